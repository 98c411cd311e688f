//! A node's pool of prepared segments: whole segment files of real zeros, fsynced, kept in one
//! directory of the node and handed to any timeline's store when it needs a new segment. A
//! store that gets one writes its WAL over allocated blocks from the first byte, so neither its
//! commits' `fdatasync`s nor any zero-fill of its own (the [`super::fill`] helper, a
//! [`super::prepare`] preparation) touch the disk while the pool lasts.
//!
//! Why: zeros written while commits wait on the same disk are what the commit tail is made of
//! (commit-tail, one safekeeper, 6000 commits of 8 KiB, three rounds: p99 378-476 µs with the
//! background zero-fill against 233-269 µs with every segment zeroed before the stream; a
//! commit's `fdatasync` pays for whatever zeros were written back just before it). The pool
//! writes its zeros only while the node is quiet (no WAL flushed and no segment taken for
//! [`QUIET`], looked at before each [`CHUNK`]; a start counts as activity), so a burst of up to
//! `target` segments of WAL meets none. A stream that outlasts the pool falls back to the
//! per-timeline preparation. The pool stays under the file system's usage limit (the node's
//! `--max-disk-usage-ratio`, at most [`MAX_FS_RATIO`]) and gives its segments back when the
//! file system is past it.
//!
//! Segment size: the pool's follows the timelines'. It starts at the size the node gives it; a
//! timeline that asks for another size gets none this time, and the pool drops what it holds
//! and refills with segments of that size (all timelines of a deployment share one size).
//!
//! Crash safety: a segment is written under [`POOL_TMP_NAME`], fsynced, and renamed to its
//! final name (directory fsynced) before it is counted; start-up removes a leftover temporary
//! file, any file that is not a whole segment, and the pool's name of a file also linked
//! elsewhere. A taken segment is renamed into the timeline's directory (both directories
//! fsynced) before any WAL goes into it, as a prepared one.
//!
//! Not here: when a store asks for a segment ([`super::prepare::Preparer::take`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use sk_core::storage::durable::{durable_rename, fsync_dir, fsync_or_abort};
use sk_core::storage::fs::{Fs, OpenMode, SyncKind};
use sk_core::storage::{Error, Result};

use super::segment::{SegmentFile, Zeros, write_zeros};

/// The pool's directory, in the data directory.
pub const SEGMENT_POOL_DIR: &str = "segment_pool";
/// The pool's segment being written.
pub const POOL_TMP_NAME: &str = "prepared.tmp";
/// Prefix of a pooled segment's name (`prepared-<n>`).
const POOL_PREFIX: &str = "prepared-";
/// The node is quiet once no WAL was flushed (and no segment taken) for this long: the pool
/// writes only then.
pub const QUIET: Duration = Duration::from_secs(1);
/// The refill looks whether the node is still quiet before each this many bytes.
pub const CHUNK: u64 = 1 << 20;
/// How long the refill rests after each 64 KiB it wrote back, as a timeline's preparation.
const WRITE_BACK_PAUSE: Duration = Duration::from_millis(1);
/// How often the refill looks again whether it may write.
const POLL: Duration = Duration::from_millis(100);
/// The refill writes nothing that would take the data directory's file system past this
/// fraction (or the node's own `--max-disk-usage-ratio`, if lower): the space is the WAL's.
pub const MAX_FS_RATIO: f64 = 0.9;
/// How long the refill waits after a failure (a full disk) before trying again.
const RETRY_AFTER: Duration = Duration::from_secs(30);

/// The pool (cheap to clone): shared by every store of a node.
#[derive(Clone, Debug)]
pub struct SegmentPool(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    fs: Fs,
    dir: PathBuf,
    /// The size of the segments it keeps (the last size a timeline asked for).
    seg_size: AtomicU64,
    /// Segments the refill keeps ready.
    target: usize,
    /// Most used fraction of the file system the pool fills up to.
    max_ratio: f64,
    state: Mutex<State>,
    changed: Condvar,
    epoch: Instant,
    /// When WAL was last flushed (or a segment taken), in nanoseconds since `epoch` plus one;
    /// 0: never.
    last_flush: AtomicU64,
    /// Segments handed over so far.
    taken: AtomicU64,
}

#[derive(Debug)]
struct State {
    /// Whole, durable segments.
    ready: Vec<PathBuf>,
    next_name: u64,
}

impl SegmentPool {
    /// Opens (creating) the pool in `dir` for segments of `seg_size` bytes, keeps what a
    /// previous run left whole, and starts the thread that keeps `target` segments ready while
    /// the file system stays used below `max_ratio` (capped at [`MAX_FS_RATIO`]; 0: no limit of
    /// the node's own). The thread ends once the last clone of the pool is dropped. `fs` is the
    /// real file system: segments move across directories, which a simulated one does not
    /// model.
    pub fn start(
        fs: Fs,
        dir: &Path,
        seg_size: u64,
        target: usize,
        max_ratio: f64,
    ) -> Result<SegmentPool> {
        fs.create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        let mut ready = Vec::new();
        let mut next_name = 0;
        let names = fs
            .list_dir(dir)
            .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        for name in names {
            let path = dir.join(&name);
            let n = name
                .strip_prefix(POOL_PREFIX)
                .and_then(|n| n.parse::<u64>().ok());
            // The pool is on the real file system only (see above). A directory is not the
            // pool's and is left alone; a file also linked in a timeline's directory (a take
            // cut short by a crash) loses only the pool's name.
            let Ok(meta) = std::fs::symlink_metadata(&path) else {
                continue;
            };
            if !meta.is_file() {
                continue;
            }
            let own = std::os::unix::fs::MetadataExt::nlink(&meta) == 1;
            match n {
                Some(n) if own && meta.len() == seg_size => {
                    next_name = next_name.max(n + 1);
                    ready.push(path);
                }
                _ => {
                    fs.remove_file(&path)
                        .map_err(|e| Error::io(format!("removing {}", path.display()), e))?;
                }
            }
        }
        crate::metrics::PREPARED_SEGMENTS.set(ready.len() as i64);
        let pool = SegmentPool(Arc::new(Inner {
            fs,
            dir: dir.to_path_buf(),
            seg_size: AtomicU64::new(seg_size),
            target,
            max_ratio: if max_ratio > 0.0 {
                max_ratio.min(MAX_FS_RATIO)
            } else {
                MAX_FS_RATIO
            },
            state: Mutex::new(State { ready, next_name }),
            changed: Condvar::new(),
            epoch: Instant::now(),
            last_flush: AtomicU64::new(0),
            taken: AtomicU64::new(0),
        }));
        // A start is activity: timelines load and proposers reconnect first.
        pool.flushed();
        let weak = Arc::downgrade(&pool.0);
        std::thread::Builder::new()
            .name("wal-segment-pool".into())
            .spawn(move || refill(weak))
            .map_err(|e| Error::io("starting the segment pool's thread".to_string(), e))?;
        Ok(pool)
    }

    /// The size of the pool's segments.
    pub fn seg_size(&self) -> u64 {
        self.0.seg_size()
    }

    /// Segments ready now.
    pub fn ready(&self) -> usize {
        self.0.lock().ready.len()
    }

    /// Whether a segment of `seg_size` bytes is ready now.
    pub fn ready_for(&self, seg_size: u64) -> bool {
        seg_size == self.seg_size() && self.ready() > 0
    }

    /// Waits (at most 30 s, else panics) until `n` segments are ready (tests).
    #[cfg(test)]
    pub(super) fn wait_ready(&self, n: usize) {
        let start = Instant::now();
        while self.ready() < n {
            assert!(
                start.elapsed() < Duration::from_secs(30),
                "pool never filled"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Segments handed over so far.
    pub fn taken(&self) -> u64 {
        self.0.taken.load(Ordering::Relaxed)
    }

    /// WAL was just flushed somewhere on the node: the pool writes nothing for [`QUIET`].
    pub fn flushed(&self) {
        let at = self.0.epoch.elapsed().as_nanos() as u64 + 1;
        self.0.last_flush.store(at, Ordering::Relaxed);
    }

    /// Moves a ready segment to `to` (in directory `dir`), if one is ready and of `seg_size`
    /// bytes, and opens it for writing. `None` if none could be handed over (a failure is
    /// logged, and the caller creates its segment itself).
    pub fn take(&self, to: &Path, dir: &Path, seg_size: u64) -> Option<SegmentFile> {
        // A stream is starting or going on: the refill waits for the next quiet spell.
        self.flushed();
        if seg_size != self.seg_size() {
            self.0.resize(seg_size);
            return None;
        }
        let from = {
            let mut st = self.0.lock();
            let from = st.ready.pop()?;
            crate::metrics::PREPARED_SEGMENTS.set(st.ready.len() as i64);
            self.0.changed.notify_all();
            from
        };
        let fs = &self.0.fs;
        // Both directories are fsynced: the file has left the pool for good before any WAL
        // goes into it (on ext4 the rename is one journal transaction, which either commits).
        let moved = durable_rename(fs, &from, to, dir, false)
            .and_then(|()| fsync_dir(fs, &self.0.dir))
            .and_then(|()| {
                fs.open(to, OpenMode::ReadWrite)
                    .map_err(|e| Error::io(format!("opening {}", to.display()), e))
            });
        match moved {
            Ok(f) => {
                self.0.taken.fetch_add(1, Ordering::Relaxed);
                crate::metrics::PREPARED_SEGMENTS_USED.inc();
                Some(f)
            }
            Err(e) => {
                // A file still in the pool is counted again at the next start.
                tracing::warn!(error = %e, "taking a prepared segment failed; creating one instead");
                None
            }
        }
    }
}

/// Removes what a pool left in `dir`, for a node that keeps none now.
pub fn remove(fs: &Fs, dir: &Path) -> Result<()> {
    if fs.exists(dir) {
        fs.remove_dir_all(dir)
            .map_err(|e| Error::io(format!("removing {}", dir.display()), e))?;
    }
    Ok(())
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn seg_size(&self) -> u64 {
        self.seg_size.load(Ordering::Relaxed)
    }

    /// From now on keeps segments of `seg_size` bytes: those of the old size go.
    fn resize(&self, seg_size: u64) {
        let old = {
            let mut st = self.lock();
            if self.seg_size() == seg_size {
                return;
            }
            tracing::info!(
                from = self.seg_size(),
                to = seg_size,
                "the segment pool follows the timelines' segment size"
            );
            self.seg_size.store(seg_size, Ordering::Relaxed);
            std::mem::take(&mut st.ready)
        };
        crate::metrics::PREPARED_SEGMENTS.set(0);
        self.remove_files(old);
    }

    fn remove_files(&self, paths: Vec<PathBuf>) {
        for path in paths {
            if let Err(e) = self.fs.remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %e, "removing a pooled segment");
            }
        }
    }

    fn quiet(&self) -> bool {
        match self.last_flush.load(Ordering::Relaxed) {
            0 => true,
            at => {
                let now = self.epoch.elapsed().as_nanos() as u64 + 1;
                now.saturating_sub(at) >= QUIET.as_nanos() as u64
            }
        }
    }

    /// Whether the file system is used past `max_ratio`, or would be with one more segment.
    fn full(&self) -> bool {
        crate::disk_usage::fs_usage(&self.dir).is_ok_and(|u| {
            u.size == 0 || u.ratio + self.seg_size() as f64 / u.size as f64 > self.max_ratio
        })
    }

    /// Writes one segment of `seg_size` bytes into the pool, [`CHUNK`] by [`CHUNK`], each once
    /// the node is quiet.
    fn prepare_one(&self, n: u64, seg_size: u64) -> Result<PathBuf> {
        let tmp = self.dir.join(POOL_TMP_NAME);
        let path = self.dir.join(format!("{POOL_PREFIX}{n}"));
        let made = (|| {
            let f = self
                .fs
                .open(&tmp, OpenMode::CreateTruncate)
                .map_err(|e| Error::io(format!("creating {}", tmp.display()), e))?;
            let mut off = 0;
            while off < seg_size {
                while !self.quiet() {
                    std::thread::sleep(POLL);
                }
                let end = (off + CHUNK).min(seg_size);
                write_zeros(&*f, off, end, Zeros::Paced(WRITE_BACK_PAUSE))
                    .map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
                off = end;
            }
            fsync_or_abort(&*f, &tmp, SyncKind::All);
            durable_rename(&self.fs, &tmp, &path, &self.dir, false)
        })();
        if made.is_err() {
            let _ = self.fs.remove_file(&tmp);
        }
        made.map(|()| path)
    }

    /// Gives the pool's segments back to the file system (it is past its limit).
    fn give_back(&self) {
        let ready = std::mem::take(&mut self.lock().ready);
        crate::metrics::PREPARED_SEGMENTS.set(0);
        self.remove_files(ready);
    }
}

/// The pool's thread: while the pool lives, writes a segment whenever fewer than `target` are
/// ready, the node is quiet and the file system has room; gives them back when it has not.
fn refill(pool: Weak<Inner>) {
    loop {
        let Some(inner) = pool.upgrade() else { return };
        let (n, seg_size) = {
            let st = inner.lock();
            let ready = st.ready.len();
            let full = inner.full();
            if ready > 0 && full {
                drop(st);
                tracing::info!(
                    ready,
                    "the file system is past its limit: removing the pooled WAL segments"
                );
                inner.give_back();
                continue;
            }
            if ready >= inner.target || full || !inner.quiet() {
                drop(inner.changed.wait_timeout(st, POLL));
                continue;
            }
            (st.next_name, inner.seg_size())
        };
        match inner.prepare_one(n, seg_size) {
            Ok(path) => {
                let mut st = inner.lock();
                st.next_name = n + 1;
                if inner.seg_size() == seg_size {
                    st.ready.push(path);
                    crate::metrics::PREPARED_SEGMENTS.set(st.ready.len() as i64);
                } else {
                    // Resized meanwhile.
                    drop(st);
                    inner.remove_files(vec![path]);
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "preparing a pooled WAL segment failed; trying again in {RETRY_AFTER:?}");
                drop(inner);
                std::thread::sleep(RETRY_AFTER);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEG: u64 = 1 << 20;

    /// The pool fills to its target with whole zeroed segments, hands one over under the
    /// caller's name, and refills.
    #[test]
    fn fills_hands_over_and_refills() {
        let tmp = tempfile::tempdir().unwrap();
        let (pool_dir, tl_dir) = (tmp.path().join("pool"), tmp.path().join("tl"));
        std::fs::create_dir_all(&tl_dir).unwrap();
        let pool = SegmentPool::start(Fs::real(), &pool_dir, SEG, 2, 0.0).unwrap();
        pool.wait_ready(2);
        std::thread::sleep(POLL * 3);
        assert_eq!(pool.ready(), 2, "no more than the target");
        let to = tl_dir.join("seg.partial");
        let _file = pool.take(&to, &tl_dir, SEG).expect("a ready segment");
        assert_eq!(std::fs::metadata(&to).unwrap().len(), SEG);
        let data = std::fs::read(&to).unwrap();
        assert!(data.iter().all(|&b| b == 0));
        // Allocated, not sparse: every block is on disk.
        let meta = std::fs::metadata(&to).unwrap();
        assert!(std::os::unix::fs::MetadataExt::blocks(&meta) * 512 >= SEG);
        pool.wait_ready(2);
    }

    /// Nothing is written while WAL is being flushed; the pool fills once the node is quiet.
    #[test]
    fn writes_only_when_quiet() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pool");
        let pool = SegmentPool::start(Fs::real(), &dir, SEG, 1, 0.0).unwrap();
        pool.flushed();
        let busy_until = Instant::now() + QUIET / 2;
        while Instant::now() < busy_until {
            pool.flushed();
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(pool.ready(), 0);
        assert!(!dir.join(POOL_TMP_NAME).exists(), "no segment begun");
        pool.wait_ready(1);
    }

    /// A restart keeps whole segments; it removes a half-written one, a short one, and the
    /// pool's name of a file also linked elsewhere (that file stays where it was taken to); a
    /// directory is left alone.
    #[test]
    fn restart_keeps_whole_segments_only() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pool");
        std::fs::create_dir_all(dir.join("stranger")).unwrap();
        std::fs::write(dir.join(POOL_TMP_NAME), vec![0u8; 4096]).unwrap();
        std::fs::write(dir.join("prepared-7"), vec![0u8; SEG as usize]).unwrap();
        std::fs::write(dir.join("prepared-8"), vec![0u8; 4096]).unwrap();
        let wal = tmp.path().join("taken.partial");
        std::fs::write(&wal, vec![7u8; SEG as usize]).unwrap();
        std::fs::hard_link(&wal, dir.join("prepared-9")).unwrap();
        let pool = SegmentPool::start(Fs::real(), &dir, SEG, 1, 0.0).unwrap();
        assert_eq!(pool.ready(), 1);
        assert!(!dir.join(POOL_TMP_NAME).exists());
        assert!(!dir.join("prepared-8").exists());
        assert!(!dir.join("prepared-9").exists());
        assert!(std::fs::read(&wal).unwrap().iter().all(|&b| b == 7));
        assert!(dir.join("stranger").is_dir());
        let to = tmp.path().join("taken");
        assert!(pool.take(&to, tmp.path(), SEG).is_some());
        assert!(!dir.join("prepared-7").exists());
    }

    /// Past the file system's usage limit the pool writes nothing and gives back what it has.
    #[test]
    fn a_full_file_system_gets_the_pool_back() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pool");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("prepared-0"), vec![0u8; SEG as usize]).unwrap();
        // No file system is used below this.
        let pool = SegmentPool::start(Fs::real(), &dir, SEG, 2, 1e-12).unwrap();
        let start = Instant::now();
        while dir.join("prepared-0").exists() {
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "kept past the limit"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(pool.ready(), 0);
        std::thread::sleep(QUIET + POLL * 3);
        assert_eq!(pool.ready(), 0);
        assert!(!dir.join(POOL_TMP_NAME).exists(), "nothing begun");
    }

    /// A timeline of another segment size gets nothing at once; the pool then drops its
    /// segments and refills with that size, which the next take gets.
    #[test]
    fn the_pool_follows_the_timelines_segment_size() {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pool");
        let pool = SegmentPool::start(Fs::real(), &dir, SEG, 1, 0.0).unwrap();
        pool.wait_ready(1);
        let to = tmp.path().join("seg.partial");
        assert!(pool.take(&to, tmp.path(), 2 * SEG).is_none());
        assert_eq!((pool.seg_size(), pool.ready()), (2 * SEG, 0));
        assert!(!pool.ready_for(SEG));
        pool.wait_ready(1);
        assert!(pool.ready_for(2 * SEG));
        let names: Vec<_> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
        assert_eq!(std::fs::metadata(&names[0]).unwrap().len(), 2 * SEG);
        assert!(pool.take(&to, tmp.path(), 2 * SEG).is_some());
        assert_eq!(std::fs::metadata(&to).unwrap().len(), 2 * SEG);
    }
}
