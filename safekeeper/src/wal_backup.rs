//! Backup of complete, committed WAL segments to remote storage ([`crate::remote_storage`]),
//! and readers' reads from it ([`RemoteReader`]).
//!
//! A segment is backed up once it is complete (its end is at or below the commit LSN, so no term
//! truncates it) and renamed from `.partial`. Uploads run off the ingest path, at most
//! `--backup-parallelism` at once on the node, each retried with exponential backoff until it
//! succeeds or the daemon stops. `backup_lsn` (the end of the contiguous backed-up prefix)
//! is kept in the control file; after a restart a timeline's first pass lists its remote objects
//! and verifies (instead of uploading) the segments already stored.
//!
//! Not here: which segments to back up and which local ones may be removed
//! ([`crate::manager`]); the store itself ([`crate::remote_storage`]).

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use bytes::Bytes;
#[cfg(test)]
use futures::StreamExt;
use sk_core::types::Lsn;
use tokio::sync::Semaphore;
#[cfg(test)]
use tokio_util::sync::CancellationToken;

use crate::metrics;
pub use crate::remote_storage::{
    BudgetPermit, DEFAULT_REMOTE_READ_BUDGET, LocalSegment, Outcome, REMOTE_READ_RANGE,
    RemoteStorage,
};
use crate::timeline::Timeline;
use crate::wal_store::segment_path;
#[cfg(test)]
use pg_wal::format::{parse_xlog_file_name, xlog_file_name};

#[cfg(test)]
use crate::manager::{FIRST_BACKOFF, MAX_BACKOFF};

/// A timeline's local segment file, read for backup in blocking tasks.
struct SegmentFile {
    tl: Arc<Timeline>,
    segno: u64,
}

impl LocalSegment for SegmentFile {
    async fn read_at(&self, offset: u64, mut buf: Vec<u8>) -> anyhow::Result<Vec<u8>> {
        let (tl, segno) = (self.tl.clone(), self.segno);
        crate::blocking::spawn(move || tl.read_segment_range(segno, offset, &mut buf).map(|()| buf))
            .await
            .context("segment read task")?
            .with_context(|| {
                format!(
                    "reading {} for backup",
                    segment_path(&self.tl.dir, segno, self.tl.seg_size, false).display()
                )
            })
    }
}

/// Node-wide backup settings.
#[derive(Clone)]
pub struct Backup {
    /// The remote store.
    pub storage: Arc<RemoteStorage>,
    /// Bounds the uploads in progress on the node.
    pub permits: Arc<Semaphore>,
    /// Uploads in flight per timeline pass.
    pub parallelism: usize,
}

impl Backup {
    /// Backup to `storage` with at most `parallelism` uploads at once.
    pub fn new(storage: RemoteStorage, parallelism: usize) -> Backup {
        Backup {
            storage: Arc::new(storage),
            permits: Arc::new(Semaphore::new(parallelism.max(1))),
            parallelism: parallelism.max(1),
        }
    }

    /// One backup pass over `tl`: backs up every complete committed segment from `backup_lsn`
    /// on, in order of completion, advancing `backup_lsn` over the contiguous backed-up prefix.
    /// With `listed`, the segments the remote listing shows are verified instead of uploaded.
    /// Each segment is retried with backoff until done or `cancel`. Returns the new backup_lsn.
    /// A pass without the timeline manager ([`crate::manager`]): tests of the store's rules.
    #[cfg(test)]
    pub(crate) async fn backup_pass(
        &self,
        tl: &Arc<Timeline>,
        listed: Option<&std::collections::BTreeSet<u64>>,
        cancel: &CancellationToken,
    ) -> Lsn {
        let seg_size = tl.seg_size;
        let wal_start = tl.wal_start_lsn();
        let backup_lsn = tl.backup_lsn();
        if !wal_start.is_valid() {
            return backup_lsn;
        }
        let from = backup_lsn.max(wal_start);
        let first = from.segment_number(seg_size);
        // Nothing below the first segment of this node's WAL is to back up: the backed-up prefix
        // starts there (else the lag would count the whole LSN space below the timeline start).
        if backup_lsn < Lsn(first * seg_size) {
            crate::blocking::section(|| tl.set_backup_lsn(Lsn(first * seg_size)));
        }
        let end = tl.positions().commit_lsn.segment_number(seg_size);
        let mut done = futures::stream::iter(first..end)
            .map(|segno| {
                let valid_from = if segno == wal_start.segment_number(seg_size) {
                    wal_start.segment_offset(seg_size) as usize
                } else {
                    0
                };
                let known = listed.is_some_and(|l| l.contains(&segno));
                self.backup_with_retries(tl, segno, valid_from, known, cancel)
            })
            .buffered(self.parallelism);
        while let Some(r) = done.next().await {
            match r {
                Some(segno) => {
                    crate::blocking::section(|| tl.set_backup_lsn(Lsn((segno + 1) * seg_size)))
                }
                None => break,
            }
        }
        tl.backup_lsn()
    }

    /// Backs up one segment, retrying with backoff; `None` if cancelled first.
    #[cfg(test)]
    async fn backup_with_retries(
        &self,
        tl: &Arc<Timeline>,
        segno: u64,
        valid_from: usize,
        known: bool,
        cancel: &CancellationToken,
    ) -> Option<u64> {
        let mut backoff = FIRST_BACKOFF;
        loop {
            let result = tokio::select! {
                r = self.upload(tl, segno, valid_from, known) => r,
                _ = cancel.cancelled() => return None,
            };
            if result.is_ok() {
                return Some(segno);
            }
            tokio::select! {
                _ = tokio::time::sleep(backoff) => {}
                _ = cancel.cancelled() => return None,
            }
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
    }

    /// One attempt to back up segment `segno` of `tl` (read from its local file), counted and
    /// logged; see [`RemoteStorage::backup_segment`]. Waits for a node-wide upload permit.
    pub async fn upload(
        &self,
        tl: &Arc<Timeline>,
        segno: u64,
        valid_from: usize,
        known: bool,
    ) -> anyhow::Result<Outcome> {
        let attempt = async {
            let _permit = self.permits.acquire().await.context("backup semaphore")?;
            let started = Instant::now();
            let len = tl.seg_size;
            let file = SegmentFile {
                tl: tl.clone(),
                segno,
            };
            let outcome = self
                .storage
                .backup_segment(&tl.ttid, segno, len, &file, valid_from, known)
                .await?;
            metrics::BACKUP_SECONDS.observe(started.elapsed().as_secs_f64());
            match outcome {
                Outcome::Uploaded => {
                    metrics::BACKUP_UPLOADED_BYTES.inc_by(len);
                    metrics::BACKUP_SEGMENTS
                        .with_label_values(&["uploaded"])
                        .inc();
                }
                Outcome::Verified => metrics::BACKUP_SEGMENTS
                    .with_label_values(&["verified"])
                    .inc(),
            }
            anyhow::Ok(outcome)
        };
        let r = attempt.await;
        if let Err(e) = &r {
            metrics::BACKUP_ERRORS.inc();
            tracing::warn!(segno, "backing up a WAL segment failed (retried): {e:#}");
        }
        r
    }
}

impl Backup {
    /// Uploads the WAL of `tl` below `upto` in its segment (committed and durable here) as a
    /// partial object of the term of `tl`'s newest WAL; bytes before `valid_from` are not this
    /// node's WAL.
    pub async fn upload_partial(
        &self,
        tl: &Arc<Timeline>,
        upto: Lsn,
        valid_from: usize,
    ) -> anyhow::Result<Outcome> {
        let attempt = async {
            let _permit = self.permits.acquire().await.context("backup semaphore")?;
            let seg_size = tl.seg_size;
            let segno = upto.segment_number(seg_size);
            let term = tl.positions().last_log_term.0;
            let t = tl.clone();
            let len = upto.segment_offset(seg_size) as usize;
            let data = crate::blocking::spawn(move || t.read_segment_prefix(segno, len))
                .await
                .context("segment read task")?
                .with_context(|| format!("reading segment {segno} for a partial backup"))?;
            let len = data.len() as u64;
            let outcome = self
                .storage
                .backup_partial(
                    &tl.ttid,
                    seg_size,
                    term,
                    upto,
                    Bytes::from(data),
                    valid_from,
                )
                .await?;
            let label = match outcome {
                Outcome::Uploaded => {
                    metrics::PARTIAL_BACKUP_BYTES.inc_by(len);
                    "uploaded"
                }
                Outcome::Verified => "verified",
            };
            metrics::PARTIAL_BACKUPS.with_label_values(&[label]).inc();
            tracing::info!(%upto, term, outcome = label, "partial segment backed up");
            anyhow::Ok(outcome)
        };
        let r = attempt.await;
        if let Err(e) = &r {
            metrics::BACKUP_ERRORS.inc();
            tracing::warn!(%upto, "backing up a partial segment failed (retried): {e:#}");
        }
        r
    }
}

/// One reader's WAL from remote storage (issue 26, defect 6): ranges of at most
/// [`REMOTE_READ_RANGE`] bytes, one buffered at a time and counted against the node's read
/// budget before it is requested, so 200 readers below the local WAL hold at most
/// `--remote-read-budget` between them, never a segment each.
#[derive(Default)]
pub struct RemoteReader {
    /// The buffered range: where it starts, its bytes, and the budget it holds.
    range: Option<(Lsn, Bytes, BudgetPermit)>,
}

impl RemoteReader {
    /// Whether the segment holding `lsn` is in remote storage (`false` without remote storage).
    pub async fn probe(tl: &Timeline, lsn: Lsn) -> anyhow::Result<bool> {
        let Some(remote) = tl.remote() else {
            return Ok(false);
        };
        remote
            .has_segment(&tl.ttid, lsn.segment_number(tl.seg_size), tl.seg_size)
            .await
    }

    /// Appends WAL `[from, min(to, end of from's segment, end of the range read))` of `tl` from
    /// remote storage to `out` and returns the end of what it appended; `None` if remote storage
    /// is off or does not hold the segment.
    pub async fn read(
        &mut self,
        tl: &Timeline,
        from: Lsn,
        to: Lsn,
        out: &mut Vec<u8>,
    ) -> anyhow::Result<Option<Lsn>> {
        let seg_size = tl.seg_size;
        let covers =
            |r: &(Lsn, Bytes, BudgetPermit)| r.0 <= from && from.0 < r.0.0 + r.1.len() as u64;
        if !self.range.as_ref().is_some_and(covers) {
            // The old range's budget goes back before the next one is asked for.
            self.range = None;
            let Some(remote) = tl.remote() else {
                return Ok(None);
            };
            let segno = from.segment_number(seg_size);
            let off = from.segment_offset(seg_size);
            let len = REMOTE_READ_RANGE.min(seg_size - off);
            let Some((bytes, permit)) = remote
                .read_range(&tl.ttid, segno, seg_size, off..off + len)
                .await?
            else {
                return Ok(None);
            };
            if bytes.len() as u64 != len {
                bail!(
                    "remote segment {segno}: range {off}+{len} returned {} bytes",
                    bytes.len()
                );
            }
            self.range = Some((from, bytes, permit));
        }
        let (start, bytes, _) = self.range.as_ref().context("range read above")?;
        let end = to.min(Lsn(start.0 + bytes.len() as u64));
        let (a, b) = ((from.0 - start.0) as usize, (end.0 - start.0) as usize);
        out.extend_from_slice(&bytes[a..b]);
        Ok(Some(end))
    }

    /// Gives the buffered range (and its budget) back.
    pub fn release(&mut self) {
        self.range = None;
    }
}

#[cfg(test)]
mod tests;
