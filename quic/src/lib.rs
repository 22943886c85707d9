//! felix-quic: the Felix protocol over QUIC.
pub mod wire;
