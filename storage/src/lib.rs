//! felix-storage: the segmented, crash-safe log Felix keeps per durable shard.
//!
//! Pure parts (no clock, no I/O): [`record`] (record codec), [`segment`] (segment, commit and
//! index formats and the scanner), [`recovery`] (the recovery planner), [`retention`], [`write_path`] (how page-cache
//! commits are written).
//! The driver, [`log`], does the I/O through glommio DMA files (io_uring, O_DIRECT) on the
//! core that owns the shard. The byte layout is in `docs/storage-format.md`.

pub mod inspect;
pub mod log;
pub mod record;
pub mod recovery;
pub mod retention;
pub mod segment;
pub mod write_path;
pub use log::{seed_dma_probe, FsyncMode, Log, LogConfig, LogError, OpenReport, StoredRecord};
pub use record::RecordIn;
