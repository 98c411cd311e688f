//! What readers tell us back (issue 31): each replication reader's written, flushed and applied
//! positions (`r`), its lag in bytes and in time, and its hot-standby feedback (`h`), kept per
//! timeline while the reader is connected.
//!
//! - **Lag in time** is measured as PostgreSQL's walsender measures `write_lag`, `flush_lag` and
//!   `replay_lag` (`LagTracker` in `walsender.c`): when WAL up to an LSN is sent, the time is
//!   noted; when the reader reports a position at or past it, the lag is the time since. The
//!   samples are bounded ([`MAX_LAG_SAMPLES`]; when full, the newest one is moved forward, which
//!   can only overstate a lag). A reader that reports the end of what it was sent twice in a row
//!   has caught up: its lags are cleared, as PostgreSQL shows NULL.
//! - **Hot-standby feedback** carries 32-bit xids with their epochs; they are kept as full 64-bit
//!   transaction ids (`epoch << 32 | xid`), so the oldest over the readers is a plain minimum and
//!   is right across a wraparound. A xid below `FirstNormalTransactionId` (3) is "none", as the
//!   walsender treats it. The timeline's [`Readers::hs_feedback`] goes to the proposer in each
//!   `AppendResponse` (neon's `hs_feedback`).
//! - **Backpressure input**: the *required* readers' least positions (each its own minimum: the
//!   reader slowest to apply need not be the one slowest to flush) go to the proposer as
//!   neon's pageserver feedback (`ps_writelsn`/`ps_flushlsn`/`ps_applylsn`), whose byte layout
//!   the proposer already reads; which readers are required is `--backpressure-readers`.
//!
//! Clock-free: callers pass `Instant`s in. Not here: reading the messages (the walsender,
//! [`crate::send_wal`]), the HTTP and Prometheus views ([`crate::http`], [`crate::registry`]),
//! and deciding to slow the writer (the proposer's core).

use std::collections::{BTreeMap, VecDeque};
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use sk_core::protocol::{HotStandbyFeedback, PageserverFeedback};
use sk_core::types::Lsn;

use crate::blocking::LeafMutex;

/// Most (LSN, time) samples kept per reader for its lag in time.
pub const MAX_LAG_SAMPLES: usize = 1024;

/// PostgreSQL's `FirstNormalTransactionId`: smaller xids are special, never an xmin.
pub const FIRST_NORMAL_XID: u32 = 3;

/// The full 64-bit transaction id of `xid` in `epoch`; 0 ("none") for a xid that is not normal.
pub fn full_xid(xid: u32, epoch: u32) -> u64 {
    if xid < FIRST_NORMAL_XID {
        0
    } else {
        (u64::from(epoch) << 32) | u64::from(xid)
    }
}

/// Which readers the writer waits for (`--backpressure-readers`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum RequiredReaders {
    /// Every reader of committed WAL (`*`, the default).
    #[default]
    Any,
    /// None: readers never slow the writer (`none`).
    Nobody,
    /// Readers whose `application_name` is one of these (comma-separated names).
    Named(Vec<String>),
}

impl RequiredReaders {
    /// Whether a reader named `application_name` is required.
    pub fn includes(&self, application_name: &str) -> bool {
        match self {
            RequiredReaders::Any => true,
            RequiredReaders::Nobody => false,
            RequiredReaders::Named(names) => names.iter().any(|n| n == application_name),
        }
    }
}

impl FromStr for RequiredReaders {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim() {
            "*" => Ok(RequiredReaders::Any),
            "none" => Ok(RequiredReaders::Nobody),
            list => {
                let names: Vec<String> = list.split(',').map(|n| n.trim().to_string()).collect();
                if names.iter().any(String::is_empty) {
                    return Err(format!(
                        "{s:?}: expected `*`, `none` or comma-separated application names"
                    ));
                }
                Ok(RequiredReaders::Named(names))
            }
        }
    }
}

/// Who a reader is, from its connection.
#[derive(Clone, Debug, Default)]
pub struct ReaderInfo {
    /// Its `application_name` startup parameter.
    pub application_name: String,
    /// Its address.
    pub client_addr: String,
    /// Whether it counts for backpressure ([`RequiredReaders::includes`]).
    pub required: bool,
}

/// One reader's lag samples and the lags measured from them.
#[derive(Debug, Default)]
struct LagTracker {
    /// When WAL up to each LSN was sent. Invariant: LSNs ascending, at most
    /// [`MAX_LAG_SAMPLES`].
    samples: VecDeque<(Lsn, Instant)>,
    /// Per position (write, flush, apply): the last reported LSN and its lag.
    read: [(Lsn, Option<Duration>); 3],
}

impl LagTracker {
    fn sent(&mut self, end: Lsn, now: Instant) {
        let full = self.samples.len() >= MAX_LAG_SAMPLES;
        match self.samples.back_mut() {
            Some(last) if last.0 >= end => {}
            Some(last) if full => last.0 = end,
            _ => self.samples.push_back((end, now)),
        }
    }

    /// The reader reached `positions` (write, flush, apply) at `now`.
    fn reached(&mut self, positions: [Lsn; 3], now: Instant) {
        for (k, &pos) in positions.iter().enumerate() {
            let (prev, lag) = &mut self.read[k];
            if pos <= *prev {
                continue;
            }
            // The newest sample this report passes that an earlier one had not.
            if let Some(&(_, t)) = self
                .samples
                .iter()
                .take_while(|(lsn, _)| *lsn <= pos)
                .filter(|(lsn, _)| *lsn > *prev)
                .last()
            {
                *lag = Some(now.saturating_duration_since(t));
            }
            *prev = pos;
        }
        let all_passed = self.read.iter().map(|r| r.0).min().unwrap_or(Lsn::INVALID);
        while self.samples.front().is_some_and(|s| s.0 <= all_passed) {
            self.samples.pop_front();
        }
    }

    fn clear_lags(&mut self) {
        for r in &mut self.read {
            r.1 = None;
        }
    }
}

/// What is known of one connected reader.
#[derive(Debug)]
struct Reader {
    info: ReaderInfo,
    start_lsn: Lsn,
    sent_lsn: Lsn,
    /// Written, flushed and applied positions reported (the start LSN until the first report).
    positions: [Lsn; 3],
    /// Whether it ever reported an applied position: `pg_receivewal` never does (it sends
    /// `InvalidXLogRecPtr`), and what it flushed stands for it in the backpressure input.
    applies: bool,
    /// The reader's clock at its last status update (µs since 2000-01-01 UTC).
    reply_time: Option<i64>,
    replied_at: Option<Instant>,
    lag: LagTracker,
    /// Full 64-bit xids (0: none).
    xmin: u64,
    catalog_xmin: u64,
    hs_time: i64,
}

/// One reader as the timeline's HTTP status shows it (names as in `pg_stat_replication`).
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ReaderStatus {
    /// Its `application_name`.
    pub application_name: String,
    /// Its address.
    pub client_addr: String,
    /// Whether it counts for backpressure (`--backpressure-readers`).
    pub required: bool,
    /// Where it started streaming.
    pub start_lsn: Lsn,
    /// End of the WAL sent to it.
    pub sent_lsn: Lsn,
    /// End of the WAL it has written.
    pub write_lsn: Lsn,
    /// End of the WAL it has flushed.
    pub flush_lsn: Lsn,
    /// End of the WAL it has applied.
    pub replay_lsn: Lsn,
    /// Committed WAL it has not written, flushed, applied (bytes).
    pub write_lag_bytes: u64,
    /// See `write_lag_bytes`.
    pub flush_lag_bytes: u64,
    /// See `write_lag_bytes`.
    pub replay_lag_bytes: u64,
    /// Time from sending WAL to its report of writing it (seconds; `None` when caught up or
    /// not measured yet).
    pub write_lag: Option<f64>,
    /// The same for flushing.
    pub flush_lag: Option<f64>,
    /// The same for applying.
    pub replay_lag: Option<f64>,
    /// The reader's clock at its last status update (µs since 2000-01-01 UTC).
    pub reply_time: Option<i64>,
    /// Seconds since its last status update.
    pub reply_age: Option<f64>,
    /// Its hot-standby feedback: oldest xmin it needs (full 64-bit xid; 0: none).
    pub xmin: u64,
    /// Its oldest catalog xmin (full 64-bit xid; 0: none).
    pub catalog_xmin: u64,
}

/// Per timeline: the readers' lags over all readers (for Prometheus: bounded cardinality).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LagSummary {
    /// Readers that sent at least one status update.
    pub reporting: usize,
    /// Smallest and largest `flush_lag_bytes`.
    pub flush_lag_bytes: (u64, u64),
    /// Smallest and largest `replay_lag_bytes`.
    pub replay_lag_bytes: (u64, u64),
    /// Largest `flush_lag` and `replay_lag` in seconds (0 when none is measured).
    pub max_flush_lag: f64,
    /// See `max_flush_lag`.
    pub max_replay_lag: f64,
}

/// The readers of one timeline.
#[derive(Debug, Default)]
pub struct Readers {
    inner: LeafMutex<BTreeMap<u64, Reader>>,
    next_id: std::sync::atomic::AtomicU64,
}

/// A connected reader's entry; dropping it forgets the reader (and its feedback).
pub struct ReaderHandle {
    readers: Arc<Readers>,
    id: u64,
}

impl Readers {
    /// Adds a reader that starts streaming at `start`.
    pub fn register(self: &Arc<Self>, info: ReaderInfo, start: Lsn) -> ReaderHandle {
        let id = self
            .next_id
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let lag = LagTracker {
            read: [(start, None); 3],
            ..Default::default()
        };
        self.inner.lock().insert(
            id,
            Reader {
                info,
                start_lsn: start,
                sent_lsn: start,
                positions: [start; 3],
                applies: false,
                reply_time: None,
                replied_at: None,
                lag,
                xmin: 0,
                catalog_xmin: 0,
                hs_time: 0,
            },
        );
        ReaderHandle {
            readers: self.clone(),
            id,
        }
    }

    /// The oldest xmin and catalog xmin any reader needs (each 0 if none needs one); `ts` is
    /// the newest feedback's time among the readers that need one.
    pub fn hs_feedback(&self) -> HotStandbyFeedback {
        oldest_xmin(&self.inner.lock())
    }

    /// The required readers' least written, flushed and applied positions (each its own
    /// minimum), as neon's pageserver feedback carries them, with the newest reply time;
    /// `None` without a required reader.
    pub fn slowest_required(&self) -> Option<PageserverFeedback> {
        slowest_required(&self.inner.lock())
    }

    /// Both of the above under one lock: what every AppendResponse carries.
    pub fn for_append(&self) -> (HotStandbyFeedback, Option<PageserverFeedback>) {
        let map = self.inner.lock();
        (oldest_xmin(&map), slowest_required(&map))
    }

    /// Every reader, for the HTTP status; byte lags are measured against `commit`.
    pub fn statuses(&self, commit: Lsn, now: Instant) -> Vec<ReaderStatus> {
        let map = self.inner.lock();
        map.values()
            .map(|r| {
                let behind = |p: Lsn| commit.0.saturating_sub(p.0);
                let secs = |d: Option<Duration>| d.map(|d| d.as_secs_f64());
                ReaderStatus {
                    application_name: r.info.application_name.clone(),
                    client_addr: r.info.client_addr.clone(),
                    required: r.info.required,
                    start_lsn: r.start_lsn,
                    sent_lsn: r.sent_lsn,
                    write_lsn: r.positions[0],
                    flush_lsn: r.positions[1],
                    replay_lsn: r.positions[2],
                    write_lag_bytes: behind(r.positions[0]),
                    flush_lag_bytes: behind(r.positions[1]),
                    replay_lag_bytes: behind(r.positions[2]),
                    write_lag: secs(r.lag.read[0].1),
                    flush_lag: secs(r.lag.read[1].1),
                    replay_lag: secs(r.lag.read[2].1),
                    reply_time: r.reply_time,
                    reply_age: r
                        .replied_at
                        .map(|t| now.saturating_duration_since(t).as_secs_f64()),
                    xmin: r.xmin,
                    catalog_xmin: r.catalog_xmin,
                }
            })
            .collect()
    }

    /// Min and max lags over the readers that reported (for Prometheus).
    pub fn summary(&self, commit: Lsn, now: Instant) -> LagSummary {
        let mut s = LagSummary::default();
        for r in self.statuses(commit, now) {
            if r.reply_time.is_none() {
                continue;
            }
            let first = s.reporting == 0;
            s.reporting += 1;
            let span = |(lo, hi): (u64, u64), v: u64| {
                if first {
                    (v, v)
                } else {
                    (lo.min(v), hi.max(v))
                }
            };
            s.flush_lag_bytes = span(s.flush_lag_bytes, r.flush_lag_bytes);
            s.replay_lag_bytes = span(s.replay_lag_bytes, r.replay_lag_bytes);
            s.max_flush_lag = s.max_flush_lag.max(r.flush_lag.unwrap_or(0.0));
            s.max_replay_lag = s.max_replay_lag.max(r.replay_lag.unwrap_or(0.0));
        }
        s
    }
}

impl ReaderHandle {
    fn with<T>(&self, f: impl FnOnce(&mut Reader) -> T) -> Option<T> {
        self.readers.inner.lock().get_mut(&self.id).map(f)
    }

    /// WAL up to `end` was sent at `now`.
    pub fn sent(&self, end: Lsn, now: Instant) {
        self.with(|r| {
            r.sent_lsn = r.sent_lsn.max(end);
            r.lag.sent(end, now);
        });
    }

    /// A status update (`r`): the reader wrote, flushed and applied up to these positions;
    /// `send_time` is its clock. Positions never go back (a reader that reports less keeps
    /// its best).
    pub fn status_update(&self, positions: [Lsn; 3], send_time: i64, now: Instant) {
        self.with(|r| {
            let prev = r.positions;
            r.applies |= positions[2].is_valid();
            for (p, new) in r.positions.iter_mut().zip(positions) {
                *p = (*p).max(new);
            }
            r.lag.reached(r.positions, now);
            // Caught up in two reports in a row: the second only says time passed.
            let caught_up = r.positions.iter().all(|&p| p == r.sent_lsn);
            if caught_up && prev == r.positions && r.replied_at.is_some() {
                r.lag.clear_lags();
            }
            r.reply_time = Some(send_time);
            r.replied_at = Some(now);
        });
    }

    /// Hot-standby feedback (`h`): the xids come with their epochs; a xid that is not normal
    /// means none (the reader released it).
    pub fn hs_feedback(&self, send_time: i64, xmin: (u32, u32), catalog_xmin: (u32, u32)) {
        self.with(|r| {
            r.xmin = full_xid(xmin.0, xmin.1);
            r.catalog_xmin = full_xid(catalog_xmin.0, catalog_xmin.1);
            r.hs_time = send_time;
        });
    }
}

/// [`Readers::hs_feedback`] over the locked map.
fn oldest_xmin(map: &BTreeMap<u64, Reader>) -> HotStandbyFeedback {
    HotStandbyFeedback::oldest(map.values().map(|r| HotStandbyFeedback {
        ts: r.hs_time,
        xmin: r.xmin,
        catalog_xmin: r.catalog_xmin,
    }))
}

/// [`Readers::slowest_required`] over the locked map.
fn slowest_required(map: &BTreeMap<u64, Reader>) -> Option<PageserverFeedback> {
    let (least, replytime) = map
        .values()
        .filter(|r| r.info.required)
        .map(|r| {
            let [write, flush, apply] = r.positions;
            // A reader that never applies (pg_receivewal) would otherwise pin the apply
            // minimum at its start LSN and pause the writer for good.
            let apply = if r.applies { apply } else { flush };
            ([write, flush, apply], r.reply_time.unwrap_or(0))
        })
        .reduce(|(a, ta), (b, tb)| {
            ([a[0].min(b[0]), a[1].min(b[1]), a[2].min(b[2])], ta.max(tb))
        })?;
    Some(PageserverFeedback {
        last_received_lsn: least[0],
        disk_consistent_lsn: least[1],
        remote_consistent_lsn: least[2],
        replytime,
        ..Default::default()
    })
}

impl Drop for ReaderHandle {
    fn drop(&mut self) {
        self.readers.inner.lock().remove(&self.id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reader(readers: &Arc<Readers>, name: &str, required: bool, start: u64) -> ReaderHandle {
        readers.register(
            ReaderInfo {
                application_name: name.into(),
                client_addr: "127.0.0.1:5".into(),
                required,
            },
            Lsn(start),
        )
    }

    #[test]
    fn oldest_xmin_is_compared_as_full_xids_across_a_wraparound() {
        let readers = Arc::new(Readers::default());
        let a = reader(&readers, "a", true, 0);
        let b = reader(&readers, "b", true, 0);
        // a: xid 4_000_000_000 of epoch 1; b: xid 10 of epoch 2 (newer, though smaller as u32).
        a.hs_feedback(7, (4_000_000_000, 1), (0, 0));
        b.hs_feedback(9, (10, 2), (100, 2));
        let f = readers.hs_feedback();
        assert_eq!(f.xmin, (1 << 32) | 4_000_000_000);
        assert_eq!(f.catalog_xmin, (2 << 32) | 100);
        assert_eq!(f.ts, 9);
        // a releases its snapshot (xid 0): only b's remains.
        a.hs_feedback(10, (0, 1), (0, 0));
        assert_eq!(readers.hs_feedback().xmin, (2 << 32) | 10);
        // b disconnects: none.
        drop(b);
        assert_eq!(readers.hs_feedback(), HotStandbyFeedback::default());
    }

    #[test]
    fn special_xids_are_not_an_xmin() {
        assert_eq!(full_xid(2, 5), 0);
        assert_eq!(full_xid(3, 5), (5 << 32) | 3);
    }

    #[test]
    fn lag_is_time_from_send_to_report_and_clears_when_caught_up() {
        let readers = Arc::new(Readers::default());
        let r = reader(&readers, "a", true, 100);
        let t0 = Instant::now();
        r.sent(Lsn(200), t0);
        r.sent(Lsn(300), t0 + Duration::from_secs(1));
        // Flushed 200 (sent at t0) 3 s later; applied nothing yet.
        r.status_update(
            [Lsn(300), Lsn(200), Lsn(100)],
            1,
            t0 + Duration::from_secs(3),
        );
        let s = &readers.statuses(Lsn(300), t0 + Duration::from_secs(3))[0];
        assert_eq!(s.write_lag, Some(2.0));
        assert_eq!(s.flush_lag, Some(3.0));
        assert_eq!(s.replay_lag, None);
        assert_eq!((s.flush_lag_bytes, s.replay_lag_bytes), (100, 200));
        r.status_update([Lsn(300); 3], 2, t0 + Duration::from_secs(4));
        let s = &readers.statuses(Lsn(300), t0 + Duration::from_secs(4))[0];
        assert_eq!((s.flush_lag, s.replay_lag), (Some(3.0), Some(3.0)));
        // Reported the same end again: caught up, the lags are cleared.
        r.status_update([Lsn(300); 3], 3, t0 + Duration::from_secs(5));
        let s = &readers.statuses(Lsn(300), t0 + Duration::from_secs(5))[0];
        assert_eq!((s.write_lag, s.flush_lag, s.replay_lag), (None, None, None));
    }

    #[test]
    fn lag_samples_stay_bounded() {
        let readers = Arc::new(Readers::default());
        let r = reader(&readers, "a", true, 0);
        let t0 = Instant::now();
        for i in 1..=(3 * MAX_LAG_SAMPLES as u64) {
            r.sent(Lsn(i * 10), t0 + Duration::from_millis(i));
        }
        let n = readers
            .inner
            .lock()
            .values()
            .next()
            .unwrap()
            .lag
            .samples
            .len();
        assert_eq!(n, MAX_LAG_SAMPLES);
        // The last sample took the newest LSN: reaching it measures from an older time (an
        // overstatement, never an understatement).
        r.status_update(
            [Lsn(30 * MAX_LAG_SAMPLES as u64); 3],
            1,
            t0 + Duration::from_secs(60),
        );
        let s = &readers.statuses(Lsn(0), t0)[0];
        assert!(s.flush_lag.unwrap() >= 60.0 - 3.0 * MAX_LAG_SAMPLES as f64 / 1000.0);
    }

    #[test]
    fn required_readers_least_positions_are_reported_and_others_are_not() {
        let readers = Arc::new(Readers::default());
        let fast = reader(&readers, "fast", true, 0);
        let slow_optional = reader(&readers, "slow", false, 0);
        fast.status_update([Lsn(500), Lsn(400), Lsn(300)], 1, Instant::now());
        slow_optional.status_update([Lsn(10); 3], 1, Instant::now());
        // The reported (write, flush, apply) positions.
        let least = || {
            let f = readers.slowest_required().unwrap();
            [
                f.last_received_lsn,
                f.disk_consistent_lsn,
                f.remote_consistent_lsn,
            ]
        };
        assert_eq!(least(), [Lsn(500), Lsn(400), Lsn(300)]);
        // A second required reader that flushed more but applied less: each position is its
        // own minimum, so the apply limit is held against it.
        let behind_in_apply = reader(&readers, "standby", true, 0);
        behind_in_apply.status_update([Lsn(700), Lsn(600), Lsn(100)], 2, Instant::now());
        assert_eq!(least(), [Lsn(500), Lsn(400), Lsn(100)]);
        // A pg_receivewal reports no applied position (0): what it flushed stands for it, so
        // it does not hold the apply minimum at its start.
        let receivewal = reader(&readers, "pg_receivewal", true, 0);
        receivewal.status_update([Lsn(900), Lsn(900), Lsn(0)], 3, Instant::now());
        assert_eq!(least()[2], Lsn(100));
        drop(behind_in_apply);
        assert_eq!(least()[2], Lsn(300));
        drop(fast);
        assert_eq!(least()[1..], [Lsn(900), Lsn(900)]);
        drop(receivewal);
        assert_eq!(readers.slowest_required(), None);
        let s = readers.summary(Lsn(1000), Instant::now());
        assert_eq!((s.reporting, s.flush_lag_bytes), (1, (990, 990)));
    }

    #[test]
    fn required_readers_parse() {
        assert_eq!("*".parse(), Ok(RequiredReaders::Any));
        assert_eq!("none".parse(), Ok(RequiredReaders::Nobody));
        let named: RequiredReaders = "standby1, receiver".parse().unwrap();
        assert!(named.includes("receiver") && !named.includes("other"));
        assert!("a,,b".parse::<RequiredReaders>().is_err());
    }
}
