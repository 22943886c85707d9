//! `felixctl kv ...`: cache keys, watches and counters over QUIC (the cache resources
//! themselves are `felixctl cache create|get|ls|set|rm`, over REST). Keys and values are
//! taken and printed as UTF-8 text (lossy on output). Exit codes as in `crate::fail`; `get`
//! of a key with no value is refused `not_found` (exit 1; `found: false` on stdout in JSON).

use crate::fail::{end_code_name, Fail};
use clap::Subcommand;
use felix_client::{
    CacheEntry, Client, EventKind, WatchFilter, WatchItem, WatchOptions, WatchStart, WriteCond,
};
use felix_quic::wire::StreamName;
use std::time::Duration;

#[derive(Subcommand)]
pub enum KvCmd {
    /// Shard count, durability and default TTL of a cache.
    Describe {
        /// The cache (in --tenant/--namespace).
        cache: String,
    },
    /// Write a value.
    Put {
        /// The cache (in --tenant/--namespace).
        cache: String,
        /// The key.
        key: String,
        /// The value.
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
    Get {
        /// The cache (in --tenant/--namespace).
        cache: String,
        /// The key.
        key: String,
    },
    /// Delete a key, printing the value it removed.
    #[command(alias = "delete")]
    Rm {
        /// The cache (in --tenant/--namespace).
        cache: String,
        /// The key.
        key: String,
        /// Only if the key is at this version.
        #[arg(long)]
        if_version: Option<u64>,
    },
    /// Print a key's or prefix's changes (after its current values with --from current).
    Watch {
        /// The cache (in --tenant/--namespace).
        cache: String,
        /// One key.
        #[arg(long, conflicts_with = "prefix", required_unless_present = "prefix")]
        key: Option<String>,
        /// Every key with this prefix (every shard unless --shard).
        #[arg(long)]
        prefix: Option<String>,
        /// With --prefix: that shard only.
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
    /// Add a delta (negative allowed) and print the new sum.
    Add {
        /// The cache (in --tenant/--namespace).
        cache: String,
        /// The counter's name.
        name: String,
        /// The amount to add.
        #[arg(allow_hyphen_values = true)]
        delta: i64,
    },
    /// Print the sum.
    Get {
        /// The cache (in --tenant/--namespace).
        cache: String,
        /// The counter's name.
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

/// Print what a get or a delete found; a key with no value is refused `not_found`.
fn print_lookup(
    ctx: &Ctx<'_>,
    key: &str,
    r: Result<Option<CacheEntry>, felix_client::Error>,
) -> Result<(), Fail> {
    match r? {
        Some(e) => {
            print_entry(ctx, key, &e);
            Ok(())
        }
        None => {
            if ctx.json {
                println!("{}", serde_json::json!({"key": key, "found": false}));
            }
            Err(Fail::refused("not_found", format!("{key}: no value")))
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

/// Run a kv command.
pub async fn run(cmd: &KvCmd, ctx: &Ctx<'_>) -> Result<(), Fail> {
    let name = |c: &str| StreamName::new(ctx.tenant, ctx.namespace, c);
    match cmd {
        KvCmd::Describe { cache } => {
            let i = ctx.client.describe_cache(&name(cache)).await?;
            if ctx.json {
                println!(
                    "{}",
                    serde_json::json!({"cache": name(cache).to_string(), "shards": i.shards,
                        "durable": i.durable, "default_ttl_ms": i.default_ttl_ms})
                );
            } else {
                crate::print_table(
                    &["CACHE", "SHARDS", "DURABLE", "DEFAULT_TTL_MS"],
                    vec![vec![
                        name(cache).to_string(),
                        i.shards.to_string(),
                        i.durable.to_string(),
                        i.default_ttl_ms
                            .map(|t| t.to_string())
                            .unwrap_or_else(|| "-".into()),
                    ]],
                );
            }
            Ok(())
        }
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
                return Err(Fail::Usage("--ttl-ms must be positive".into()));
            }
            let w = ctx
                .client
                .cache_put_if(
                    &name(cache),
                    key.clone().into_bytes(),
                    value.clone().into_bytes(),
                    *ttl_ms,
                    cond,
                )
                .await?;
            if ctx.json {
                println!(
                    "{}",
                    serde_json::json!({"key": key, "shard": w.shard, "version": w.version,
                        "expires_at_ms": w.expires_at_ms})
                );
            } else {
                println!("version {} (shard {})", w.version, w.shard);
            }
            Ok(())
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
                        return Err(Fail::Usage(format!(
                            "--from must be current, latest or an offset, got {s:?}"
                        )))
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
                        return Err(Fail::Usage(
                            "an offset is per shard: give --shard (or --key)".into(),
                        ));
                    }
                    ctx.client
                        .cache_watch_prefix(&c, p.clone().into_bytes(), start, opts)
                        .await
                }
                (None, None, _) => unreachable!("clap requires --key or --prefix"),
            };
            watch_loop(&mut w?, *count, *idle_exit_ms, ctx.json).await
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
            let v = r?;
            print_counter(ctx, n, v.sum, v.shard);
            Ok(())
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
) -> Result<(), Fail> {
    let mut seen = 0u64;
    loop {
        if count.is_some_and(|c| seen >= c) {
            return Ok(());
        }
        let item = match idle_exit_ms {
            Some(ms) => match w.next_timeout(Duration::from_millis(ms)).await {
                Ok(i) => i,
                Err(_) => return Ok(()),
            },
            None => w.next().await,
        };
        let Some(item) = item else {
            // Every shard's watch ended without an end this loop saw: the connection went.
            return Err(Fail::unreachable(
                "closed",
                "the connection to the broker ended",
            ));
        };
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
                let name = end_code_name(code);
                let msg =
                    format!("watch of shard {shard} ended ({name}): {message}; resume from offset {resume_from}");
                match code {
                    0 => {}
                    u16::MAX => return Err(Fail::unreachable(&name, msg)),
                    _ => return Err(Fail::refused(&name, msg)),
                }
                if !json {
                    eprintln!("felixctl: {msg}");
                }
            }
        }
    }
}
