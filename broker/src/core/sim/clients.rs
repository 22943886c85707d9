//! What the simulation's stream clients do: publish, subscribe, unsubscribe, stall.

use super::{Client, Pub, World, PUBLISH_TIMEOUT_MS};
use crate::core::conn::subs::Sub;
use crate::core::{MeshMsg, Origin, PublishReq, ShardKey, ToOwner};
use crate::fanout::SubQueue;
use bytes::Bytes;
use felix_quic::wire::{ErrorCode, QueuePolicy, Records, StartAt};
use std::time::Duration;

impl World {
    /// A client on core `core` publishes `n` records to `key` (acked).
    pub(crate) fn publish(&mut self, core: u8, key: ShardKey, n: u32) -> u64 {
        let id = self.next_id + 1;
        let payloads: Vec<Bytes> = (0..n).map(|i| Bytes::from(format!("p{id}.{i}"))).collect();
        self.publish_payloads(core, key, payloads)
    }

    /// A client on core `core` publishes these records to `key` (acked); returns its id.
    pub(crate) fn publish_payloads(
        &mut self,
        core: u8,
        key: ShardKey,
        payloads: Vec<Bytes>,
    ) -> u64 {
        let id = self.id();
        let n = payloads.len();
        self.note(format!("publish #{id} of {n} on core {core} to {key:?}"));
        let records = Records::encode(payloads.iter().map(|p| &p[..]));
        let deadline = self.epoch + Duration::from_millis(self.now_ms + PUBLISH_TIMEOUT_MS);
        self.pubs.insert(
            id,
            Pub {
                key,
                payloads,
                answers: Vec::new(),
                lost: false,
                life: self.life,
            },
        );
        let origin = Origin {
            core,
            conn: id,
            quic_stream: 4,
            request_id: id,
            ack: true,
            bytes: records.payload_bytes() as u64,
        };
        if self.draining {
            // The connection side refuses new publishes while draining.
            let p = self.pubs.get_mut(&id).expect("inserted");
            p.answers.push(Err(ErrorCode::ShuttingDown));
            return id;
        }
        let req = PublishReq {
            origin,
            stream: key.0,
            shard: key.1,
            records,
            deadline,
        };
        let owner = self.ctx(core).owner_core(key);
        self.send(core, owner, MeshMsg::Owner(ToOwner::Publish(req)));
        self.drain_inbox(core);
        id
    }

    /// A client on core `core` subscribes to `key`.
    pub(crate) fn subscribe(
        &mut self,
        core: u8,
        key: ShardKey,
        start: StartAt,
        policy: QueuePolicy,
        records_max: u64,
    ) -> u64 {
        let sid = self.id();
        self.note(format!(
            "subscribe #{sid} on core {core} to {key:?} from {start:?}, {policy:?} {records_max}"
        ));
        self.clients.insert(
            sid,
            Client {
                core,
                key,
                policy,
                unread: Vec::new(),
                read: Vec::new(),
                stalled: false,
                answer: None,
                lost: false,
                life: self.life,
            },
        );
        let sub = Sub {
            conn: sid,
            quic_stream: sid,
            stream: key.0,
            shard: key.1,
            queue: SubQueue::new(policy, records_max, 1 << 20),
            next_offset: None,
            request_id: sid,
            reply_stream: 0,
            catch_up: None,
        };
        self.with_subs(core, |h, _, ctx| h.open(sid, sub, start, ctx));
        self.drain_inbox(core);
        sid
    }

    /// The client unsubscribes (or its connection closes).
    pub(crate) fn unsubscribe(&mut self, sid: u64) {
        let core = self.clients[&sid].core;
        self.note(format!("unsubscribe #{sid}"));
        self.with_subs(core, |h, _, ctx| h.remove(sid, None, ctx));
        self.clients.remove(&sid);
        self.drain_inbox(core);
    }

    pub(crate) fn set_stalled(&mut self, sid: u64, stalled: bool) {
        if let Some(c) = self.clients.get_mut(&sid) {
            c.stalled = stalled;
        }
    }
}
