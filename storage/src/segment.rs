//! Segment and index file formats and the segment scanner (pure: bytes in, facts out).
//!
//! A segment file `<base:020>.log` is a 4096-byte header block followed by commits. Every
//! commit starts on a fresh 4096-byte block and is zero-padded to the end of its last block,
//! so a commit never rewrites a block an earlier commit wrote: a torn write can only damage
//! the commit being written, never an acknowledged one.
//!
//! A sealed segment has an index file `<base:020>.idx`, written once when the segment is
//! sealed: a header with the segment's end facts and a CRC, then sparse entries
//! `(offset - base, file position)` at commit starts, then the segment's generation runs.
//! The active segment has no index file; its index is rebuilt by scanning at open.
//!
//! Format version 2 (replication, `docs/replication-design.md` rule 6) puts a generation in
//! every commit header (a 40-byte `FXC2` header). Version 1 files are still read: a version-1
//! commit (`FXCM`, 32 bytes) is of generation 0, which is what every record of an unreplicated
//! log is.

use crate::record::decode_at;

/// Block size: O_DIRECT alignment and the unit each commit starts on.
pub const BLOCK: usize = 4096;
pub const SEGMENT_MAGIC: &[u8; 8] = b"FELIXSEG";
pub const INDEX_MAGIC: &[u8; 8] = b"FELIXIDX";
/// The version new segment headers and index files are written with.
pub const FORMAT_VERSION: u16 = 2;
/// The oldest version still read. A version-1 segment holds only version-1 commits: the log
/// seals an active version-1 segment at open instead of appending version-2 commits to it,
/// so that a broker of the previous release refuses the directory (it does not know version
/// 2) rather than cutting the commits it cannot parse as a torn tail.
pub const FORMAT_VERSION_OLDEST: u16 = 1;
const SEG_HEADER_CRC_AT: usize = 48;
const IDX_HEADER_BYTES: usize = 64;
const IDX_ENTRY_BYTES: usize = 8;
const IDX_RUN_BYTES: usize = 16;

pub fn align_up(v: usize) -> usize {
    v.div_ceil(BLOCK) * BLOCK
}

pub fn segment_file_name(base: u64) -> String {
    format!("{base:020}.log")
}
pub fn index_file_name(base: u64) -> String {
    format!("{base:020}.idx")
}
/// Parse `<20 digits>.log` / `.idx`; anything else is not ours.
pub fn parse_file_name(name: &str) -> Option<(u64, &'static str)> {
    let (stem, ext) = name.rsplit_once('.')?;
    let kind = match ext {
        "log" => "log",
        "idx" => "idx",
        _ => return None,
    };
    if stem.len() != 20 || !stem.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((stem.parse().ok()?, kind))
}

/// The header block of a segment file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// [`FORMAT_VERSION`] for a segment written now; [`FORMAT_VERSION_OLDEST`] is still read.
    pub version: u16,
    pub base_offset: u64,
    /// The log's id: chosen at random when the log is created, the same in every segment of
    /// that log, so a segment from another log is refused. It never changes (the directory's
    /// rotating storage identity is another thing, `broker/src/storage_identity.rs`).
    pub log_id: [u8; 16],
    pub created_ms: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderError {
    /// The block is all zeros (a segment whose creation did not reach the disk).
    Zero,
    Short,
    BadMagic,
    BadVersion(u16),
    BadCrc,
}

impl SegmentHeader {
    pub fn encode(&self) -> [u8; BLOCK] {
        let mut b = [0u8; BLOCK];
        b[0..8].copy_from_slice(SEGMENT_MAGIC);
        b[8..10].copy_from_slice(&self.version.to_le_bytes());
        b[12..16].copy_from_slice(&(BLOCK as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.base_offset.to_le_bytes());
        b[24..40].copy_from_slice(&self.log_id);
        b[40..48].copy_from_slice(&self.created_ms.to_le_bytes());
        let crc = crc32c::crc32c(&b[..SEG_HEADER_CRC_AT]);
        b[48..52].copy_from_slice(&crc.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8]) -> Result<SegmentHeader, HeaderError> {
        if b.len() < BLOCK {
            return if b.iter().all(|x| *x == 0) {
                Err(HeaderError::Zero)
            } else {
                Err(HeaderError::Short)
            };
        }
        let b = &b[..BLOCK];
        if b.iter().all(|x| *x == 0) {
            return Err(HeaderError::Zero);
        }
        if &b[0..8] != SEGMENT_MAGIC {
            return Err(HeaderError::BadMagic);
        }
        let v = u16::from_le_bytes([b[8], b[9]]);
        if !(FORMAT_VERSION_OLDEST..=FORMAT_VERSION).contains(&v) {
            return Err(HeaderError::BadVersion(v));
        }
        let crc = u32::from_le_bytes(b[48..52].try_into().unwrap());
        if crc32c::crc32c(&b[..SEG_HEADER_CRC_AT]) != crc {
            return Err(HeaderError::BadCrc);
        }
        Ok(SegmentHeader {
            version: v,
            base_offset: u64::from_le_bytes(b[16..24].try_into().unwrap()),
            log_id: b[24..40].try_into().unwrap(),
            created_ms: u64::from_le_bytes(b[40..48].try_into().unwrap()),
        })
    }
}

/// One sparse index entry: the record at `offset` starts at byte `pos` of the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    pub offset: u64,
    pub pos: u64,
}

/// CRC32C of an index file's header and entries, the CRC field itself (bytes 48..52) skipped.
fn index_crc(b: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(&b[..48]), &b[52..])
}

/// What a sealed segment's index file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentIndex {
    pub base_offset: u64,
    /// One past the last record's offset (== base when the segment holds no record).
    pub end_offset: u64,
    /// One past the last record's last byte.
    pub end_pos: u64,
    /// Largest record timestamp (0 when empty): retention by age uses it.
    pub max_ts_ms: u64,
    /// The spacing rule the entries were built with (so a rebuilt index can be compared).
    pub interval_bytes: u32,
    pub entries: Vec<IndexEntry>,
    /// The generations of the segment's records, as runs (a version-1 index, written before
    /// generations existed, decodes to one run of generation 0 when the segment holds any
    /// record).
    pub gens: Vec<GenRun>,
}

/// Records from `first` on (up to the next run's `first`, or the end) were written in
/// generation `gen`. Generations never decrease along a log, so runs are few: one per
/// leader change that wrote into the segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GenRun {
    pub first: u64,
    pub gen: u64,
}

/// Extend `runs` with `count` records from `first` in generation `gen` (contiguous with what
/// `runs` already covers; a new run only where the generation changes).
pub fn push_gen_run(runs: &mut Vec<GenRun>, first: u64, gen: u64) {
    match runs.last() {
        Some(r) if r.gen == gen => {}
        Some(r) => {
            assert!(
                r.gen < gen && r.first < first,
                "generations never decrease along a log: run {r:?}, then {gen} at {first}"
            );
            runs.push(GenRun { first, gen });
        }
        None => runs.push(GenRun { first, gen }),
    }
}

/// The generation of the record at `offset`, from `runs` (which cover `[runs[0].first, end)`;
/// the caller checks `offset < end`).
pub fn gen_in_runs(runs: &[GenRun], offset: u64) -> Option<u64> {
    let i = runs.partition_point(|r| r.first <= offset);
    i.checked_sub(1).map(|i| runs[i].gen)
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IndexError {
    Short,
    BadMagic,
    BadVersion(u16),
    BadCrc,
    /// Entries out of order or outside the segment.
    Inconsistent,
}

impl SegmentIndex {
    pub fn encode(&self) -> Vec<u8> {
        let n = self.entries.len();
        let runs_at = IDX_HEADER_BYTES + n * IDX_ENTRY_BYTES;
        let mut b = vec![0u8; runs_at + self.gens.len() * IDX_RUN_BYTES];
        b[0..8].copy_from_slice(INDEX_MAGIC);
        b[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&(n as u32).to_le_bytes());
        b[56..60].copy_from_slice(&(self.gens.len() as u32).to_le_bytes());
        for (i, r) in self.gens.iter().enumerate() {
            let p = runs_at + i * IDX_RUN_BYTES;
            b[p..p + 8].copy_from_slice(&r.first.to_le_bytes());
            b[p + 8..p + 16].copy_from_slice(&r.gen.to_le_bytes());
        }
        b[16..24].copy_from_slice(&self.base_offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.end_offset.to_le_bytes());
        b[32..40].copy_from_slice(&self.end_pos.to_le_bytes());
        b[40..48].copy_from_slice(&self.max_ts_ms.to_le_bytes());
        b[52..56].copy_from_slice(&self.interval_bytes.to_le_bytes());
        for (i, e) in self.entries.iter().enumerate() {
            let p = IDX_HEADER_BYTES + i * IDX_ENTRY_BYTES;
            let rel =
                u32::try_from(e.offset - self.base_offset).expect("segment spans < 2^32 offsets");
            let pos = u32::try_from(e.pos).expect("segment < 4 GiB");
            b[p..p + 4].copy_from_slice(&rel.to_le_bytes());
            b[p + 4..p + 8].copy_from_slice(&pos.to_le_bytes());
        }
        let crc = index_crc(&b);
        b[48..52].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// Decode and check an index file (trailing zero padding allowed).
    pub fn decode(b: &[u8]) -> Result<SegmentIndex, IndexError> {
        if b.len() < IDX_HEADER_BYTES {
            return Err(IndexError::Short);
        }
        if &b[0..8] != INDEX_MAGIC {
            return Err(IndexError::BadMagic);
        }
        let v = u16::from_le_bytes([b[8], b[9]]);
        if !(FORMAT_VERSION_OLDEST..=FORMAT_VERSION).contains(&v) {
            return Err(IndexError::BadVersion(v));
        }
        let n = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
        // Version 1 has no runs (bytes 56..60 were zero).
        let n_runs = if v >= 2 {
            u32::from_le_bytes(b[56..60].try_into().unwrap()) as usize
        } else {
            0
        };
        let runs_at = IDX_HEADER_BYTES
            .checked_add(n.checked_mul(IDX_ENTRY_BYTES).ok_or(IndexError::Short)?)
            .ok_or(IndexError::Short)?;
        let body_end = runs_at
            .checked_add(n_runs.checked_mul(IDX_RUN_BYTES).ok_or(IndexError::Short)?)
            .ok_or(IndexError::Short)?;
        if b.len() < body_end {
            return Err(IndexError::Short);
        }
        if index_crc(&b[..body_end]) != u32::from_le_bytes(b[48..52].try_into().unwrap()) {
            return Err(IndexError::BadCrc);
        }
        let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap());
        let base_offset = u64_at(16);
        let end_offset = u64_at(24);
        let end_pos = u64_at(32);
        let mut entries = Vec::with_capacity(n);
        for i in 0..n {
            let p = IDX_HEADER_BYTES + i * IDX_ENTRY_BYTES;
            let rel = u32::from_le_bytes(b[p..p + 4].try_into().unwrap()) as u64;
            let pos = u32::from_le_bytes(b[p + 4..p + 8].try_into().unwrap()) as u64;
            entries.push(IndexEntry {
                offset: base_offset + rel,
                pos,
            });
        }
        let ordered = entries
            .windows(2)
            .all(|w| w[0].offset < w[1].offset && w[0].pos < w[1].pos);
        let inside = entries
            .iter()
            .all(|e| e.offset < end_offset && e.pos >= BLOCK as u64 && e.pos < end_pos);
        if end_offset < base_offset || !ordered || !inside {
            return Err(IndexError::Inconsistent);
        }
        let mut gens: Vec<GenRun> = (0..n_runs)
            .map(|i| {
                let p = runs_at + i * IDX_RUN_BYTES;
                GenRun {
                    first: u64_at(p),
                    gen: u64_at(p + 8),
                }
            })
            .collect();
        if v < 2 && end_offset > base_offset {
            gens.push(GenRun {
                first: base_offset,
                gen: 0,
            });
        }
        // Runs start at the base (when there is a record), inside the segment, strictly
        // increasing in both offset and generation.
        let runs_ok = match gens.first() {
            None => end_offset == base_offset,
            Some(r) => {
                r.first == base_offset
                    && gens.last().is_some_and(|r| r.first < end_offset)
                    && gens
                        .windows(2)
                        .all(|w| w[0].first < w[1].first && w[0].gen < w[1].gen)
            }
        };
        if !runs_ok {
            return Err(IndexError::Inconsistent);
        }
        Ok(SegmentIndex {
            base_offset,
            end_offset,
            end_pos,
            max_ts_ms: u64_at(40),
            interval_bytes: u32::from_le_bytes(b[52..56].try_into().unwrap()),
            entries,
            gens,
        })
    }

    /// The entry to start a read for `offset` from (the last entry at or before it).
    pub fn floor(&self, offset: u64) -> Option<IndexEntry> {
        let i = self.entries.partition_point(|e| e.offset <= offset);
        i.checked_sub(1).map(|i| self.entries[i])
    }
}

/// The header that starts every commit (on a block boundary).
///
/// ```text
/// 0   magic         4 bytes "FXC2" (version 2; "FXCM" is version 1, 32 bytes, no gen)
/// 4   crc32c        u32  CRC32C of bytes [8, 40)  (version 1: [8, 32))
/// 8   records_bytes u32  bytes of records following this header (padding excluded)
/// 12  count         u32  records in the commit (>= 1)
/// 16  first_offset  u64
/// 24  max_ts_ms     u64
/// 32  gen           u64  the generation every record of the commit was written in
/// ```
/// It gives a commit's extent, so a scan can tell a torn final commit (damage inside the
/// last commit, nothing after it) from damage in the middle (a valid commit header after the
/// damage: that commit was written later, so the damaged one had completed). Its generation
/// is what log matching compares (replication rule 6); a commit never mixes generations.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CommitHeader {
    pub records_bytes: u32,
    pub count: u32,
    pub first_offset: u64,
    pub max_ts_ms: u64,
    pub gen: u64,
    /// 2, or 1 for a commit written before generations existed (its `gen` is 0).
    pub version: u8,
}

pub const COMMIT_MAGIC: &[u8; 4] = b"FXC2";
pub const COMMIT_MAGIC_V1: &[u8; 4] = b"FXCM";
/// The header new commits get.
pub const COMMIT_HEADER_BYTES: usize = 40;
pub const COMMIT_HEADER_V1_BYTES: usize = 32;

impl CommitHeader {
    /// A version-2 header (what the log writes).
    pub fn new(
        records_bytes: u32,
        count: u32,
        first_offset: u64,
        max_ts_ms: u64,
        gen: u64,
    ) -> Self {
        CommitHeader {
            records_bytes,
            count,
            first_offset,
            max_ts_ms,
            gen,
            version: 2,
        }
    }

    /// This header's length on disk.
    pub fn header_bytes(&self) -> usize {
        if self.version == 1 {
            COMMIT_HEADER_V1_BYTES
        } else {
            COMMIT_HEADER_BYTES
        }
    }

    /// The header's bytes (`header_bytes()` of them).
    pub fn encode(&self) -> Vec<u8> {
        let mut b = vec![0u8; self.header_bytes()];
        self.write_to(&mut b);
        b
    }

    /// Write the header into `b` (exactly `header_bytes()` long): the commit path encodes
    /// straight into its write buffer.
    pub fn write_to(&self, b: &mut [u8]) {
        assert_eq!(b.len(), self.header_bytes());
        b.fill(0);
        if self.version == 1 {
            assert_eq!(self.gen, 0, "a version-1 commit has no generation");
            b[0..4].copy_from_slice(COMMIT_MAGIC_V1);
        } else {
            b[0..4].copy_from_slice(COMMIT_MAGIC);
            b[32..40].copy_from_slice(&self.gen.to_le_bytes());
        }
        b[8..12].copy_from_slice(&self.records_bytes.to_le_bytes());
        b[12..16].copy_from_slice(&self.count.to_le_bytes());
        b[16..24].copy_from_slice(&self.first_offset.to_le_bytes());
        b[24..32].copy_from_slice(&self.max_ts_ms.to_le_bytes());
        let crc = crc32c::crc32c(&b[8..]);
        b[4..8].copy_from_slice(&crc.to_le_bytes());
    }

    /// Decode a commit header (either version) at `bytes[pos..]`; `None` if it is not a
    /// valid one.
    pub fn decode_at(bytes: &[u8], pos: usize) -> Option<CommitHeader> {
        let magic = bytes.get(pos..pos + 4)?;
        let (version, len) = if magic == COMMIT_MAGIC {
            (2u8, COMMIT_HEADER_BYTES)
        } else if magic == COMMIT_MAGIC_V1 {
            (1u8, COMMIT_HEADER_V1_BYTES)
        } else {
            return None;
        };
        let b = bytes.get(pos..pos + len)?;
        if crc32c::crc32c(&b[8..]) != u32::from_le_bytes(b[4..8].try_into().unwrap()) {
            return None;
        }
        let u64_at = |p: usize| u64::from_le_bytes(b[p..p + 8].try_into().unwrap());
        let h = CommitHeader {
            records_bytes: u32::from_le_bytes(b[8..12].try_into().unwrap()),
            count: u32::from_le_bytes(b[12..16].try_into().unwrap()),
            first_offset: u64_at(16),
            max_ts_ms: u64_at(24),
            gen: if version == 2 { u64_at(32) } else { 0 },
            version,
        };
        (h.count >= 1 && h.records_bytes as usize >= h.count as usize * crate::record::HEADER_BYTES)
            .then_some(h)
    }

    /// Bytes from the commit start to the end of its last record.
    pub fn span(&self) -> usize {
        self.header_bytes() + self.records_bytes as usize
    }
}

/// How a scan of a segment's bytes ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ScanEnd {
    /// Clean end: a zero block (or end of file) where the next commit would start.
    Clean,
    /// The last commit, starting at `pos`, is damaged and nothing was written after it: a torn
    /// (or cut) tail. `bad_at` is the first damaged byte found.
    TornTail { pos: u64, bad_at: u64, why: String },
    /// Damage at `pos`, and a valid commit starts later at `resumes_at`: the damage is in the
    /// middle, and cutting there would drop intact, acknowledged records.
    Corrupt {
        pos: u64,
        why: String,
        resumes_at: u64,
    },
    /// Records are valid but their offsets are not contiguous.
    OffsetGap { pos: u64, expected: u64, found: u64 },
    /// A valid commit whose generation is lower than the one before it.
    GenerationBack { pos: u64, was: u64, found: u64 },
}

/// What scanning a segment's bytes found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    pub base_offset: u64,
    /// Offsets `[base_offset, end_offset)` were found intact and contiguous.
    pub end_offset: u64,
    /// One past the last good commit's last record byte (== BLOCK when the segment is empty).
    pub end_pos: u64,
    pub max_ts_ms: u64,
    pub interval_bytes: u32,
    /// A sparse index rebuilt from the scan: the first commit, then each commit starting at
    /// least `interval_bytes` after the previous entry. Entries point at commit headers.
    pub index: Vec<IndexEntry>,
    /// The generations of the intact records, from their commit headers.
    pub gens: Vec<GenRun>,
    pub end: ScanEnd,
}

impl Scan {
    pub fn as_index(&self) -> SegmentIndex {
        SegmentIndex {
            base_offset: self.base_offset,
            end_offset: self.end_offset,
            end_pos: self.end_pos,
            max_ts_ms: self.max_ts_ms,
            interval_bytes: self.interval_bytes,
            entries: self.index.clone(),
            gens: self.gens.clone(),
        }
    }
}

/// Check one commit's records; `Err((byte, why))` names the first damaged byte.
fn check_commit(bytes: &[u8], pos: usize, h: &CommitHeader) -> Result<(), (usize, String)> {
    let end = pos + h.span();
    if end > bytes.len() {
        return Err((
            bytes.len().max(pos),
            "commit extends past the end of the file".into(),
        ));
    }
    let mut p = pos + h.header_bytes();
    for i in 0..h.count as u64 {
        match decode_at(&bytes[..end], p) {
            Ok(r) if r.offset == h.first_offset + i => p += r.len,
            Ok(r) => {
                return Err((
                    p,
                    format!(
                        "record offset {} inside a commit starting at {}",
                        r.offset, h.first_offset
                    ),
                ))
            }
            Err(e) => return Err((p, e.to_string())),
        }
    }
    if p != end {
        return Err((p, "records do not fill the commit".into()));
    }
    Ok(())
}

/// The first valid commit header at a block boundary at or after `from` (resync).
fn next_commit_after(bytes: &[u8], from: usize) -> Option<usize> {
    let mut q = align_up(from);
    while q + COMMIT_HEADER_V1_BYTES <= bytes.len() {
        if CommitHeader::decode_at(bytes, q).is_some() {
            return Some(q);
        }
        q += BLOCK;
    }
    None
}

/// Scan the bytes of a segment file (header block included) whose header says `base_offset`.
///
/// Commits are walked from block 1. A zero block where a commit would start ends the data;
/// a damaged commit header or record stops the walk, and the rest of the file is searched (at
/// block boundaries past the damaged commit) for a valid commit header: one found means
/// corruption in the middle, none means a torn tail. Commits are written one at a time, so
/// nothing can follow a commit that was torn.
pub fn scan_segment(bytes: &[u8], base_offset: u64, interval_bytes: u32) -> Scan {
    let mut pos = BLOCK;
    let mut next = base_offset;
    let mut max_ts = 0u64;
    let mut index: Vec<IndexEntry> = Vec::new();
    let mut gens: Vec<GenRun> = Vec::new();
    let mut end_pos = BLOCK as u64;
    let end = loop {
        if pos >= bytes.len() {
            break ScanEnd::Clean;
        }
        let block_end = (pos + BLOCK).min(bytes.len());
        if bytes[pos..block_end].iter().all(|b| *b == 0) {
            // End of data, unless a commit was written after a block that got lost.
            break match next_commit_after(bytes, pos + BLOCK) {
                Some(q) => ScanEnd::Corrupt {
                    pos: pos as u64,
                    why: "zeroed block".into(),
                    resumes_at: q as u64,
                },
                None => ScanEnd::Clean,
            };
        }
        let Some(h) = CommitHeader::decode_at(bytes, pos) else {
            break damaged(bytes, pos, pos, pos + BLOCK, "bad commit header".into());
        };
        if h.first_offset != next {
            break ScanEnd::OffsetGap {
                pos: pos as u64,
                expected: next,
                found: h.first_offset,
            };
        }
        if let Err((at, why)) = check_commit(bytes, pos, &h) {
            break damaged(bytes, pos, at, pos + h.span(), why);
        }
        if gens.last().is_some_and(|r| r.gen > h.gen) {
            // Intact, but a generation lower than an earlier commit's: no writer does that
            // (the log refuses such an append), so the bytes are not this log's history.
            break ScanEnd::GenerationBack {
                pos: pos as u64,
                was: gens.last().map(|r| r.gen).unwrap_or(0),
                found: h.gen,
            };
        }
        push_gen_run(&mut gens, h.first_offset, h.gen);
        if index
            .last()
            .is_none_or(|e| pos as u64 - e.pos >= interval_bytes as u64)
        {
            index.push(IndexEntry {
                offset: h.first_offset,
                pos: pos as u64,
            });
        }
        max_ts = max_ts.max(h.max_ts_ms);
        next += h.count as u64;
        end_pos = (pos + h.span()) as u64;
        pos = align_up(pos + h.span());
    };
    Scan {
        base_offset,
        end_offset: next,
        end_pos,
        max_ts_ms: max_ts,
        interval_bytes,
        index,
        gens,
        end,
    }
}

fn damaged(
    bytes: &[u8],
    commit_pos: usize,
    bad_at: usize,
    commit_end: usize,
    why: String,
) -> ScanEnd {
    match next_commit_after(bytes, commit_end.max(commit_pos + 1)) {
        Some(q) => ScanEnd::Corrupt {
            pos: bad_at as u64,
            why,
            resumes_at: q as u64,
        },
        None => ScanEnd::TornTail {
            pos: commit_pos as u64,
            bad_at: bad_at as u64,
            why,
        },
    }
}

#[cfg(test)]
pub(crate) mod tests {
    /// Encode one commit (header + records) into `out`, zero-padded to a block boundary.
    /// Returns the commit header. `records` must be contiguous from `first_offset`. `gen`
    /// `None` writes a version-1 commit.
    pub(crate) fn encode_commit(
        out: &mut Vec<u8>,
        records: &[u8],
        count: u32,
        first_offset: u64,
        max_ts_ms: u64,
        gen: Option<u64>,
    ) -> CommitHeader {
        let mut h = CommitHeader::new(
            u32::try_from(records.len()).expect("commit < 4 GiB"),
            count,
            first_offset,
            max_ts_ms,
            gen.unwrap_or(0),
        );
        if gen.is_none() {
            h.version = 1;
        }
        let start = out.len();
        debug_assert_eq!(start % BLOCK, 0);
        out.extend_from_slice(&h.encode());
        out.extend_from_slice(records);
        out.resize(start + align_up(h.span()), 0);
        h
    }

    use super::*;
    use crate::record::{encode_into, RecordIn};

    /// Build segment bytes: header + commits (each a list of payloads), all of generation
    /// 0. Returns the bytes, each record's (offset, start, end) and each commit's (start, end
    /// of records).
    #[allow(clippy::type_complexity)]
    pub(crate) fn build(
        base: u64,
        commits: &[Vec<Vec<u8>>],
    ) -> (Vec<u8>, Vec<(u64, usize, usize)>, Vec<(usize, usize)>) {
        let gens = vec![Some(0); commits.len()];
        build_gens(base, commits, &gens)
    }

    /// [`build`] with each commit's generation (`None`: a version-1 commit, and then a
    /// version-1 segment header when every commit is one).
    #[allow(clippy::type_complexity)]
    pub(crate) fn build_gens(
        base: u64,
        commits: &[Vec<Vec<u8>>],
        gens: &[Option<u64>],
    ) -> (Vec<u8>, Vec<(u64, usize, usize)>, Vec<(usize, usize)>) {
        assert_eq!(commits.len(), gens.len());
        let v1 = !gens.is_empty() && gens.iter().all(|g| g.is_none());
        let mut b = SegmentHeader {
            version: if v1 { 1 } else { FORMAT_VERSION },
            base_offset: base,
            log_id: [7; 16],
            created_ms: 1,
        }
        .encode()
        .to_vec();
        let mut recs = Vec::new();
        let mut spans = Vec::new();
        let mut off = base;
        for (c, gen) in commits.iter().zip(gens) {
            let mut body = Vec::new();
            let start = b.len();
            let mut local = Vec::new();
            for p in c {
                let s0 = body.len();
                encode_into(&mut body, off, 100 + off, &RecordIn::new(p));
                local.push((off, s0, body.len()));
                off += 1;
            }
            if c.is_empty() {
                continue;
            }
            let h = encode_commit(
                &mut b,
                &body,
                c.len() as u32,
                local[0].0,
                100 + off - 1,
                *gen,
            );
            for (o, s0, e0) in local {
                recs.push((
                    o,
                    start + h.header_bytes() + s0,
                    start + h.header_bytes() + e0,
                ));
            }
            spans.push((start, start + h.span()));
        }
        (b, recs, spans)
    }

    #[test]
    fn header_round_trip_and_damage() {
        let h = SegmentHeader {
            version: FORMAT_VERSION,
            base_offset: 99,
            log_id: [3; 16],
            created_ms: 5,
        };
        let mut b = h.encode();
        assert_eq!(SegmentHeader::decode(&b), Ok(h));
        assert_eq!(SegmentHeader::decode(&[0u8; BLOCK]), Err(HeaderError::Zero));
        b[17] ^= 1;
        assert_eq!(SegmentHeader::decode(&b), Err(HeaderError::BadCrc));
    }

    #[test]
    fn index_round_trip_and_damage() {
        let i = SegmentIndex {
            base_offset: 10,
            end_offset: 20,
            end_pos: 9000,
            max_ts_ms: 77,
            interval_bytes: 4096,
            entries: vec![
                IndexEntry {
                    offset: 10,
                    pos: 4096,
                },
                IndexEntry {
                    offset: 15,
                    pos: 8192,
                },
            ],
            gens: vec![GenRun { first: 10, gen: 3 }, GenRun { first: 14, gen: 5 }],
        };
        let mut b = i.encode();
        b.resize(BLOCK, 0);
        assert_eq!(SegmentIndex::decode(&b), Ok(i.clone()));
        assert_eq!(
            i.floor(14),
            Some(IndexEntry {
                offset: 10,
                pos: 4096
            })
        );
        assert_eq!(i.floor(15).unwrap().offset, 15);
        assert_eq!(i.floor(9), None);
        b[70] ^= 1;
        assert_eq!(SegmentIndex::decode(&b), Err(IndexError::BadCrc));
    }

    #[test]
    fn scan_clean_multi_commit() {
        let commits = vec![vec![vec![1u8; 10], vec![2; 5000]], vec![vec![3; 1]], vec![]];
        let (b, recs, spans) = build(50, &commits);
        let s = scan_segment(&b, 50, 0);
        assert_eq!(s.end, ScanEnd::Clean);
        assert_eq!(s.end_offset, 53);
        assert_eq!(s.end_pos, recs.last().unwrap().2 as u64);
        assert_eq!(s.index.len(), 2, "one entry per commit start");
        assert_eq!(
            s.index[1],
            IndexEntry {
                offset: 52,
                pos: spans[1].0 as u64
            }
        );
    }

    #[test]
    fn scan_empty_segment() {
        let (b, _, _) = build(5, &[]);
        let s = scan_segment(&b, 5, 0);
        assert_eq!(
            (s.end_offset, s.end_pos, s.end.clone()),
            (5, BLOCK as u64, ScanEnd::Clean)
        );
    }

    #[test]
    fn commit_headers_of_both_versions_round_trip() {
        let v2 = CommitHeader::new(100, 2, 7, 9, 4);
        let b = v2.encode();
        assert_eq!(b.len(), COMMIT_HEADER_BYTES);
        assert_eq!(&b[..4], COMMIT_MAGIC);
        assert_eq!(CommitHeader::decode_at(&b, 0), Some(v2));
        let mut v1 = CommitHeader::new(100, 2, 7, 9, 0);
        v1.version = 1;
        let b1 = v1.encode();
        assert_eq!(b1.len(), COMMIT_HEADER_V1_BYTES);
        assert_eq!(&b1[..4], COMMIT_MAGIC_V1);
        assert_eq!(CommitHeader::decode_at(&b1, 0), Some(v1));
        assert_eq!(
            v1.span() + 8,
            v2.span(),
            "the generation is 8 more header bytes"
        );
        // The generation is under the CRC.
        let mut bad = b.clone();
        bad[33] ^= 1;
        assert_eq!(CommitHeader::decode_at(&bad, 0), None);
    }

    #[test]
    fn a_scan_finds_the_generation_runs_and_refuses_one_going_back() {
        let c = |n: u8| vec![vec![n; 10]];
        let commits = vec![c(1), c(2), c(3), c(4)];
        let (b, _, spans) = build_gens(20, &commits, &[Some(1), Some(1), Some(4), Some(6)]);
        let s = scan_segment(&b, 20, 0);
        assert_eq!(s.end, ScanEnd::Clean);
        let runs = vec![
            GenRun { first: 20, gen: 1 },
            GenRun { first: 22, gen: 4 },
            GenRun { first: 23, gen: 6 },
        ];
        assert_eq!(s.gens, runs);
        assert_eq!(gen_in_runs(&runs, 21), Some(1));
        assert_eq!(gen_in_runs(&runs, 22), Some(4));
        assert_eq!(gen_in_runs(&runs, 99), Some(6), "the caller bounds the end");
        assert_eq!(gen_in_runs(&runs, 19), None);
        // The index carries the runs, and decoding checks them.
        let mut idx = s.as_index().encode();
        idx.resize(BLOCK, 0);
        assert_eq!(SegmentIndex::decode(&idx).unwrap().gens, runs);
        let (b2, _, _) = build_gens(20, &commits, &[Some(1), Some(4), Some(3), Some(6)]);
        let s2 = scan_segment(&b2, 20, 0);
        assert_eq!(
            s2.end,
            ScanEnd::GenerationBack {
                pos: spans[2].0 as u64,
                was: 4,
                found: 3
            }
        );
        assert_eq!(s2.end_offset, 22, "records before the step back are intact");
    }

    #[test]
    fn version_1_segments_and_indexes_read_as_generation_0() {
        let commits = vec![vec![vec![1u8; 10], vec![2; 30]], vec![vec![3; 5]]];
        let (b, recs, _) = build_gens(40, &commits, &[None, None]);
        assert_eq!(SegmentHeader::decode(&b).unwrap().version, 1);
        let s = scan_segment(&b, 40, 0);
        assert_eq!((s.end.clone(), s.end_offset), (ScanEnd::Clean, 43));
        assert_eq!(s.gens, vec![GenRun { first: 40, gen: 0 }]);
        assert_eq!(
            recs[0].1,
            BLOCK + COMMIT_HEADER_V1_BYTES,
            "records follow a 32-byte header"
        );
        // A version-1 index (no runs, bytes 56..60 zero) as the previous release wrote it.
        let mut idx = s.as_index();
        idx.gens.clear();
        let mut v1 = idx.encode();
        v1[8..10].copy_from_slice(&1u16.to_le_bytes());
        let crc = index_crc(&v1);
        v1[48..52].copy_from_slice(&crc.to_le_bytes());
        let d = SegmentIndex::decode(&v1).unwrap();
        assert_eq!(d.gens, vec![GenRun { first: 40, gen: 0 }]);
        assert_eq!(
            d,
            s.as_index(),
            "a version-1 index matches the scan of its segment"
        );
        // A version-2 index whose runs do not start at the base is refused.
        let mut bad = s.as_index();
        bad.gens[0].first = 41;
        assert_eq!(
            SegmentIndex::decode(&bad.encode()),
            Err(IndexError::Inconsistent)
        );
        // Unknown versions are refused.
        let mut v9 = b.clone();
        v9[8..10].copy_from_slice(&9u16.to_le_bytes());
        assert_eq!(SegmentHeader::decode(&v9), Err(HeaderError::BadVersion(9)));
    }
}
