//! The shard admission decision, pure: given the catalog this broker holds and who is asking,
//! serve a request for a shard here, forward it to the owner, or refuse it. Every request
//! that names a shard passes it (`CoreState::admit_shard` is its driver side), and the
//! cluster simulator (`sim::cluster`) runs the same function for each simulated broker, so
//! "a forward is never forwarded again" is checked across catalogs that disagree.

use super::peer::FwdTarget;
use crate::catalog::Catalog;
use crate::core::Refusal;
use felix_quic::wire::{ErrorCode, ForwardHead};

/// What the shard admission decided for a request.
pub(in crate::core) enum ShardAdmit {
    /// This broker owns the shard: serve it here.
    Serve,
    /// Another broker owns it: forward it there.
    Forward(FwdTarget),
}

/// Who asks, as the admission needs to know it.
pub(in crate::core) struct Asker<'a> {
    /// This broker's node id (the forward's origin).
    pub node_id: u64,
    /// The head of the forward this request came in, when another broker forwarded it.
    pub forwarded: Option<&'a ForwardHead>,
    /// This broker has peer links (it can forward at all).
    pub links: bool,
    /// The largest frame the asking client takes (carried in the forward).
    pub frame_bytes_max: u32,
    /// The asking client's token (auth on; empty otherwise), carried in the forward so the
    /// owner checks the same principal.
    pub principal: &'a str,
}

/// The decision for shard `shard` of stream (or, with `cache`, cache) slot `idx`.
///
/// - A forwarded request is served only if this broker owns the shard at the generation and
///   incarnation the forwarder routed by; it is never forwarded again (`not_leader`,
///   `conflict`), so two brokers that disagree during a move cannot bounce it.
/// - A client's request for a shard placed on another live broker with a peer listener is
///   forwarded there, when this broker has peer links.
/// - Otherwise the catalog's refusal stands (`not_leader` naming the owner, ...).
pub(in crate::core) fn shard_admit(
    catalog: &Catalog,
    asker: &Asker,
    cache: bool,
    idx: u32,
    shard: u32,
) -> Result<ShardAdmit, Refusal> {
    if let Some(head) = asker.forwarded.filter(|_| !breaks::forward_again()) {
        catalog.forward_check(cache, idx, shard, head.incarnation, head.generation)?;
        return Ok(ShardAdmit::Serve);
    }
    let checked = if cache {
        catalog.cache_serve_check(idx, shard)
    } else {
        catalog.serve_check(idx, shard)
    };
    match checked {
        Ok(()) => Ok(ShardAdmit::Serve),
        Err((ErrorCode::NotLeader, msg)) if asker.links => {
            match catalog.forward_target(cache, idx, shard) {
                Some((node, addr, incarnation, generation)) => Ok(ShardAdmit::Forward(FwdTarget {
                    node,
                    addr,
                    head: ForwardHead {
                        incarnation,
                        generation,
                        origin_node: asker.node_id,
                        principal: asker.principal.to_string(),
                        frame_bytes_max: asker.frame_bytes_max,
                    },
                })),
                None => Err(Refusal::new(ErrorCode::NotLeader, msg)),
            }
        }
        Err(e) => Err(e.into()),
    }
}

/// Test-build switch that breaks the rule, for the cluster simulator's negative twin.
pub(crate) mod breaks {
    #[cfg(test)]
    pub(crate) static FORWARD_AGAIN: std::sync::atomic::AtomicBool =
        std::sync::atomic::AtomicBool::new(false);

    /// A forwarded request is admitted as if a client had sent it (and so forwarded again
    /// when this broker's catalog names another owner).
    #[inline]
    pub(super) fn forward_again() -> bool {
        #[cfg(test)]
        return FORWARD_AGAIN.load(std::sync::atomic::Ordering::Relaxed);
        #[cfg(not(test))]
        false
    }
}
