//! Metadata stores behind one seam: the catalog state machine, applied either directly (memory)
//! or through an openraft group ([`crate::raft`]). Reads are served from the local copy.

use crate::api::{ApiError, ClusterStatus};
use crate::catalog::{Catalog, Command, Outcome};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use tokio::sync::watch;

pub mod memory;

pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// The local catalog copy plus a revision signal for long-polls.
pub struct Shared {
    catalog: RwLock<Catalog>,
    rev: watch::Sender<u64>,
}

impl Shared {
    pub fn new(c: Catalog) -> Arc<Self> {
        let (rev, _) = watch::channel(c.revision());
        Arc::new(Shared {
            catalog: RwLock::new(c),
            rev,
        })
    }

    pub fn read<R>(&self, f: impl FnOnce(&Catalog) -> R) -> R {
        f(&self.catalog.read().unwrap_or_else(|e| e.into_inner()))
    }

    pub fn apply(&self, cmd: &Command) -> Outcome {
        let mut c = self.catalog.write().unwrap_or_else(|e| e.into_inner());
        let out = c.apply(cmd);
        let r = c.revision();
        drop(c);
        self.rev.send_replace(r);
        out
    }

    pub fn replace(&self, c: Catalog) {
        let r = c.revision();
        *self.catalog.write().unwrap_or_else(|e| e.into_inner()) = c;
        self.rev.send_replace(r);
    }

    pub fn watch(&self) -> watch::Receiver<u64> {
        self.rev.subscribe()
    }
}

/// Where a write or heartbeat must go.
pub enum Route {
    /// This node decides.
    Local,
    /// Send it to the leader's REST listener at this address.
    Leader(String),
    /// No leader known now.
    NoLeader,
}

pub trait MetadataStore: Send + Sync + 'static {
    fn shared(&self) -> &Arc<Shared>;
    /// Commit a command (on the leader; a follower forwards it) and answer its outcome.
    fn write(&self, cmd: Command) -> BoxFut<'_, Outcome>;
    /// Apply a write only if this node is the leader (the receiving end of a forward).
    fn write_local(&self, cmd: Command) -> BoxFut<'_, Outcome>;
    fn status(&self) -> ClusterStatus;
    /// Where leader-only work (heartbeats) goes.
    fn route(&self) -> Route;
    /// Readiness beyond `status().ready` (e.g. the leader answers); default: status.
    fn ready(&self) -> BoxFut<'_, Result<(), ApiError>>;
    /// Flush and stop.
    fn shutdown(&self) -> BoxFut<'_, ()>;
}
