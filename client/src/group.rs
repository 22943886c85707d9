//! Consumer groups: claim records of a durable stream, answer them (ack, nack, extend,
//! reject), work the dead-letter list. A group lives on each shard of its stream; calls
//! that take `shard: None` act on every shard, and [`GroupConsumer`] polls all shards of
//! a stream from one call.
//!
//! Delivery is at least once: a record is delivered again when its claim lapses unanswered
//! or is nacked, and after a broker restart every record not acknowledged before it is
//! delivered again. Handle records idempotently.

use super::*;
use felix_quic::wire::{
    AnswerOp, ClaimId, ClaimRef, DeadLetterAction, DeadLetterRef, GroupFrame, GroupInfo, GroupRef,
};
use std::time::Instant;

/// One claimed record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupRecord {
    pub shard: u32,
    pub offset: u64,
    /// Which delivery this is, from 1.
    pub attempt: u32,
    pub payload: Bytes,
    /// The claim holds until about then (the broker's clock decides; measured from when
    /// the poll was sent, so early rather than late — except for a long poll, whose claim
    /// starts when it is served: then it is `visibility` after the answer).
    pub deadline: Instant,
}

impl GroupRecord {
    /// The claim's name, `SHARD:OFFSET:ATTEMPTS`.
    pub fn claim(&self) -> ClaimId {
        ClaimId {
            shard: self.shard,
            offset: self.offset,
            attempt: self.attempt,
        }
    }
}

/// Settings of a new group.
#[derive(Debug, Clone, Copy)]
pub struct GroupOptions {
    pub start: StartAt,
    /// Deliveries before a record is dead-lettered; 0 = broker default (5).
    pub max_attempts: u32,
    /// Default claim duration of polls; 0 = broker default (30 s).
    pub visibility_timeout_ms: u64,
}

impl Default for GroupOptions {
    fn default() -> Self {
        GroupOptions {
            start: StartAt::Earliest,
            max_attempts: 0,
            visibility_timeout_ms: 0,
        }
    }
}

/// A page of dead letters of one shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterPage {
    pub letters: Vec<DeadLetterRef>,
    pub next_after: Option<u64>,
}

fn target(stream: &StreamName, group: &str, shard: u32) -> GroupRef {
    GroupRef {
        stream: stream.clone(),
        group: group.to_string(),
        shard,
    }
}

fn group_answer(f: Frame) -> Result<GroupFrame, Error> {
    match f {
        Frame::Group(g) => Ok(g),
        other => Err(unexpected(other)),
    }
}

fn records_of(g: GroupFrame, base: Instant) -> Result<Vec<GroupRecord>, Error> {
    match g {
        GroupFrame::GroupRecords {
            shard,
            visibility_timeout_ms,
            claims,
            records,
            ..
        } => {
            let deadline = base + Duration::from_millis(visibility_timeout_ms);
            Ok(claims
                .into_iter()
                .zip(records.iter())
                .map(|(c, payload)| GroupRecord {
                    shard,
                    offset: c.offset,
                    attempt: c.attempt,
                    payload,
                    deadline,
                })
                .collect())
        }
        other => Err(Error::Protocol(format!(
            "unexpected answer kind {} to a poll",
            other.kind()
        ))),
    }
}

impl Client {
    /// Send a request now; the answer arrives on the receiver.
    fn start(
        &self,
        make: impl FnOnce(u64) -> Frame,
    ) -> Result<(u64, oneshot::Receiver<Result<Frame, Error>>), Error> {
        let request_id = self.inner.id();
        let (reply, rx) = oneshot::channel();
        self.inner.send(Cmd::Request {
            frame: make(request_id),
            request_id,
            reply,
        })?;
        Ok((request_id, rx))
    }

    async fn group_request(
        &self,
        make: impl FnOnce(u64) -> GroupFrame,
    ) -> Result<GroupFrame, Error> {
        group_answer(self.request(|rid| Frame::Group(make(rid))).await?)
    }

    async fn shards_of(&self, stream: &StreamName, shard: Option<u32>) -> Result<Vec<u32>, Error> {
        Ok(match shard {
            Some(s) => vec![s],
            None => (0..self.describe_stream(stream).await?.shards).collect(),
        })
    }

    async fn expect_ok(&self, make: impl FnOnce(u64) -> GroupFrame) -> Result<(), Error> {
        match self.group_request(make).await? {
            GroupFrame::GroupOk { .. } => Ok(()),
            other => Err(Error::Protocol(format!(
                "unexpected answer kind {}",
                other.kind()
            ))),
        }
    }

    /// Create `group` on one shard, or on every shard of the stream (`None`). Creating on
    /// every shard stops at the first refusal (shards before it keep the group).
    pub async fn group_create(
        &self,
        stream: &StreamName,
        group: &str,
        shard: Option<u32>,
        opts: GroupOptions,
    ) -> Result<(), Error> {
        for s in self.shards_of(stream, shard).await? {
            self.expect_ok(|request_id| GroupFrame::GroupCreate {
                request_id,
                target: target(stream, group, s),
                start: opts.start,
                max_attempts: opts.max_attempts,
                visibility_timeout_ms: opts.visibility_timeout_ms,
            })
            .await?;
        }
        Ok(())
    }

    /// Delete `group` (its cursor and dead letters) on one shard or every shard.
    pub async fn group_delete(
        &self,
        stream: &StreamName,
        group: &str,
        shard: Option<u32>,
    ) -> Result<(), Error> {
        for s in self.shards_of(stream, shard).await? {
            self.expect_ok(|request_id| GroupFrame::GroupDelete {
                request_id,
                target: target(stream, group, s),
            })
            .await?;
        }
        Ok(())
    }

    /// Counts and settings per shard.
    pub async fn group_describe(
        &self,
        stream: &StreamName,
        group: &str,
        shard: Option<u32>,
    ) -> Result<Vec<(u32, GroupInfo)>, Error> {
        let mut out = Vec::new();
        for s in self.shards_of(stream, shard).await? {
            match self
                .group_request(|request_id| GroupFrame::GroupDescribe {
                    request_id,
                    target: target(stream, group, s),
                })
                .await?
            {
                GroupFrame::GroupInfo { shard, info, .. } => out.push((shard, info)),
                other => {
                    return Err(Error::Protocol(format!(
                        "unexpected answer kind {}",
                        other.kind()
                    )))
                }
            }
        }
        Ok(out)
    }

    /// Claim up to `max` records of one shard for `visibility_timeout_ms` (the group's
    /// default when `None`). With nothing to claim, wait up to `wait` for a record (the
    /// broker bounds the wait by `group_poll_wait_max_ms`).
    pub async fn group_poll(
        &self,
        stream: &StreamName,
        group: &str,
        shard: u32,
        max: u32,
        visibility_timeout_ms: Option<u64>,
        wait: Duration,
    ) -> Result<Vec<GroupRecord>, Error> {
        let sent = Instant::now();
        let (_, rx) = self.start(|request_id| {
            Frame::Group(GroupFrame::GroupPoll {
                request_id,
                target: target(stream, group, shard),
                max,
                visibility_timeout_ms: visibility_timeout_ms.unwrap_or(0),
                wait_ms: wait.as_millis() as u64,
            })
        })?;
        let f = self.wait_long(rx, wait).await?;
        let base = if wait.is_zero() { sent } else { Instant::now() };
        records_of(group_answer(f)?, base)
    }

    async fn wait_long(
        &self,
        rx: oneshot::Receiver<Result<Frame, Error>>,
        wait: Duration,
    ) -> Result<Frame, Error> {
        self.inner
            .answer(rx, wait + self.inner.cfg.request_timeout)
            .await
    }

    /// Answer claims (of any shards): one request per shard; one result per claim, in
    /// order (`stale_claim` for a delivery that is no longer live).
    pub async fn group_answer(
        &self,
        stream: &StreamName,
        group: &str,
        op: AnswerOp,
        claims: &[ClaimId],
    ) -> Result<Vec<Result<(), Error>>, Error> {
        let mut by_shard: std::collections::BTreeMap<u32, Vec<usize>> = Default::default();
        for (i, c) in claims.iter().enumerate() {
            by_shard.entry(c.shard).or_default().push(i);
        }
        let mut out: Vec<Option<Result<(), Error>>> = vec![None; claims.len()];
        for (shard, idx) in by_shard {
            let refs: Vec<ClaimRef> = idx
                .iter()
                .map(|&i| ClaimRef {
                    offset: claims[i].offset,
                    attempt: claims[i].attempt,
                })
                .collect();
            let answered = self
                .group_request(|request_id| GroupFrame::GroupAnswer {
                    request_id,
                    target: target(stream, group, shard),
                    op,
                    claims: refs,
                })
                .await?;
            let GroupFrame::GroupAnswered { codes, .. } = answered else {
                return Err(Error::Protocol("unexpected answer to GroupAnswer".into()));
            };
            if codes.len() != idx.len() {
                return Err(Error::Protocol(format!(
                    "{} results for {} claims",
                    codes.len(),
                    idx.len()
                )));
            }
            for (&i, code) in idx.iter().zip(codes) {
                out[i] = Some(match code {
                    0 => Ok(()),
                    n => Err(broker_error(n, format!("claim {}", claims[i]))),
                });
            }
        }
        Ok(out
            .into_iter()
            .map(|r| r.expect("every claim answered"))
            .collect())
    }

    /// Acknowledge: the records are done for the group.
    pub async fn group_ack(
        &self,
        stream: &StreamName,
        group: &str,
        claims: &[ClaimId],
    ) -> Result<Vec<Result<(), Error>>, Error> {
        self.group_answer(stream, group, AnswerOp::Ack, claims)
            .await
    }

    /// Hand back: delivered again after `delay_ms` (0: at once), or dead-lettered if that
    /// was the last allowed delivery.
    pub async fn group_nack(
        &self,
        stream: &StreamName,
        group: &str,
        claims: &[ClaimId],
        delay_ms: u64,
    ) -> Result<Vec<Result<(), Error>>, Error> {
        self.group_answer(stream, group, AnswerOp::Nack { delay_ms }, claims)
            .await
    }

    /// Renew claims for `visibility_timeout_ms` from now.
    pub async fn group_extend(
        &self,
        stream: &StreamName,
        group: &str,
        claims: &[ClaimId],
        visibility_timeout_ms: u64,
    ) -> Result<Vec<Result<(), Error>>, Error> {
        self.group_answer(
            stream,
            group,
            AnswerOp::Extend {
                visibility_timeout_ms,
            },
            claims,
        )
        .await
    }

    /// Dead-letter claims now.
    pub async fn group_reject(
        &self,
        stream: &StreamName,
        group: &str,
        claims: &[ClaimId],
    ) -> Result<Vec<Result<(), Error>>, Error> {
        self.group_answer(stream, group, AnswerOp::Reject, claims)
            .await
    }

    /// Move the cursor (every shard, or one). Forward skips records; backward delivers
    /// finished records again (dead letters are never touched).
    pub async fn group_seek(
        &self,
        stream: &StreamName,
        group: &str,
        shard: Option<u32>,
        to: StartAt,
    ) -> Result<(), Error> {
        for s in self.shards_of(stream, shard).await? {
            self.expect_ok(|request_id| GroupFrame::GroupSeek {
                request_id,
                target: target(stream, group, s),
                to,
            })
            .await?;
        }
        Ok(())
    }

    /// One page (at most `limit`, up to 1000) of a shard's dead letters above `after`.
    pub async fn dead_letters(
        &self,
        stream: &StreamName,
        group: &str,
        shard: u32,
        after: Option<u64>,
        limit: u32,
    ) -> Result<DeadLetterPage, Error> {
        match self
            .group_request(|request_id| GroupFrame::DeadLetterList {
                request_id,
                target: target(stream, group, shard),
                after,
                limit,
            })
            .await?
        {
            GroupFrame::DeadLetterPage {
                letters,
                next_after,
                ..
            } => Ok(DeadLetterPage {
                letters,
                next_after,
            }),
            other => Err(Error::Protocol(format!(
                "unexpected answer kind {}",
                other.kind()
            ))),
        }
    }

    /// Redrive (deliver again with a fresh budget) or discard one dead letter.
    pub async fn dead_letter_op(
        &self,
        stream: &StreamName,
        group: &str,
        shard: u32,
        offset: u64,
        action: DeadLetterAction,
    ) -> Result<(), Error> {
        self.expect_ok(|request_id| GroupFrame::DeadLetterOp {
            request_id,
            target: target(stream, group, shard),
            action,
            offset,
        })
        .await
    }

    /// A consumer of `group` over every shard of `stream`.
    pub async fn group_consumer(
        &self,
        stream: &StreamName,
        group: &str,
    ) -> Result<GroupConsumer<&Client>, Error> {
        let shards = self.describe_stream(stream).await?.shards;
        Ok(GroupConsumer::over(
            (0..shards).map(|_| self).collect(),
            stream,
            group,
        ))
    }
}

/// A poll's answer: (shard, request id, when it was sent, the answer).
type Answer = (u32, u64, Instant, Result<Frame, Error>);

/// Polls one group across every shard of a stream from one call.
///
/// A poll first asks every shard at once without waiting (the `max` split between them,
/// the starting shard rotating so none is favoured). Only if all are empty and `wait` is
/// not zero does it long-poll every shard; as soon as one answers with records the others
/// are cancelled. Records claimed by a poll whose answer is not returned — a cancelled poll
/// that had already claimed, answers beyond `max`, or every answer of a `poll` future that
/// was dropped before it finished — are kept and returned first by the next call (dropped
/// once their claim has lapsed: the broker delivers them again). Long polls still waiting
/// when a new call starts, or when the consumer is dropped, are cancelled.
///
/// `H` is how it holds a connection: `&Client` from [`Client::group_consumer`] (every shard
/// on that connection), `Arc<Client>` from the ClusterClient's consumer (each shard on its
/// owner's connection).
pub struct GroupConsumer<H: std::ops::Deref<Target = Client>> {
    /// The connection each shard's polls go to.
    clients: Vec<H>,
    stream: StreamName,
    group: String,
    shards: u32,
    next: u32,
    buffered: VecDeque<GroupRecord>,
    /// Every poll's answer arrives here (forwarded by a task), so none is lost with a
    /// dropped future.
    answers_tx: mpsc::UnboundedSender<Answer>,
    answers: mpsc::UnboundedReceiver<Answer>,
    /// Polls sent and not answered yet: (shard, request id) → long poll. (Request ids are
    /// unique per connection, and shards may be on different connections.)
    outstanding: std::collections::HashMap<(u32, u64), bool>,
}

impl<H: std::ops::Deref<Target = Client>> Drop for GroupConsumer<H> {
    fn drop(&mut self) {
        self.cancel_long_polls();
    }
}

impl<H: std::ops::Deref<Target = Client>> GroupConsumer<H> {
    /// A consumer of `group` over the shards of `stream`, shard `i`'s polls on `clients[i]`.
    pub(crate) fn over(clients: Vec<H>, stream: &StreamName, group: &str) -> Self {
        let (answers_tx, answers) = mpsc::unbounded_channel();
        GroupConsumer {
            shards: clients.len() as u32,
            clients,
            stream: stream.clone(),
            group: group.to_string(),
            next: 0,
            buffered: VecDeque::new(),
            answers_tx,
            answers,
            outstanding: std::collections::HashMap::new(),
        }
    }

    /// Move shard `shard`'s polls to another connection (its owner changed or its
    /// connection was lost). Polls outstanding on the old one still answer into the consumer.
    pub(crate) fn set_client(&mut self, shard: u32, client: H) {
        if let Some(c) = self.clients.get_mut(shard as usize) {
            *c = client;
        }
    }

    /// The connection shard `shard`'s polls go to.
    pub(crate) fn client_of(&self, shard: u32) -> &H {
        &self.clients[shard as usize]
    }

    /// [`GroupConsumer::client_of`], `None` for a shard the stream does not have.
    pub(crate) fn client_of_checked(&self, shard: u32) -> Option<&H> {
        self.clients.get(shard as usize)
    }

    pub(crate) fn shard_count(&self) -> u32 {
        self.shards
    }

    /// Split `max` over the shards starting at the rotation point; each listed shard gets
    /// at least `floor` (0 or 1).
    fn split(&mut self, max: u32, floor: u32) -> Vec<(u32, u32)> {
        let n = self.shards;
        let start = self.next;
        self.next = (self.next + 1) % n.max(1);
        (0..n)
            .map(|i| {
                let s = (start + i) % n;
                let q = max / n + u32::from(i < max % n);
                (s, q.max(floor))
            })
            .filter(|&(_, q)| q > 0)
            .collect()
    }

    /// Send one poll; a task forwards its answer to `answers`.
    fn launch(
        &mut self,
        shard: u32,
        max: u32,
        vt: Option<u64>,
        wait: Duration,
    ) -> Result<(), Error> {
        let sent = Instant::now();
        let t = target(&self.stream, &self.group, shard);
        let client = &self.clients[shard as usize];
        let (rid, rx) = client.start(|request_id| {
            Frame::Group(GroupFrame::GroupPoll {
                request_id,
                target: t,
                max,
                visibility_timeout_ms: vt.unwrap_or(0),
                wait_ms: wait.as_millis() as u64,
            })
        })?;
        let limit = wait + client.inner.cfg.request_timeout;
        self.outstanding.insert((shard, rid), !wait.is_zero());
        let tx = self.answers_tx.clone();
        let inner = client.inner.clone();
        tokio::spawn(async move {
            let r = inner.answer(rx, limit).await;
            let _ = tx.send((shard, rid, sent, r));
        });
        Ok(())
    }

    /// Ask every long poll still waiting to answer now (with what it holds, or nothing).
    fn cancel_long_polls(&mut self) {
        for (&(shard, rid), &long) in &self.outstanding {
            if long {
                let _ = self.clients[shard as usize].inner.send(Cmd::Send {
                    frame: Frame::Group(GroupFrame::GroupPollCancel {
                        request_id: rid,
                        target: target(&self.stream, &self.group, shard),
                    }),
                });
            }
        }
    }

    /// Take one answer in: its records, or its error.
    fn take(&mut self, (shard, rid, sent, r): Answer) -> Result<Vec<GroupRecord>, Error> {
        // See `GroupRecord::deadline` for the base of a long poll.
        let long = self.outstanding.remove(&(shard, rid)).unwrap_or(false);
        let base = if long { Instant::now() } else { sent };
        r.and_then(group_answer).and_then(|g| records_of(g, base))
    }

    /// Up to `max` records from any shards.
    pub async fn poll(
        &mut self,
        max: u32,
        visibility_timeout_ms: Option<u64>,
        wait: Duration,
    ) -> Result<Vec<GroupRecord>, Error> {
        if max == 0 {
            return Err(Error::InvalidArgument("poll max must be at least 1".into()));
        }
        // Answers of an earlier call that did not finish, and its long polls.
        self.cancel_long_polls();
        while let Ok(a) = self.answers.try_recv() {
            if let Ok(recs) = self.take(a) {
                self.buffered.extend(recs);
            }
        }
        let mut out: Vec<GroupRecord> = Vec::new();
        let mut first_err = None;
        let fill = |out: &mut Vec<GroupRecord>, buffered: &mut VecDeque<GroupRecord>| {
            let now = Instant::now();
            while out.len() < max as usize {
                match buffered.pop_front() {
                    Some(r) if r.deadline > now => out.push(r),
                    Some(_) => {}
                    None => break,
                }
            }
        };
        fill(&mut out, &mut self.buffered);
        if !out.is_empty() {
            return Ok(out);
        }
        // Round one: every shard, no wait; every answer is read (one shard's refusal does
        // not drop the records the others claimed).
        for (s, q) in self.split(max, 0) {
            self.launch(s, q, visibility_timeout_ms, Duration::ZERO)?;
        }
        while !self.outstanding.is_empty() {
            let Some(a) = self.answers.recv().await else {
                break;
            };
            match self.take(a) {
                Ok(recs) => self.buffered.extend(recs),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
        }
        fill(&mut out, &mut self.buffered);
        if !out.is_empty() || wait.is_zero() {
            return match (out.is_empty(), first_err) {
                (true, Some(e)) => Err(e),
                _ => Ok(out),
            };
        }
        // Round two: long-poll every shard; the first answer with records cancels the rest.
        for (s, q) in self.split(max, 1) {
            self.launch(s, q, visibility_timeout_ms, wait)?;
        }
        let mut cancelled = false;
        while !self.outstanding.is_empty() {
            let Some(a) = self.answers.recv().await else {
                break;
            };
            match self.take(a) {
                Ok(recs) => self.buffered.extend(recs),
                Err(e) => {
                    first_err.get_or_insert(e);
                }
            }
            fill(&mut out, &mut self.buffered);
            if !out.is_empty() && !cancelled {
                cancelled = true;
                self.cancel_long_polls();
            }
        }
        match (out.is_empty(), first_err) {
            (true, Some(e)) => Err(e),
            _ => Ok(out),
        }
    }
}
