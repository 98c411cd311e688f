//! The tokio side of the timeline manager: one driver task per timeline performs what its
//! [`ManagerCore`] decides (control-file saves, uploads, removal) and reports back, and the
//! node's supervisor starts a driver for every timeline, ends it with its timeline, and deletes
//! a deleted timeline's (or tenant's) remote objects once its driver has stopped.
//!
//! Nothing here decides anything that can lose WAL: the rules are the core's
//! ([`crate::manager`]). What this module guarantees is the order of effects:
//!
//! - every action that may block (the acceptor lock, file I/O) runs in a blocking section;
//! - a deleted timeline's driver lets its actions in flight end (it never aborts them: an
//!   aborted upload's request can still land after the deletion listed the store) before it
//!   finishes; only then are its remote objects deleted, and only after that is a timeline
//!   with the same ids allowed again (the registry refuses one while its deletion is pending,
//!   see [`GlobalTimelines::pending_remote_deletions`]), so a recreated timeline never sees the
//!   old one's WAL, objects or horizon;
//! - a pending remote deletion survives restarts (it is recorded in the tombstone).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;
use std::time::{Duration, Instant};

use sk_core::types::TenantTimelineId;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::manager::{Action, Config, Event, ManagerCore, Observed};
use crate::metrics;
use crate::registry::GlobalTimelines;
use crate::timeline::Timeline;
use crate::wal_backup::Backup;

/// How often an active timeline's driver looks at its state (neon's manager: 300 ms).
pub const TICK: Duration = Duration::from_millis(300);
/// The shortest wait between two looks (a retry that came due while the uploads are at their
/// parallelism waits this long, not in a busy loop).
const MIN_WAIT: Duration = Duration::from_millis(10);
/// In-memory LSNs older than this are saved even if they moved little.
pub const SAVE_INTERVAL: Duration = Duration::from_secs(5);

/// Node-wide settings of the managers.
#[derive(Clone)]
pub struct Settings {
    /// Backup, if the node has remote storage.
    pub backup: Option<Backup>,
    /// `--wal-keep-size`.
    pub wal_keep_size: u64,
    /// How often the supervisor looks for new timelines and pending deletions.
    pub supervise_every: Duration,
    /// `--partial-backup-timeout` (`None`: off).
    pub partial_timeout: Option<Duration>,
    /// `--eviction-min-idle` (`None`: off).
    pub evict_after: Option<Duration>,
}

/// The supervisor: a driver for every timeline of `timelines`, remote deletions after
/// deletes. Runs until `cancel`; then stops every driver and waits for them.
pub async fn run(timelines: Arc<GlobalTimelines>, settings: Settings, cancel: CancellationToken) {
    let mut drivers: HashMap<TenantTimelineId, (Arc<Timeline>, tokio::task::JoinHandle<()>)> =
        HashMap::new();
    let mut deleting: HashMap<String, tokio::task::JoinHandle<()>> = HashMap::new();
    if let Some(b) = &settings.backup {
        // Every timeline gets the store with its driver, at the first tick (at once).
        timelines.set_remote_storage(true);
        timelines.set_storage(b.storage.clone());
        timelines.set_remote_url(b.storage.url().to_string());
    }
    let mut ticker = crate::ticker::Ticker::new(settings.supervise_every);
    let changed = timelines.changed();
    loop {
        tokio::select! {
            ok = ticker.tick(&cancel) => if !ok { break },
            _ = changed.notified() => {}
        }
        drivers.retain(|_, (_, j)| !j.is_finished());
        deleting.retain(|_, j| !j.is_finished());
        for tl in timelines.all() {
            match drivers.get(&tl.ttid) {
                Some((t, _)) if Arc::ptr_eq(t, &tl) => continue,
                // The deleted (or evicted) timeline of the same ids is still stopping: the new
                // one (recreated, or restored) waits.
                Some(_) => continue,
                None => {}
            }
            if let Some(b) = &settings.backup {
                tl.set_remote(b.storage.clone());
            }
            let span = crate::timeline::span(&tl.ttid);
            let job = drive(
                tl.clone(),
                Some(timelines.clone()),
                settings.clone(),
                cancel.clone(),
            );
            let handle = tokio::spawn(tracing::Instrument::instrument(job, span));
            drivers.insert(tl.ttid, (tl, handle));
        }
        let Some(backup) = &settings.backup else {
            continue;
        };
        for d in timelines.pending_remote_deletions() {
            if deleting.contains_key(&d.name) || drivers.keys().any(|t| d.covers(t)) {
                continue;
            }
            let (storage, tls, name) = (backup.storage.clone(), timelines.clone(), d.name.clone());
            deleting.insert(name.clone(), tokio::spawn(async move {
                match storage
                    .delete_objects(&d.tenant_id, d.timeline_id.as_ref())
                    .await
                {
                    Ok(n) => {
                        match crate::blocking::spawn(move || tls.remote_deletion_done(&name)).await {
                            Ok(Ok(())) => tracing::info!(
                                target = %d.name,
                                objects = n,
                                "remote objects of the deleted timeline(s) deleted"
                            ),
                            Ok(Err(e)) => {
                                tracing::error!(target = %d.name, "recording the remote deletion: {e}")
                            }
                            Err(e) => tracing::error!("remote deletion task: {e}"),
                        }
                    }
                    Err(e) => {
                        metrics::BACKUP_ERRORS.inc();
                        tracing::warn!(
                            target = %d.name,
                            "deleting remote objects failed (retried): {e:#}"
                        );
                    }
                }
            }));
        }
    }
    for (_, (_, j)) in drivers {
        let _ = j.await;
    }
    for (_, j) in deleting {
        j.abort();
        let _ = j.await;
    }
}

/// What the core sees of `tl` now.
pub fn observe(tl: &Timeline) -> Observed {
    let (inmem, persisted) = tl.lsns();
    Observed {
        flush_lsn: tl.positions().flush_lsn,
        wal_start_lsn: tl.wal_start_lsn(),
        inmem,
        persisted,
        busy: tl.connections() > 0,
    }
}

/// The manager core's configuration for `tl`.
pub fn config_for(tl: &Timeline, settings: &Settings) -> Config {
    Config {
        seg_size: tl.seg_size,
        wal_keep_size: settings.wal_keep_size,
        remote: settings.backup.is_some(),
        parallelism: settings.backup.as_ref().map_or(1, |b| b.parallelism),
        save_interval: SAVE_INTERVAL,
        partial_timeout: settings.partial_timeout,
        evict_after: settings.evict_after,
    }
}

/// One timeline's driver: performs its core's actions until the timeline is deleted (then
/// stops its work in flight and returns) or `cancel` (node shutdown; the daemon saves every
/// control file after).
pub async fn drive(
    tl: Arc<Timeline>,
    timelines: Option<Arc<GlobalTimelines>>,
    settings: Settings,
    cancel: CancellationToken,
) {
    let started = Instant::now();
    let mut core = ManagerCore::new(config_for(&tl, &settings), observe(&tl), tl.removed_below());
    let mut inflight: JoinSet<Event> = JoinSet::new();
    // What each task answers if it panics or is aborted (so the core never waits forever).
    let mut fallback: HashMap<tokio::task::Id, Event> = HashMap::new();
    let mut positions = tl.subscribe();
    let mut deleted = false;
    let mut pending: Vec<Action> = core.step(Event::Tick(Duration::ZERO));
    loop {
        // Until nothing is left: performing an action may ask for more (Stop → Finished).
        while !pending.is_empty() {
            for action in std::mem::take(&mut pending) {
                match action {
                    Action::Stop => {
                        // Wait, never abort: an upload aborted here may still land in the
                        // store after the remote deletion listed it (its request was sent),
                        // leaving an object of a deleted timeline behind. Each action ends by
                        // itself (the store client's retries and timeouts are bounded).
                        while inflight.join_next().await.is_some() {}
                        fallback.clear();
                        pending.extend(core.step(Event::Stopped));
                    }
                    Action::Finished => return,
                    Action::Missing { segno } => {
                        metrics::BACKUP_ERRORS.inc();
                        tracing::error!(
                            segno,
                            "segment {segno} is below this node's local WAL and not in remote \
                         storage: it cannot be backed up from here (listing the store again later)"
                        );
                    }
                    action => {
                        let fb = fallback_of(&action);
                        let id = inflight
                            .spawn(perform(
                                tl.clone(),
                                timelines.clone(),
                                settings.clone(),
                                action,
                            ))
                            .id();
                        fallback.insert(id, fb);
                    }
                }
            }
        }
        let idle = inflight.is_empty() && core.next_wakeup().is_none();
        let wake = core
            .next_wakeup()
            .map(|t| t.saturating_sub(started.elapsed()))
            .unwrap_or(TICK)
            .clamp(MIN_WAIT, TICK);
        let event = tokio::select! {
            _ = cancel.cancelled() => {
                inflight.abort_all();
                while inflight.join_next().await.is_some() {}
                return;
            }
            _ = tl.deleted().cancelled(), if !deleted => {
                deleted = true;
                Event::Deleted
            }
            Some(done) = inflight.join_next_with_id() => match done {
                Ok((id, ev)) => {
                    fallback.remove(&id);
                    ev
                }
                Err(e) => {
                    if e.is_panic() {
                        tracing::error!("timeline manager action panicked: {e}");
                    }
                    fallback.remove(&e.id()).unwrap_or(Event::Tick(started.elapsed()))
                }
            },
            r = positions.changed(), if idle => {
                if r.is_err() {
                    return;
                }
                Event::Observed(observe(&tl))
            }
            _ = tokio::time::sleep(wake), if !idle => Event::Tick(started.elapsed()),
        };
        pending.extend(core.step(event));
        if !deleted {
            pending.extend(core.step(Event::Observed(observe(&tl))));
            pending.extend(core.step(Event::Tick(started.elapsed())));
        }
    }
}

/// What an action's task answers if it never finishes normally.
fn fallback_of(action: &Action) -> Event {
    match action {
        Action::List => Event::Listed(None),
        Action::Upload { segno, .. } => Event::Uploaded {
            segno: *segno,
            ok: false,
        },
        Action::Save => Event::Saved { ok: false },
        Action::Evict { .. } => Event::Evicted { ok: false },
        Action::Remove { .. } => Event::Removed { first_local: 0 },
        Action::UploadPartial { upto, .. } => Event::UploadedPartial {
            upto: *upto,
            ok: false,
        },
        Action::RemovePartials { below } => Event::RemovedPartials {
            below: *below,
            ok: false,
        },
        _ => Event::Tick(Duration::ZERO),
    }
}

/// Performs one action of `tl`'s core and returns what happened.
async fn perform(
    tl: Arc<Timeline>,
    timelines: Option<Arc<GlobalTimelines>>,
    settings: Settings,
    action: Action,
) -> Event {
    match action {
        Action::List => {
            let Some(b) = &settings.backup else {
                return Event::Listed(None);
            };
            match b.storage.list_segments(&tl.ttid, tl.seg_size).await {
                Ok(l) => {
                    Event::Listed(Some(l.into_iter().map(|(n, _)| n).collect::<BTreeSet<_>>()))
                }
                Err(e) => {
                    metrics::BACKUP_ERRORS.inc();
                    tracing::warn!("listing remote WAL failed (retried): {e:#}");
                    Event::Listed(None)
                }
            }
        }
        Action::Upload {
            segno,
            valid_from,
            known_stored,
        } => {
            let ok = match &settings.backup {
                Some(b) => b.upload(&tl, segno, valid_from, known_stored).await.is_ok(),
                None => false,
            };
            Event::Uploaded { segno, ok }
        }
        Action::SetBackupLsn(lsn) => {
            let t = tl.clone();
            let _ = crate::blocking::spawn(move || t.set_backup_lsn(lsn)).await;
            Event::Observed(observe(&tl))
        }
        Action::Save => {
            let t = tl.clone();
            let ok = match crate::blocking::spawn(move || t.maybe_persist(true)).await {
                Ok(Ok(_)) => true,
                Ok(Err(e)) => {
                    tracing::error!("persisting control file: {e}");
                    false
                }
                Err(e) => {
                    tracing::error!("control file task: {e}");
                    false
                }
            };
            Event::Saved { ok }
        }
        Action::Remove { horizon } => {
            let t = tl.clone();
            match crate::blocking::spawn(move || t.remove_segments_below(horizon)).await {
                Ok(Ok(0)) => {}
                Ok(Ok(n)) => {
                    metrics::WAL_REMOVED_SEGMENTS.inc_by(n as u64);
                    tracing::info!(removed = n, below = %tl.oldest_available_lsn(), "removed WAL segments");
                }
                Ok(Err(e)) => tracing::error!("removing WAL segments: {e}"),
                Err(e) => tracing::error!("WAL removal task failed: {e}"),
            }
            Event::Removed {
                first_local: tl.removed_below(),
            }
        }
        Action::UploadPartial {
            upto, valid_from, ..
        } => {
            let ok = match &settings.backup {
                Some(b) => b.upload_partial(&tl, upto, valid_from).await.is_ok(),
                None => false,
            };
            Event::UploadedPartial { upto, ok }
        }
        Action::RemovePartials { below } => {
            let ok = match &settings.backup {
                Some(b) => match b
                    .storage
                    .remove_partials_below(&tl.ttid, tl.seg_size, below)
                    .await
                {
                    Ok(n) => {
                        metrics::PARTIAL_BACKUPS_REMOVED.inc_by(n as u64);
                        true
                    }
                    Err(e) => {
                        metrics::BACKUP_ERRORS.inc();
                        tracing::warn!(%below, "removing superseded partial segments failed (retried): {e:#}");
                        false
                    }
                },
                None => false,
            };
            Event::RemovedPartials { below, ok }
        }
        Action::Evict { end } => {
            let Some(tls) = timelines else {
                return Event::Evicted { ok: false };
            };
            let started = Instant::now();
            let t = tl.clone();
            let outcome = crate::blocking::spawn(move || tls.evict(&t, end)).await;
            let ok = match outcome {
                Ok(Ok(removed)) => {
                    let took = started.elapsed();
                    metrics::EVICTIONS.with_label_values(&["done"]).inc();
                    metrics::EVICTION_SECONDS
                        .with_label_values(&["evict"])
                        .observe(took.as_secs_f64());
                    tracing::info!(%end, removed, "timeline evicted: its WAL is in remote storage");
                    true
                }
                Ok(Err(e)) => {
                    metrics::EVICTIONS.with_label_values(&["refused"]).inc();
                    // Evicted but its files not all removed: start-up (or the next restore)
                    // finishes; the timeline is evicted all the same.
                    let evicted = tl.is_evicted();
                    tracing::info!(%end, evicted, "eviction stopped: {e}");
                    evicted
                }
                Err(e) => {
                    tracing::error!("eviction task: {e}");
                    tl.is_evicted()
                }
            };
            Event::Evicted { ok }
        }
        Action::Missing { .. } | Action::Stop | Action::Finished => Event::Tick(Duration::ZERO),
    }
}

/// Measures every `tick` and marks the timelines past a disk-usage limit (see
/// [`crate::disk_usage`]). Runs
/// until `cancel`.
pub async fn run_disk_limits(
    timelines: Arc<GlobalTimelines>,
    limits: crate::disk_usage::DiskLimits,
    tick: Duration,
    cancel: CancellationToken,
) {
    let mut ticker = crate::ticker::Ticker::new(tick);
    while ticker.tick(&cancel).await {
        let (timelines, limits) = (timelines.clone(), limits.clone());
        let _ = crate::blocking::spawn(move || measure_disk_usage(&timelines, &limits)).await;
    }
}

/// One measurement of every timeline (blocking).
pub fn measure_disk_usage(timelines: &GlobalTimelines, limits: &crate::disk_usage::DiskLimits) {
    let fs = if limits.max_fs_ratio > 0.0 {
        match crate::disk_usage::fs_usage(&limits.datadir) {
            Ok(r) => Some(r),
            Err(e) => {
                tracing::warn!("measuring the data directory's file system: {e}");
                None
            }
        }
    } else {
        None
    };
    for tl in timelines.all() {
        let changed = match tl.measure_disk(limits, fs) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("measuring {}: {e}", tl.dir.display());
                continue;
            }
        };
        if let Some(v) = changed {
            let _span = crate::timeline::span(&tl.ttid).entered();
            match v {
                Some(why) => tracing::warn!("refusing appends: {why}"),
                None => tracing::info!("disk usage back under the limits: appends resume"),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{elected_timeline, sim_node};

    /// A deleted timeline's driver ends by itself (its Stop asks for Finished, with nothing
    /// else to wake it: a driver that waited for another event kept the timeline id's slot and
    /// its remote deletion pending forever, found by the nemesis run).
    #[tokio::test]
    async fn a_deleted_timelines_driver_finishes() {
        let (_sim, _fs, timelines) = sim_node();
        let tl = elected_timeline(&timelines, 3, 1 << 20, sk_core::types::Lsn(1 << 20));
        let settings = Settings {
            backup: None,
            wal_keep_size: 0,
            supervise_every: Duration::from_secs(1),
            partial_timeout: None,
            evict_after: None,
        };
        let job = tokio::spawn(drive(tl.clone(), None, settings, CancellationToken::new()));
        tokio::task::yield_now().await;
        crate::blocking::section(|| tl.mark_deleted());
        tokio::time::timeout(Duration::from_secs(10), job)
            .await
            .expect("the driver finishes after the delete")
            .unwrap();
    }
}
