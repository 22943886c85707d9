//! felix-broker: the thread-per-core runtime.
//!
//! Executors pinned to the CPUs the process may use, each with its own SO_REUSEPORT UDP socket
//! and QUIC endpoint; ephemeral pub/sub with shard owners, replay rings and per-subscriber
//! queues (`fanout`, pure) driven by `core`; durable shards on felix-storage logs; caches
//! (`cache`, pure; driven by `core::caches`, in memory or log-backed); consumer groups
//! (`group`, pure; driven by `core::groups`); the catalog either standalone or followed from
//! the control plane by the ops thread (`control_link`).

pub mod auth;
pub mod cache;
pub mod catalog;
pub mod config;
pub mod control_link;
pub mod core;
pub mod fanout;
pub mod group;
pub mod inspect;
pub mod metrics;
pub mod replica_reports;
pub mod storage_identity;
