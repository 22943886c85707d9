//! Recovery planning (pure): what is on disk in, a plan out. The driver gathers a
//! [`DiskView`] (headers, index files, scans of the segments [`must_scan`] names), calls
//! [`plan_recovery`], and only then executes the plan's actions. `inspect` runs the same
//! planner on the same view without executing anything.
//!
//! Rules, each with the failure it prevents:
//! - Only the last segment may have a torn tail: commits are written one at a time and a
//!   segment is sealed (fdatasync, then its index) before the next one is created. A torn
//!   final commit is cut whole, at its start — it was never acknowledged under `on_commit`
//!   (acks follow the fdatasync), and under the other modes it is what a machine crash may
//!   lose. (A bit flipped in an acknowledged final commit looks exactly like a torn write and
//!   is cut the same way; `inspect` reports it as "would repair".)
//! - Damage with a valid commit anywhere after it is corruption in the middle: the log is
//!   refused (segment and byte named). Cutting there would silently drop good records.
//! - A sealed segment's index is trusted if its CRC holds and its end facts line up with the
//!   next segment; a missing or damaged index is rebuilt from a scan of its segment.
//! - Offsets must be contiguous across segments; a gap or overlap is refused.
//! - A last segment whose header never reached the disk and that holds no record is a roll
//!   interrupted by a crash: it is deleted.

use crate::segment::{HeaderError, IndexError, Scan, ScanEnd, SegmentHeader, SegmentIndex, BLOCK};

/// One segment as found on disk.
#[derive(Debug, Clone)]
pub struct SegmentView {
    /// The base offset in the file name.
    pub base: u64,
    pub file_len: u64,
    pub header: Result<SegmentHeader, HeaderError>,
    /// `None`: no index file.
    pub index: Option<Result<SegmentIndex, IndexError>>,
    /// A scan of the segment's bytes, when [`must_scan`] asked for one (or inspect did).
    pub scan: Option<Scan>,
}

impl SegmentView {
    /// Assemble a view from what the driver read: `head` is the file's first block (shorter
    /// if the file is), `full` the whole file when it was to be scanned.
    pub fn from_read(
        base: u64,
        file_len: u64,
        head: &[u8],
        index_bytes: Option<&[u8]>,
        full: Option<&[u8]>,
        interval_bytes: u32,
    ) -> SegmentView {
        SegmentView {
            base,
            file_len,
            header: SegmentHeader::decode(head),
            index: index_bytes.map(SegmentIndex::decode),
            scan: full.map(|b| crate::segment::scan_segment(b, base, interval_bytes)),
        }
    }
}

#[derive(Debug, Clone, Default)]
pub struct DiskView {
    /// Sorted by base.
    pub segments: Vec<SegmentView>,
    /// Index files with no segment file.
    pub orphan_indexes: Vec<u64>,
}

/// Which segments the planner needs scanned: the last one, and any whose index is missing
/// or damaged.
pub fn must_scan(view: &DiskView) -> Vec<usize> {
    let n = view.segments.len();
    (0..n)
        .filter(|&i| i + 1 == n || !matches!(view.segments[i].index, Some(Ok(_))))
        .collect()
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Remove a last segment that holds no record and whose header is missing or torn.
    DeleteSegment { base: u64 },
    /// Cut the segment's file at `pos` (the first bad record of a torn tail).
    TruncateSegment { base: u64, pos: u64 },
    /// Write a sealed segment's index rebuilt from its scan.
    WriteIndex { index: SegmentIndex },
    /// Remove the last segment's damaged index; the segment becomes active again.
    RemoveIndex { base: u64 },
    /// Remove an index file whose segment does not exist.
    RemoveOrphanIndex { base: u64 },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    Clean,
    Repair,
    Refuse {
        segment: u64,
        pos: u64,
        reason: String,
    },
}

/// Where appends continue after recovery.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Active {
    /// Keep appending to the last segment at `write_pos` (block-aligned).
    Continue { base: u64, write_pos: u64 },
    /// The last segment is sealed (or there is none): create a segment with this base.
    Create { base: u64 },
}

/// A recovered segment's facts, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    pub base: u64,
    pub end_offset: u64,
    pub end_pos: u64,
    pub max_ts_ms: u64,
    pub index: Vec<crate::segment::IndexEntry>,
    /// The generations of the segment's records.
    pub gens: Vec<crate::segment::GenRun>,
    /// The segment header's format version: an active version-1 segment is sealed at open
    /// (`crate::segment::FORMAT_VERSION_OLDEST`).
    pub version: u16,
    pub sealed: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub verdict: Verdict,
    pub actions: Vec<Action>,
    /// Segments that remain after the actions (empty on refusal).
    pub segments: Vec<Recovered>,
    pub active: Active,
    /// The next offset to assign.
    pub next_offset: u64,
    /// The storage identity found in the headers (None for an empty directory).
    pub log_id: Option<[u8; 16]>,
}

fn refuse(segment: u64, pos: u64, reason: impl Into<String>) -> Plan {
    Plan {
        verdict: Verdict::Refuse {
            segment,
            pos,
            reason: reason.into(),
        },
        actions: vec![],
        segments: vec![],
        active: Active::Create { base: 0 },
        next_offset: 0,
        log_id: None,
    }
}

/// Decide what to do with what is on disk. `first_offset` is where an empty log starts.
/// Panics if a segment [`must_scan`] names has no scan (a driver bug, not a disk fault).
pub fn plan_recovery(view: &DiskView, first_offset: u64) -> Plan {
    let mut actions: Vec<Action> = view
        .orphan_indexes
        .iter()
        .map(|&base| Action::RemoveOrphanIndex { base })
        .collect();
    let mut segs: &[SegmentView] = &view.segments;
    let mut rolled_back = false;

    // A roll interrupted before the new segment's header reached the disk.
    if let Some(last) = segs.last() {
        if last.header.is_err() {
            let scan = last.scan.as_ref().expect("last segment must be scanned");
            let no_records =
                scan.end_offset == last.base && !matches!(scan.end, ScanEnd::Corrupt { .. });
            if no_records && last.file_len <= 2 * BLOCK as u64 {
                actions.push(Action::DeleteSegment { base: last.base });
                segs = &segs[..segs.len() - 1];
                // The roll sealed the segment before it: treat that one as sealed.
                rolled_back = true;
            }
        }
    }

    let mut out: Vec<Recovered> = Vec::with_capacity(segs.len());
    let mut log_id: Option<[u8; 16]> = None;
    let n = segs.len();
    for (i, s) in segs.iter().enumerate() {
        let last = i + 1 == n && !rolled_back;
        let h = match &s.header {
            Ok(h) => *h,
            Err(e) => return refuse(s.base, 0, format!("segment header unreadable: {e:?}")),
        };
        if h.base_offset != s.base {
            return refuse(
                s.base,
                0,
                format!(
                    "header says base {} but the file is named {}",
                    h.base_offset, s.base
                ),
            );
        }
        match log_id {
            None => log_id = Some(h.log_id),
            Some(id) if id != h.log_id => {
                return refuse(
                    s.base,
                    0,
                    "segment belongs to another log (storage identity differs)",
                )
            }
            Some(_) => {}
        }
        if let Some(prev) = out.last() {
            if prev.end_offset != s.base {
                return refuse(
                    s.base,
                    0,
                    format!("offsets not contiguous: previous segment ends at {}, this one starts at {}", prev.end_offset, s.base),
                );
            }
        }
        let rec = if !last {
            match (&s.index, &s.scan) {
                (Some(Ok(idx)), _) => {
                    if idx.base_offset != s.base || idx.end_pos > s.file_len {
                        return refuse(
                            s.base,
                            idx.end_pos.min(s.file_len),
                            "sealed segment is shorter than its index says",
                        );
                    }
                    Recovered {
                        base: s.base,
                        end_offset: idx.end_offset,
                        end_pos: idx.end_pos,
                        max_ts_ms: idx.max_ts_ms,
                        index: idx.entries.clone(),
                        gens: idx.gens.clone(),
                        version: h.version,
                        sealed: true,
                    }
                }
                (_, Some(scan)) => {
                    if let Some(p) = refusal_in(scan) {
                        return p;
                    }
                    if let ScanEnd::TornTail { bad_at, why, .. } = &scan.end {
                        return refuse(
                            s.base,
                            *bad_at,
                            format!(
                                "sealed segment is damaged ({why}) and a newer segment follows it"
                            ),
                        );
                    }
                    actions.push(Action::WriteIndex {
                        index: scan.as_index(),
                    });
                    recovered_from_scan(scan, h.version, true)
                }
                (_, None) => panic!("segment {} has no usable index and was not scanned", s.base),
            }
        } else {
            let scan = s.scan.as_ref().expect("last segment must be scanned");
            if let Some(p) = refusal_in(scan) {
                return p;
            }
            if let ScanEnd::TornTail { pos, .. } = scan.end {
                actions.push(Action::TruncateSegment { base: s.base, pos });
            }
            let torn = matches!(scan.end, ScanEnd::TornTail { .. });
            let sealed = match &s.index {
                None => false,
                Some(Ok(idx)) if !torn && *idx == scan.as_index() => true,
                Some(Ok(idx)) if idx.end_offset != scan.end_offset => {
                    return refuse(
                        s.base,
                        scan.end_pos,
                        format!(
                            "index vouches for offsets up to {} but the segment holds up to {}",
                            idx.end_offset, scan.end_offset
                        ),
                    )
                }
                // A torn or stale index written during a seal that did not finish.
                Some(_) => {
                    actions.push(Action::RemoveIndex { base: s.base });
                    false
                }
            };
            recovered_from_scan(scan, h.version, sealed)
        };
        let prev_gen = out.iter().rev().find_map(|r| r.gens.last()).map(|r| r.gen);
        if let (Some(was), Some(first)) = (prev_gen, rec.gens.first()) {
            if first.gen < was {
                return refuse(
                    s.base,
                    0,
                    format!(
                        "the segment starts in generation {} but an earlier one ends in generation {was}",
                        first.gen
                    ),
                );
            }
        }
        out.push(rec);
    }

    let (active, next_offset) = match out.last() {
        None => (Active::Create { base: first_offset }, first_offset),
        Some(r) if r.sealed => (Active::Create { base: r.end_offset }, r.end_offset),
        Some(r) => (
            Active::Continue {
                base: r.base,
                write_pos: crate::segment::align_up(r.end_pos as usize) as u64,
            },
            r.end_offset,
        ),
    };
    Plan {
        verdict: if actions.is_empty() {
            Verdict::Clean
        } else {
            Verdict::Repair
        },
        actions,
        segments: out,
        active,
        next_offset,
        log_id,
    }
}

fn refusal_in(scan: &Scan) -> Option<Plan> {
    match &scan.end {
        ScanEnd::Corrupt {
            pos,
            why,
            resumes_at,
        } => Some(refuse(
            scan.base_offset,
            *pos,
            format!("bad record ({why}) with intact records after it (at byte {resumes_at})"),
        )),
        ScanEnd::OffsetGap {
            pos,
            expected,
            found,
        } => Some(refuse(
            scan.base_offset,
            *pos,
            format!("record offset {found} where {expected} was expected"),
        )),
        ScanEnd::GenerationBack { pos, was, found } => Some(refuse(
            scan.base_offset,
            *pos,
            format!("a commit of generation {found} after one of generation {was}"),
        )),
        _ => None,
    }
}

fn recovered_from_scan(scan: &Scan, version: u16, sealed: bool) -> Recovered {
    Recovered {
        base: scan.base_offset,
        end_offset: scan.end_offset,
        end_pos: scan.end_pos,
        max_ts_ms: scan.max_ts_ms,
        index: scan.index.clone(),
        gens: scan.gens.clone(),
        version,
        sealed,
    }
}

#[cfg(test)]
mod tests;
