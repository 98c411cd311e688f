//! A cap on the segment files held open, shared by the WAL stores of every timeline: an LRU of
//! open `.partial` segments. Each store keeps its segment open in a [`Slot`] registered here;
//! when a store opens a file and more than `cap` are open, the least recently used files of
//! other stores are closed, and their stores open them again on their next write.
//!
//! Durability: an evicted file with writes no fsync has covered yet is `fdatasync`ed (through
//! [`fsync_or_abort`]) before it is closed. A store's WAL is therefore never less durable for
//! having been evicted, and a write-back error can never be lost with the descriptor that would
//! have reported it (Linux reports it only to descriptors open when it happened: the
//! PostgreSQL "fsyncgate" lesson). Readers are unaffected: walsenders open their own
//! descriptors ([`super::WalReader`]).
//!
//! Locking: the LRU lock is held only to update or pick entries, never while a slot is locked
//! by the same thread for eviction, and a store never holds its own slot while it evicts
//! others; so no two threads wait on each other's slots.
//!
//! Not here: what a store writes or when it fsyncs ([`super::WalFileStore`]), readers' and
//! recovery's short-lived descriptors.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use sk_core::storage::durable::fsync_or_abort;
use sk_core::storage::fs::SyncKind;

use super::segment::SegmentFile;

/// Default of `--max-open-segment-files`: half a default `ulimit -n` of 1024, leaving the rest
/// to connections, readers and start-up.
pub const DEFAULT_MAX_OPEN_SEGMENT_FILES: usize = 512;

/// The segment file a store has open for writing.
#[derive(Debug)]
pub(super) struct OpenSegment {
    pub(super) segno: u64,
    pub(super) path: PathBuf,
    pub(super) file: SegmentFile,
    /// Written since the file's last fsync: eviction fsyncs it before closing it.
    pub(super) dirty: bool,
}

/// The LRU of open segment files, shared (cheap to clone) by every store of a node.
#[derive(Clone)]
pub struct OpenFiles(Arc<Shared>);

struct Shared {
    /// Invariant: >= 1.
    cap: usize,
    lru: Mutex<Lru>,
    evictions: AtomicU64,
    next_slot: AtomicU64,
}

/// Invariant: `order` and `entries` hold the same slots; `entries[id].tick` is `id`'s key in
/// `order`.
#[derive(Default)]
struct Lru {
    tick: u64,
    entries: HashMap<u64, Entry>,
    /// Last use -> slot id, least recent first.
    order: BTreeMap<u64, u64>,
}

struct Entry {
    tick: u64,
    /// Which opening of the slot's file this entry stands for (see [`SlotState::generation`]).
    generation: u64,
    slot: Arc<SlotInner>,
}

impl Lru {
    fn touch(&mut self, id: u64) {
        if let Some(e) = self.entries.get(&id)
            && e.tick == self.tick
        {
            // The most recently used already (a store appending alone): nothing moves.
            return;
        }
        self.tick += 1;
        let tick = self.tick;
        if let Some(e) = self.entries.get_mut(&id) {
            self.order.remove(&e.tick);
            e.tick = tick;
            self.order.insert(tick, id);
        }
    }

    fn remove(&mut self, id: u64, generation: u64) {
        if self
            .entries
            .get(&id)
            .is_some_and(|e| e.generation == generation)
            && let Some(e) = self.entries.remove(&id)
        {
            self.order.remove(&e.tick);
            crate::metrics::OPEN_SEGMENT_FILES.dec();
        }
    }
}

impl OpenFiles {
    /// An LRU that keeps at most `cap` segment files open (at least 1).
    pub fn new(cap: usize) -> OpenFiles {
        OpenFiles(Arc::new(Shared {
            cap: cap.max(1),
            lru: Mutex::new(Lru::default()),
            evictions: AtomicU64::new(0),
            next_slot: AtomicU64::new(0),
        }))
    }

    /// The cap.
    pub fn cap(&self) -> usize {
        self.0.cap
    }

    /// Segment files open now.
    pub fn open(&self) -> usize {
        self.lru().entries.len()
    }

    /// Files closed to make room for others so far.
    pub fn evictions(&self) -> u64 {
        self.0.evictions.load(Ordering::Relaxed)
    }

    fn lru(&self) -> MutexGuard<'_, Lru> {
        self.0.lru.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A slot for one store's open segment.
    pub(super) fn slot(&self, no_sync: bool) -> Slot {
        Slot {
            id: self.0.next_slot.fetch_add(1, Ordering::Relaxed),
            inner: Arc::new(SlotInner {
                no_sync,
                state: Mutex::new(SlotState::default()),
            }),
            files: self.clone(),
        }
    }

    /// Closes `victim`'s file if it still holds the opening `generation`, fsyncing it first if
    /// it has unsynced writes.
    fn evict(&self, victim: &SlotInner, generation: u64) {
        let mut state = victim.lock();
        if state.generation != generation {
            return;
        }
        if let Some(seg) = state.seg.take() {
            // Nothing written to the file is lost with its descriptor: durable before it closes.
            if seg.dirty && !victim.no_sync {
                fsync_or_abort(&*seg.file, &seg.path, SyncKind::Data);
            }
            drop(seg);
            self.0.evictions.fetch_add(1, Ordering::Relaxed);
            crate::metrics::SEGMENT_FILE_EVICTIONS.inc();
        }
    }
}

impl Default for OpenFiles {
    /// An LRU of [`DEFAULT_MAX_OPEN_SEGMENT_FILES`] files.
    fn default() -> OpenFiles {
        OpenFiles::new(DEFAULT_MAX_OPEN_SEGMENT_FILES)
    }
}

impl fmt::Debug for OpenFiles {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenFiles")
            .field("cap", &self.0.cap)
            .field("evictions", &self.evictions())
            .finish_non_exhaustive()
    }
}

#[derive(Default)]
struct SlotState {
    seg: Option<OpenSegment>,
    /// Counts the files put into the slot; an LRU entry names the one it stands for, so an
    /// eviction decided before the store replaced its file does not close the new one.
    generation: u64,
}

struct SlotInner {
    no_sync: bool,
    state: Mutex<SlotState>,
}

impl SlotInner {
    fn lock(&self) -> MutexGuard<'_, SlotState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// One store's place in the LRU: at most one open segment file. Dropping it closes the file.
pub(super) struct Slot {
    id: u64,
    inner: Arc<SlotInner>,
    files: OpenFiles,
}

impl Slot {
    /// Runs `f` on the open file if it is segment `segno` (marking it as just used); gives `f`
    /// back if the slot is empty (never opened, closed, or evicted). Another segment's file is
    /// closed unsynced: a store moves to another segment only after completing (and syncing)
    /// the previous one, or after a truncation. An eviction waits until `f` returns.
    pub(super) fn try_with<R, F: FnOnce(&mut OpenSegment) -> R>(
        &self,
        segno: u64,
        f: F,
    ) -> Result<R, F> {
        let mut state = self.inner.lock();
        match &mut state.seg {
            Some(seg) if seg.segno == segno => {
                self.files.lru().touch(self.id);
                Ok(f(seg))
            }
            Some(_) => {
                state.seg = None;
                self.files.lru().remove(self.id, state.generation);
                Err(f)
            }
            None => Err(f),
        }
    }

    /// Puts `seg` into the slot, then closes the least recently used files of other stores
    /// until at most the cap are open. (With as many stores opening files at once as the cap,
    /// `seg` itself may be evicted again before it is used: [`Slot::try_with`] then says so.)
    pub(super) fn install(&self, seg: OpenSegment) {
        let victims = {
            let mut state = self.inner.lock();
            state.seg = Some(seg);
            state.generation += 1;
            let mut lru = self.files.lru();
            if let Some(old) = lru.entries.remove(&self.id) {
                lru.order.remove(&old.tick);
                crate::metrics::OPEN_SEGMENT_FILES.dec();
            }
            lru.tick += 1;
            let tick = lru.tick;
            lru.entries.insert(
                self.id,
                Entry {
                    tick,
                    generation: state.generation,
                    slot: self.inner.clone(),
                },
            );
            lru.order.insert(tick, self.id);
            crate::metrics::OPEN_SEGMENT_FILES.inc();
            let mut victims = Vec::new();
            while lru.entries.len() > self.files.0.cap {
                let Some((_, id)) = lru.order.pop_first() else {
                    break;
                };
                let e = lru.entries.remove(&id).expect("order and entries agree");
                crate::metrics::OPEN_SEGMENT_FILES.dec();
                victims.push((e.slot, e.generation));
            }
            victims
            // Both locks are released here: an eviction takes another slot's lock.
        };
        for (victim, generation) in victims {
            self.files.evict(&victim, generation);
        }
    }

    /// Takes the open file out of the slot (closing it when dropped), unsynced.
    pub(super) fn take(&self) -> Option<OpenSegment> {
        let mut state = self.inner.lock();
        let seg = state.seg.take();
        if seg.is_some() {
            self.files.lru().remove(self.id, state.generation);
        }
        seg
    }

    /// Runs `f` on the open file, if any.
    pub(super) fn with_open<R>(&self, f: impl FnOnce(&mut OpenSegment) -> R) -> Option<R> {
        let mut state = self.inner.lock();
        state.seg.as_mut().map(f)
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        drop(self.take());
    }
}

impl fmt::Debug for Slot {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let state = self.inner.lock();
        f.debug_struct("Slot")
            .field("id", &self.id)
            .field("segment", &state.seg.as_ref().map(|s| s.segno))
            .finish()
    }
}
