//! The watch mux (docs/protocol.md, "Watch mux") through the real broker binary: every watch
//! of a connection on one stream keeps each watch's contract. A slow reader of one watch is
//! ended by the client and its sibling on the same connection sees every change; a
//! connection that stops reading has each watch ended at its own bound by the broker, after
//! exactly what was queued for it. Every loop is bounded by count and time.

mod common;

use bytes::Bytes;
use common::raw::Raw;
use common::Broker;
use felix_client::{WatchFilter, WatchItem, WatchOptions, WatchStart};
use felix_quic::wire::{
    features, CacheFrame, ErrorCode, EventKind, Frame, StreamName, WatchFilter as WireFilter,
    WatchStart as WireStart, WriteCond,
};
use std::time::{Duration, Instant};

const WAIT: Duration = Duration::from_secs(30);

fn start() -> Broker {
    Broker::start_with_cache_one()
}

fn one() -> StreamName {
    StreamName::new("default", "default", "one")
}

#[test]
fn a_slow_watch_on_a_mux_connection_is_ended_by_the_client_and_its_sibling_sees_everything() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start();
    rt.block_on(async {
        let c = b.client().await;
        let writer = b.client().await;
        let slow_opts = WatchOptions {
            buffer_items: 8,
            ..Default::default()
        };
        let kv = one();
        let watch =
            |opts| c.cache_watch(&kv, WatchFilter::Key("k".into()), WatchStart::Latest, opts);
        let mut slow = watch(slow_opts).await.unwrap();
        let mut fast = watch(WatchOptions::default()).await.unwrap();
        let mut log = Vec::new();
        for i in 0..3000 {
            log.push(
                writer
                    .cache_put(&one(), "k", format!("v{i}"), None)
                    .await
                    .unwrap()
                    .version,
            );
        }
        // The sibling on the same connection: every change, in order, none repeated.
        let mut got = Vec::new();
        let deadline = Instant::now() + WAIT;
        while got.len() < log.len() && Instant::now() < deadline {
            match fast.next_timeout(WAIT).await.unwrap() {
                Some(WatchItem::Event { offset, .. }) => got.push(offset),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, log, "the sibling of a slow watch sees the whole log");
        // The slow one: exactly what its buffer held, then its end naming the next offset.
        let mut slow_got = Vec::new();
        let resume = loop {
            match slow.next_timeout(WAIT).await.unwrap() {
                Some(WatchItem::Event { offset, .. }) => slow_got.push(offset),
                Some(WatchItem::End {
                    code, resume_from, ..
                }) => {
                    assert_eq!(code, ErrorCode::WatchLagged.number());
                    break resume_from;
                }
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(slow_got, log[..8], "its buffer's worth, in order");
        assert_eq!(
            resume, log[8],
            "it resumes at the first change it could not take"
        );
        assert_eq!(
            b.total("cache_watches_lagged"),
            0,
            "the broker ended nothing"
        );
        // Resuming from there gives the rest: nothing lost, nothing twice.
        let mut again = c
            .cache_watch(
                &one(),
                WatchFilter::Key("k".into()),
                WatchStart::Offset(resume),
                WatchOptions::default(),
            )
            .await
            .unwrap();
        let mut rest = Vec::new();
        while rest.len() < log.len() - 8 {
            match again.next_timeout(WAIT).await.unwrap() {
                Some(WatchItem::Event { offset, .. }) => rest.push(offset),
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(rest, log[8..]);
        c.close().await.unwrap();
        writer.close().await.unwrap();
    });
}

/// A raw peer with the mux stops reading its mux stream (1 MiB window): the watch with a
/// 4-event bound is ended `watch_lagged` by the broker after the changes queued for it
/// before; the watch with the default bound on the same stream gets every change.
#[test]
fn a_mux_connection_that_stops_reading_has_each_watch_ended_at_its_own_bound() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let b = start();
    rt.block_on(async {
        let mut c = Raw::connect(b.quic, &b.ca(), 16 << 20, 1 << 20).await;
        c.hello_with(Frame::Hello {
            features: features::ALL,
            max_frame_bytes: 16 << 20,
            client: "raw-mux".into(),
        })
        .await;
        let put = |rid: u64, v: String| {
            Frame::Cache(CacheFrame::CachePut {
                request_id: rid,
                cache: one(),
                key: Bytes::from_static(b"m"),
                value: Bytes::from(v),
                ttl_ms: 0,
                cond: WriteCond::Always,
            })
        };
        c.send(0, &put(1, "v0".into()));
        assert!(matches!(
            c.next_on(0).await,
            Frame::Cache(CacheFrame::CacheWritten { .. })
        ));
        let mut wids = Vec::new();
        let mut ms = None;
        for (rid, events_max) in [(2u64, 4u32), (3, 0)] {
            c.send(
                0,
                &Frame::Cache(CacheFrame::CacheWatch {
                    request_id: rid,
                    cache: one(),
                    filter: WireFilter::Key(Bytes::from_static(b"m")),
                    start: WireStart::Current,
                    queue_events_max: events_max,
                    queue_bytes_max: 0,
                }),
            );
            match c.next_on(0).await {
                Frame::Cache(CacheFrame::CacheWatchOk { watch_id, .. }) => wids.push(watch_id),
                other => panic!("{other:?}"),
            }
            // Its retained value and state end.
            for _ in 0..2 {
                let f = match ms {
                    None => {
                        let (s, f) = c.next_server_uni().await;
                        ms = Some(s);
                        f
                    }
                    Some(s) => c.next_on(s).await,
                };
                assert!(
                    matches!(f, Frame::Cache(CacheFrame::CacheMux { .. })),
                    "{f:?}"
                );
            }
        }
        let ms = ms.unwrap();
        c.pause(ms);
        // 100 changes of 48 KiB: 4.8 MB, well past the 1 MiB window.
        let mut log = Vec::new();
        for i in 0..100u64 {
            c.send(0, &put(10 + i, format!("{i:04}{}", "x".repeat(48 << 10))));
            match c.next_on(0).await {
                Frame::Cache(CacheFrame::CacheWritten { version, .. }) => log.push(version),
                other => panic!("{other:?}"),
            }
        }
        c.resume(ms);
        let (mut small, mut big, mut end) = (Vec::new(), Vec::new(), None);
        let deadline = Instant::now() + WAIT;
        while (end.is_none() || big.len() < log.len()) && Instant::now() < deadline {
            let Frame::Cache(CacheFrame::CacheMux { watch_ids, frame }) = c.next_on(ms).await
            else {
                panic!("only CacheMux on the mux stream")
            };
            match *frame {
                CacheFrame::CacheEvent {
                    kind: EventKind::Put,
                    offset,
                    ..
                } => {
                    for id in watch_ids {
                        assert!(end.is_none() || id != wids[0], "nothing after its end");
                        if id == wids[0] {
                            small.push(offset)
                        } else {
                            big.push(offset)
                        }
                    }
                }
                CacheFrame::CacheWatchEnd {
                    code, resume_from, ..
                } => {
                    assert_eq!(watch_ids, vec![wids[0]], "only the small watch ends");
                    assert_eq!(code, ErrorCode::WatchLagged.number());
                    end = Some(resume_from);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(big, log, "the default-bound watch got every change");
        let resume = end.expect("the small watch was ended");
        let cut = log
            .iter()
            .position(|o| *o == resume)
            .expect("resume is a logged offset");
        assert!(cut < log.len(), "it lagged");
        assert_eq!(
            small,
            log[..cut],
            "before its end, exactly the changes before resume_from"
        );
        assert_eq!(b.total("cache_watches_lagged"), 1);
        c.assert_no_bad();
    });
}
