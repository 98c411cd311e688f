//! What a node keeps of an evicted timeline ([`EvictedTimeline`]) and the file and store steps
//! of an eviction and a restore: removing the local WAL, downloading the end's segment,
//! writing it back durably. The order of the steps and who runs them: [`crate::evict`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;
use sk_core::state::TimelinePersistentState;
use sk_core::storage::durable::{durable_rename, fsync_dir, fsync_or_abort};
use sk_core::storage::fs::{Fs, OpenMode, SyncKind};
use sk_core::types::{Lsn, TenantTimelineId};

use sk_core::storage::{Error, Result};

use crate::remote_storage::RemoteStorage;
use crate::wal_store::{PREPARED_SEGMENT_NAME, TMP_SEGMENT_NAME, segment_path};

/// Temporary name of a restored segment before its rename.
const RESTORE_TMP_NAME: &str = "walrestore.tmp";

/// What a node keeps of an evicted timeline: its directory and its persisted state (for status
/// and for the restore).
#[derive(Debug)]
pub struct EvictedTimeline {
    /// Which timeline.
    pub ttid: TenantTimelineId,
    /// Its directory (now only the control file).
    pub dir: PathBuf,
    /// Its control file's state (`evicted` set).
    pub state: Arc<TimelinePersistentState>,
    /// Held while it is restored (one restore at a time).
    pub restoring: tokio::sync::Mutex<()>,
}

impl EvictedTimeline {
    /// An evicted timeline in `dir` whose control file holds `state`.
    pub fn new(dir: PathBuf, state: Arc<TimelinePersistentState>) -> EvictedTimeline {
        EvictedTimeline {
            ttid: TenantTimelineId {
                tenant_id: state.tenant_id,
                timeline_id: state.timeline_id,
            },
            dir,
            state,
            restoring: tokio::sync::Mutex::new(()),
        }
    }

    /// The WAL segment size.
    pub fn seg_size(&self) -> u64 {
        u64::from(self.state.server.wal_seg_size)
    }

    /// Its end of WAL (committed, and what it acknowledged).
    pub fn end_lsn(&self) -> Lsn {
        self.state.commit_lsn
    }

    /// Where its WAL begins.
    pub fn wal_start_lsn(&self) -> Lsn {
        self.state
            .local_start_lsn
            .max(self.state.timeline_start_lsn)
    }

    /// The segment a restore downloads (see [`segment_to_restore`]).
    pub fn segment_to_restore(&self) -> Option<u64> {
        segment_to_restore(self.end_lsn(), self.wal_start_lsn(), self.seg_size())
    }
}

/// The segment a restore of WAL ending at `end` (beginning at `wal_start`) downloads: the one
/// holding the last WAL byte, where the start-up's search for the end of WAL reads (the segment
/// holding `end`, or the complete one before it when `end` is at a segment boundary); `None`
/// when the timeline has no WAL.
pub fn segment_to_restore(end: Lsn, wal_start: Lsn, seg_size: u64) -> Option<u64> {
    if !end.is_valid() || end <= wal_start {
        return None;
    }
    Some(Lsn(end.0 - 1).segment_number(seg_size))
}

/// Whether a restore of WAL ending at `end` needs a partial object (its last segment is not
/// complete).
pub fn needs_partial_object(end: Lsn, wal_start: Lsn, seg_size: u64) -> bool {
    segment_to_restore(end, wal_start, seg_size).is_some() && end.segment_offset(seg_size) != 0
}

/// Removes every segment file of the timeline in `dir` (and what a preparation or restore left),
/// then fsyncs the directory (unless `no_sync`). Returns how many files it removed.
pub fn remove_local_wal(fs: &Fs, dir: &Path, seg_size: u64, no_sync: bool) -> Result<usize> {
    let mut n = crate::wal_store::remove_segments_below(fs, dir, seg_size, u64::MAX, true)?;
    for name in [PREPARED_SEGMENT_NAME, TMP_SEGMENT_NAME, RESTORE_TMP_NAME] {
        let p = dir.join(name);
        if fs.exists(&p) {
            fs.remove_file(&p)
                .map_err(|e| Error::io(format!("removing {}", p.display()), e))?;
            n += 1;
        }
    }
    if !no_sync {
        fsync_dir(fs, dir)?;
    }
    Ok(n)
}

/// An object a restore may take segment `segno` from.
#[derive(Clone, Debug)]
pub enum Source {
    /// A partial object (by its path as listed).
    Partial(object_store::path::Path),
    /// The complete segment.
    Complete,
}

/// The objects that may hold segment `segno` up to `end`, in the order a restore tries them:
/// partial objects ending at or past `end`, shortest first (the one this node stored, unless a
/// longer one, another node's with more committed WAL, superseded it), then the complete
/// segment; only the complete segment when `end` is at the segment's end.
pub async fn sources(
    storage: &RemoteStorage,
    ttid: &TenantTimelineId,
    seg_size: u64,
    segno: u64,
    end: Lsn,
) -> anyhow::Result<Vec<Source>> {
    if (segno + 1) * seg_size == end.0 {
        return Ok(vec![Source::Complete]);
    }
    let mut v: Vec<Source> = storage
        .list_partials(ttid, seg_size)
        .await?
        .into_iter()
        .filter(|(s, _, upto, _)| *s == segno && *upto >= end)
        .map(|(_, _, _, path)| Source::Partial(path))
        .collect();
    v.push(Source::Complete);
    Ok(v)
}

/// The bytes of `source` for segment `segno`, if it is stored and holds the WAL below `end`.
pub async fn fetch(
    storage: &RemoteStorage,
    ttid: &TenantTimelineId,
    seg_size: u64,
    segno: u64,
    end: Lsn,
    source: &Source,
) -> anyhow::Result<Option<Bytes>> {
    let got = match source {
        Source::Partial(path) => storage.read_object(path).await?,
        Source::Complete => storage.read_segment(ttid, segno, seg_size).await?,
    };
    Ok(got.filter(|b| b.len() as u64 >= end.0 - segno * seg_size))
}

/// The first of [`sources`] that [`fetch`] finds. `Ok(None)`: nothing stored holds the WAL
/// (an error for the caller: eviction required it stored).
pub async fn download(
    storage: &RemoteStorage,
    ttid: &TenantTimelineId,
    seg_size: u64,
    segno: u64,
    end: Lsn,
) -> anyhow::Result<Option<Bytes>> {
    for source in sources(storage, ttid, seg_size, segno, end).await? {
        if let Some(b) = fetch(storage, ttid, seg_size, segno, end, &source).await? {
            return Ok(Some(b));
        }
    }
    Ok(None)
}

/// Writes the segment holding the last WAL byte below `end` of the timeline in `dir` from
/// `data` (its bytes from 0; only those below `end` are kept, the rest of the segment is left
/// sparse, read as zeros) and makes it durable under its `.partial` name, or its complete name
/// when `end` is at its end.
pub fn write_restored_segment(
    fs: &Fs,
    dir: &Path,
    seg_size: u64,
    end: Lsn,
    data: &[u8],
    no_sync: bool,
) -> Result<()> {
    // The segment holding the last byte below `end`, and how much of it is WAL.
    let segno = Lsn(end.0.saturating_sub(1)).segment_number(seg_size);
    let off = (end.0 - segno * seg_size) as usize;
    let complete = off as u64 == seg_size;
    if data.len() < off {
        return Err(Error::Rejected(format!(
            "the stored WAL of segment {segno} holds {} bytes, {off} are needed",
            data.len()
        )));
    }
    let tmp = dir.join(RESTORE_TMP_NAME);
    let io = |what: &str, p: &Path| {
        let context = format!("{what} {}", p.display());
        move |e| Error::io(context, e)
    };
    let f = fs
        .open(&tmp, OpenMode::CreateTruncate)
        .map_err(io("creating", &tmp))?;
    f.write_all_at(&data[..off], 0)
        .map_err(io("writing", &tmp))?;
    f.set_len(seg_size).map_err(io("extending", &tmp))?;
    if !no_sync {
        fsync_or_abort(&*f, &tmp, SyncKind::Data);
    }
    drop(f);
    let path = segment_path(dir, segno, seg_size, !complete);
    durable_rename(fs, &tmp, &path, dir, no_sync)?;
    Ok(())
}
