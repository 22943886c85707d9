//! The ClusterClient's group consumer: a [`GroupConsumer`] whose polls for each shard go to
//! that shard's owner broker, and whose answers (ack, nack, extend, reject) go to the owner of
//! each claim's shard. A shard whose connection was lost, or that answered `not_leader`, is
//! pointed at its owner again (learned anew from any broker) before the next poll; polls
//! still outstanding on the old connection answer into the consumer as before.
//!
//! Claims are per shard and live at the owner: a claim made through one broker is answered
//! through any (a broker that does not own the shard forwards), so moving a shard's polls to
//! another connection loses no claim. Delivery stays at least once, as for one broker.

use crate::cluster::{connection_lost, ClusterClient};
use crate::{Client, Error, GroupConsumer, GroupRecord};
use felix_quic::wire::{AnswerOp, ClaimId, ErrorCode, StreamName};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// A consumer of one group over every shard of a stream, each shard polled at its owner.
pub struct ClusterGroupConsumer {
    cc: Arc<ClusterClient>,
    stream: StreamName,
    group: String,
    inner: GroupConsumer<Arc<Client>>,
    /// A shard's connection failed or its owner moved: re-resolve before the next poll.
    stale: bool,
}

impl ClusterClient {
    /// A consumer of `group` over every shard of `stream`, each shard's polls sent to its
    /// owner (any broker when the owner is unknown or unreachable: it forwards).
    pub async fn group_consumer(
        self: &Arc<Self>,
        stream: &StreamName,
        group: &str,
    ) -> Result<ClusterGroupConsumer, Error> {
        let (shards, owners) = self.layout(stream).await?;
        let mut clients = Vec::with_capacity(shards as usize);
        for shard in 0..shards {
            let owner = owners.get(shard as usize).copied().unwrap_or(0);
            clients.push(self.to_node(owner).await?);
        }
        Ok(ClusterGroupConsumer {
            cc: self.clone(),
            stream: stream.clone(),
            group: group.to_string(),
            inner: GroupConsumer::over(clients, stream, group),
            stale: false,
        })
    }
}

impl ClusterGroupConsumer {
    /// Up to `max` records from any shards (see [`GroupConsumer::poll`]). A lost connection
    /// or a moved shard is reported by the call that met it, and the next call polls the
    /// shard at its owner again.
    pub async fn poll(
        &mut self,
        max: u32,
        visibility_timeout_ms: Option<u64>,
        wait: Duration,
    ) -> Result<Vec<GroupRecord>, Error> {
        if self.stale || self.any_closed() {
            self.reroute().await?;
        }
        let r = self.inner.poll(max, visibility_timeout_ms, wait).await;
        if let Err(e) = &r {
            self.note_failure(e);
        }
        // A connection may have died under a poll whose other shards answered with records.
        self.stale |= self.any_closed();
        r
    }

    /// Acknowledge claims (of any shards): each shard's at its poll connection.
    pub async fn ack(&mut self, claims: &[ClaimId]) -> Result<Vec<Result<(), Error>>, Error> {
        self.answer(AnswerOp::Ack, claims).await
    }

    /// Hand claims back: delivered again after `delay_ms`, or dead-lettered if that was the
    /// last allowed delivery.
    pub async fn nack(
        &mut self,
        claims: &[ClaimId],
        delay_ms: u64,
    ) -> Result<Vec<Result<(), Error>>, Error> {
        self.answer(AnswerOp::Nack { delay_ms }, claims).await
    }

    /// Answer claims with `op`, one request per shard, at the connection that shard is
    /// polled on; one result per claim, in order.
    pub async fn answer(
        &mut self,
        op: AnswerOp,
        claims: &[ClaimId],
    ) -> Result<Vec<Result<(), Error>>, Error> {
        let mut by_shard: BTreeMap<u32, Vec<usize>> = BTreeMap::new();
        for (i, c) in claims.iter().enumerate() {
            by_shard.entry(c.shard).or_default().push(i);
        }
        let mut out: Vec<Option<Result<(), Error>>> = vec![None; claims.len()];
        for (shard, idx) in by_shard {
            let subset: Vec<ClaimId> = idx.iter().map(|&i| claims[i]).collect();
            let client = match self.inner.client_of_checked(shard) {
                Some(c) => c.clone(),
                None => {
                    return Err(Error::InvalidArgument(format!(
                        "claim of shard {shard}: the stream has no such shard"
                    )))
                }
            };
            let answered = match client
                .group_answer(&self.stream, &self.group, op, &subset)
                .await
            {
                Ok(a) => a,
                Err(e) => {
                    self.note_failure(&e);
                    return Err(e);
                }
            };
            for (&i, r) in idx.iter().zip(answered) {
                out[i] = Some(r);
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every claim answered"))
            .collect())
    }

    fn any_closed(&self) -> bool {
        (0..self.inner.shard_count()).any(|s| self.inner.client_of(s).is_closed())
    }

    fn note_failure(&mut self, e: &Error) {
        if connection_lost(e) || matches!(e.code(), Some(ErrorCode::NotLeader)) {
            self.stale = true;
        }
    }

    /// Point every shard at its owner again: drop closed connections and the owner map,
    /// learn the owners from any broker, and reconnect.
    async fn reroute(&mut self) -> Result<(), Error> {
        for s in 0..self.inner.shard_count() {
            let c = self.inner.client_of(s).clone();
            if c.is_closed() {
                self.cc.forget_conn(&c);
            }
        }
        self.cc.forget_layout(&self.stream);
        let (shards, owners) = self.cc.layout(&self.stream).await?;
        for shard in 0..shards.min(self.inner.shard_count()) {
            let owner = owners.get(shard as usize).copied().unwrap_or(0);
            let c = self.cc.to_node(owner).await?;
            self.inner.set_client(shard, c);
        }
        self.stale = false;
        Ok(())
    }
}
