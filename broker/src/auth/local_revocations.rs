//! Revocation without a control plane. A standalone or `jwks` broker follows a file,
//! `data_dir/auth/revocations.json`, in the control plane's feed format (what
//! `GET /v1/auth/revocations` answers). `felix-broker token revoke` adds to it, and the operator
//! of a `jwks` broker may write it from their own issuer. A change is installed as the feed's
//! answer would be, so the cores' sweep ends the revoked principals' streams the same way.
//!
//! An unreadable or malformed file keeps the revocations held (fail open, as with the feed) and
//! shows in the feed's failure counter and `/readyz`.

use super::{now_s, write_private, AuthKeys};
use felix_control::auth::{Revocation, RevocationFeed, RevokeKind};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// The revocation file under a broker's data dir.
pub fn revocations_path(data_dir: &Path) -> PathBuf {
    data_dir.join("auth").join("revocations.json")
}

/// How often the file is looked at: a revocation is in force within this plus the cores'
/// once-a-second sweep.
const POLL_MS: u64 = 500;
/// At most this many revocations in the file; `token revoke` refuses past it (the way out is
/// a new signing key, which retires every token at once).
pub const REVOCATIONS_MAX: usize = 10_000;

/// What identifies a version of the file: a rename over it changes the inode, an edit in
/// place the time or the length.
fn stamp(path: &Path) -> Option<(u64, i64, i64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.ino(), m.mtime(), m.mtime_nsec(), m.len()))
}

fn read(path: &Path) -> Result<RevocationFeed, String> {
    let raw = std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let feed: RevocationFeed = serde_json::from_slice(&raw)
        .map_err(|e| format!("{}: not a revocation list: {e}", path.display()))?;
    if feed.revocations.len() > REVOCATIONS_MAX {
        return Err(format!(
            "{}: {} revocations, more than {REVOCATIONS_MAX}",
            path.display(),
            feed.revocations.len()
        ));
    }
    Ok(feed)
}

fn now_ms() -> u64 {
    now_s().saturating_mul(1000).max(1)
}

/// Install the file's revocations now (before the broker serves), then follow it on a thread
/// of its own until `shutdown`.
pub fn follow(path: PathBuf, keys: Arc<AuthKeys>, shutdown: Arc<AtomicBool>) {
    let mut last = None;
    // The revision installed: a removed file installs an empty list at the next one, so the
    // cores' sweep (which rechecks on any change of revision) sees it.
    let mut revision = 0u64;
    let mut look = move || {
        let s = stamp(&path);
        if s == last {
            return;
        }
        last = s;
        let feed = match s {
            None => RevocationFeed {
                revision: revision + 1,
                revocations: Vec::new(),
            },
            Some(_) => match read(&path) {
                Ok(f) => f,
                Err(e) => {
                    tracing::error!(error = %e, "the revocation file is unusable; the revocations held stay in force");
                    keys.revocation_feed_failed(now_ms());
                    return;
                }
            },
        };
        // A file written with a revision at or below the one installed still counts as new.
        revision = feed.revision.max(revision + 1);
        let n = feed.revocations.len();
        keys.set_revocations(
            &RevocationFeed {
                revision,
                revocations: feed.revocations,
            },
            now_ms(),
        );
        tracing::info!(revocations = n, revision, "revocation file read");
    };
    look();
    std::thread::Builder::new()
        .name("felix-revocations".into())
        .spawn(move || {
            while !shutdown.load(Ordering::Acquire) {
                std::thread::sleep(std::time::Duration::from_millis(POLL_MS));
                look();
            }
        })
        .expect("spawn the revocation file thread");
}

/// Revocations of the file that cover tokens of `subject` or `tenant` issued in the second
/// `at_s`: a token made then is dated the second after, or it would be born revoked.
pub fn revoked_at_s(data_dir: &Path, subject: &str, tenant: &str) -> Option<u64> {
    let feed = read(&revocations_path(data_dir)).ok()?;
    feed.revocations
        .iter()
        .filter(|r| {
            (r.kind == RevokeKind::Subject && r.value == subject)
                || (r.kind == RevokeKind::Tenant && r.value == tenant)
        })
        .map(|r| r.at_s)
        .max()
}

/// `felix-broker token revoke --data-dir DIR (--jti ID | --subject S | --tenant T)`: add a
/// revocation to DIR's revocation file (tokens of the target issued until now are refused,
/// and their streams ended). Exit 2 on a usage error, 1 if the file cannot be updated.
pub fn revoke_command(args: &[String]) -> i32 {
    let usage =
        "usage: felix-broker token revoke --data-dir DIR (--jti ID | --subject NAME | --tenant TENANT)";
    let (mut dir, mut target) = (None, None);
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        let Some(v) = it.next().filter(|v| !v.is_empty()) else {
            eprintln!("{flag} needs a value\n{usage}");
            return 2;
        };
        let kind = match flag.as_str() {
            "--data-dir" => {
                dir = Some(PathBuf::from(v));
                continue;
            }
            "--jti" => RevokeKind::Jti,
            "--subject" => RevokeKind::Subject,
            "--tenant" => RevokeKind::Tenant,
            other => {
                eprintln!("unknown flag {other}\n{usage}");
                return 2;
            }
        };
        if target.replace((kind, v.clone())).is_some() {
            eprintln!("name exactly one of --jti, --subject, --tenant\n{usage}");
            return 2;
        }
    }
    let (Some(dir), Some((kind, value))) = (dir, target) else {
        eprintln!("{usage}");
        return 2;
    };
    match add(&revocations_path(&dir), kind, value) {
        Ok(n) => {
            eprintln!(
                "revoked; {n} revocations in force (the broker applies it within a second or two)"
            );
            0
        }
        Err(e) => {
            eprintln!("felix-broker token revoke: {e}");
            1
        }
    }
}

/// Add one revocation to the file (made if missing); the number now in force.
fn add(path: &Path, kind: RevokeKind, value: String) -> Result<usize, String> {
    let mut feed = if path.exists() {
        read(path)?
    } else {
        RevocationFeed::default()
    };
    let at_s = now_s();
    // Revoked again: the later time holds.
    feed.revocations
        .retain(|r| !(r.kind == kind && r.value == value));
    if feed.revocations.len() >= REVOCATIONS_MAX {
        return Err(format!(
            "{} holds {REVOCATIONS_MAX} revocations; give the broker a new signing key instead (it retires every token)",
            path.display()
        ));
    }
    // Kept for good: a standalone token's lifetime has no upper bound to wait out.
    feed.revocations.push(Revocation {
        kind,
        value,
        at_s,
        until_s: u64::MAX,
    });
    feed.revision += 1;
    let bytes = serde_json::to_vec_pretty(&feed).expect("serializable");
    write_private(path, &bytes)?;
    Ok(feed.revocations.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn revoking_adds_once_per_target_and_stays_bounded() {
        let d = tempfile::tempdir().unwrap();
        let p = revocations_path(d.path());
        assert_eq!(add(&p, RevokeKind::Subject, "alice".into()), Ok(1));
        assert_eq!(add(&p, RevokeKind::Subject, "alice".into()), Ok(1));
        assert_eq!(add(&p, RevokeKind::Jti, "j1".into()), Ok(2));
        let f = read(&p).unwrap();
        assert_eq!(f.revision, 3);
        assert!(revoked_at_s(d.path(), "alice", "t").is_some());
        assert!(revoked_at_s(d.path(), "bob", "t").is_none());
        std::fs::write(&p, b"not json").unwrap();
        assert!(
            add(&p, RevokeKind::Jti, "j2".into()).is_err(),
            "a malformed file is not overwritten"
        );
    }
}
