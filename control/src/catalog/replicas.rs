//! Replicated shards in the catalog (docs/replication-design.md): each shard of a stream with
//! `replication_factor` > 1 has a [`Placement`], kept in the Raft state beside the stream, and
//! the stream's `placement` entry mirrors what brokers route by (the leader, the replica set,
//! the generation). Placement chooses the replica set once, on distinct live brokers that
//! registered a storage identity; it promotes a new leader when the leader is down (rule 8) and
//! takes the leader's reports (rule 7). Reports change no catalog object, so they emit no
//! change: the commit mark and each replica's lag are read with [`Catalog::stream_replication`].

use super::*;
use crate::replication::{Placement, PromoteError, Report, ReportAnswer, StorageId};

/// One replicated shard: its stream and shard number.
pub(super) type ShardKey = (ObjKey, u32);

/// One replicated shard's placement in a catalog image.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ReplicaImage {
    pub tenant: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub placement: Placement,
}

pub(super) fn to_images(m: &BTreeMap<ShardKey, Placement>) -> Vec<ReplicaImage> {
    m.iter()
        .map(|((k, shard), p)| ReplicaImage {
            tenant: k.0.clone(),
            namespace: k.1.clone(),
            stream: k.2.clone(),
            shard: *shard,
            placement: p.clone(),
        })
        .collect()
}

pub(super) fn from_images(v: Vec<ReplicaImage>) -> BTreeMap<ShardKey, Placement> {
    v.into_iter()
        .map(|r| {
            (
                (key(&r.tenant, &r.namespace, &r.stream), r.shard),
                r.placement,
            )
        })
        .collect()
}

/// A registered storage identity as placement counts it (16 lowercase hex digits, checked at
/// registration).
pub(super) fn sid_of(b: &Broker) -> Option<StorageId> {
    b.storage_id
        .as_deref()
        .and_then(|s| u64::from_str_radix(s, 16).ok())
}

/// Place one stream's shards. One copy: the single-copy rules of `placement::place`. More:
/// the replica set is chosen once per shard and a dead leader is replaced by promotion.
/// Returns whether the stream's `placement` changed.
pub(super) fn place_stream(
    s: &mut Stream,
    k: &ObjKey,
    reps: &mut BTreeMap<ShardKey, Placement>,
    brokers: &BTreeMap<u64, Broker>,
) -> bool {
    let live = |n: u64| brokers.get(&n).is_some_and(|b| b.live);
    if s.replication_factor <= 1 {
        let set: BTreeSet<u64> = brokers.keys().copied().filter(|&n| live(n)).collect();
        return placement::place(&mut s.placement, s.durable, &set);
    }
    let rf = s.replication_factor as usize;
    let mut changed = false;
    for i in 0..s.placement.len() {
        let sk = (k.clone(), s.placement[i].shard);
        let Some(p) = reps.get_mut(&sk) else {
            if let Some(p) = seat(&s.placement, rf, brokers) {
                changed |= mirror(&mut s.placement[i], &p, ShardState::Assigned);
                reps.insert(sk, p);
            }
            continue;
        };
        let (_, leader) = p.newest();
        let state = match leader {
            Some(l) if live(l) => ShardState::Assigned,
            _ => match p.promote_among(live) {
                Ok(_) => ShardState::Assigned,
                // No live replica qualifies: unavailable, never served short (rule 8).
                Err(PromoteError::NoneQualifies | PromoteError::NotEligible { .. }) => {
                    ShardState::Unavailable
                }
            },
        };
        changed |= mirror(&mut s.placement[i], p, state);
    }
    changed
}

/// Choose a new shard's replica set: `rf` distinct live brokers with a storage identity, those
/// holding the fewest replicas of this stream first (ties: lowest node id), and name its first
/// leader, the chosen broker leading the fewest of this stream's shards. `None` while fewer
/// than `rf` qualify: the shard waits unplaced rather than placed short.
fn seat(
    shards: &[ShardPlacement],
    rf: usize,
    brokers: &BTreeMap<u64, Broker>,
) -> Option<Placement> {
    let mut held: BTreeMap<u64, (usize, usize)> = BTreeMap::new();
    for sp in shards {
        for &n in &sp.replicas {
            held.entry(n).or_default().0 += 1;
        }
        if let Some(l) = sp.leader {
            held.entry(l).or_default().1 += 1;
        }
    }
    let mut candidates: Vec<(u64, StorageId)> = brokers
        .values()
        .filter(|b| b.live)
        .filter_map(|b| sid_of(b).map(|sid| (b.node_id, sid)))
        .collect();
    if candidates.len() < rf {
        return None;
    }
    candidates.sort_by_key(|&(n, _)| (held.get(&n).map_or(0, |h| h.0), n));
    candidates.truncate(rf);
    let first = candidates
        .iter()
        .map(|&(n, _)| n)
        .min_by_key(|n| (held.get(n).map_or(0, |h| h.1), *n))
        .expect("rf >= 2 candidates");
    let mut p = Placement::new(candidates.into_iter().collect());
    // Every replica of a new shard is at the empty position, so every one is eligible.
    p.promote(first, false)
        .expect("a new shard's replicas are all eligible");
    Some(p)
}

/// Make a shard's routing entry say what its placement says: the leader first in the replica
/// set, the generation it leads. Returns whether the entry changed.
fn mirror(sp: &mut ShardPlacement, p: &Placement, state: ShardState) -> bool {
    let (gen, leader) = p.newest();
    let mut replicas: Vec<u64> = leader.into_iter().collect();
    replicas.extend(p.set().iter().copied().filter(|&n| Some(n) != leader));
    let settled = if p.is_settled() {
        Vec::new()
    } else {
        p.settled().to_vec()
    };
    let next = ShardPlacement {
        shard: sp.shard,
        owner: leader,
        generation: gen,
        state,
        replicas,
        leader,
        settled,
    };
    let changed = *sp != next;
    *sp = next;
    changed
}

/// Replicated shards at a glance, for the control plane's `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplicationHealth {
    /// Seated replicated shards.
    pub shards: u64,
    /// Of those, shards with a replica that is down, or whose report no longer vouches for
    /// it (rule 9): fewer copies count than were asked for.
    pub under_replicated: u64,
    /// Of those, shards no live replica qualifies to lead (rule 8).
    pub unavailable: u64,
    /// The largest lag behind its leader's reported end, in records, of any replica.
    pub lag_records_max: u64,
    /// The largest lag behind its leader's log, in bytes, of any replica (as the leaders'
    /// last landed reports said).
    pub lag_bytes_max: u64,
}

impl Catalog {
    /// [`ReplicationHealth`] over every replicated shard.
    pub fn replication_health(&self) -> ReplicationHealth {
        let live = |n: u64| self.brokers.get(&n).is_some_and(|b| b.live);
        let mut h = ReplicationHealth::default();
        for ((k, shard), p) in &self.replicas {
            h.shards += 1;
            if p.set().iter().any(|&n| !live(n) || !p.vouched(n)) {
                h.under_replicated += 1;
            }
            let state = self
                .streams
                .get(k)
                .and_then(|s| s.placement.iter().find(|sp| sp.shard == *shard))
                .map(|sp| sp.state);
            if state == Some(ShardState::Unavailable) {
                h.unavailable += 1;
            }
            let (_, leader) = p.newest();
            let lead_end = leader.and_then(|l| p.reported(l)).map_or(0, |x| x.pos.end);
            for &n in p.set() {
                let end = p.reported(n).map_or(0, |x| x.pos.end);
                h.lag_records_max = h.lag_records_max.max(lead_end.saturating_sub(end));
                h.lag_bytes_max = h.lag_bytes_max.max(p.behind_bytes(n).unwrap_or(0));
            }
        }
        h
    }

    /// A broker registered storage identity `sid`: every placement holding it learns it (rule
    /// 9), so reports made under an identity it no longer has stop counting.
    pub(super) fn register_replica_identity(&mut self, node: u64, sid: Option<&str>) {
        let Some(sid) = sid.and_then(|s| u64::from_str_radix(s, 16).ok()) else {
            return;
        };
        for p in self.replicas.values_mut() {
            if p.set().contains(&node) && p.registered(node) != Some(sid) {
                p.register(node, sid);
            }
        }
    }

    /// Broker `node` registered again: a new process, which has none of its old leaderships
    /// (rule 1). Every shard it leads gets a new generation, or no leader when none qualifies
    /// (a restarted leader would otherwise be named at a generation it refuses to lead, and
    /// its shard would wait for a promotion that never comes while it stays live).
    pub(super) fn replica_leader_restarted(&mut self, node: u64) {
        let live = self.live();
        for p in self.replicas.values_mut() {
            if p.newest().1 == Some(node) {
                let _ = p.leader_restarted(|n| live.contains(&n));
            }
        }
    }

    /// A stream is gone: so are its shards' placements.
    pub(super) fn forget_replicas(&mut self, k: &ObjKey) {
        self.replicas.retain(|(sk, _), _| sk != k);
    }

    /// A leader's report for one shard (rule 7), answered as placement decides.
    pub(super) fn replica_report(
        &mut self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        report: &Report,
    ) -> Outcome {
        let k = key(tenant, namespace, stream);
        self.stream(tenant, namespace, stream)?;
        let live = self.live();
        let Some(p) = self.replicas.get_mut(&(k.clone(), shard)) else {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                format!("stream {tenant}/{namespace}/{stream} has no replicated shard {shard}"),
            ));
        };
        let unsettled = !p.is_settled();
        let answer = p.on_report(report);
        // A resigning leader's landed report: another qualifying live replica leads a new
        // generation, and brokers see the move. A landed report that settled a change of set
        // (rule 11) is a change too: the routing entry stops naming the old set.
        let resigned = report.resign
            && matches!(answer, ReportAnswer::Landed { .. })
            && p.resign(report.leader, |n| live.contains(&n)).is_some();
        if resigned || (unsettled && p.is_settled()) {
            let p = p.clone();
            self.publish_placement(&k, shard, &p);
        }
        Ok(Reply::Report(answer))
    }

    /// Make the routing entry of `shard` of stream `k` say what `p` says (an assigned shard),
    /// and emit the change brokers follow.
    fn publish_placement(&mut self, k: &ObjKey, shard: u32, p: &Placement) {
        let rev = self.revision + 1;
        let s = self
            .streams
            .get_mut(k)
            .expect("a placement's stream exists");
        let sp = s
            .placement
            .iter_mut()
            .find(|sp| sp.shard == shard)
            .expect("a placement's shard exists");
        mirror(sp, p, ShardState::Assigned);
        s.revision = rev;
        let s = s.clone();
        self.emit(ChangeEvent::StreamPut { stream: s });
    }

    /// The operator's way out of an unavailable replicated shard (`felixctl shard abandon`):
    /// promote `to`, or the live replica reported furthest ahead (vouched ones first), though
    /// none qualifies under rule 8. Refused while the shard is not `unavailable`: then
    /// placement promotes a qualifying replica itself, without loss.
    pub(super) fn abandon_shard(
        &mut self,
        tenant: &str,
        namespace: &str,
        stream: &str,
        shard: u32,
        to: Option<u64>,
    ) -> Outcome {
        let k = key(tenant, namespace, stream);
        let state = self
            .stream(tenant, namespace, stream)?
            .placement
            .iter()
            .find(|sp| sp.shard == shard)
            .map(|sp| sp.state);
        let live = self.live();
        let name = format!("shard {shard} of {tenant}/{namespace}/{stream}");
        let Some(p) = self.replicas.get_mut(&(k.clone(), shard)) else {
            return Err(ApiError::new(
                ErrorCode::NotFound,
                format!("{name} is not a replicated shard"),
            ));
        };
        if state != Some(ShardState::Unavailable) {
            return Err(ApiError::new(
                ErrorCode::Conflict,
                format!("{name} is not unavailable: placement promotes a replica that qualifies itself, without loss; abandon is for a shard none qualifies for"),
            ));
        }
        let c = match to {
            Some(c) if !p.set().contains(&c) => {
                return Err(ApiError::invalid(format!(
                    "node {c} is not a replica of {name} (replicas: {:?})",
                    p.set()
                )))
            }
            Some(c) if !live.contains(&c) => {
                return Err(ApiError::new(
                    ErrorCode::Conflict,
                    format!("node {c} is not live: it cannot lead {name}"),
                ))
            }
            Some(c) => c,
            None => {
                let reported = |n: u64| p.reported(n).map(|h| h.pos).unwrap_or_default();
                let best = p
                    .set()
                    .iter()
                    .copied()
                    .filter(|n| live.contains(n))
                    .max_by_key(|&n| (p.vouched(n), reported(n), std::cmp::Reverse(n)));
                best.ok_or_else(|| {
                    ApiError::new(
                        ErrorCode::Conflict,
                        format!("no replica of {name} is live: nothing to promote"),
                    )
                })?
            }
        };
        let a = p
            .abandon(c)
            .map_err(|e| ApiError::invalid(format!("{name}: {e:?}")))?;
        let p = p.clone();
        self.publish_placement(&k, shard, &p);
        Ok(Reply::Abandoned(a))
    }

    /// What placement knows of one stream's replicas: per shard, the leader, the followers, the
    /// generation, the commit mark the landed reports show and each replica's lag behind the
    /// leader's reported end.
    pub fn stream_replication(
        &self,
        tenant: &str,
        namespace: &str,
        stream: &str,
    ) -> Result<StreamReplication, ApiError> {
        let s = self.stream(tenant, namespace, stream)?;
        let k = key(tenant, namespace, stream);
        let shards = s
            .placement
            .iter()
            .map(|sp| {
                let p = self.replicas.get(&(k.clone(), sp.shard));
                self.shard_replication(sp, p)
            })
            .collect();
        Ok(StreamReplication {
            tenant: s.tenant.clone(),
            namespace: s.namespace.clone(),
            name: s.name.clone(),
            replication_factor: s.replication_factor,
            consistency: s.consistency,
            shards,
        })
    }

    fn shard_replication(&self, sp: &ShardPlacement, p: Option<&Placement>) -> ShardReplication {
        let live = |n: u64| self.brokers.get(&n).is_some_and(|b| b.live);
        let Some(p) = p else {
            // One copy, or not seated yet: the routing entry is all there is.
            return ShardReplication {
                shard: sp.shard,
                state: sp.state,
                generation: sp.generation,
                leader: sp.leader,
                followers: Vec::new(),
                commit: None,
                replicas: Vec::new(),
            };
        };
        let (gen, leader) = p.newest();
        let lead_end = leader.and_then(|l| p.reported(l)).map_or(0, |h| h.pos.end);
        let replicas = p
            .set()
            .iter()
            .map(|&n| {
                let h = p.reported(n);
                let end = h.map_or(0, |h| h.pos.end);
                ReplicaLag {
                    node: n,
                    end,
                    last_generation: h.map_or(0, |h| h.pos.last_gen),
                    lag_records: lead_end.saturating_sub(end),
                    lag_bytes: p.behind_bytes(n),
                    vouched: p.vouched(n),
                    live: live(n),
                }
            })
            .collect();
        ShardReplication {
            shard: sp.shard,
            state: sp.state,
            generation: gen,
            leader,
            followers: p
                .set()
                .iter()
                .copied()
                .filter(|&n| Some(n) != leader)
                .collect(),
            commit: Some(p.commit().end),
            replicas,
        }
    }
}

mod replace;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replication::{Holding, Pos, ReportAnswer};

    pub(super) fn preview() -> Catalog {
        let mut c = Catalog::new(Limits {
            replication_preview: true,
            ..Limits::default()
        });
        for cmd in [
            Command::Init {
                catalog_id: "test".into(),
                hold_placement: false,
            },
            Command::CreateTenant {
                req: CreateTenant {
                    name: "t".into(),
                    description: None,
                },
            },
            Command::CreateNamespace {
                tenant: "t".into(),
                req: CreateNamespace {
                    name: "n".into(),
                    description: None,
                },
            },
        ] {
            c.apply(&cmd).unwrap();
        }
        c
    }

    /// Broker `id` registers under storage identity `sid` (None: it sends none).
    pub(super) fn register(c: &mut Catalog, id: u64, sid: Option<u64>) {
        c.apply(&Command::RegisterBroker {
            req: RegisterBroker {
                node_id: id,
                quic_addr: format!("127.0.0.1:{}", 7000 + id),
                cores: 2,
                peer_addr: None,
                capabilities: vec![],
                storage_id: sid.map(|s| format!("{s:016x}")),
            },
        })
        .unwrap();
    }

    pub(super) fn live(c: &mut Catalog, id: u64, live: bool) {
        c.apply(&Command::SetBrokerLive { node_id: id, live })
            .unwrap();
    }

    pub(super) fn create(c: &mut Catalog, name: &str, shards: u32, rf: u32) -> Outcome {
        c.apply(&Command::CreateStream {
            tenant: "t".into(),
            namespace: "n".into(),
            req: CreateStream {
                shards: Some(shards),
                durable: true,
                replication_factor: Some(rf),
                ..CreateStream::named(name)
            },
        })
    }

    pub(super) fn shard(c: &Catalog, name: &str, i: usize) -> ShardPlacement {
        c.stream("t", "n", name).unwrap().placement[i].clone()
    }

    pub(super) fn report(
        c: &mut Catalog,
        name: &str,
        i: u32,
        gen: u64,
        leader: u64,
        seq: u64,
        holders: &[(u64, u64, u64, u64)],
    ) -> ReportAnswer {
        report_resigning(c, name, i, (gen, leader, seq), holders, false)
    }

    /// As [`report`], saying whether the leader resigns.
    fn report_resigning(
        c: &mut Catalog,
        name: &str,
        i: u32,
        (gen, leader, seq): (u64, u64, u64),
        holders: &[(u64, u64, u64, u64)],
        resign: bool,
    ) -> ReportAnswer {
        let holders = holders
            .iter()
            .map(|&(node, last_gen, end, sid)| Holding {
                node,
                pos: Pos { last_gen, end },
                sid,
            })
            .collect();
        let r = Report {
            gen,
            leader,
            seq,
            holders,
            resign,
            behind_bytes: Default::default(),
        };
        match c
            .apply(&Command::ReplicaReport {
                tenant: "t".into(),
                namespace: "n".into(),
                stream: name.into(),
                shard: i,
                report: r,
            })
            .unwrap()
        {
            Reply::Report(a) => a,
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn replicas_are_seated_on_distinct_brokers_with_identities_and_leaders_spread() {
        let mut c = preview();
        register(&mut c, 1, Some(0x11));
        register(&mut c, 2, Some(0x22));
        register(&mut c, 3, None);
        // Two brokers show an identity: a shard of three copies waits unplaced.
        create(&mut c, "s", 3, 3).unwrap();
        assert_eq!(shard(&c, "s", 0).state, ShardState::Unassigned);
        assert!(shard(&c, "s", 0).replicas.is_empty());
        register(&mut c, 3, Some(0x33));
        let mut leaders = BTreeSet::new();
        for i in 0..3 {
            let sp = shard(&c, "s", i);
            assert_eq!(sp.state, ShardState::Assigned);
            assert_eq!(sp.generation, 1);
            assert_eq!(sp.owner, sp.leader);
            assert_eq!(sp.replicas[0], sp.leader.unwrap(), "the leader first");
            let distinct: BTreeSet<u64> = sp.replicas.iter().copied().collect();
            assert_eq!(distinct, BTreeSet::from([1, 2, 3]));
            leaders.insert(sp.leader.unwrap());
        }
        assert_eq!(leaders.len(), 3, "each broker leads one shard");
        // Without the preview, more than one copy is still refused.
        assert_eq!(
            Catalog::replication(None, Some(3), true, 3, false)
                .unwrap_err()
                .code,
            ErrorCode::Unsupported
        );
    }

    /// Broker `n`'s storage identity in these tests.
    pub(super) fn sid(n: u64) -> u64 {
        n * 0x11
    }

    /// Three brokers with identities and stream "s" of one shard and three copies, seated:
    /// its leader and two followers.
    fn three_seated() -> (Catalog, [u64; 3]) {
        let mut c = preview();
        for n in 1..=3 {
            register(&mut c, n, Some(sid(n)));
        }
        create(&mut c, "s", 1, 3).unwrap();
        let sp = shard(&c, "s", 0);
        (c, [sp.leader.unwrap(), sp.replicas[1], sp.replicas[2]])
    }

    #[test]
    fn reports_move_the_mark_and_a_dead_leader_gives_way_to_the_furthest_ahead() {
        let (mut c, [l, f1, f2]) = three_seated();
        // Only the named leader's report lands.
        assert_eq!(
            report(&mut c, "s", 0, 1, f1, 1, &[]),
            ReportAnswer::Refused { gen: 1, newest: 1 }
        );
        let a = report(
            &mut c,
            "s",
            0,
            1,
            l,
            1,
            &[(l, 1, 10, sid(l)), (f1, 1, 7, sid(f1)), (f2, 1, 3, sid(f2))],
        );
        assert!(matches!(a, ReportAnswer::Landed { ref counted, .. } if counted.len() == 3));
        let v = c.stream_replication("t", "n", "s").unwrap();
        let s0 = &v.shards[0];
        assert_eq!((s0.generation, s0.leader, s0.commit), (1, Some(l), Some(7)));
        assert_eq!(
            s0.followers,
            vec![f1, f2]
                .into_iter()
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect::<Vec<_>>()
        );
        let lag: BTreeMap<u64, u64> = s0
            .replicas
            .iter()
            .map(|r| (r.node, r.lag_records))
            .collect();
        assert_eq!(lag, BTreeMap::from([(l, 0), (f1, 3), (f2, 7)]));
        // The mark never moves back on a later report.
        report(
            &mut c,
            "s",
            0,
            1,
            l,
            2,
            &[(l, 1, 10, sid(l)), (f2, 1, 3, sid(f2))],
        );
        assert_eq!(
            c.stream_replication("t", "n", "s").unwrap().shards[0].commit,
            Some(7)
        );

        // The leader dies: the furthest-ahead live replica (f1 at 7) is promoted.
        let rev = c.revision();
        live(&mut c, l, false);
        let sp = shard(&c, "s", 0);
        assert_eq!(
            (sp.leader, sp.owner, sp.generation, sp.state),
            (Some(f1), Some(f1), 2, ShardState::Assigned)
        );
        assert!(c.revision() > rev + 1, "the move is a change brokers see");
        assert_eq!(
            report(&mut c, "s", 0, 1, l, 3, &[]),
            ReportAnswer::Refused { gen: 1, newest: 2 },
            "the deposed leader's report is refused"
        );
        // f1 dies too: f2 is behind what f1 was reported to hold, so none qualifies.
        live(&mut c, f1, false);
        assert_eq!(shard(&c, "s", 0).state, ShardState::Unavailable);
        assert_eq!(
            shard(&c, "s", 0).generation,
            2,
            "no generation issued to no one"
        );
        // f1 returns: it still leads generation 2, and serves again.
        live(&mut c, f1, true);
        let sp = shard(&c, "s", 0);
        assert_eq!(
            (sp.leader, sp.generation, sp.state),
            (Some(f1), 2, ShardState::Assigned)
        );
    }

    #[test]
    fn a_restarted_leader_leads_a_new_generation_or_its_shard_waits_for_one_that_qualifies() {
        let (mut c, [l, f1, f2]) = three_seated();
        report(
            &mut c,
            "s",
            0,
            1,
            l,
            1,
            &[(l, 1, 10, sid(l)), (f1, 1, 7, sid(f1)), (f2, 1, 3, sid(f2))],
        );
        // The leader's process restarts under the same identity, faster than it is counted
        // dead: it cannot lead generation 1 again (rule 1), so it is named at generation 2,
        // being the furthest ahead.
        register(&mut c, l, Some(sid(l)));
        let sp = shard(&c, "s", 0);
        assert_eq!(
            (sp.leader, sp.generation, sp.state),
            (Some(l), 2, ShardState::Assigned)
        );
        // A follower's restart changes no leadership.
        register(&mut c, f2, Some(sid(f2)));
        assert_eq!(shard(&c, "s", 0).generation, 2);
        // The leader restarts under a rotated identity (rule 9) while f1 is down: f2 is behind
        // the mark (7), and the leader's reports no longer vouch for it. Nobody qualifies: the
        // shard waits, with no leader named, rather than stay named at a generation its
        // leader refuses.
        live(&mut c, f1, false);
        register(&mut c, l, Some(sid(l) + 100));
        let sp = shard(&c, "s", 0);
        assert_eq!(
            (sp.state, sp.generation),
            (ShardState::Unavailable, 2),
            "no generation issued to no one"
        );
        // f1 returns, at the mark: it leads generation 3.
        live(&mut c, f1, true);
        let sp = shard(&c, "s", 0);
        assert_eq!(
            (sp.leader, sp.generation, sp.state),
            (Some(f1), 3, ShardState::Assigned)
        );
    }

    #[test]
    fn a_resigning_leader_gives_way_to_a_live_replica_that_qualifies() {
        let (mut c, [l, f1, f2]) = three_seated();
        let holders = [(l, 1, 10, sid(l)), (f1, 1, 7, sid(f1)), (f2, 1, 3, sid(f2))];
        report(&mut c, "s", 0, 1, l, 1, &holders);
        // A follower's report cannot resign for the leader (it is refused).
        let a = report_resigning(&mut c, "s", 0, (1, f1, 1), &holders, true);
        assert!(matches!(a, ReportAnswer::Refused { .. }), "{a:?}");
        assert_eq!(shard(&c, "s", 0).generation, 1);
        // With f1 down, f2 is behind the mark (7): none qualifies, and the leader stays.
        live(&mut c, f1, false);
        let a = report_resigning(&mut c, "s", 0, (1, l, 2), &holders, true);
        assert!(matches!(a, ReportAnswer::Landed { .. }), "{a:?}");
        let sp = shard(&c, "s", 0);
        assert_eq!((sp.leader, sp.generation), (Some(l), 1));
        // f1 is back: the next resigning report names it at generation 2, brokers see the
        // move, and the old leader's next report is refused.
        live(&mut c, f1, true);
        let rev = c.revision();
        report_resigning(&mut c, "s", 0, (1, l, 3), &holders, true);
        let sp = shard(&c, "s", 0);
        assert_eq!(
            (sp.leader, sp.generation, sp.state),
            (Some(f1), 2, ShardState::Assigned)
        );
        assert!(c.revision() > rev, "the move is a change brokers see");
        assert_eq!(
            report(&mut c, "s", 0, 1, l, 4, &holders),
            ReportAnswer::Refused { gen: 1, newest: 2 }
        );
    }

    #[test]
    fn a_rotated_identity_stops_counting_and_the_image_keeps_placements() {
        let (mut c, [l, f1, f2]) = three_seated();
        report(
            &mut c,
            "s",
            0,
            1,
            l,
            1,
            &[(l, 1, 9, sid(l)), (f1, 1, 9, sid(f1)), (f2, 1, 4, sid(f2))],
        );
        // f1's machine crashed: it comes back under a new identity. What it was reported to
        // hold no longer counts: with the leader down, the only vouched replica is f2, behind
        // the mark (9), so none qualifies and the shard waits.
        register(&mut c, f1, Some(0xabc));
        let v = c.stream_replication("t", "n", "s").unwrap();
        let r1 = v.shards[0].replicas.iter().find(|r| r.node == f1).unwrap();
        assert!(!r1.vouched);
        live(&mut c, l, false);
        let sp = shard(&c, "s", 0);
        assert_eq!(
            (sp.leader, sp.generation, sp.state),
            (Some(l), 1, ShardState::Unavailable)
        );
        // The leader comes back: it serves again in its generation.
        live(&mut c, l, true);
        assert_eq!(shard(&c, "s", 0).state, ShardState::Assigned);
        // A catalog restored from its image holds the same placements.
        let back = Catalog::from_image(*c.limits(), c.to_image());
        assert_eq!(back, c);
        // Deleting the stream forgets them.
        let del = c
            .apply(&Command::DeleteStream {
                tenant: "t".into(),
                namespace: "n".into(),
                name: "s".into(),
            })
            .unwrap();
        let Reply::Stream(s) = del else { panic!() };
        c.apply(&Command::FinishStreamDelete {
            tenant: "t".into(),
            namespace: "n".into(),
            name: "s".into(),
            revision: s.revision,
        })
        .unwrap();
        assert!(c.replicas.is_empty());
    }

    fn abandon(c: &mut Catalog, to: Option<u64>) -> Outcome {
        c.apply(&Command::AbandonShard {
            tenant: "t".into(),
            namespace: "n".into(),
            stream: "s".into(),
            shard: 0,
            to,
        })
    }

    #[test]
    fn abandon_promotes_past_rule_8_only_where_no_replica_qualifies_and_says_what_is_lost() {
        let (mut c, [l, f1, f2]) = three_seated();
        report(
            &mut c,
            "s",
            0,
            1,
            l,
            1,
            &[(l, 1, 12, sid(l)), (f1, 1, 9, sid(f1)), (f2, 1, 4, sid(f2))],
        );
        // A shard that is served, or that a replica qualifies for, is not abandoned.
        assert_eq!(abandon(&mut c, None).unwrap_err().code, ErrorCode::Conflict);
        // f1, then the leader, die: f2 is behind the mark (9), so the shard waits.
        live(&mut c, f1, false);
        live(&mut c, l, false);
        assert_eq!(shard(&c, "s", 0).state, ShardState::Unavailable);
        assert_eq!(
            abandon(&mut c, Some(f1)).unwrap_err().code,
            ErrorCode::Conflict,
            "a dead replica cannot lead"
        );
        assert_eq!(
            abandon(&mut c, Some(9)).unwrap_err().code,
            ErrorCode::InvalidRequest,
            "not a replica"
        );
        let rev = c.revision();
        let Reply::Abandoned(a) = abandon(&mut c, None).unwrap() else {
            panic!()
        };
        assert_eq!((a.assignment.leader, a.assignment.gen), (f2, 2));
        assert_eq!(
            (a.kept.end, a.commit.end),
            (4, 9),
            "records 4..9 may be lost"
        );
        let sp = shard(&c, "s", 0);
        assert_eq!(
            (sp.leader, sp.generation, sp.state),
            (Some(f2), 2, ShardState::Assigned)
        );
        assert!(c.revision() > rev, "brokers see the new leader");
        // The mark dropped to what f2 holds: placement works from it again. f2 reports at
        // generation 2 and f1 returns; when f2 dies, f1 (copied to 6 of generation 2)
        // qualifies and is promoted by rule 8, no abandon needed.
        live(&mut c, f1, true);
        report(
            &mut c,
            "s",
            0,
            2,
            f2,
            1,
            &[(f2, 2, 6, sid(f2)), (f1, 2, 6, sid(f1))],
        );
        live(&mut c, f2, false);
        let sp = shard(&c, "s", 0);
        assert_eq!(
            (sp.leader, sp.generation, sp.state),
            (Some(f1), 3, ShardState::Assigned)
        );
    }
}
