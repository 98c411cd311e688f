//! The timeline manager's decisions, sans I/O: when to save the control file, which segments
//! to back up, how far local WAL may be removed, and how a deleted timeline's work ends. Events
//! in ([`Event`]: what the timeline's state is now, what an action did, time passing), actions
//! out ([`Action`]); the tokio driver ([`crate::lifecycle`]) only performs the actions and
//! reports back, and the seeded simulation (`manager/sim.rs`) drives this same core over a
//! real timeline on a simulated disk, crashes included.
//!
//! The rules, each enforced here and named in docs/durability.md:
//!
//! - **Removal goes by persisted state.** The horizon is computed from the control file's
//!   commit LSN, peers' horizon and backup LSN, never the in-memory ones: a node killed right
//!   after an unlink restarts from the control file, searches its end of WAL from the persisted
//!   commit LSN, and backs up from the persisted backup LSN, so both must still find their WAL
//!   locally (issue 26, defect 1). When the in-memory state would allow removing more, the core
//!   saves the control file first and removes after the save.
//! - **Backup starts from what is still local or already stored.** Segments are uploaded in
//!   order from `backup_lsn`; a segment below the first local one (removed before a restart
//!   whose control file was older) counts as backed up only if the store's listing shows it,
//!   else it is reported missing, never retried from a file that is gone.
//! - **Nothing is uploaded before the store was listed once** (a segment another node stored
//!   is verified instead of uploaded, see [`crate::wal_backup`]).
//! - **A quiet timeline's committed WAL reaches the store within the partial-backup timeout.**
//!   When committed WAL above every stored complete segment has waited `partial_timeout`
//!   without a new complete segment being backed up, the committed part of its segment is
//!   uploaded as a partial object (named by term and end LSN, never taken for a complete
//!   segment; conditional create, so nodes racing store it once), then this node's superseded
//!   partial objects are removed. Only WAL below both the commit LSN and this node's flush LSN
//!   is uploaded: committed, durable here, identical on every node.
//! - **Only WAL wholly in the store is evicted.** A timeline is evicted ([`crate::evict`])
//!   only when it has been idle (no connection, no WAL or commit movement) for
//!   `evict_after`, nothing of its manager is in flight, its in-memory LSNs are all saved, and
//!   every byte of its WAL is committed and durable at one end LSN that the store holds:
//!   complete segments below the end's segment backed up (persisted backup LSN), the end's
//!   segment as a partial object this node stored or verified up to the end. The node checks
//!   again under the acceptor lock (connections, the end) before it flags anything.
//! - **A deleted timeline stops**: every action in flight is aborted and awaited before the
//!   core reports it finished; its remote objects are then deleted by the node
//!   ([`crate::lifecycle`]), before a timeline with the same ids may exist again.
//!
//! Not here: the readers' holds, which the driver applies under their own lock when it removes
//! ([`crate::remove_wal::ReadHolds`]); the file and object-store I/O.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use sk_core::types::Lsn;

use crate::remove_wal::{HorizonInputs, removal_horizon};

pub mod recovery;

/// First retry delay of a failed upload or listing; doubles up to [`MAX_BACKOFF`].
pub const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// Longest retry delay.
pub const MAX_BACKOFF: Duration = Duration::from_secs(10);
/// How long a missing segment (below the local WAL and not in the store) waits before the
/// store is listed again.
pub const RELIST_MISSING_AFTER: Duration = Duration::from_secs(30);
/// How long a removal that readers' holds cut short waits before it is tried again.
pub const REMOVE_AGAIN_AFTER: Duration = Duration::from_secs(1);

/// What the core is configured with (fixed for the life of a timeline's manager).
#[derive(Clone, Copy, Debug)]
pub struct Config {
    /// WAL segment size in bytes.
    pub seg_size: u64,
    /// Bytes of WAL always kept below the flush LSN (`--wal-keep-size`).
    pub wal_keep_size: u64,
    /// Whether the node backs WAL up (`--remote-storage`); without it nothing is removed.
    pub remote: bool,
    /// Uploads in flight at once.
    pub parallelism: usize,
    /// In-memory LSNs older than this are saved even if they moved little.
    pub save_interval: Duration,
    /// Committed WAL not in a stored complete segment is uploaded as a partial segment after
    /// waiting this long with no new complete segment backed up (`--partial-backup-timeout`);
    /// `None`: never. Only with `remote`.
    pub partial_timeout: Option<Duration>,
    /// A timeline idle this long whose WAL is wholly in the store is evicted
    /// (`--eviction-min-idle`); `None`: never. Only with `remote`.
    pub evict_after: Option<Duration>,
}

/// A timeline's LSNs that are persisted lazily.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Lsns {
    /// Committed WAL.
    pub commit_lsn: Lsn,
    /// Oldest WAL any peer may still need.
    pub peer_horizon_lsn: Lsn,
    /// Complete segments below this are in remote storage.
    pub backup_lsn: Lsn,
}

/// The timeline's state as the driver read it (from the published view, at one moment).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// Durable end of WAL.
    pub flush_lsn: Lsn,
    /// Where this node's WAL begins (`max(local_start_lsn, timeline_start_lsn)`).
    pub wal_start_lsn: Lsn,
    /// In memory (what the acceptor knows now).
    pub inmem: Lsns,
    /// In the control file.
    pub persisted: Lsns,
    /// A proposer or reader is connected.
    pub busy: bool,
}

/// What happened.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The timeline's state now (after any change, and with every other event).
    Observed(Observed),
    /// Time passed: `now` since the manager started (monotonic).
    Tick(Duration),
    /// The store's listing of the timeline's complete segments; `None`: it failed.
    Listed(Option<BTreeSet<u64>>),
    /// An upload of `segno` finished (`ok`: stored or verified).
    Uploaded {
        /// The segment.
        segno: u64,
        /// Whether it is in the store now.
        ok: bool,
    },
    /// A control-file save finished.
    Saved {
        /// Whether it was written (the next [`Event::Observed`] shows the persisted state).
        ok: bool,
    },
    /// A removal finished: every local segment below `first_local` is gone (or being removed).
    Removed {
        /// The first segment still local.
        first_local: u64,
    },
    /// A partial upload ([`Action::UploadPartial`]) of the WAL below `upto` finished.
    UploadedPartial {
        /// The end of the WAL it held.
        upto: Lsn,
        /// Whether it is in the store now.
        ok: bool,
    },
    /// A removal of partial objects ([`Action::RemovePartials`]) finished.
    RemovedPartials {
        /// The bound it was given.
        below: Lsn,
        /// Whether every superseded object is gone.
        ok: bool,
    },
    /// An eviction ([`Action::Evict`]) finished: `ok`, the timeline is evicted (its manager is
    /// done); else it was refused at the node's last check or failed, and stays resident.
    Evicted {
        /// Whether it is evicted.
        ok: bool,
    },
    /// The timeline was deleted.
    Deleted,
    /// Every action in flight was aborted and has ended (after [`Action::Stop`]).
    Stopped,
}

/// What the driver is to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Action {
    /// List the timeline's complete segments in the store; answer [`Event::Listed`].
    List,
    /// Upload (or verify, if `known_stored`) segment `segno`, whose bytes before `valid_from`
    /// are not this node's WAL; answer [`Event::Uploaded`].
    Upload {
        /// The segment.
        segno: u64,
        /// Offset of this node's first WAL byte in it (0 but for the first segment).
        valid_from: usize,
        /// The listing showed it: verify instead of uploading.
        known_stored: bool,
    },
    /// Complete segments below `lsn` are in the store (in memory; saved with the next save).
    SetBackupLsn(Lsn),
    /// Save the control file with the in-memory LSNs; answer [`Event::Saved`].
    Save,
    /// Remove local segments wholly below `horizon` (and below every reader's hold); answer
    /// [`Event::Removed`].
    Remove {
        /// The removal horizon, from persisted state.
        horizon: Lsn,
    },
    /// Segment `segno` is below the local WAL and not in the store: it cannot be backed up
    /// from here (logged, counted; the store is listed again later).
    Missing {
        /// The segment.
        segno: u64,
    },
    /// Upload the WAL of segment `segno` below `upto` (mid-segment, committed and durable
    /// here) as a partial object; its bytes before `valid_from` are not this node's WAL. Answer
    /// [`Event::UploadedPartial`].
    UploadPartial {
        /// The segment.
        segno: u64,
        /// End of the WAL uploaded.
        upto: Lsn,
        /// Offset of this node's first WAL byte in it (0 but for the first segment).
        valid_from: usize,
    },
    /// Remove this timeline's partial objects whose WAL ends below `below` (superseded by a
    /// longer partial object or by complete segments). Answer [`Event::RemovedPartials`].
    RemovePartials {
        /// Objects ending below this go.
        below: Lsn,
    },
    /// Evict the timeline, whose WAL ends at `end` (all of it committed, durable and in the
    /// store); answer [`Event::Evicted`].
    Evict {
        /// The end of WAL the decision saw (the node refuses if it moved).
        end: Lsn,
    },
    /// Abort every action in flight and answer [`Event::Stopped`] once they have ended.
    Stop,
    /// The manager is done: nothing is in flight and nothing more will be asked.
    Finished,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Listing {
    /// To list at or after this time.
    Due(Duration),
    InFlight,
    Done,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Running,
    Stopping,
    Finished,
}

/// The decisions of one timeline's manager.
#[derive(Debug)]
pub struct ManagerCore {
    cfg: Config,
    now: Duration,
    obs: Observed,
    /// Every local segment below this was removed.
    first_local: u64,
    listing: Listing,
    list_backoff: Duration,
    /// The store's segments, as last listed (plus what was uploaded since).
    stored: BTreeSet<u64>,
    uploading: BTreeSet<u64>,
    /// Uploaded segments above the contiguous backed-up prefix.
    uploaded: BTreeSet<u64>,
    /// Failed uploads: when to retry, and the delay after the next failure.
    retry: BTreeMap<u64, (Duration, Duration)>,
    /// Missing segments already reported.
    missing: BTreeSet<u64>,
    saving: bool,
    /// A failed save is tried again from then on, and the delay after the next failure.
    save_retry: (Duration, Duration),
    /// The horizon of the removal in flight.
    removing: Option<Lsn>,
    /// A removal that readers' holds cut short is tried again from then on.
    remove_again_at: Duration,
    last_save: Duration,
    partial: Partial,
    /// Since when nothing moved and nothing was connected.
    idle_since: Duration,
    /// An eviction is in flight.
    evicting: bool,
    phase: Phase,
}

impl Partial {
    /// Whether a listing may find objects to remove: something of this node's may be left (its
    /// longest object, until the complete segments pass it), or an earlier run's objects were
    /// not swept yet (once the WAL moves). Not at every complete segment.
    fn superseded_may_be_left(&self) -> bool {
        (self.stored.is_valid() && self.stored >= self.removed_below) || (self.moved && !self.swept)
    }
}

/// Partial-segment backup's state (in memory: after a restart the partial object is uploaded
/// again, which finds an identical one stored or stores a longer one).
#[derive(Debug)]
struct Partial {
    /// End of the longest partial object this node stored.
    stored: Lsn,
    /// The upload in flight, by its end.
    uploading: Option<Lsn>,
    /// Since when committed WAL that no stored object holds has waited (reset by every complete
    /// segment backed up).
    waiting_since: Option<Duration>,
    /// The complete-segment backup LSN last seen (a change resets the wait).
    backup_lsn: Lsn,
    /// A failed upload is retried from then on.
    retry_at: Duration,
    backoff: Duration,
    /// A removal of superseded objects is in flight.
    removing: bool,
    /// Partial objects ending below this were removed.
    removed_below: Lsn,
    /// A failed removal is retried from then on, and the delay after the next failure.
    remove_retry_at: Duration,
    remove_backoff: Duration,
    /// Whether objects of an earlier run (unknown to `stored`) were removed once: done after
    /// the timeline first backs up a new complete segment (an idle timeline's newest object
    /// stays).
    swept: bool,
    /// A complete segment was backed up since the manager started.
    moved: bool,
}

impl ManagerCore {
    /// A manager for a timeline whose local segments below `first_local` are gone (read from
    /// its directory at open), in state `obs`.
    pub fn new(cfg: Config, obs: Observed, first_local: u64) -> ManagerCore {
        ManagerCore {
            cfg,
            now: Duration::ZERO,
            obs,
            first_local,
            listing: Listing::Due(Duration::ZERO),
            list_backoff: FIRST_BACKOFF,
            stored: BTreeSet::new(),
            uploading: BTreeSet::new(),
            uploaded: BTreeSet::new(),
            retry: BTreeMap::new(),
            missing: BTreeSet::new(),
            saving: false,
            save_retry: (Duration::ZERO, FIRST_BACKOFF),
            removing: None,
            remove_again_at: Duration::ZERO,
            last_save: Duration::ZERO,
            partial: Partial {
                stored: Lsn::INVALID,
                uploading: None,
                waiting_since: None,
                backup_lsn: obs.inmem.backup_lsn,
                retry_at: Duration::ZERO,
                backoff: FIRST_BACKOFF,
                removing: false,
                removed_below: Lsn::INVALID,
                remove_retry_at: Duration::ZERO,
                remove_backoff: FIRST_BACKOFF,
                swept: false,
                moved: false,
            },
            idle_since: Duration::ZERO,
            evicting: false,
            phase: Phase::Running,
        }
    }

    /// Takes `event` and returns what to do now.
    pub fn step(&mut self, event: Event) -> Vec<Action> {
        let mut out = Vec::new();
        match event {
            Event::Observed(o) => {
                if o.busy
                    || o.flush_lsn != self.obs.flush_lsn
                    || o.inmem.commit_lsn != self.obs.inmem.commit_lsn
                {
                    self.idle_since = self.now;
                }
                self.obs = o;
            }
            Event::Tick(now) => self.now = self.now.max(now),
            Event::Listed(Some(set)) => {
                self.listing = Listing::Done;
                self.list_backoff = FIRST_BACKOFF;
                self.stored.extend(set);
                self.missing.clear();
            }
            Event::Listed(None) => {
                self.listing = Listing::Due(self.now + self.list_backoff);
                self.list_backoff = (self.list_backoff * 2).min(MAX_BACKOFF);
            }
            Event::Uploaded { segno, ok } => {
                self.uploading.remove(&segno);
                if ok {
                    self.retry.remove(&segno);
                    self.uploaded.insert(segno);
                    self.stored.insert(segno);
                } else {
                    let delay = self.retry.get(&segno).map_or(FIRST_BACKOFF, |r| r.1);
                    self.retry
                        .insert(segno, (self.now + delay, (delay * 2).min(MAX_BACKOFF)));
                }
            }
            Event::Saved { ok } => {
                self.saving = false;
                if ok {
                    self.last_save = self.now;
                    self.save_retry = (Duration::ZERO, FIRST_BACKOFF);
                } else {
                    // A file system that refuses the save (gone, full, read-only) is not asked
                    // again at once: that was a busy loop of errors.
                    let delay = self.save_retry.1;
                    self.save_retry = (self.now + delay, (delay * 2).min(MAX_BACKOFF));
                }
            }
            Event::Removed { first_local } => {
                self.first_local = self.first_local.max(first_local);
                if let Some(h) = self.removing.take()
                    && self.first_local < h.segment_number(self.cfg.seg_size)
                {
                    // A reader holds WAL below the horizon (or the removal failed): later.
                    self.remove_again_at = self.now + REMOVE_AGAIN_AFTER;
                }
            }
            Event::UploadedPartial { upto, ok } => {
                self.partial.uploading = None;
                if ok {
                    self.partial.stored = self.partial.stored.max(upto);
                    self.partial.waiting_since = None;
                    self.partial.backoff = FIRST_BACKOFF;
                } else {
                    self.partial.retry_at = self.now + self.partial.backoff;
                    self.partial.backoff = (self.partial.backoff * 2).min(MAX_BACKOFF);
                }
            }
            Event::RemovedPartials { below, ok } => {
                let p = &mut self.partial;
                p.removing = false;
                if ok {
                    p.removed_below = p.removed_below.max(below);
                    p.remove_backoff = FIRST_BACKOFF;
                    p.swept = true;
                } else {
                    p.remove_retry_at = self.now + p.remove_backoff;
                    p.remove_backoff = (p.remove_backoff * 2).min(MAX_BACKOFF);
                }
            }
            Event::Evicted { ok } => {
                self.evicting = false;
                if ok && self.phase == Phase::Running {
                    self.phase = Phase::Finished;
                    out.push(Action::Finished);
                    return out;
                }
                // Refused (a connection came, the WAL moved) or failed: idle again from now.
                self.idle_since = self.now;
            }
            Event::Deleted => {
                if self.phase == Phase::Running {
                    self.phase = Phase::Stopping;
                    out.push(Action::Stop);
                }
                return out;
            }
            Event::Stopped => {
                if self.phase == Phase::Stopping {
                    self.phase = Phase::Finished;
                    out.push(Action::Finished);
                }
                return out;
            }
        }
        if self.phase == Phase::Running {
            self.decide(&mut out);
        }
        out
    }

    /// When the core next wants a [`Event::Tick`] (a retry, a listing or a save coming due);
    /// `None`: only a change of the timeline's state can give it work.
    pub fn next_wakeup(&self) -> Option<Duration> {
        if self.phase != Phase::Running {
            return None;
        }
        let mut at: Option<Duration> = None;
        let mut consider = |t: Duration| at = Some(at.map_or(t, |a| a.min(t)));
        if self.cfg.remote
            && let Listing::Due(t) = self.listing
        {
            consider(t);
        }
        for (segno, (t, _)) in &self.retry {
            if !self.uploading.contains(segno) {
                consider(*t);
            }
        }
        if self.removing.is_none() && self.remove_again_at > self.now {
            consider(self.remove_again_at);
        }
        if let Some(at) = self.save_at() {
            consider(at);
        }
        if let (Some(timeout), Some(since), None) = (
            self.cfg.partial_timeout,
            self.partial.waiting_since,
            self.partial.uploading,
        ) && self.cfg.remote
        {
            consider((since + timeout).max(self.partial.retry_at));
        }
        let p = &self.partial;
        if self.cfg.remote
            && !p.removing
            && p.remove_retry_at > self.now
            && p.superseded_may_be_left()
        {
            consider(p.remove_retry_at);
        }
        if let Some(after) = self.cfg.evict_after
            && self.cfg.remote
            && !self.evicting
        {
            consider(self.idle_since + after);
        }
        at
    }

    /// Every local segment below this was removed.
    pub fn first_local(&self) -> u64 {
        self.first_local
    }

    /// The horizon removal may go to now: from the persisted state.
    pub fn removal_horizon(&self) -> Lsn {
        self.horizon_of(&self.obs.persisted)
    }

    fn horizon_of(&self, l: &Lsns) -> Lsn {
        horizon_of(
            l,
            self.obs.flush_lsn,
            self.cfg.remote,
            self.cfg.wal_keep_size,
        )
    }

    /// When the control file is to be saved, if it is: when due, at once when the commit ran a
    /// segment ahead (as `maybe_persist_inmem`) or the in-memory state would let removal go
    /// further than the saved one; never before a failed save's backoff has passed.
    fn save_at(&self) -> Option<Duration> {
        if self.saving || self.obs.inmem == self.obs.persisted {
            return None;
        }
        let seg = self.cfg.seg_size;
        let saved_horizon = self.horizon_of(&self.obs.persisted);
        let inmem_horizon = self.horizon_of(&self.obs.inmem);
        let removal_waits = inmem_horizon.is_valid()
            && inmem_horizon.segment_number(seg)
                > saved_horizon.segment_number(seg).max(self.first_local);
        let commit_ahead =
            self.obs.inmem.commit_lsn.0 >= self.obs.persisted.commit_lsn.0.saturating_add(seg);
        let at = if commit_ahead || removal_waits {
            self.now
        } else {
            self.last_save + self.cfg.save_interval
        };
        Some(at.max(self.save_retry.0))
    }

    fn decide(&mut self, out: &mut Vec<Action>) {
        let seg = self.cfg.seg_size;
        // Removal, from the persisted state only.
        let persisted = self.horizon_of(&self.obs.persisted);
        if self.removing.is_none()
            && self.now >= self.remove_again_at
            && persisted.is_valid()
            && persisted.segment_number(seg) > self.first_local
        {
            self.removing = Some(persisted);
            out.push(Action::Remove { horizon: persisted });
        }
        if self.save_at().is_some_and(|at| self.now >= at) {
            self.saving = true;
            out.push(Action::Save);
        }
        if self.cfg.remote {
            self.backup(out);
            self.partial_backup(out);
            self.eviction(out);
        }
    }

    /// Eviction (see the module docs).
    fn eviction(&mut self, out: &mut Vec<Action>) {
        let Some(after) = self.cfg.evict_after else {
            return;
        };
        if self.evicting || self.now < self.idle_since + after || !out.is_empty() {
            return;
        }
        if let Some(end) = self.evictable_end() {
            self.evicting = true;
            out.push(Action::Evict { end });
        }
    }

    /// The end of WAL if all of the timeline's WAL is saved and in the store at it, with
    /// nothing in flight.
    fn evictable_end(&self) -> Option<Lsn> {
        let seg = self.cfg.seg_size;
        let o = &self.obs;
        let p = &self.partial;
        let quiet = self.listing == Listing::Done
            && self.uploading.is_empty()
            && !self.saving
            && self.removing.is_none()
            && p.uploading.is_none()
            && !p.removing
            && !o.busy;
        let end = o.flush_lsn;
        if !quiet || o.inmem != o.persisted || o.persisted.commit_lsn != end {
            return None;
        }
        let start = o.wal_start_lsn;
        if end.is_valid() && start.is_valid() && end > start {
            // Complete segments of this node's WAL below the end's segment are backed up.
            let backed = o.persisted.backup_lsn.segment_number(seg);
            if backed.max(start.segment_number(seg)) < end.segment_number(seg) {
                return None;
            }
        }
        // The end's segment is stored up to the end (unless nothing of it is this node's WAL).
        if crate::evicted::needs_partial_object(end, start, seg) && p.stored < end {
            return None;
        }
        Some(end)
    }

    /// Partial-segment backup (see the module docs).
    fn partial_backup(&mut self, out: &mut Vec<Action>) {
        let seg = self.cfg.seg_size;
        let Some(timeout) = self.cfg.partial_timeout else {
            return;
        };
        if self.listing != Listing::Done {
            return;
        }
        let backed = self.obs.inmem.backup_lsn;
        if backed != self.partial.backup_lsn {
            // A new complete segment: the WAL is moving, what waited is (mostly) stored.
            self.partial.backup_lsn = backed;
            self.partial.waiting_since = None;
            self.partial.moved = true;
        }
        let p = &mut self.partial;
        // Superseded objects: below the complete segments, and below this node's longest one
        // when every complete segment before its segment is stored (else a partial object of
        // such a segment, another node's too, is its only copy in the store).
        let below = if p.stored.is_valid() && backed >= p.stored.segment_start(seg) {
            p.stored.max(backed)
        } else {
            backed
        };
        if p.superseded_may_be_left()
            && !p.removing
            && below > p.removed_below
            && self.now >= p.remove_retry_at
        {
            p.removing = true;
            out.push(Action::RemovePartials { below });
        }
        let start = self.obs.wal_start_lsn;
        let upto = self.obs.inmem.commit_lsn.min(self.obs.flush_lsn);
        let segno = upto.segment_number(seg);
        let waiting = start.is_valid()
            && upto > start
            && upto.segment_offset(seg) != 0
            && upto > p.stored.max(backed);
        if !waiting {
            p.waiting_since = None;
            return;
        }
        let since = *p.waiting_since.get_or_insert(self.now);
        if p.uploading.is_none() && self.now >= since + timeout && self.now >= p.retry_at {
            p.uploading = Some(upto);
            out.push(Action::UploadPartial {
                segno,
                upto,
                valid_from: if segno == start.segment_number(seg) {
                    start.segment_offset(seg) as usize
                } else {
                    0
                },
            });
        }
    }

    fn backup(&mut self, out: &mut Vec<Action>) {
        let seg = self.cfg.seg_size;
        match self.listing {
            Listing::Due(t) if self.now >= t => {
                self.listing = Listing::InFlight;
                out.push(Action::List);
                return;
            }
            Listing::Done => {}
            _ => return,
        }
        let start = self.obs.wal_start_lsn;
        if !start.is_valid() {
            return;
        }
        let start_seg = start.segment_number(seg);
        // Complete committed segments are below this one.
        let end = self.obs.inmem.commit_lsn.segment_number(seg);
        let backed = self.obs.inmem.backup_lsn;
        let mut next = backed.segment_number(seg).max(start_seg);
        if backed < Lsn(start_seg * seg) && start_seg < end {
            // Nothing below this node's first segment is owed (else the lag would count the
            // whole LSN space below the timeline start).
            out.push(Action::SetBackupLsn(Lsn(next * seg)));
        }
        // The contiguous backed-up prefix: uploaded here, or (below the local WAL) listed.
        let first = next;
        while next < end
            && (self.uploaded.contains(&next)
                || (next < self.first_local && self.stored.contains(&next)))
        {
            self.uploaded.remove(&next);
            next += 1;
        }
        if next > first {
            out.push(Action::SetBackupLsn(Lsn(next * seg)));
        }
        for segno in next..end {
            if self.uploading.len() >= self.cfg.parallelism {
                break;
            }
            if self.uploading.contains(&segno) || self.uploaded.contains(&segno) {
                continue;
            }
            if self.retry.get(&segno).is_some_and(|r| self.now < r.0) {
                continue;
            }
            if segno < self.first_local {
                if self.stored.contains(&segno) {
                    continue;
                }
                // Removed locally before a restart and not in the store: nothing here can
                // back it up. Say so once, and look at the store again later.
                if self.missing.insert(segno) {
                    out.push(Action::Missing { segno });
                }
                if self.listing == Listing::Done {
                    self.listing = Listing::Due(self.now + RELIST_MISSING_AFTER);
                }
                break;
            }
            self.uploading.insert(segno);
            out.push(Action::Upload {
                segno,
                valid_from: if segno == start_seg {
                    start.segment_offset(seg) as usize
                } else {
                    0
                },
                known_stored: self.stored.contains(&segno),
            });
        }
    }
}

#[cfg(test)]
mod sim;
/// The removal horizon of a timeline whose lazily persisted LSNs are `l` (in memory or as
/// persisted: the caller chooses, see the module docs), with `flush` its end of WAL, `remote`
/// whether it is backed up, and `wal_keep_size` bytes kept below `flush`.
pub fn horizon_of(l: &Lsns, flush: Lsn, remote: bool, wal_keep_size: u64) -> Lsn {
    removal_horizon(&HorizonInputs {
        flush_lsn: flush,
        commit_lsn: l.commit_lsn,
        peer_horizon_lsn: l.peer_horizon_lsn,
        backup_lsn: remote.then_some(l.backup_lsn),
        oldest_reader: None,
        wal_keep_size,
    })
}

/// What a snapshot's start is chosen from (the donor's view at one moment).
#[derive(Clone, Copy, Debug)]
pub struct SnapshotInputs {
    /// WAL segment size.
    pub seg_size: u64,
    /// Where the donor's WAL begins (`max(local_start_lsn, timeline_start_lsn)`).
    pub wal_start: Lsn,
    /// The donor's first local segment's start (segments below were removed after backup).
    pub first_local: Lsn,
    /// The donor's durable end of WAL.
    pub flush: Lsn,
    /// How far removal could go by the donor's in-memory LSNs (backup, commit, the page below
    /// the peers' horizon; `--wal-keep-size` aside); invalid without remote storage.
    pub horizon: Lsn,
    /// Whether both donor and puller have remote storage (the puller then serves WAL below the
    /// snapshot's start from the store).
    pub remote: bool,
}

/// Where a snapshot starts (issue 26, defect 3). With remote storage on both sides it starts at
/// the backed-up point (the removal horizon's segment start, never below the donor's first
/// local segment): the WAL below it is in the store, which the puller serves it from, and what
/// a peer or a new proposer may still read from this node (the commit LSN, the page below the
/// peers' horizon) is above it. Without, it starts at the donor's first WAL, which must all be
/// local: a donor that removed WAL can only be pulled onto a node with remote storage.
pub fn snapshot_start(i: &SnapshotInputs) -> Result<Lsn, String> {
    let start = i.wal_start.min(i.flush);
    if i.remote {
        let backed = if i.horizon.is_valid() {
            i.horizon.segment_start(i.seg_size)
        } else {
            Lsn::INVALID
        };
        return Ok(start.max(backed).max(i.first_local).min(i.flush));
    }
    if i.first_local > start {
        return Err(format!(
            "WAL below {} lives only in remote storage: pull onto a safekeeper with \
             --remote-storage (the same store), which serves it from there",
            i.first_local
        ));
    }
    Ok(start)
}

/// What a `DELETE` of a timeline removes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeleteScope {
    /// The timeline everywhere: this node's copy and, with remote storage, its objects in the
    /// store (shared by every member).
    Everywhere,
    /// This node's copy only (`?only_local=true`): retiring a node after a replacement.
    OnlyLocal,
}

/// Whether a `DELETE` of a timeline on this node also deletes its objects in the store. They
/// are one copy shared by every member, and with `--wal-keep-size` below the WAL's size they are
/// the only copy of its early WAL: a node that the timeline's membership configuration no
/// longer counts as a member (node 2 after "replace 2 by 4") must leave them to the members,
/// so such a delete is refused unless it asks for this node's copy only. `mconf` is the
/// timeline's configuration as this node persisted it (`None`: this node does not have the
/// timeline, nothing to judge it by). Returns whether the store's objects go too.
pub fn deletes_remote_objects(
    scope: DeleteScope,
    remote: bool,
    mconf: Option<&sk_core::state::Configuration>,
    node: sk_core::types::NodeId,
) -> Result<bool, String> {
    if scope == DeleteScope::OnlyLocal || !remote {
        return Ok(false);
    }
    if let Some(c) = mconf
        && c.generation.0 > 0
        && !c.contains(node)
    {
        let ids: Vec<String> = c
            .members
            .iter()
            .chain(c.new_members.iter().flatten())
            .map(|m| m.id.0.to_string())
            .collect();
        return Err(format!(
            "node {node} is not a member of the timeline's generation {} (members {}): its \
             objects in remote storage belong to them; delete this node's copy only with \
             ?only_local=true",
            c.generation,
            ids.join(", ")
        ));
    }
    Ok(true)
}

/// Whether the peers that answered a pull's status requests can tell the newest copy: a
/// majority of the timeline's members (of each half of a joint configuration) for a timeline
/// with a membership configuration, else a majority of the hosts asked.
pub fn pull_quorum(
    answered: &[sk_core::types::NodeId],
    mconf: &sk_core::state::Configuration,
    hosts: usize,
) -> Result<(), String> {
    if mconf.generation.0 == 0 {
        let need = hosts / 2 + 1;
        if answered.len() < need {
            return Err(format!(
                "only {} of {hosts} peers answered (a majority, {need}, is needed to know the \
                 newest copy)",
                answered.len()
            ));
        }
        return Ok(());
    }
    let halves = std::iter::once(&mconf.members).chain(mconf.new_members.as_ref());
    for half in halves {
        let need = half.len() / 2 + 1;
        let got = half.iter().filter(|m| answered.contains(&m.id)).count();
        if got < need {
            let ids: Vec<String> = half.iter().map(|m| m.id.0.to_string()).collect();
            return Err(format!(
                "only {got} of the members [{}] of generation {} answered (a majority, {need}, \
                 is needed to know the newest copy)",
                ids.join(", "),
                mconf.generation
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
