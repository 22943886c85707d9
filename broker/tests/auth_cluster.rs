//! Auth across brokers: two brokers with peer listeners (`--auth jwks`, one key set for the
//! cluster) against one control plane, all real processes on loopback. A forwarded request is
//! checked at the broker the client holds and again at the owner, with the client's token
//! carried in the forward.

use bytes::Bytes;
use felix_client::{Client, Error, GroupOptions};
use felix_control::auth::{admin_claims, Action, Claims, Jwks, SigningKey, ISSUER};
use felix_quic::tls::generate_cluster_certs;
use felix_quic::wire::cache::{CacheFrame, WriteCond};
use felix_quic::wire::group::{GroupFrame, GroupRef};
use felix_quic::wire::hash::shard_for_key;
use felix_quic::wire::peer::lanes;
use felix_quic::wire::{ErrorCode, Frame, PeerFrame, Records, ShardSelector, StartAt, StreamName};
use std::time::Duration;

mod common;
use common::cluster::{
    cluster_id, forward, make_resources_with, placement, publish_forward, raw_peer, refusal_of,
    start_node, visible,
};
use common::cp::{eventually, start_control_plane, ControlPlane};
use common::Broker;

const SHARDS: u32 = 4;

/// Two brokers with `--auth jwks` over one signing key, a durable stream `acme/prod/spread`
/// and a cache `acme/prod/kv` of four shards each spread over them.
struct JwksCluster {
    cp: ControlPlane,
    _tmp: tempfile::TempDir,
    certs: std::path::PathBuf,
    key: SigningKey,
    now_s: u64,
    n1: Broker,
    n2: Broker,
    name: StreamName,
    kv: StreamName,
    admin: String,
}

impl JwksCluster {
    async fn start() -> JwksCluster {
        let cp = start_control_plane(120_000);
        let tmp = tempfile::tempdir().unwrap();
        let certs = tmp.path().join("certs");
        generate_cluster_certs(&certs, &[1, 2, 3]).unwrap();
        let key = SigningKey::from_seed("cluster-1", [42; 32]);
        let jwks = tmp.path().join("jwks.json");
        let set = Jwks {
            keys: vec![key.jwk()],
        };
        std::fs::write(&jwks, serde_json::to_vec(&set).unwrap()).unwrap();
        let node = |id: u64| {
            let d = tmp.path().join(format!("durable-{id}"));
            let args = [
                "--auth",
                "jwks",
                "--auth-jwks",
                jwks.to_str().unwrap(),
                "--durable-storage-dir",
                d.to_str().unwrap(),
            ];
            start_node(&cp, &certs, id, &args)
        };
        let (n1, n2) = (node(1), node(2));
        make_resources_with(&cp, tmp.path(), &SHARDS.to_string(), &["--durable"]);
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_secs();
        let admin = key.issue(&admin_claims("admin", "a", now_s, 600));
        for n in [&n1, &n2] {
            *n.metrics_token.lock().unwrap() = Some(admin.clone());
        }
        let c = JwksCluster {
            cp,
            _tmp: tmp,
            certs,
            key,
            now_s,
            n1,
            n2,
            name: StreamName::new("acme", "prod", "spread"),
            kv: StreamName::new("acme", "prod", "kv"),
            admin,
        };
        let watchers = [
            c.connect(&c.n1, c.admin.clone()).await.unwrap(),
            c.connect(&c.n2, c.admin.clone()).await.unwrap(),
        ];
        visible(&watchers, &c.name).await;
        c
    }

    /// A token of tenant `acme` with `perms`.
    fn token(&self, perms: &[&str]) -> String {
        self.key.issue(&Claims {
            iss: ISSUER.into(),
            sub: "svc".into(),
            tenant: "acme".into(),
            perms: perms.iter().map(|p| p.to_string()).collect(),
            iat: self.now_s,
            nbf: self.now_s,
            exp: self.now_s + 600,
            jti: format!("j-{}", perms.join(",")),
        })
    }

    async fn connect(&self, b: &Broker, t: String) -> Result<Client, Error> {
        let mut cfg = b.client_config();
        cfg.token = Some(t);
        Client::connect(cfg).await
    }
}

/// Auth across brokers (`--auth jwks`, one key set for the cluster): a forwarded request is
/// checked at the forwarding broker and again at the owner, with the client's token carried in
/// the forward; a forward without a principal, or with one that lacks the permission, is
/// refused by the owner and nothing is appended.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forwards_carry_the_clients_principal() {
    let c = JwksCluster::start().await;
    let JwksCluster {
        cp, n1, n2, name, ..
    } = &c;
    let (incarnation, places) = placement(cp, "streams", "spread").await;
    let token = |perms: &[&str]| c.token(perms);
    let certs = &c.certs;
    let theirs = places.iter().position(|p| p.0 == 2).unwrap() as u32;
    let mine = places.iter().position(|p| p.0 == 1).unwrap() as u32;

    // A publisher's token through broker 1 to broker 2's shard: forwarded, served.
    let publisher = c
        .connect(n1, token(&["stream.publish:prod/*"]))
        .await
        .unwrap();
    eventually("forwarded with its principal", || async {
        publisher
            .publish_batch(name, ShardSelector::Shard(theirs), vec!["ok"])
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    assert!(n2.total("forwards_served") >= 1);
    // A subscriber's token: refused at broker 1, never forwarded.
    let sent = n1.total("forwards_sent");
    let reader = c
        .connect(n1, token(&["stream.subscribe:prod/*"]))
        .await
        .unwrap();
    match reader
        .publish_batch(name, ShardSelector::Shard(theirs), vec!["no"])
        .await
    {
        Err(Error::Broker { code, message }) => {
            assert_eq!(code, ErrorCode::Forbidden);
            assert!(message.contains("stream.publish:prod/spread"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(n1.total("forwards_sent"), sent, "refused before the link");

    // A peer that forwards on its own: the owner checks the principal the forward names.
    let cluster = cluster_id(cp).await;
    let (mut raw, answer) = raw_peer(n1, certs, &cluster, (1, 3, 3)).await;
    assert!(
        matches!(answer, Frame::Peer(PeerFrame::PeerHelloOk { .. })),
        "{answer:?}"
    );
    let generation = places[mine as usize].1;
    let fwd = |rid: u64, principal: String| {
        publish_forward(
            name,
            (rid, mine),
            (incarnation, generation),
            principal,
            b"raw",
        )
    };
    let refusal = refusal_of;
    raw.send(4, &fwd(1, String::new()));
    assert_eq!(
        refusal(raw.next_on(4).await),
        (1, Some(ErrorCode::Unauthenticated))
    );
    raw.send(4, &fwd(2, token(&["cache.read:*"])));
    assert_eq!(
        refusal(raw.next_on(4).await),
        (2, Some(ErrorCode::Forbidden))
    );
    raw.send(4, &fwd(3, "forged.token.here".into()));
    assert_eq!(
        refusal(raw.next_on(4).await),
        (3, Some(ErrorCode::Unauthenticated))
    );
    raw.send(4, &fwd(4, token(&["stream.publish:prod/spread"])));
    match raw.next_on(4).await {
        Frame::PublishAck {
            request_id: 4,
            first_offset: 0,
            ..
        } => {}
        other => panic!("the refused forwards appended nothing: {other:?}"),
    }
}

/// The forwarded request kinds, in the order the table runs them (a write before the read or
/// delete that needs it), each with the one action that allows it.
const FORWARDED: &[(&str, Action)] = &[
    ("Publish", Action::StreamPublish),
    ("GroupCreate", Action::Manage),
    ("GroupDescribe", Action::GroupConsume),
    ("GroupPoll", Action::GroupConsume),
    ("GroupSeek", Action::GroupConsume),
    ("DeadLetterList", Action::GroupConsume),
    ("CachePut", Action::CacheWrite),
    ("CounterAdd", Action::CacheWrite),
    ("CacheGet", Action::CacheRead),
    ("CounterGet", Action::CacheRead),
    ("CacheDelete", Action::CacheWrite),
    ("GroupDelete", Action::Manage),
];

/// Where the table's requests go: a stream shard and a cache key owned by one broker.
struct Place {
    shard: u32,
    key: Bytes,
}

/// The first key `k<i>` whose cache shard `owner` holds.
fn key_on(cache_places: &[(u64, u64)], owner: u64) -> Bytes {
    (0..1000)
        .map(|i| Bytes::from(format!("k{i}")))
        .find(|k| cache_places[shard_for_key(k, SHARDS) as usize].0 == owner)
        .expect("a key on every broker")
}

/// `kind` through the client, on `at`; a group created or deleted is named for `action`.
async fn run_kind(
    c: &Client,
    cl: &JwksCluster,
    kind: &str,
    action: Action,
    at: &Place,
) -> Result<(), Error> {
    let (name, kv, shard, key) = (&cl.name, &cl.kv, at.shard, at.key.clone());
    let own_group = format!("g-{}", action.name());
    match kind {
        "Publish" => c
            .publish_batch(name, ShardSelector::Shard(shard), vec!["t"])
            .await
            .map(drop),
        "GroupCreate" => {
            c.group_create(name, &own_group, Some(shard), GroupOptions::default())
                .await
        }
        "GroupDescribe" => c.group_describe(name, "g", Some(shard)).await.map(drop),
        "GroupPoll" => c
            .group_poll(name, "g", shard, 1, None, Duration::ZERO)
            .await
            .map(drop),
        "GroupSeek" => c.group_seek(name, "g", Some(shard), StartAt::Latest).await,
        "DeadLetterList" => c.dead_letters(name, "g", shard, None, 10).await.map(drop),
        "CachePut" => c.cache_put(kv, key, "v", None).await.map(drop),
        "CounterAdd" => c.counter_add(kv, key, 1).await.map(drop),
        "CacheGet" => c.cache_get(kv, key).await.map(drop),
        "CounterGet" => c.counter_get(kv, key).await.map(drop),
        "CacheDelete" => c.cache_delete(kv, key).await.map(drop),
        "GroupDelete" => c.group_delete(name, &own_group, Some(shard)).await,
        other => unreachable!("{other}"),
    }
}

/// `kind` as the frame a forward carries, on `at`.
fn frame_of(cl: &JwksCluster, kind: &str, action: Action, rid: u64, at: &Place) -> Frame {
    let target = |group: &str| GroupRef {
        stream: cl.name.clone(),
        group: group.into(),
        shard: at.shard,
    };
    let own_group = format!("r-{}", action.name());
    let (kv, key) = (cl.kv.clone(), at.key.clone());
    let g = Frame::Group;
    let c = Frame::Cache;
    match kind {
        "Publish" => Frame::Publish {
            request_id: rid,
            stream: cl.name.clone(),
            shard: ShardSelector::Shard(at.shard),
            ack: true,
            records: Records::encode([&b"r"[..]]),
        },
        "GroupCreate" => g(GroupFrame::GroupCreate {
            request_id: rid,
            target: target(&own_group),
            start: StartAt::Earliest,
            max_attempts: 0,
            visibility_timeout_ms: 0,
        }),
        "GroupDescribe" => g(GroupFrame::GroupDescribe {
            request_id: rid,
            target: target("g"),
        }),
        "GroupPoll" => g(GroupFrame::GroupPoll {
            request_id: rid,
            target: target("g"),
            max: 1,
            visibility_timeout_ms: 0,
            wait_ms: 0,
        }),
        "GroupSeek" => g(GroupFrame::GroupSeek {
            request_id: rid,
            target: target("g"),
            to: StartAt::Latest,
        }),
        "DeadLetterList" => g(GroupFrame::DeadLetterList {
            request_id: rid,
            target: target("g"),
            after: None,
            limit: 10,
        }),
        "CachePut" => c(CacheFrame::CachePut {
            request_id: rid,
            cache: kv,
            key,
            value: Bytes::from_static(b"v"),
            ttl_ms: 0,
            cond: WriteCond::Always,
        }),
        "CounterAdd" => c(CacheFrame::CounterAdd {
            request_id: rid,
            cache: kv,
            name: key,
            delta: 1,
        }),
        "CacheGet" => c(CacheFrame::CacheGet {
            request_id: rid,
            cache: kv,
            key,
        }),
        "CounterGet" => c(CacheFrame::CounterGet {
            request_id: rid,
            cache: kv,
            name: key,
        }),
        "CacheDelete" => c(CacheFrame::CacheDelete {
            request_id: rid,
            cache: kv,
            key,
            cond: WriteCond::Always,
        }),
        "GroupDelete" => g(GroupFrame::GroupDelete {
            request_id: rid,
            target: target(&own_group),
        }),
        other => unreachable!("{other}"),
    }
}

/// Every forwarded request kind × every action, on both sides of the link. Through broker 1
/// to broker 2's shards, a token of one action is served exactly the kinds that action
/// allows and refused `forbidden` (naming the permission) for the rest, which never reach
/// the link; a raw peer's forwards to broker 1, carrying the same tokens, get the same
/// answers from the owner.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_forwarded_request_kind_is_checked_for_every_action() {
    let cl = JwksCluster::start().await;
    let (incarnation, places) = placement(&cl.cp, "streams", "spread").await;
    let (cache_incarnation, cache_places) = placement(&cl.cp, "caches", "kv").await;
    let on = |node: u64| Place {
        shard: places.iter().position(|p| p.0 == node).unwrap() as u32,
        key: key_on(&cache_places, node),
    };
    let (theirs, mine) = (on(2), on(1));
    // What the reads need: a group `g` on every shard, a value and a counter under each key.
    let admin = cl.connect(&cl.n1, cl.admin.clone()).await.unwrap();
    eventually("every durable shard open", || async {
        admin
            .group_create(&cl.name, "g", None, GroupOptions::default())
            .await
            .map_err(|e| e.to_string())
    })
    .await;
    for at in [&theirs, &mine] {
        admin
            .cache_put(&cl.kv, at.key.clone(), "v", None)
            .await
            .unwrap();
        admin.counter_add(&cl.kv, at.key.clone(), 1).await.unwrap();
    }

    // Through broker 1: checked there, forwarded only when allowed.
    let sent_before = cl.n1.total("forwards_sent");
    let mut allowed = 0;
    for action in Action::ALL {
        let c = cl
            .connect(&cl.n1, cl.token(&[&format!("{}:prod/*", action.name())]))
            .await
            .unwrap();
        for (kind, needs) in FORWARDED {
            let r = run_kind(&c, &cl, kind, action, &theirs).await;
            if *needs == action {
                allowed += 1;
                assert!(r.is_ok(), "{kind} with {}: {r:?}", action.name());
                continue;
            }
            match r {
                Err(Error::Broker { code, message }) => {
                    assert_eq!(code, ErrorCode::Forbidden, "{kind} with {}", action.name());
                    assert!(message.contains(needs.name()), "{kind}: {message}");
                }
                other => panic!("{kind} with {}: {other:?}", action.name()),
            }
        }
    }
    assert_eq!(allowed, FORWARDED.len(), "each kind allowed by one action");
    assert_eq!(
        cl.n1.total("forwards_sent") - sent_before,
        allowed as u64,
        "each allowed request forwarded once, no refused one"
    );

    // A peer's forwards to broker 1: the owner checks the principal each one carries.
    let cluster = cluster_id(&cl.cp).await;
    let (mut raw, answer) = raw_peer(&cl.n1, &cl.certs, &cluster, (1, 3, 3)).await;
    assert!(
        matches!(answer, Frame::Peer(PeerFrame::PeerHelloOk { .. })),
        "{answer:?}"
    );
    let stream_fence = (incarnation, places[mine.shard as usize].1);
    let cache_shard = shard_for_key(&mine.key, SHARDS) as usize;
    let cache_fence = (cache_incarnation, cache_places[cache_shard].1);
    let mut rid = 0;
    for action in Action::ALL {
        let t = cl.token(&[&format!("{}:prod/*", action.name())]);
        for (kind, needs) in FORWARDED {
            rid += 1;
            let inner = frame_of(&cl, kind, action, rid, &mine);
            // The lanes a broker forwards on: publishes on the publish stream, the rest on
            // the control stream.
            let (fence, lane) = match inner {
                Frame::Cache(_) => (cache_fence, lanes::CONTROL_STREAM),
                Frame::Publish { .. } => (stream_fence, lanes::PUBLISH_STREAM),
                _ => (stream_fence, lanes::CONTROL_STREAM),
            };
            raw.send(lane, &forward(inner, fence, t.clone()));
            let answer = raw.next_on(lane).await;
            if *needs == action {
                assert!(
                    !matches!(answer, Frame::Error { .. }),
                    "{kind} with {}: {answer:?}",
                    action.name()
                );
            } else {
                assert_eq!(
                    refusal_of(answer),
                    (rid, Some(ErrorCode::Forbidden)),
                    "{kind} with {}",
                    action.name()
                );
            }
        }
    }
    // Sanity of the table itself: a publish forward without a principal is unauthenticated.
    raw.send(
        4,
        &publish_forward(
            &cl.name,
            (rid + 1, mine.shard),
            stream_fence,
            String::new(),
            b"x",
        ),
    );
    assert_eq!(
        refusal_of(raw.next_on(4).await),
        (rid + 1, Some(ErrorCode::Unauthenticated))
    );
}
