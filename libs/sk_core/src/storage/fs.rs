//! The file-system seam under the file stores: the real file system ([`Fs::real`]) and a
//! simulated one ([`SimFs`]) that forgets, on a simulated power loss, everything no fsync has
//! made durable: file contents *and* directory entries (creations, renames, deletions).
//!
//! Why a simulation: `kill -9` cannot catch a missing fsync, because the page cache survives it,
//! and the in-memory store fakes ([`super::mem`]) model an atomic, durable rename, so neither can
//! catch a missing *directory* fsync. [`SimFs`] follows POSIX's weakest reading, as LazyFS and
//! ALICE do: a rename or a new file is durable only once its directory is fsynced, and a file's
//! writes only once the file is. The model test runs the real file stores of the `safekeeper`
//! crate (`wal_store`, `control_file`) on it.
//!
//! What [`SimFs`] does not model: directories as entries of their parent (creating, renaming
//! and removing a directory are durable at once), reordering of one file's unsynced writes (a power loss keeps a random *prefix* of them, which includes torn
//! tails and lost tails but no holes), and `fdatasync` losing a size change (`Data` and `All`
//! both make size and content durable; the stores use `All` where the size changes).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

/// How to open a file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpenMode {
    /// An existing file, read-only.
    Read,
    /// An existing file, for reading and writing.
    ReadWrite,
    /// Created if missing, truncated to zero length, for reading and writing.
    CreateTruncate,
}

/// What to make durable.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SyncKind {
    /// `fdatasync`: data and the metadata needed to read it back (enough for a file whose size
    /// does not change).
    Data,
    /// `fsync`: data and all metadata (size changes, directories).
    All,
}

/// An open file: positional reads and writes only.
pub trait FileHandle: fmt::Debug + Send + Sync {
    /// Reads up to `buf.len()` bytes at `off`; 0 at end of file.
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize>;
    /// Writes all of `buf` at `off`, extending the file with zeros if `off` is past its end.
    fn write_all_at(&self, buf: &[u8], off: u64) -> io::Result<()>;
    /// Truncates or extends (with zeros) the file to `len` bytes.
    fn set_len(&self, len: u64) -> io::Result<()>;
    /// `fdatasync` or `fsync`. Callers go through [`crate::storage::durable::fsync_or_abort`].
    fn sync(&self, kind: SyncKind) -> io::Result<()>;
    /// Writes back the dirty pages of `[off, off + len)` and waits for them
    /// (`sync_file_range(WAIT_BEFORE | WRITE | WAIT_AFTER)`). It promises no durability (no
    /// metadata, no device cache flush): it spreads the write-back of a large write, so other
    /// files' `fdatasync`s wait behind one piece of it rather than all of it at its `fsync`, and
    /// that `fsync` has little left to write. Its error must be taken as a failed write: it
    /// consumes the descriptor's write-back error, which a later `fsync` then no longer reports.
    /// By default nothing (the simulated file system).
    fn write_back(&self, off: u64, len: u64) -> io::Result<()> {
        let _ = (off, len);
        Ok(())
    }

    /// Fills `buf` from `off`; an error if the file ends first.
    fn read_exact_at(&self, buf: &mut [u8], off: u64) -> io::Result<()> {
        let n = read_full_at(self, buf, off)?;
        if n < buf.len() {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!("file ends {} bytes into a {}-byte read", n, buf.len()),
            ));
        }
        Ok(())
    }
}

/// Reads as many bytes as available at `off` into `buf`, up to its length (stops early only at
/// end of file).
pub fn read_full_at<F: FileHandle + ?Sized>(f: &F, buf: &mut [u8], off: u64) -> io::Result<usize> {
    let mut got = 0;
    while got < buf.len() {
        match f.read_at(&mut buf[got..], off + got as u64) {
            Ok(0) => break,
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(got)
}

/// Operations on names. Paths are absolute or relative to the process's working directory
/// (real) or to the simulation's root (simulated).
pub trait FileSystem: fmt::Debug + Send + Sync {
    /// Opens `path` as `mode` says.
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Box<dyn FileHandle>>;
    /// Atomically replaces `to` with `from`: a file within one directory, or a directory
    /// (which `to` must not name yet).
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Removes the file `path`.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Creates directory `path` and its missing parents.
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Removes directory `path` and everything below it.
    fn remove_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Names of the entries (files and directories) of directory `path`.
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>>;
    /// Whether `path` names a file or a directory.
    fn exists(&self, path: &Path) -> bool;
    /// Whether `path` is a directory.
    fn is_dir(&self, path: &Path) -> bool;
    /// Makes the entries of directory `path` durable. Callers go through
    /// [`crate::storage::durable::fsync_dir`].
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
    /// Whether this is a simulation driven by one thread (then work that would run on threads
    /// of its own runs on the caller's, so a seed replays exactly).
    fn simulated(&self) -> bool {
        false
    }
}

/// A shared handle to a file system; the default is the real one.
#[derive(Clone)]
pub struct Fs(Arc<dyn FileSystem>);

impl Fs {
    /// The operating system's file system.
    pub fn real() -> Fs {
        Fs(Arc::new(RealFs))
    }

    /// A simulated file system (see [`SimFs`]).
    pub fn sim(sim: Arc<SimFs>) -> Fs {
        Fs(sim)
    }

    /// A file system of the caller's: one that wraps another to delay or fail some calls in a
    /// test.
    pub fn custom(fs: Arc<dyn FileSystem>) -> Fs {
        Fs(fs)
    }
}

impl Default for Fs {
    fn default() -> Fs {
        Fs::real()
    }
}

impl fmt::Debug for Fs {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl std::ops::Deref for Fs {
    type Target = dyn FileSystem;

    fn deref(&self) -> &(dyn FileSystem + 'static) {
        &*self.0
    }
}

// ----- the real file system -------------------------------------------------------------------

#[derive(Debug)]
struct RealFs;

#[derive(Debug)]
struct RealFile(std::fs::File);

impl FileHandle for RealFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        std::os::unix::fs::FileExt::read_at(&self.0, buf, off)
    }

    fn write_all_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(&self.0, buf, off)
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }

    fn sync(&self, kind: SyncKind) -> io::Result<()> {
        match kind {
            SyncKind::Data => self.0.sync_data(),
            SyncKind::All => self.0.sync_all(),
        }
    }

    fn write_back(&self, off: u64, len: u64) -> io::Result<()> {
        use std::os::fd::AsRawFd;
        let (off, len) = (
            i64::try_from(off).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
            i64::try_from(len).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?,
        );
        let flags = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        // SAFETY: a plain system call on an open descriptor this value owns; no memory is
        // passed.
        if unsafe { libc::sync_file_range(self.0.as_raw_fd(), off, len, flags) } == 0 {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

impl FileSystem for RealFs {
    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Box<dyn FileHandle>> {
        let mut o = std::fs::OpenOptions::new();
        match mode {
            OpenMode::Read => o.read(true),
            OpenMode::ReadWrite => o.read(true).write(true),
            OpenMode::CreateTruncate => o.read(true).write(true).create(true).truncate(true),
        };
        Ok(Box::new(RealFile(o.open(path)?)))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_dir_all(path)
    }

    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(path)? {
            if let Ok(name) = entry?.file_name().into_string() {
                names.push(name);
            }
        }
        Ok(names)
    }

    fn exists(&self, path: &Path) -> bool {
        path.exists()
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        std::fs::File::open(path)?.sync_all()
    }
}

// ----- the simulated file system --------------------------------------------------------------

/// An in-memory file system that can lose power, or see its process crash.
///
/// Every file (inode) keeps its durable content and the operations applied since its last
/// fsync; every directory keeps its durable entries and the entry operations since its last
/// fsync. [`SimFs::power_loss`] keeps, per file and per directory, a prefix of those pending
/// operations (the caller chooses how long) and forgets the rest, and invalidates every open
/// handle. Operations between power losses see the current (not necessarily durable) state, as
/// processes see the page cache.
#[derive(Debug, Default)]
pub struct SimFs {
    /// Shared with the open handles.
    state: Arc<Mutex<SimState>>,
}

#[derive(Debug, Default)]
struct SimState {
    /// Bumped by every power loss; handles of an older epoch fail with EIO.
    epoch: u64,
    next_ino: u64,
    inodes: HashMap<u64, Inode>,
    dirs: BTreeMap<PathBuf, Dir>,
    fsyncs: u64,
    dir_fsyncs: u64,
    /// Armed crash point: the number of mutating operations still allowed before the power
    /// "fails" (see [`SimFs::arm_crash_after`]).
    crash_in: Option<u64>,
    /// The machine's state when the power failed, if a crash point was reached.
    crash_image: Option<CrashImage>,
    /// A full disk: writes and `set_len` fail with ENOSPC (see [`SimFs::set_full`]).
    full: bool,
}

/// Files and directories as they were when a crash point was reached.
#[derive(Debug)]
struct CrashImage {
    inodes: HashMap<u64, Inode>,
    dirs: BTreeMap<PathBuf, Dir>,
}

/// A file's content or a directory's entries: what processes see now, what is durable, and
/// the operations between the two.
#[derive(Debug, Clone)]
struct Journaled<T, Op> {
    current: T,
    durable: T,
    /// Applied to `current`, not yet to `durable`.
    pending: Vec<Op>,
}

/// An operation on a file's content or a directory's entries.
trait Operation<T> {
    fn apply(&self, target: &mut T);
}

impl<T: Default, Op> Default for Journaled<T, Op> {
    fn default() -> Self {
        Journaled {
            current: T::default(),
            durable: T::default(),
            pending: Vec::new(),
        }
    }
}

impl<T: Clone, Op: Operation<T>> Journaled<T, Op> {
    /// Applies `op` now; it becomes durable at the next [`Journaled::sync`].
    fn record(&mut self, op: Op) {
        op.apply(&mut self.current);
        self.pending.push(op);
    }

    fn sync(&mut self) {
        for op in self.pending.drain(..) {
            op.apply(&mut self.durable);
        }
    }

    /// Keeps the first `keep(n)` (at most `n`) of the `n` pending operations and forgets the
    /// rest; returns how many were kept and lost.
    fn lose_power(&mut self, keep: &mut dyn FnMut(usize) -> usize) -> (usize, usize) {
        let n = self.pending.len();
        let k = keep(n).min(n);
        for op in self.pending.drain(..k) {
            op.apply(&mut self.durable);
        }
        self.pending.clear();
        // With every pending operation kept (or none pending), `current` already equals the
        // durable content: copying a whole file for each of them made power losses the
        // simulations' largest copy.
        if k < n {
            self.current = self.durable.clone();
        }
        (k, n - k)
    }
}

type Inode = Journaled<Vec<u8>, FileOp>;
type Dir = Journaled<BTreeMap<String, u64>, DirOp>;

#[derive(Debug, Clone)]
enum FileOp {
    Write { off: u64, bytes: Vec<u8> },
    SetLen(u64),
}

impl Operation<Vec<u8>> for FileOp {
    fn apply(&self, data: &mut Vec<u8>) {
        match self {
            FileOp::Write { off, bytes } => {
                let off = *off as usize;
                set_len(data, data.len().max(off + bytes.len()));
                data[off..off + bytes.len()].copy_from_slice(bytes);
            }
            FileOp::SetLen(len) => set_len(data, *len as usize),
        }
    }
}

/// Truncates or zero-extends `data` to `len` bytes ([`zero_extend`]: a file written from start
/// to end costs linear time; copying the whole file into a fresh allocation on every growth made
/// zero-filling a segment in 64 KiB pieces quadratic, a third of the manager simulation's time).
fn set_len(data: &mut Vec<u8>, len: usize) {
    if len <= data.len() {
        data.truncate(len);
    } else {
        zero_extend(data, len - data.len());
    }
}

/// Appends `n` zero bytes to `data`, reserving with the vector's amortized growth and copying
/// zeros by the slice: `Vec::resize` fills byte by byte in unoptimized builds, where the
/// simulations run the WAL paths that use this.
pub fn zero_extend(data: &mut Vec<u8>, n: usize) {
    static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
    data.reserve(n);
    let end = data.len() + n;
    while data.len() < end {
        let k = (end - data.len()).min(ZEROS.len());
        data.extend_from_slice(&ZEROS[..k]);
    }
}

#[derive(Debug, Clone)]
enum DirOp {
    Link {
        name: String,
        ino: u64,
    },
    Unlink {
        name: String,
    },
    /// Atomic within one directory, as `rename(2)` is.
    Rename {
        from: String,
        to: String,
    },
}

impl Operation<BTreeMap<String, u64>> for DirOp {
    fn apply(&self, entries: &mut BTreeMap<String, u64>) {
        match self {
            DirOp::Link { name, ino } => {
                entries.insert(name.clone(), *ino);
            }
            DirOp::Unlink { name } => {
                entries.remove(name);
            }
            DirOp::Rename { from, to } => {
                if let Some(ino) = entries.remove(from) {
                    entries.insert(to.clone(), ino);
                }
            }
        }
    }
}

/// What a simulated power loss did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct PowerLossReport {
    /// Unsynced file operations (writes, size changes) forgotten / kept.
    pub file_ops_lost: usize,
    /// See `file_ops_lost`.
    pub file_ops_kept: usize,
    /// Unsynced directory operations (creations, renames, deletions) forgotten / kept.
    pub dir_ops_lost: usize,
    /// See `dir_ops_lost`.
    pub dir_ops_kept: usize,
}

/// A panic while holding the lock leaves the state consistent (every mutation is complete
/// before the guard drops), so a poisoned lock is still usable.
fn lock(state: &Mutex<SimState>) -> MutexGuard<'_, SimState> {
    state.lock().unwrap_or_else(|e| e.into_inner())
}

fn not_found(path: &Path) -> io::Error {
    io::Error::new(
        io::ErrorKind::NotFound,
        format!("{}: no such file or directory", path.display()),
    )
}

/// `(directory, file name)` of `path`.
fn split(path: &Path) -> io::Result<(PathBuf, String)> {
    let name = path
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "path has no file name"))?;
    let dir = path.parent().unwrap_or(Path::new("")).to_path_buf();
    Ok((dir, name.to_string()))
}

impl SimFs {
    /// An empty simulated file system.
    pub fn new() -> Arc<SimFs> {
        Arc::new(SimFs::default())
    }

    /// A simulated file system holding the (durable, empty) directory `dir`, and an [`Fs`] on
    /// it (for tests).
    pub fn with_dir(dir: &Path) -> (Arc<SimFs>, Fs) {
        let sim = SimFs::new();
        sim.create_dir_all(dir)
            .expect("the simulation creates directories");
        let fs = Fs::sim(sim.clone());
        (sim, fs)
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        lock(&self.state)
    }

    /// Simulates a power loss: for every file and directory, `keep(n)` (clamped to `n`) of its
    /// `n` pending operations survive, in order; the rest are forgotten. Open handles stop
    /// working. `keep = |_| 0` is the harshest outcome, `|n| n` a clean shutdown.
    ///
    /// If a crash point armed with [`SimFs::arm_crash_after`] was reached, the machine lost
    /// power *there*: operations from that point on never happened.
    pub fn power_loss(&self, keep: &mut dyn FnMut(usize) -> usize) -> PowerLossReport {
        let mut st = self.lock();
        let mut report = PowerLossReport::default();
        st.epoch += 1;
        st.crash_in = None;
        if let Some(image) = st.crash_image.take() {
            st.inodes = image.inodes;
            st.dirs = image.dirs;
        }
        for dir in st.dirs.values_mut() {
            let (kept, lost) = dir.lose_power(keep);
            report.dir_ops_kept += kept;
            report.dir_ops_lost += lost;
        }
        // Iterate in inode order: the outcome depends only on the caller's choices.
        let mut inos: Vec<u64> = st.inodes.keys().copied().collect();
        inos.sort_unstable();
        let linked: std::collections::HashSet<u64> = st
            .dirs
            .values()
            .flat_map(|d| d.durable.values().copied())
            .collect();
        for ino in inos {
            if !linked.contains(&ino) {
                st.inodes.remove(&ino);
                continue;
            }
            let inode = st.inodes.get_mut(&ino).expect("listed above");
            let (kept, lost) = inode.lose_power(keep);
            report.file_ops_kept += kept;
            report.file_ops_lost += lost;
        }
        report
    }

    /// Simulates a process crash (`kill -9`, the abort after a failed fsync): every open handle
    /// dies, but the machine keeps running, so the page cache survives: operations no fsync
    /// covered stay visible *and* pending (a later [`SimFs::power_loss`] can still forget
    /// them). A restarted process therefore reads bytes that are not durable, which is what
    /// start-up recovery must make durable before revealing them.
    ///
    /// If a crash point armed with [`SimFs::arm_crash_after`] was reached, the process died
    /// *there*: operations from that point on never happened (the ones before it stay pending).
    pub fn process_crash(&self) {
        let mut st = self.lock();
        st.epoch += 1;
        st.crash_in = None;
        if let Some(image) = st.crash_image.take() {
            st.inodes = image.inodes;
            st.dirs = image.dirs;
        }
    }

    /// Arms a crash point: the power fails just before the mutating operation (write, size
    /// change, creation, rename, deletion, fsync) numbered `ops` from now (0 = the next one).
    /// Operations go on working in memory, as a process does not notice; the caller then calls
    /// [`SimFs::power_loss`] if [`SimFs::crash_point_reached`], which restores the machine as it
    /// was at that point, or [`SimFs::disarm`].
    pub fn arm_crash_after(&self, ops: u64) {
        let mut st = self.lock();
        st.crash_in = Some(ops);
        st.crash_image = None;
    }

    /// Whether the armed crash point was reached.
    pub fn crash_point_reached(&self) -> bool {
        self.lock().crash_image.is_some()
    }

    /// Cancels an armed crash point that was not reached.
    pub fn disarm(&self) {
        let mut st = self.lock();
        st.crash_in = None;
        st.crash_image = None;
    }

    /// Fills the disk (`true`) or frees space again: while full, every file write and
    /// `set_len` fails with ENOSPC and changes nothing (stricter than a real file system,
    /// which still takes writes over blocks it allocated before).
    pub fn set_full(&self, full: bool) {
        self.lock().full = full;
    }

    /// Number of file fsyncs and directory fsyncs so far.
    pub fn sync_counts(&self) -> (u64, u64) {
        let st = self.lock();
        (st.fsyncs, st.dir_fsyncs)
    }
}

impl SimState {
    /// Called before every mutating operation: takes the crash image at the armed point.
    fn before_mutation(&mut self) {
        match self.crash_in {
            Some(0) => {
                self.crash_in = None;
                self.crash_image = Some(CrashImage {
                    inodes: self.inodes.clone(),
                    dirs: self.dirs.clone(),
                });
            }
            Some(n) => self.crash_in = Some(n - 1),
            None => {}
        }
    }

    fn dir(&self, dir: &Path) -> io::Result<&Dir> {
        self.dirs.get(dir).ok_or_else(|| not_found(dir))
    }

    fn dir_mut(&mut self, dir: &Path) -> io::Result<&mut Dir> {
        self.dirs.get_mut(dir).ok_or_else(|| not_found(dir))
    }

    fn lookup(&self, path: &Path) -> io::Result<u64> {
        let (dir, name) = split(path)?;
        self.dir(&dir)?
            .current
            .get(&name)
            .copied()
            .ok_or_else(|| not_found(path))
    }

    /// Moves directory `from` and everything below it to `to` (durable at once: see the module
    /// documentation).
    fn rename_dir(&mut self, from: &Path, to: &Path) -> io::Result<()> {
        if self.dirs.contains_key(to) || self.lookup(to).is_ok() {
            return Err(io::Error::new(
                io::ErrorKind::AlreadyExists,
                format!(
                    "{}: the simulation renames directories to new names only",
                    to.display()
                ),
            ));
        }
        let parent = to.parent().unwrap_or(Path::new(""));
        self.dir(parent)?;
        self.before_mutation();
        let moved: Vec<PathBuf> = self
            .dirs
            .keys()
            .filter(|d| d.starts_with(from))
            .cloned()
            .collect();
        for d in moved {
            let dir = self.dirs.remove(&d).expect("listed above");
            let rest = d.strip_prefix(from).expect("filtered by prefix");
            let new = if rest.as_os_str().is_empty() {
                to.to_path_buf()
            } else {
                to.join(rest)
            };
            self.dirs.insert(new, dir);
        }
        Ok(())
    }

    fn dir_op(&mut self, dir: &Path, op: DirOp) -> io::Result<()> {
        self.dir_mut(dir)?;
        self.before_mutation();
        self.dir_mut(dir)?.record(op);
        Ok(())
    }
}

impl FileSystem for SimFs {
    fn simulated(&self) -> bool {
        true
    }

    fn open(&self, path: &Path, mode: OpenMode) -> io::Result<Box<dyn FileHandle>> {
        let mut st = self.lock();
        let epoch = st.epoch;
        let ino = match (st.lookup(path), mode) {
            (Ok(ino), OpenMode::CreateTruncate) => {
                st.before_mutation();
                let inode = st.inodes.get_mut(&ino).expect("linked inode exists");
                inode.record(FileOp::SetLen(0));
                ino
            }
            (Ok(ino), _) => ino,
            (Err(_), OpenMode::CreateTruncate) => {
                let (dir, name) = split(path)?;
                st.dir(&dir)?;
                st.next_ino += 1;
                let ino = st.next_ino;
                st.inodes.insert(ino, Inode::default());
                st.dir_op(&dir, DirOp::Link { name, ino })?;
                ino
            }
            (Err(e), _) => return Err(e),
        };
        Ok(Box::new(SimFile {
            state: Arc::clone(&self.state),
            ino,
            epoch,
            writable: mode != OpenMode::Read,
        }))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut st = self.lock();
        if st.dirs.contains_key(from) {
            return st.rename_dir(from, to);
        }
        st.lookup(from)?;
        let (dir, from_name) = split(from)?;
        let (to_dir, to_name) = split(to)?;
        if dir != to_dir {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the simulation renames within one directory only",
            ));
        }
        st.dir_op(
            &dir,
            DirOp::Rename {
                from: from_name,
                to: to_name,
            },
        )
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        let mut st = self.lock();
        st.lookup(path)?;
        let (dir, name) = split(path)?;
        st.dir_op(&dir, DirOp::Unlink { name })
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut st = self.lock();
        let mut p = Some(path);
        while let Some(d) = p {
            st.dirs.entry(d.to_path_buf()).or_default();
            p = d.parent();
        }
        Ok(())
    }

    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut st = self.lock();
        st.dir(path)?;
        st.before_mutation();
        st.dirs.retain(|d, _| !d.starts_with(path));
        Ok(())
    }

    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let st = self.lock();
        let mut names: Vec<String> = st.dir(path)?.current.keys().cloned().collect();
        let subdirs = st.dirs.keys().filter(|d| d.parent() == Some(path));
        names.extend(subdirs.filter_map(|d| Some(d.file_name()?.to_str()?.to_string())));
        names.sort();
        Ok(names)
    }

    fn exists(&self, path: &Path) -> bool {
        let st = self.lock();
        st.dirs.contains_key(path) || st.lookup(path).is_ok()
    }

    fn is_dir(&self, path: &Path) -> bool {
        self.lock().dirs.contains_key(path)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        let mut st = self.lock();
        st.dir_mut(path)?;
        st.before_mutation();
        st.dir_fsyncs += 1;
        st.dir_mut(path)?.sync();
        Ok(())
    }
}

#[derive(Debug)]
struct SimFile {
    state: Arc<Mutex<SimState>>,
    ino: u64,
    epoch: u64,
    writable: bool,
}

impl SimFile {
    fn with_inode<T>(&self, f: impl FnOnce(&mut SimState, u64) -> io::Result<T>) -> io::Result<T> {
        let mut st = lock(&self.state);
        if st.epoch != self.epoch || !st.inodes.contains_key(&self.ino) {
            return Err(io::Error::other(
                "stale handle: the simulated process crashed or the machine lost power",
            ));
        }
        f(&mut st, self.ino)
    }

    fn mutate(&self, op: FileOp) -> io::Result<()> {
        if !self.writable {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "file opened read-only",
            ));
        }
        self.with_inode(|st, ino| {
            if st.full {
                return Err(io::Error::from_raw_os_error(libc::ENOSPC));
            }
            st.before_mutation();
            st.inodes.get_mut(&ino).expect("checked").record(op);
            Ok(())
        })
    }
}

impl FileHandle for SimFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> io::Result<usize> {
        self.with_inode(|st, ino| {
            let data = &st.inodes[&ino].current;
            let off = (off as usize).min(data.len());
            let n = buf.len().min(data.len() - off);
            buf[..n].copy_from_slice(&data[off..off + n]);
            Ok(n)
        })
    }

    fn write_all_at(&self, buf: &[u8], off: u64) -> io::Result<()> {
        self.mutate(FileOp::Write {
            off,
            bytes: buf.to_vec(),
        })
    }

    fn set_len(&self, len: u64) -> io::Result<()> {
        self.mutate(FileOp::SetLen(len))
    }

    fn sync(&self, _kind: SyncKind) -> io::Result<()> {
        self.with_inode(|st, ino| {
            st.before_mutation();
            st.fsyncs += 1;
            st.inodes.get_mut(&ino).expect("checked").sync();
            Ok(())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `write_back` on a real file writes its pages back (the system call succeeds on the
    /// tests' file system) and refuses a range `sync_file_range` cannot express.
    #[test]
    fn real_write_back_succeeds_and_refuses_ranges_past_i64() {
        let dir = tempfile::tempdir().unwrap();
        let f = Fs::real()
            .open(&dir.path().join("f"), OpenMode::CreateTruncate)
            .unwrap();
        f.write_all_at(&[7u8; 70_000], 0).unwrap();
        f.write_back(0, 70_000).unwrap();
        f.write_back(65_536, 4_464).unwrap();
        let e = f.write_back(u64::MAX, 1).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::InvalidInput);
    }

    fn sim() -> (Arc<SimFs>, Fs) {
        SimFs::with_dir(Path::new("/d"))
    }

    fn create(fs: &Fs, path: &str) -> Box<dyn FileHandle> {
        fs.open(Path::new(path), OpenMode::CreateTruncate).unwrap()
    }

    fn sync_dir(fs: &Fs) {
        fs.sync_dir(Path::new("/d")).unwrap();
    }

    fn read_all(fs: &Fs, path: &str) -> io::Result<Vec<u8>> {
        let f = fs.open(Path::new(path), OpenMode::Read)?;
        let mut buf = vec![0; 1 << 16];
        let n = read_full_at(&*f, &mut buf, 0)?;
        buf.truncate(n);
        Ok(buf)
    }

    #[test]
    fn unsynced_writes_are_lost_synced_ones_kept() {
        let (sim, fs) = sim();
        let f = create(&fs, "/d/a");
        sync_dir(&fs);
        f.write_all_at(b"durable", 0).unwrap();
        f.sync(SyncKind::Data).unwrap();
        f.write_all_at(b"-lost", 7).unwrap();
        assert_eq!(read_all(&fs, "/d/a").unwrap(), b"durable-lost");
        let report = sim.power_loss(&mut |_| 0);
        assert_eq!((report.file_ops_lost, report.file_ops_kept), (1, 0));
        assert_eq!(read_all(&fs, "/d/a").unwrap(), b"durable");
        let err = f.write_all_at(b"x", 0).unwrap_err();
        assert!(err.to_string().contains("lost power"), "{err}");
    }

    #[test]
    fn a_process_crash_keeps_unsynced_operations_pending_until_a_power_loss() {
        let (sim, fs) = sim();
        let f = create(&fs, "/d/a");
        sync_dir(&fs);
        f.write_all_at(b"durable", 0).unwrap();
        f.sync(SyncKind::Data).unwrap();
        f.write_all_at(b"-cached", 7).unwrap();
        create(&fs, "/d/b");
        sim.process_crash();
        let err = f.write_all_at(b"x", 0).unwrap_err();
        assert!(err.to_string().contains("lost power"), "{err}");
        // The restarted process sees the page cache...
        assert_eq!(read_all(&fs, "/d/a").unwrap(), b"durable-cached");
        assert!(fs.exists(Path::new("/d/b")));
        // ...which a later power loss can still take away.
        let report = sim.power_loss(&mut |_| 0);
        assert_eq!((report.file_ops_lost, report.dir_ops_lost), (1, 1));
        assert_eq!(read_all(&fs, "/d/a").unwrap(), b"durable");
        assert!(!fs.exists(Path::new("/d/b")));
    }

    #[test]
    fn a_power_loss_keeps_a_prefix_of_unsynced_writes() {
        let (sim, fs) = sim();
        let f = create(&fs, "/d/a");
        sync_dir(&fs);
        for (i, piece) in [b"one", b"two", b"six"].iter().enumerate() {
            f.write_all_at(*piece, 3 * i as u64).unwrap();
        }
        sim.power_loss(&mut |n| n.saturating_sub(1));
        assert_eq!(read_all(&fs, "/d/a").unwrap(), b"onetwo");
    }

    #[test]
    fn a_rename_is_durable_only_after_the_directory_is_synced() {
        let (sim, fs) = sim();
        let old = create(&fs, "/d/f");
        old.write_all_at(b"old", 0).unwrap();
        old.sync(SyncKind::All).unwrap();
        sync_dir(&fs);
        let new = create(&fs, "/d/f.tmp");
        new.write_all_at(b"new", 0).unwrap();
        new.sync(SyncKind::All).unwrap();
        fs.rename(Path::new("/d/f.tmp"), Path::new("/d/f")).unwrap();
        assert_eq!(read_all(&fs, "/d/f").unwrap(), b"new");

        // Without a directory fsync both the creation and the rename are forgotten.
        let report = sim.power_loss(&mut |_| 0);
        assert_eq!(report.dir_ops_lost, 2);
        assert_eq!(read_all(&fs, "/d/f").unwrap(), b"old");
        assert!(!fs.exists(Path::new("/d/f.tmp")));

        // With it, the rename survives.
        let new = create(&fs, "/d/f.tmp");
        new.write_all_at(b"new", 0).unwrap();
        new.sync(SyncKind::All).unwrap();
        fs.rename(Path::new("/d/f.tmp"), Path::new("/d/f")).unwrap();
        sync_dir(&fs);
        sim.power_loss(&mut |_| 0);
        assert_eq!(read_all(&fs, "/d/f").unwrap(), b"new");
        assert_eq!(fs.list_dir(Path::new("/d")).unwrap(), vec!["f".to_string()]);
    }

    #[test]
    fn a_synced_file_whose_entry_is_not_synced_disappears() {
        let (sim, fs) = sim();
        let f = create(&fs, "/d/seg");
        f.write_all_at(&[7; 100], 0).unwrap();
        f.sync(SyncKind::All).unwrap();
        sim.power_loss(&mut |_| 0);
        assert_eq!(
            fs.open(Path::new("/d/seg"), OpenMode::Read)
                .unwrap_err()
                .kind(),
            io::ErrorKind::NotFound
        );
    }

    #[test]
    fn deletions_are_undone_unless_synced() {
        let (sim, fs) = sim();
        create(&fs, "/d/x");
        sync_dir(&fs);
        fs.remove_file(Path::new("/d/x")).unwrap();
        assert!(!fs.exists(Path::new("/d/x")));
        sim.power_loss(&mut |_| 0);
        assert!(fs.exists(Path::new("/d/x")));
        fs.remove_file(Path::new("/d/x")).unwrap();
        sync_dir(&fs);
        sim.power_loss(&mut |_| 0);
        assert!(!fs.exists(Path::new("/d/x")));
    }

    #[test]
    fn size_changes_follow_the_same_rules() {
        let (sim, fs) = sim();
        let f = create(&fs, "/d/s");
        sync_dir(&fs);
        f.set_len(4096).unwrap();
        f.sync(SyncKind::All).unwrap();
        f.write_all_at(&[1; 10], 5000).unwrap();
        assert_eq!(read_all(&fs, "/d/s").unwrap().len(), 5010);
        sim.power_loss(&mut |_| 0);
        assert_eq!(read_all(&fs, "/d/s").unwrap(), vec![0; 4096]);
        let ro = fs.open(Path::new("/d/s"), OpenMode::Read).unwrap();
        assert_eq!(
            ro.write_all_at(b"x", 0).unwrap_err().kind(),
            io::ErrorKind::PermissionDenied
        );
    }

    #[test]
    fn directories_are_listed_renamed_and_removed_with_their_contents() {
        let (_sim, fs) = sim();
        fs.create_dir_all(Path::new("/d/tmp/t1")).unwrap();
        create(&fs, "/d/tmp/t1/f");
        assert_eq!(fs.list_dir(Path::new("/d")).unwrap(), vec!["tmp"]);
        assert!(fs.is_dir(Path::new("/d/tmp")) && !fs.is_dir(Path::new("/d/tmp/t1/f")));
        fs.create_dir_all(Path::new("/d/ten")).unwrap();
        fs.rename(Path::new("/d/tmp/t1"), Path::new("/d/ten/t1"))
            .unwrap();
        assert!(fs.exists(Path::new("/d/ten/t1/f")));
        assert!(!fs.exists(Path::new("/d/tmp/t1")));
        assert!(
            fs.rename(Path::new("/d/ten/t1"), Path::new("/d/tmp"))
                .is_err(),
            "a directory is renamed to a new name only"
        );
        fs.remove_dir_all(Path::new("/d/ten")).unwrap();
        assert_eq!(fs.list_dir(Path::new("/d")).unwrap(), vec!["tmp"]);
    }

    #[test]
    fn a_crash_point_restores_the_machine_as_it_was_there() {
        let (sim, fs) = sim();
        let f = create(&fs, "/d/c");
        sync_dir(&fs);
        f.write_all_at(b"v1", 0).unwrap();
        f.sync(SyncKind::All).unwrap();
        // Power fails just before the second operation from here: the write happened, its
        // fsync did not, whatever the process did afterwards.
        sim.arm_crash_after(1);
        f.write_all_at(b"v2", 0).unwrap();
        assert!(!sim.crash_point_reached());
        f.sync(SyncKind::All).unwrap();
        assert!(sim.crash_point_reached());
        fs.rename(Path::new("/d/c"), Path::new("/d/renamed"))
            .unwrap();
        sync_dir(&fs);
        sim.power_loss(&mut |n| n);
        assert_eq!(
            read_all(&fs, "/d/c").unwrap(),
            b"v2",
            "pending write kept (n of n)"
        );
        assert!(!fs.exists(Path::new("/d/renamed")));

        sim.arm_crash_after(5);
        fs.remove_file(Path::new("/d/c")).unwrap();
        assert!(!sim.crash_point_reached());
        sim.disarm();
        sync_dir(&fs);
        sim.power_loss(&mut |_| 0);
        assert!(!fs.exists(Path::new("/d/c")));
    }
}
