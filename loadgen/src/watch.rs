//! `--mode cache`: put and get latency, then watch fanout on one key. W watchers spread over
//! the connections, one writer at `--rate` acked puts/s for `--secs`; every watcher's offsets
//! are checked against the writer's acknowledged ones.
//!
//! `--watch-reader` picks how the watchers are read: `set` (one `WatchSet` per connection,
//! read by one task, as peer-bench reads etcd: one reader per gRPC stream) or `task` (a task
//! per watch, each woken per change).

use super::*;
use felix_client::{EventKind, WatchFilter, WatchItem, WatchOptions, WatchSet, WatchStart};
use hdrhistogram::Histogram;
use std::sync::Mutex;
use tokio::task::JoinHandle;

#[derive(Clone, Copy, ValueEnum, Debug, PartialEq, Eq)]
pub(crate) enum WatchReader {
    /// One task per connection reads that connection's watches through a `WatchSet`.
    Set,
    /// One task per watch.
    Task,
}

fn new_hist() -> Histogram<u64> {
    Histogram::<u64>::new_with_bounds(1, 60_000_000, 2).unwrap()
}

/// What one watcher saw.
#[derive(Default)]
struct Watcher {
    got: u64,
    /// Ended by the broker (not by the run's close).
    lagged: bool,
    /// Every offset seen, in arrival order: checked against the writer's acknowledged offsets
    /// at the end (a count could pass a gap plus a duplicate).
    offsets: Vec<u64>,
}

/// What an item meant to its watcher.
enum Seen {
    /// A change, with its latency from the writer's stamp in the value, µs.
    Put(u64),
    /// The watch's end.
    End,
    Other,
}

impl Watcher {
    fn on(&mut self, item: WatchItem, epoch: Instant) -> Seen {
        match item {
            WatchItem::Event {
                kind: EventKind::Put,
                value,
                offset,
                ..
            } => {
                self.offsets.push(offset);
                self.got += 1;
                let t = u64::from_le_bytes(value[..8].try_into().unwrap());
                let now = epoch.elapsed().as_micros() as u64;
                Seen::Put(now.saturating_sub(t).max(1))
            }
            // u16::MAX: the connection closed (the run is over), not a lag end.
            WatchItem::End { code, .. } => {
                self.lagged = code != u16::MAX;
                Seen::End
            }
            _ => Seen::Other,
        }
    }
}

/// Shared between the readers and the main task: each watcher's count so far, and how many
/// watchers' reading is over. The main task closes the connections once every watcher has
/// what the writer sent (or the drain time is up), which ends the readers.
struct Progress {
    got: Vec<AtomicU64>,
    ended: AtomicU64,
}

/// A reader's result: its watchers by global index, and its latency histogram (the `task`
/// readers share one per connection instead).
type ReaderOut = (Vec<(usize, Watcher)>, Option<Histogram<u64>>);

/// The latency histograms of the `task` readers, one per connection.
type SharedHists = Vec<Arc<Mutex<Histogram<u64>>>>;

pub(crate) async fn run(a: &Args) -> Result<(), felix_client::Error> {
    let watchers_n = a.subscribers;
    let count = a.count.unwrap_or(10_000);
    if watchers_n == 0 || watchers_n > 10_000 || a.rate == 0 || a.rate > 100_000 || a.secs == 0 {
        return Err(felix_client::Error::InvalidArgument(
            "need 1..=10000 watchers (--subscribers), rate 1..=100000, secs >= 1".into(),
        ));
    }
    let cache = StreamName::new("default", "default", &a.cache);
    let load = load1();
    let writer = Client::connect(cfg(a)).await?;
    let deadline = Instant::now() + Duration::from_secs(a.bound_secs);
    let (puts, put_h, get_h) = put_get(&writer, &cache, count, deadline, a.payload).await?;
    // Watch fanout on one key.
    let conns_n = a
        .connections
        .unwrap_or(watchers_n.div_ceil(100))
        .clamp(1, watchers_n);
    let rss0 = a.broker_pid.and_then(rss_bytes);
    let mut clients = Vec::new();
    for _ in 0..conns_n {
        clients.push(Client::connect(cfg(a)).await?);
    }
    let progress = Arc::new(Progress {
        got: (0..watchers_n).map(|_| AtomicU64::new(0)).collect(),
        ended: AtomicU64::new(0),
    });
    // The time base of the writer's stamps and the readers' latencies.
    let epoch = Instant::now();
    let (readers, hists) = match a.watch_reader {
        WatchReader::Set => {
            let r = set_readers(&clients, &cache, watchers_n, &progress, epoch).await?;
            (r, Vec::new())
        }
        WatchReader::Task => task_readers(&clients, &cache, watchers_n, &progress, epoch).await?,
    };
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss1 = a.broker_pid.and_then(rss_bytes);
    let start = Instant::now();
    let cpu0 = cpu_mark(a);
    let (acked, put_live_h) = write_changes(a, &writer, &cache, epoch, deadline).await?;
    let n = acked.len() as u64;
    let write_secs = start.elapsed().as_secs_f64();
    // Bounded: until every watcher has the n changes, every reader ended, or the drain time.
    // The writer waits for each put, so it may end later than --secs when the load is heavy:
    // the watchers get 10 s after its last put (never less than after --secs), within the
    // run's bound.
    let drain_end = (epoch.elapsed() + Duration::from_secs(10))
        .max(Duration::from_secs(a.secs + 10))
        .min(Duration::from_secs(a.bound_secs));
    drain(
        epoch,
        drain_end,
        &progress.ended,
        watchers_n,
        &progress.got,
        n,
    )
    .await;
    // The watch phase ends here: its time and CPU do not include closing the connections.
    let elapsed = start.elapsed().as_secs_f64();
    let cpu1 = cpu_mark(a);
    for c in std::mem::take(&mut clients) {
        let _ = c.close().await;
    }
    let mut hist = new_hist();
    let mut watchers: Vec<Option<Watcher>> = (0..watchers_n).map(|_| None).collect();
    for r in readers {
        let (ws, h) = r.await.unwrap();
        if let Some(h) = h {
            hist.add(&h).unwrap();
        }
        for (i, w) in ws {
            watchers[i] = Some(w);
        }
    }
    for h in &hists {
        hist.add(&*h.lock().unwrap()).unwrap();
    }
    let watchers: Vec<Watcher> = watchers
        .into_iter()
        .map(Option::unwrap_or_default)
        .collect();
    let check = check_offsets(&watchers, &acked);
    let rss_per_watcher = match (rss0, rss1) {
        (Some(r0), Some(r1)) => Some(r1.saturating_sub(r0) as f64 / watchers_n as f64),
        _ => None,
    };
    // CPU over the watch phase, in cores: a saturated load core measures the client, not
    // the broker (the load core decrypts QUIC for every watcher).
    let cores =
        |x: Option<f64>, y: Option<f64>| Some(((y? - x?) / elapsed * 100.0).round() / 100.0);
    let client_us_per_event = match (cpu0.0, cpu1.0) {
        (Some(x), Some(y)) if check.delivered > 0 => Some((y - x) * 1e6 / check.delivered as f64),
        _ => None,
    };
    emit(
        a,
        serde_json::json!({
            "tool": "felix-loadgen", "mode": "cache", "cache": a.cache, "payload": a.payload,
            "unit": "us", "secs": a.secs, "max_secs": a.bound_secs, "truncated": puts < count,
            "puts": puts, "put_latency": pct(&put_h), "get_latency": pct(&get_h),
            "watchers": watchers_n, "connections": conns_n, "rate_target": a.rate,
            "watch_reader": format!("{:?}", a.watch_reader).to_lowercase(),
            "write_rate": n as f64 / write_secs, "changes": n, "delivered": check.delivered,
            "delivered_per_s": check.delivered as f64 / elapsed,
            "expected": n * watchers_n as u64,
            "watches_ended": check.lagged, "watchers_complete": check.complete,
            "lossless": check.complete == watchers_n, "load1": load,
            "watchers_exact_offsets": check.exact, "first_offset_mismatch": check.wrong,
            "put_latency_under_fanout": pct(&put_live_h),
            "broker_rss_per_watcher_bytes": rss_per_watcher,
            "watch_phase_cpu": {"client_cores": cores(cpu0.0, cpu1.0),
                "broker_cores": cores(cpu0.1, cpu1.1),
                "client_us_per_event": client_us_per_event},
            "change_to_watcher_latency": pct(&hist),
        }),
    );
    let _ = writer.close().await;
    Ok(())
}

/// `count` puts over 1,000 keys, then as many gets: their latencies.
async fn put_get(
    writer: &Client,
    cache: &StreamName,
    count: u64,
    deadline: Instant,
    payload: usize,
) -> Result<(u64, Histogram<u64>, Histogram<u64>), felix_client::Error> {
    let value = Bytes::from(vec![b'v'; payload]);
    let (mut put_h, mut get_h) = (new_hist(), new_hist());
    let mut puts = 0u64;
    for i in 0..count {
        if Instant::now() > deadline {
            break;
        }
        let t = Instant::now();
        writer
            .cache_put(cache, format!("bench/k{}", i % 1000), value.clone(), None)
            .await?;
        put_h.record(t.elapsed().as_micros().max(1) as u64).unwrap();
        puts += 1;
    }
    for i in 0..puts {
        let t = Instant::now();
        writer
            .cache_get(cache, format!("bench/k{}", i % 1000))
            .await?;
        get_h.record(t.elapsed().as_micros().max(1) as u64).unwrap();
    }
    Ok((puts, put_h, get_h))
}

const KEY: &[u8] = b"bench/watched";

/// One `WatchSet` per connection, watcher `i` on connection `i % conns`, and one reader task
/// per set.
async fn set_readers(
    clients: &[Client],
    cache: &StreamName,
    watchers_n: usize,
    progress: &Arc<Progress>,
    epoch: Instant,
) -> Result<Vec<JoinHandle<ReaderOut>>, felix_client::Error> {
    let conns_n = clients.len();
    let mut sets: Vec<(WatchSet, Vec<usize>)> = (0..conns_n)
        .map(|_| (WatchSet::new(), Vec::new()))
        .collect();
    for i in 0..watchers_n {
        let (set, members) = &mut sets[i % conns_n];
        let filter = WatchFilter::Key(Bytes::from_static(KEY));
        let id = set
            .watch(
                &clients[i % conns_n],
                cache,
                filter,
                WatchStart::Latest,
                WatchOptions::default(),
            )
            .await?;
        // Ids count from 1 in the order members are added.
        debug_assert_eq!(id as usize, members.len() + 1);
        members.push(i);
    }
    Ok(sets
        .into_iter()
        .map(|(mut set, members)| {
            let progress = progress.clone();
            tokio::spawn(async move {
                let mut h = new_hist();
                let mut ws: Vec<Watcher> = members.iter().map(|_| Watcher::default()).collect();
                while let Some((id, item)) = set.next().await {
                    let k = id as usize - 1;
                    match ws[k].on(item, epoch) {
                        Seen::Put(us) => {
                            let _ = h.record(us);
                            progress.got[members[k]].store(ws[k].got, Ordering::Release);
                        }
                        Seen::End => {
                            progress.ended.fetch_add(1, Ordering::AcqRel);
                        }
                        Seen::Other => {}
                    }
                }
                (members.into_iter().zip(ws).collect(), Some(h))
            })
        })
        .collect())
}

/// A task per watch, watcher `i` on connection `i % conns`; the latency histograms are per
/// connection.
async fn task_readers(
    clients: &[Client],
    cache: &StreamName,
    watchers_n: usize,
    progress: &Arc<Progress>,
    epoch: Instant,
) -> Result<(Vec<JoinHandle<ReaderOut>>, SharedHists), felix_client::Error> {
    let conns_n = clients.len();
    let mut watches = Vec::with_capacity(watchers_n);
    for i in 0..watchers_n {
        let filter = WatchFilter::Key(Bytes::from_static(KEY));
        let w = clients[i % conns_n]
            .cache_watch(cache, filter, WatchStart::Latest, WatchOptions::default())
            .await?;
        watches.push(w);
    }
    let hists: SharedHists = (0..conns_n)
        .map(|_| Arc::new(Mutex::new(new_hist())))
        .collect();
    let readers = watches
        .into_iter()
        .enumerate()
        .map(|(i, mut w)| {
            let h = hists[i % conns_n].clone();
            let progress = progress.clone();
            // A reader waits on its watch alone: a timeout per read would register a timer
            // per event per watcher, which was most of the load core's work at 10k watchers.
            tokio::spawn(async move {
                let mut me = Watcher::default();
                while let Some(item) = w.next().await {
                    match me.on(item, epoch) {
                        Seen::Put(us) => {
                            let _ = h.lock().unwrap().record(us);
                            progress.got[i].store(me.got, Ordering::Release);
                        }
                        Seen::End => break,
                        Seen::Other => {}
                    }
                }
                progress.ended.fetch_add(1, Ordering::AcqRel);
                (vec![(i, me)], None)
            })
        })
        .collect();
    Ok((readers, hists))
}

/// The writer: `--rate` puts/s to the watched key for `--secs`, each value stamped with its
/// send time. The acknowledged offsets, in order, and the acked puts' latency.
async fn write_changes(
    a: &Args,
    writer: &Client,
    cache: &StreamName,
    epoch: Instant,
    deadline: Instant,
) -> Result<(Vec<u64>, Histogram<u64>), felix_client::Error> {
    let start = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let total = a.rate * a.secs;
    let pad = vec![b'x'; a.payload.saturating_sub(8)];
    let mut acked: Vec<u64> = Vec::with_capacity(total as usize);
    let mut put_live_h = new_hist();
    let key = Bytes::from_static(KEY);
    while (acked.len() as u64) < total && Instant::now() < deadline {
        tick.tick().await;
        let due = ((start.elapsed().as_secs_f64() * a.rate as f64) as u64 + 1).min(total);
        while (acked.len() as u64) < due {
            let mut v = Vec::with_capacity(8 + pad.len());
            v.extend_from_slice(&(epoch.elapsed().as_micros() as u64).to_le_bytes());
            v.extend_from_slice(&pad);
            let t = Instant::now();
            let w = writer.cache_put(cache, key.clone(), v, None).await?;
            // An acked put's latency under the fanout load is part of the result.
            put_live_h
                .record(t.elapsed().as_micros().max(1) as u64)
                .unwrap();
            acked.push(w.version);
        }
    }
    Ok((acked, put_live_h))
}

/// The run's verdict on the watchers' offsets.
struct Check {
    delivered: u64,
    lagged: usize,
    /// Exactly the writer's acknowledged offsets, in order.
    exact: usize,
    /// Exact, with every change.
    complete: usize,
    /// The first watcher not exact (and not ended by the broker), described.
    wrong: Option<String>,
}

fn check_offsets(watchers: &[Watcher], acked: &[u64]) -> Check {
    let n = acked.len() as u64;
    let mut c = Check {
        delivered: 0,
        lagged: 0,
        exact: 0,
        complete: 0,
        wrong: None,
    };
    for (i, w) in watchers.iter().enumerate() {
        c.delivered += w.got;
        c.lagged += usize::from(w.lagged);
        // Complete means exactly the writer's acknowledged offsets, in order: none missing,
        // none repeated, none out of order.
        let ok = w.offsets == acked;
        c.complete += usize::from(w.got == n && ok);
        c.exact += usize::from(ok);
        if !ok && !w.lagged && c.wrong.is_none() {
            let at = w.offsets.iter().zip(acked).position(|(x, y)| x != y);
            c.wrong = Some(format!(
                "watcher {i}: {} offsets, the writer acknowledged {}; first difference at index {:?}",
                w.offsets.len(),
                acked.len(),
                at
            ));
        }
    }
    c
}

#[cfg(test)]
mod tests {
    use super::*;

    fn watcher(offsets: &[u64]) -> Watcher {
        Watcher {
            got: offsets.len() as u64,
            lagged: false,
            offsets: offsets.to_vec(),
        }
    }

    /// A count cannot pass a gap plus a duplicate: the offsets are compared.
    #[test]
    fn offsets_are_checked_not_counted() {
        let acked = [3, 4, 5];
        let c = check_offsets(
            &[
                watcher(&[3, 4, 5]),
                watcher(&[3, 3, 5]),
                watcher(&[3, 5, 4]),
            ],
            &acked,
        );
        assert_eq!((c.delivered, c.exact, c.complete), (9, 1, 1));
        assert!(c.wrong.unwrap().starts_with("watcher 1:"));
    }
}
