//! Recovery: finding the end of WAL at start-up ([`find_end_of_wal`], decoding from the
//! persisted `commit_lsn`), making what it decoded durable ([`sync_recovered_wal`]) and verifying
//! the committed WAL below it ([`verify_committed_wal`]). All decode records (page headers,
//! CRC-32C, `xl_prev` links); together they refuse a timeline whose committed WAL is missing or
//! corrupt.
//!
//! ## WAL that ends with an `XLOG_SWITCH`
//!
//! After a switch record (rmid 0, info 0x40: `pg_switch_wal()`, `archive_timeout`, some
//! checkpoints) the rest of the segment is padding and WAL continues at the next segment's
//! start; PostgreSQL's `EndRecPtr` after the record *is* that start, and so is the flush LSN the
//! safekeeper acknowledges. PostgreSQL 15 writes the padding as zeros, page headers included
//! (checked with `pg_waldump` and `xxd` on a real segment). The decoder skips the padding
//! unread; start-up needs one more rule: when recovery starts at a segment boundary and the
//! page before it has a zero header, that is a switch's padding, not missing WAL, if the
//! segment's last written page (and the one before it, for a switch header split across
//! pages) decodes up to exactly the segment end (`segment_ends_with_switch`).
//!
//! ## A torn tail or corruption in the middle of the log?
//!
//! Decoding from the commit LSN stops at the first page or record that does not decode, at X.
//! That is the end of WAL only if nothing acknowledged lies beyond X; otherwise taking X as the
//! end silently drops acknowledged (maybe quorum-committed) WAL. As etcd's WAL (`isTornEntry`)
//! and raft-engine (`TolerateTailCorruption` vs. `AbsoluteConsistency`) do, recovery tells the
//! two apart (`check_tail`):
//!
//! 1. Look forward from X, at every 8-byte aligned position, for *valid WAL*: a record whose
//!    CRC-32C checks out (when the position is a page start: after a page header with the right
//!    magic, flags and `xlp_pageaddr`, and the tail of a continued record) and whose `xl_prev`
//!    points at or after the last valid record before X (a record that follows the damage
//!    chains back into it) and before itself.
//! 2. Stop at the first *never-written* sector: an aligned 512-byte sector that reads as zeros
//!    (or is absent: a short or missing segment file), or the zero rest of X's own sector. An
//!    `fdatasync` covers every earlier write of the file, so WAL beyond such a hole was never
//!    acknowledged: it is an out-of-order writeback after a power loss, or the zeroed tail every
//!    segment has past the end of WAL. Found nothing valid before it → a **torn tail**: the WAL
//!    ends at the last valid record before X (and the next truncation zeroes the rest).
//! 3. Found valid WAL at V with no never-written sector in `[X, V)` → the bytes at X were
//!    written and then damaged: **corruption**, start-up refuses with
//!    [`Error::WalCorruption`] naming the segment, X, what was expected there and V.
//!
//! Refinements, and the holes they close:
//! - A record *at* X whose CRC is valid but whose `xl_prev` does not link to the previous record
//!   is stale (an older generation's record: PostgreSQL's guard against recycled pages). That is
//!   an end of WAL, not corruption. (A bit flip in `xl_prev` breaks the CRC, which covers it.)
//! - Valid WAL found from a page start may lie past a never-written sector inside the record
//!   tail that page continues; it counts only if `[X, V)` has no such sector.
//! - Every segment past the end of WAL is zero there (created blank; a truncation zeroes the tail
//!   of its segment and fsyncs it before removing later segments), so a normal start-up finds a
//!   zero sector at once and reads one page.
//!
//! What it cannot tell: corruption of a record that legitimately contains a 512-byte run of
//! zeros (a full-page image of an empty page) looks like a torn tail, as in etcd. The commit-LSN
//! check below still refuses a WAL that ends below the persisted commit LSN, and
//! [`verify_committed_wal`] refuses any damage below it.
//!
//! Not here: acting on the result (the store refuses to open when WAL ends below `commit_lsn`:
//! [`super::WalFileStore::open`]; the timeline refuses to start on a verification failure).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use pg_wal::format::{
    MAX_RECORD_LEN, PageHeader, SIZE_OF_XLOG_RECORD, is_valid_seg_size, page_header_size,
};
use pg_wal::{DecodeError, DecodeErrorKind, PgMajor, WalStreamDecoder, XLOG_BLCKSZ};
use sk_core::storage::durable::{fsync_dir, fsync_or_abort};
use sk_core::storage::fs::{FileHandle, Fs, SyncKind, read_full_at};
use sk_core::storage::{Error, Result};
use sk_core::types::Lsn;

use super::reader::WalReader;
use super::segment::{SegmentFile, open_segment_ro, segment_path};

/// Bytes read per call while recovering.
const RECOVERY_READ_CHUNK: usize = 128 << 10;
/// Bytes read per call while verifying committed WAL.
const VERIFY_READ_CHUNK: u64 = 4 << 20;

/// Start-up recovery: the end of the last valid record of the WAL in `dir`, decoding from the
/// record boundary `start` (the persisted `commit_lsn`). Decoding stops at the first invalid
/// page header or record, a missing segment or a short file. An invalid page or record followed
/// by valid WAL is corruption, not the end of WAL: [`Error::WalCorruption`] (see the module
/// documentation for the rule).
///
/// The result is below `start` when WAL that must precede `start` is missing: the segment
/// holding `start` is absent (and `start` is not its first byte), or, when `wal_start` is valid
/// and below `start`, the page holding the byte before `start` has no valid header. Then the
/// returned LSN is the start of the missing segment or page.
pub fn find_end_of_wal(
    fs: &Fs,
    dir: &Path,
    seg_size: u64,
    major: PgMajor,
    start: Lsn,
    wal_start: Lsn,
) -> Result<Lsn> {
    if !is_valid_seg_size(seg_size) {
        return Err(Error::Rejected(format!(
            "invalid WAL segment size {seg_size}"
        )));
    }
    if wal_start.is_valid() && start > wal_start {
        let probe = Lsn(start.0 - 1);
        let probe_seg = probe.segment_number(seg_size);
        let Some((f, path)) = open_segment_ro(fs, dir, probe_seg, seg_size)? else {
            return Ok(probe.segment_start(seg_size));
        };
        let page = probe.page_start();
        let ok = match page_header_at(&*f, page, seg_size) {
            Some(hdr) if hdr == [0; 24] => {
                // Zeros: never written, or the padding after an XLOG_SWITCH (PostgreSQL zeroes
                // the padding pages' headers too), which is WAL that ends at the segment end.
                start.segment_offset(seg_size) == 0
                    && segment_ends_with_switch(&*f, start.0 - seg_size, seg_size, major, wal_start)
            }
            Some(hdr) => PageHeader::decode(&hdr)
                .is_some_and(|h| h.magic == major.page_magic() && h.pageaddr == page),
            None => false,
        };
        if !ok {
            tracing::warn!(file = %path.display(), %page, "no valid page header below the start of recovery");
            return Ok(page);
        }
    }
    let mut decoder = WalStreamDecoder::new(start, seg_size, major);
    let mut buf = vec![0u8; RECOVERY_READ_CHUNK.min(seg_size as usize)];
    let mut lsn = start;
    loop {
        let segno = lsn.segment_number(seg_size);
        let Some((f, path)) = open_segment_ro(fs, dir, segno, seg_size)? else {
            if lsn == start && lsn.segment_offset(seg_size) != 0 {
                return Ok(lsn.segment_start(seg_size));
            }
            break;
        };
        let mut off = lsn.segment_offset(seg_size);
        while off < seg_size {
            let want = ((seg_size - off) as usize).min(buf.len());
            let n = read_full_at(&*f, &mut buf[..want], off)
                .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
            if n == 0 {
                return Ok(decoder.last_record_end());
            }
            if let Err(e) = decoder.feed(&buf[..n]) {
                check_tail(
                    fs,
                    dir,
                    seg_size,
                    major,
                    &e,
                    decoder.last_valid_record_start(),
                )?;
                tracing::info!(file = %path.display(), "end of WAL (a torn or zeroed tail): {e}");
                return Ok(decoder.last_record_end());
            }
            off += n as u64;
            lsn = Lsn(lsn.0 + n as u64);
            if n < want {
                return Ok(decoder.last_record_end());
            }
        }
    }
    Ok(decoder.last_record_end())
}

/// The 24 bytes of the short header of `page` (in the segment open as `f`), if readable.
fn page_header_at(f: &dyn FileHandle, page: Lsn, seg_size: u64) -> Option<[u8; 24]> {
    let mut hdr = [0u8; 24];
    f.read_exact_at(&mut hdr, page.segment_offset(seg_size))
        .ok()
        .map(|()| hdr)
}

/// Whether the segment starting at `seg_start` (open as `f`) ends with an `XLOG_SWITCH`: its
/// last written page (the last one whose header is not zeros) and the page before it, if any
/// and not below `wal_start`'s page, decode up to exactly the segment end, which only a switch
/// record's padding reaches. Starting one page early covers a switch whose header is split
/// across two pages; a page that continues a long record is decoded from its continuation.
fn segment_ends_with_switch(
    f: &dyn FileHandle,
    seg_start: u64,
    seg_size: u64,
    major: PgMajor,
    wal_start: Lsn,
) -> bool {
    let lowest = wal_start.page_start().0.max(seg_start);
    let mut last = seg_start + seg_size - XLOG_BLCKSZ;
    loop {
        match page_header_at(f, Lsn(last), seg_size) {
            Some(hdr) if hdr == [0; 24] => {}
            Some(_) => break,
            None => return false,
        }
        if last <= lowest {
            return false;
        }
        last -= XLOG_BLCKSZ;
    }
    let from = if last >= lowest + XLOG_BLCKSZ {
        last - XLOG_BLCKSZ
    } else {
        last
    };
    let mut bytes = vec![0u8; (last + XLOG_BLCKSZ - from) as usize];
    if f.read_exact_at(&mut bytes, from - seg_start).is_err() {
        return false;
    }
    let mut dec = WalStreamDecoder::new(Lsn(from), seg_size, major);
    let _ = dec.feed(&bytes);
    let seg_end = Lsn(seg_start + seg_size);
    dec.last_record_end() == seg_end || dec.switch_end() == Some(seg_end)
}

/// Makes the WAL that recovery decoded durable before anyone sees it: fsyncs every segment
/// from the one holding `from` (the persisted commit LSN, where decoding started) to the one
/// holding the last byte before `end`, then the directory `dir` (renames of completed segments,
/// the control file's last rename), or aborts through [`fsync_or_abort`].
///
/// Why: after `kill -9`, or the abort that follows a failed fsync, the bytes the dead process
/// wrote may still be only in the page cache. Recovery decodes them like any other, and the
/// store reports them as durable (`flush_lsn`): the first vote or walsender would reveal WAL a
/// power loss can still take away. PostgreSQL fsyncs its data directory at crash recovery
/// (`recovery_init_sync_method`) and neon's safekeeper syncs its datadir before serving, for the
/// same reason. Below `from` nothing needs it: the commit LSN never passes a process's durable
/// end of WAL (`flush_lsn`), and each process made durable what it recovered.
pub fn sync_recovered_wal(fs: &Fs, dir: &Path, seg_size: u64, from: Lsn, end: Lsn) -> Result<()> {
    let first = from.segment_number(seg_size);
    let last = if end > from {
        Lsn(end.0 - 1).segment_number(seg_size)
    } else {
        first
    };
    for segno in first..=last {
        if let Some((f, path)) = open_segment_ro(fs, dir, segno, seg_size)? {
            // fsync, not fdatasync: the dead process may have changed the size (a truncation).
            fsync_or_abort(&*f, &path, SyncKind::All);
        }
    }
    fsync_dir(fs, dir)?;
    Ok(())
}

/// Decodes every record of the committed WAL, `[from, commit)`, checking page headers, CRC-32C
/// and `xl_prev` links, and returns how many records completed in it. [`find_end_of_wal`] only
/// decodes from `commit` on (to find the end of WAL); this catches corruption *below* the commit
/// LSN, which would otherwise be served to readers. Linear in the WAL kept; reads run at
/// page-cache or disk speed. Also what `wal-verify` runs offline.
///
/// A record that does not decode, or committed WAL that ends inside a record, is
/// [`Error::Corruption`] naming `dir` (start-up adds that it refuses to start).
pub fn verify_committed_wal(
    fs: &Fs,
    dir: &Path,
    seg_size: u64,
    major: PgMajor,
    from: Lsn,
    commit: Lsn,
) -> Result<u64> {
    if !from.is_valid() || from >= commit {
        return Ok(0);
    }
    let corrupt = |reason: String| Error::Corruption {
        file: dir.display().to_string(),
        reason,
    };
    let reader = WalReader::on(fs.clone(), dir, seg_size);
    let mut decoder = WalStreamDecoder::new(from, seg_size, major);
    let mut records = 0u64;
    // Zeroed once: each chunk is read over it (no fill per chunk).
    let mut buf = vec![0u8; VERIFY_READ_CHUNK as usize];
    let mut pos = from;
    while pos < commit {
        let n = VERIFY_READ_CHUNK.min(commit.0 - pos.0) as usize;
        reader.read_into(pos, &mut buf[..n])?;
        let end = Lsn(pos.0 + n as u64);
        if let Err(e) = decoder.feed_with(&buf[..n], |_| records += 1) {
            return Err(corrupt(format!(
                "{e} (after {records} valid records), below the commit LSN {commit}: committed \
                 WAL would be lost or served corrupt"
            )));
        }
        pos = end;
    }
    if decoder.last_record_end() != commit {
        return Err(corrupt(format!(
            "committed WAL ends at {} inside a record, not at the commit LSN {commit}",
            decoder.last_record_end()
        )));
    }
    Ok(records)
}

/// Sector size of the torn-write rule: the unit a disk writes atomically.
const SECTOR: u64 = 512;
/// Pages kept by a [`TailScan`] before it forgets them all.
const SCAN_CACHE_PAGES: usize = 4096;

/// Decoding stopped with `err` (at X); `prev_floor` is the start of the last valid record
/// before X, if known. `Ok` if X is a torn tail (the end of WAL), [`Error::WalCorruption`] if
/// valid WAL follows it without a never-written sector in between. See the module docs.
fn check_tail(
    fs: &Fs,
    dir: &Path,
    seg_size: u64,
    major: PgMajor,
    err: &DecodeError,
    prev_floor: Option<Lsn>,
) -> Result<()> {
    let x = err.lsn;
    let mut scan = TailScan::new(fs, dir, seg_size, major);
    // The rest of X's own sector never written: the usual end of WAL (zeros after the last
    // record).
    let sector_end = x.0.next_multiple_of(SECTOR);
    if sector_end > x.0 && scan.all_zero(x, Lsn(sector_end))? {
        return Ok(());
    }
    // A record at X with a valid CRC is a stale one whose `xl_prev` does not link: the end.
    if let Some((v, _)) = scan.checked_record_from(x)?
        && v == x
    {
        return Ok(());
    }
    let mut p = x.0;
    loop {
        if p.is_multiple_of(SECTOR) && scan.all_zero(Lsn(p), Lsn(p + SECTOR))? {
            return Ok(()); // a never-written sector before any valid WAL: a torn tail
        }
        if let Some((v, prev)) = scan.checked_record_from(Lsn(p))?
            && prev < v
            && prev_floor.is_none_or(|floor| prev >= floor)
            && !scan.zero_sector_in(Lsn(p), v)?
        {
            let (expected, found) = expected_found(err);
            return Err(Error::WalCorruption {
                file: scan.segment_name(x).display().to_string(),
                lsn: x,
                expected,
                found,
                valid_at: v,
            });
        }
        p += 8;
    }
}

/// What a valid WAL has where `err` stopped decoding, and what was there instead.
fn expected_found(err: &DecodeError) -> (String, String) {
    use DecodeErrorKind as K;
    let lsn = err.lsn;
    match &err.kind {
        K::BadCrc { got, computed } => (
            format!("a record whose CRC-32C field matches its bytes ({computed:#010X})"),
            format!("CRC field {got:#010X}"),
        ),
        K::BadMagic { got, expected } => (
            format!(
                "a page header with magic {:#06X} of {expected}",
                expected.page_magic()
            ),
            match PgMajor::from_page_magic(*got) {
                Some(v) => format!("magic {got:#06X} ({v}'s WAL)"),
                None => format!("magic {got:#06X}"),
            },
        ),
        K::BadPageAddr { got } => (
            format!("a page header with xlp_pageaddr {lsn}"),
            format!("xlp_pageaddr {got}"),
        ),
        K::BadPrevLink { got, expected } => (
            format!("a record whose xl_prev is the previous record {expected}"),
            format!("xl_prev {got}"),
        ),
        K::BadRemLen { got, expected } => (
            format!("a continuation page with xlp_rem_len {expected}"),
            format!("xlp_rem_len {got}"),
        ),
        K::RecordTooShort(n) | K::RecordTooLong(n) => (
            format!("a record length from {SIZE_OF_XLOG_RECORD} to {MAX_RECORD_LEN}"),
            format!("xl_tot_len {n}"),
        ),
        K::BadRmgr(r) => (
            "a resource manager id of the timeline's PostgreSQL version".to_string(),
            format!("xl_rmid {r}"),
        ),
        other => ("valid WAL".to_string(), other.to_string()),
    }
}

/// Reads the WAL after the point where decoding stopped, page by page (absent bytes of a short
/// or missing segment read as never written), for [`check_tail`].
struct TailScan<'a> {
    fs: &'a Fs,
    dir: &'a Path,
    seg_size: u64,
    major: PgMajor,
    segments: HashMap<u64, Option<SegmentFile>>,
    /// Page start → the bytes of that page present on disk (shorter than a page, or empty,
    /// when the file ends or is missing).
    pages: HashMap<u64, Vec<u8>>,
}

impl<'a> TailScan<'a> {
    fn new(fs: &'a Fs, dir: &'a Path, seg_size: u64, major: PgMajor) -> TailScan<'a> {
        TailScan {
            fs,
            dir,
            seg_size,
            major,
            segments: HashMap::new(),
            pages: HashMap::new(),
        }
    }

    fn segment_name(&self, lsn: Lsn) -> PathBuf {
        let segno = lsn.segment_number(self.seg_size);
        let partial = segment_path(self.dir, segno, self.seg_size, true);
        if self.fs.exists(&partial) {
            partial
        } else {
            segment_path(self.dir, segno, self.seg_size, false)
        }
    }

    /// The bytes of the page starting at `page` that exist on disk.
    fn page(&mut self, page: Lsn) -> Result<&[u8]> {
        if !self.pages.contains_key(&page.0) {
            if self.pages.len() >= SCAN_CACHE_PAGES {
                self.pages.clear();
            }
            let segno = page.segment_number(self.seg_size);
            if !self.segments.contains_key(&segno) {
                let f = open_segment_ro(self.fs, self.dir, segno, self.seg_size)?.map(|(f, _)| f);
                self.segments.insert(segno, f);
            }
            let mut bytes = vec![0u8; XLOG_BLCKSZ as usize];
            let n = match &self.segments[&segno] {
                Some(f) => read_full_at(&**f, &mut bytes, page.segment_offset(self.seg_size))
                    .map_err(|e| Error::io(format!("reading WAL at {page}"), e))?,
                None => 0,
            };
            bytes.truncate(n);
            self.pages.insert(page.0, bytes);
        }
        Ok(&self.pages[&page.0])
    }

    /// Whether `[from, to)` (inside one page) reads as zeros or is absent: never written.
    fn all_zero(&mut self, from: Lsn, to: Lsn) -> Result<bool> {
        let page = from.page_start();
        let (a, b) = (from.page_offset() as usize, (to.0 - page.0) as usize);
        let bytes = self.page(page)?;
        Ok(bytes
            .get(a..b.min(bytes.len()))
            .is_none_or(|r| r.iter().all(|&x| x == 0)))
    }

    /// Whether an aligned sector inside `[from, to)` was never written.
    fn zero_sector_in(&mut self, from: Lsn, to: Lsn) -> Result<bool> {
        let mut s = from.0.next_multiple_of(SECTOR);
        while s + SECTOR <= to.0 {
            if self.all_zero(Lsn(s), Lsn(s + SECTOR))? {
                return Ok(true);
            }
            s += SECTOR;
        }
        Ok(false)
    }

    /// Decodes from `p` (a candidate record or page start) until the first record whose CRC
    /// checks out, and returns its `(start, xl_prev)`; `None` if decoding fails first or the
    /// bytes run out. Cheap for most positions: a plausible header is checked before decoding.
    fn checked_record_from(&mut self, p: Lsn) -> Result<Option<(Lsn, Lsn)>> {
        let seg_size = self.seg_size;
        let major = self.major;
        let off = p.page_offset() as usize;
        {
            let page = self.page(p.page_start())?;
            if off == 0 {
                let ok = PageHeader::decode(page)
                    .is_some_and(|h| h.magic == major.page_magic() && h.pageaddr == p);
                if !ok {
                    return Ok(None);
                }
            } else {
                if off < page_header_size(p.page_start(), seg_size) || off + 4 > page.len() {
                    return Ok(None);
                }
                let tot_len =
                    u32::from_le_bytes([page[off], page[off + 1], page[off + 2], page[off + 3]]);
                if !(SIZE_OF_XLOG_RECORD as u32..=MAX_RECORD_LEN).contains(&tot_len) {
                    return Ok(None);
                }
                if page
                    .get(off + 17)
                    .is_some_and(|&rmid| !major.is_valid_rmid(rmid))
                {
                    return Ok(None);
                }
            }
        }
        let mut dec = WalStreamDecoder::new(p, seg_size, self.major);
        let mut at = p;
        loop {
            let page_start = at.page_start();
            let from = (at.0 - page_start.0) as usize;
            let page = self.page(page_start)?;
            if page.len() <= from {
                return Ok(None); // ran out of written bytes
            }
            let full = page.len() == XLOG_BLCKSZ as usize;
            let bytes = page[from..].to_vec();
            // Records after the first checked one may fail (the bytes run into zeros): the
            // first one counts.
            let failed = dec.feed(&bytes).is_err();
            if let Some(found) = dec.first_checked_record() {
                return Ok(Some(found));
            }
            if failed {
                return Ok(None);
            }
            if !full {
                return Ok(None);
            }
            at = Lsn(page_start.0 + XLOG_BLCKSZ);
        }
    }
}
