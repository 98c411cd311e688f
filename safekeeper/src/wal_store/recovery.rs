//! Recovery: finding the end of WAL at start-up ([`find_end_of_wal`], decoding from the
//! persisted `commit_lsn`) and verifying the committed WAL below it ([`verify_committed_wal`]).
//! Both decode records (page headers, CRC-32C, `xl_prev` links); together they refuse a timeline
//! whose committed WAL is missing or corrupt.
//!
//! Not here: acting on the result (the store refuses to open when WAL ends below `commit_lsn`:
//! [`super::WalFileStore::open`]; the timeline refuses to start on a verification failure).

use std::path::Path;

use pg_wal::WalStreamDecoder;
use pg_wal::format::{PageHeader, XLOG_PAGE_MAGIC, is_valid_seg_size};
use sk_core::storage::durable::{fsync_dir, fsync_or_abort};
use sk_core::storage::fs::{Fs, SyncKind, read_full_at};
use sk_core::storage::{Error, Result};
use sk_core::types::Lsn;

use super::reader::WalReader;
use super::segment::open_segment_ro;

/// Bytes read per call while recovering.
const RECOVERY_READ_CHUNK: usize = 128 << 10;
/// Bytes read per call while verifying committed WAL.
const VERIFY_READ_CHUNK: u64 = 4 << 20;

/// Start-up recovery: the end of the last valid record of the WAL in `dir`, decoding from the
/// record boundary `start` (the persisted `commit_lsn`). Decoding stops at the first invalid
/// page header or record, a missing segment or a short file.
///
/// The result is below `start` when WAL that must precede `start` is missing: the segment
/// holding `start` is absent (and `start` is not its first byte), or, when `wal_start` is valid
/// and below `start`, the page holding the byte before `start` has no valid header. Then the
/// returned LSN is the start of the missing segment or page.
pub fn find_end_of_wal(
    fs: &Fs,
    dir: &Path,
    seg_size: u64,
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
        let mut hdr = [0u8; 24];
        let page = probe.page_start();
        let ok = f
            .read_exact_at(&mut hdr, page.segment_offset(seg_size))
            .ok()
            .and_then(|()| PageHeader::decode(&hdr))
            .is_some_and(|h| h.magic == XLOG_PAGE_MAGIC && h.pageaddr == page);
        if !ok {
            tracing::warn!(file = %path.display(), %page, "no valid page header below the start of recovery");
            return Ok(page);
        }
    }
    let mut decoder = WalStreamDecoder::new(start, seg_size);
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
                tracing::info!(file = %path.display(), "end of WAL: {e}");
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
    fsync_dir(fs, dir);
    Ok(())
}

/// Decodes every record of the committed WAL, `[from, commit)`, checking page headers, CRC-32C
/// and `xl_prev` links. [`find_end_of_wal`] only decodes from `commit` on (to find the end of
/// WAL); this catches corruption *below* the commit LSN, which would otherwise be served to
/// readers. Linear in the WAL kept; reads run at page-cache or disk speed.
///
/// A record that does not decode, or committed WAL that ends inside a record, is
/// [`Error::Corruption`] naming `dir`.
pub fn verify_committed_wal(
    fs: &Fs,
    dir: &Path,
    seg_size: u64,
    from: Lsn,
    commit: Lsn,
) -> Result<()> {
    if !from.is_valid() || from >= commit {
        return Ok(());
    }
    let corrupt = |reason: String| Error::Corruption {
        file: dir.display().to_string(),
        reason,
    };
    let reader = WalReader::on(fs.clone(), dir, seg_size);
    let mut decoder = WalStreamDecoder::new(from, seg_size);
    let mut buf = Vec::with_capacity(VERIFY_READ_CHUNK as usize);
    let mut pos = from;
    while pos < commit {
        let end = Lsn(pos.0 + VERIFY_READ_CHUNK.min(commit.0 - pos.0));
        buf.clear();
        reader.read(pos, end, &mut buf)?;
        if let Err(e) = decoder.feed(&buf) {
            return Err(corrupt(format!(
                "{e}, below the commit LSN {commit}: refusing to start, committed WAL would be \
                 lost or served corrupt"
            )));
        }
        pos = end;
    }
    if decoder.last_record_end() != commit {
        return Err(corrupt(format!(
            "committed WAL ends at {} inside a record, not at the commit LSN {commit}: refusing \
             to start",
            decoder.last_record_end()
        )));
    }
    Ok(())
}
