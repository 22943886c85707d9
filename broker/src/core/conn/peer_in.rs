//! The owner side of a peer link: a connection that came in on the peer listener is another
//! broker. It starts with `PeerHello` (its node id must be the one its TLS certificate
//! names, its cluster ours), then sends only `Forward`s. A forward's inner request passes the
//! same admission and handlers as a client's, with the forward's head in the session, so
//! the shard admission checks the incarnation and generation and never forwards it again.

use super::super::*;
use felix_quic::tls::{cert_dns_names, node_name};
use felix_quic::wire::cache::CacheFrame;
use felix_quic::wire::peer::lanes;
use felix_quic::wire::replica::{ReplicaMsg, ShardRef, ShippedRecord};
use felix_quic::wire::{peer, ForwardHead, PeerFrame};

impl CoreState {
    /// Take a peer's hello, or close the link with why it is refused.
    pub(in crate::core) fn on_peer_hello(
        &mut self,
        key: ConnKey,
        stream: u64,
        node_id: u64,
        cluster_id: String,
        capabilities: u64,
        peer_max_frame_bytes: u32,
    ) {
        let cfg = self.s.cfg.clone();
        let names = self
            .ep
            .peek(key)
            .and_then(|e| e.conn.quic().peer_cert().map(cert_dns_names))
            .unwrap_or_default();
        let refusal = if !names.contains(&node_name(node_id)) {
            Some(format!(
                "PeerHello names node {node_id}, but the link's certificate names {names:?}: a broker speaks only for the node its certificate names"
            ))
        } else if node_id == cfg.node_id {
            Some(format!(
                "PeerHello from node {node_id}, which is this broker's own id"
            ))
        } else if !self.catalog.cluster_id.is_empty() && cluster_id != self.catalog.cluster_id {
            Some(format!(
                "PeerHello names cluster {cluster_id:?}, this broker is in {:?}",
                self.catalog.cluster_id
            ))
        } else if (peer_max_frame_bytes as usize)
            < cfg.max_payload_bytes as usize + FRAME_OVERHEAD_BYTES
        {
            Some(format!(
                "PeerHello.max_frame_bytes {peer_max_frame_bytes} cannot carry every record this broker accepts"
            ))
        } else {
            None
        };
        if let Some(msg) = refusal {
            CoreCounters::inc(&self.s.counters.peer_links_refused);
            tracing::warn!(node_id, %msg, "peer link refused");
            self.close_with(key, stream, ErrorCode::InvalidRequest, msg);
            return;
        }
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        session.hello_done = true;
        session.peer_node = Some(node_id);
        session.features = capabilities & peer::capabilities::ALL;
        CoreCounters::inc(&self.s.counters.peer_links_accepted);
        let ok = Frame::Peer(PeerFrame::PeerHelloOk {
            node_id: cfg.node_id,
            cluster_id: self.catalog.cluster_id.clone(),
            capabilities: session.features,
            max_frame_bytes: cfg.max_frame_bytes as u32,
        });
        if let Some(e) = self.ep.get(key) {
            e.conn
                .set_peer_max_frame_bytes(peer_max_frame_bytes as usize);
            e.conn.send_frame(stream, &ok);
        }
    }

    /// A replica message from the broker at the other end of link `key`: taken only on a link
    /// that negotiated replication and only for the dialer itself (a broker speaks for the
    /// node its certificate names), then routed to the shard's owner core. One naming a
    /// stream incarnation or shard this broker does not know is dropped and counted: the
    /// protocol tolerates loss, and its sender tries again or is deposed.
    pub(in crate::core) fn on_replicate(
        &mut self,
        key: ConnKey,
        stream: u64,
        shard: ShardRef,
        msg: ReplicaMsg,
        records: Vec<ShippedRecord>,
    ) {
        let Some(session) = self.sessions.get(&key) else {
            return;
        };
        let peer_node = session.peer_node;
        let refusal = if session.features & peer::capabilities::REPLICATION == 0 {
            Some("Replicate on a peer link that did not negotiate replication (PeerHello capability bit 1)".to_string())
        } else if peer_node != Some(msg.sender()) {
            Some(format!(
                "Replicate on node {}'s link names node {} as its sender: a broker speaks only for itself",
                peer_node.unwrap_or(0),
                msg.sender()
            ))
        } else {
            None
        };
        if let Some(why) = refusal {
            CoreCounters::inc(&self.s.counters.replica_msgs_refused);
            tracing::warn!(?peer_node, %why, "replica message refused");
            self.send_err(key, stream, 0, ErrorCode::InvalidRequest, why);
            return;
        }
        let known = self
            .catalog
            .lookup(&shard.stream)
            .ok()
            .map(|(i, _)| i as u32);
        let Some(idx) = known.filter(|&i| {
            let slot = self.catalog.slot(i);
            slot.incarnation == shard.incarnation && shard.shard < slot.def.shards
        }) else {
            CoreCounters::inc(&self.s.counters.replica_msgs_stale);
            return;
        };
        CoreCounters::inc(&self.s.counters.replica_msgs_routed);
        let owner = self.owner_core(idx, shard.shard);
        let from = msg.sender();
        self.route(
            owner,
            MeshMsg::Owner(ToOwner::Replica {
                stream: idx,
                shard: shard.shard,
                from,
                msg,
                records,
            }),
        );
    }

    /// Serve a forwarded request as if its client had sent it here, under the forward's head.
    pub(in crate::core) fn on_forward(
        &mut self,
        key: ConnKey,
        stream: u64,
        head: ForwardHead,
        inner: Frame,
    ) {
        let forwardable = matches!(
            inner,
            Frame::Publish { .. }
                | Frame::Group(_)
                | Frame::Cache(
                    CacheFrame::CachePut { .. }
                        | CacheFrame::CacheGet { .. }
                        | CacheFrame::CacheDelete { .. }
                        | CacheFrame::CounterAdd { .. }
                        | CacheFrame::CounterGet { .. }
                )
        );
        if !forwardable {
            let rid = inner.request_id().unwrap_or(0);
            let msg = format!(
                "{} is not forwarded between brokers (subscriptions and watches go to the owner; describes are answered by any broker)",
                streams::kind_name(inner.kind())
            );
            self.send_err(
                key,
                answer_stream(stream),
                rid,
                ErrorCode::InvalidRequest,
                msg,
            );
            return;
        }
        CoreCounters::inc(&self.s.counters.forwards_served);
        if stream == lanes::PUBLISH_STREAM {
            // The answers to forwarded publishes go back at their lane's urgency too, so that
            // this broker's own replication traffic on the link is never queued behind them.
            if let Some(e) = self.ep.get(key) {
                e.conn.set_urgency(stream, lanes::PUBLISH_URGENCY);
            }
        }
        if let Some(s) = self.sessions.get_mut(&key) {
            s.forwarded = Some(head);
        }
        self.dispatch(key, stream, inner);
        if let Some(s) = self.sessions.get_mut(&key) {
            s.forwarded = None;
        }
    }
}
