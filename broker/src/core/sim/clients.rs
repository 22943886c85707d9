//! What the simulation's stream clients do: publish, subscribe, unsubscribe, stall. A
//! request enters as a session hands it to the core: its frame encoded and decoded
//! (`super::wire`), then the connection side's checks (`conn::checks`) choose its shard or
//! refuse it.

use super::{Client, Pub, World, PUBLISH_TIMEOUT_MS};
use crate::core::conn::checks;
use crate::core::conn::subs::Sub;
use crate::core::{MeshMsg, Origin, PublishReq, ShardKey, ToOwner};
use crate::fanout::SubQueue;
use bytes::Bytes;
use felix_quic::wire::{ErrorCode, Frame, QueuePolicy, Records, ShardSelector, StartAt};
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
        let frame = super::wire(&Frame::Publish {
            request_id: id,
            stream: self.catalog.slot(key.0).def.name(),
            shard: ShardSelector::Shard(key.1),
            ack: true,
            records,
        });
        let Frame::Publish {
            stream,
            shard,
            records,
            ..
        } = frame
        else {
            unreachable!("a publish decodes as one")
        };
        let target = checks::publish_target(
            &self.catalog,
            1 << 20,
            &mut self.rr,
            &stream,
            shard,
            &records,
        );
        let (idx, shard) = match target {
            Ok(t) => t,
            Err(why) => {
                self.note(format!("publish #{id} refused: {why}"));
                let p = self.pubs.get_mut(&id).expect("inserted");
                p.answers.push(Err(why.code));
                return id;
            }
        };
        assert_eq!((idx, shard), key, "the shard the publish named");
        let req = PublishReq {
            origin,
            stream: idx,
            shard,
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
        let mux = self.sub_mux && policy == QueuePolicy::DropNew;
        self.note(format!(
            "subscribe #{sid} on core {core} to {key:?} from {start:?}, {policy:?} {records_max}{}",
            if mux { ", mux" } else { "" }
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
                mux,
            },
        );
        let frame = super::wire(&Frame::Subscribe {
            request_id: sid,
            stream: self.catalog.slot(key.0).def.name(),
            shard: key.1,
            start,
            policy,
            queue_records_max: records_max as u32,
            queue_bytes_max: 1 << 20,
        });
        let Frame::Subscribe {
            stream,
            shard,
            start,
            policy,
            queue_records_max,
            queue_bytes_max,
            ..
        } = frame
        else {
            unreachable!("a subscribe decodes as one")
        };
        let idx = match checks::subscribe_target(&self.catalog, &stream, shard) {
            Ok(idx) => idx,
            Err(why) => {
                self.note(format!("subscribe #{sid} refused: {why}"));
                let cl = self.clients.get_mut(&sid).expect("inserted");
                cl.answer = Some(Err(why.code.number()));
                return sid;
            }
        };
        let conn = if mux {
            super::submux::mux_conn(core)
        } else {
            sid
        };
        let sub = Sub {
            conn,
            quic_stream: conn,
            stream: idx,
            shard,
            queue: SubQueue::new(policy, queue_records_max as u64, queue_bytes_max),
            next_offset: None,
            request_id: sid,
            reply_stream: 0,
            catch_up: None,
            mux,
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

    /// Client `sid` stops (or starts again) reading. A mux client's connection stops as a
    /// whole (the real client never stops its mux stream for one subscription).
    pub(crate) fn set_stalled(&mut self, sid: u64, stalled: bool) {
        if let Some(c) = self.clients.get_mut(&sid) {
            c.stalled = stalled;
            if c.mux {
                let conn = super::submux::mux_conn(c.core);
                self.mux_conns.entry(conn).or_default().stalled = stalled;
            }
        }
    }
}
