//! `felixctl publish`: records from the arguments or from stdin, as bytes, each published as
//! soon as it is read (so `tail -f log | felixctl publish events` streams), none dropped: a
//! record the broker refuses is named (its number) and the exit code says so.

use crate::fail::Fail;
use felix_client::Client;
use felix_quic::wire::{ShardSelector, StreamName};
use std::ffi::OsString;
use std::io::Read;
use tokio::sync::mpsc;

/// How stdin is cut into records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Framing {
    /// Each record ends with this byte (the byte is not part of it); a last record without
    /// it is still a record.
    Delimited(u8),
    /// All of stdin is one record.
    Whole,
}

pub enum Source {
    Args(Vec<OsString>),
    Stdin(Framing),
}

pub struct PublishOpts {
    pub batch: bool,
    pub no_ack: bool,
    pub json: bool,
}

/// Parse `--delimiter`: one character (its UTF-8 must be one byte), `\n`, `\0`, `\t`, `\r`, or
/// `0xNN`.
pub fn parse_delimiter(s: &str) -> Result<u8, String> {
    let b = match s {
        "\\n" => b'\n',
        "\\0" => 0,
        "\\t" => b'\t',
        "\\r" => b'\r',
        x if x.len() == 4 && (x.starts_with("0x") || x.starts_with("0X")) => {
            u8::from_str_radix(&x[2..], 16)
                .map_err(|_| format!("--delimiter {x:?}: 0xNN needs two hex digits"))?
        }
        x if x.len() == 1 => x.as_bytes()[0],
        x => {
            return Err(format!(
                "--delimiter must be one byte (a character, \\n, \\0, \\t, \\r or 0xNN), got {x:?}"
            ))
        }
    };
    Ok(b)
}

/// Cuts a byte stream into records as it arrives (pure: no I/O).
#[derive(Debug)]
pub struct Splitter {
    framing: Framing,
    partial: Vec<u8>,
}

impl Splitter {
    pub fn new(framing: Framing) -> Self {
        Splitter {
            framing,
            partial: Vec::new(),
        }
    }

    /// Take `chunk`; the records it completes, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Vec<u8>> {
        let Framing::Delimited(d) = self.framing else {
            self.partial.extend_from_slice(chunk);
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut rest = chunk;
        while let Some(i) = rest.iter().position(|b| *b == d) {
            self.partial.extend_from_slice(&rest[..i]);
            out.push(std::mem::take(&mut self.partial));
            rest = &rest[i + 1..];
        }
        self.partial.extend_from_slice(rest);
        out
    }

    /// The end of input: a last record without its delimiter, or the whole input.
    pub fn finish(self) -> Option<Vec<u8>> {
        match self.framing {
            Framing::Whole => Some(self.partial),
            Framing::Delimited(_) => (!self.partial.is_empty()).then_some(self.partial),
        }
    }
}

/// Read stdin on a thread of its own, handing each record over as soon as it is complete.
fn stdin_records(framing: Framing) -> mpsc::Receiver<Result<Vec<u8>, String>> {
    let (tx, rx) = mpsc::channel(256);
    std::thread::spawn(move || {
        let mut split = Splitter::new(framing);
        let mut buf = vec![0u8; 64 << 10];
        let mut stdin = std::io::stdin().lock();
        loop {
            match stdin.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    for r in split.push(&buf[..n]) {
                        if tx.blocking_send(Ok(r)).is_err() {
                            return;
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let _ = tx.blocking_send(Err(format!("reading stdin: {e}")));
                    return;
                }
            }
        }
        if let Some(r) = split.finish() {
            let _ = tx.blocking_send(Ok(r));
        }
    });
    rx
}

fn records_of(source: Source) -> mpsc::Receiver<Result<Vec<u8>, String>> {
    match source {
        Source::Stdin(f) => stdin_records(f),
        Source::Args(args) => {
            use std::os::unix::ffi::OsStringExt;
            let (tx, rx) = mpsc::channel(args.len().max(1));
            for a in args {
                let _ = tx.try_send(Ok(a.into_vec()));
            }
            rx
        }
    }
}

/// What happened to the records of one publish command.
#[derive(Debug, Default)]
struct Tally {
    sent: u64,
    refused: u64,
    last_refusal: Option<(String, String)>,
}

impl Tally {
    fn refused(&mut self, json: bool, record: u64, code: &str, message: &str) {
        self.refused += 1;
        if json {
            println!(
                "{}",
                serde_json::json!({"record": record, "ok": false, "code": code, "message": message})
            );
        } else {
            eprintln!("felixctl: record {record} refused ({code}): {message}");
        }
        self.last_refusal = Some((code.to_string(), message.to_string()));
    }

    fn outcome(self) -> Result<(), Fail> {
        let total = self.sent + self.refused;
        match (self.refused, self.last_refusal) {
            (0, _) if total == 0 => Err(Fail::Usage("nothing to publish".into())),
            (0, _) => Ok(()),
            (n, Some((code, message))) if n == total => Err(Fail::refused(
                &code,
                format!("every record was refused ({n}); the last: {message}"),
            )),
            (n, _) => Err(Fail::Partial(format!(
                "{n} of {total} records refused (each named above); the others were published"
            ))),
        }
    }
}

/// Publish every record of `source`; see the module docs.
pub async fn publish(
    client: &Client,
    name: &StreamName,
    sel: ShardSelector,
    source: Source,
    opts: PublishOpts,
) -> Result<(), Fail> {
    let mut rx = records_of(source);
    let max_payload = client.limits.max_payload_bytes as usize;
    let mut tally = Tally::default();
    let mut batch: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut n = 0u64;
    while let Some(rec) = rx.recv().await {
        let rec = rec.map_err(|e| Fail::refused("io", e))?;
        n += 1;
        // Refused here, before sending, naming the broker's limit (HelloOk).
        if rec.len() > max_payload {
            let msg = format!(
                "{} bytes is over the broker's max_payload_bytes ({max_payload}); not sent",
                rec.len()
            );
            tally.refused(opts.json, n, "payload_too_large", &msg);
            continue;
        }
        if opts.batch {
            batch.push((n, rec));
            continue;
        }
        send(client, name, &sel, vec![(n, rec)], &opts, &mut tally).await?;
    }
    if !batch.is_empty() {
        send(client, name, &sel, batch, &opts, &mut tally).await?;
    }
    if opts.no_ack && tally.sent > 0 {
        // Every byte must have reached the broker before felixctl exits: a close would discard
        // whatever QUIC still held.
        client.flush_fire().await.map_err(|e| {
            let f = Fail::from(e);
            Fail::unreachable(
                f.parts().0,
                format!(
                    "{}; the broker did not confirm receiving the {} fire-and-forget record(s) sent",
                    f.parts().1,
                    tally.sent
                ),
            )
        })?;
        // Refusals the connection's core makes are queued on the control stream before the
        // answer to a request sent after them: one round trip collects them.
        client.describe_stream(name).await?;
        let (refused, last) = client.fire_and_forget_errors();
        if refused > 0 {
            tally.sent -= refused.min(tally.sent);
            tally.refused += refused;
            let last = last.map(Fail::from).map(|f| {
                let (c, m) = f.parts();
                (c.to_string(), m)
            });
            eprintln!(
                "felixctl: {refused} fire-and-forget records refused (which ones is not reported without acks); the last: {}",
                last.as_ref().map(|l| l.1.clone()).unwrap_or_default()
            );
            tally.last_refusal = last;
        }
    }
    tally.outcome()
}

/// Publish `records` (numbered) as one publish; a refusal is recorded against each of them,
/// a lost connection ends the command.
async fn send(
    client: &Client,
    name: &StreamName,
    sel: &ShardSelector,
    records: Vec<(u64, Vec<u8>)>,
    opts: &PublishOpts,
    tally: &mut Tally,
) -> Result<(), Fail> {
    let numbers: Vec<u64> = records.iter().map(|r| r.0).collect();
    let payloads: Vec<bytes::Bytes> = records.into_iter().map(|r| r.1.into()).collect();
    let count = payloads.len() as u64;
    if opts.no_ack {
        return match client.publish_fire(name, sel.clone(), payloads) {
            Ok(()) => {
                tally.sent += count;
                wait_for_room(client).await
            }
            Err(e) => refused_or_stop(e, &numbers, opts.json, tally),
        };
    }
    match client.publish_batch(name, sel.clone(), payloads).await {
        Ok(a) => {
            tally.sent += count;
            if opts.json {
                println!(
                    "{}",
                    serde_json::json!({"record": numbers[0], "shard": a.shard,
                        "first_offset": a.first_offset, "count": a.count})
                );
            } else {
                println!(
                    "shard {} offset {} count {}",
                    a.shard, a.first_offset, a.count
                );
            }
            Ok(())
        }
        Err(e) => refused_or_stop(e, &numbers, opts.json, tally),
    }
}

/// Fire-and-forget records queued in the client beyond this wait for QUIC to take them, so
/// felixctl's memory stays bounded when stdin is faster than the network.
const FIRE_BACKLOG_BYTES_MAX: u64 = 8 << 20;

/// Wait (bounded) while the client holds more than `FIRE_BACKLOG_BYTES_MAX` of unsent
/// fire-and-forget records.
async fn wait_for_room(client: &Client) -> Result<(), Fail> {
    let give_up = tokio::time::Instant::now() + std::time::Duration::from_secs(30);
    while client.fire_backlog_bytes() > FIRE_BACKLOG_BYTES_MAX {
        if tokio::time::Instant::now() > give_up {
            return Err(Fail::unreachable(
                "timeout",
                "the broker took no fire-and-forget records for 30 s",
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    Ok(())
}

fn refused_or_stop(
    e: felix_client::Error,
    numbers: &[u64],
    json: bool,
    tally: &mut Tally,
) -> Result<(), Fail> {
    let f = Fail::from(e);
    if let Fail::Unreachable { message, code } = &f {
        // The connection is gone: say how far the command got and stop.
        return Err(Fail::unreachable(
            code,
            format!(
                "{message}; {} record(s) published before it, record {} and after not sent",
                tally.sent, numbers[0]
            ),
        ));
    }
    let (code, message) = f.parts();
    for n in numbers {
        tally.refused(json, *n, code, &message);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_are_bytes_as_they_are_and_nothing_is_dropped() {
        let mut s = Splitter::new(Framing::Delimited(b'\n'));
        let mut got = s.push(b"b1\n\xff\xfe\nb");
        got.extend(s.push(b"3\n\nlast"));
        got.extend(s.finish());
        assert_eq!(
            got,
            vec![
                b"b1".to_vec(),
                vec![0xff, 0xfe],
                b"b3".to_vec(),
                Vec::new(),
                b"last".to_vec()
            ]
        );
    }

    #[test]
    fn a_trailing_delimiter_makes_no_extra_record() {
        let mut s = Splitter::new(Framing::Delimited(0));
        assert_eq!(s.push(b"a\0b\0"), vec![b"a".to_vec(), b"b".to_vec()]);
        assert_eq!(s.finish(), None);
    }

    #[test]
    fn whole_input_is_one_record_even_empty() {
        let mut s = Splitter::new(Framing::Whole);
        assert!(s.push(b"x\ny\n").is_empty());
        assert_eq!(s.finish(), Some(b"x\ny\n".to_vec()));
        assert_eq!(Splitter::new(Framing::Whole).finish(), Some(Vec::new()));
    }

    #[test]
    fn delimiters_parse() {
        assert_eq!(parse_delimiter("\\n"), Ok(b'\n'));
        assert_eq!(parse_delimiter("\\0"), Ok(0));
        assert_eq!(parse_delimiter(","), Ok(b','));
        assert_eq!(parse_delimiter("0x1e"), Ok(0x1e));
        assert!(parse_delimiter("ab").is_err());
        assert!(parse_delimiter("é").is_err());
        assert!(parse_delimiter("0xzz").is_err());
    }

    #[test]
    fn the_outcome_names_partial_and_total_refusals() {
        let ok = Tally {
            sent: 3,
            ..Default::default()
        };
        assert!(ok.outcome().is_ok());
        let mut partial = Tally {
            sent: 2,
            ..Default::default()
        };
        partial.refused(true, 3, "payload_too_large", "big");
        assert!(matches!(partial.outcome(), Err(Fail::Partial(_))));
        let mut all = Tally::default();
        all.refused(true, 1, "unknown_stream", "no");
        assert_eq!(all.outcome().unwrap_err().parts().0, "unknown_stream");
        assert!(matches!(Tally::default().outcome(), Err(Fail::Usage(_))));
    }
}
