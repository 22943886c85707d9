//! Authentication on a connection, the driver side of `authz` (pure): `Authenticate` verifies
//! a token and sets the connection's principal (again at any time: re-auth in place), and
//! the admission asks `authorize` for every frame. A forward carries its client's token; the
//! owner verifies it once per token (a bounded cache) and checks the inner request with it.

use super::super::authz;
use super::super::*;
use felix_control::auth::{AuthError, Principal};
use felix_quic::wire::PeerFrame;

/// Verified forward principals one core keeps; past it the cache starts again empty.
const FORWARD_PRINCIPALS_MAX: usize = 1024;

fn now_s() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn refusal_of(e: AuthError) -> Refusal {
    match e {
        AuthError::Expired(m) => Refusal::new(ErrorCode::TokenExpired, m),
        AuthError::Revoked(m) => Refusal::new(ErrorCode::Revoked, m),
        other => Refusal::new(ErrorCode::Unauthenticated, other.to_string()),
    }
}

impl CoreState {
    /// `Authenticate`: verify the token and make it the connection's principal. A refused
    /// token leaves the principal the connection had (a failed refresh does not end a
    /// connection whose token is still valid). With auth off the answer names no one.
    pub(in crate::core) fn on_authenticate(
        &mut self,
        key: ConnKey,
        stream: u64,
        request_id: u64,
        token: String,
    ) {
        let answer = match &self.s.auth {
            None => Ok(AuthFrame::Authenticated {
                request_id,
                subject: String::new(),
                tenant: String::new(),
                expires_at_ms: 0,
            }),
            Some(v) => v.verify(&token, now_s()).map(|p| {
                let ok = AuthFrame::Authenticated {
                    request_id,
                    subject: p.subject.clone(),
                    tenant: p.tenant.clone(),
                    expires_at_ms: p.expires_at_s.saturating_mul(1000),
                };
                if let Some(s) = self.sessions.get_mut(&key) {
                    s.principal = Some((p, Arc::from(token.as_str())));
                    s.revoked = None;
                }
                ok
            }),
        };
        match answer {
            Ok(ok) => {
                CoreCounters::inc(&self.s.counters.auth_accepted);
                if let Some(e) = self.ep.get(key) {
                    e.conn.send_frame(stream, &Frame::Auth(ok));
                }
            }
            Err(e) => {
                CoreCounters::inc(&self.s.counters.auth_refused);
                let Refusal { code, message: msg } = refusal_of(e);
                self.send_err(key, answer_stream(stream), request_id, code, msg);
            }
        }
    }

    /// The admission's auth check of `frame` on connection `key` (`Ok` with auth off).
    pub(in crate::core) fn authorize(
        &mut self,
        key: ConnKey,
        frame: &Frame,
    ) -> Result<(), Refusal> {
        if self.s.auth.is_none() {
            return Ok(());
        }
        let now = now_s();
        let Some(session) = self.sessions.get(&key) else {
            return Ok(());
        };
        if !session.peer_link {
            let principal = session.principal.as_ref().map(|(p, _)| p);
            if let (None, Some(why)) = (principal, &session.revoked) {
                if authz::need(frame) != authz::Need::Nothing {
                    return Err(Refusal::new(ErrorCode::Revoked, why.clone()));
                }
            }
            return authz::check(principal, now, &authz::need(frame));
        }
        // A peer link is mutual TLS; what it forwards is checked as its client's request.
        let Frame::Peer(PeerFrame::Forward { head, inner }) = frame else {
            return Ok(());
        };
        let need = authz::need(inner);
        if need == authz::Need::Nothing {
            return Ok(());
        }
        let v = self.s.auth.clone().expect("checked above");
        let p = self.forward_principal(&v, &head.principal, now)?;
        authz::check(Some(&p), now, &need)
    }

    /// About once a second: end the subscriptions and watches of connections whose token
    /// expired unrefreshed (`token_expired`) or, when the revocations changed, was revoked
    /// (`revoked`: the principal is taken away too, so every request is refused until a token
    /// that verifies is presented). An expired one's requests are refused already.
    pub(in crate::core) fn expire_principals(&mut self, now: Instant) {
        let Some(v) = self.s.auth.clone() else {
            return;
        };
        if now.duration_since(self.auth_checked_at) < timers::AUTH_EXPIRY_PERIOD {
            return;
        }
        self.auth_checked_at = now;
        let revision = v.revocation_revision();
        let recheck = revision != self.revocations_seen;
        if recheck {
            self.revocations_seen = revision;
            // Forwarded principals were verified against the old list.
            self.forward_principals.clear();
        }
        let now_s = now_s();
        // (connection, its subscriptions, its watches, its publish streams, why they end)
        type Ending = (ConnKey, Vec<u64>, Vec<u64>, Vec<u64>, Refusal);
        let mut due: Vec<Ending> = Vec::new();
        for (key, s) in self.sessions.iter_mut() {
            let Some((p, _)) = s.principal.as_ref() else {
                continue;
            };
            let (code, why) = match recheck.then(|| v.revoked(p)).flatten() {
                Some(why) => {
                    s.principal = None;
                    s.revoked = Some(why.clone());
                    (ErrorCode::Revoked, why)
                }
                None if p.expires_at_s <= now_s => {
                    let why = format!(
                        "{}'s token {} expired at {}; authenticate again and subscribe again",
                        p.subject, p.jti, p.expires_at_s
                    );
                    (ErrorCode::TokenExpired, why)
                }
                None => continue,
            };
            let lanes: Vec<u64> = (s.pub_streams.iter())
                .filter(|(_, p)| !p.ended)
                .map(|(id, _)| *id)
                .collect();
            if !s.subs.is_empty() || !s.watches.is_empty() || !lanes.is_empty() {
                due.push((
                    *key,
                    s.subs.clone(),
                    s.watches.clone(),
                    lanes,
                    Refusal::new(code, why),
                ));
            }
        }
        for (key, subs, watches, lanes, end) in due {
            if end.code == ErrorCode::Revoked {
                CoreCounters::inc(&self.s.counters.auth_revoked_ended);
            }
            for sid in subs {
                self.remove_sub(sid, Some((end.code.number(), end.message.clone())));
            }
            for wid in watches {
                self.end_watch(key, wid, end.clone());
            }
            self.end_publish_lanes(key, &lanes, &end);
        }
    }

    /// End a principal's publish streams: the broker stops reading them (STOP_SENDING with
    /// the refusal's code), so nothing more of that principal's is appended through them.
    /// An acked lane gets the refusal under request id 0, then its FIN once the publishes
    /// already read are answered: the client fails whatever it sent after them, which was
    /// never read. A one-way stream has no way back, so its refusal goes on the control
    /// stream.
    fn end_publish_lanes(&mut self, key: ConnKey, lanes: &[u64], end: &Refusal) {
        let Some(session) = self.sessions.get_mut(&key) else {
            return;
        };
        let Some(e) = self.ep.get(key) else {
            return;
        };
        for &stream in lanes {
            let Some(lane) = session.pub_streams.get_mut(&stream) else {
                continue;
            };
            debug_assert!(!lane.ended, "a lane is ended once");
            lane.ended = true;
            CoreCounters::inc(&self.s.counters.auth_publish_lanes_ended);
            e.conn.stop_reading(stream, u64::from(end.code.number()));
            if streams::StreamClass::of(stream) == streams::StreamClass::Publisher {
                e.conn.send_frame(stream, &end.clone().frame(0));
                if lane.pending == 0 {
                    session.pub_streams.remove(&stream);
                    e.conn.finish(stream);
                } else {
                    lane.fin_requested = true;
                }
            } else {
                e.conn.send_frame(0, &end.clone().frame(0));
            }
        }
        self.ep.mark_dirty(key);
    }

    /// The principal of a token a forward carried, verified once and then kept.
    fn forward_principal(
        &mut self,
        v: &crate::auth::AuthKeys,
        token: &str,
        now: u64,
    ) -> Result<Principal, Refusal> {
        if let Some(p) = self.forward_principals.get(token) {
            return Ok(p.clone());
        }
        if token.is_empty() {
            return Err(Refusal::new(
                ErrorCode::Unauthenticated,
                "the forwarding broker named no principal (is auth off there?)",
            ));
        }
        let p = v.verify(token, now).map_err(refusal_of)?;
        if self.forward_principals.len() >= FORWARD_PRINCIPALS_MAX {
            self.forward_principals.clear();
        }
        self.forward_principals.insert(Arc::from(token), p.clone());
        Ok(p)
    }
}
