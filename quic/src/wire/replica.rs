//! Replication on the peer link (docs/replication-design.md; docs/protocol.md, "Peer
//! links"): one frame kind, `Replicate`, carrying one replica message about one shard, and a
//! shipment's records. The messages are the replica machine's own (`broker/src/core/replica`
//! uses [`ReplicaMsg`] as its `Msg`): what the machine sends is what the wire carries, with no
//! translation in between. A shipment's records travel beside its message: the machine names
//! them by generation, the driver reads them from its log.
//!
//! Body: the stream (tenant, namespace, name), its incarnation u64, the shard u32, a message
//! tag u8 and the message's fields, then (for `Ship` only) the records: count u32, then each
//! `ts_ms u64, flags u8, payload_len u32, payload`. A `Ship` sends its generations as runs
//! (count u32, then `records u32, gen u64` each), since a shipment rarely spans two.

use super::{put_stream, Reader, StreamName, WireError};
use bytes::{BufMut, Bytes, BytesMut};

/// Frame kinds of this module (after the auth kinds).
pub mod kind {
    pub const REPLICATE: u8 = 52;
    pub const FIRST: u8 = REPLICATE;
    pub const LAST: u8 = REPLICATE;
}

/// The shard a replication frame is about: a stream incarnation (the catalog revision that
/// created it: a stream deleted and made again under the same name is another one) and a
/// shard of it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardRef {
    pub stream: StreamName,
    pub incarnation: u64,
    pub shard: u32,
}

/// How a follower answers a shipment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Shipped {
    /// The follower's log agrees with the leader's up to `end` (exclusive).
    Holds { end: u64 },
    /// The follower's log does not agree at `start - 1`: ship again from `below` or lower.
    Mismatch { below: u64 },
}

/// A replica message (the rules are in docs/replication-design.md; node ids are the
/// brokers', storage identities their data directories').
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReplicaMsg {
    /// A new leader's fence for `gen` (rule 3).
    Fence {
        gen: u64,
        leader: u64,
    },
    /// `from` promised `gen` to the leader, and holds records up to `end` (exclusive).
    FenceAnswer {
        gen: u64,
        from: u64,
        end: u64,
    },
    /// Records from offset `start`, one per generation in `gens`; `prev_gen` is the
    /// generation of the record at `start - 1` (rule 6). `commit` is the leader's commit
    /// mark when it shipped: the records below it are committed (rule 7), which the follower
    /// learns for what it holds in agreement with the leader.
    Ship {
        gen: u64,
        leader: u64,
        start: u64,
        prev_gen: Option<u64>,
        commit: u64,
        gens: Vec<u64>,
    },
    /// `from` answered a shipment, under its storage identity `sid` (rule 9).
    ShipAnswer {
        gen: u64,
        from: u64,
        sid: u64,
        shipped: Shipped,
    },
    /// Renew the leader's lease: the exchange sent at `round` (the leader's clock, rule 2).
    LeaseAsk {
        gen: u64,
        leader: u64,
        round: u64,
    },
    LeaseGrant {
        gen: u64,
        from: u64,
        round: u64,
    },
    /// `from` refused a message of generation `gen`: it promised `promised` (to another).
    Refuse {
        gen: u64,
        from: u64,
        promised: u64,
    },
}

impl ReplicaMsg {
    /// The node that sent it: the leader of a fence, shipment or lease question, the
    /// replica of an answer, grant or refusal. A peer link carries only its dialer's own.
    pub fn sender(&self) -> u64 {
        match *self {
            ReplicaMsg::Fence { leader, .. }
            | ReplicaMsg::Ship { leader, .. }
            | ReplicaMsg::LeaseAsk { leader, .. } => leader,
            ReplicaMsg::FenceAnswer { from, .. }
            | ReplicaMsg::ShipAnswer { from, .. }
            | ReplicaMsg::LeaseGrant { from, .. }
            | ReplicaMsg::Refuse { from, .. } => from,
        }
    }
}

/// One record of a shipment, as the leader's log holds it (its generation is the `Ship`'s).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShippedRecord {
    pub ts_ms: u64,
    pub flags: u8,
    pub payload: Bytes,
}

mod tag {
    pub const FENCE: u8 = 1;
    pub const FENCE_ANSWER: u8 = 2;
    pub const SHIP: u8 = 3;
    pub const SHIP_ANSWER_HOLDS: u8 = 4;
    pub const SHIP_ANSWER_MISMATCH: u8 = 5;
    pub const LEASE_ASK: u8 = 6;
    pub const LEASE_GRANT: u8 = 7;
    pub const REFUSE: u8 = 8;
}

pub(super) fn encode_body(
    b: &mut BytesMut,
    shard: &ShardRef,
    msg: &ReplicaMsg,
    records: &[ShippedRecord],
) {
    put_stream(b, &shard.stream);
    b.put_u64_le(shard.incarnation);
    b.put_u32_le(shard.shard);
    let three = |b: &mut BytesMut, t: u8, x: u64, y: u64, z: u64| {
        b.put_u8(t);
        b.put_u64_le(x);
        b.put_u64_le(y);
        b.put_u64_le(z);
    };
    match msg {
        ReplicaMsg::Fence { gen, leader } => {
            b.put_u8(tag::FENCE);
            b.put_u64_le(*gen);
            b.put_u64_le(*leader);
        }
        ReplicaMsg::FenceAnswer { gen, from, end } => {
            three(b, tag::FENCE_ANSWER, *gen, *from, *end)
        }
        ReplicaMsg::Ship {
            gen,
            leader,
            start,
            prev_gen,
            commit,
            gens,
        } => {
            b.put_u8(tag::SHIP);
            b.put_u64_le(*gen);
            b.put_u64_le(*leader);
            b.put_u64_le(*start);
            b.put_u8(prev_gen.is_some() as u8);
            b.put_u64_le(prev_gen.unwrap_or(0));
            b.put_u64_le(*commit);
            let runs: Vec<&[u64]> = gens.chunk_by(|a, b| a == b).collect();
            b.put_u32_le(runs.len() as u32);
            for r in runs {
                b.put_u32_le(r.len() as u32);
                b.put_u64_le(r[0]);
            }
            assert_eq!(records.len(), gens.len(), "a shipment carries its records");
        }
        ReplicaMsg::ShipAnswer {
            gen,
            from,
            sid,
            shipped,
        } => {
            let (t, at) = match shipped {
                Shipped::Holds { end } => (tag::SHIP_ANSWER_HOLDS, *end),
                Shipped::Mismatch { below } => (tag::SHIP_ANSWER_MISMATCH, *below),
            };
            three(b, t, *gen, *from, *sid);
            b.put_u64_le(at);
        }
        ReplicaMsg::LeaseAsk { gen, leader, round } => {
            three(b, tag::LEASE_ASK, *gen, *leader, *round)
        }
        ReplicaMsg::LeaseGrant { gen, from, round } => {
            three(b, tag::LEASE_GRANT, *gen, *from, *round)
        }
        ReplicaMsg::Refuse {
            gen,
            from,
            promised,
        } => three(b, tag::REFUSE, *gen, *from, *promised),
    }
    if matches!(msg, ReplicaMsg::Ship { .. }) {
        b.put_u32_le(records.len() as u32);
        for r in records {
            b.put_u64_le(r.ts_ms);
            b.put_u8(r.flags);
            b.put_u32_le(r.payload.len() as u32);
            b.put_slice(&r.payload);
        }
    } else {
        assert!(records.is_empty(), "only a shipment carries records");
    }
}

pub(super) fn decode_body(
    r: &mut Reader,
) -> Result<(ShardRef, ReplicaMsg, Vec<ShippedRecord>), WireError> {
    let shard = ShardRef {
        stream: r.stream()?,
        incarnation: r.u64("incarnation")?,
        shard: r.u32("shard")?,
    };
    let t = r.u8("replica_tag")?;
    let (gen, x) = (r.u64("gen")?, r.u64("node")?);
    let msg = match t {
        tag::FENCE => ReplicaMsg::Fence { gen, leader: x },
        tag::FENCE_ANSWER => ReplicaMsg::FenceAnswer {
            gen,
            from: x,
            end: r.u64("end")?,
        },
        tag::SHIP => {
            let start = r.u64("start")?;
            let has_prev = r.bool("has_prev_gen")?;
            let prev = r.u64("prev_gen")?;
            let commit = r.u64("commit")?;
            let n = r.u32("gen_runs")?;
            let runs = r.list(n, "gen_runs", |r| {
                Ok((r.u32("run_records")?, r.u64("run_gen")?))
            })?;
            let total: u64 = runs.iter().map(|r| r.0 as u64).sum();
            // Every shipped record takes at least 13 bytes: a count past what is left is a lie.
            if total > r.left() as u64 {
                return Err(WireError::InvalidValue {
                    field: "gen_runs",
                    value: total,
                });
            }
            let gens = runs
                .iter()
                .flat_map(|&(k, g)| std::iter::repeat_n(g, k as usize))
                .collect();
            ReplicaMsg::Ship {
                gen,
                leader: x,
                start,
                prev_gen: has_prev.then_some(prev),
                commit,
                gens,
            }
        }
        tag::SHIP_ANSWER_HOLDS | tag::SHIP_ANSWER_MISMATCH => {
            let sid = r.u64("sid")?;
            let at = r.u64("at")?;
            let shipped = if t == tag::SHIP_ANSWER_HOLDS {
                Shipped::Holds { end: at }
            } else {
                Shipped::Mismatch { below: at }
            };
            ReplicaMsg::ShipAnswer {
                gen,
                from: x,
                sid,
                shipped,
            }
        }
        tag::LEASE_ASK => ReplicaMsg::LeaseAsk {
            gen,
            leader: x,
            round: r.u64("round")?,
        },
        tag::LEASE_GRANT => ReplicaMsg::LeaseGrant {
            gen,
            from: x,
            round: r.u64("round")?,
        },
        tag::REFUSE => ReplicaMsg::Refuse {
            gen,
            from: x,
            promised: r.u64("promised")?,
        },
        other => {
            return Err(WireError::InvalidValue {
                field: "replica_tag",
                value: other as u64,
            })
        }
    };
    let records = match &msg {
        ReplicaMsg::Ship { gens, .. } => {
            let n = r.u32("records")?;
            if n as usize != gens.len() {
                return Err(WireError::InvalidValue {
                    field: "records",
                    value: n as u64,
                });
            }
            r.list(n, "records", |r| {
                let ts_ms = r.u64("ts_ms")?;
                let flags = r.u8("flags")?;
                let len = r.u32("payload_len")? as usize;
                let payload = r.take(len, "payload")?;
                Ok(ShippedRecord {
                    ts_ms,
                    flags,
                    payload,
                })
            })?
        }
        _ => Vec::new(),
    };
    Ok((shard, msg, records))
}
