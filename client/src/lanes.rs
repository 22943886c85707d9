//! Publisher lanes: which QUIC stream carries each publisher's acked publishes, and what
//! happens when the broker ends one (its principal was revoked, or its token expired).
//!
//! The broker ends a lane by stopping to read it, sending the refusal under request id 0
//! on it, and finishing it once the publishes it had read are answered. Everything still
//! unanswered when that FIN arrives was never read, so nothing of it was appended: it fails
//! with the broker's refusal, and the publisher's next publish opens a fresh stream (which
//! succeeds again once the connection authenticates with a valid token).

use std::collections::HashMap;

use crate::Error;

#[derive(Default)]
pub(crate) struct Lanes {
    /// Publisher number → its current stream.
    streams: HashMap<u32, u64>,
    /// Acked publish request id → the stream it went out on, until answered.
    sent_on: HashMap<u64, u64>,
    /// Streams the broker ended → the refusal their unanswered publishes fail with.
    ended: HashMap<u64, Error>,
}

impl Lanes {
    /// The stream of publisher `n`, opened by `open` when it has none (or its last ended).
    pub(crate) fn stream(&mut self, n: u32, open: impl FnOnce() -> u64) -> u64 {
        *self.streams.entry(n).or_insert_with(open)
    }

    pub(crate) fn sent(&mut self, request_id: u64, stream: u64) {
        self.sent_on.insert(request_id, stream);
    }

    pub(crate) fn answered(&mut self, request_id: u64) {
        self.sent_on.remove(&request_id);
    }

    /// The broker ended `stream` with `why`. False when `stream` is no lane of this client.
    pub(crate) fn ended_by_broker(&mut self, stream: u64, why: Error) -> bool {
        let before = self.streams.len();
        self.streams.retain(|_, s| *s != stream);
        if self.streams.len() == before {
            return false;
        }
        self.ended.insert(stream, why);
        true
    }

    /// `stream` finished or was reset: the request ids still unanswered on it, with the
    /// refusal they fail with, when the broker had ended it.
    pub(crate) fn closed(&mut self, stream: u64) -> Option<(Vec<u64>, Error)> {
        let why = self.ended.remove(&stream)?;
        let ids: Vec<u64> = (self.sent_on.iter())
            .filter(|(_, s)| **s == stream)
            .map(|(id, _)| *id)
            .collect();
        for id in &ids {
            self.sent_on.remove(id);
        }
        Some((ids, why))
    }

    pub(crate) fn clear(&mut self) {
        self.sent_on.clear();
        self.ended.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_quic::wire::ErrorCode;

    fn revoked() -> Error {
        Error::Broker {
            code: ErrorCode::Revoked,
            message: "revoked".into(),
        }
    }

    #[test]
    fn an_ended_lane_fails_only_its_own_unanswered_publishes_and_is_reopened() {
        let mut l = Lanes::default();
        let mut next = 4;
        let mut open = || {
            next += 4;
            next
        };
        let a = l.stream(1, &mut open);
        let b = l.stream(2, &mut open);
        assert_eq!(l.stream(1, &mut open), a, "a lane keeps its stream");
        l.sent(10, a);
        l.sent(11, a);
        l.sent(12, b);
        l.answered(10);
        assert!(!l.ended_by_broker(999, revoked()), "not a lane");
        assert!(l.ended_by_broker(a, revoked()));
        assert!(l.closed(b).is_none(), "b was not ended");
        let (ids, why) = l.closed(a).expect("a was ended");
        assert_eq!(ids, vec![11]);
        assert!(matches!(
            why,
            Error::Broker {
                code: ErrorCode::Revoked,
                ..
            }
        ));
        assert!(l.closed(a).is_none(), "failed once");
        let a2 = l.stream(1, &mut open);
        assert_ne!(a2, a, "the next publish opens a fresh stream");
        assert_eq!(l.stream(2, &mut open), b);
    }
}
