//! Messages between cores (and from a core to itself, through its inbox), and their routing:
//! `route` never awaits a full channel (overflow queues drained by the pump task), and
//! `on_mesh` dispatches what arrives to the owner side or the connection side.

use super::shard::stream::StreamMsg;
use super::*;

/// Messages between cores (and from a core to itself, through its inbox): a datagram for a
/// connection another core holds, a request for the owner of a shard, or what an owner sends
/// back to the cores that hold connections. The split is where a peer link will forward: a
/// broker that does not own a shard sends its `ToOwner` to the broker that does.
pub enum MeshMsg {
    /// A datagram for a connection that lives on the receiving core.
    /// A datagram that arrived on another core's socket of kind `sock`.
    Packet {
        buf: Vec<u8>,
        from: SocketAddr,
        sock: felix_quic::server::Sock,
    },
    /// To the core that owns the shard named in the message.
    Owner(ToOwner),
    /// To the core that holds the connection (or the subscribers, watches) it is for.
    Conn(ToConn),
}

/// Connection core → the shard's owner core (or, `DrainHeld`, an owner to itself).
pub enum ToOwner {
    Publish(PublishReq),
    /// A subscriber on `core` wants the shard from `start`.
    Attach {
        core: u8,
        sub: u64,
        stream: u32,
        shard: u32,
        start: StartAt,
    },
    /// A durable shard's next history chunk from `from`, for a catching-up subscriber.
    Fetch {
        core: u8,
        sub: u64,
        stream: u32,
        shard: u32,
        from: u64,
    },
    /// One subscriber of `core` is gone.
    Detach {
        core: u8,
        stream: u32,
        shard: u32,
    },
    /// Whether any Block subscriber of `core` has parked batches.
    Parked {
        core: u8,
        stream: u32,
        shard: u32,
        parked: bool,
    },
    /// Owner → itself: try the next held publish (queued behind the deliveries just sent, so
    /// local subscribers park before the next append if they are full).
    DrainHeld {
        stream: u32,
        shard: u32,
    },
    /// A consumer-group request, to the owner of the durable shard.
    Group {
        origin: GroupOrigin,
        stream: u32,
        frame: felix_quic::wire::GroupFrame,
    },
    /// To every core: a connection that long-polled is gone.
    GroupConnClosed {
        core: u8,
        conn: ConnKey,
    },
    /// A cache request, to the owner of its shard.
    CacheReq {
        origin: CacheOrigin,
        cache: u32,
        shard: u32,
        frame: felix_quic::wire::CacheFrame,
    },
    /// Register a watch and compute its start, at the owner.
    WatchOpen(WatchReq),
    /// Unregister a watch at the owner.
    WatchClose {
        watch: u64,
        cache: u32,
        shard: u32,
    },
    /// A replica message from broker `from` about a shard this core owns, taken from a peer
    /// link on another core (the listener core is whichever took the link's first packet).
    Replica {
        stream: u32,
        shard: u32,
        from: u64,
        msg: felix_quic::wire::replica::ReplicaMsg,
        records: Vec<felix_quic::wire::replica::ShippedRecord>,
    },
}

/// Owner core → the core that holds the connection, subscribers or watches.
pub enum ToConn {
    /// `(shard, first_offset, count)` or the refusal.
    PublishResult { origin: Origin, result: PubResult },
    /// To every core with subscribers for the shard: one per core per batch.
    Delivery {
        stream: u32,
        shard: u32,
        batch: Batch,
    },
    /// What to replay, and the offset live deliveries continue at.
    AttachResult {
        sub: u64,
        result: Result<AttachOk, Refusal>,
    },
    /// A history chunk (from disk), or the ring's tail and the switch to live delivery
    /// (`live`).
    FetchResult {
        sub: u64,
        result: Result<Fetched, Refusal>,
    },
    /// The answer to a group request.
    GroupReply { origin: GroupOrigin, frame: Frame },
    /// The answer to a cache request.
    CacheReply { origin: CacheOrigin, frame: Frame },
    /// A watch's start, or its refusal.
    WatchOpened {
        watch: u64,
        result: Result<Opened, Refusal>,
    },
    /// A change of a cache shard, to a core with a matching watch.
    CacheChange { cache: u32, shard: u32, ev: Arc<Ev> },
    /// The owner's stream shard failed (its storage): end the local subscriptions on it.
    SubsEnded {
        stream: u32,
        shard: u32,
        why: Refusal,
    },
    /// The owner dropped a shard (its storage failed): end the local watches on it.
    WatchesEnded {
        cache: u32,
        shard: u32,
        why: Refusal,
    },
}

impl MeshMsg {
    /// The stream shard an owner-bound stream message is for, and the message as the shard
    /// host takes it; anything else is handed back (moved, not boxed: this is on the path of
    /// every delivery).
    #[allow(clippy::result_large_err)]
    pub(crate) fn into_stream(self) -> Result<(ShardKey, StreamMsg), MeshMsg> {
        Ok(match self {
            MeshMsg::Owner(ToOwner::Publish(req)) => {
                ((req.stream, req.shard), StreamMsg::Publish(req))
            }
            MeshMsg::Owner(ToOwner::Attach {
                core,
                sub,
                stream,
                shard,
                start,
            }) => ((stream, shard), StreamMsg::Attach { core, sub, start }),
            MeshMsg::Owner(ToOwner::Fetch {
                core,
                sub,
                stream,
                shard,
                from,
            }) => ((stream, shard), StreamMsg::Fetch { core, sub, from }),
            MeshMsg::Owner(ToOwner::Detach {
                core,
                stream,
                shard,
            }) => ((stream, shard), StreamMsg::Detach { core }),
            MeshMsg::Owner(ToOwner::Parked {
                core,
                stream,
                shard,
                parked,
            }) => ((stream, shard), StreamMsg::Parked { core, parked }),
            MeshMsg::Owner(ToOwner::DrainHeld { stream, shard }) => {
                ((stream, shard), StreamMsg::DrainHeld)
            }
            other => return Err(other),
        })
    }

    /// The shard of a message that waits while that shard's durable log opens (publishes,
    /// attaches, detaches, park notices, group requests); None for any other.
    /// The cache shard a request for a cache shard's owner names (requests, watch opens and
    /// closes), which its lifecycle gates.
    pub(crate) fn cache_shard(&self) -> Option<ShardKey> {
        match self {
            MeshMsg::Owner(ToOwner::CacheReq { cache, shard, .. })
            | MeshMsg::Owner(ToOwner::WatchClose { cache, shard, .. }) => Some((*cache, *shard)),
            MeshMsg::Owner(ToOwner::WatchOpen(r)) => Some((r.cache, r.shard)),
            _ => None,
        }
    }

    pub(crate) fn waits_for_open(&self) -> Option<ShardKey> {
        match self {
            MeshMsg::Owner(ToOwner::Publish(req)) => Some((req.stream, req.shard)),
            MeshMsg::Owner(ToOwner::Group { stream, frame, .. }) => {
                frame.target().map(|t| (*stream, t.shard))
            }
            MeshMsg::Owner(ToOwner::Attach { stream, shard, .. })
            | MeshMsg::Owner(ToOwner::Detach { stream, shard, .. })
            | MeshMsg::Owner(ToOwner::Parked { stream, shard, .. }) => Some((*stream, *shard)),
            _ => None,
        }
    }
}

/// A successful attach.
#[derive(Debug)]
pub struct AttachOk {
    pub lag: Option<Lag>,
    pub replay: Vec<Batch>,
    pub from: u64,
    /// The subscriber starts below the owner's in-memory tail: it fetches history from disk
    /// (one chunk at a time, as its queue empties) and ignores live batches until a fetch
    /// answers `live`.
    pub catch_up: bool,
}

/// A history chunk.
#[derive(Debug)]
pub struct Fetched {
    /// Records retention deleted while the subscriber was catching up.
    pub lag: Option<Lag>,
    pub batches: Vec<Batch>,
    /// These batches reach the owner's current end: live deliveries follow them.
    pub live: bool,
}

impl CoreState {
    // ---------- mesh plumbing ----------

    pub(in crate::core) fn route(&mut self, to: u8, msg: MeshMsg) {
        if to == self.id {
            self.inbox.push_back(msg);
            return;
        }
        let to = to as usize;
        if !self.mesh_overflow[to].is_empty() {
            self.mesh_overflow[to].push_back(msg);
            self.mesh_wake.wake();
            return;
        }
        match self.senders.try_send_to(to, msg) {
            Ok(()) => {}
            Err(glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(msg))) => {
                self.mesh_overflow[to].push_back(msg);
                self.mesh_wake.wake();
            }
            // Closed peer (shutdown): nothing can carry it any more.
            Err(_) => {}
        }
    }

    pub(in crate::core) fn drain_inbox(&mut self) {
        while let Some(m) = self.inbox.pop_front() {
            self.on_mesh(m);
        }
    }

    pub(in crate::core) fn on_mesh(
        &mut self,
        msg: MeshMsg,
    ) -> Option<(Vec<u8>, SocketAddr, felix_quic::server::Sock)> {
        // A peer may act on a newer catalog than ours (a slot we have not seen yet): catch up
        // first. The cell only moves forward, so after this we know every slot it knows.
        self.refresh_catalog();
        let msg = self.defer_while_opening(msg)?;
        // Only cache requests pass the cache shards' lifecycle (the rest skip the step).
        let msg = if msg.cache_shard().is_some() {
            self.with_caches(|h, ctx| h.gate(msg, ctx))?
        } else {
            msg
        };
        let msg = match msg {
            // A replicated shard's publishes go to its replica, not to the stream host.
            MeshMsg::Owner(ToOwner::Publish(req))
                if self.catalog.replicated(req.stream, req.shard) =>
            {
                self.replica_publish(req);
                return None;
            }
            other => other,
        };
        let msg = match msg.into_stream() {
            Ok((key, m)) => {
                self.tell_stream_shard(key, m);
                return None;
            }
            Err(msg) => msg,
        };
        match msg {
            MeshMsg::Packet {
                mut buf,
                from,
                sock,
            } => {
                CoreCounters::inc(&self.s.counters.packets_forwarded_in);
                match self.ep.on_datagram(&mut buf, from, sock, true) {
                    Route::Conn { key, new } => self.after_recv(key, new),
                    Route::Reply(r) => return Some((r, from, sock)),
                    _ => {}
                }
            }
            MeshMsg::Conn(ToConn::PublishResult { origin, result }) => {
                self.on_publish_result(origin, result, 0)
            }
            MeshMsg::Conn(ToConn::Delivery {
                stream,
                shard,
                batch,
            }) => self.on_delivery(stream, shard, batch),
            MeshMsg::Conn(ToConn::AttachResult { sub, result }) => {
                self.on_attach_result(sub, result)
            }
            MeshMsg::Conn(ToConn::FetchResult { sub, result }) => self.on_fetch_result(sub, result),
            MeshMsg::Owner(ToOwner::Group {
                origin,
                stream,
                frame,
            }) => self.on_group(origin, stream, frame),
            MeshMsg::Conn(ToConn::GroupReply { origin, frame }) => {
                self.on_group_reply(origin, frame)
            }
            MeshMsg::Owner(ToOwner::GroupConnClosed { core, conn }) => {
                self.on_group_conn_closed(core, conn)
            }
            MeshMsg::Owner(ToOwner::Replica {
                stream,
                shard,
                from,
                msg,
                records,
            }) => self.on_replica_msg((stream, shard), from, msg, records),
            MeshMsg::Owner(ToOwner::CacheReq {
                origin,
                cache,
                shard,
                frame,
            }) => self.on_cache_req(origin, cache, shard, frame),
            MeshMsg::Conn(ToConn::CacheReply { origin, frame }) => {
                self.on_cache_reply(origin, frame)
            }
            MeshMsg::Owner(ToOwner::WatchOpen(req)) => self.on_watch_open(req),
            MeshMsg::Conn(ToConn::WatchOpened { watch, result }) => {
                self.on_watch_opened(watch, result)
            }
            MeshMsg::Conn(ToConn::CacheChange { cache, shard, ev }) => {
                self.on_cache_change(cache, shard, ev)
            }
            MeshMsg::Owner(ToOwner::WatchClose {
                watch,
                cache,
                shard,
            }) => self.on_watch_close(watch, cache, shard),
            MeshMsg::Conn(ToConn::SubsEnded { stream, shard, why }) => {
                self.end_local_subs((stream, shard), why)
            }
            MeshMsg::Conn(ToConn::WatchesEnded { cache, shard, why }) => {
                self.end_local_watches((cache, shard), why)
            }
            MeshMsg::Owner(ToOwner::Publish(_))
            | MeshMsg::Owner(ToOwner::Attach { .. })
            | MeshMsg::Owner(ToOwner::Fetch { .. })
            | MeshMsg::Owner(ToOwner::Detach { .. })
            | MeshMsg::Owner(ToOwner::Parked { .. })
            | MeshMsg::Owner(ToOwner::DrainHeld { .. }) => {
                unreachable!("handed to the stream shard host above")
            }
        }
        None
    }
}
