//! WAL segments on disk: the file implementation of [`WalStore`].
//!
//! Layout (as neon's safekeeper): one directory per timeline holding PostgreSQL-named segment
//! files (`%08X%08X%08X`, timeline 1). The segment being written carries a `.partial` suffix;
//! completed segments have the plain name. Every segment file is always `seg_size` bytes long:
//! it is created full-size (sparse, via `set_len`) under the temporary name `waltmp`, fsynced, and
//! renamed in durably, so later appends only need `fdatasync`. The end of WAL is therefore found
//! by decoding records, never from file sizes. A new segment may also come whole and zero-filled:
//! prepared in the background for this timeline, or from the node's pool ([`pool`]).
//!
//! LSNs kept (reference §4.2): `write_lsn` (bytes handed to the OS) >= `write_record_lsn` (end of
//! the last complete record written) >= `flush_record_lsn` (end of the last complete record that
//! is durable: what [`WalStore::flush_lsn`] reports). Every written byte goes through a
//! [`WalStreamDecoder`] to find record boundaries; a write that does not decode is refused
//! before it touches the disk.
//!
//! The store (this file) is split by role into:
//! - [`segment`]: segment names, opening, creating blank full-size segments;
//! - [`open_files`]: the LRU of open segment files shared by every timeline's store (a cap
//!   on descriptors: idle timelines' segments are fsynced if needed and closed);
//! - [`recovery`]: the end of WAL at start-up and verification of the committed WAL;
//! - [`reader`]: reading WAL back for walsenders;
//! - [`prepare`]: preparing the next segment in the background, on an injected clock and runner;
//! - [`fill`]: zero-filling the rest of a sparse open segment in the background, for a
//!   commit-bound stream;
//! - [`pool`]: the node's pool of zero-filled segments, written while the node is quiet and
//!   taken by any store that needs a new segment.
//!
//! Not here: deciding what to write or truncate (the consensus core), when to flush (the
//! `WalAcceptor`), the control file ([`crate::control_file`]), or which segments may be removed
//! (the caller passes the horizon to [`WalFileStore::remove_segments_up_to`]).

// Storage: no `unwrap()` outside tests (see sk_core).
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

mod fill;
pub mod open_files;
pub mod pool;
pub mod prepare;
pub mod reader;
pub mod recovery;
pub mod segment;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use pg_wal::PgMajor;
use pg_wal::WalStreamDecoder;
use pg_wal::format::{first_segment_image, is_valid_seg_size, parse_xlog_file_name};
use sk_core::storage::durable::{durable_rename, fsync_dir, fsync_or_abort};
use sk_core::storage::fs::{FileHandle, Fs, SyncKind};
use sk_core::storage::{Error, Result, WalStore};
use sk_core::types::Lsn;

use fill::{Claim, Fill};
pub use open_files::{DEFAULT_MAX_OPEN_SEGMENT_FILES, OpenFiles};
use open_files::{OpenSegment, Slot};
pub use pool::SegmentPool;
use prepare::Preparer;
pub use prepare::{Background, Inline, PREPARED_SEGMENT_NAME, Runner, Threads};
pub use reader::{MAX_READ_LEN, WalReader};
pub use recovery::{find_end_of_wal, sync_recovered_wal, verify_committed_wal};
pub use segment::{PARTIAL_SUFFIX, TMP_SEGMENT_NAME, segment_path};
use segment::{SegmentFile, Zeros, create_segment, open_segment, write_zeros};

/// Options of a [`WalFileStore`].
#[derive(Clone, Debug, Default)]
pub struct WalFileOptions {
    /// Skip every fsync. For tests only: nothing is durable.
    pub no_sync: bool,
    /// System identifier written into the long page header by
    /// [`WalStore::initialize_first_segment`] (0 when unknown).
    pub system_id: u64,
    /// The PostgreSQL major version of the WAL: the page magic and resource managers recovery
    /// and the append decoder accept, and the first segment's page headers.
    pub major: PgMajor,
    /// Where this safekeeper's WAL begins (the control file's `local_start_lsn`), or
    /// [`Lsn::INVALID`] if unknown. When valid, start-up also checks that the page holding the
    /// last byte below `commit_lsn` is present.
    pub wal_start_lsn: Lsn,
    /// Create segments (and zero truncated tails) by writing real zeros instead of the default
    /// sparse `set_len`. Costs a full segment write per segment, but appends then overwrite
    /// allocated blocks, so their `fdatasync` needs no block allocation (see the
    /// `write_flush` bench for the trade-off on a given filesystem).
    pub zero_fill: bool,
    /// Prepare the next segment off the ingest path when WAL arrives slower than this many
    /// bytes per second (0: never). A background thread writes a whole segment of zeros under
    /// [`PREPARED_SEGMENT_NAME`] and fsyncs it; the next segment switch renames it in (durably)
    /// instead of creating a sparse file, so appends into it allocate no blocks and their
    /// `fdatasync` commits no file-system metadata. Worth it when commits wait on each
    /// `fdatasync` (a slow, latency-bound stream); a fast stream batches its `fdatasync`s and
    /// would only pay the extra segment write in bandwidth, hence the rate threshold.
    pub prepare_below_rate: u64,
    /// The file system the segments live on (the real one by default).
    pub fs: Fs,
    /// Where background preparations run and the clock that measures the fill rate (real
    /// threads and clock by default).
    pub background: Background,
    /// The LRU of open segment files this store's file joins (shared by the stores of a node;
    /// by default one of its own, of [`DEFAULT_MAX_OPEN_SEGMENT_FILES`]).
    pub open_files: OpenFiles,
    /// The node's pool of zero-filled segments: a new segment is taken from it when one is
    /// ready (before a preparation of this store's own, or a sparse file), and this store
    /// prepares none of its own while the pool has one. `None`: no pool.
    pub pool: Option<SegmentPool>,
}

/// Pieces of appends smaller than this are gathered in memory and written with one `pwrite`
/// (at the latest by the next flush): for small appends the syscall costs more than the rest of
/// the append (wal-bench `wal_acceptor_throughput/.../size=1024`).
const COALESCE_BELOW: usize = 64 * 1024;
/// Most bytes gathered before they are written out.
const COALESCE_MAX: usize = 512 * 1024;
/// A stream whose flushes cover less WAL than this is commit-bound: each `fdatasync` waits on
/// one small commit. Its appends into a sparse segment are preceded by zeros written ahead
/// ([`ZERO_AHEAD`] at a time), so the blocks are allocated once per chunk instead of once per
/// `fdatasync` (an allocating `fdatasync` also commits file-system metadata: ~1.6x the time of
/// one into allocated blocks on ext4, see `file_write/.../file={sparse,zeroed}`). A faster
/// stream's flushes cover more and it would only pay the second write in bandwidth.
const ZERO_AHEAD_BELOW_BATCH: u64 = 64 * 1024;
/// Bytes of zeros written ahead of a commit-bound stream's appends at a time.
const ZERO_AHEAD: u64 = 256 * 1024;

/// WAL of one timeline in segment files.
#[derive(Debug)]
pub struct WalFileStore {
    dir: PathBuf,
    /// Invariant: a valid segment size (power of two, 1 MiB..=1 GiB).
    seg_size: u64,
    opts: WalFileOptions,
    /// End of the bytes written to the OS.
    write_lsn: Lsn,
    /// End of the last complete record written. Invariant: `<= write_lsn`.
    write_record_lsn: Lsn,
    /// End of the bytes known durable. Invariant: `flush_record_lsn <= flush_byte_lsn <= write_lsn`.
    flush_byte_lsn: Lsn,
    /// End of the last complete record that is durable (reported as `flush_lsn()`).
    /// Invariant: `<= write_record_lsn`.
    flush_record_lsn: Lsn,
    /// Fed every written byte; positioned at `write_lsn`.
    decoder: WalStreamDecoder,
    /// The `.partial` segment holding `write_lsn`, if open (the LRU of [`OpenFiles`] may close
    /// it, after an fsync if it has unsynced writes).
    file: Slot,
    /// Accepted (decoded, counted in `write_lsn`) but not yet written to the OS: the bytes just
    /// before `write_lsn`, never across a segment end. Written out before any fsync, truncation
    /// or larger write, so durability is unchanged; readers only read up to `flush_lsn`.
    /// Invariant: `flush_byte_lsn <= write_lsn - pending.len()`, `pending.len() <= COALESCE_MAX`.
    pending: Vec<u8>,
    /// True from start-up until the first successful truncation (and during one): writes are
    /// refused, as the tail past the recovered end may hold garbage of an older term.
    pending_truncation: bool,
    /// Background preparation of the next segment.
    prep: Preparer,
    /// `(segno, offset)`: the `.partial` segment `segno` holds written blocks (WAL or zeros)
    /// up to `offset`; `None`: nothing known past `write_lsn`.
    allocated: Option<(u64, u64)>,
    /// The background zero-fill of the open segment, if one was started (see [`fill`]).
    fill: Option<Fill>,
    /// Whether the last flush covered less than [`ZERO_AHEAD_BELOW_BATCH`] (zeros are then
    /// written ahead of appends into sparse space).
    commit_bound: bool,
    /// `(segno, dirty_to)`: segment `segno` was made by this store (a new sparse or zeroed file,
    /// a prepared one, one of the node's pool: zeros throughout) and holds nothing but zeros at
    /// and past offset `dirty_to`, every byte this store wrote into it other than zeros lying
    /// below. A truncation inside it then zeroes `[end, dirty_to)` in place and keeps its
    /// blocks allocated, instead of cutting the file and leaving the appends after it to
    /// allocate blocks again. `None`: nothing known (a segment found on disk).
    /// Invariant: `dirty_to` is raised before each write of WAL (or of the first segment's
    /// image) into the segment, never after.
    fresh: Option<(u64, u64)>,
    /// Released for an eviction ([`WalFileStore::release`]): every write is refused.
    released: bool,
}

/// The lowest-numbered segment file (complete or `.partial`) in timeline directory `dir`.
pub fn first_local_segment(fs: &Fs, dir: &Path, seg_size: u64) -> Result<Option<u64>> {
    let names = fs
        .list_dir(dir)
        .map_err(|e| Error::io(format!("reading {}", dir.display()), e))?;
    Ok(names
        .iter()
        .filter_map(|n| parse_xlog_file_name(n, seg_size).map(|(segno, _)| segno))
        .min())
}

/// Removes the segment files (complete or `.partial`) numbered below `below` from timeline
/// directory `dir` and fsyncs the directory (unless `no_sync`) before it returns how many it
/// removed. The caller makes sure no writer is at those segments: the timeline manager removes
/// only below the persisted commit LSN's segment, which the writer has passed for good.
pub fn remove_segments_below(
    fs: &Fs,
    dir: &Path,
    seg_size: u64,
    below: u64,
    no_sync: bool,
) -> Result<usize> {
    let ctx = || format!("listing {}", dir.display());
    let mut segs: Vec<(u64, String)> = fs
        .list_dir(dir)
        .map_err(|e| Error::io(ctx(), e))?
        .into_iter()
        .filter_map(|n| parse_xlog_file_name(&n, seg_size).map(|(segno, _)| (segno, n)))
        .filter(|(segno, _)| *segno < below)
        .collect();
    segs.sort_unstable();
    for (_, name) in &segs {
        let path = dir.join(name);
        fs.remove_file(&path)
            .map_err(|e| Error::io(format!("removing {}", path.display()), e))?;
    }
    if !segs.is_empty() && !no_sync {
        fsync_dir(fs, dir)?;
    }
    Ok(segs.len())
}

impl WalFileStore {
    /// Opens the WAL in `dir` (created if missing) with segments of `seg_size` bytes, recovering
    /// the end of WAL by decoding from `commit_lsn` (the control file's). With `commit_lsn`
    /// invalid (0) the store starts empty. Fails, naming both LSNs, if the WAL on disk ends
    /// below `commit_lsn`: committed WAL would be lost. Every byte recovery decoded is made
    /// durable before this returns ([`sync_recovered_wal`]). Writes are refused until the first
    /// [`WalStore::truncate_wal`].
    pub fn open(
        dir: impl Into<PathBuf>,
        seg_size: u64,
        commit_lsn: Lsn,
        opts: WalFileOptions,
    ) -> Result<WalFileStore> {
        let dir = dir.into();
        if !is_valid_seg_size(seg_size) {
            return Err(Error::Rejected(format!(
                "invalid WAL segment size {seg_size}: must be a power of two in 1 MiB..=1 GiB"
            )));
        }
        let fs = &opts.fs;
        fs.create_dir_all(&dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
        // Half-made segments of a previous run.
        for name in [TMP_SEGMENT_NAME, PREPARED_SEGMENT_NAME] {
            match fs.remove_file(&dir.join(name)) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io(format!("removing a leftover {name}"), e)),
            }
        }
        let end = if commit_lsn.is_valid() {
            let end = find_end_of_wal(
                fs,
                &dir,
                seg_size,
                opts.major,
                commit_lsn,
                opts.wal_start_lsn,
            )?;
            if end < commit_lsn {
                return Err(Error::Corruption {
                    file: dir.display().to_string(),
                    reason: format!(
                        "WAL ends at {end}, below commit_lsn {commit_lsn} from the control file: \
                         refusing to start, committed WAL would be lost"
                    ),
                });
            }
            // Every byte recovery decoded is durable before the store reports it: a crash
            // that kept the page cache may have left it un-synced.
            if !opts.no_sync {
                sync_recovered_wal(fs, &dir, seg_size, commit_lsn, end)?;
            }
            end
        } else {
            Lsn::INVALID
        };
        tracing::info!(dir = %dir.display(), %commit_lsn, end_of_wal = %end, "WAL store opened");
        let prep = Preparer::new(&dir, seg_size, &opts);
        let file = opts.open_files.slot(opts.no_sync);
        Ok(WalFileStore {
            decoder: WalStreamDecoder::new(end, seg_size, opts.major),
            dir,
            seg_size,
            opts,
            write_lsn: end,
            write_record_lsn: end,
            flush_byte_lsn: end,
            flush_record_lsn: end,
            file,
            pending: Vec::new(),
            pending_truncation: true,
            prep,
            allocated: None,
            fill: None,
            commit_bound: false,
            fresh: None,
            released: false,
        })
    }

    /// Waits until a segment being prepared is ready (tests make the background deterministic
    /// with it).
    #[cfg(test)]
    fn wait_for_prepared_segment(&self) {
        self.prep.wait();
    }

    /// Waits until the background zero-fill of the open segment (if any) has ended.
    #[cfg(test)]
    fn wait_for_fill(&self) {
        if let Some(f) = &self.fill {
            f.wait();
        }
    }

    /// Lets go of the store's files for an eviction: stops the background zero-fill and
    /// segment preparation (waiting for them, and removing a prepared segment), closes the open
    /// segment and frees the gathering buffer. Every later write or truncation is refused, so
    /// no WAL can go into a file that the eviction then removes. Refused (and nothing changes)
    /// while written WAL is not durable.
    pub fn release(&mut self) -> Result<()> {
        if !self.pending.is_empty() || self.flush_byte_lsn != self.write_lsn {
            return Err(Error::Rejected(format!(
                "cannot release the WAL store: WAL up to {} is written, durable only up to {}",
                self.write_lsn, self.flush_byte_lsn
            )));
        }
        self.released = true;
        self.fill = None;
        self.allocated = None;
        self.fresh = None;
        drop(self.file.take());
        self.prep.stop()?;
        self.pending = Vec::new();
        Ok(())
    }

    /// The timeline directory holding the segments.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Segment size in bytes.
    pub fn seg_size(&self) -> u64 {
        self.seg_size
    }

    /// End of the bytes known durable (may be mid-record; see [`WalStore::flush_lsn`]).
    pub fn flush_byte_lsn(&self) -> Lsn {
        self.flush_byte_lsn
    }

    /// End of the bytes handed to the OS: `write_lsn` minus small appends still gathered in
    /// memory (they reach the file before any fsync). A crash that keeps the page cache (kill -9)
    /// keeps exactly this much.
    pub fn os_write_lsn(&self) -> Lsn {
        Lsn(self.write_lsn.0 - self.pending.len() as u64)
    }

    /// A reader of this store's segments.
    pub fn reader(&self) -> WalReader {
        WalReader::on(self.opts.fs.clone(), self.dir.clone(), self.seg_size)
    }

    /// Appends the WAL bytes `[from, to)` to `out` (see [`WalReader::read`]).
    pub fn read_wal(&self, from: Lsn, to: Lsn, out: &mut Vec<u8>) -> Result<()> {
        self.reader().read(from, to, out)
    }

    /// Deletes every segment file numbered `segno` or lower. Refused for the segment being
    /// written. Not fsynced: a deletion lost in a crash only leaves an old segment behind.
    /// Returns the number of files removed.
    pub fn remove_segments_up_to(&mut self, segno: u64) -> Result<usize> {
        if self.write_lsn.is_valid() && segno >= self.write_lsn.segment_number(self.seg_size) {
            return Err(Error::Rejected(format!(
                "cannot remove segment {segno}: WAL is being written at {}",
                self.write_lsn
            )));
        }
        let mut removed = 0;
        for (n, _partial, path) in self.list_segments()? {
            if n <= segno {
                self.opts
                    .fs
                    .remove_file(&path)
                    .map_err(|e| Error::io(format!("removing {}", path.display()), e))?;
                removed += 1;
            }
        }
        Ok(removed)
    }

    /// Deletes every segment file numbered below `below`, in ascending order, then fsyncs the
    /// directory (unless `no_sync`), so that no crash leaves a gap below a kept segment.
    /// Refused for the segment being written. Returns the number of files removed.
    pub fn remove_segments_below(&mut self, below: u64) -> Result<usize> {
        if below == 0 {
            return Ok(0);
        }
        if self.write_lsn.is_valid() && below > self.write_lsn.segment_number(self.seg_size) {
            return Err(Error::Rejected(format!(
                "cannot remove segments below {below}: WAL is being written at {}",
                self.write_lsn
            )));
        }
        remove_segments_below(
            &self.opts.fs,
            &self.dir,
            self.seg_size,
            below,
            self.opts.no_sync,
        )
    }

    fn list_segments(&self) -> Result<Vec<(u64, bool, PathBuf)>> {
        let ctx = || format!("listing {}", self.dir.display());
        let mut out = Vec::new();
        for name in self
            .opts
            .fs
            .list_dir(&self.dir)
            .map_err(|e| Error::io(ctx(), e))?
        {
            if let Some((segno, partial)) = parse_xlog_file_name(&name, self.seg_size) {
                out.push((segno, partial, self.dir.join(name)));
            }
        }
        Ok(out)
    }

    fn sync(&self, file: &dyn FileHandle, path: &Path, kind: SyncKind) {
        if !self.opts.no_sync {
            fsync_or_abort(file, path, kind);
        }
    }

    /// Runs `f` on the open `.partial` file of segment `segno`, opening it (or creating the
    /// segment) if needed.
    fn with_segment<R>(
        &mut self,
        segno: u64,
        mut f: impl FnOnce(&mut OpenSegment) -> Result<R>,
    ) -> Result<R> {
        loop {
            f = match self.file.try_with(segno, f) {
                Ok(r) => return r,
                Err(f) => f,
            };
            let seg = self.open_for_write(segno)?;
            self.file.install(seg);
        }
    }

    /// Opens segment `segno` for writing under its `.partial` name, creating it if needed.
    fn open_for_write(&mut self, segno: u64) -> Result<OpenSegment> {
        let (file, path) = match open_segment(&self.opts.fs, &self.dir, segno, self.seg_size)? {
            Some((file, path, true)) => (file, path),
            Some((file, full, false)) => {
                // A completed segment is being rewritten (only after a truncation that
                // crashed before renaming it): it is the current one again.
                let path = segment_path(&self.dir, segno, self.seg_size, true);
                durable_rename(&self.opts.fs, &full, &path, &self.dir, self.opts.no_sync)?;
                (file, path)
            }
            None => self.new_segment(segno)?,
        };
        Ok(OpenSegment {
            segno,
            path,
            file,
            dirty: false,
        })
    }

    /// Creates segment `segno`: the prepared one renamed in if it is ready, else a new sparse
    /// (or zero-filled) file. Then starts preparing the next one if WAL arrives slowly.
    fn new_segment(&mut self, segno: u64) -> Result<(SegmentFile, PathBuf)> {
        // The previous segment's fill is stopped (and waited for) before another segment is
        // written.
        self.fill = None;
        let created = match self.prep.take(segno)? {
            Some(prepared) => {
                self.allocated = Some((segno, self.seg_size));
                prepared
            }
            None => {
                let created = create_segment(&self.dir, segno, self.seg_size, &self.opts)?;
                self.allocated = Some((
                    segno,
                    if self.opts.zero_fill {
                        self.seg_size
                    } else {
                        0
                    },
                ));
                created
            }
        };
        self.prep.segment_opened(segno);
        // Zeros throughout (a write into it marks itself after this, see `dirtying`).
        self.fresh = Some((segno, 0));
        Ok(created)
    }

    /// WAL (or the first segment's image) is about to be written below `end` in segment
    /// `segno`: a fresh segment's zeros end there at the latest (see `fresh`). Unless it is the
    /// fresh segment already (it exists then: only truncation removes segments, and it keeps
    /// that one), opens (or creates) it first, so a segment made for this very write is marked
    /// too.
    fn dirtying(&mut self, segno: u64, end: u64) -> Result<()> {
        if self.fresh.is_none_or(|(s, _)| s != segno) {
            self.with_segment(segno, |_| Ok(()))?;
        }
        if let Some((s, dirty_to)) = &mut self.fresh
            && *s == segno
        {
            *dirty_to = (*dirty_to).max(end);
        }
        Ok(())
    }

    /// Writes the gathered bytes to their segment. On failure they stay gathered (a retry
    /// rewrites them at the same offset).
    fn write_out_pending(&mut self) -> Result<()> {
        if self.pending.is_empty() {
            return Ok(());
        }
        let start = Lsn(self.write_lsn.0 - self.pending.len() as u64);
        let segno = start.segment_number(self.seg_size);
        let off = start.segment_offset(self.seg_size);
        self.dirtying(segno, off + self.pending.len() as u64)?;
        let pending = std::mem::take(&mut self.pending);
        let written = self.with_segment(segno, |seg| {
            seg.dirty = true;
            seg.file
                .write_all_at(&pending, off)
                .map_err(|e| Error::io(format!("writing {} at {start}", seg.path.display()), e))
        });
        self.pending = pending;
        if written.is_ok() {
            self.pending.clear(); // keeps the capacity
        }
        written
    }

    /// Before WAL `[off, end)` of segment `segno` is accepted (`off` is `write_lsn`'s offset):
    /// for a commit-bound stream, makes sure the blocks under it are allocated by writing
    /// [`ZERO_AHEAD`] bytes of zeros from the first byte not known to be allocated, and then
    /// starts zero-filling the rest of the segment in the background ([`fill`]), which spares
    /// the later commits of this segment the zeros. Only ever at or past `write_lsn`, where the
    /// segment holds no WAL (gathered bytes lie below it). With a fill running, every write
    /// (commit-bound or not) first claims its range from it, so the fill never writes over WAL.
    /// Best effort: if the zeros cannot be written, the WAL write says why. Not under
    /// `no_sync`: allocated blocks only spare an fdatasync its metadata, and without one the
    /// zeros would double what is written and stall every commit that crosses into the next
    /// [`ZERO_AHEAD`] (every 32nd 8 KiB commit, by 0.3 ms).
    fn zero_ahead(&mut self, segno: u64, off: u64, end: u64) {
        if self.opts.zero_fill || self.opts.no_sync {
            return;
        }
        if self.allocated.is_none_or(|(s, _)| s != segno) {
            // The segment is opened (or made) first: a prepared or pooled one is allocated
            // throughout, and writing zeros over it, or starting its fill, would only compete
            // with the commits for the disk. An error here surfaces at the write itself.
            let _ = self.with_segment(segno, |_| Ok(()));
        }
        let known = match self.allocated {
            Some((s, a)) if s == segno => a,
            _ => 0,
        };
        if end <= known {
            return;
        }
        let to = if self.commit_bound {
            (end + ZERO_AHEAD).min(self.seg_size)
        } else {
            end
        };
        let mut from = known.max(off);
        let filling = self.fill.as_ref().filter(|f| f.segno() == segno);
        if let Some(fill) = filling {
            match fill.claim(off, end, to) {
                Claim::Allocated { allocated } => {
                    self.allocated = Some((segno, allocated));
                    return;
                }
                Claim::ZeroItself { from: f } => from = f,
            }
        }
        let filling = filling.is_some();
        // `from < end`: `known < end` above, and `off < end`.
        if !self.commit_bound || from >= to {
            return;
        }
        let zeroed = self.with_segment(segno, |seg| {
            seg.dirty = true;
            write_zeros(&*seg.file, from, to, Zeros::Pages)
                .map(|()| seg.path.clone())
                .map_err(|e| Error::io(format!("writing zeros ahead in {}", seg.path.display()), e))
        });
        match zeroed {
            Ok(path) => {
                self.allocated = Some((segno, to));
                if !filling && to < self.seg_size {
                    // The previous segment's fill ended with it (dropped, joined).
                    self.fill = None;
                    self.fill = Fill::start(
                        &self.opts.fs,
                        &path,
                        segno,
                        to,
                        self.seg_size,
                        &self.opts.background,
                    );
                }
            }
            Err(e) => tracing::debug!("{e}"),
        }
    }

    /// The write reached the end of segment `segno`: make it durable and give it its final name.
    fn complete_segment(&mut self, segno: u64) -> Result<()> {
        debug_assert!(self.pending.is_empty(), "pending bytes at a segment end");
        let (file, path) = match self.file.take() {
            Some(seg) if seg.segno == segno => (seg.file, seg.path),
            // Evicted since the write (which fsynced it, if written): opened again to sync.
            _ => match open_segment(&self.opts.fs, &self.dir, segno, self.seg_size)? {
                Some((file, path, true)) => (file, path),
                _ => return Err(unreachable_segment(segno)),
            },
        };
        // The segment is durable before it is renamed to its final name. The rename itself is
        // not fsynced: recovery and truncation look for both names.
        self.sync(&*file, &path, SyncKind::Data);
        let full = segment_path(&self.dir, segno, self.seg_size, false);
        self.opts.fs.rename(&path, &full).map_err(|e| {
            Error::io(
                format!("renaming {} to {}", path.display(), full.display()),
                e,
            )
        })?;
        self.flush_byte_lsn = self.write_lsn;
        self.flush_record_lsn = self.write_record_lsn;
        Ok(())
    }
}

impl WalFileStore {
    fn refuse_if_released(&self) -> Result<()> {
        if self.released {
            return Err(Error::Rejected(format!(
                "the WAL store of {} was released (the timeline is being evicted)",
                self.dir.display()
            )));
        }
        Ok(())
    }
}

/// Local invariant breach in `complete_segment` turned into an error rather than a panic.
fn unreachable_segment(segno: u64) -> Error {
    Error::Rejected(format!(
        "internal: segment {segno} completed but its .partial file is missing"
    ))
}

impl WalStore for WalFileStore {
    fn write_lsn(&self) -> Lsn {
        self.write_lsn
    }

    fn write_record_lsn(&self) -> Lsn {
        self.write_record_lsn
    }

    fn flush_lsn(&self) -> Lsn {
        self.flush_record_lsn
    }

    fn write_wal(&mut self, start: Lsn, buf: &[u8]) -> Result<()> {
        if sk_core::failpoint::active("wal-write-enospc") {
            return Err(Error::io(
                format!("writing WAL at {start} (failpoint)"),
                std::io::Error::from_raw_os_error(libc::ENOSPC),
            ));
        }
        self.refuse_if_released()?;
        if self.pending_truncation {
            return Err(Error::Rejected(format!(
                "write at {start} refused: WAL must be truncated after start-up first"
            )));
        }
        if self.write_lsn.is_valid() && start != self.write_lsn {
            let what = if start > self.write_lsn {
                "gap"
            } else {
                "rewrite"
            };
            return Err(Error::Rejected(format!(
                "{what}: write at {start} but WAL is written up to {}",
                self.write_lsn
            )));
        }
        if !self.write_lsn.is_valid() {
            // An empty store takes the first write's position as its start.
            self.decoder = WalStreamDecoder::new(start, self.seg_size, self.opts.major);
            (self.write_lsn, self.write_record_lsn) = (start, start);
            (self.flush_byte_lsn, self.flush_record_lsn) = (start, start);
        }
        let mut rest = buf;
        while !rest.is_empty() {
            let pos = self.write_lsn;
            let segno = pos.segment_number(self.seg_size);
            let off = pos.segment_offset(self.seg_size);
            let n = ((self.seg_size - off) as usize).min(rest.len());
            let (piece, tail) = rest.split_at(n);
            // Decode before writing: WAL that does not decode never reaches the disk.
            let mut decoder = self.decoder.clone();
            let last_end = decoder.feed(piece).map_err(|e| {
                Error::Rejected(format!("WAL written at {pos} does not decode: {e}"))
            })?;
            self.zero_ahead(segno, off, off + n as u64);
            if piece.len() < COALESCE_BELOW && off + (n as u64) < self.seg_size {
                // Gathered; written out with its neighbours (before any fsync).
                if self.pending.len() + piece.len() > COALESCE_MAX {
                    self.write_out_pending()?;
                }
                // The segment exists as soon as WAL is accepted into it (creation errors, such
                // as a full disk, surface at this append), only the pwrite is deferred.
                self.with_segment(segno, |_| Ok(()))?;
                self.pending.extend_from_slice(piece);
            } else {
                self.write_out_pending()?;
                self.dirtying(segno, off + n as u64)?;
                self.with_segment(segno, |seg| {
                    seg.dirty = true;
                    seg.file.write_all_at(piece, off).map_err(|e| {
                        Error::io(format!("writing {} at {pos}", seg.path.display()), e)
                    })
                })?;
            }
            self.decoder = decoder;
            self.write_lsn = Lsn(pos.0 + n as u64);
            if let Some(end) = last_end {
                self.write_record_lsn = end;
            }
            if off + n as u64 == self.seg_size {
                self.complete_segment(segno)?;
            }
            rest = tail;
        }
        Ok(())
    }

    fn truncate_wal(&mut self, end: Lsn) -> Result<()> {
        self.refuse_if_released()?;
        if self.write_record_lsn.is_valid() && end > self.write_record_lsn {
            return Err(Error::Rejected(format!(
                "truncation to {end} above the end of WAL {}",
                self.write_record_lsn
            )));
        }
        if !self.pending_truncation && end == self.write_lsn && end == self.flush_record_lsn {
            return Ok(());
        }
        // Gathered bytes below `end` are kept (written now), those above it are discarded.
        if end.0 > self.write_lsn.0 - self.pending.len() as u64 {
            self.write_out_pending()?;
        } else {
            self.pending.clear();
        }
        self.pending_truncation = true;
        let end_segno = end.segment_number(self.seg_size);
        let end_off = end.segment_offset(self.seg_size);
        // What is known of `end`'s segment: the zeros it holds past what this store wrote, and
        // its allocated blocks (kept if it is zeroed in place below).
        let fresh = self.fresh.take().filter(|(s, _)| *s == end_segno);
        let allocated = self.allocated.filter(|(s, _)| *s == end_segno);
        // A sparse tail past `end` is deallocated below; no fill may write there meanwhile
        // (dropping it stops it and waits for it).
        self.allocated = None;
        self.fill = None;
        // LSNs move first: the deletions below cannot be undone, so nothing may report WAL
        // past `end` from here on, even if truncation fails half-way.
        self.write_lsn = end;
        self.write_record_lsn = end;
        self.flush_byte_lsn = end;
        self.flush_record_lsn = end;
        self.decoder = WalStreamDecoder::new(end, self.seg_size, self.opts.major);
        // Closed unsynced: what it holds past `end` is discarded, the rest is synced below.
        drop(self.file.take());

        // 1. Zero everything after `end` in its segment and make it durable first: from then on
        //    recovery can never decode past `end`, whatever is left in later segments.
        let fs = self.opts.fs.clone();
        let existing = open_segment(&fs, &self.dir, end_segno, self.seg_size)?;
        let seg = match existing {
            Some(s) => Some(s),
            None if end_off != 0 => {
                let (f, p) = create_segment(&self.dir, end_segno, self.seg_size, &self.opts)?;
                Some((f, p, true))
            }
            None => None,
        };
        if let Some((f, path, partial)) = seg {
            if let Some((_, dirty_to)) = fresh {
                // Only `[end, dirty_to)` may hold anything but zeros: zeroed in place, the
                // segment keeps its blocks (and stays fresh, with nothing written past `end`).
                if end_off < dirty_to {
                    write_zeros(&*f, end_off, dirty_to, Zeros::Pages)
                } else {
                    Ok(())
                }
            } else if self.opts.zero_fill {
                write_zeros(&*f, end_off, self.seg_size, Zeros::Bulk)
            } else {
                f.set_len(end_off).and_then(|()| f.set_len(self.seg_size))
            }
            .map_err(|e| Error::io(format!("zeroing {} after {end}", path.display()), e))?;
            // fsync, not fdatasync: a cut file's size changed twice.
            self.sync(&*f, &path, SyncKind::All);
            if !partial {
                let p = segment_path(&self.dir, end_segno, self.seg_size, true);
                fs.rename(&path, &p)
                    .map_err(|e| Error::io(format!("renaming {}", path.display()), e))?;
            }
        }
        // 2. Delete later segments (and a leftover temporary file).
        for (segno, _partial, path) in self.list_segments()? {
            if segno > end_segno {
                fs.remove_file(&path)
                    .map_err(|e| Error::io(format!("removing {}", path.display()), e))?;
            }
        }
        let _ = fs.remove_file(&self.dir.join(TMP_SEGMENT_NAME));
        // 3. A segment that ends exactly at `end` is complete: give it its final name.
        if end_off == 0 && end_segno > 0 {
            let prev = segment_path(&self.dir, end_segno - 1, self.seg_size, true);
            if fs.exists(&prev) {
                let full = segment_path(&self.dir, end_segno - 1, self.seg_size, false);
                fs.rename(&prev, &full)
                    .map_err(|e| Error::io(format!("renaming {}", prev.display()), e))?;
            }
        }
        // 4. Make the deletions and renames durable.
        if !self.opts.no_sync {
            fsync_dir(&fs, &self.dir)?;
        }
        if let Some((segno, dirty_to)) = fresh {
            self.fresh = Some((segno, dirty_to.min(end_off)));
            self.allocated = allocated;
        }
        self.pending_truncation = false;
        Ok(())
    }

    fn flush_wal(&mut self) -> Result<()> {
        if self.flush_byte_lsn == self.write_lsn {
            return Ok(());
        }
        self.commit_bound = self.write_lsn.0 - self.flush_byte_lsn.0 < ZERO_AHEAD_BELOW_BATCH;
        self.write_out_pending()?;
        // The gathering buffer's memory goes with each flush: a timeline that stops writing
        // would otherwise keep its last batch's capacity for good (7 KiB of every idle
        // timeline's ~25 KiB, heap profile of 2000 timelines after one 8 KiB commit each).
        self.pending = Vec::new();
        let no_sync = self.opts.no_sync;
        let synced = self.file.with_open(|seg| {
            if !no_sync {
                fsync_or_abort(&*seg.file, &seg.path, SyncKind::Data);
            }
            seg.dirty = false;
        });
        match synced {
            Some(()) => {}
            None => {
                // Not open (evicted, which fsynced it, or after an I/O error): sync the segment
                // holding the last byte.
                let last = Lsn(self.write_lsn.0 - 1).segment_number(self.seg_size);
                if let Some((f, path, _)) =
                    open_segment(&self.opts.fs, &self.dir, last, self.seg_size)?
                {
                    self.sync(&*f, &path, SyncKind::Data);
                }
            }
        }
        self.flush_byte_lsn = self.write_lsn;
        self.flush_record_lsn = self.write_record_lsn;
        if let Some(pool) = &self.opts.pool {
            pool.flushed();
        }
        Ok(())
    }

    fn initialize_first_segment(&mut self, init_lsn: Lsn) -> Result<()> {
        if self.write_lsn.is_valid() {
            return Err(Error::Rejected(format!(
                "initialize_first_segment({init_lsn}) on a store holding WAL up to {}",
                self.write_lsn
            )));
        }
        let image = first_segment_image(
            self.opts.major,
            self.opts.system_id,
            self.seg_size,
            init_lsn,
        )
        .map_err(|e| Error::Rejected(e.to_string()))?;
        let segno = init_lsn.segment_number(self.seg_size);
        self.dirtying(segno, image.len() as u64)?;
        self.with_segment(segno, |seg| {
            seg.file
                .write_all_at(&image, 0)
                .map_err(|e| Error::io(format!("writing {}", seg.path.display()), e))
        })?;
        // Closed unsynced: the truncation that follows syncs the segment, and this is redone if
        // lost.
        drop(self.file.take());
        Ok(())
    }
}
