//! felix-broker: the thread-per-core runtime.
//!
//! Executors pinned one per core, each with its own SO_REUSEPORT UDP socket and QUIC
//! endpoint; ephemeral pub/sub with shard owners, replay rings and per-subscriber queues
//! (`fanout`, pure) driven by `core`. Not yet: durable shards (felix-storage), the control
//! plane, caches and queues.

pub mod catalog;
pub mod config;
pub mod core;
pub mod dma;
pub mod fanout;
pub mod metrics;
