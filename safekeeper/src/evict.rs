//! Eviction of idle timelines: a timeline whose WAL is wholly in remote storage keeps only its
//! control file locally, and is brought back on demand.
//!
//! When: the timeline manager's core decides ([`crate::manager`], `Action::Evict`): idle for
//! `--eviction-min-idle`, no connection, every byte of WAL committed and durable at one end
//! LSN, complete segments below it backed up and the segment holding it stored as a partial
//! object. How, in this order (each step durable before the next; a crash between any two is
//! finished or undone at start-up):
//!
//! 1. **Flag** ([`crate::timeline::Timeline::begin_eviction`]): under the acceptor lock, with no
//!    proposer or reader connected and the WAL where the core saw it, the control file is
//!    persisted with `evicted = true` and the WAL store is released (its background work
//!    stopped, its file closed): from here on the acceptor refuses every message, so nothing
//!    can be written into a file that step 3 removes.
//! 2. **Registry**: the timeline leaves the resident map for the evicted one; its manager ends.
//! 3. **Remove** every segment file, then fsync the directory. A start-up that finds the flag
//!    set removes whatever is left and does not open the WAL.
//!
//! Restore ([`restore`]), one at a time per timeline and at most
//! [`crate::registry::GlobalTimelines::restore_permits`] at once on the node:
//!
//! 1. **Download** the segment holding the last WAL byte (a partial object ending at or past
//!    the end, or the complete segment: WAL below a commit LSN is the same on every node; at a
//!    segment boundary the complete segment before it, where the start-up's search for the end
//!    of WAL reads), unless the timeline has no WAL.
//! 2. **Write** its bytes below the end into the local segment (`.partial`, or complete at a
//!    boundary; through a temporary file, fsynced, renamed durably).
//! 3. **Open** the timeline as at start-up (which verifies the committed WAL). If that fails the
//!    segment is removed again and the timeline stays evicted, with the error.
//! 4. **Clear** the flag (persisted), then the timeline joins the resident map and gets a
//!    manager. A crash before this leaves the flag set: start-up removes the downloaded file.
//!
//! WAL below the restored segment is not downloaded: readers and peers are served it from the
//! store ([`crate::send_wal`]), as after any removal.

use std::sync::Arc;

use sk_core::types::TenantTimelineId;

pub use crate::evicted::{EvictedTimeline, download, segment_to_restore};
use crate::metrics;
use crate::registry::GlobalTimelines;
use crate::timeline::{Timeline, TimelineError};

/// How long a restore waits for its download (the store client's own retries would let a hung
/// store hold a proposer or reader for minutes).
pub const RESTORE_DOWNLOAD_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Brings the evicted timeline `ttid` back (see the module docs): one restore per timeline at
/// a time (a second caller waits for the first and gets its result), at most
/// [`GlobalTimelines::restore_permits`] on the node. Returns the resident timeline (at once if
/// it is resident), or `Ok(None)` if this node has it neither resident nor evicted. A store
/// that fails or does not hold the WAL gives [`TimelineError::RestoreFailed`]: the timeline
/// stays evicted and the next demand tries again.
pub async fn restore(
    timelines: &Arc<GlobalTimelines>,
    ttid: &TenantTimelineId,
) -> Result<Option<Arc<Timeline>>, TimelineError> {
    // A resident object flagged by an eviction in progress leaves the map within that
    // eviction (the registry serializes it with restores): wait for it.
    for _ in 0..500 {
        match timelines.get(ttid) {
            Some(tl) if !tl.is_evicted() => return Ok(Some(tl)),
            Some(_) => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            None => break,
        }
    }
    let Some(e) = timelines.get_evicted(ttid) else {
        return Ok(None);
    };
    let _one = e.restoring.lock().await;
    if let Some(tl) = timelines.get(ttid) {
        return Ok(Some(tl));
    }
    if timelines.get_evicted(ttid).is_none() {
        // Deleted meanwhile.
        return Ok(None);
    }
    let _permit = timelines
        .restore_permits()
        .clone()
        .acquire_owned()
        .await
        .map_err(|_| failed(ttid, "the node is shutting down".into()))?;
    let started = std::time::Instant::now();
    let result = restore_now(timelines, &e).await;
    let outcome = if result.is_ok() { "ok" } else { "error" };
    metrics::RESTORES.with_label_values(&[outcome]).inc();
    match &result {
        Ok(_) => {
            let took = started.elapsed();
            metrics::EVICTION_SECONDS
                .with_label_values(&["restore"])
                .observe(took.as_secs_f64());
            tracing::info!(%ttid, end = %e.end_lsn(), ms = took.as_millis() as u64, "timeline restored");
        }
        Err(err) => tracing::warn!(%ttid, "restoring the evicted timeline failed: {err}"),
    }
    result.map(Some)
}

async fn restore_now(
    timelines: &Arc<GlobalTimelines>,
    e: &EvictedTimeline,
) -> Result<Arc<Timeline>, TimelineError> {
    let ttid = e.ttid;
    let Some(segno) = e.segment_to_restore() else {
        return install(timelines, e, None).await;
    };
    let storage = timelines.storage().ok_or_else(|| {
        failed(
            &ttid,
            "the node has no remote storage to restore from".into(),
        )
    })?;
    let (seg, end) = (e.seg_size(), e.end_lsn());
    let in_time = |what: &'static str| {
        move |_| {
            failed(
                &ttid,
                format!(
                    "remote storage did not answer within {} s ({what})",
                    RESTORE_DOWNLOAD_TIMEOUT.as_secs()
                ),
            )
        }
    };
    let io = |err: anyhow::Error| failed(&ttid, format!("reading remote storage: {err:#}"));
    let found = tokio::time::timeout(
        RESTORE_DOWNLOAD_TIMEOUT,
        crate::evicted::sources(storage, &ttid, seg, segno, end),
    )
    .await
    .map_err(in_time("listing"))?
    .map_err(io)?;
    // Each object in turn: one whose bytes do not verify (another node's, valid only from a
    // later start in the segment) gives way to the next.
    let mut refused = None;
    for source in &found {
        let got = tokio::time::timeout(
            RESTORE_DOWNLOAD_TIMEOUT,
            crate::evicted::fetch(storage, &ttid, seg, segno, end, source),
        )
        .await
        .map_err(in_time("download"))?
        .map_err(io)?;
        let Some(data) = got else { continue };
        match install(timelines, e, Some(data)).await {
            Err(TimelineError::Storage(
                err @ (sk_core::storage::Error::Corruption { .. }
                | sk_core::storage::Error::WalCorruption { .. }
                | sk_core::storage::Error::Rejected(_)),
            )) => {
                tracing::warn!(%ttid, ?source, "this stored copy does not restore: {err}");
                refused = Some(err.to_string());
            }
            other => return other,
        }
    }
    Err(failed(
        &ttid,
        match refused {
            Some(why) => format!("no stored copy of segment {segno} restores: {why}"),
            None => format!(
                "no object in {} holds segment {segno} up to {end}",
                storage.timeline_location(&ttid)
            ),
        },
    ))
}

/// Restores `e` from `data` (its end segment's bytes; `None` if it needs none) on a blocking
/// thread.
async fn install(
    timelines: &Arc<GlobalTimelines>,
    e: &EvictedTimeline,
    data: Option<bytes::Bytes>,
) -> Result<Arc<Timeline>, TimelineError> {
    let ttid = e.ttid;
    let tls = timelines.clone();
    let end = e.end_lsn();
    crate::blocking::spawn(move || {
        // Restored and evicted again (at another end) since the download: not these bytes.
        if tls.evicted_end(&ttid).is_some_and(|now| now != end) {
            return Err(failed(&ttid, "evicted again meanwhile".into()));
        }
        tls.restore_from(&ttid, data.as_deref())
    })
    .await
    .map_err(|err| failed(&ttid, format!("restore task: {err}")))?
}

/// The timeline a proposer's greeting names ([`GlobalTimelines::get_or_create`]), restored
/// first if it is evicted.
pub async fn get_or_create(
    timelines: &Arc<GlobalTimelines>,
    greeting: &sk_core::protocol::ProposerGreeting,
    allow_creation: bool,
) -> Result<Arc<Timeline>, TimelineError> {
    let mut tries = 0;
    loop {
        match timelines.get_or_create(greeting, allow_creation) {
            // Evicted again between its restore and here (idle that long): once more.
            Err(TimelineError::Evicted(ttid)) if tries < 3 => {
                tries += 1;
                restore(timelines, &ttid).await?;
            }
            r => return r,
        }
    }
}

fn failed(ttid: &TenantTimelineId, reason: String) -> TimelineError {
    TimelineError::RestoreFailed {
        ttid: *ttid,
        reason,
    }
}

#[cfg(test)]
mod tests;
