use super::*;
use proptest::prelude::*;

fn cat() -> Catalog {
    let mut c = Catalog::new(Limits::default());
    c.apply(&Command::Init {
        catalog_id: "test".into(),
        hold_placement: false,
    })
    .unwrap();
    c
}

fn tenant(c: &mut Catalog, t: &str) -> Outcome {
    c.apply(&Command::CreateTenant {
        req: CreateTenant {
            name: t.into(),
            description: None,
        },
    })
}

fn ns(c: &mut Catalog, t: &str, n: &str) -> Outcome {
    c.apply(&Command::CreateNamespace {
        tenant: t.into(),
        req: CreateNamespace {
            name: n.into(),
            description: None,
        },
    })
}

fn stream(c: &mut Catalog, name: &str, shards: u32, durable: bool) -> Outcome {
    c.apply(&Command::CreateStream {
        tenant: "t".into(),
        namespace: "n".into(),
        req: CreateStream {
            shards: Some(shards),
            durable,
            ..CreateStream::named(name)
        },
    })
}

fn code(o: Outcome) -> ErrorCode {
    o.unwrap_err().code
}

fn broker(c: &mut Catalog, id: u64) -> Outcome {
    c.apply(&Command::RegisterBroker {
        req: RegisterBroker {
            node_id: id,
            quic_addr: format!("127.0.0.1:{}", 7000 + id),
            cores: 2,
            peer_addr: None,
            capabilities: vec![],
            storage_id: None,
        },
    })
}

fn base() -> Catalog {
    let mut c = cat();
    tenant(&mut c, "t").unwrap();
    ns(&mut c, "t", "n").unwrap();
    c
}

#[test]
fn create_get_and_duplicates() {
    let mut c = base();
    assert_eq!(code(tenant(&mut c, "t")), ErrorCode::AlreadyExists);
    assert_eq!(code(ns(&mut c, "t", "n")), ErrorCode::AlreadyExists);
    assert_eq!(code(ns(&mut c, "nope", "n")), ErrorCode::UnknownTenant);
    let Reply::Stream(s) = stream(&mut c, "s", 3, false).unwrap() else {
        panic!()
    };
    assert_eq!(s.shards, 3);
    assert_eq!(s.revision, c.revision());
    assert_eq!(
        code(stream(&mut c, "s", 3, false)),
        ErrorCode::AlreadyExists
    );
    assert_eq!(c.stream("t", "n", "s").unwrap(), &s);
    assert_eq!(
        c.stream("t", "n", "x").unwrap_err().code,
        ErrorCode::UnknownStream
    );
    assert_eq!(
        c.stream("t", "m", "x").unwrap_err().code,
        ErrorCode::UnknownNamespace
    );
}

#[test]
fn names_are_validated() {
    let mut c = cat();
    for bad in ["", "a/b", ".x", "sp ace", &"x".repeat(65), "é"] {
        assert_eq!(code(tenant(&mut c, bad)), ErrorCode::InvalidName, "{bad:?}");
    }
    assert!(tenant(&mut c, &"x".repeat(64)).is_ok());
    assert_eq!(c.revision(), 1);
}

#[test]
fn unsupported_fields_are_refused() {
    let mut c = base();
    let repl = |c: &mut Catalog, rf: u32, q: bool, durable: bool| {
        c.apply(&Command::CreateStream {
            tenant: "t".into(),
            namespace: "n".into(),
            req: CreateStream {
                replication_factor: Some(rf),
                consistency: q.then_some(Consistency::Quorum),
                durable,
                ..CreateStream::named("s")
            },
        })
    };
    // Bad input first, each with its reason; then what is valid but not built.
    let msg = |r: Outcome| r.unwrap_err().message;
    assert!(msg(repl(&mut c, 0, false, true)).contains("1..=5"));
    assert!(msg(repl(&mut c, 6, false, true)).contains("1..=5"));
    assert!(msg(repl(&mut c, 3, false, false)).contains("durable"));
    assert!(msg(repl(&mut c, 1, true, false)).contains("durable"));
    let e = repl(&mut c, 3, false, true).unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidRequest);
    assert!(e.message.contains("0 registered"), "{}", e.message);
    for id in 1..=3 {
        broker(&mut c, id).unwrap();
    }
    assert!(msg(repl(&mut c, 4, false, true)).contains("3 registered"));
    assert_eq!(code(repl(&mut c, 3, false, true)), ErrorCode::Unsupported);
    assert_eq!(code(repl(&mut c, 1, true, true)), ErrorCode::Unsupported);
    assert_eq!(
        c.stream("t", "n", "s").err().map(|e| e.code),
        Some(ErrorCode::UnknownStream)
    );
    assert_eq!(
        code(stream(&mut c, "s", 0, false)),
        ErrorCode::InvalidRequest
    );
    assert_eq!(
        code(stream(&mut c, "s", 4097, false)),
        ErrorCode::InvalidRequest
    );
    stream(&mut c, "s", 2, false).unwrap();
    let r = c.apply(&Command::UpdateStream {
        tenant: "t".into(),
        namespace: "n".into(),
        name: "s".into(),
        req: UpdateStream {
            shards: Some(3),
            ..Default::default()
        },
    });
    assert_eq!(code(r), ErrorCode::Unsupported);
    // Copies and consistency are settled at creation; asking for the same is no change.
    let upd = |c: &mut Catalog, rf: Option<u32>, q: Option<Consistency>| {
        c.apply(&Command::UpdateStream {
            tenant: "t".into(),
            namespace: "n".into(),
            name: "s".into(),
            req: UpdateStream {
                replication_factor: rf,
                consistency: q,
                ..Default::default()
            },
        })
    };
    let rev = c.revision();
    assert_eq!(code(upd(&mut c, Some(3), None)), ErrorCode::Unsupported);
    assert_eq!(
        code(upd(&mut c, None, Some(Consistency::Quorum))),
        ErrorCode::Unsupported
    );
    upd(&mut c, Some(1), Some(Consistency::Leader)).unwrap();
    assert_eq!(c.revision(), rev);
}

#[test]
fn delete_is_two_phase_and_blocks_recreate() {
    let mut c = base();
    stream(&mut c, "s", 1, false).unwrap();
    let del = Command::DeleteStream {
        tenant: "t".into(),
        namespace: "n".into(),
        name: "s".into(),
    };
    let Reply::Stream(s) = c.apply(&del).unwrap() else {
        panic!()
    };
    assert_eq!(s.state, ResourceState::Deleting);
    let rev = c.revision();
    // Deleting again is idempotent and changes nothing.
    c.apply(&del).unwrap();
    assert_eq!(c.revision(), rev);
    assert_eq!(code(stream(&mut c, "s", 1, false)), ErrorCode::Conflict);
    let upd = Command::UpdateStream {
        tenant: "t".into(),
        namespace: "n".into(),
        name: "s".into(),
        req: UpdateStream::default(),
    };
    assert_eq!(code(c.apply(&upd)), ErrorCode::Conflict);
    // The namespace cannot go while the stream is deleting.
    let dn = Command::DeleteNamespace {
        tenant: "t".into(),
        name: "n".into(),
    };
    assert_eq!(code(c.apply(&dn)), ErrorCode::Conflict);
    // A stale finish is a no-op.
    c.apply(&Command::FinishStreamDelete {
        tenant: "t".into(),
        namespace: "n".into(),
        name: "s".into(),
        revision: s.revision - 1,
    })
    .unwrap();
    assert!(c.stream("t", "n", "s").is_ok());
    c.apply(&Command::FinishStreamDelete {
        tenant: "t".into(),
        namespace: "n".into(),
        name: "s".into(),
        revision: s.revision,
    })
    .unwrap();
    assert!(c.stream("t", "n", "s").is_err());
    stream(&mut c, "s", 1, false).unwrap();
    assert_eq!(
        code(c.apply(&Command::DeleteTenant { name: "t".into() })),
        ErrorCode::Conflict
    );
}

#[test]
fn placement_follows_brokers() {
    let mut c = base();
    stream(&mut c, "e", 4, false).unwrap();
    stream(&mut c, "d", 4, true).unwrap();
    assert!(c
        .stream("t", "n", "e")
        .unwrap()
        .placement
        .iter()
        .all(|p| p.state == ShardState::Unassigned));
    broker(&mut c, 1).unwrap();
    broker(&mut c, 2).unwrap();
    let e = c.stream("t", "n", "e").unwrap().clone();
    assert_eq!(e.placement.iter().filter(|p| p.owner == Some(2)).count(), 2);
    // The durable stream was placed whole on broker 1 and does not move when 2 joins.
    let d = c.stream("t", "n", "d").unwrap().clone();
    assert!(d.placement.iter().all(|p| p.owner == Some(1)));
    c.apply(&Command::SetBrokerLive {
        node_id: 1,
        live: false,
    })
    .unwrap();
    let e = c.stream("t", "n", "e").unwrap();
    assert!(e.placement.iter().all(|p| p.owner == Some(2)));
    let d = c.stream("t", "n", "d").unwrap();
    assert!(d
        .placement
        .iter()
        .all(|p| p.owner == Some(1) && p.state == ShardState::Unavailable));
    // A new stream goes to the live broker only.
    let Reply::Stream(n) = stream(&mut c, "later", 2, true).unwrap() else {
        panic!()
    };
    assert!(n.placement.iter().all(|p| p.owner == Some(2)));
}

/// The settle window: a catalog started holding placement leaves every shard unplaced while
/// brokers register, then spreads them over all of them at once; a second release is a no-op.
/// Without the hold, the first broker takes every durable shard (durable RF=1 shards stay put).
#[test]
fn the_settle_window_spreads_shards_over_brokers_starting_together() {
    let held = |hold: bool| {
        let mut c = Catalog::new(Limits::default());
        c.apply(&Command::Init {
            catalog_id: "w".into(),
            hold_placement: hold,
        })
        .unwrap();
        tenant(&mut c, "t").unwrap();
        ns(&mut c, "t", "n").unwrap();
        stream(&mut c, "s", 8, true).unwrap();
        for id in 1..=3 {
            broker(&mut c, id).unwrap();
        }
        c
    };
    let count = |c: &Catalog| {
        let mut n = std::collections::BTreeMap::<u64, usize>::new();
        for p in &c.stream("t", "n", "s").unwrap().placement {
            if let Some(o) = p.owner {
                *n.entry(o).or_default() += 1;
            }
        }
        n
    };
    let mut c = held(true);
    assert!(c.placement_held());
    assert!(count(&c).is_empty(), "nothing placed in the window");
    let rev = c.revision();
    c.apply(&Command::ReleasePlacement).unwrap();
    assert!(
        !c.placement_held() && c.revision() > rev,
        "the release is a change"
    );
    let n = count(&c);
    assert_eq!(n.values().sum::<usize>(), 8);
    let (lo, hi) = (n.values().min().unwrap(), n.values().max().unwrap());
    assert!(n.len() == 3 && hi - lo <= 1, "{n:?}");
    let rev = c.revision();
    c.apply(&Command::ReleasePlacement).unwrap();
    assert_eq!(c.revision(), rev);
    // The snapshot carries the hold (a restart keeps it).
    let img = CatalogImage {
        snapshot: held(true).snapshot(),
        changes: vec![],
        auth: Default::default(),
        replicas: vec![],
    };
    assert!(Catalog::from_image(Limits::default(), img).placement_held());
    // Without the window the first broker took them all.
    assert_eq!(count(&held(false)).get(&1), Some(&8));
}

#[test]
fn re_registration_bumps_incarnation() {
    let mut c = base();
    let Reply::Broker(b) = broker(&mut c, 5).unwrap() else {
        panic!()
    };
    assert_eq!(b.incarnation, 1);
    let Reply::Broker(b) = broker(&mut c, 5).unwrap() else {
        panic!()
    };
    assert_eq!(b.incarnation, 2);
    let bad = c.apply(&Command::RegisterBroker {
        req: RegisterBroker {
            node_id: 6,
            quic_addr: "nohost".into(),
            cores: 1,
            peer_addr: None,
            capabilities: vec![],
            storage_id: None,
        },
    });
    assert_eq!(code(bad), ErrorCode::InvalidRequest);
}

/// Rule 9's registration: the storage identity is kept with the broker, and the revision it
/// was first seen at moves only when it changes; a malformed one is refused and changes
/// nothing.
#[test]
fn the_storage_identity_is_registered_and_its_revision_moves_only_when_it_rotates() {
    let mut c = base();
    let reg = |c: &mut Catalog, sid: Option<&str>| {
        c.apply(&Command::RegisterBroker {
            req: RegisterBroker {
                node_id: 3,
                quic_addr: "127.0.0.1:7003".into(),
                cores: 1,
                peer_addr: None,
                capabilities: vec!["storage_id".into()],
                storage_id: sid.map(String::from),
            },
        })
    };
    let Reply::Broker(b) = reg(&mut c, Some("00000000000000aa")).unwrap() else {
        panic!()
    };
    let first = b.storage_id_since.expect("registered with an identity");
    assert_eq!(b.storage_id.as_deref(), Some("00000000000000aa"));
    assert_eq!(first, b.revision);
    // A restart that kept the identity.
    let Reply::Broker(b) = reg(&mut c, Some("00000000000000aa")).unwrap() else {
        panic!()
    };
    assert_eq!((b.incarnation, b.storage_id_since), (2, Some(first)));
    // A rotation.
    let Reply::Broker(b) = reg(&mut c, Some("00000000000000bb")).unwrap() else {
        panic!()
    };
    assert_eq!(b.storage_id_since, Some(b.revision));
    assert!(b.revision > first);
    for bad in [
        "00000000000000BB",
        "abc",
        "00000000000000gg",
        "00000000000000aaa",
    ] {
        let rev = c.revision();
        assert_eq!(
            code(reg(&mut c, Some(bad))),
            ErrorCode::InvalidRequest,
            "{bad}"
        );
        assert_eq!(c.revision(), rev, "a refused registration changes nothing");
    }
    assert_eq!(
        c.broker(3).unwrap().storage_id.as_deref(),
        Some("00000000000000bb")
    );
    // A broker without a durable directory has none.
    let Reply::Broker(b) = reg(&mut c, None).unwrap() else {
        panic!()
    };
    assert_eq!((b.storage_id, b.storage_id_since), (None, None));
}

#[test]
fn change_ring_is_bounded_and_typed() {
    let mut c = Catalog::new(Limits {
        change_log_len: 5,
        ..Limits::default()
    });
    for i in 0..10 {
        tenant(&mut c, &format!("t{i}")).unwrap();
    }
    assert_eq!(c.revision(), 10);
    assert_eq!(c.oldest_since(), 5);
    assert_eq!(
        c.changes_since(4, 100).unwrap_err().code,
        ErrorCode::RevisionTooOld
    );
    assert_eq!(
        c.changes_since(11, 100).unwrap_err().code,
        ErrorCode::RevisionTooOld
    );
    let p = c.changes_since(5, 2).unwrap();
    assert_eq!(
        p.changes.iter().map(|c| c.revision).collect::<Vec<_>>(),
        vec![6, 7]
    );
    assert!(p.more);
    assert_eq!(p.next_since, 7);
    let p = c.changes_since(10, 2).unwrap();
    assert!(p.changes.is_empty() && !p.more && p.next_since == 10);
}

#[test]
fn image_round_trips() {
    let mut c = base();
    broker(&mut c, 1).unwrap();
    stream(&mut c, "s", 3, true).unwrap();
    let json = serde_json::to_string(&c.to_image()).unwrap();
    let back = Catalog::from_image(Limits::default(), serde_json::from_str(&json).unwrap());
    assert_eq!(back, c);
}

/// A leader's report travels inside the internally tagged `Command`: forwarded from a member
/// to the Raft leader, shipped to the other members, written to the Raft log and read back at
/// a restart, all as JSON. Its per-node maps keep their integer keys through serde's buffered
/// path (they were refused there: "invalid type: string \"1\", expected u64").
#[test]
fn a_replica_report_round_trips_through_json_inside_a_command() {
    use crate::replication::{Holding, Pos, Report};
    let report = Report {
        gen: 3,
        leader: 1,
        seq: 9,
        holders: vec![Holding {
            node: 2,
            pos: Pos {
                last_gen: 3,
                end: 40,
            },
            sid: 7,
        }],
        resign: false,
        behind_bytes: BTreeMap::from([(1, 0), (2, 4_096)]),
    };
    let cmd = Command::ReplicaReport {
        tenant: "t".into(),
        namespace: "n".into(),
        stream: "s".into(),
        shard: 0,
        report,
    };
    let json = serde_json::to_string(&cmd).unwrap();
    assert!(
        json.contains(r#""behind_bytes":{"1":0,"2":4096}"#),
        "{json}"
    );
    let back: Command = serde_json::from_str(&json).unwrap();
    assert_eq!(serde_json::to_string(&back).unwrap(), json);
    // As a Raft log entry is read back: from a buffered value.
    let v: serde_json::Value = serde_json::from_str(&json).unwrap();
    let back: Command = serde_json::from_value(v).unwrap();
    assert_eq!(serde_json::to_string(&back).unwrap(), json);
}

// ---- property tests ----

fn arb_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("a".to_string()),
        Just("b".to_string()),
        Just("c".to_string()),
        Just("bad/name".to_string()),
    ]
}

fn arb_cmd() -> impl Strategy<Value = Command> {
    let tn = || arb_name();
    prop_oneof![
        tn().prop_map(|name| Command::CreateTenant {
            req: CreateTenant {
                name,
                description: None
            }
        }),
        tn().prop_map(|name| Command::DeleteTenant { name }),
        (tn(), tn()).prop_map(|(tenant, name)| Command::CreateNamespace {
            tenant,
            req: CreateNamespace {
                name,
                description: Some("d".into())
            }
        }),
        (tn(), tn()).prop_map(|(tenant, name)| Command::DeleteNamespace { tenant, name }),
        (tn(), tn(), tn(), 0u32..6, any::<bool>(), 0u32..3).prop_map(
            |(tenant, namespace, name, shards, durable, rf)| Command::CreateStream {
                tenant,
                namespace,
                req: CreateStream {
                    shards: Some(shards),
                    durable,
                    replication_factor: Some(rf),
                    ..CreateStream::named(name)
                }
            }
        ),
        (tn(), tn(), tn(), 0u64..3).prop_map(|(tenant, namespace, name, r)| {
            Command::UpdateStream {
                tenant,
                namespace,
                name,
                req: UpdateStream {
                    retention_bytes: Some(r),
                    ..Default::default()
                },
            }
        }),
        (tn(), tn(), tn()).prop_map(|(tenant, namespace, name)| Command::DeleteStream {
            tenant,
            namespace,
            name
        }),
        (tn(), tn(), tn(), 0u64..40).prop_map(|(tenant, namespace, name, revision)| {
            Command::FinishStreamDelete {
                tenant,
                namespace,
                name,
                revision,
            }
        }),
        (tn(), tn(), tn(), 1u32..4).prop_map(|(tenant, namespace, name, shards)| {
            Command::CreateCache {
                tenant,
                namespace,
                req: CreateCache {
                    name,
                    shards: Some(shards),
                    durable: false,
                    ttl_seconds: None,
                },
            }
        }),
        (tn(), tn(), tn()).prop_map(|(tenant, namespace, name)| Command::DeleteCache {
            tenant,
            namespace,
            name
        }),
        (0u64..4).prop_map(|id| Command::RegisterBroker {
            req: RegisterBroker {
                node_id: id,
                quic_addr: "h:1".into(),
                cores: 1,
                peer_addr: None,
                capabilities: vec![],
                storage_id: None,
            }
        }),
        (0u64..4, any::<bool>())
            .prop_map(|(node_id, live)| Command::SetBrokerLive { node_id, live }),
    ]
}

/// Rebuild a catalog from nothing but the change feed, the way a broker does.
fn replay(changes: &[Change]) -> CatalogSnapshot {
    let mut t = BTreeMap::new();
    let mut n = BTreeMap::new();
    let mut s = BTreeMap::new();
    let mut ca = BTreeMap::new();
    let mut b = BTreeMap::new();
    for ch in changes {
        match &ch.event {
            ChangeEvent::TenantPut { tenant } => {
                t.insert(tenant.name.clone(), tenant.clone());
            }
            ChangeEvent::TenantDeleted { name } => {
                t.remove(name);
            }
            ChangeEvent::NamespacePut { namespace } => {
                n.insert(
                    (namespace.tenant.clone(), namespace.name.clone()),
                    namespace.clone(),
                );
            }
            ChangeEvent::NamespaceDeleted { tenant, name } => {
                n.remove(&(tenant.clone(), name.clone()));
            }
            ChangeEvent::StreamPut { stream } => {
                s.insert(
                    key(&stream.tenant, &stream.namespace, &stream.name),
                    stream.clone(),
                );
            }
            ChangeEvent::StreamDeleted {
                tenant,
                namespace,
                name,
            } => {
                s.remove(&key(tenant, namespace, name));
            }
            ChangeEvent::CachePut { cache } => {
                ca.insert(
                    key(&cache.tenant, &cache.namespace, &cache.name),
                    cache.clone(),
                );
            }
            ChangeEvent::CacheDeleted {
                tenant,
                namespace,
                name,
            } => {
                ca.remove(&key(tenant, namespace, name));
            }
            ChangeEvent::BrokerPut { broker } => {
                b.insert(broker.node_id, broker.clone());
            }
        }
    }
    CatalogSnapshot {
        catalog_id: String::new(),
        revision: changes.last().map(|c| c.revision).unwrap_or(0),
        tenants: t.into_values().collect(),
        namespaces: n.into_values().collect(),
        streams: s.into_values().collect(),
        caches: ca.into_values().collect(),
        brokers: b.into_values().collect(),
        placement_held: false,
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Determinism, gap-free revisions, refusals change nothing, the feed replays to the
    /// snapshot, and images round-trip.
    #[test]
    fn state_machine_properties(cmds in proptest::collection::vec(arb_cmd(), 1..60)) {
        let mut a = Catalog::new(Limits { change_log_len: 1000, ..Limits::default() });
        let mut b = Catalog::new(Limits { change_log_len: 1000, ..Limits::default() });
        for cmd in &cmds {
            let before = a.clone();
            let ra = a.apply(cmd);
            let rb = b.apply(cmd);
            prop_assert_eq!(&ra, &rb);
            if ra.is_err() {
                prop_assert_eq!(&a, &before, "a refusal changed the catalog");
            }
            // Every shard owner is a registered broker; every live-only ephemeral placement is on live brokers.
            for s in a.all_streams() {
                prop_assert_eq!(s.placement.len() as u32, s.shards);
                prop_assert!(s.replication_factor == 1);
                for p in &s.placement {
                    if let Some(o) = p.owner { prop_assert!(a.brokers.contains_key(&o)); }
                }
            }
            // Every namespace has its tenant; every stream its namespace.
            for n in a.namespaces.values() { prop_assert!(a.tenants.contains_key(&n.tenant)); }
            for s in a.streams.values() { prop_assert!(a.namespaces.contains_key(&(s.tenant.clone(), s.namespace.clone()))); }
        }
        let revs: Vec<u64> = a.changes.iter().map(|c| c.revision).collect();
        prop_assert_eq!(revs, (1..=a.revision()).collect::<Vec<_>>());
        let all = a.changes_since(0, usize::MAX).unwrap();
        let mut want = a.snapshot();
        want.catalog_id = String::new();
        prop_assert_eq!(replay(&all.changes), want);
        let back = Catalog::from_image(*a.limits(), a.to_image());
        prop_assert_eq!(back, a);
    }
}
