//! felix-broker: the thread-per-core runtime.
//!
//! **State of this crate (first landing):** executors pinned one per core, each with its own
//! SO_REUSEPORT UDP socket and QUIC endpoint, the dev TLS certificate, the Felix handshake,
//! `DescribeStream` against the catalog, typed refusals for malformed frames, and packets for
//! another core's connection forwarded over the core mesh. Publish and Subscribe are answered
//! with the typed error `unsupported` until the shard runtime lands (issue 2 stays open).

pub mod catalog;
pub mod config;
pub mod core;
pub mod dma;
pub mod fanout;
pub mod metrics;
