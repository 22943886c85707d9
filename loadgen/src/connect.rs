//! `connect`: the cost of opening a connection, measured as a user feels it. Each sample is one
//! fresh connection: the QUIC and TLS handshake, the Hello (and, with auth on, the token the
//! broker verifies), then one acked publish; the sample ends at that ack. Connections are made
//! one after another, each closed before the next, so a sample never waits on another.

use super::{cfg, emit, load1, name, stats, token, Args, Plan, Refused};
use bytes::Bytes;
use felix_client::Client;
use felix_quic::wire::ShardSelector;
use std::time::Instant;

pub(super) async fn connect(a: &Args) -> Result<(), felix_client::Error> {
    let mut plan = Plan::new(a, 200);
    // The first connections pay for the broker's cold paths (the stream's first open, the
    // key cache); they are not what a steady population of clients sees.
    let warmup = plan.warmup(5, 20);
    let total = plan.count.saturating_add(warmup);
    let load = load1();
    let (stream, payload) = (name(a), Bytes::from(vec![b'x'; a.payload]));
    let mut hist = hdrhistogram::Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).unwrap();
    let mut handshake = hist.clone();
    let mut refused = Refused::default();
    let mut durable = None;
    plan.start();
    let begin = Instant::now();
    let mut i = 0u64;
    let truncated = loop {
        if let Some(cut) = plan.stop(i, total) {
            break cut;
        }
        let measured = !plan.warming(i, warmup);
        let t0 = Instant::now();
        let c = Client::connect(cfg(a)).await?;
        let connected_us = t0.elapsed().as_micros().max(1) as u64;
        let sent = c
            .publisher()
            .publish_batch(
                &stream,
                ShardSelector::Shard(a.shard),
                vec![payload.clone()],
            )
            .await;
        let first_ack_us = t0.elapsed().as_micros().max(1) as u64;
        match sent {
            Ok(_) if measured => {
                hist.record(first_ack_us).unwrap();
                handshake.record(connected_us).unwrap();
            }
            Ok(_) => {}
            Err(e) => refused.take(e, 1)?,
        }
        if durable.is_none() {
            durable = Some(c.describe_stream(&stream).await?.durable);
        }
        // Closed before the next one opens: the broker's connection count stays at one or two.
        let _ = c.close().await;
        i += 1;
    };
    let secs = begin.elapsed().as_secs_f64();
    let mut v = serde_json::json!({
        "tool": "felix-loadgen", "mode": "connect", "stream": a.stream, "shard": a.shard,
        "durable": durable.unwrap_or(false), "payload": a.payload, "count": hist.len(),
        "load1": load, "truncated": truncated, "duration_s": secs,
        "token": token(a).is_some(),
        "unit": "us", "connect": stats::pct(&hist), "handshake": stats::pct(&handshake),
    });
    let o = v.as_object_mut().unwrap();
    plan.fields(a, o);
    refused.fields(o);
    emit(a, v);
    Ok(())
}
