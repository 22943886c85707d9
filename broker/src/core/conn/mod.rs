//! The connection side of a core: sessions, the admission of every frame (which stream
//! carries what, before Hello, the Hello itself), refusals and their bounds, closes, and the
//! requests that start publishes and subscriptions. Subscription delivery is `subs`.

use super::*;

mod auth;
pub(in crate::core) mod checks;
mod deliver;
mod peer_in;
mod peer_out;
pub(in crate::core) use super::admit::ShardAdmit;
pub(in crate::core) mod subs;
pub(in crate::core) mod watches;

/// Refusals queued on one answer stream past this stop the reading of the stream that caused
/// them until they drain: refused frames are cheap to send, and a peer that does not read its
/// answers must not grow the broker's memory.
pub(in crate::core) const REFUSALS_QUEUED_BYTES_MAX: usize = 1 << 20;

/// A shard count in words for people: "shard 0" or "shards 0–3" (0..n in Rust reads wrong).
pub(crate) fn shard_range(shards: u32) -> String {
    match shards {
        0 => "no shards".into(),
        1 => "only shard 0".into(),
        n => format!("shards 0–{}", n - 1),
    }
}

/// The conformance suite's negative twin: in debug builds only, `FELIX_TEST_BREAK_RULE=
/// publish-on-control` serves a Publish on the control stream, breaking one row of the
/// conformance table so `broker/tests/conformance.rs` can show it catches the break.
#[cfg(debug_assertions)]
pub(in crate::core) fn broken_for_tests(v: Verdict, kind: u8, stream: u64) -> Verdict {
    static BREAK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *BREAK.get_or_init(|| {
        std::env::var("FELIX_TEST_BREAK_RULE").is_ok_and(|r| r == "publish-on-control")
    });
    if on && kind == felix_quic::wire::kind::PUBLISH && stream == 0 {
        return Verdict::Serve;
    }
    v
}

#[cfg(not(debug_assertions))]
pub(in crate::core) fn broken_for_tests(v: Verdict, _kind: u8, _stream: u64) -> Verdict {
    v
}

impl CoreState {
    pub(in crate::core) fn on_conn_closed(&mut self, key: ConnKey) {
        self.links_conn_closed(key);
        if let Some(session) = self.sessions.remove(&key) {
            for sid in session.subs {
                self.remove_sub(sid, None);
            }
            self.watches_conn_closed(key, session.watches);
            self.group_conn_closed(key, session.long_polls);
        }
    }

    pub(in crate::core) fn after_recv(&mut self, key: ConnKey, new: bool) {
        if self.is_link(key) {
            return self.after_link_recv(key);
        }
        if new {
            CoreCounters::inc(&self.s.counters.connections_accepted);
            let session = Session {
                peer_link: self.on_peer_listener(key),
                ..Session::default()
            };
            self.sessions.insert(key, session);
            let wait_ms = self.hello_wait_ms();
            let deadline = Instant::now() + Duration::from_millis(wait_ms);
            self.hello_waits.push_back((deadline, key));
        }
        let mut events = Vec::new();
        let Some(e) = self.ep.get(key) else { return };
        e.conn.poll_readable(&mut events);
        for ev in events {
            self.on_event(key, ev);
        }
        // Streams quiche could not take earlier may have room now (peer acked, window grew).
        self.ep.mark_dirty(key);
    }

    /// Take a Hello: record the client's frame maximum and answer HelloOk, or refuse a maximum
    /// that could not carry every record this broker accepts and close.
    pub(in crate::core) fn on_hello(
        &mut self,
        key: ConnKey,
        stream: u64,
        f: u64,
        peer_max_frame_bytes: u32,
    ) {
        let cfg = self.s.cfg.clone();
        let floor = cfg.max_payload_bytes as usize + FRAME_OVERHEAD_BYTES;
        if (peer_max_frame_bytes as usize) < floor {
            let msg = format!(
                "Hello.max_frame_bytes {peer_max_frame_bytes} is below {floor}, the smallest frame that carries every record this broker accepts (max_payload_bytes {} + {FRAME_OVERHEAD_BYTES}); the connection is closed",
                cfg.max_payload_bytes
            );
            self.close_with(key, stream, ErrorCode::InvalidRequest, msg);
            return;
        }
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        session.hello_done = true;
        session.features = f & features::ALL;
        let hello = Frame::HelloOk {
            features: session.features,
            limits: Limits {
                max_frame_bytes: cfg.max_frame_bytes as u32,
                max_payload_bytes: cfg.max_payload_bytes,
                max_subscriptions: cfg.max_subscriptions,
                max_key_bytes: cfg.cache_key_bytes_max,
            },
            core: self.id as u16,
            server: concat!("felix-broker/", env!("CARGO_PKG_VERSION")).into(),
        };
        if let Some(e) = self.ep.get(key) {
            // Each side sends at most the other's maximum.
            e.conn
                .set_peer_max_frame_bytes(peer_max_frame_bytes as usize);
            e.conn.send_frame(stream, &hello);
        }
    }

    /// Answer a frame that could not be taken off `stream`.
    pub(in crate::core) fn on_bad_frame(&mut self, key: ConnKey, stream: u64, err: FrameError) {
        let code = err.error.code();
        let what = match err.kind {
            Some(k) => format!("{}: {}", streams::kind_name(k), err.error),
            None => err.error.to_string(),
        };
        if err.fatal && stream == 0 {
            // Nothing more can be read on the control stream and a client cannot open
            // another, so no request could be made on this connection again: end it.
            let msg = format!(
                "{what}; the control stream's framing is lost, so the connection is closed"
            );
            self.close_with(key, 0, code, msg);
            return;
        }
        let msg = if err.truncated_at_end {
            format!("{what}; the stream ended inside a frame")
        } else if err.fatal {
            format!("{what}; the stream's framing is lost and the stream was stopped")
        } else if code == ErrorCode::FrameTooLarge {
            format!("{what}; the frame is discarded and the stream goes on")
        } else {
            format!("{what}; the frame was skipped and the stream goes on")
        };
        self.send_err(
            key,
            answer_stream(stream),
            err.request_id.unwrap_or(0),
            code,
            msg,
        );
        if !err.fatal {
            self.hold_if_unread(key, stream, answer_stream(stream));
        }
    }

    /// How long a new connection has for its Hello: `hello_timeout_ms`, or the idle timeout
    /// when that is shorter (0 means no idle timeout to quiche, so it does not count).
    pub(in crate::core) fn hello_wait_ms(&self) -> u64 {
        let cfg = &self.s.cfg;
        match cfg.idle_timeout_ms {
            0 => cfg.hello_timeout_ms,
            idle => cfg.hello_timeout_ms.min(idle),
        }
    }

    /// Send `Error code msg` on `stream`, then close the connection with the code's number as
    /// the QUIC application error and the same text as the reason. Once per connection: what
    /// it sends afterwards is ignored. The close waits for the Error frame to leave, at most
    /// `CLOSE_GRACE` (a peer that grants no flow control cannot hold the connection open).
    pub(in crate::core) fn close_with(
        &mut self,
        key: ConnKey,
        stream: u64,
        code: ErrorCode,
        msg: String,
    ) {
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        if std::mem::replace(&mut session.closing, true) {
            return;
        }
        CoreCounters::inc(&self.s.counters.connections_closed_hello);
        tracing::debug!(conn = key, code = code.name(), "{msg}");
        self.send_err(key, stream, 0, code, msg.clone());
        if let Some(e) = self.ep.get(key) {
            e.conn
                .close_after_flush(code.number() as u64, &format!("{}: {msg}", code.name()));
        }
        self.closes_due
            .push_back((Instant::now() + timers::CLOSE_GRACE, key));
        self.ep.mark_dirty(key);
    }

    /// Force the closes whose Error frame could not leave within `CLOSE_GRACE`.
    pub(in crate::core) fn force_due_closes(&mut self, now: Instant) {
        while let Some(&(at, key)) = self.closes_due.front() {
            if at > now {
                break;
            }
            self.closes_due.pop_front();
            if let Some(e) = self.ep.get(key) {
                e.conn.close_pending_now();
                self.ep.mark_dirty(key);
            }
        }
    }

    /// Close the connections that said no Hello within `hello_timeout_ms` or, with auth on,
    /// presented no token by then.
    pub(in crate::core) fn expire_hellos(&mut self, now: Instant) {
        self.force_due_closes(now);
        while let Some(&(at, key)) = self.hello_waits.front() {
            if at > now {
                break;
            }
            self.hello_waits.pop_front();
            let Some(s) = self.sessions.get(&key) else {
                continue;
            };
            let ms = self.hello_wait_ms();
            if !s.hello_done {
                let msg = format!("no Hello within {ms} ms (hello_timeout_ms) of the connection's first packet; the connection is closed");
                self.close_with(key, 0, ErrorCode::InvalidRequest, msg);
            } else if self.s.auth.is_some()
                && !s.peer_link
                && s.principal.is_none()
                && s.revoked.is_none()
            {
                // With auth on nothing is served without a token, so a connection that never
                // authenticates only holds a slot: the same deadline covers Authenticate.
                let msg = format!("no Authenticate within {ms} ms (hello_timeout_ms) of the connection's first packet, and auth is on; the connection is closed");
                self.close_with(key, 0, ErrorCode::Unauthenticated, msg);
            }
        }
    }

    /// After a refusal of a frame from `source` answered on `answer`: stop reading `source`
    /// while `answer` holds more than `REFUSALS_QUEUED_BYTES_MAX` (see `release_held`).
    pub(in crate::core) fn hold_if_unread(&mut self, key: ConnKey, source: u64, answer: u64) {
        let Some(e) = self.ep.get(key) else { return };
        if e.conn.queued_bytes(answer) <= REFUSALS_QUEUED_BYTES_MAX {
            return;
        }
        e.conn.pause(source);
        if let Some(s) = self.sessions.get_mut(&key) {
            let held = s.held_sources.entry(answer).or_default();
            if !held.contains(&source) {
                held.push(source);
            }
        }
    }

    /// Resume the streams held for answer streams that just drained, and take what they hold.
    pub(in crate::core) fn release_held(&mut self, key: ConnKey, drained: &[u64]) {
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        if session.held_sources.is_empty() {
            return;
        }
        let release: Vec<u64> = drained
            .iter()
            .filter_map(|d| session.held_sources.remove(d))
            .flatten()
            .collect();
        let mut events = Vec::new();
        if let Some(e) = self.ep.get(key) {
            for s in release {
                e.conn.resume(s);
                e.conn.read_stream(s, &mut events);
            }
        }
        for ev in events {
            self.on_event(key, ev);
        }
    }

    pub(in crate::core) fn send_err(
        &mut self,
        key: ConnKey,
        stream: u64,
        rid: u64,
        code: ErrorCode,
        msg: String,
    ) {
        CoreCounters::inc(&self.s.counters.errors_sent);
        if let Some(e) = self.ep.get(key) {
            e.conn.send_frame(stream, &Frame::error(rid, code, msg));
        }
    }

    /// Everything a connection's streams produced: whole frames go through admission, then to
    /// their handler; frames that could not be taken are answered; a finished publisher stream
    /// is finished on our side once its last answer is queued.
    pub(in crate::core) fn on_event(&mut self, key: ConnKey, ev: ConnEvent) {
        match ev {
            ConnEvent::Frame { stream, frame } => {
                CoreCounters::inc(&self.s.counters.frames_received);
                if self.admit_frame(key, stream, &frame) {
                    self.dispatch(key, stream, frame);
                }
            }
            ConnEvent::BadFrame { stream, error } => {
                CoreCounters::inc(&self.s.counters.bad_frames);
                if self.sessions.get(&key).is_some_and(|s| !s.closing) {
                    self.on_bad_frame(key, stream, error);
                }
            }
            ConnEvent::Finished { stream } => self.on_stream_finished(key, stream),
            ConnEvent::Reset { stream, .. } => {
                // A publisher stream the client abandoned has nothing more to end. Its
                // pending answers still count down (and are dropped by QUIC).
                if let Some(s) = self.sessions.get_mut(&key) {
                    if s.pub_streams.get(&stream).is_some_and(|p| p.pending == 0) {
                        s.pub_streams.remove(&stream);
                    }
                }
            }
        }
    }

    /// Admission: the one place every frame passes before anything acts on it (which stream
    /// carries what, before Hello, a closing connection; auth and forwarding will hang here).
    /// False when the frame was skipped or refused (and answered).
    fn admit_frame(&mut self, key: ConnKey, stream: u64, frame: &Frame) -> bool {
        let Some(session) = self.sessions.get(&key) else {
            return false;
        };
        if session.closing {
            return false; // answered and closing: nothing more is taken
        }
        // Which stream carries what (docs/protocol.md, conformance table); on the peer
        // listener, the peer link's own rules, then the forwarded request's as a client's.
        let verdict = if session.peer_link {
            match (admit_peer(frame.kind(), stream, session.hello_done), frame) {
                (Verdict::Serve, Frame::Peer(PeerFrame::Forward { inner, .. })) => {
                    let ack = matches!(**inner, Frame::Publish { ack: true, .. });
                    admit(inner.kind(), stream, ack, true)
                }
                (v, _) => v,
            }
        } else {
            let ack = matches!(frame, Frame::Publish { ack: true, .. });
            admit(frame.kind(), stream, ack, session.hello_done)
        };
        let verdict = match broken_for_tests(verdict, frame.kind(), stream) {
            // Who may: the principal's permission (auth on), after the stream rules.
            Verdict::Serve => match self.authorize(key, frame) {
                Ok(()) => return true,
                Err(Refusal { code, message }) => {
                    CoreCounters::inc(&self.s.counters.auth_denied);
                    Verdict::Refuse {
                        answer_on: answer_stream(stream),
                        code,
                        message,
                    }
                }
            },
            other => other,
        };
        match verdict {
            Verdict::Serve => true,
            Verdict::Skip => false,
            Verdict::Refuse {
                answer_on,
                code,
                message,
            } => {
                CoreCounters::inc(&self.s.counters.frames_refused);
                // A refused request is named by its id; a broker-only frame is no request of
                // the client's, so its refusal carries 0.
                let rid = match streams::kind_info(frame.kind()) {
                    Some((_, streams::Placement::BrokerOnly)) => 0,
                    _ => frame.request_id().unwrap_or(0),
                };
                self.send_err(key, answer_on, rid, code, message);
                self.hold_if_unread(key, stream, answer_on);
                false
            }
        }
    }

    /// DescribeStream and DescribeCluster: answered from this broker's catalog.
    fn on_describe(&mut self, key: ConnKey, stream: u64, frame: Frame) {
        let reply = match frame {
            Frame::DescribeStream {
                request_id,
                stream: name,
            } => match self.catalog.lookup(&name) {
                Ok((idx, def)) => Frame::StreamInfo {
                    request_id,
                    shards: def.shards,
                    durable: def.durable,
                    owners: self.catalog.shard_owners(idx, self.s.cfg.node_id),
                },
                Err((code, msg)) => Frame::error(request_id, code, msg),
            },
            Frame::DescribeCluster { request_id } => {
                let mut brokers: Vec<(u64, String)> = self
                    .catalog
                    .broker_addrs
                    .iter()
                    .map(|(id, a)| (*id, a.clone()))
                    .collect();
                brokers.sort();
                Frame::ClusterInfo {
                    request_id,
                    node_id: self.s.cfg.node_id,
                    brokers,
                }
            }
            other => unreachable!("not a describe: kind {}", other.kind()),
        };
        if let Some(e) = self.ep.get(key) {
            e.conn.send_frame(stream, &reply);
        }
    }

    /// Unsubscribe: ends a subscription or a watch of this connection.
    fn on_unsubscribe(&mut self, key: ConnKey, stream: u64, request_id: u64, id: u64) {
        let owned = self.subs.get(id).map(|s| s.conn == key).unwrap_or(false);
        if owned {
            self.remove_sub(id, Some((0, "unsubscribed".into())));
        } else if !self.unwatch(key, id) {
            self.send_err(
                key,
                stream,
                request_id,
                ErrorCode::NotFound,
                format!("no subscription {id} on this connection"),
            );
        }
    }

    /// An admitted frame to its handler; a refusal is answered with the request's id.
    fn dispatch(&mut self, key: ConnKey, stream: u64, frame: Frame) {
        let counters = self.s.counters.clone();
        match frame {
            Frame::Hello {
                features: f,
                max_frame_bytes,
                ..
            } => self.on_hello(key, stream, f, max_frame_bytes),
            Frame::Peer(PeerFrame::PeerHello {
                node_id,
                cluster_id,
                capabilities,
                max_frame_bytes,
            }) => self.on_peer_hello(
                key,
                stream,
                node_id,
                cluster_id,
                capabilities,
                max_frame_bytes,
            ),
            Frame::Peer(PeerFrame::Forward { head, inner }) => {
                self.on_forward(key, stream, head, *inner)
            }
            Frame::Replicate {
                shard,
                msg,
                records,
            } => self.on_replicate(key, stream, shard, msg, records),
            Frame::Auth(AuthFrame::Authenticate { request_id, token }) => {
                self.on_authenticate(key, stream, request_id, token)
            }
            f @ (Frame::DescribeStream { .. } | Frame::DescribeCluster { .. }) => {
                self.on_describe(key, stream, f)
            }
            Frame::Publish {
                request_id,
                stream: name,
                shard,
                ack,
                records,
            } => {
                if let Err(Refusal { code, message: msg }) =
                    self.on_publish(key, stream, request_id, &name, shard, ack, records)
                {
                    CoreCounters::inc(&counters.publishes_refused);
                    self.send_err(key, answer_stream(stream), request_id, code, msg);
                }
            }
            Frame::Subscribe {
                request_id,
                stream: name,
                shard,
                start,
                policy,
                queue_records_max,
                queue_bytes_max,
            } => {
                if let Err(Refusal { code, message: msg }) = self.on_subscribe(
                    key,
                    stream,
                    request_id,
                    &name,
                    shard,
                    start,
                    policy,
                    queue_records_max,
                    queue_bytes_max,
                ) {
                    self.send_err(key, stream, request_id, code, msg);
                }
            }
            Frame::Unsubscribe {
                request_id,
                subscription_id,
            } => self.on_unsubscribe(key, stream, request_id, subscription_id),
            Frame::Group(g) => {
                let rid = g.request_id();
                if let Err(Refusal { code, message: msg }) = self.on_group_request(key, stream, g) {
                    self.send_err(key, stream, rid, code, msg);
                }
            }
            Frame::Cache(c) => {
                let rid = c.request_id();
                if let Err(Refusal { code, message: msg }) = self.on_cache_request(key, stream, c) {
                    CoreCounters::inc(&counters.cache_refused);
                    self.send_err(key, stream, rid, code, msg);
                }
            }
            other => {
                // `admit` serves only the kinds above; anything else is a table defect.
                tracing::error!(kind = other.kind(), "admitted frame has no handler");
                self.send_err(
                    key,
                    answer_stream(stream),
                    other.request_id().unwrap_or(0),
                    ErrorCode::Internal,
                    format!("{} has no handler", streams::kind_name(other.kind())),
                );
            }
        }
    }

    /// The peer finished `stream`: a publisher stream is finished on our side once its last
    /// answer is queued.
    fn on_stream_finished(&mut self, key: ConnKey, stream: u64) {
        if streams::StreamClass::of(stream) == streams::StreamClass::OneWay {
            if let Some(session) = self.sessions.get_mut(&key) {
                session.pub_streams.remove(&stream);
            }
        }
        if streams::StreamClass::of(stream) == streams::StreamClass::Publisher {
            // Finish our side of a publisher stream once its last answer is queued.
            let Some(session) = self.sessions.get_mut(&key) else {
                return;
            };
            let pending = session
                .pub_streams
                .get(&stream)
                .map(|p| p.pending)
                .unwrap_or(0);
            if pending == 0 {
                session.pub_streams.remove(&stream);
                if let Some(e) = self.ep.get(key) {
                    e.conn.finish(stream);
                }
            } else {
                session.pub_streams.entry(stream).or_default().fin_requested = true;
            }
        }
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::core) fn on_publish(
        &mut self,
        key: ConnKey,
        quic_stream: u64,
        request_id: u64,
        name: &felix_quic::wire::StreamName,
        sel: ShardSelector,
        ack: bool,
        records: Records,
    ) -> Result<(), Refusal> {
        if self.draining {
            return Err(Refusal::new(
                ErrorCode::ShuttingDown,
                "the broker is shutting down; nothing was appended",
            ));
        }
        let cfg = self.s.cfg.clone();
        let max_payload = cfg.max_payload_bytes;
        let (idx, shard) = checks::publish_target(
            &self.catalog,
            max_payload,
            &mut self.rr,
            name,
            sel,
            &records,
        )?;
        let route = self.admit_shard(key, false, idx, shard)?;
        let bytes = records.region_len() as u64;
        let session = self
            .sessions
            .get_mut(&key)
            .expect("frames come from live sessions");
        // Refuse before queueing anything, so a retry cannot write twice. A peer link carries
        // the forwards of every client of a core of another broker: their own caps applied
        // there, and the link is bounded by that broker's `peer_forwards_max`.
        let capped = !session.peer_link;
        if capped
            && session.inflight_bytes + bytes > cfg.conn_inflight_bytes_max
            && session.inflight_bytes > 0
        {
            return Err(Refusal::new(
                ErrorCode::InflightLimit,
                format!(
                    "connection has {} bytes in flight (cap {})",
                    session.inflight_bytes, cfg.conn_inflight_bytes_max
                ),
            ));
        }
        if capped && ack && session.unacked >= cfg.conn_unacked_max {
            return Err(Refusal::new(
                ErrorCode::InflightLimit,
                format!(
                    "connection has {} unanswered acked publishes (cap {})",
                    session.unacked, cfg.conn_unacked_max
                ),
            ));
        }
        session.inflight_bytes += bytes;
        let lane = session.pub_streams.entry(quic_stream).or_default();
        if ack {
            session.unacked += 1;
            lane.pending += 1;
        }
        let origin = Origin {
            core: self.id,
            conn: key,
            quic_stream,
            request_id,
            ack,
            bytes,
        };
        CoreCounters::inc(&self.s.counters.publishes_received);
        if let ShardAdmit::Forward(target) = route {
            // Acked on the link whatever the client asked, so a refusal reaches it too.
            let frame = Frame::Publish {
                request_id,
                stream: name.clone(),
                shard: ShardSelector::Shard(shard),
                ack: true,
                records,
            };
            let wait = Duration::from_millis(cfg.publish_timeout_ms);
            let client = peer::FwdClient::Publish(origin);
            let lane = peer::Lane::Publish;
            if let Err(why) = self.forward(target, &frame, client, lane, (wait, None)) {
                self.on_publish_result(origin, Err(why), 0);
            }
            return Ok(());
        }
        let owner = self.owner_core(idx, shard);
        if owner != self.id {
            CoreCounters::inc(&self.s.counters.publishes_forwarded);
        }
        let deadline = Instant::now() + Duration::from_millis(cfg.publish_timeout_ms);
        self.route(
            owner,
            MeshMsg::Owner(ToOwner::Publish(PublishReq {
                origin,
                stream: idx,
                shard,
                records,
                deadline,
            })),
        );
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    pub(in crate::core) fn on_subscribe(
        &mut self,
        key: ConnKey,
        reply_stream: u64,
        request_id: u64,
        name: &felix_quic::wire::StreamName,
        shard: u32,
        start: StartAt,
        policy: QueuePolicy,
        queue_records_max: u32,
        queue_bytes_max: u64,
    ) -> Result<(), Refusal> {
        let cfg = self.s.cfg.clone();
        let idx = checks::subscribe_target(&self.catalog, name, shard)?;
        let session = self
            .sessions
            .get_mut(&key)
            .expect("frames come from live sessions");
        session.room_for_one_more(cfg.max_subscriptions)?;
        let records_max = queue_bound(queue_records_max as u64, cfg.sub_queue_records_max as u64);
        let bytes_max = queue_bound(queue_bytes_max, cfg.sub_queue_bytes_max);
        let e = self.ep.get(key).expect("session has a connection");
        // Only drop_new subscriptions share the mux: a client that cannot take more for one of
        // them drops the newest and announces it, which is drop_new exactly. A Block or
        // drop_old subscription keeps a stream of its own, whose flow control brings its policy
        // to the broker's queue for it alone.
        let mux = session.features & features::SUB_MUX != 0 && policy == QueuePolicy::DropNew;
        let open_new = !mux || session.sub_mux_stream.is_none();
        if open_new && !e.conn.can_open_uni() {
            return Err(Refusal::new(
                ErrorCode::TooManySubscriptions,
                "the client's unidirectional stream limit is exhausted",
            ));
        }
        let sid = ((self.id as u64) << 48) | self.next_sub;
        self.next_sub += 1; // subscription and watch ids share this space
        let qs = match (mux, session.sub_mux_stream) {
            (true, Some(qs)) => qs,
            (true, None) => {
                // The mux stream carries nothing but `SubMux` frames (no `SubStream`).
                let qs = e.conn.open_uni();
                session.sub_mux_stream = Some(qs);
                session.sub_streams.insert(qs, subs::SUB_MUX_SID);
                qs
            }
            (false, _) => {
                let qs = e.conn.open_uni();
                let first = Frame::SubStream {
                    subscription_id: sid,
                };
                e.conn.send_frame(qs, &first);
                session.sub_streams.insert(qs, sid);
                qs
            }
        };
        session.subs.push(sid);
        let sub = subs::Sub {
            conn: key,
            quic_stream: qs,
            stream: idx,
            shard,
            queue: SubQueue::new(policy, records_max, bytes_max),
            next_offset: None,
            request_id,
            reply_stream,
            catch_up: None,
            mux,
        };
        self.with_subs(|h, _, ctx| h.open(sid, sub, start, ctx));
        Ok(())
    }
}
