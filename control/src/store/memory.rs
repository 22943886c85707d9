//! The in-memory store: the state machine applied directly. Gone at exit.

use super::{BoxFut, MetadataStore, Route, Shared};
use crate::api::{ApiError, ClusterStatus};
use crate::catalog::{Catalog, Command, Limits, Outcome};
use felix_quic::wire::ErrorCode;
use std::sync::Arc;

pub struct MemoryStore {
    shared: Arc<Shared>,
}

impl MemoryStore {
    /// `hold_placement`: start in the placement settle window (the sweep ends it).
    pub fn new(limits: Limits, hold_placement: bool) -> Self {
        let shared = Shared::new(Catalog::new(limits));
        let id = format!("mem-{:016x}", rand::random::<u64>());
        let _ = shared.apply(&Command::Init {
            catalog_id: id,
            hold_placement,
        });
        MemoryStore { shared }
    }
}

impl MetadataStore for MemoryStore {
    fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    fn write(&self, cmd: Command) -> BoxFut<'_, Outcome> {
        Box::pin(async move { self.shared.apply(&cmd) })
    }

    fn write_local(&self, cmd: Command) -> BoxFut<'_, Outcome> {
        self.write(cmd)
    }

    fn status(&self) -> ClusterStatus {
        ClusterStatus {
            store: "memory".into(),
            node_id: 0,
            ready: true,
            is_leader: true,
            leader: Some(0),
            voters: vec![],
            learners: vec![],
            catalog_revision: self.shared.read(|c| c.revision()),
            term: 0,
            applied_index: 0,
            members: vec![],
        }
    }

    fn route(&self) -> Route {
        Route::Local
    }

    fn ready(&self) -> BoxFut<'_, Result<(), ApiError>> {
        Box::pin(async move {
            if self.shared.read(|c| c.initialized()) {
                Ok(())
            } else {
                Err(ApiError::new(
                    ErrorCode::Unavailable,
                    "catalog not initialized",
                ))
            }
        })
    }

    fn shutdown(&self) -> BoxFut<'_, ()> {
        Box::pin(async {})
    }
}
