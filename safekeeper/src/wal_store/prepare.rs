//! Background segment preparation: when WAL arrives slowly, the next segment is written full of
//! zeros and fsynced off the ingest path (under [`PREPARED_SEGMENT_NAME`]), and the next segment
//! switch renames it in instead of creating a sparse file. Appends into it then allocate no
//! blocks, so their `fdatasync` commits no file-system metadata (see
//! [`super::WalFileOptions::prepare_below_rate`] for when it pays off).
//!
//! The clock that measures the fill rate and the thread that does the work are injected through
//! [`Runner`]: [`Threads`] (the real clock, one thread per preparation) in production,
//! [`Inline`] (a clock the caller moves, preparations run at once on the caller's thread) where
//! a test or a simulation must decide when time passes, run the preparation synchronously, and
//! crash it at any of its file-system calls.
//!
//! Not here: creating a segment on the ingest path ([`super::segment`]), choosing the rate
//! threshold (the timeline, `PREPARE_SEGMENTS_BELOW_RATE`).

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sk_core::storage::durable::durable_rename;
use sk_core::storage::fs::{Fs, OpenMode};
use sk_core::storage::{Error, Result};

use super::segment::{SegmentFile, Zeros, segment_path, write_blank_segment};

/// Name of a zero-filled segment prepared in the background (see
/// [`super::WalFileOptions::prepare_below_rate`]).
pub const PREPARED_SEGMENT_NAME: &str = "walprep";

/// How long a background preparation rests after each piece it wrote back: a 16 MiB segment
/// then takes ~0.3 s more to prepare (its stream fills one in a second or more, or it is not
/// prepared), and the commits of the same disk find at most one 64 KiB piece ahead of their
/// `fdatasync` in the queue. Commit-tail (6000 commits of 8 KiB) through one safekeeper, six
/// rounds alternating with the unpaced build: max 2.9–9.3 ms against 32–49 ms, p99.9
/// 2.4–2.9 ms against 3.6–6.5 ms, mean 0.92–1.10x (the raw disk's own max 1.5–11 ms in the
/// same rounds).
const PREPARATION_WRITE_BACK_PAUSE: Duration = Duration::from_millis(1);

/// A segment preparation, ready to run.
pub type Job = Box<dyn FnOnce() -> Result<()> + Send>;

/// Where preparations run and what time it is.
pub trait Runner: fmt::Debug + Send + Sync {
    /// Now, to measure how fast a segment filled.
    fn now(&self) -> Instant;
    /// How long a preparation rests after writing back each piece of its segment
    /// ([`Zeros::Paced`]): none by default (a caller's thread, a simulation).
    fn write_back_pause(&self) -> Duration {
        Duration::ZERO
    }
    /// Starts `job`. `None` if it could not be started (then nothing is prepared).
    fn spawn(&self, job: Job) -> Option<Task>;
}

/// A preparation started by a [`Runner`].
#[derive(Debug)]
pub enum Task {
    /// Running (or done) on a thread of its own.
    Thread(JoinHandle<Result<()>>),
    /// Already run, with this outcome.
    Done(Result<()>),
}

impl Task {
    pub(super) fn is_finished(&self) -> bool {
        match self {
            Task::Thread(h) => h.is_finished(),
            Task::Done(_) => true,
        }
    }

    /// Waits until it has finished, leaving its outcome to [`Task::join`] (tests).
    #[cfg(test)]
    pub(super) fn wait_finished(&self) {
        while !self.is_finished() {
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Waits for the outcome; `None` if the job panicked.
    pub(super) fn join(self) -> Option<Result<()>> {
        match self {
            Task::Thread(h) => h.join().ok(),
            Task::Done(r) => Some(r),
        }
    }
}

/// The real clock, and a named thread per preparation.
#[derive(Debug, Default)]
pub struct Threads;

impl Runner for Threads {
    fn now(&self) -> Instant {
        Instant::now()
    }

    fn write_back_pause(&self) -> Duration {
        PREPARATION_WRITE_BACK_PAUSE
    }

    fn spawn(&self, job: Job) -> Option<Task> {
        // A failed spawn only means no preparation.
        std::thread::Builder::new()
            .name("wal-segment-prep".into())
            .spawn(job)
            .ok()
            .map(Task::Thread)
    }
}

/// Runs every preparation at once, on the caller's thread, on a clock that moves only when
/// [`Inline::advance`] is called.
#[derive(Debug)]
pub struct Inline {
    now: Mutex<Instant>,
}

impl Inline {
    /// A runner whose clock starts now.
    pub fn new() -> Arc<Inline> {
        Arc::new(Inline {
            now: Mutex::new(Instant::now()),
        })
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        *self.now.lock().unwrap_or_else(|e| e.into_inner()) += by;
    }
}

impl Runner for Inline {
    fn now(&self) -> Instant {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn spawn(&self, job: Job) -> Option<Task> {
        Some(Task::Done(job()))
    }
}

/// The [`Runner`] of a store ([`Threads`] by default).
#[derive(Clone)]
pub struct Background(Arc<dyn Runner>);

impl Background {
    /// Preparations on `runner`.
    pub fn new(runner: Arc<dyn Runner>) -> Background {
        Background(runner)
    }

    /// The runner itself.
    pub(super) fn runner(&self) -> &dyn Runner {
        &*self.0
    }
}

impl Default for Background {
    fn default() -> Background {
        Background(Arc::new(Threads))
    }
}

impl fmt::Debug for Background {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The preparation state of one store.
///
/// Invariant: at most one preparation exists, and it writes only [`PREPARED_SEGMENT_NAME`] in
/// `dir`; it is waited for before the state is dropped, so no preparation outlives its store.
#[derive(Debug)]
pub(super) struct Preparer {
    fs: Fs,
    dir: PathBuf,
    seg_size: u64,
    no_sync: bool,
    /// Prepare when WAL arrives slower than this many bytes per second (0: never).
    below_rate: u64,
    background: Background,
    /// The preparation started and not yet used.
    task: Option<Task>,
    /// The segment being written and when it was opened (its fill rate decides whether the
    /// next one is prepared).
    opened_at: Option<(u64, Instant)>,
    /// The node's pool of zero-filled segments.
    pool: Option<super::SegmentPool>,
}

impl Preparer {
    pub(super) fn new(dir: &Path, seg_size: u64, opts: &super::WalFileOptions) -> Preparer {
        Preparer {
            fs: opts.fs.clone(),
            dir: dir.to_path_buf(),
            seg_size,
            no_sync: opts.no_sync,
            below_rate: opts.prepare_below_rate,
            background: opts.background.clone(),
            task: None,
            opened_at: None,
            pool: opts.pool.clone(),
        }
    }

    /// Segment `segno` was just opened: if the previous segment filled slower than the rate
    /// threshold, starts preparing the next one (unless the node's pool has one ready: its
    /// zeros were written while the disk was quiet, this preparation's would be written under
    /// the commits of this very stream). Never under `no_sync`: written blocks only spare an
    /// `fdatasync` its metadata, and without one the zeros would only double what is written.
    pub(super) fn segment_opened(&mut self, segno: u64) {
        let now = self.background.0.now();
        let slow = self.opened_at.is_some_and(|(prev, at)| {
            let elapsed = now.duration_since(at).as_secs_f64();
            prev + 1 == segno && (self.seg_size as f64) < self.below_rate as f64 * elapsed
        });
        self.opened_at = Some((segno, now));
        let pooled = self
            .pool
            .as_ref()
            .is_some_and(|p| p.ready_for(self.seg_size));
        if slow && self.task.is_none() && !pooled && !self.no_sync {
            let fs = self.fs.clone();
            let path = self.dir.join(PREPARED_SEGMENT_NAME);
            let seg_size = self.seg_size;
            let zeros = Zeros::Paced(self.background.0.write_back_pause());
            self.task = self.background.0.spawn(Box::new(move || {
                write_blank_segment(&fs, &path, seg_size, Some(zeros), false).map(drop)
            }));
        }
    }

    /// The prepared segment renamed (durably) to segment `segno`'s `.partial` name, if its
    /// preparation has finished, else one of the node's pool if it has one; never waits for
    /// either.
    pub(super) fn take(&mut self, segno: u64) -> Result<Option<(SegmentFile, PathBuf)>> {
        let path = segment_path(&self.dir, segno, self.seg_size, true);
        if self.take_own(&path)? {
            let file = self
                .fs
                .open(&path, OpenMode::ReadWrite)
                .map_err(|e| Error::io(format!("opening {}", path.display()), e))?;
            return Ok(Some((file, path)));
        }
        let pooled = self
            .pool
            .as_ref()
            .and_then(|p| p.take(&path, &self.dir, self.seg_size));
        Ok(pooled.map(|file| (file, path)))
    }

    /// Renames this store's own prepared segment to `path` (durably) if its preparation has
    /// finished well; whether it did.
    fn take_own(&mut self, path: &Path) -> Result<bool> {
        let Some(task) = self.task.take_if(|t| t.is_finished()) else {
            return Ok(false);
        };
        let prep = self.dir.join(PREPARED_SEGMENT_NAME);
        match task.join() {
            Some(Ok(())) => {}
            Some(Err(e)) => {
                tracing::warn!(dir = %self.dir.display(), error = %e, "preparing a WAL segment failed");
                let _ = self.fs.remove_file(&prep);
                return Ok(false);
            }
            None => return Ok(false),
        }
        // The prepared file is durable at full size; its new name is made durable before any
        // WAL goes into it, as for a created segment.
        durable_rename(&self.fs, &prep, path, &self.dir, self.no_sync)?;
        Ok(true)
    }

    /// Stops preparing: waits for a preparation in flight and removes what it made (an
    /// evicted timeline keeps no segment file).
    pub(super) fn stop(&mut self) -> Result<()> {
        if let Some(t) = self.task.take() {
            let _ = t.join();
        }
        let prep = self.dir.join(PREPARED_SEGMENT_NAME);
        if self.fs.exists(&prep) {
            self.fs
                .remove_file(&prep)
                .map_err(|e| Error::io(format!("removing {}", prep.display()), e))?;
        }
        self.opened_at = None;
        Ok(())
    }

    /// Waits until a segment being prepared is ready (tests make the threads deterministic with
    /// it).
    #[cfg(test)]
    pub(super) fn wait(&self) {
        if let Some(t) = &self.task {
            t.wait_finished();
        }
    }
}

impl Drop for Preparer {
    fn drop(&mut self) {
        // No thread may write into this directory after the store is gone (a reopened store
        // removes leftovers at start-up).
        if let Some(t) = self.task.take() {
            let _ = t.join();
        }
    }
}
