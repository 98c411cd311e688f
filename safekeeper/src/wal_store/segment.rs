//! Segment files: their names (PostgreSQL's `%08X%08X%08X`, `.partial` while being written),
//! opening them, and creating them blank and full-size under a temporary name so that appends
//! into them never change a file size.
//!
//! Not here: what goes into a segment (the store, [`super::WalFileStore`]), preparing one off the
//! ingest path ([`super::prepare`]), recovery ([`super::recovery`]).

use std::path::{Path, PathBuf};

use pg_wal::format::{PG_TLI, xlog_file_name};
use sk_core::storage::durable::{durable_rename, fsync_or_abort};
use sk_core::storage::fs::{FileHandle, Fs, OpenMode, SyncKind};
use sk_core::storage::{Error, Result};

use super::WalFileOptions;

/// Temporary name of a segment being created.
pub const TMP_SEGMENT_NAME: &str = "waltmp";
/// Suffix of the segment being written.
pub const PARTIAL_SUFFIX: &str = ".partial";

/// Path of segment `segno` in `dir`, plain or `.partial`.
pub fn segment_path(dir: &Path, segno: u64, seg_size: u64, partial: bool) -> PathBuf {
    let mut name = xlog_file_name(PG_TLI, segno, seg_size);
    if partial {
        name.push_str(PARTIAL_SUFFIX);
    }
    dir.join(name)
}

/// An open segment file.
pub(super) type SegmentFile = Box<dyn FileHandle>;

/// Opens segment `segno` for reading and writing, `.partial` first, then the plain name.
/// Returns the file, its path and whether it is the `.partial` one; `None` if neither exists.
pub(super) fn open_segment(
    fs: &Fs,
    dir: &Path,
    segno: u64,
    seg_size: u64,
) -> Result<Option<(SegmentFile, PathBuf, bool)>> {
    open_segment_as(fs, dir, segno, seg_size, OpenMode::ReadWrite)
}

/// Opens segment `segno` read-only, `.partial` first, then the plain name.
pub(super) fn open_segment_ro(
    fs: &Fs,
    dir: &Path,
    segno: u64,
    seg_size: u64,
) -> Result<Option<(SegmentFile, PathBuf)>> {
    Ok(open_segment_as(fs, dir, segno, seg_size, OpenMode::Read)?.map(|(f, path, _)| (f, path)))
}

fn open_segment_as(
    fs: &Fs,
    dir: &Path,
    segno: u64,
    seg_size: u64,
    mode: OpenMode,
) -> Result<Option<(SegmentFile, PathBuf, bool)>> {
    for partial in [true, false] {
        let path = segment_path(dir, segno, seg_size, partial);
        match fs.open(&path, mode) {
            Ok(f) => return Ok(Some((f, path, partial))),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(Error::io(format!("opening {}", path.display()), e)),
        }
    }
    Ok(None)
}

/// How [`write_zeros`] writes: the size of its `pwrite`s.
#[derive(Debug, Clone, Copy)]
pub(super) enum Zeros {
    /// One page per `pwrite`, for zeros that small WAL appends will overwrite soon, in the
    /// open segment (zero-ahead). Linux (6.16 on, ext4) gives a write page-cache folios by the
    /// write's length, and every later write into a folio walks all of the folio's blocks
    /// (`ext4_block_write_begin`, `block_commit_write`): zeros written 1 MiB at a time made
    /// each small append into them cost 3x its `pwrite` into a sparse file (wal-bench
    /// `process_msg/fsync=false/commit=false/size=8`: 3.8 µs, 2.0 µs with page-sized zeros,
    /// against 0.7 µs for `pwrite/size=8`).
    Pages,
    /// As [`Zeros::Bulk`], each 64 KiB written back (`sync_file_range`) before the next, with
    /// this pause after it: for background preparation, whose 16 MiB left to the final `fsync`
    /// held a concurrent WAL `fdatasync` of the same disk behind it for 34-47 ms (strace of a
    /// commit-bound stream: the preparation thread's `fsync` and the ingest's `fdatasync` ended
    /// together). Without a pause, 256 KiB pieces gave a max of 5.2-6.9 ms in two rounds and
    /// 820 ms in a third, and a mean commit 1.05-1.54x slower.
    Paced(std::time::Duration),
    /// 64 KiB per `pwrite`, for whole blank segments made off the ingest path (truncation, and
    /// preparation under `--no-sync`): 16 times fewer system calls than pages, folios small
    /// enough for the appends into them (1 MiB pieces put `process_msg` back at 3.5 µs), and a
    /// write-back that costs the commits of other nodes on the same disk less than pages did
    /// (three safekeepers on one disk, page-sized preparation: mean commit 1.4-2x slower in 4
    /// of 4 alternating runs; 64 KiB: 0.6x the mean of the 1 MiB build in 2 of 2).
    Bulk,
}

/// Writes real zeros over `[from, to)` of `f` (allocating the blocks, unlike `set_len`).
pub(super) fn write_zeros(
    f: &dyn FileHandle,
    from: u64,
    to: u64,
    how: Zeros,
) -> std::io::Result<()> {
    const PAGE: usize = 4096;
    let piece = match how {
        Zeros::Pages => PAGE,
        Zeros::Bulk | Zeros::Paced(_) => 64 << 10,
    };
    let zeros = vec![0u8; piece.min((to - from) as usize)];
    let mut off = from;
    let mut written_back = from;
    while off < to {
        // Page-aligned pieces: a page piece never straddles two pages.
        let n = ((to - off) as usize)
            .min(zeros.len())
            .min(piece - (off as usize % PAGE));
        f.write_all_at(&zeros[..n], off)?;
        off += n as u64;
        if let Zeros::Paced(pause) = how
            && (off - written_back >= PACED_WRITE_BACK || off == to)
        {
            // A write-back error is this call's alone: Linux hands it to the first caller that
            // waits (and advances the descriptor's error cursor past it), so the final fsync
            // would succeed over pages that never reached the disk. It fails the fill.
            f.write_back(written_back, off - written_back)?;
            written_back = off;
            if !pause.is_zero() {
                std::thread::sleep(pause);
            }
        }
    }
    Ok(())
}

/// How much of a [`Zeros::Paced`] fill is written back at a time.
const PACED_WRITE_BACK: u64 = 64 << 10;

/// Creates (or empties) the file `path` as a blank segment of `seg_size` bytes, real zeros or
/// sparse, durable at full size unless `no_sync`: appends into it later change no file size,
/// so `fdatasync` is enough for them.
pub(super) fn write_blank_segment(
    fs: &Fs,
    path: &Path,
    seg_size: u64,
    zeros: Option<Zeros>,
    no_sync: bool,
) -> Result<SegmentFile> {
    let f = fs
        .open(path, OpenMode::CreateTruncate)
        .map_err(|e| Error::io(format!("creating {}", path.display()), e))?;
    match zeros {
        Some(how) => write_zeros(&*f, 0, seg_size, how),
        None => f.set_len(seg_size),
    }
    .map_err(|e| Error::io(format!("sizing {}", path.display()), e))?;
    if !no_sync {
        fsync_or_abort(&*f, path, SyncKind::All);
    }
    Ok(f)
}

/// Creates segment `segno` as a blank, full-size `.partial` file ([`write_blank_segment`]) under
/// a temporary name, renamed in durably.
pub(super) fn create_segment(
    dir: &Path,
    segno: u64,
    seg_size: u64,
    opts: &WalFileOptions,
) -> Result<(SegmentFile, PathBuf)> {
    let fs = &opts.fs;
    let tmp = dir.join(TMP_SEGMENT_NAME);
    let path = segment_path(dir, segno, seg_size, true);
    let result = (|| {
        let f = write_blank_segment(
            fs,
            &tmp,
            seg_size,
            opts.zero_fill.then_some(Zeros::Bulk),
            opts.no_sync,
        )?;
        durable_rename(fs, &tmp, &path, dir, opts.no_sync)?;
        Ok(f)
    })();
    match result {
        Ok(f) => Ok((f, path)),
        Err(e) => {
            // Leave no half-made segment behind (e.g. after ENOSPC).
            let _ = fs.remove_file(&tmp);
            Err(e)
        }
    }
}
