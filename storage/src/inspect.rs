//! Read-only inspection of a log directory (`felix-broker inspect segments`): plain reads,
//! no DMA and no writes, so it is safe beside a running broker and on a copy of a disk.
//!
//! It scans every segment (startup scans only the last one), checks every record's CRC and
//! each sealed index against one rebuilt from its segment, and reports the verdict startup
//! would reach.

use crate::log::list_log_dir;
use crate::recovery::{plan_recovery, Action, DiskView, SegmentView, Verdict};
use crate::segment::{index_file_name, segment_file_name, ScanEnd, BLOCK};
use serde::Serialize;
use std::path::Path;

/// Exit codes of `inspect`: clean, startup would repair, startup would refuse (or corrupt).
pub const EXIT_CLEAN: i32 = 0;
pub const EXIT_WOULD_REPAIR: i32 = 6;
pub const EXIT_CORRUPT: i32 = 7;

#[derive(Debug, Clone, Serialize)]
pub struct SegmentReport {
    pub base: u64,
    pub file_bytes: u64,
    pub records: u64,
    pub end_offset: u64,
    /// "clean", "torn tail at N", "corrupt at N: why", ...
    pub data: String,
    /// "ok", "missing", "active", "damaged: ...", "mismatch".
    pub index: String,
    /// The segment header's format version (0 when the header is unreadable).
    pub version: u16,
    /// The generations of the intact records, as "gen@first_offset" runs
    /// (replication rule 6): `["1@0", "2@140"]`.
    pub generations: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct LogReport {
    pub dir: String,
    pub segments: Vec<SegmentReport>,
    /// What startup would do: "clean", "repair: ..." or "refuse: ...".
    pub startup: String,
    /// Problems startup would not notice (it trusts sealed segments' indexes).
    pub problems: Vec<String>,
    pub exit_code: i32,
}

/// Inspect one log directory. `interval_bytes` must match the broker's index spacing for
/// index comparison to be meaningful; the interval stored in each index file is used when
/// present.
pub fn inspect_log(dir: &Path) -> std::io::Result<LogReport> {
    let (logs, mut idxs) = list_log_dir(dir).map_err(|e| std::io::Error::other(e.to_string()))?;
    let mut view = DiskView::default();
    for &base in &logs {
        let bytes = std::fs::read(dir.join(segment_file_name(base)))?;
        let index = if idxs.remove(&base) {
            Some(std::fs::read(dir.join(index_file_name(base)))?)
        } else {
            None
        };
        // Rebuild with the index's own interval so the comparison is like for like.
        let interval = index
            .as_deref()
            .and_then(|b| crate::segment::SegmentIndex::decode(b).ok())
            .map(|i| i.interval_bytes)
            .unwrap_or(64 << 10);
        let head = &bytes[..bytes.len().min(BLOCK)];
        view.segments.push(SegmentView::from_read(
            base,
            bytes.len() as u64,
            head,
            index.as_deref(),
            Some(&bytes),
            interval,
        ));
    }
    view.orphan_indexes = idxs.into_iter().collect();
    let plan = plan_recovery(&view, 0);
    let n = view.segments.len();
    let mut problems = Vec::new();
    let mut segments = Vec::new();
    for (i, s) in view.segments.iter().enumerate() {
        let scan = s.scan.as_ref().expect("inspect scans every segment");
        let last = i + 1 == n;
        let data = match &scan.end {
            ScanEnd::Clean => "clean".to_string(),
            ScanEnd::TornTail { pos, why, .. } => {
                format!("torn tail: commit at byte {pos} ({why})")
            }
            ScanEnd::Corrupt {
                pos,
                why,
                resumes_at,
            } => {
                format!("corrupt at byte {pos}: {why} (intact data resumes at {resumes_at})")
            }
            ScanEnd::OffsetGap {
                pos,
                expected,
                found,
            } => {
                format!("offset gap at byte {pos}: expected {expected}, found {found}")
            }
            ScanEnd::GenerationBack { pos, was, found } => {
                format!("generation {found} at byte {pos} after generation {was}")
            }
        };
        let index = match &s.index {
            None if last => "active".to_string(),
            None => "missing".to_string(),
            Some(Err(e)) => format!("damaged: {e:?}"),
            Some(Ok(idx)) if *idx == scan.as_index() => "ok".to_string(),
            Some(Ok(_)) => "mismatch".to_string(),
        };
        if !last {
            if scan.end != ScanEnd::Clean {
                problems.push(format!("sealed segment {}: {data}", s.base));
            }
            if index == "mismatch" {
                problems.push(format!(
                    "sealed segment {}: index differs from one rebuilt from the segment",
                    s.base
                ));
            }
        }
        segments.push(SegmentReport {
            base: s.base,
            file_bytes: s.file_len,
            records: scan.end_offset - s.base,
            end_offset: scan.end_offset,
            data,
            index,
            version: s.header.as_ref().map(|h| h.version).unwrap_or(0),
            generations: scan
                .gens
                .iter()
                .map(|r| format!("{}@{}", r.gen, r.first))
                .collect(),
        });
    }
    let startup = match &plan.verdict {
        Verdict::Clean => "clean".to_string(),
        Verdict::Repair => format!("repair: {}", describe(&plan.actions)),
        Verdict::Refuse {
            segment,
            pos,
            reason,
        } => {
            format!(
                "refuse: segment {} byte {pos}: {reason}",
                segment_file_name(*segment)
            )
        }
    };
    let exit_code = if matches!(plan.verdict, Verdict::Refuse { .. }) || !problems.is_empty() {
        EXIT_CORRUPT
    } else if plan.verdict == Verdict::Repair {
        EXIT_WOULD_REPAIR
    } else {
        EXIT_CLEAN
    };
    Ok(LogReport {
        dir: dir.display().to_string(),
        segments,
        startup,
        problems,
        exit_code,
    })
}

fn describe(actions: &[Action]) -> String {
    actions
        .iter()
        .map(|a| match a {
            Action::DeleteSegment { base } => {
                format!("delete unfinished segment {}", segment_file_name(*base))
            }
            Action::TruncateSegment { base, pos } => {
                format!("cut {} at byte {pos}", segment_file_name(*base))
            }
            Action::WriteIndex { index } => {
                format!("rebuild {}", index_file_name(index.base_offset))
            }
            Action::RemoveIndex { base } => format!("remove unfinished {}", index_file_name(*base)),
            Action::RemoveOrphanIndex { base } => {
                format!("remove orphan {}", index_file_name(*base))
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Every log directory under `root` (a directory holding `.log` segment files), sorted.
pub fn find_logs(root: &Path) -> std::io::Result<Vec<std::path::PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let mut has_segment = false;
        for e in std::fs::read_dir(&d)? {
            let e = e?;
            let ft = e.file_type()?;
            if ft.is_dir() {
                stack.push(e.path());
            } else if crate::segment::parse_file_name(&e.file_name().to_string_lossy()).is_some() {
                has_segment = true;
            }
        }
        if has_segment {
            out.push(d);
        }
    }
    out.sort();
    Ok(out)
}
