//! In-memory fakes of [`ControlStore`] and [`WalStore`] for the consensus tests, benches and the
//! model test.
//!
//! [`MemControlStore`] models an atomic rename: `persist` is durable the moment it returns.
//!
//! [`MemWalStore`] keeps bytes that are durable separately from bytes that were written but not
//! yet synced, and [`MemWalStore::power_loss`] drops the latter, as a machine crash would. It has
//! no WAL decoder, so it treats **the end of every `write_wal` call as a record boundary**: its
//! `write_record_lsn() == write_lsn()` and `flush_lsn()` is the durable end of the last write.
//! Callers must therefore only write whole records (the model test does).
//!
//! Rules enforced like the real store: strict continuity (a gap or a rewrite is
//! [`Error::Rejected`]), truncation never above the written end, and writes refused after
//! construction or a reboot until the first successful `truncate_wal` (neon's pending truncation:
//! the end of WAL found at boot is only trusted once the proposer says where to continue).

use std::ops::Deref;

use crate::state::TimelinePersistentState;
use crate::storage::{ControlStore, Error, Result, WalStore};
use crate::types::Lsn;

/// Control state held in memory; every persist is durable and atomic.
#[derive(Debug, Clone)]
pub struct MemControlStore {
    state: TimelinePersistentState,
    /// How many times `persist` ran (tests count control-file writes with it).
    persist_count: u64,
}

impl MemControlStore {
    /// A store whose durable state is `state`.
    pub fn new(state: TimelinePersistentState) -> MemControlStore {
        MemControlStore {
            state,
            persist_count: 0,
        }
    }

    /// How many times the state was persisted.
    pub fn persist_count(&self) -> u64 {
        self.persist_count
    }
}

impl Deref for MemControlStore {
    type Target = TimelinePersistentState;

    fn deref(&self) -> &TimelinePersistentState {
        &self.state
    }
}

impl ControlStore for MemControlStore {
    fn persist(&mut self, state: &TimelinePersistentState) -> Result<()> {
        self.state = state.clone();
        self.persist_count += 1;
        Ok(())
    }
}

/// WAL held in memory, with an explicit durable/un-synced split.
#[derive(Debug, Clone)]
pub struct MemWalStore {
    /// LSN of `buf[0]`. Bytes below it are not held.
    base: Lsn,
    /// WAL bytes `[base, write_lsn)`.
    buf: Vec<u8>,
    /// Invariant: `base <= durable_end <= write_lsn`; bytes below it survive a power loss.
    durable_end: Lsn,
    /// Ends of the writes above `durable_end`, ascending (each is a record boundary); a partial
    /// power loss keeps a prefix of them.
    unsynced_writes: Vec<Lsn>,
    /// Writes are refused until a truncation succeeds (set at construction and after a reboot).
    pending_truncation: bool,
    /// `initialize_first_segment` ran on the empty store at this LSN.
    initialized_at: Option<Lsn>,
    /// Number of `flush_wal` calls that had something to sync.
    sync_count: u64,
}

impl MemWalStore {
    /// An empty store (no WAL yet).
    pub fn new() -> MemWalStore {
        MemWalStore {
            base: Lsn::INVALID,
            buf: Vec::new(),
            durable_end: Lsn::INVALID,
            unsynced_writes: Vec::new(),
            pending_truncation: true,
            initialized_at: None,
            sync_count: 0,
        }
    }

    fn write_end(&self) -> Lsn {
        Lsn(self.base.0 + self.buf.len() as u64)
    }

    /// The machine lost power: everything written but not synced is gone. The store then behaves
    /// as freshly booted from its disk image (writes refused until the next truncation).
    pub fn power_loss(&mut self) {
        self.power_loss_keeping(0);
    }

    /// A power loss after which the first `keep` un-synced writes happened to reach the disk
    /// anyway (the OS wrote them back); later ones are lost. Whole writes only: the fake's
    /// record boundaries are write boundaries, and a real store's recovery decodes up to the
    /// last whole record.
    pub fn power_loss_keeping(&mut self, keep: usize) {
        let end = match keep {
            0 => self.durable_end,
            k => self
                .unsynced_writes
                .get(k - 1)
                .copied()
                .unwrap_or(self.write_end()),
        };
        self.buf.truncate((end.0 - self.base.0) as usize);
        self.durable_end = end;
        self.unsynced_writes.clear();
        self.pending_truncation = true;
    }

    /// Number of un-synced writes a power loss could keep or drop.
    pub fn unsynced_write_count(&self) -> usize {
        self.unsynced_writes.len()
    }

    /// The bytes `[start, end)` as written (durable or not), or `None` if not all held.
    pub fn read(&self, start: Lsn, end: Lsn) -> Option<&[u8]> {
        if start < self.base || end > self.write_end() || start > end {
            return None;
        }
        let from = (start.0 - self.base.0) as usize;
        let to = (end.0 - self.base.0) as usize;
        Some(&self.buf[from..to])
    }

    /// The first LSN held.
    pub fn base_lsn(&self) -> Lsn {
        self.base
    }

    /// Where `initialize_first_segment` was called, if it was.
    pub fn initialized_at(&self) -> Option<Lsn> {
        self.initialized_at
    }

    /// Number of `flush_wal` calls that synced something.
    pub fn sync_count(&self) -> u64 {
        self.sync_count
    }
}

impl Default for MemWalStore {
    /// Same as [`MemWalStore::new`]: empty, waiting for its first truncation.
    fn default() -> MemWalStore {
        MemWalStore::new()
    }
}

impl WalStore for MemWalStore {
    fn write_lsn(&self) -> Lsn {
        self.write_end()
    }

    fn write_record_lsn(&self) -> Lsn {
        // Every write ends at a record boundary (module docs).
        self.write_end()
    }

    fn flush_lsn(&self) -> Lsn {
        self.durable_end
    }

    fn write_wal(&mut self, start: Lsn, buf: &[u8]) -> Result<()> {
        if self.pending_truncation {
            return Err(Error::Rejected(format!(
                "write at {start} before the WAL was truncated after start-up"
            )));
        }
        let end = self.write_end();
        if end.is_valid() && start != end {
            let what = if start < end { "rewrite" } else { "gap" };
            return Err(Error::Rejected(format!(
                "{what}: write at {start} but WAL ends at {end}"
            )));
        }
        if !end.is_valid() && self.buf.is_empty() {
            self.base = start;
            self.durable_end = start;
        }
        let new_end = start
            .checked_add(buf.len() as u64)
            .ok_or_else(|| Error::Rejected(format!("write at {start} overflows the LSN space")))?;
        self.buf.extend_from_slice(buf);
        if !buf.is_empty() {
            self.unsynced_writes.push(new_end);
        }
        Ok(())
    }

    fn truncate_wal(&mut self, end: Lsn) -> Result<()> {
        let record_end = self.write_record_lsn();
        if record_end.is_valid() && end > record_end {
            return Err(Error::Rejected(format!(
                "truncate at {end} above the end of WAL {record_end}"
            )));
        }
        if end < self.base || !record_end.is_valid() {
            // Nothing held at `end`: start afresh there.
            self.base = end;
            self.buf.clear();
        } else {
            self.buf.truncate((end.0 - self.base.0) as usize);
        }
        // Truncation syncs what remains, as the real store does (fdatasync + full fsync).
        self.durable_end = end;
        self.unsynced_writes.clear();
        self.pending_truncation = false;
        Ok(())
    }

    fn flush_wal(&mut self) -> Result<()> {
        let end = self.write_end();
        if self.durable_end != end {
            self.durable_end = end;
            self.unsynced_writes.clear();
            self.sync_count += 1;
        }
        Ok(())
    }

    fn initialize_first_segment(&mut self, init_lsn: Lsn) -> Result<()> {
        if self.write_end().is_valid() {
            return Err(Error::Rejected(format!(
                "initialize_first_segment at {init_lsn} but WAL already ends at {}",
                self.write_end()
            )));
        }
        self.initialized_at = Some(init_lsn);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready_at(lsn: u64) -> MemWalStore {
        let mut w = MemWalStore::new();
        w.truncate_wal(Lsn(lsn)).unwrap();
        w
    }

    #[test]
    fn writes_are_refused_until_first_truncation() {
        let mut w = MemWalStore::new();
        assert!(matches!(
            w.write_wal(Lsn(100), b"x"),
            Err(Error::Rejected(_))
        ));
        w.truncate_wal(Lsn(100)).unwrap();
        w.write_wal(Lsn(100), b"abc").unwrap();
        assert_eq!(w.write_lsn(), Lsn(103));
    }

    #[test]
    fn gap_and_rewrite_are_rejected() {
        let mut w = ready_at(100);
        w.write_wal(Lsn(100), b"abc").unwrap();
        assert!(matches!(
            w.write_wal(Lsn(104), b"d"),
            Err(Error::Rejected(_))
        ));
        assert!(matches!(
            w.write_wal(Lsn(102), b"d"),
            Err(Error::Rejected(_))
        ));
        assert_eq!(w.read(Lsn(100), Lsn(103)), Some(&b"abc"[..]));
    }

    #[test]
    fn power_loss_drops_unsynced_bytes_only() {
        let mut w = ready_at(100);
        w.write_wal(Lsn(100), b"abc").unwrap();
        w.flush_wal().unwrap();
        w.write_wal(Lsn(103), b"de").unwrap();
        assert_eq!(w.flush_lsn(), Lsn(103));
        assert_eq!(w.write_lsn(), Lsn(105));
        w.power_loss();
        assert_eq!(w.write_lsn(), Lsn(103));
        assert_eq!(w.flush_lsn(), Lsn(103));
        assert_eq!(w.read(Lsn(100), Lsn(103)), Some(&b"abc"[..]));
        // Booted from the disk image: writes wait for a truncation.
        assert!(w.write_wal(Lsn(103), b"x").is_err());
    }

    #[test]
    fn partial_power_loss_keeps_whole_writes() {
        let mut w = ready_at(0x10);
        for chunk in [&b"aa"[..], b"bbb", b"c"] {
            let at = w.write_lsn();
            w.write_wal(at, chunk).unwrap();
        }
        w.power_loss_keeping(2);
        assert_eq!(w.flush_lsn(), Lsn(0x15));
        assert_eq!(w.read(Lsn(0x10), Lsn(0x15)), Some(&b"aabbb"[..]));
    }

    #[test]
    fn truncation_above_the_end_is_rejected_and_below_is_durable() {
        let mut w = ready_at(100);
        w.write_wal(Lsn(100), b"abcdef").unwrap();
        assert!(w.truncate_wal(Lsn(107)).is_err());
        w.truncate_wal(Lsn(103)).unwrap();
        assert_eq!(w.flush_lsn(), Lsn(103));
        w.power_loss();
        assert_eq!(w.read(Lsn(100), Lsn(103)), Some(&b"abc"[..]));
        assert_eq!(w.write_lsn(), Lsn(103));
    }

    #[test]
    fn first_segment_initialization_needs_an_empty_store() {
        let mut w = MemWalStore::new();
        w.initialize_first_segment(Lsn(0x1000)).unwrap();
        w.truncate_wal(Lsn(0x1000)).unwrap();
        w.write_wal(Lsn(0x1000), b"x").unwrap();
        assert!(w.initialize_first_segment(Lsn(0x1000)).is_err());
    }
}
