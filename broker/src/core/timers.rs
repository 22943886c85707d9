//! The core's timer table and work bounds: every wait cap, poll period and per-pass bound of
//! the driver, named in one place (they were bare numbers in the code that used them).

use std::time::Duration;

/// How often the mesh pump looks at its overflow queues without being woken (a missed wake
/// costs at most this).
pub(in crate::core) const MESH_POLL: Duration = Duration::from_millis(50);

/// The flusher's longest sleep while publishes are held or the core drains: held publishes
/// time out within this of their deadline.
pub(in crate::core) const FLUSH_WAIT_BUSY: Duration = Duration::from_millis(10);

/// The flusher's longest sleep while a replica report of this core is out. Its answer
/// releases acknowledgements; the ops thread rings the core's doorbell when it arrives
/// (`driver.rs` `spawn_report_doorbell`), so this poll only bounds the wait when a doorbell
/// datagram is lost.
pub(in crate::core) const REPORT_ANSWER_POLL: Duration = Duration::from_millis(20);

/// The flusher's longest sleep otherwise (QUIC timers and group and cache deadlines wake it
/// sooner).
pub(in crate::core) const FLUSH_WAIT_IDLE: Duration = Duration::from_millis(100);

/// How often the queue gauges are recomputed (a walk over the core's subscriptions).
pub(in crate::core) const GAUGES_PERIOD: Duration = Duration::from_secs(1);

/// How long the going-away notices may take to flush before connections close.
pub(in crate::core) const NOTIFY_FLUSH: Duration = Duration::from_millis(200);

/// How long a refused connection's Error frame may take to leave before the close is forced
/// (a peer that grants no flow control cannot hold the connection open).
pub(in crate::core) const CLOSE_GRACE: Duration = Duration::from_secs(1);

/// Passes of one connection's flush that refill drained subscription streams; past it the
/// connection goes to the back of the round (one busy connection cannot starve the rest).
pub(in crate::core) const FLUSH_PASSES_MAX: usize = 64;

/// Records one history read returns at most (with `history_fetch_bytes` as the byte bound).
pub(crate) const HISTORY_READ_RECORDS_MAX: usize = 4096;

/// How often a core looks for connections whose token expired with subscriptions or watches
/// open (a walk over its sessions), to end them `token_expired`.
pub(in crate::core) const AUTH_EXPIRY_PERIOD: Duration = Duration::from_secs(1);
