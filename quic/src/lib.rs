//! felix-quic: the Felix protocol over QUIC — frame codec (`wire`), TLS on BoringSSL (`tls`),
//! the runtime-agnostic connection core (`conn`), a glommio driver for the broker
//! (`glommio_driver`) and a tokio driver for clients (`tokio_driver`).

pub mod conn;
pub mod idmap;
pub mod server;
pub mod tls;
pub mod udp;
pub mod wire;

#[cfg(feature = "glommio-driver")]
pub mod glommio_driver;
#[cfg(feature = "tokio-driver")]
pub mod tokio_driver;

/// Largest UDP payload Felix sends or accepts (safe on loopback and typical Ethernet paths).
pub const MAX_UDP_PAYLOAD: usize = 1350;
/// Connection id length used by Felix servers.
pub const CONN_ID_LEN: usize = 16;
