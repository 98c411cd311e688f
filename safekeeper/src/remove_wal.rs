//! Removal of local WAL segments below a safe horizon, and the holds readers put on WAL.
//!
//! The horizon ([`removal_horizon`]) is the minimum of: `backup_lsn` (only backed-up WAL goes),
//! the commit LSN, the peers' horizon (the proposer's `truncate_lsn`: what a peer or a new
//! proposer may still fetch from here, and the page before it, where a new synthetic proposer
//! finds the last record's start), and the oldest position a connected reader holds; and
//! at least `--wal-keep-size` bytes below the flush LSN stay. Only whole segments below the
//! horizon's segment are removed. Without remote storage nothing is removed: a reader may ask
//! for any WAL from the timeline start, and nothing else could serve it.
//!
//! Readers take a [`ReadHold`] at their start position before opening a segment and move it as
//! they stream; removal computes the horizon and *claims* the segments below it under the lock
//! the holds are taken and checked under, then unlinks them without it, so a segment is never
//! removed under a reader that holds it, and a reader never gets a hold below what was claimed
//! (it is refused, and serves from the backup). The holds' lock is a leaf
//! ([`crate::blocking::LeafMutex`]): no I/O under it, so taking a hold never waits for an
//! unlink or a directory fsync. Removal fsyncs the directory before it reports the segments
//! removed.

use std::collections::BTreeMap;
use std::sync::Arc;

use pg_wal::lsn::XLOG_BLCKSZ;
use sk_core::types::Lsn;

use crate::blocking::{LeafGuard, LeafMutex};

/// What the removal horizon is computed from (one timeline, read at one moment).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct HorizonInputs {
    /// Durable end of WAL.
    pub flush_lsn: Lsn,
    /// Committed WAL.
    pub commit_lsn: Lsn,
    /// The peers' horizon (the proposer's `truncate_lsn`); invalid = unknown (nothing is known
    /// to be unneeded by peers).
    pub peer_horizon_lsn: Lsn,
    /// Complete segments below this are backed up; `None` without remote storage.
    pub backup_lsn: Option<Lsn>,
    /// The oldest position a connected reader holds.
    pub oldest_reader: Option<Lsn>,
    /// Bytes of WAL always kept below `flush_lsn` (`--wal-keep-size`).
    pub wal_keep_size: u64,
}

/// The LSN below which local WAL may be removed (whole segments only; see the module docs).
/// `Lsn::INVALID` = nothing may be removed.
pub fn removal_horizon(i: &HorizonInputs) -> Lsn {
    let Some(backup) = i.backup_lsn else {
        return Lsn::INVALID;
    };
    // The page below the peers' horizon stays too: a new proposer reads the record that ends
    // there (`Proposer::prev_record_start`), also while remote storage is down.
    let peers = Lsn(i.peer_horizon_lsn.0.saturating_sub(XLOG_BLCKSZ));
    let mut h = backup.min(i.commit_lsn).min(peers);
    if let Some(r) = i.oldest_reader {
        h = h.min(r);
    }
    h.min(Lsn(i.flush_lsn.0.saturating_sub(i.wal_keep_size)))
}

/// The positions readers of one timeline hold, and the first segment still kept locally.
#[derive(Default)]
pub struct ReadHolds {
    inner: LeafMutex<HoldsInner>,
}

#[derive(Default)]
struct HoldsInner {
    next_id: u64,
    holds: BTreeMap<u64, Lsn>,
    /// Every local segment below this number was removed, or is being removed.
    removed_below: u64,
}

/// A reader's hold on WAL from its position on; released on drop.
pub struct ReadHold {
    holds: Arc<ReadHolds>,
    id: u64,
}

impl ReadHolds {
    /// Holds that start with segments below `removed_below` already gone.
    pub fn new(removed_below: u64) -> ReadHolds {
        ReadHolds {
            inner: LeafMutex::new(HoldsInner {
                removed_below,
                ..HoldsInner::default()
            }),
        }
    }

    fn lock(&self) -> LeafGuard<'_, HoldsInner> {
        self.inner.lock()
    }

    /// Holds WAL from `lsn` on, if its segment is still local; `None` if it was removed.
    pub fn hold(self: &Arc<Self>, lsn: Lsn, seg_size: u64) -> Option<ReadHold> {
        let mut inner = self.lock();
        if lsn.segment_number(seg_size) < inner.removed_below {
            return None;
        }
        let id = inner.next_id;
        inner.next_id += 1;
        inner.holds.insert(id, lsn);
        Some(ReadHold {
            holds: self.clone(),
            id,
        })
    }

    /// Every local segment below this number was removed.
    pub fn removed_below(&self) -> u64 {
        self.lock().removed_below
    }

    /// The oldest position a reader holds.
    pub fn oldest(&self) -> Option<Lsn> {
        self.lock().holds.values().min().copied()
    }

    /// Under the holds' lock, `compute(oldest held position)` gives the horizon and the local
    /// segments below its segment are claimed (no hold is granted there from then on); then,
    /// without the lock, `remove(n)` removes the segments below `n`, returning how many it
    /// removed. Nothing is removed below what a hold needs.
    pub fn remove_below<E>(
        &self,
        seg_size: u64,
        compute: impl FnOnce(Option<Lsn>) -> Lsn,
        remove: impl FnOnce(u64) -> Result<usize, E>,
    ) -> Result<usize, E> {
        let below = {
            let mut inner = self.lock();
            let oldest = inner.holds.values().min().copied();
            let horizon = compute(oldest);
            let below = horizon.segment_number(seg_size);
            if !horizon.is_valid() || below <= inner.removed_below {
                return Ok(0);
            }
            // Claimed before the first unlink: a reader that arrives meanwhile is refused and
            // served from the store, never handed a segment that is about to go.
            inner.removed_below = below;
            below
        };
        remove(below)
    }
}

impl ReadHold {
    /// The reader moved on to `lsn`: WAL below it is no longer held.
    pub fn advance(&self, lsn: Lsn) {
        let mut inner = self.holds.lock();
        if let Some(p) = inner.holds.get_mut(&self.id) {
            *p = (*p).max(lsn);
        }
    }
}

impl Drop for ReadHold {
    fn drop(&mut self) {
        self.holds.lock().holds.remove(&self.id);
    }
}

#[cfg(test)]
mod tests;
