//! `felixctl group ...`: consumer groups over QUIC. Claims print as `SHARD:OFFSET:ATTEMPTS`,
//! which `ack`, `nack`, `extend` and `reject` take back. `rm`, `dead-letters discard` and a
//! `seek` that moves a cursor back over finished records ask `[y/N]` at a terminal and need
//! `--yes` elsewhere. Exit codes as in `crate::fail`: a refused claim among accepted ones is partial (4).

use crate::fail::Fail;
use clap::Subcommand;
use felix_client::{ClaimId, Client, DeadLetterAction, GroupOptions};
use felix_quic::wire::{StartAt, StreamName};
use std::io::{IsTerminal, Write};
use std::time::Duration;

#[derive(Subcommand)]
pub enum GroupCmd {
    /// Create a group on every shard of the stream (or on --shard).
    Create {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// One shard [default: every shard].
        #[arg(long)]
        shard: Option<u32>,
        /// earliest, latest or an offset (per shard).
        #[arg(long, default_value = "earliest")]
        from: String,
        /// Deliveries before a record is dead-lettered [default: the broker's, 5].
        #[arg(long)]
        max_attempts: Option<u32>,
        /// Default claim duration of polls, milliseconds [default: the broker's, 30000].
        #[arg(long)]
        visibility_timeout_ms: Option<u64>,
    },
    /// Cursor, tail and counts per shard.
    #[command(alias = "get")]
    Describe {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// One shard [default: every shard].
        #[arg(long)]
        shard: Option<u32>,
    },
    /// Claim records and print each with its claim.
    Poll {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// One shard [default: every shard].
        #[arg(long)]
        shard: Option<u32>,
        /// Most records to claim.
        #[arg(long, default_value_t = 10)]
        max: u32,
        /// Claim duration, milliseconds [default: the group's].
        #[arg(long)]
        visibility_timeout_ms: Option<u64>,
        /// With nothing to claim, wait this long for a record, milliseconds (0: answer now).
        #[arg(long, default_value_t = 0)]
        wait_ms: u64,
    },
    /// Acknowledge claims (the records are done).
    Ack {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// Claims as printed by poll: SHARD:OFFSET:ATTEMPTS.
        #[arg(required = true)]
        claims: Vec<String>,
    },
    /// Hand claims back (delivered again after --delay-ms, or dead-lettered at the last attempt).
    Nack {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// Claims as printed by poll: SHARD:OFFSET:ATTEMPTS.
        #[arg(required = true)]
        claims: Vec<String>,
        /// Deliver them again after this long, milliseconds.
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
    },
    /// Renew claims.
    Extend {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// Claims as printed by poll: SHARD:OFFSET:ATTEMPTS.
        #[arg(required = true)]
        claims: Vec<String>,
        /// New claim duration from now, milliseconds.
        #[arg(long)]
        visibility_timeout_ms: u64,
    },
    /// Dead-letter claims now.
    Reject {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// Claims as printed by poll: SHARD:OFFSET:ATTEMPTS.
        #[arg(required = true)]
        claims: Vec<String>,
    },
    /// Move the cursor: earliest, latest or an offset.
    Seek {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// Where to: earliest, latest or an offset.
        to: String,
        /// One shard [default: every shard].
        #[arg(long)]
        shard: Option<u32>,
    },
    /// Delete the group (cursor and dead letters).
    #[command(alias = "delete")]
    Rm {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// One shard [default: every shard].
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
    #[command(alias = "list")]
    Ls {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// One shard [default: every shard].
        #[arg(long)]
        shard: Option<u32>,
        /// Most per shard.
        #[arg(long, default_value_t = 1000)]
        limit: u32,
    },
    /// Deliver a dead letter again with a fresh attempt budget.
    Redrive {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// The dead letter\'s shard.
        #[arg(long)]
        shard: u32,
        /// The dead letter\'s offset.
        offset: u64,
    },
    /// Drop a dead letter's pointer (the record stays finished).
    Discard {
        /// The stream (in --tenant/--namespace).
        stream: String,
        /// The consumer group.
        group: String,
        /// The dead letter\'s shard.
        #[arg(long)]
        shard: u32,
        /// The dead letter\'s offset.
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

/// Print a command's outcome: `json` under --json, else `text`.
fn done(ctx: &Ctx, json: serde_json::Value, text: &str) {
    if ctx.json {
        println!("{json}");
    } else {
        println!("{text}");
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
    let msg = format!("{refused} of {} claims refused", claims.len());
    match refused {
        0 => Ok(()),
        n if n == claims.len() => Err(Fail::refused("refused", msg)),
        _ => Err(Fail::Partial(msg)),
    }
}

/// Run a group command.
pub async fn run(cmd: &GroupCmd, ctx: &Ctx<'_>) -> Result<(), Fail> {
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
                max_attempts: max_attempts.unwrap_or(0),
                visibility_timeout_ms: visibility_timeout_ms.unwrap_or(0),
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
            let shards = c.group_describe(&sn(stream), group, *shard).await?;
            if ctx.json {
                for (s, i) in &shards {
                    println!(
                        "{}",
                        serde_json::json!({"shard": s, "cursor": i.cursor, "tail": i.tail,
                            "in_flight": i.in_flight, "waiting": i.waiting, "parked": i.parked,
                            "dead_letters": i.dead_letters, "max_attempts": i.max_attempts,
                            "visibility_timeout_ms": i.visibility_timeout_ms})
                    );
                }
            } else {
                crate::print_table(
                    &[
                        "SHARD",
                        "CURSOR",
                        "TAIL",
                        "IN_FLIGHT",
                        "WAITING",
                        "PARKED",
                        "DEAD_LETTERS",
                        "MAX_ATTEMPTS",
                        "VISIBILITY_MS",
                    ],
                    shards
                        .iter()
                        .map(|(s, i)| {
                            [
                                *s as u64,
                                i.cursor,
                                i.tail,
                                i.in_flight,
                                i.waiting,
                                i.parked,
                                i.dead_letters,
                                i.max_attempts as u64,
                                i.visibility_timeout_ms,
                            ]
                            .iter()
                            .map(|v| v.to_string())
                            .collect()
                        })
                        .collect(),
                );
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
            done(
                ctx,
                serde_json::json!({"group": group, "moved": true}),
                &format!("group {group} moved"),
            );
        }
        GroupCmd::Rm {
            stream,
            group,
            shard,
        } => {
            ask(ctx.yes, &format!("delete group {group} of {}", sn(stream)))?;
            c.group_delete(&sn(stream), group, *shard).await?;
            done(
                ctx,
                serde_json::json!({"group": group, "deleted": true}),
                &format!("group {group} deleted"),
            );
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
                done(
                    ctx,
                    serde_json::json!({"shard": shard, "offset": offset, "redriven": true}),
                    &format!("{shard}:{offset} redriven"),
                );
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
                done(
                    ctx,
                    serde_json::json!({"shard": shard, "offset": offset, "discarded": true}),
                    &format!("{shard}:{offset} discarded"),
                );
            }
        },
    }
    Ok(())
}
