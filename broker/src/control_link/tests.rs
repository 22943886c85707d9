use super::*;
use crate::catalog::Place;
use api::{Change, Consistency, Namespace, ShardPlacement, Tenant};
use felix_quic::wire::{ErrorCode, StreamName};

fn stream(name: &str, created: u64, owners: &[Option<u64>], state: ResourceState) -> api::Stream {
    api::Stream {
        tenant: "t".into(),
        namespace: "n".into(),
        name: name.into(),
        shards: owners.len() as u32,
        durable: false,
        retention_bytes: None,
        retention_seconds: None,
        fsync: FsyncMode::Periodic,
        consistency: Consistency::Leader,
        replication_factor: 1,
        state,
        created_revision: created,
        revision: created,
        placement: owners
            .iter()
            .enumerate()
            .map(|(i, o)| ShardPlacement {
                shard: i as u32,
                owner: *o,
                generation: 1,
                state: if o.is_some() {
                    ShardState::Assigned
                } else {
                    ShardState::Unassigned
                },
                replicas: o.iter().copied().collect(),
                leader: *o,
                settled: Vec::new(),
            })
            .collect(),
    }
}

fn broker(id: u64) -> api::Broker {
    api::Broker {
        node_id: id,
        quic_addr: format!("10.0.0.{id}:7400"),
        cores: 2,
        live: true,
        incarnation: 1,
        revision: 1,
        peer_addr: None,
        storage_id: None,
        storage_id_since: None,
    }
}

fn snapshot(revision: u64) -> CatalogSnapshot {
    CatalogSnapshot {
        placement_held: false,
        catalog_id: "c1".into(),
        revision,
        tenants: vec![Tenant {
            name: "t".into(),
            description: None,
            created_revision: 1,
            revision: 1,
        }],
        namespaces: vec![Namespace {
            tenant: "t".into(),
            name: "n".into(),
            description: None,
            created_revision: 2,
            revision: 2,
        }],
        streams: vec![],
        caches: vec![],
        brokers: vec![broker(1), broker(2)],
    }
}

fn page(changes: Vec<(u64, ChangeEvent)>, revision: u64) -> ChangesPage {
    let next = changes.last().map(|c| c.0).unwrap_or(revision);
    ChangesPage {
        catalog_id: "c1".into(),
        next_since: next,
        revision,
        changes: changes
            .into_iter()
            .map(|(revision, event)| Change { revision, event })
            .collect(),
        more: false,
    }
}

fn put(s: api::Stream) -> ChangeEvent {
    ChangeEvent::StreamPut { stream: s }
}

#[test]
fn feed_applies_in_order_and_refuses_gaps_and_other_catalogs() {
    let mut m = Mirror::from_snapshot(snapshot(3));
    let before = m.clone();
    // A gap (4 missing) is refused whole: nothing applied.
    let gap = page(
        vec![(5, put(stream("s", 5, &[Some(1)], ResourceState::Active)))],
        5,
    );
    assert!(m.apply(&gap).is_err());
    assert_eq!(m, before);
    let mut other = page(vec![], 3);
    other.catalog_id = "c2".into();
    assert!(m.apply(&other).is_err(), "a replaced catalog means resync");
    assert_eq!(
        m.apply(&page(vec![], 3)),
        Ok(false),
        "an empty page changes nothing"
    );
    let ok = page(
        vec![
            (
                4,
                put(stream("s", 4, &[Some(1), Some(2)], ResourceState::Active)),
            ),
            (
                5,
                ChangeEvent::TenantPut {
                    tenant: Tenant {
                        name: "u".into(),
                        description: None,
                        created_revision: 5,
                        revision: 5,
                    },
                },
            ),
        ],
        5,
    );
    assert_eq!(m.apply(&ok), Ok(true));
    assert_eq!(m.revision, 5);
    let v = m.view();
    assert_eq!(v.streams.len(), 1);
    assert!(v.tenants.contains("u"));
    // Replaying an old page is a gap too (revision 4 again).
    assert!(m.apply(&ok).is_err());
}

#[test]
fn catalog_versions_keep_slots_and_route_by_placement() {
    let name = StreamName::new("t", "n", "s");
    let mut m = Mirror::from_snapshot(snapshot(3));
    m.apply(&page(
        vec![(
            4,
            put(stream(
                "s",
                4,
                &[Some(1), Some(2), None],
                ResourceState::Active,
            )),
        )],
        4,
    ))
    .unwrap();
    let c1 = Catalog::from_view(&Catalog::default(), &m.view(), 1, false);
    let (idx, def) = c1.lookup(&name).unwrap();
    assert_eq!((idx, def.shards), (0, 3));
    assert_eq!(c1.slot(0).places[0], Place::Mine { generation: 1 });
    assert!(c1.serve_check(0, 0).is_ok());
    let (code, msg) = c1.serve_check(0, 1).unwrap_err();
    assert_eq!(code, ErrorCode::NotLeader);
    assert!(msg.contains("broker 2 at 10.0.0.2:7400"), "{msg}");
    assert_eq!(c1.serve_check(0, 2).unwrap_err().0, ErrorCode::Unavailable);
    assert_eq!(
        c1.lookup(&StreamName::new("t", "x", "s")).unwrap_err().0,
        ErrorCode::UnknownNamespace
    );
    assert_eq!(
        c1.lookup(&StreamName::new("t", "n", "x")).unwrap_err().0,
        ErrorCode::UnknownStream
    );

    // Deleting: the slot is kept, marked deleted; lookups no longer find the name.
    m.apply(&page(
        vec![(
            5,
            put(stream(
                "s",
                4,
                &[Some(1), Some(2), None],
                ResourceState::Deleting,
            )),
        )],
        5,
    ))
    .unwrap();
    let c2 = Catalog::from_view(&c1, &m.view(), 1, false);
    assert!(c2.slot(0).deleted);
    assert_eq!(c2.lookup(&name).unwrap_err().0, ErrorCode::UnknownStream);
    assert_eq!(
        c2.serve_check(0, 0).unwrap_err().0,
        ErrorCode::StreamDeleted
    );

    // Gone, then created again: a new incarnation takes a new slot; the old stays deleted.
    m.apply(&page(
        vec![
            (
                6,
                ChangeEvent::StreamDeleted {
                    tenant: "t".into(),
                    namespace: "n".into(),
                    name: "s".into(),
                },
            ),
            (7, put(stream("s", 7, &[Some(1)], ResourceState::Active))),
        ],
        7,
    ))
    .unwrap();
    let c3 = Catalog::from_view(&c2, &m.view(), 1, false);
    assert_eq!(c3.slots().len(), 2);
    assert!(c3.slot(0).deleted);
    let (idx, def) = c3.lookup(&name).unwrap();
    assert_eq!((idx, def.shards, c3.slot(1).incarnation), (1, 1, 7));

    // A re-created stream never reuses a slot even if the new version arrives in one jump.
    m.apply(&page(
        vec![(8, put(stream("s", 8, &[Some(1)], ResourceState::Active)))],
        8,
    ))
    .unwrap();
    let c4 = Catalog::from_view(&c3, &m.view(), 1, false);
    assert_eq!(c4.lookup(&name).unwrap().0, 2);
    assert!(c4.slot(1).deleted);

    // Fenced: nothing is served.
    let c5 = Catalog::from_view(&c4, &m.view(), 1, true);
    assert_eq!(c5.serve_check(2, 0).unwrap_err().0, ErrorCode::Unavailable);
}

#[test]
fn durable_owner_down_is_unavailable_and_settings_follow_updates() {
    let mut s = stream("d", 4, &[Some(2)], ResourceState::Active);
    s.durable = true;
    s.fsync = FsyncMode::OnCommit;
    s.placement[0].state = ShardState::Unavailable;
    let mut m = Mirror::from_snapshot(snapshot(3));
    m.apply(&page(vec![(4, put(s.clone()))], 4)).unwrap();
    let c1 = Catalog::from_view(&Catalog::default(), &m.view(), 1, false);
    assert_eq!(c1.slot(0).places[0], Place::OwnerDown { owner: 2 });
    let (code, msg) = c1.serve_check(0, 0).unwrap_err();
    assert_eq!(code, ErrorCode::Unavailable);
    assert!(msg.contains("not moved"), "{msg}");
    assert_eq!(c1.slot(0).def.fsync.as_deref(), Some("on_commit"));
    s.retention_bytes = Some(1 << 20);
    s.placement[0].state = ShardState::Assigned;
    s.placement[0].owner = Some(1);
    m.apply(&page(vec![(5, put(s))], 5)).unwrap();
    let c2 = Catalog::from_view(&c1, &m.view(), 1, false);
    assert_eq!(c2.slots().len(), 1, "same incarnation, same slot");
    assert_eq!(c2.slot(0).def.retention_bytes, Some(1 << 20));
    assert!(c2.serve_check(0, 0).is_ok());
}

/// A stream of more than one copy (a control plane with `--replication-preview`) is not
/// served by this build, even on the broker placement names its leader: one copy would
/// restart its offsets at every failover. The refusal is typed and names the leader.
#[test]
fn a_replicated_shard_is_served_by_its_leader_only() {
    let mut s = stream("r", 4, &[Some(1)], ResourceState::Active);
    s.durable = true;
    s.replication_factor = 3;
    s.consistency = Consistency::Quorum;
    s.placement[0].leader = Some(1);
    s.placement[0].replicas = vec![1, 2, 3];
    s.placement[0].generation = 2;
    let mut m = Mirror::from_snapshot(snapshot(3));
    m.apply(&page(vec![(4, put(s.clone()))], 4)).unwrap();
    let c = Catalog::from_view(&Catalog::default(), &m.view(), 1, false);
    assert_eq!(
        c.slot(0).places[0],
        Place::Replicated {
            leader: 1,
            mine: true,
            generation: 2,
            replicas: vec![1, 2, 3],
            settled: vec![],
        }
    );
    assert!(
        c.slot(0).def.quorum,
        "quorum consistency reaches the broker"
    );
    assert!(c.serve_check(0, 0).is_ok(), "its leader serves it");
    assert!(c.replicated(0, 0));
    assert_eq!(c.shard_owners(0, 1), vec![1]);
    // Another replica refuses it, naming the leader; its owner is the leader.
    let c2 = Catalog::from_view(&Catalog::default(), &m.view(), 2, false);
    let (code, msg) = c2.serve_check(0, 0).unwrap_err();
    assert_eq!(code, ErrorCode::NotLeader);
    assert!(msg.contains("led by broker 1"), "{msg}");
    assert_eq!(c2.shard_owners(0, 2), vec![1]);
    // A shard no replica may lead is unavailable everywhere.
    s.placement[0].leader = None;
    m.apply(&page(vec![(5, put(s))], 5)).unwrap();
    let c3 = Catalog::from_view(&c2, &m.view(), 2, false);
    assert_eq!(c3.serve_check(0, 0).unwrap_err().0, ErrorCode::Unavailable);
}
