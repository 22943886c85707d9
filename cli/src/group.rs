//! `felixctl group ...`: consumer groups over QUIC. Claims print as `SHARD:OFFSET:ATTEMPTS`,
//! which `ack`, `nack`, `extend` and `reject` take back. `rm`, `dead-letters discard` and a
//! `seek` that moves a cursor back over finished records ask `[y/N]` at a terminal and need
//! `--yes` elsewhere. Exit codes: 0 ok, 1 refused (any claim refused counts), 2 usage.

use clap::Subcommand;
use felix_client::{ClaimId, Client, DeadLetterAction, GroupOptions};
use felix_quic::wire::{StartAt, StreamName};
use std::io::{IsTerminal, Write};
use std::time::Duration;

#[derive(Subcommand)]
pub enum GroupCmd {
    /// Create a group on every shard of the stream (or on --shard).
    Create {
        stream: String,
        group: String,
        #[arg(long)]
        shard: Option<u32>,
        /// earliest, latest or an offset (per shard).
        #[arg(long, default_value = "earliest")]
        from: String,
        /// Deliveries before a record is dead-lettered (default 5).
        #[arg(long, default_value_t = 0)]
        max_attempts: u32,
        /// Default claim duration of polls, milliseconds (default 30000).
        #[arg(long, default_value_t = 0)]
        visibility_timeout_ms: u64,
    },
    /// Cursor, tail and counts per shard.
    Describe {
        stream: String,
        group: String,
        #[arg(long)]
        shard: Option<u32>,
    },
    /// Claim records and print each with its claim.
    Poll {
        stream: String,
        group: String,
        /// One shard; default: every shard.
        #[arg(long)]
        shard: Option<u32>,
        #[arg(long, default_value_t = 10)]
        max: u32,
        /// Claim duration, milliseconds; default: the group's.
        #[arg(long)]
        visibility_timeout_ms: Option<u64>,
        /// With nothing to claim, wait this long for a record.
        #[arg(long, default_value_t = 0)]
        wait_ms: u64,
    },
    /// Acknowledge claims (the records are done).
    Ack {
        stream: String,
        group: String,
        #[arg(required = true)]
        claims: Vec<String>,
    },
    /// Hand claims back (delivered again after --delay-ms, or dead-lettered at the last attempt).
    Nack {
        stream: String,
        group: String,
        #[arg(required = true)]
        claims: Vec<String>,
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
    },
    /// Renew claims.
    Extend {
        stream: String,
        group: String,
        #[arg(required = true)]
        claims: Vec<String>,
        #[arg(long)]
        visibility_timeout_ms: u64,
    },
    /// Dead-letter claims now.
    Reject {
        stream: String,
        group: String,
        #[arg(required = true)]
        claims: Vec<String>,
    },
    /// Move the cursor: earliest, latest or an offset.
    Seek {
        stream: String,
        group: String,
        to: String,
        #[arg(long)]
        shard: Option<u32>,
    },
    /// Delete the group (cursor and dead letters).
    Rm {
        stream: String,
        group: String,
        #[arg(long)]
        shard: Option<u32>,
    },
    /// The dead-letter list.
    #[command(name = "dead-letters", subcommand)]
    DeadLetters(DeadCmd),
}

#[derive(Subcommand)]
pub enum DeadCmd {
    /// List dead letters (pointers into the log).
    Ls {
        stream: String,
        group: String,
        #[arg(long)]
        shard: Option<u32>,
        /// Most per shard.
        #[arg(long, default_value_t = 1000)]
        limit: u32,
    },
    /// Deliver a dead letter again with a fresh attempt budget.
    Redrive {
        stream: String,
        group: String,
        #[arg(long)]
        shard: u32,
        offset: u64,
    },
    /// Drop a dead letter's pointer (the record stays finished).
    Discard {
        stream: String,
        group: String,
        #[arg(long)]
        shard: u32,
        offset: u64,
    },
}

pub struct Ctx<'a> {
    pub client: &'a Client,
    pub tenant: &'a str,
    pub namespace: &'a str,
    pub json: bool,
    pub yes: bool,
}

enum Fail {
    Usage(String),
    Refused(String),
}

impl From<felix_client::Error> for Fail {
    fn from(e: felix_client::Error) -> Fail {
        Fail::Refused(e.to_string())
    }
}

fn start_of(s: &str) -> Result<StartAt, Fail> {
    Ok(match s {
        "latest" => StartAt::Latest,
        "earliest" => StartAt::Earliest,
        n => StartAt::Offset(n.parse().map_err(|_| {
            Fail::Usage(format!("expected latest, earliest or an offset, got {n:?}"))
        })?),
    })
}

fn claims_of(v: &[String]) -> Result<Vec<ClaimId>, Fail> {
    v.iter()
        .map(|s| s.parse::<ClaimId>().map_err(|e| Fail::Usage(e.to_string())))
        .collect()
}

fn ask(yes: bool, what: &str) -> Result<(), Fail> {
    if yes {
        return Ok(());
    }
    if !std::io::stdin().is_terminal() {
        return Err(Fail::Usage(format!(
            "refusing to {what} without --yes (stdin is not a terminal)"
        )));
    }
    eprint!("{what}? [y/N] ");
    let _ = std::io::stderr().flush();
    let mut line = String::new();
    let _ = std::io::stdin().read_line(&mut line);
    if matches!(line.trim(), "y" | "Y" | "yes") {
        Ok(())
    } else {
        Err(Fail::Usage("not done".into()))
    }
}

/// Print one result per claim; refused ones make the command fail.
fn answered(
    ctx: &Ctx,
    claims: &[ClaimId],
    results: Vec<Result<(), felix_client::Error>>,
) -> Result<(), Fail> {
    let mut refused = 0;
    for (c, r) in claims.iter().zip(results) {
        match (&r, ctx.json) {
            (Ok(()), true) => println!(
                "{}",
                serde_json::json!({"claim": c.to_string(), "ok": true})
            ),
            (Ok(()), false) => println!("{c} ok"),
            (Err(e), true) => println!(
                "{}",
                serde_json::json!({"claim": c.to_string(), "ok": false,
                    "code": e.code().map(|c| c.name()), "message": e.to_string()})
            ),
            (Err(e), false) => println!("{c} refused: {e}"),
        }
        refused += r.is_err() as usize;
    }
    if refused > 0 {
        return Err(Fail::Refused(format!(
            "{refused} of {} claims refused",
            claims.len()
        )));
    }
    Ok(())
}

pub async fn run(cmd: &GroupCmd, ctx: &Ctx<'_>) -> i32 {
    match run_inner(cmd, ctx).await {
        Ok(()) => 0,
        Err(Fail::Usage(m)) => {
            eprintln!("felixctl: {m}");
            2
        }
        Err(Fail::Refused(m)) => {
            eprintln!("felixctl: {m}");
            1
        }
    }
}

async fn run_inner(cmd: &GroupCmd, ctx: &Ctx<'_>) -> Result<(), Fail> {
    let c = ctx.client;
    let sn = |s: &str| StreamName::new(ctx.tenant, ctx.namespace, s);
    match cmd {
        GroupCmd::Create {
            stream,
            group,
            shard,
            from,
            max_attempts,
            visibility_timeout_ms,
        } => {
            let opts = GroupOptions {
                start: start_of(from)?,
                max_attempts: *max_attempts,
                visibility_timeout_ms: *visibility_timeout_ms,
            };
            c.group_create(&sn(stream), group, *shard, opts).await?;
            if !ctx.json {
                println!("group {group} created on {}", sn(stream));
            } else {
                println!("{}", serde_json::json!({"group": group, "created": true}));
            }
        }
        GroupCmd::Describe {
            stream,
            group,
            shard,
        } => {
            for (s, i) in c.group_describe(&sn(stream), group, *shard).await? {
                if ctx.json {
                    println!(
                        "{}",
                        serde_json::json!({"shard": s, "cursor": i.cursor, "tail": i.tail,
                            "in_flight": i.in_flight, "waiting": i.waiting, "parked": i.parked,
                            "dead_letters": i.dead_letters, "max_attempts": i.max_attempts,
                            "visibility_timeout_ms": i.visibility_timeout_ms})
                    );
                } else {
                    println!(
                        "shard {s}: cursor {} tail {} in_flight {} waiting {} parked {} dead_letters {} (max_attempts {}, visibility {} ms)",
                        i.cursor, i.tail, i.in_flight, i.waiting, i.parked, i.dead_letters,
                        i.max_attempts, i.visibility_timeout_ms
                    );
                }
            }
        }
        GroupCmd::Poll {
            stream,
            group,
            shard,
            max,
            visibility_timeout_ms,
            wait_ms,
        } => {
            let wait = Duration::from_millis(*wait_ms);
            let recs = match shard {
                Some(s) => {
                    c.group_poll(&sn(stream), group, *s, *max, *visibility_timeout_ms, wait)
                        .await?
                }
                None => {
                    let mut cons = c.group_consumer(&sn(stream), group).await?;
                    cons.poll(*max, *visibility_timeout_ms, wait).await?
                }
            };
            for r in recs {
                let text = String::from_utf8_lossy(&r.payload);
                if ctx.json {
                    println!(
                        "{}",
                        serde_json::json!({"claim": r.claim().to_string(), "shard": r.shard,
                            "offset": r.offset, "attempt": r.attempt, "payload": text})
                    );
                } else {
                    println!("{} {text}", r.claim());
                }
            }
        }
        GroupCmd::Ack {
            stream,
            group,
            claims,
        } => {
            let ids = claims_of(claims)?;
            let r = c.group_ack(&sn(stream), group, &ids).await?;
            answered(ctx, &ids, r)?;
        }
        GroupCmd::Nack {
            stream,
            group,
            claims,
            delay_ms,
        } => {
            let ids = claims_of(claims)?;
            let r = c.group_nack(&sn(stream), group, &ids, *delay_ms).await?;
            answered(ctx, &ids, r)?;
        }
        GroupCmd::Extend {
            stream,
            group,
            claims,
            visibility_timeout_ms,
        } => {
            let ids = claims_of(claims)?;
            let r = c
                .group_extend(&sn(stream), group, &ids, *visibility_timeout_ms)
                .await?;
            answered(ctx, &ids, r)?;
        }
        GroupCmd::Reject {
            stream,
            group,
            claims,
        } => {
            let ids = claims_of(claims)?;
            let r = c.group_reject(&sn(stream), group, &ids).await?;
            answered(ctx, &ids, r)?;
        }
        GroupCmd::Seek {
            stream,
            group,
            to,
            shard,
        } => {
            let to = start_of(to)?;
            // Backward over finished records replays them: ask first.
            let back = c
                .group_describe(&sn(stream), group, *shard)
                .await?
                .iter()
                .any(|(_, i)| match to {
                    StartAt::Earliest => i.cursor > 0,
                    StartAt::Offset(o) => o < i.cursor,
                    StartAt::Latest => false,
                });
            if back {
                ask(
                    ctx.yes,
                    &format!("move group {group} back (finished records are delivered again)"),
                )?;
            }
            c.group_seek(&sn(stream), group, *shard, to).await?;
            println!("group {group} moved");
        }
        GroupCmd::Rm {
            stream,
            group,
            shard,
        } => {
            ask(ctx.yes, &format!("delete group {group} of {}", sn(stream)))?;
            c.group_delete(&sn(stream), group, *shard).await?;
            println!("group {group} deleted");
        }
        GroupCmd::DeadLetters(d) => match d {
            DeadCmd::Ls {
                stream,
                group,
                shard,
                limit,
            } => {
                let shards = match shard {
                    Some(s) => vec![*s],
                    None => (0..c.describe_stream(&sn(stream)).await?.shards).collect(),
                };
                for s in shards {
                    let mut after = None;
                    let mut left = *limit;
                    while left > 0 {
                        let page = c
                            .dead_letters(&sn(stream), group, s, after, left.min(1000))
                            .await?;
                        left -= page.letters.len() as u32;
                        for l in &page.letters {
                            let reason = ["expired", "nacked", "rejected"]
                                .get(l.reason as usize)
                                .unwrap_or(&"unknown");
                            if ctx.json {
                                println!(
                                    "{}",
                                    serde_json::json!({"shard": s, "offset": l.offset,
                                        "attempts": l.attempts, "reason": reason,
                                        "redriving": l.redriving})
                                );
                            } else {
                                println!(
                                    "{s}:{} attempts {} {reason}{}",
                                    l.offset,
                                    l.attempts,
                                    if l.redriving { " (redriving)" } else { "" }
                                );
                            }
                        }
                        match page.next_after {
                            Some(a) => after = Some(a),
                            None => break,
                        }
                    }
                }
            }
            DeadCmd::Redrive {
                stream,
                group,
                shard,
                offset,
            } => {
                c.dead_letter_op(
                    &sn(stream),
                    group,
                    *shard,
                    *offset,
                    DeadLetterAction::Redrive,
                )
                .await?;
                println!("{shard}:{offset} redriven");
            }
            DeadCmd::Discard {
                stream,
                group,
                shard,
                offset,
            } => {
                ask(ctx.yes, &format!("discard dead letter {shard}:{offset}"))?;
                c.dead_letter_op(
                    &sn(stream),
                    group,
                    *shard,
                    *offset,
                    DeadLetterAction::Discard,
                )
                .await?;
                println!("{shard}:{offset} discarded");
            }
        },
    }
    Ok(())
}
