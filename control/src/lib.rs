//! Felix control plane.
//!
//! * [`api`] — the REST API's JSON shapes (usable without the server).
//! * [`catalog`] — the deterministic catalog state machine: commands, revisions, the bounded
//!   change ring, validation.
//! * [`placement`] — which broker owns each shard (pure).
//! * [`replication`] — placement's side of shard replication: generations, reports,
//!   promotion (pure), and the types brokers exchange with it.
//! * `store`, `server`, `raft` (feature `server`) — the metadata stores behind one trait, the
//!   axum REST server with its OpenAPI document, and the openraft adapters.

pub mod api;
pub mod auth;
#[cfg(feature = "ca-bundle")]
pub mod ca_bundle;
pub mod catalog;
pub mod docs;
pub mod placement;
pub mod replication;

#[cfg(feature = "server")]
pub mod config;
#[cfg(feature = "server")]
pub mod https;
#[cfg(feature = "server")]
pub mod linger;
#[cfg(feature = "server")]
pub mod raft;
#[cfg(feature = "server")]
pub mod server;
#[cfg(feature = "server")]
pub mod store;
