//! REST for replicated shards: what placement holds for a stream's shards (leader, followers,
//! generation, commit mark, each replica's lag), and the endpoint a shard's leader reports to
//! (rule 7). A report is a Raft write: its answer says whether it landed, and only a landed
//! report moves the leader's commit mark.

use super::*;
use crate::auth::{Action, ANY_TENANT};
use crate::replication::{Report, ReportAnswer};
use axum::extract::Extension;
use rest_auth::{permit, Caller};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Leaders' reports this member answered, by answer, and abandons it carried out (counters
/// of this process; `/metrics`).
pub(super) static REPORTS_LANDED: AtomicU64 = AtomicU64::new(0);
pub(super) static REPORTS_REFUSED: AtomicU64 = AtomicU64::new(0);
pub(super) static REPORTS_STALE: AtomicU64 = AtomicU64::new(0);
pub(super) static ABANDONS: AtomicU64 = AtomicU64::new(0);
/// Replicas this member's sweep replaced (rule 11), one per shard changed.
pub(super) static REPLACEMENTS: AtomicU64 = AtomicU64::new(0);

#[utoipa::path(get, path = "/v1/tenants/{tenant}/namespaces/{namespace}/streams/{stream}/replication", tag = "streams",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("stream" = String, Path)),
    responses((status = 200, body = StreamReplication), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub(super) async fn stream_replication(
    State(st): State<Arc<AppState>>,
    Path((t, n, s)): Path<(String, String, String)>,
) -> Res<Json<StreamReplication>> {
    Ok(Json(st.read(|c| c.stream_replication(&t, &n, &s))?))
}

/// A leader's report, as a broker sends it.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReportRequest {
    /// The generation the leader leads.
    pub generation: u64,
    pub leader: u64,
    /// Numbers the leader's reports within its generation, from 1.
    pub seq: u64,
    pub holders: Vec<HolderEntry>,
    /// The leader has held no lease for a whole lease period (it cannot reach a majority of
    /// its replicas): placement names another leader if one qualifies. Default false.
    #[serde(default)]
    pub resign: bool,
}

/// One replica in a report.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct HolderEntry {
    pub node: u64,
    /// The generation of the last record it holds of the leader's log.
    pub last_generation: u64,
    /// The offset after that record.
    pub end: u64,
    /// The storage identity it answered under (16 lowercase hex digits).
    pub storage_id: String,
    /// In a report: the bytes of the leader's log past `end` (lag in bytes, shown by the
    /// replication view; placement decides nothing on it). Absent in answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub behind_bytes: Option<u64>,
}

/// Placement's answer: `landed` (stored; `counted` are the holders it vouches for),
/// `refused` (another leader or a newer generation: `newest`), or `stale` (a newer report of
/// this leader is stored: `seq`).
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct ReportReply {
    pub answer: String,
    pub generation: u64,
    /// `landed`: the holders that count.
    #[serde(default)]
    pub counted: Vec<HolderEntry>,
    /// `refused`: the newest generation placement has issued.
    #[serde(default)]
    pub newest: Option<u64>,
    /// `stale`: the number of the report placement holds.
    #[serde(default)]
    pub seq: Option<u64>,
}

/// Bounds a report's holder list: a shard has at most `REPLICATION_FACTOR_MAX` replicas.
const HOLDERS_MAX: usize = crate::catalog::REPLICATION_FACTOR_MAX as usize;

impl ReportRequest {
    fn to_report(&self) -> Result<Report, ApiError> {
        if self.generation == 0 || self.seq == 0 {
            return Err(ApiError::invalid("generation and seq start at 1"));
        }
        if self.holders.len() > HOLDERS_MAX {
            return Err(ApiError::invalid(format!(
                "a report names at most {HOLDERS_MAX} holders, got {}",
                self.holders.len()
            )));
        }
        let holders = self
            .holders
            .iter()
            .map(|h| {
                crate::catalog::check_storage_id(&h.storage_id)?;
                if h.last_generation > self.generation {
                    return Err(ApiError::invalid(format!(
                        "holder {} reports generation {} past the report's {}",
                        h.node, h.last_generation, self.generation
                    )));
                }
                Ok(crate::replication::Holding {
                    node: h.node,
                    pos: crate::replication::Pos {
                        last_gen: h.last_generation,
                        end: h.end,
                    },
                    sid: u64::from_str_radix(&h.storage_id, 16).expect("checked"),
                })
            })
            .collect::<Result<Vec<_>, ApiError>>()?;
        let behind_bytes = self
            .holders
            .iter()
            .filter_map(|h| Some((h.node, h.behind_bytes?)))
            .collect();
        Ok(Report {
            gen: self.generation,
            leader: self.leader,
            seq: self.seq,
            holders,
            resign: self.resign,
            behind_bytes,
        })
    }
}

fn holder_entry(h: &crate::replication::Holding) -> HolderEntry {
    HolderEntry {
        node: h.node,
        last_generation: h.pos.last_gen,
        end: h.pos.end,
        storage_id: format!("{:016x}", h.sid),
        behind_bytes: None,
    }
}

impl From<ReportAnswer> for ReportReply {
    fn from(a: ReportAnswer) -> Self {
        let empty = |answer: &str, generation| ReportReply {
            answer: answer.into(),
            generation,
            counted: Vec::new(),
            newest: None,
            seq: None,
        };
        match a {
            ReportAnswer::Landed { gen, counted } => ReportReply {
                counted: counted.iter().map(holder_entry).collect(),
                ..empty("landed", gen)
            },
            ReportAnswer::Refused { gen, newest } => ReportReply {
                newest: Some(newest),
                ..empty("refused", gen)
            },
            ReportAnswer::Stale { gen, seq } => ReportReply {
                seq: Some(seq),
                ..empty("stale", gen)
            },
        }
    }
}

/// A shard leader's report. Only broker `leader` itself (its node token) or an admin may send
/// it: a report moves what placement promotes on.
#[utoipa::path(post, path = "/v1/tenants/{tenant}/namespaces/{namespace}/streams/{stream}/shards/{shard}/report", tag = "streams",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("stream" = String, Path), ("shard" = u32, Path)),
    request_body = ReportRequest,
    responses((status = 200, body = ReportReply), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn shard_report(
    State(st): State<Arc<AppState>>,
    caller: Option<Extension<Caller>>,
    Path((tenant, namespace, stream, shard)): Path<(String, String, String, u32)>,
    Json(req): Json<ReportRequest>,
) -> Res<Json<ReportReply>> {
    permit(
        &caller,
        Action::ClusterAdmin,
        ANY_TENANT,
        &format!("brokers/{}", req.leader),
    )?;
    let report = req.to_report()?;
    match st
        .write(Command::ReplicaReport {
            tenant,
            namespace,
            stream,
            shard,
            report,
        })
        .await?
    {
        Reply::Report(a) => {
            let counter = match &a {
                ReportAnswer::Landed { .. } => &REPORTS_LANDED,
                ReportAnswer::Refused { .. } => &REPORTS_REFUSED,
                ReportAnswer::Stale { .. } => &REPORTS_STALE,
            };
            counter.fetch_add(1, Relaxed);
            Ok(Json(a.into()))
        }
        other => Err(unexpected(other)),
    }
}

/// `POST .../shards/{shard}/abandon`: promote a replica of an unavailable shard, accepting
/// what may be lost.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AbandonRequest {
    /// The replica to promote; default the live one reported furthest ahead.
    #[serde(default)]
    pub to: Option<u64>,
    /// Must be `true`: records a majority held may be lost, acknowledged ones among them.
    pub confirm: bool,
}

/// What an abandon did.
#[derive(Debug, Clone, Serialize, Deserialize, utoipa::ToSchema)]
pub struct AbandonReply {
    /// The new generation, and the replica that leads it.
    pub generation: u64,
    pub leader: u64,
    /// The offset up to which the new leader is known to hold the log (its last vouched
    /// report; 0 if none vouches for it).
    pub kept_end: u64,
    /// The commit mark before: records from `kept_end` to `commit` were committed and may be
    /// lost.
    pub commit: u64,
    pub may_lose_records: u64,
}

#[utoipa::path(post, path = "/v1/tenants/{tenant}/namespaces/{namespace}/streams/{stream}/shards/{shard}/abandon", tag = "streams",
    params(("tenant" = String, Path), ("namespace" = String, Path), ("stream" = String, Path), ("shard" = u32, Path)),
    request_body = AbandonRequest,
    responses((status = 200, body = AbandonReply), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody), (status = 503, body = ErrorBody)))]
pub(super) async fn shard_abandon(
    State(st): State<Arc<AppState>>,
    Path((tenant, namespace, stream, shard)): Path<(String, String, String, u32)>,
    Json(req): Json<AbandonRequest>,
) -> Res<Json<AbandonReply>> {
    if !req.confirm {
        return Err(ApiError::invalid(
            "confirm must be true: abandoning may lose committed records, acknowledged ones among them",
        )
        .into());
    }
    match st
        .write(Command::AbandonShard {
            tenant,
            namespace,
            stream,
            shard,
            to: req.to,
        })
        .await?
    {
        Reply::Abandoned(a) => {
            // Counted once it is in the store (a refused abandon changes nothing).
            ABANDONS.fetch_add(1, Relaxed);
            Ok(Json(AbandonReply {
                generation: a.assignment.gen,
                leader: a.assignment.leader,
                kept_end: a.kept.end,
                commit: a.commit.end,
                may_lose_records: a.commit.end.saturating_sub(a.kept.end),
            }))
        }
        other => Err(unexpected(other)),
    }
}
