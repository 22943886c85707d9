//! The forwarding side of a peer link: the shard admission that turns a request for a shard
//! another broker owns into a forward, and the driver of this core's links (`core::peer`,
//! pure): it dials, writes what the links send, feeds them what arrives, and answers the
//! clients whose forwards are done.

use super::super::admit::{shard_admit, Asker, ShardAdmit};
use super::super::peer::{FwdAnswer, FwdClient, FwdTarget, Lane, LinkEffect, Links};
use super::super::*;
use felix_quic::server::Sock;
use felix_quic::tls::node_name;
use felix_quic::wire::peer::lanes;

impl CoreState {
    /// The shard admission of every request that names a shard (publish, cache operation,
    /// group operation): `admit::shard_admit` with this session's forward head, if any.
    pub(in crate::core) fn admit_shard(
        &self,
        key: ConnKey,
        cache: bool,
        idx: u32,
        shard: u32,
    ) -> Result<ShardAdmit, Refusal> {
        let session = self.sessions.get(&key);
        let asker = Asker {
            node_id: self.s.cfg.node_id,
            forwarded: session.and_then(|s| s.forwarded.as_ref()),
            principal: session
                .and_then(|s| s.principal.as_ref())
                .map_or("", |(_, token)| token),
            links: self.links.is_some(),
            frame_bytes_max: self
                .ep
                .peek(key)
                .map_or(0, |e| e.conn.peer_max_frame_bytes() as u32),
        };
        shard_admit(&self.catalog, &asker, cache, idx, shard)
    }

    /// Hand a request to the links; a refusal (link down, full) is returned for the caller
    /// to answer (nothing was sent).
    pub(in crate::core) fn forward(
        &mut self,
        target: FwdTarget,
        inner: &Frame,
        client: FwdClient,
        lane: Lane,
        (wait, cancel): (Duration, Option<&Frame>),
    ) -> Result<(), Refusal> {
        let cluster = self.catalog.cluster_id.clone();
        let links = self
            .links
            .as_mut()
            .expect("admit_shard forwards only with links");
        links.set_cluster_id(&cluster);
        let r = links.forward(Instant::now(), target, inner, client, lane, wait, cancel);
        if r.is_ok() {
            CoreCounters::inc(&self.s.counters.forwards_sent);
        }
        self.link_effects();
        r
    }

    /// Step the links with the time (their deadlines) and carry out what they decided.
    pub(in crate::core) fn links_tick(&mut self, now: Instant) {
        if let Some(links) = self.links.as_mut() {
            links.tick(now);
            self.link_effects();
        }
    }

    pub(in crate::core) fn links_deadline(&self) -> Option<Instant> {
        self.links.as_ref().and_then(Links::next_deadline)
    }

    pub(in crate::core) fn is_link(&self, key: ConnKey) -> bool {
        self.links.as_ref().is_some_and(|l| l.is_link(key))
    }

    /// Packets arrived on a link this core dialed.
    pub(in crate::core) fn after_link_recv(&mut self, key: ConnKey) {
        let mut events = Vec::new();
        let established = {
            let Some(e) = self.ep.get(key) else { return };
            e.conn.poll_readable(&mut events);
            e.conn.is_established()
        };
        let now = Instant::now();
        let links = self.links.as_mut().expect("is_link");
        if established {
            links.on_established(key);
        }
        for ev in events {
            match ev {
                ConnEvent::Frame { frame, .. } => links.on_frame(now, key, frame),
                ConnEvent::BadFrame { error, .. } => {
                    if let Some(id) = error.request_id {
                        links.on_bad_answer(key, id, error.error.to_string());
                    }
                }
                _ => {}
            }
        }
        self.link_effects();
        self.ep.mark_dirty(key);
    }

    /// A client's long poll forwarded to an owner is cancelled: false when none waits.
    pub(in crate::core) fn cancel_forwarded_poll(&mut self, conn: ConnKey, rid: u64) -> bool {
        let Some(links) = self.links.as_mut() else {
            return false;
        };
        let found = links.cancel_poll(conn, rid);
        if found {
            CoreCounters::inc(&self.s.counters.forwards_cancelled);
        }
        self.link_effects();
        found
    }

    /// The broker starts draining: its own long polls are answered at once; those it
    /// forwarded are cancelled at their owners, so their answers (and the drain) come now.
    pub(in crate::core) fn links_drain(&mut self) {
        if let Some(links) = self.links.as_mut() {
            let n = links.cancel_all_polls();
            CoreCounters::add(&self.s.counters.forwards_cancelled, n);
            self.link_effects();
        }
    }

    /// A client connection closed: cancel its long polls at their owners.
    pub(in crate::core) fn links_conn_closed(&mut self, conn: ConnKey) {
        if let Some(links) = self.links.as_mut() {
            let n = links.conn_closed(conn);
            CoreCounters::add(&self.s.counters.forwards_cancelled, n);
            self.link_effects();
        }
    }

    /// A link this core dialed closed.
    pub(in crate::core) fn on_link_closed(&mut self, key: ConnKey, why: String) {
        if let Some(links) = self.links.as_mut() {
            links.on_closed(Instant::now(), key, why);
            self.link_effects();
        }
    }

    /// Carry out the links' effects (answers may make more: a loop until none are left).
    pub(in crate::core) fn link_effects(&mut self) {
        loop {
            let Some(links) = self.links.as_mut() else {
                return;
            };
            let effects = links.drain_effects();
            if effects.is_empty() {
                return;
            }
            for effect in effects {
                self.link_effect(effect);
            }
        }
    }

    fn link_effect(&mut self, effect: LinkEffect) {
        match effect {
            LinkEffect::Dial { node, addr } => {
                let r = self.ep.connect(&node_name(node), addr);
                let links = self.links.as_mut().expect("links made the effect");
                match r {
                    Ok(key) => {
                        CoreCounters::inc(&self.s.counters.peer_dials);
                        links.on_dialed(node, key);
                    }
                    Err(why) => links.on_dial_failed(Instant::now(), node, why),
                }
            }
            LinkEffect::Send { key, lane, bytes } => {
                let (stream, urgency) = match lane {
                    Lane::Control => (lanes::CONTROL_STREAM, None),
                    Lane::Publish => (lanes::PUBLISH_STREAM, Some(lanes::PUBLISH_URGENCY)),
                    Lane::Replication => {
                        (lanes::REPLICATION_STREAM, Some(lanes::REPLICATION_URGENCY))
                    }
                };
                if let Some(e) = self.ep.get(key) {
                    if let Some(u) = urgency {
                        // Set on every send: quiche refuses it before the handshake gave the
                        // stream room, and it costs a lookup once the stream exists.
                        e.conn.set_urgency(stream, u);
                    }
                    e.conn.send_bytes(stream, bytes);
                    self.ep.mark_dirty(key);
                }
            }
            LinkEffect::Close { key } => {
                if let Some(e) = self.ep.get(key) {
                    e.conn.close(
                        ErrorCode::Unavailable.number() as u64,
                        "peer link timed out",
                    );
                    self.ep.mark_dirty(key);
                }
            }
            LinkEffect::Answer {
                client,
                answer,
                node,
            } => self.answer_forward(client, *answer, node),
        }
    }

    /// Answer the client of a finished forward.
    fn answer_forward(&mut self, client: FwdClient, answer: FwdAnswer, node: u64) {
        match client {
            FwdClient::Publish(origin) => {
                let result = match answer {
                    FwdAnswer::Frame(
                        Frame::PublishAck {
                            shard,
                            first_offset,
                            count,
                            ..
                        },
                        _,
                    ) => Ok((shard, first_offset, count)),
                    FwdAnswer::Frame(Frame::Error { code, message, .. }, _) => Err(Refusal::new(
                        ErrorCode::from_number(code).unwrap_or(ErrorCode::Internal),
                        message,
                    )),
                    FwdAnswer::Frame(other, _) => Err(Refusal::new(
                        ErrorCode::Internal,
                        format!(
                            "the owner answered a forwarded publish with {}",
                            streams::kind_name(other.kind())
                        ),
                    )),
                    FwdAnswer::Refused(r) => Err(r),
                };
                if result.is_err() {
                    CoreCounters::inc(&self.s.counters.forwards_refused);
                }
                self.on_publish_result(origin, result, node);
            }
            FwdClient::Request {
                conn,
                stream,
                request_id,
                cache,
            } => {
                if let (true, Some(sess)) = (cache, self.sessions.get_mut(&conn)) {
                    sess.cache_inflight = sess.cache_inflight.saturating_sub(1);
                }
                let Some(e) = self.ep.get(conn) else { return };
                match answer {
                    FwdAnswer::Frame(_, bytes) if bytes.len() <= e.conn.peer_max_frame_bytes() => {
                        e.conn.send_bytes(stream, bytes)
                    }
                    FwdAnswer::Frame(_, bytes) => e.conn.send_frame(
                        stream,
                        &Frame::error(
                            request_id,
                            ErrorCode::FrameTooLarge,
                            format!(
                                "the owner's answer is {} bytes, over this connection's max_frame_bytes {}",
                                bytes.len(),
                                e.conn.peer_max_frame_bytes()
                            ),
                        ),
                    ),
                    FwdAnswer::Refused(r) => {
                        CoreCounters::inc(&self.s.counters.forwards_refused);
                        e.conn.send_frame(stream, &r.frame(request_id))
                    }
                }
                self.ep.mark_dirty(conn);
            }
        }
    }

    /// Whether a connection came in on the peer listener (another broker).
    pub(in crate::core) fn on_peer_listener(&self, key: ConnKey) -> bool {
        self.ep
            .peek(key)
            .is_some_and(|e| e.sock == Sock::PeerListen)
    }
}
