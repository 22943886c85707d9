//! `felixctl kv ...`: cache keys, watches and counters over QUIC (the cache resources
//! themselves are `felixctl cache create|get|ls|set|rm`, over REST). Keys and values are
//! taken and printed as UTF-8 text (lossy on output). Exit codes: 0 ok, 1 refused or the
//! condition failed, 2 usage; `get` of a key with no value exits 1 (`found: false` in JSON).

use clap::Subcommand;
use felix_client::{
    CacheEntry, Client, EventKind, WatchFilter, WatchItem, WatchOptions, WatchStart, WriteCond,
};
use felix_quic::wire::StreamName;
use std::time::Duration;

#[derive(Subcommand)]
pub enum KvCmd {
    /// Shard count, durability and default TTL of a cache.
    Describe { cache: String },
    /// Write a value.
    Put {
        cache: String,
        key: String,
        value: String,
        /// Time to live, milliseconds; default: the cache's.
        #[arg(long)]
        ttl_ms: Option<u64>,
        /// Only if the key is at this version.
        #[arg(long, conflicts_with = "if_absent")]
        if_version: Option<u64>,
        /// Only if the key has no value.
        #[arg(long)]
        if_absent: bool,
    },
    /// Print a key's value.
    Get { cache: String, key: String },
    /// Delete a key, printing the value it removed.
    Rm {
        cache: String,
        key: String,
        /// Only if the key is at this version.
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Print a key's or prefix's changes (after its current values with --from current).
    Watch {
        cache: String,
        /// One key.
        #[arg(long, conflicts_with = "prefix", required_unless_present = "prefix")]
        key: Option<String>,
        /// Every key with this prefix (every shard unless --shard).
        #[arg(long)]
        prefix: Option<String>,
        #[arg(long, requires = "prefix")]
        shard: Option<u32>,
        /// current, latest, or an offset (a resume; needs --key or --shard).
        #[arg(long, default_value = "current")]
        from: String,
        /// Exit after this many events (retained values included).
        #[arg(long)]
        count: Option<u64>,
        /// Exit when nothing arrives for this long (milliseconds).
        #[arg(long)]
        idle_exit_ms: Option<u64>,
    },
    /// Counters: add a delta (prints the new sum) or get the sum.
    #[command(subcommand)]
    Counter(CounterCmd),
}

#[derive(Subcommand)]
pub enum CounterCmd {
    Add {
        cache: String,
        name: String,
        #[arg(allow_hyphen_values = true)]
        delta: i64,
    },
    Get {
        cache: String,
        name: String,
    },
}

pub struct Ctx<'a> {
    pub client: &'a Client,
    pub tenant: &'a str,
    pub namespace: &'a str,
    pub json: bool,
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Print what a get or a delete found; exit 1 when the key had no value or the call failed.
fn print_lookup(
    ctx: &Ctx<'_>,
    key: &str,
    r: Result<Option<CacheEntry>, felix_client::Error>,
) -> i32 {
    match r {
        Ok(Some(e)) => {
            print_entry(ctx, key, &e);
            0
        }
        Ok(None) => {
            if ctx.json {
                println!("{}", serde_json::json!({"key": key, "found": false}));
            } else {
                eprintln!("felixctl: {key}: no value");
            }
            1
        }
        Err(e) => {
            eprintln!("felixctl: {e}");
            1
        }
    }
}

fn print_entry(ctx: &Ctx<'_>, key: &str, e: &CacheEntry) {
    if ctx.json {
        println!(
            "{}",
            serde_json::json!({"key": key, "found": true, "shard": e.shard, "version": e.version,
                "expires_at_ms": e.expires_at_ms, "value": text(&e.value)})
        );
    } else {
        println!("{}", text(&e.value));
    }
}

pub async fn run(cmd: &KvCmd, ctx: &Ctx<'_>) -> i32 {
    let name = |c: &str| StreamName::new(ctx.tenant, ctx.namespace, c);
    let fail = |e: felix_client::Error| {
        eprintln!("felixctl: {e}");
        1
    };
    match cmd {
        KvCmd::Describe { cache } => match ctx.client.describe_cache(&name(cache)).await {
            Ok(i) => {
                if ctx.json {
                    println!(
                        "{}",
                        serde_json::json!({"cache": name(cache).to_string(), "shards": i.shards,
                            "durable": i.durable, "default_ttl_ms": i.default_ttl_ms})
                    );
                } else {
                    println!(
                        "{}: {} shard(s), durable: {}, default ttl: {}",
                        name(cache),
                        i.shards,
                        i.durable,
                        i.default_ttl_ms
                            .map(|t| format!("{t} ms"))
                            .unwrap_or_else(|| "none".into())
                    );
                }
                0
            }
            Err(e) => fail(e),
        },
        KvCmd::Put {
            cache,
            key,
            value,
            ttl_ms,
            if_version,
            if_absent,
        } => {
            let cond = match (if_version, if_absent) {
                (Some(v), _) => WriteCond::Version(*v),
                (None, true) => WriteCond::Absent,
                (None, false) => WriteCond::Always,
            };
            if *ttl_ms == Some(0) {
                eprintln!("felixctl: --ttl-ms must be positive");
                return 2;
            }
            match ctx
                .client
                .cache_put_if(
                    &name(cache),
                    key.clone().into_bytes(),
                    value.clone().into_bytes(),
                    *ttl_ms,
                    cond,
                )
                .await
            {
                Ok(w) => {
                    if ctx.json {
                        println!(
                            "{}",
                            serde_json::json!({"key": key, "shard": w.shard, "version": w.version,
                                "expires_at_ms": w.expires_at_ms})
                        );
                    } else {
                        println!("version {} (shard {})", w.version, w.shard);
                    }
                    0
                }
                Err(e) => fail(e),
            }
        }
        KvCmd::Get { cache, key } => {
            let r = ctx
                .client
                .cache_get(&name(cache), key.clone().into_bytes())
                .await;
            print_lookup(ctx, key, r)
        }
        KvCmd::Rm {
            cache,
            key,
            if_version,
        } => {
            let r = match if_version {
                Some(v) => ctx
                    .client
                    .cache_delete_if(
                        &name(cache),
                        key.clone().into_bytes(),
                        WriteCond::Version(*v),
                    )
                    .await
                    .map(|d| Some(d.removed)),
                None => ctx
                    .client
                    .cache_delete(&name(cache), key.clone().into_bytes())
                    .await
                    .map(|d| d.map(|d| d.removed)),
            };
            print_lookup(ctx, key, r)
        }
        KvCmd::Watch {
            cache,
            key,
            prefix,
            shard,
            from,
            count,
            idle_exit_ms,
        } => {
            let start = match from.as_str() {
                "current" => WatchStart::Current,
                "latest" => WatchStart::Latest,
                s => match s.parse::<u64>() {
                    Ok(o) => WatchStart::Offset(o),
                    Err(_) => {
                        eprintln!(
                            "felixctl: --from must be current, latest or an offset, got {s:?}"
                        );
                        return 2;
                    }
                },
            };
            let c = name(cache);
            let opts = WatchOptions::default();
            let w = match (key, prefix, shard) {
                (Some(k), _, _) => {
                    let f = WatchFilter::Key(k.clone().into_bytes().into());
                    ctx.client.cache_watch(&c, f, start, opts).await
                }
                (None, Some(p), Some(s)) => {
                    let f = WatchFilter::Prefix {
                        prefix: p.clone().into_bytes().into(),
                        shard: *s,
                    };
                    ctx.client.cache_watch(&c, f, start, opts).await
                }
                (None, Some(p), None) => {
                    if let WatchStart::Offset(_) = start {
                        eprintln!("felixctl: an offset is per shard: give --shard (or --key)");
                        return 2;
                    }
                    ctx.client
                        .cache_watch_prefix(&c, p.clone().into_bytes(), start, opts)
                        .await
                }
                (None, None, _) => unreachable!("clap requires --key or --prefix"),
            };
            let mut w = match w {
                Ok(w) => w,
                Err(e) => return fail(e),
            };
            watch_loop(&mut w, *count, *idle_exit_ms, ctx.json).await
        }
        KvCmd::Counter(c) => {
            let (r, n) = match c {
                CounterCmd::Add {
                    cache,
                    name: n,
                    delta,
                } => (
                    ctx.client
                        .counter_add(&name(cache), n.clone().into_bytes(), *delta)
                        .await,
                    n,
                ),
                CounterCmd::Get { cache, name: n } => (
                    ctx.client
                        .counter_get(&name(cache), n.clone().into_bytes())
                        .await,
                    n,
                ),
            };
            match r {
                Ok(v) => {
                    print_counter(ctx, n, v.sum, v.shard);
                    0
                }
                Err(e) => fail(e),
            }
        }
    }
}

fn print_counter(ctx: &Ctx<'_>, name: &str, sum: i64, shard: u32) {
    if ctx.json {
        println!(
            "{}",
            serde_json::json!({"counter": name, "sum": sum, "shard": shard})
        );
    } else {
        println!("{sum}");
    }
}

async fn watch_loop(
    w: &mut felix_client::CacheWatch,
    count: Option<u64>,
    idle_exit_ms: Option<u64>,
    json: bool,
) -> i32 {
    let mut seen = 0u64;
    loop {
        if count.is_some_and(|c| seen >= c) {
            return 0;
        }
        let item = match idle_exit_ms {
            Some(ms) => match w.next_timeout(Duration::from_millis(ms)).await {
                Ok(i) => i,
                Err(_) => return 0,
            },
            None => w.next().await,
        };
        let Some(item) = item else { return 0 };
        match item {
            WatchItem::Event {
                shard,
                kind,
                offset,
                key,
                value,
                expires_at_ms,
            } => {
                seen += 1;
                let kind = match kind {
                    EventKind::Retained => "retained",
                    EventKind::Put => "put",
                    EventKind::Delete => "delete",
                    EventKind::Expire => "expire",
                };
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"shard": shard, "kind": kind, "offset": offset,
                            "key": text(&key), "value": text(&value), "expires_at_ms": expires_at_ms})
                    );
                } else if value.is_empty() && kind != "put" && kind != "retained" {
                    println!("[{shard}:{offset}] {kind} {}", text(&key));
                } else {
                    println!(
                        "[{shard}:{offset}] {kind} {} = {}",
                        text(&key),
                        text(&value)
                    );
                }
            }
            WatchItem::StateDone {
                shard,
                count,
                snapshot,
                live_from,
            } => {
                if json {
                    println!(
                        "{}",
                        serde_json::json!({"shard": shard, "state_done": {"count": count,
                            "snapshot": snapshot, "live_from": live_from}})
                    );
                } else {
                    eprintln!(
                        "[{shard}] {count} current value(s){}; live from offset {live_from}",
                        if snapshot { " (snapshot)" } else { "" }
                    );
                }
            }
            WatchItem::End {
                shard,
                code,
                resume_from,
                message,
            } => {
                eprintln!(
                    "felixctl: watch of shard {shard} ended ({code}): {message}; resume from {resume_from}"
                );
                if code != 0 {
                    return 1;
                }
            }
        }
    }
}
