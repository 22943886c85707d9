//! The storage identity of a durable storage directory (`docs/replication-design.md`, rule 9).
//!
//! It names the bytes this broker wrote into the directory. Replication counts what a replica
//! was reported to hold only under the identity it holds now, so the identity must change
//! whenever those bytes may be gone:
//! - a clean stop (every log flushed and fsynced, then `clean` recorded) keeps it;
//! - a process crash (SIGKILL, OOM, a panic) keeps it when the machine has not restarted
//!   since (same `boot_id`) and `syncfs` on the directory succeeds: what the process wrote
//!   was in the page cache and is now on disk;
//! - anything else rotates it: a new boot after an unclean stop (a machine crash may have lost
//!   the fsync window of `periodic` or `none` logs), a failed `syncfs`, a missing or unreadable
//!   record beside existing data, or `felix-broker restore-point` (the bytes were restored
//!   from elsewhere).
//!
//! The identity is per directory while the fsync mode is per stream. A new boot after an
//! unclean stop rotates it even when every log ran `on_commit`, which would have lost nothing:
//! the broker does not keep a record of every mode it ran, and a rotation only costs a
//! follower being counted again after the leader ships to it; keeping an identity wrongly
//! could lose acknowledged records.
//!
//! [`decide`] is the rule, pure; [`open`] carries it out before the broker serves.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// The file in the durable storage directory.
pub const FILE: &str = "storage-identity.json";

/// What the file holds.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The identity, 16 hex digits.
    pub id: String,
    /// `/proc/sys/kernel/random/boot_id` of the boot that last opened the directory.
    pub boot_id: String,
    /// The last broker to run on the directory stopped cleanly, after fsyncing every log.
    pub clean: bool,
}

/// Why the identity is what it is after opening.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// A new directory: no data, no record.
    New,
    /// The last stop was clean.
    KeptClean,
    /// A process crash on this boot, and `syncfs` succeeded.
    KeptSameBoot,
    /// The machine restarted since an unclean stop.
    RotatedNewBoot,
    /// `syncfs` failed after an unclean stop on this boot.
    RotatedSyncfsFailed,
    /// The record was unreadable, or missing beside existing data.
    RotatedNoRecord,
    /// `felix-broker restore-point`.
    RotatedByHand,
}

impl Why {
    pub fn rotated(self) -> bool {
        !matches!(self, Why::New | Why::KeptClean | Why::KeptSameBoot)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Why::New => "new directory",
            Why::KeptClean => "kept: the last stop was clean",
            Why::KeptSameBoot => "kept: a process crash on this boot, and syncfs succeeded",
            Why::RotatedNewBoot => "rotated: the machine restarted after an unclean stop",
            Why::RotatedSyncfsFailed => "rotated: syncfs failed after an unclean stop",
            Why::RotatedNoRecord => "rotated: the identity record is missing or unreadable",
            Why::RotatedByHand => "rotated by felix-broker restore-point",
        }
    }
}

/// What the directory's record said.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Found {
    /// No record and no other entry in the directory.
    Empty,
    /// No record (or an unreadable one) beside existing data.
    Missing,
    Record(Record),
}

/// The rule: keep the identity in `found`, or why not. `syncfs_ok` is asked only for a crash
/// on this boot (it costs a flush of the whole file system).
pub fn decide(found: &Found, boot_id: &str, syncfs_ok: impl FnOnce() -> bool) -> Why {
    match found {
        Found::Empty => Why::New,
        Found::Missing => Why::RotatedNoRecord,
        Found::Record(r) if r.clean => Why::KeptClean,
        Found::Record(r) if r.boot_id != boot_id => Why::RotatedNewBoot,
        Found::Record(_) if syncfs_ok() => Why::KeptSameBoot,
        Found::Record(_) => Why::RotatedSyncfsFailed,
    }
}

/// The identity as placement sees it (a replica's `StorageId`).
pub fn as_number(id: &str) -> Option<u64> {
    (id.len() == 16)
        .then(|| u64::from_str_radix(id, 16).ok())
        .flatten()
}

fn fresh_id(not: Option<&str>) -> std::io::Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open("/dev/urandom")?;
    loop {
        let mut b = [0u8; 8];
        f.read_exact(&mut b)?;
        let id = format!("{:016x}", u64::from_le_bytes(b));
        // Zero is no identity, and a rotation must change it.
        if u64::from_le_bytes(b) != 0 && Some(id.as_str()) != not {
            return Ok(id);
        }
    }
}

/// This boot's id.
pub fn boot_id() -> std::io::Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?
        .trim()
        .to_string())
}

/// Flush every dirty page of the file system holding `dir` to disk.
fn syncfs(dir: &Path) -> bool {
    use std::os::fd::AsRawFd;
    match std::fs::File::open(dir) {
        Ok(f) => unsafe { libc::syncfs(f.as_raw_fd()) == 0 },
        Err(_) => false,
    }
}

fn read(dir: &Path) -> std::io::Result<Found> {
    match std::fs::read(dir.join(FILE)) {
        Ok(b) => Ok(serde_json::from_slice::<Record>(&b)
            .ok()
            .filter(|r| as_number(&r.id).is_some())
            .map_or(Found::Missing, Found::Record)),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let mut entries = std::fs::read_dir(dir)?;
            Ok(if entries.next().is_none() {
                Found::Empty
            } else {
                Found::Missing
            })
        }
        Err(e) => Err(e),
    }
}

fn write(dir: &Path, r: &Record) -> std::io::Result<()> {
    let bytes = serde_json::to_vec_pretty(r).expect("a record serialises");
    crate::core::atomic_write(dir, FILE, &bytes)?;
    // Both sides of the write: what is on disk is what was meant.
    debug_assert_eq!(read(dir).ok(), Some(Found::Record(r.clone())));
    Ok(())
}

/// Open the identity of `dir` (created if missing) before the broker serves: decide, and write
/// the record back marked as running (not clean) on this boot.
pub fn open(dir: &Path) -> std::io::Result<(Record, Why)> {
    std::fs::create_dir_all(dir)?;
    let found = read(dir)?;
    let boot = boot_id()?;
    let why = decide(&found, &boot, || syncfs(dir));
    let id = match (&found, why.rotated()) {
        (Found::Record(r), false) => r.id.clone(),
        (Found::Record(r), true) => fresh_id(Some(&r.id))?,
        _ => fresh_id(None)?,
    };
    let rec = Record {
        id,
        boot_id: boot,
        clean: false,
    };
    write(dir, &rec)?;
    Ok((rec, why))
}

/// Record a clean stop, once every log of the directory is flushed and fsynced. Does nothing
/// if the record names another identity (a `restore-point` while this broker ran).
pub fn mark_clean(dir: &Path, id: &str) -> std::io::Result<()> {
    match read(dir)? {
        Found::Record(r) if r.id == id => write(dir, &Record { clean: true, ..r }),
        _ => Ok(()),
    }
}

/// `felix-broker restore-point --durable-storage-dir DIR`: rotate the identity by hand, after
/// the directory's bytes were restored from a backup or copied from another broker. Run it
/// with the broker stopped.
pub fn restore_point_command(args: &[String]) -> i32 {
    let usage = "usage: felix-broker restore-point --durable-storage-dir DIR";
    let dir = match args {
        [flag, dir] if flag == "--durable-storage-dir" => Path::new(dir),
        _ => {
            eprintln!("{usage}");
            return 2;
        }
    };
    let r = (|| -> std::io::Result<(Option<String>, Record)> {
        std::fs::create_dir_all(dir)?;
        let old = match read(dir)? {
            Found::Record(r) => Some(r.id),
            _ => None,
        };
        let rec = Record {
            id: fresh_id(old.as_deref())?,
            boot_id: boot_id()?,
            // A restored directory was not stopped cleanly by this broker, but the new
            // identity already says its bytes are not the ones answered under before; the
            // next start keeps it.
            clean: true,
        };
        write(dir, &rec)?;
        Ok((old, rec))
    })();
    match r {
        Ok((old, rec)) => {
            println!(
                "storage identity of {}: {} -> {} ({})",
                dir.display(),
                old.as_deref().unwrap_or("none"),
                rec.id,
                Why::RotatedByHand.as_str()
            );
            0
        }
        Err(e) => {
            eprintln!("felix-broker restore-point: {}: {e}", dir.display());
            1
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(clean: bool, boot: &str) -> Found {
        Found::Record(Record {
            id: "00000000000000aa".into(),
            boot_id: boot.into(),
            clean,
        })
    }

    #[test]
    fn the_identity_is_kept_only_when_the_bytes_are_shown_to_be_there() {
        let never = || -> bool { panic!("syncfs is asked only after a crash on this boot") };
        assert_eq!(decide(&Found::Empty, "b1", never), Why::New);
        assert_eq!(decide(&Found::Missing, "b1", never), Why::RotatedNoRecord);
        assert_eq!(decide(&rec(true, "b0"), "b1", never), Why::KeptClean);
        assert_eq!(decide(&rec(false, "b0"), "b1", never), Why::RotatedNewBoot);
        assert_eq!(decide(&rec(false, "b1"), "b1", || true), Why::KeptSameBoot);
        assert_eq!(
            decide(&rec(false, "b1"), "b1", || false),
            Why::RotatedSyncfsFailed
        );
        assert!(Why::RotatedNewBoot.rotated() && !Why::KeptSameBoot.rotated());
    }

    #[test]
    fn open_keeps_across_a_crash_on_this_boot_and_rotates_on_doubt() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("durable");
        let (a, why) = open(&dir).unwrap();
        assert_eq!(why, Why::New);
        assert!(as_number(&a.id).is_some() && !a.clean);
        // An unclean stop on this boot (the record still says running): kept.
        let (b, why) = open(&dir).unwrap();
        assert_eq!((b.id.as_str(), why), (a.id.as_str(), Why::KeptSameBoot));
        // A record from another boot, not clean: rotated.
        let other = Record {
            boot_id: "another-boot".into(),
            ..b.clone()
        };
        write(&dir, &other).unwrap();
        let (c, why) = open(&dir).unwrap();
        assert_eq!(why, Why::RotatedNewBoot);
        assert_ne!(c.id, a.id);
        // Clean, then another boot: kept.
        mark_clean(&dir, &c.id).unwrap();
        let clean = Record {
            boot_id: "another-boot".into(),
            clean: true,
            ..c.clone()
        };
        write(&dir, &clean).unwrap();
        let (d, why) = open(&dir).unwrap();
        assert_eq!((d.id.as_str(), why), (c.id.as_str(), Why::KeptClean));
        // mark_clean for an identity the directory no longer has does nothing.
        mark_clean(&dir, "0000000000000001").unwrap();
        assert_eq!(read(&dir).unwrap(), Found::Record(d.clone()));
        // A garbled record beside data: rotated.
        std::fs::write(dir.join(FILE), b"{not json").unwrap();
        let (e, why) = open(&dir).unwrap();
        assert_eq!(why, Why::RotatedNoRecord);
        assert_ne!(e.id, d.id);
    }
}
