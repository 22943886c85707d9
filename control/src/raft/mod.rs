//! The Raft metadata store: an embedded openraft 0.9 group whose state machine is the catalog.
//!
//! * Members talk over the same HTTP listener as the REST API (`/raft/{member}/…`).
//! * A member's Raft id is `node_id << 32 | generation`. A data dir created for a new group is
//!   generation 0. A member that starts with an empty data dir while its peers already form a
//!   group is a *wiped* member: it takes the next generation and asks the leader to remove its
//!   old identity and re-add it as a learner, then a voter. RPCs addressed to the old identity
//!   are refused by the process, so a wiped member never votes under the identity whose votes
//!   and log it forgot.
//! * Writes on a follower are forwarded to the leader (`/internal/v1/write`) and answered as if
//!   local.

mod member_auth;
mod storage;

pub use member_auth::MemberSecret;

use crate::api::{ApiError, ClusterStatus, Member};
use crate::catalog::{Catalog, Command, Outcome};
use crate::config::Config;
use crate::server::{Json, Path as P, Refusal};
use crate::store::{BoxFut, MetadataStore, Route, Shared};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::Router;
use felix_quic::wire::ErrorCode;
use openraft::error::{
    ClientWriteError, InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError,
    Unreachable,
};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{BasicNode, ChangeMembers, ServerState};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Cursor;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The outcome of one applied command, as the Raft response type.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Resp(pub Outcome);

openraft::declare_raft_types!(
    pub TypeConfig:
        D = Command,
        R = Resp,
);

pub type Raft = openraft::Raft<TypeConfig>;

pub fn member_id(node_id: u64, generation: u32) -> u64 {
    (node_id << 32) | generation as u64
}

pub fn split_member(m: u64) -> (u64, u32) {
    (m >> 32, m as u32)
}

// ------------------------------------------------------------------ network

pub struct NetFactory {
    http: reqwest::Client,
    timeout: Duration,
    /// `http` or `https`, as every member serves.
    scheme: &'static str,
}

impl RaftNetworkFactory<TypeConfig> for NetFactory {
    type Network = Net;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> Net {
        Net {
            target,
            addr: node.addr.clone(),
            http: self.http.clone(),
            timeout: self.timeout,
            scheme: self.scheme,
        }
    }
}

pub struct Net {
    target: u64,
    addr: String,
    http: reqwest::Client,
    timeout: Duration,
    scheme: &'static str,
}

impl Net {
    async fn rpc<Q, R, E>(
        &self,
        kind: &str,
        req: &Q,
        opt: &RPCOption,
    ) -> Result<R, RPCError<u64, BasicNode, RaftError<u64, E>>>
    where
        Q: Serialize,
        R: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let url = format!(
            "{}://{}/raft/{}/{kind}",
            self.scheme, self.addr, self.target
        );
        let ttl = opt
            .hard_ttl()
            .min(self.timeout)
            .max(Duration::from_millis(50));
        let r = self
            .http
            .post(url)
            .timeout(ttl)
            .json(req)
            .send()
            .await
            .map_err(|e| RPCError::Unreachable(Unreachable::new(&e)))?;
        if !r.status().is_success() {
            // 409: that process is not (or no longer) this member; anything else: not serving.
            let e = std::io::Error::other(format!("{} answered {}", self.addr, r.status()));
            return Err(RPCError::Unreachable(Unreachable::new(&e)));
        }
        let res: Result<R, RaftError<u64, E>> = r
            .json()
            .await
            .map_err(|e| RPCError::Network(NetworkError::new(&e)))?;
        res.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for Net {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.rpc("append", &rpc, &option).await
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<
        InstallSnapshotResponse<u64>,
        RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>,
    > {
        self.rpc("snapshot", &rpc, &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.rpc("vote", &rpc, &option).await
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::repeat(Duration::from_millis(200)))
    }
}

// ------------------------------------------------------------------ the store

#[derive(Debug, Clone, Serialize, Deserialize)]
struct Identity {
    node_id: u64,
    member_id: u64,
}

/// What `/internal/v1/identity` answers a booting peer.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PeerIdentity {
    pub node_id: u64,
    /// Started with an empty data dir and not yet part of a group.
    pub fresh: bool,
    pub members: Vec<Member>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RejoinRequest {
    pub node_id: u64,
    pub member_id: u64,
    pub addr: String,
}

struct Node {
    raft: Raft,
    member: u64,
}

/// The Raft store. Serves (as not ready) while it boots, so peers can probe it.
pub struct RaftStore {
    cfg: Arc<Config>,
    shared: Arc<Shared>,
    node: OnceLock<Node>,
    fresh: AtomicBool,
    boot: tokio::sync::Mutex<()>,
    http: reqwest::Client,
    peers: BTreeMap<u64, String>,
    dir: PathBuf,
}

/// Open the Raft store: answers at once; the group is joined in the background.
pub async fn open(cfg: Arc<Config>) -> Result<(Arc<dyn MetadataStore>, Router), String> {
    let dir = cfg
        .raft_data_dir
        .clone()
        .ok_or("the raft store needs --raft-data-dir (FELIX_RAFT_DATA_DIR)")?;
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let peers = cfg.peers()?;
    let secret = cfg
        .member_secret_file
        .as_deref()
        .map(MemberSecret::load)
        .transpose()?;
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(s) = &secret {
        headers.insert(member_auth::HEADER, s.header_value());
    }
    let http = crate::https::client_builder(cfg.member_ca().as_deref())?
        .timeout(Duration::from_millis(cfg.raft_rpc_timeout_ms.max(100)))
        .default_headers(headers)
        .build()
        .map_err(|e| e.to_string())?;
    let st = Arc::new(RaftStore {
        shared: Shared::new(Catalog::new(cfg.limits())),
        cfg: cfg.clone(),
        node: OnceLock::new(),
        fresh: AtomicBool::new(false),
        boot: tokio::sync::Mutex::new(()),
        http,
        peers,
        dir,
    });
    let ident_path = st.dir.join("identity.json");
    match std::fs::read(&ident_path) {
        Ok(b) => {
            let id: Identity =
                serde_json::from_slice(&b).map_err(|e| format!("{}: {e}", ident_path.display()))?;
            if id.node_id != cfg.raft_node_id {
                return Err(format!(
                    "{} belongs to node {}, not {}",
                    st.dir.display(),
                    id.node_id,
                    cfg.raft_node_id
                ));
            }
            st.start(id.member_id).await?;
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            if st.dir.join("raft-log.jsonl").exists() {
                return Err(format!(
                    "{} has a Raft log but no identity.json; refusing to guess",
                    st.dir.display()
                ));
            }
            st.fresh.store(true, Ordering::SeqCst);
            let b = st.clone();
            tokio::spawn(async move { b.boot_fresh().await });
        }
        Err(e) => return Err(format!("{}: {e}", ident_path.display())),
    }
    let mut routes = Router::new()
        .route("/raft/{member}/append", post(rpc_append))
        .route("/raft/{member}/vote", post(rpc_vote))
        .route("/raft/{member}/snapshot", post(rpc_snapshot))
        .route("/internal/v1/identity", get(identity))
        .route("/internal/v1/rejoin", post(rejoin))
        .route("/internal/v1/assign", post(assign))
        .layer(DefaultBodyLimit::max(64 << 20))
        .with_state(st.clone());
    // With a secret configured it is checked whether or not bearer auth is on: a member that
    // has one must not take votes or appends from a process that does not.
    if let Some(s) = secret {
        routes = routes.layer(axum::middleware::from_fn_with_state(
            member_auth::Guard::new(s),
            member_auth::require,
        ));
    }
    Ok((st, routes))
}

impl RaftStore {
    async fn start(&self, member: u64) -> Result<(), String> {
        let log = storage::LogStore::open(&self.dir).map_err(|e| e.to_string())?;
        let sm = storage::SmStore::open(&self.dir, self.shared.clone(), self.cfg.limits())
            .map_err(|e| e.to_string())?;
        let rc = openraft::Config {
            cluster_name: "felix-control".into(),
            heartbeat_interval: self.cfg.raft_heartbeat_ms,
            election_timeout_min: self.cfg.raft_election_min_ms,
            election_timeout_max: self.cfg.raft_election_max_ms,
            snapshot_policy: openraft::SnapshotPolicy::LogsSinceLast(
                self.cfg.raft_snapshot_logs.max(10),
            ),
            max_in_snapshot_log_to_keep: 64,
            install_snapshot_timeout: 2000,
            ..Default::default()
        }
        .validate()
        .map_err(|e| format!("raft config: {e}"))?;
        let net = NetFactory {
            http: self.http.clone(),
            timeout: Duration::from_millis(self.cfg.raft_rpc_timeout_ms.max(100)),
            scheme: self.cfg.scheme(),
        };
        let raft = Raft::new(member, Arc::new(rc), net, log, sm)
            .await
            .map_err(|e| format!("raft: {e}"))?;
        let _ = self.node.set(Node { raft, member });
        tracing::info!(node = self.cfg.raft_node_id, member, "raft member started");
        Ok(())
    }

    fn write_identity(&self, member: u64) -> Result<(), String> {
        let id = Identity {
            node_id: self.cfg.raft_node_id,
            member_id: member,
        };
        storage::write_atomic(
            &self.dir.join("identity.json"),
            &serde_json::to_vec(&id).expect("identity"),
            true,
        )
        .map_err(|e| e.to_string())
    }

    /// Adopt `member` as this process's identity and start (once).
    async fn adopt(&self, member: u64) -> Result<bool, String> {
        let _g = self.boot.lock().await;
        if let Some(n) = self.node.get() {
            return Ok(n.member == member);
        }
        self.write_identity(member)?;
        self.start(member).await?;
        self.fresh.store(false, Ordering::SeqCst);
        Ok(true)
    }

    /// An empty data dir. Three ways out, decided by probing the peers:
    /// * some peer is in a group: this member's data was wiped — rejoin under the next
    ///   generation (the old identity is removed by the leader first);
    /// * this is the lowest node id and every peer answers with no group: found the group —
    ///   assign every peer its generation-0 identity first, then initialize, so no peer can
    ///   see the group before it holds its identity;
    /// * otherwise wait (for the founder's assignment, or for the group to appear).
    async fn boot_fresh(self: Arc<Self>) {
        let me = self.cfg.raft_node_id;
        let founder = self.peers.keys().next() == Some(&me);
        let others: Vec<(u64, String)> = self
            .peers
            .iter()
            .filter(|(id, _)| **id != me)
            .map(|(i, a)| (*i, a.clone()))
            .collect();
        let mut last_log = Instant::now();
        let mut refused_by: Option<String> = None;
        loop {
            if self.node.get().is_some() {
                return; // assigned by the founder
            }
            let mut all_answered = true;
            let mut group: Option<Vec<Member>> = None;
            for (_, addr) in &others {
                match self
                    .http
                    .get(format!(
                        "{}://{addr}/internal/v1/identity",
                        self.cfg.scheme()
                    ))
                    .timeout(Duration::from_millis(500))
                    .send()
                    .await
                {
                    Ok(r) if r.status().is_success() => match r.json::<PeerIdentity>().await {
                        Ok(p) if !p.members.is_empty() => group = Some(p.members),
                        Ok(_) => {}
                        Err(_) => all_answered = false,
                    },
                    Ok(r) if r.status() == reqwest::StatusCode::UNAUTHORIZED => {
                        all_answered = false;
                        refused_by = Some(addr.clone());
                    }
                    _ => all_answered = false,
                }
            }
            if let Some(members) = group {
                let g = members
                    .iter()
                    .filter(|m| m.node_id == me)
                    .map(|m| m.generation + 1)
                    .max()
                    .unwrap_or(0);
                let member = member_id(me, g);
                match self.adopt(member).await {
                    Ok(true) => return self.rejoin_loop(member, &others).await,
                    Ok(false) => return,
                    Err(e) => {
                        tracing::error!("cannot start raft: {e}");
                        return;
                    }
                }
            }
            if founder && all_answered && self.form(&others).await {
                return;
            }
            if last_log.elapsed() > Duration::from_secs(5) {
                if let Some(peer) = refused_by.take() {
                    tracing::error!(%peer, "a peer refused this member's secret: start every member with the same --member-secret-file");
                }
                tracing::warn!(
                    "empty data dir: waiting for the peers (to form the group, or to rejoin it)"
                );
                last_log = Instant::now();
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Found the group: assign every peer its identity, then initialize. False: try again.
    async fn form(&self, others: &[(u64, String)]) -> bool {
        for (id, addr) in others {
            let r = self
                .http
                .post(format!("{}://{addr}/internal/v1/assign", self.cfg.scheme()))
                .timeout(Duration::from_secs(5))
                .json(&member_id(*id, 0))
                .send()
                .await;
            if !matches!(&r, Ok(r) if r.status().is_success()) {
                return false;
            }
        }
        let me = member_id(self.cfg.raft_node_id, 0);
        match self.adopt(me).await {
            Ok(true) => {}
            _ => return false,
        }
        let nodes: BTreeMap<u64, BasicNode> = self
            .peers
            .iter()
            .map(|(id, a)| (member_id(*id, 0), BasicNode { addr: a.clone() }))
            .collect();
        let raft = &self.node.get().expect("started").raft;
        if let Err(e) = raft.initialize(nodes).await {
            tracing::warn!("raft initialize: {e}");
        }
        true
    }

    async fn rejoin_loop(&self, member: u64, others: &[(u64, String)]) {
        let me = self.cfg.raft_node_id;
        tracing::info!(
            member,
            "empty data dir in an existing group: rejoining under a new generation"
        );
        let req = RejoinRequest {
            node_id: me,
            member_id: member,
            addr: self.peers[&me].clone(),
        };
        loop {
            for (_, addr) in others {
                let r = self
                    .http
                    .post(format!("{}://{addr}/internal/v1/rejoin", self.cfg.scheme()))
                    .timeout(Duration::from_secs(30))
                    .json(&req)
                    .send()
                    .await;
                if matches!(&r, Ok(r) if r.status().is_success()) {
                    tracing::info!(member, "rejoined as a voter");
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }

    fn node(&self) -> Result<&Node, ApiError> {
        self.node.get().ok_or_else(|| {
            ApiError::new(ErrorCode::Unavailable, "the raft member is still starting")
        })
    }

    fn members(&self) -> Vec<Member> {
        let Some(n) = self.node.get() else {
            return vec![];
        };
        let m = n.raft.metrics().borrow().membership_config.clone();
        let voters: BTreeSet<u64> = m.membership().voter_ids().collect();
        m.membership()
            .nodes()
            .map(|(id, node)| {
                let (node_id, generation) = split_member(*id);
                Member {
                    node_id,
                    generation,
                    addr: node.addr.clone(),
                    voter: voters.contains(id),
                }
            })
            .collect()
    }

    async fn forward(&self, addr: &str, cmd: &Command) -> Result<Outcome, bool> {
        // Err(true): not delivered (safe to retry); Err(false): outcome unknown.
        let now_s = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut rb = self
            .http
            .post(format!("{}://{addr}/internal/v1/write", self.cfg.scheme()))
            .timeout(self.cfg.write_timeout())
            .json(cmd);
        if let Some(t) = self
            .shared
            .read(|c| c.auth().member_token(self.cfg.raft_node_id, now_s))
        {
            rb = rb.bearer_auth(t);
        }
        let r = rb.send().await.map_err(|e| {
            // Not delivered is retried (every 50 ms while a leader is elected): quietly.
            if e.is_connect() {
                tracing::debug!(leader = addr, error = %e, "a write could not be forwarded to the leader");
            } else {
                tracing::warn!(leader = addr, error = %e, "a write forwarded to the leader was not answered");
            }
            e.is_connect()
        })?;
        let status = r.status();
        if !status.is_success() {
            let body = r.text().await.unwrap_or_default();
            tracing::warn!(leader = addr, %status, body, "the leader refused a forwarded write");
            return Err(false);
        }
        r.json::<Outcome>().await.map_err(|e| {
            tracing::warn!(leader = addr, error = %e, "the leader's answer to a forwarded write is unreadable");
            false
        })
    }
}

impl MetadataStore for RaftStore {
    fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    fn write(&self, cmd: Command) -> BoxFut<'_, Outcome> {
        Box::pin(async move {
            let deadline = Instant::now() + self.cfg.write_timeout();
            let unknown = || {
                ApiError::new(
                    ErrorCode::Unavailable,
                    "the write may or may not have been committed (leader lost); read before retrying",
                )
            };
            loop {
                let raft = &self.node()?.raft;
                match raft.client_write(cmd.clone()).await {
                    Ok(r) => return r.data.0,
                    Err(RaftError::APIError(ClientWriteError::ForwardToLeader(f))) => {
                        if let Some(node) = f.leader_node {
                            match self.forward(&node.addr, &cmd).await {
                                Ok(Err(e)) if e.code == ErrorCode::NotLeader => {}
                                Ok(o) => return o,
                                Err(true) => {}
                                Err(false) => return Err(unknown()),
                            }
                        }
                    }
                    Err(e) => {
                        return Err(ApiError::new(ErrorCode::Unavailable, format!("raft: {e}")))
                    }
                }
                if Instant::now() >= deadline {
                    return Err(ApiError::new(
                        ErrorCode::Unavailable,
                        "no Raft leader accepted the write in time",
                    ));
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    }

    fn write_local(&self, cmd: Command) -> BoxFut<'_, Outcome> {
        Box::pin(async move {
            match self.node()?.raft.client_write(cmd).await {
                Ok(r) => r.data.0,
                Err(RaftError::APIError(ClientWriteError::ForwardToLeader(_))) => Err(
                    ApiError::new(ErrorCode::NotLeader, "this member is not the leader"),
                ),
                Err(e) => Err(ApiError::new(ErrorCode::Unavailable, format!("raft: {e}"))),
            }
        })
    }

    fn status(&self) -> ClusterStatus {
        let rev = self.shared.read(|c| c.revision());
        let Some(n) = self.node.get() else {
            return ClusterStatus {
                store: "raft".into(),
                node_id: self.cfg.raft_node_id,
                ready: false,
                is_leader: false,
                leader: None,
                voters: vec![],
                learners: vec![],
                catalog_revision: rev,
                term: 0,
                applied_index: 0,
                members: vec![],
            };
        };
        let m = n.raft.metrics().borrow().clone();
        let members = self.members();
        ClusterStatus {
            store: "raft".into(),
            node_id: self.cfg.raft_node_id,
            ready: m.current_leader.is_some() && self.shared.read(|c| c.initialized()),
            is_leader: m.state == ServerState::Leader,
            leader: m.current_leader.map(|l| split_member(l).0),
            voters: members
                .iter()
                .filter(|m| m.voter)
                .map(|m| m.node_id)
                .collect(),
            learners: members
                .iter()
                .filter(|m| !m.voter)
                .map(|m| m.node_id)
                .collect(),
            catalog_revision: rev,
            term: m.current_term,
            applied_index: m.last_applied.map(|l| l.index).unwrap_or(0),
            members,
        }
    }

    fn route(&self) -> Route {
        let Some(n) = self.node.get() else {
            return Route::NoLeader;
        };
        let m = n.raft.metrics().borrow().clone();
        match m.current_leader {
            Some(l) if l == n.member => Route::Local,
            Some(l) => match m.membership_config.membership().get_node(&l) {
                Some(node) => Route::Leader(node.addr.clone()),
                None => Route::NoLeader,
            },
            None => Route::NoLeader,
        }
    }

    fn ready(&self) -> BoxFut<'_, Result<(), ApiError>> {
        Box::pin(async move {
            let unavailable = |m: &str| Err(ApiError::new(ErrorCode::Unavailable, m));
            let n = self.node()?;
            if !self.shared.read(|c| c.initialized()) {
                return unavailable("the catalog is not initialized yet (no leader has written)");
            }
            let m = n.raft.metrics().borrow().clone();
            match m.current_leader {
                None => unavailable("no Raft leader"),
                Some(l) if l == n.member => {
                    let voters = m.membership_config.membership().voter_ids().count();
                    let bound = 3 * self
                        .cfg
                        .raft_election_max_ms
                        .max(self.cfg.raft_heartbeat_ms);
                    if voters <= 1 || m.millis_since_quorum_ack.is_some_and(|ms| ms <= bound) {
                        Ok(())
                    } else {
                        unavailable("leader without a recent quorum")
                    }
                }
                Some(_) => match self.route() {
                    Route::Leader(addr) => {
                        let ok = self
                            .http
                            .get(format!("{}://{addr}/livez", self.cfg.scheme()))
                            .timeout(Duration::from_millis(500))
                            .send()
                            .await
                            .is_ok_and(|r| r.status().is_success());
                        if ok {
                            Ok(())
                        } else {
                            unavailable("the Raft leader does not answer")
                        }
                    }
                    _ => unavailable("no Raft leader"),
                },
            }
        })
    }

    fn shutdown(&self) -> BoxFut<'_, ()> {
        Box::pin(async move {
            if let Some(n) = self.node.get() {
                let _ = n.raft.shutdown().await;
            }
        })
    }
}

// ------------------------------------------------------------------ internal routes

type St = State<Arc<RaftStore>>;

fn for_me(st: &RaftStore, member: u64) -> Result<&Raft, Refusal> {
    let n = st.node().map_err(Refusal::from)?;
    if n.member != member {
        return Err(Refusal {
            status: StatusCode::CONFLICT,
            err: ApiError::new(
                ErrorCode::Conflict,
                format!("this process is member {}, not {member}", n.member),
            ),
        });
    }
    Ok(&n.raft)
}

async fn rpc_append(
    State(st): St,
    P(member): P<u64>,
    Json(req): Json<AppendEntriesRequest<TypeConfig>>,
) -> Result<axum::Json<Result<AppendEntriesResponse<u64>, RaftError<u64>>>, Refusal> {
    Ok(axum::Json(for_me(&st, member)?.append_entries(req).await))
}

async fn rpc_vote(
    State(st): St,
    P(member): P<u64>,
    Json(req): Json<VoteRequest<u64>>,
) -> Result<axum::Json<Result<VoteResponse<u64>, RaftError<u64>>>, Refusal> {
    Ok(axum::Json(for_me(&st, member)?.vote(req).await))
}

async fn rpc_snapshot(
    State(st): St,
    P(member): P<u64>,
    Json(req): Json<InstallSnapshotRequest<TypeConfig>>,
) -> Result<
    axum::Json<Result<InstallSnapshotResponse<u64>, RaftError<u64, InstallSnapshotError>>>,
    Refusal,
> {
    Ok(axum::Json(for_me(&st, member)?.install_snapshot(req).await))
}

async fn identity(State(st): St) -> Result<axum::Json<PeerIdentity>, Refusal> {
    let fresh = st.fresh.load(Ordering::SeqCst);
    if !fresh && st.node.get().is_none() {
        return Err(ApiError::new(ErrorCode::Unavailable, "starting").into());
    }
    Ok(axum::Json(PeerIdentity {
        node_id: st.cfg.raft_node_id,
        fresh,
        members: st.members(),
    }))
}

/// From the founder of a new group: this (fresh) process is `member`.
async fn assign(State(st): St, Json(member): Json<u64>) -> Result<StatusCode, Refusal> {
    if split_member(member).0 != st.cfg.raft_node_id {
        return Err(ApiError::invalid("that identity belongs to another node").into());
    }
    if st.node.get().is_none() && !st.fresh.load(Ordering::SeqCst) {
        return Err(ApiError::new(ErrorCode::Unavailable, "starting").into());
    }
    match st.adopt(member).await {
        Ok(true) => Ok(StatusCode::OK),
        Ok(false) => Err(ApiError::new(
            ErrorCode::Conflict,
            "this process already has another identity",
        )
        .into()),
        Err(e) => Err(ApiError::new(ErrorCode::Unavailable, e).into()),
    }
}

/// On the leader: replace a wiped member's old identity by its new one (remove the old voter,
/// add the new one as a learner, wait for it to catch up, promote it).
async fn rejoin(State(st): St, Json(req): Json<RejoinRequest>) -> Result<StatusCode, Refusal> {
    let n = st.node().map_err(Refusal::from)?;
    if !matches!(st.route(), Route::Local) {
        return Err(ApiError::new(ErrorCode::NotLeader, "not the leader").into());
    }
    if split_member(req.member_id).0 != req.node_id {
        return Err(ApiError::invalid("member_id does not belong to node_id").into());
    }
    crate::catalog::check_addr(&req.addr).map_err(Refusal::from)?;
    let raft_err = |e: String| Refusal::from(ApiError::new(ErrorCode::Unavailable, e));
    let m = n.raft.metrics().borrow().membership_config.clone();
    let voters: BTreeSet<u64> = m.membership().voter_ids().collect();
    if voters.contains(&req.member_id) {
        return Ok(StatusCode::OK);
    }
    let old: BTreeSet<u64> = m
        .membership()
        .nodes()
        .map(|(id, _)| *id)
        .filter(|id| split_member(*id).0 == req.node_id && *id != req.member_id)
        .collect();
    let old_voters: BTreeSet<u64> = old.intersection(&voters).copied().collect();
    if !old_voters.is_empty() {
        n.raft
            .change_membership(ChangeMembers::RemoveVoters(old_voters), false)
            .await
            .map_err(|e| raft_err(format!("remove old identity: {e}")))?;
    }
    let stale: BTreeSet<u64> = old.difference(&voters).copied().collect();
    if !stale.is_empty() {
        n.raft
            .change_membership(ChangeMembers::RemoveNodes(stale), false)
            .await
            .map_err(|e| raft_err(format!("remove old learner: {e}")))?;
    }
    n.raft
        .add_learner(req.member_id, BasicNode { addr: req.addr }, true)
        .await
        .map_err(|e| raft_err(format!("add learner: {e}")))?;
    n.raft
        .change_membership(
            ChangeMembers::AddVoterIds([req.member_id].into_iter().collect()),
            false,
        )
        .await
        .map_err(|e| raft_err(format!("promote: {e}")))?;
    Ok(StatusCode::OK)
}
