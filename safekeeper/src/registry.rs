//! The node's timelines: the one registry ([`GlobalTimelines`]) that loads them at start-up,
//! finds them by id, creates new ones on a proposer's greeting, persists their in-memory state
//! in the background, and exposes their per-timeline gauges to Prometheus
//! ([`TimelineCollector`]).
//!
//! Layout on disk: `<datadir>/<tenant_id>/<timeline_id>/` holds `safekeeper.control` and the WAL
//! segments. A new timeline is built under `<datadir>/tmp/` and renamed into place durably, so a
//! crash never leaves a half-created timeline behind. Every file-system call goes through the
//! [`Fs`] seam, so the registry runs on the simulated file system as well as on the real one.
//!
//! Locking: the map is a `std::sync::Mutex` held for lookups only; creations are serialized by a
//! second lock and build the timeline (directory creation and fsyncs) without holding the map.
//!
//! Not here: one timeline's acceptor and positions ([`crate::timeline`]), what a connection does
//! with a timeline ([`crate::receive_wal`], [`crate::send_wal`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::SystemTime;

use pg_wal::PgMajor;
use pg_wal::format::is_valid_seg_size;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{GaugeVec, IntGaugeVec, Opts};
use sk_core::protocol::ProposerGreeting;
use sk_core::state::{Configuration, ServerInfo, TimelinePersistentState};
use sk_core::storage::durable::fsync_dir;
use sk_core::storage::fs::{Fs, OpenMode};
use sk_core::types::{NodeId, TenantId, TenantTimelineId, TimelineId};

use crate::control_file::{CONTROL_FILE_NAME, FileControlStore};
use crate::evicted::EvictedTimeline;
use crate::manager::DeleteScope;
use crate::remote_storage::RemoteStorage;
use crate::timeline::{Timeline, TimelineError};
use crate::wal_store::{OpenFiles, SegmentPool};

/// Where new timelines are built before they are renamed into place, and where deleted ones
/// are moved before they are removed. Emptied at start-up.
const TMP_DIR: &str = "tmp";
/// Tombstones of deleted timelines (`<tenant_id>_<timeline_id>`) and tenants (`<tenant_id>`):
/// durable before a deletion starts and cleared by an explicit create. Empty, or holding
/// [`REMOTE_PENDING`] while the deleted objects in remote storage are still to be deleted.
const TOMBSTONE_DIR: &str = "tombstones";
/// A tombstone's content while its remote objects are still to be deleted.
const REMOTE_PENDING: &[u8] = b"remote-pending\n";

/// A deletion whose remote objects are still to be deleted (its tombstone says so).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RemoteDeletion {
    /// The tombstone's name.
    pub name: String,
    /// The tenant.
    pub tenant_id: TenantId,
    /// The timeline, or `None` for the whole tenant.
    pub timeline_id: Option<TimelineId>,
}

impl RemoteDeletion {
    fn parse(name: &str) -> Option<RemoteDeletion> {
        let (tenant, timeline) = match name.split_once('_') {
            Some((t, tl)) => (t, Some(tl.parse().ok()?)),
            None => (name, None),
        };
        Some(RemoteDeletion {
            name: name.to_string(),
            tenant_id: tenant.parse().ok()?,
            timeline_id: timeline,
        })
    }

    /// Whether timeline `ttid` is among what it deletes.
    pub fn covers(&self, ttid: &TenantTimelineId) -> bool {
        self.tenant_id == ttid.tenant_id && self.timeline_id.is_none_or(|t| t == ttid.timeline_id)
    }
}

/// The tombstone name of a timeline.
fn timeline_tombstone(ttid: &TenantTimelineId) -> String {
    format!("{}_{}", ttid.tenant_id, ttid.timeline_id)
}

/// What `POST /v1/tenant/{tenant_id}/timeline` creates.
#[derive(Clone, Debug)]
pub struct CreateTimeline {
    /// The timeline.
    pub ttid: TenantTimelineId,
    /// The PostgreSQL server (system id, version, segment size).
    pub server: ServerInfo,
    /// Where the timeline's WAL begins (`Lsn::INVALID`: where its first proposer starts).
    pub start_lsn: sk_core::types::Lsn,
    /// The membership configuration it starts with.
    pub mconf: Configuration,
}

/// All timelines of this node.
pub struct GlobalTimelines {
    fs: Fs,
    datadir: PathBuf,
    node_id: NodeId,
    no_sync: bool,
    /// The LRU of open segment files every timeline's WAL store joins.
    open_files: OpenFiles,
    /// The node's pool of zero-filled segments, if it keeps one.
    pool: Option<SegmentPool>,
    map: Mutex<HashMap<TenantTimelineId, Arc<Timeline>>>,
    /// Evicted timelines ([`crate::evict`]), never also in `map`. Locked after `map` when both
    /// are.
    evicted: Mutex<HashMap<TenantTimelineId, Arc<EvictedTimeline>>>,
    /// The node's remote storage (restores download from it), set with the managers.
    storage: std::sync::OnceLock<Arc<RemoteStorage>>,
    /// Restores running at once on the node.
    restore_permits: Arc<tokio::sync::Semaphore>,
    /// Serializes creations and deletions (a blocking section: directory creation and fsyncs).
    create_lock: Mutex<()>,
    /// Tombstone names ([`TOMBSTONE_DIR`]) of deleted timelines and tenants.
    tombstones: Mutex<std::collections::HashSet<String>>,
    /// Tombstones whose remote objects are still to be deleted ([`REMOTE_PENDING`]).
    remote_pending: Mutex<std::collections::BTreeSet<String>>,
    /// See [`GlobalTimelines::set_remote_url`].
    remote_url: std::sync::OnceLock<String>,
    /// See [`GlobalTimelines::set_disk_limits`].
    disk_limits: Mutex<Option<crate::disk_usage::DiskLimits>>,
    /// Whether the node backs WAL up (a deletion then has remote objects to delete).
    remote_on: std::sync::atomic::AtomicBool,
    /// Wakes the manager supervisor ([`crate::lifecycle`]): a timeline was added or deleted.
    changed: tokio::sync::Notify,
    /// Timelines being pulled here (one pull of a timeline at a time).
    pulling: Arc<Mutex<std::collections::HashSet<TenantTimelineId>>>,
}

/// A pull in progress ([`GlobalTimelines::begin_pull`]); the timeline may be pulled again once
/// it drops.
pub struct PullGuard {
    pulling: Arc<Mutex<std::collections::HashSet<TenantTimelineId>>>,
    ttid: TenantTimelineId,
}

impl Drop for PullGuard {
    fn drop(&mut self) {
        self.pulling
            .lock()
            .expect("pulling lock")
            .remove(&self.ttid);
    }
}

impl GlobalTimelines {
    /// Loads every timeline under `datadir` on the real file system (see
    /// [`GlobalTimelines::load_in`]).
    pub fn load(
        datadir: &Path,
        node_id: NodeId,
        no_sync: bool,
    ) -> Result<GlobalTimelines, TimelineError> {
        GlobalTimelines::load_in(Fs::real(), datadir, node_id, no_sync)
    }

    /// Loads every timeline under `datadir` on `fs`, with the default cap on open segment
    /// files (see [`GlobalTimelines::load_in_with`]).
    pub fn load_in(
        fs: Fs,
        datadir: &Path,
        node_id: NodeId,
        no_sync: bool,
    ) -> Result<GlobalTimelines, TimelineError> {
        GlobalTimelines::load_in_with(fs, datadir, node_id, no_sync, OpenFiles::default(), None)
    }

    /// Loads every timeline under `datadir` on `fs`; their segment files share the LRU
    /// `open_files`, and their new segments come from `pool` while it has some. Any timeline that fails verification (a corrupt control file, WAL ending
    /// below its commit LSN) stops start-up: serving on would risk acknowledged data.
    pub fn load_in_with(
        fs: Fs,
        datadir: &Path,
        node_id: NodeId,
        no_sync: bool,
        open_files: OpenFiles,
        pool: Option<SegmentPool>,
    ) -> Result<GlobalTimelines, TimelineError> {
        let tmp = datadir.join(TMP_DIR);
        if fs.exists(&tmp) {
            // Half-built timelines from a crash during creation: never acknowledged anything.
            fs.remove_dir_all(&tmp)
                .map_err(|e| TimelineError::io(format!("removing {}", tmp.display()), e))?;
        }
        let tombstone_dir = datadir.join(TOMBSTONE_DIR);
        let mut tombstones = std::collections::HashSet::new();
        let mut remote_pending = std::collections::BTreeSet::new();
        if fs.is_dir(&tombstone_dir) {
            for p in list_dir_sorted(&fs, &tombstone_dir)? {
                if let Some(n) = p.file_name().and_then(|n| n.to_str()) {
                    tombstones.insert(n.to_string());
                    if read_small(&fs, &p)? == REMOTE_PENDING {
                        remote_pending.insert(n.to_string());
                    }
                }
            }
        }
        // (tenant, timeline, directory) of every timeline to open.
        let mut to_open = Vec::new();
        for tenant in list_dir_sorted(&fs, datadir)? {
            let Some(name) = tenant.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !fs.is_dir(&tenant) || name.parse::<TenantId>().is_err() {
                continue;
            }
            if tombstones.contains(name) {
                // A tenant deletion interrupted by a crash: finish it.
                remove_durably(&fs, datadir, &tenant, no_sync)?;
                continue;
            }
            for dir in list_dir_sorted(&fs, &tenant)? {
                if !fs.exists(&dir.join(CONTROL_FILE_NAME)) {
                    continue;
                }
                let timeline_name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if tombstones.contains(&format!("{name}_{timeline_name}")) {
                    // A timeline deletion interrupted by a crash: finish it.
                    remove_durably(&fs, datadir, &dir, no_sync)?;
                    continue;
                }
                to_open.push((name.to_string(), timeline_name.to_string(), dir.clone()));
            }
        }
        let mut map = HashMap::new();
        let mut evicted = HashMap::new();
        for loaded in open_all(&fs, &to_open, node_id, no_sync, &open_files, pool.as_ref())? {
            match loaded {
                Loaded::Resident(tl) => {
                    map.insert(tl.ttid, Arc::from(tl));
                }
                Loaded::Evicted(e) => {
                    evicted.insert(e.ttid, Arc::new(e));
                }
            }
        }
        Ok(GlobalTimelines {
            fs,
            datadir: datadir.to_path_buf(),
            node_id,
            no_sync,
            open_files,
            pool,
            map: Mutex::new(map),
            evicted: Mutex::new(evicted),
            storage: std::sync::OnceLock::new(),
            restore_permits: Arc::new(tokio::sync::Semaphore::new(DEFAULT_RESTORES)),
            create_lock: Mutex::new(()),
            tombstones: Mutex::new(tombstones),
            remote_pending: Mutex::new(remote_pending),
            remote_on: std::sync::atomic::AtomicBool::new(false),
            changed: tokio::sync::Notify::new(),
            pulling: Default::default(),
            disk_limits: Mutex::new(None),
            remote_url: std::sync::OnceLock::new(),
        })
    }

    /// Whether the node backs WAL up (a pull then takes a snapshot from the backed-up point).
    pub fn remote_storage_on(&self) -> bool {
        self.remote_on.load(Ordering::SeqCst)
    }

    /// Says the node backs WAL up: a deletion from now on leaves its remote objects to delete
    /// (recorded in its tombstone, done by [`crate::lifecycle`]).
    pub fn set_remote_storage(&self, on: bool) {
        self.remote_on.store(on, Ordering::SeqCst);
    }

    /// The node's disk limits: a timeline added from now on is measured before it takes its
    /// first append (the periodic measurement, [`crate::lifecycle::run_disk_limits`], would
    /// leave it unlimited until its next round).
    pub fn set_disk_limits(&self, limits: crate::disk_usage::DiskLimits) {
        *self.disk_limits.lock().expect("disk limits lock") = Some(limits);
    }

    /// Measures a timeline about to be added against the disk limits, if any. Blocking.
    fn measure_new(&self, tl: &Timeline) {
        let Some(limits) = self.disk_limits.lock().expect("disk limits lock").clone() else {
            return;
        };
        let fs = if limits.max_fs_ratio > 0.0 {
            crate::disk_usage::fs_usage(&limits.datadir)
                .inspect_err(|e| tracing::warn!("measuring the data directory's file system: {e}"))
                .ok()
        } else {
            None
        };
        match tl.measure_disk(&limits, fs) {
            Ok(Some(Some(why))) => tracing::warn!(ttid = %tl.ttid, "refusing appends: {why}"),
            Ok(_) => {}
            Err(e) => tracing::warn!("measuring {}: {e}", tl.dir.display()),
        }
    }

    /// The node's remote storage's address (`--remote-storage`), as the status pages show it.
    pub fn set_remote_url(&self, url: String) {
        let _ = self.remote_url.set(url);
    }

    /// Where `ttid` is (or would be) backed up on this node, as a timeline's status says
    /// (`remote_location`); `None` without remote storage.
    pub fn remote_location(&self, ttid: &TenantTimelineId) -> Option<String> {
        self.remote_url
            .get()
            .map(|url| crate::remote_storage::timeline_location(url, ttid))
    }

    /// Notified when a timeline is added or deleted (one stored permit).
    pub fn changed(&self) -> &tokio::sync::Notify {
        &self.changed
    }

    /// The deletions whose remote objects are still to be deleted.
    pub fn pending_remote_deletions(&self) -> Vec<RemoteDeletion> {
        self.remote_pending
            .lock()
            .expect("remote pending lock")
            .iter()
            .filter_map(|n| RemoteDeletion::parse(n))
            .collect()
    }

    /// Whether a deletion covering `ttid` still has remote objects to delete.
    fn remote_deletion_pending(&self, ttid: &TenantTimelineId) -> bool {
        self.pending_remote_deletions()
            .iter()
            .any(|d| d.covers(ttid))
    }

    /// Records durably that tombstone `name`'s remote objects are deleted (its content is
    /// emptied); a timeline with those ids may be created again. Blocking.
    pub fn remote_deletion_done(&self, name: &str) -> Result<(), TimelineError> {
        let _creating = self.create_lock.lock().expect("create lock");
        let path = self.datadir.join(TOMBSTONE_DIR).join(name);
        if self.fs.exists(&path) {
            let f = self
                .fs
                .open(&path, OpenMode::CreateTruncate)
                .map_err(|e| TimelineError::io(format!("writing {}", path.display()), e))?;
            if !self.no_sync {
                f.sync(sk_core::storage::fs::SyncKind::All)
                    .map_err(|e| TimelineError::io(format!("fsync {}", path.display()), e))?;
            }
        }
        self.remote_pending
            .lock()
            .expect("remote pending lock")
            .remove(name);
        Ok(())
    }

    /// Refuses a new timeline `ttid` while a deletion of the same ids has remote objects left.
    fn refuse_while_deleting(&self, ttid: &TenantTimelineId) -> Result<(), TimelineError> {
        if self.remote_deletion_pending(ttid) {
            return Err(TimelineError::BeingDeleted(*ttid));
        }
        Ok(())
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// The timeline `ttid`, if this node has it.
    pub fn get(&self, ttid: &TenantTimelineId) -> Option<Arc<Timeline>> {
        self.map.lock().expect("timelines lock").get(ttid).cloned()
    }

    /// The evicted timeline `ttid`, if this node has it evicted.
    pub fn get_evicted(&self, ttid: &TenantTimelineId) -> Option<Arc<EvictedTimeline>> {
        self.evicted
            .lock()
            .expect("evicted lock")
            .get(ttid)
            .cloned()
    }

    /// Every evicted timeline, in id order.
    pub fn all_evicted(&self) -> Vec<Arc<EvictedTimeline>> {
        let mut v: Vec<_> = self
            .evicted
            .lock()
            .expect("evicted lock")
            .values()
            .cloned()
            .collect();
        v.sort_by_key(|t| t.ttid);
        v
    }

    /// The ids of every timeline here, resident or evicted, in order.
    pub fn ids(&self) -> Vec<TenantTimelineId> {
        let mut v: Vec<TenantTimelineId> = {
            let map = self.map.lock().expect("timelines lock");
            let evicted = self.evicted.lock().expect("evicted lock");
            map.keys().chain(evicted.keys()).copied().collect()
        };
        v.sort();
        v
    }

    /// How many timelines are resident and how many evicted.
    pub fn counts(&self) -> (usize, usize) {
        let map = self.map.lock().expect("timelines lock");
        let evicted = self.evicted.lock().expect("evicted lock");
        (map.len(), evicted.len())
    }

    /// Whether this node has `ttid`, resident or evicted.
    pub fn contains(&self, ttid: &TenantTimelineId) -> bool {
        self.get(ttid).is_some() || self.get_evicted(ttid).is_some()
    }

    /// Sets the node's remote storage, which restores download from (first call wins).
    pub fn set_storage(&self, storage: Arc<RemoteStorage>) {
        let _ = self.storage.set(storage);
    }

    /// The node's remote storage, once set.
    pub fn storage(&self) -> Option<&Arc<RemoteStorage>> {
        self.storage.get()
    }

    /// The permits of restores running at once (`--max-concurrent-restores`).
    pub fn restore_permits(&self) -> &Arc<tokio::sync::Semaphore> {
        &self.restore_permits
    }

    /// Sets how many restores may run at once (before any runs).
    pub fn set_max_restores(&mut self, n: usize) {
        self.restore_permits = Arc::new(tokio::sync::Semaphore::new(n.max(1)));
    }

    /// Evicts `tl` ([`crate::evict`], steps 1 to 3) if its WAL still ends at `end` and nothing
    /// is connected: flags it durably, moves it to the evicted timelines, removes its segment
    /// files. Returns how many files it removed. Blocking.
    pub fn evict(
        &self,
        tl: &Arc<Timeline>,
        end: sk_core::types::Lsn,
    ) -> Result<usize, TimelineError> {
        self.evict_steps(tl, end, EvictStep::All)
    }

    /// [`GlobalTimelines::evict`], stopping (as a process killed there would) after `upto`:
    /// what the simulation crashes between.
    pub(crate) fn evict_steps(
        &self,
        tl: &Arc<Timeline>,
        end: sk_core::types::Lsn,
        upto: EvictStep,
    ) -> Result<usize, TimelineError> {
        let _creating = self.create_lock.lock().expect("create lock");
        match self.get(&tl.ttid) {
            Some(t) if Arc::ptr_eq(&t, tl) => {}
            _ => {
                return Err(TimelineError::BadRequest(format!(
                    "timeline {} is not resident here",
                    tl.ttid
                )));
            }
        }
        let state = tl.begin_eviction(end)?;
        if upto == EvictStep::Flag {
            return Ok(0);
        }
        {
            let mut map = self.map.lock().expect("timelines lock");
            map.remove(&tl.ttid);
            self.evicted.lock().expect("evicted lock").insert(
                tl.ttid,
                Arc::new(EvictedTimeline::new(tl.dir.clone(), state)),
            );
        }
        self.changed.notify_one();
        if upto == EvictStep::Registry {
            return Ok(0);
        }
        Ok(crate::evicted::remove_local_wal(
            &self.fs,
            &tl.dir,
            tl.seg_size,
            self.no_sync,
        )?)
    }

    /// Restores the evicted timeline `ttid` from `data` (its end segment's bytes, downloaded
    /// by [`crate::evict::restore`]; `None` if it needs none): steps 2 to 4 of
    /// [`crate::evict`]. Returns the resident timeline. Blocking.
    pub fn restore_from(
        &self,
        ttid: &TenantTimelineId,
        data: Option<&[u8]>,
    ) -> Result<Arc<Timeline>, TimelineError> {
        self.restore_steps(ttid, data, RestoreStep::All)
    }

    /// The end of WAL of evicted timeline `ttid` (what a restore downloads for).
    pub fn evicted_end(&self, ttid: &TenantTimelineId) -> Option<sk_core::types::Lsn> {
        self.get_evicted(ttid).map(|e| e.end_lsn())
    }

    /// [`GlobalTimelines::restore_from`], stopping after `upto` (see
    /// [`GlobalTimelines::evict_steps`]).
    pub(crate) fn restore_steps(
        &self,
        ttid: &TenantTimelineId,
        data: Option<&[u8]>,
        upto: RestoreStep,
    ) -> Result<Arc<Timeline>, TimelineError> {
        let _creating = self.create_lock.lock().expect("create lock");
        if let Some(tl) = self.get(ttid) {
            return Ok(tl);
        }
        let Some(e) = self.get_evicted(ttid) else {
            return Err(TimelineError::NotFound(*ttid));
        };
        let (fs, seg_size) = (&self.fs, e.seg_size());
        match (e.segment_to_restore(), data) {
            (Some(_), Some(data)) => crate::evicted::write_restored_segment(
                fs,
                &e.dir,
                seg_size,
                e.end_lsn(),
                data,
                self.no_sync,
            )?,
            (Some(segno), None) => {
                return Err(sk_core::storage::Error::Rejected(format!(
                    "restoring timeline {ttid}: segment {segno} is needed and was not given"
                ))
                .into());
            }
            (None, _) => {}
        }
        if upto == RestoreStep::Download {
            return Err(TimelineError::BadRequest(
                "stopped after the download".into(),
            ));
        }
        let opened = self.open_timeline(&e.dir).and_then(|tl| {
            let end = tl.positions().flush_lsn;
            if end != e.end_lsn() {
                return Err(sk_core::storage::Error::Rejected(format!(
                    "the restored WAL ends at {end}, the evicted timeline's at {}",
                    e.end_lsn()
                ))
                .into());
            }
            if upto == RestoreStep::Open {
                return Err(TimelineError::BadRequest("stopped after the open".into()));
            }
            tl.finish_restore()
                .map_err(|source| TimelineError::Acceptor {
                    ttid: *ttid,
                    dir: e.dir.display().to_string(),
                    source: Box::new(source),
                })?;
            Ok(tl)
        });
        let tl = match opened {
            Ok(tl) => Arc::new(tl),
            Err(err) => {
                if upto == RestoreStep::All {
                    // Stays evicted: the downloaded file goes (start-up would remove it too).
                    if let Err(r) =
                        crate::evicted::remove_local_wal(fs, &e.dir, seg_size, self.no_sync)
                    {
                        tracing::warn!(%ttid, "removing a failed restore's files: {r}");
                    }
                }
                return Err(err);
            }
        };
        if let Some(r) = self.storage.get() {
            tl.set_remote(r.clone());
        }
        self.measure_new(&tl);
        {
            let mut map = self.map.lock().expect("timelines lock");
            self.evicted.lock().expect("evicted lock").remove(ttid);
            map.insert(*ttid, tl.clone());
        }
        self.changed.notify_one();
        Ok(tl)
    }

    /// Every timeline, in id order.
    pub fn all(&self) -> Vec<Arc<Timeline>> {
        let mut v: Vec<_> = self
            .map
            .lock()
            .expect("timelines lock")
            .values()
            .cloned()
            .collect();
        v.sort_by_key(|t| t.ttid);
        v
    }

    /// The timeline a greeting names, created if absent and `allow_creation`. Blocking when it
    /// creates (directory creation and fsyncs).
    pub fn get_or_create(
        &self,
        greeting: &ProposerGreeting,
        allow_creation: bool,
    ) -> Result<Arc<Timeline>, TimelineError> {
        let ttid = greeting.ttid();
        if let Some(tl) = self.get(&ttid) {
            // Flagged and on its way out (an eviction in progress): evicted.
            if tl.is_evicted() {
                return Err(TimelineError::Evicted(ttid));
            }
            return Ok(tl);
        }
        if self.get_evicted(&ttid).is_some() {
            return Err(TimelineError::Evicted(ttid));
        }
        if !allow_creation {
            return Err(TimelineError::NotFound(ttid));
        }
        if !is_valid_seg_size(greeting.wal_seg_size as u64) {
            return Err(TimelineError::BadSegmentSize(greeting.wal_seg_size));
        }
        PgMajor::from_server_version(greeting.pg_version)?;
        let _creating = self.create_lock.lock().expect("create lock");
        if let Some(tl) = self.get(&ttid) {
            return Ok(tl);
        }
        if self.get_evicted(&ttid).is_some() {
            return Err(TimelineError::Evicted(ttid));
        }
        if self.is_tombstoned(&ttid) {
            return Err(TimelineError::Deleted(ttid));
        }
        let tl = Arc::new(self.create(&CreateTimeline {
            ttid,
            server: ServerInfo {
                pg_version: greeting.pg_version,
                system_id: greeting.system_id,
                wal_seg_size: greeting.wal_seg_size,
            },
            start_lsn: sk_core::types::Lsn::INVALID,
            // Membership starts empty (generation 0); the greeting itself is processed next
            // and adopts the proposer's configuration through the usual checks.
            mconf: Configuration::default(),
        })?);
        self.measure_new(&tl);
        self.map
            .lock()
            .expect("timelines lock")
            .insert(ttid, tl.clone());
        self.changed.notify_one();
        tracing::info!(seg_size = greeting.wal_seg_size, "timeline created");
        Ok(tl)
    }

    /// Whether `ttid` or its tenant was deleted here (and not created explicitly since).
    fn is_tombstoned(&self, ttid: &TenantTimelineId) -> bool {
        let t = self.tombstones.lock().expect("tombstones lock");
        t.contains(&ttid.tenant_id.to_string()) || t.contains(&timeline_tombstone(ttid))
    }

    /// The operator's create (`POST /v1/tenant/{t}/timeline`): makes `req`'s timeline durably
    /// and clears the tombstones of the timeline and of its tenant. Refuses one that exists.
    /// Blocking.
    pub fn create_explicit(&self, req: &CreateTimeline) -> Result<Arc<Timeline>, TimelineError> {
        if !is_valid_seg_size(req.server.wal_seg_size as u64) {
            return Err(TimelineError::BadSegmentSize(req.server.wal_seg_size));
        }
        PgMajor::from_server_version(req.server.pg_version)?;
        req.mconf.validate().map_err(TimelineError::BadRequest)?;
        let _creating = self.create_lock.lock().expect("create lock");
        if self.contains(&req.ttid) {
            return Err(TimelineError::Exists(req.ttid));
        }
        self.refuse_while_deleting(&req.ttid)?;
        // A crash after the rename and before the tombstones are cleared leaves a tombstoned
        // directory, removed at start-up: this create was not acknowledged.
        let tl = Arc::new(self.create(req)?);
        for name in [
            req.ttid.tenant_id.to_string(),
            timeline_tombstone(&req.ttid),
        ] {
            self.clear_tombstone(&name)?;
        }
        self.measure_new(&tl);
        self.map
            .lock()
            .expect("timelines lock")
            .insert(req.ttid, tl.clone());
        self.changed.notify_one();
        tracing::info!(mconf = ?req.mconf, start_lsn = %req.start_lsn, "timeline created over HTTP");
        Ok(tl)
    }

    /// The file system the timelines live on.
    pub fn fs(&self) -> &Fs {
        &self.fs
    }

    /// The LRU of open segment files shared by the timelines.
    pub fn open_files(&self) -> &OpenFiles {
        &self.open_files
    }

    /// Opens the timeline in `dir` as this node's stores are: in its LRU of open files, with
    /// its segment pool.
    fn open_timeline(&self, dir: &Path) -> Result<Timeline, TimelineError> {
        Timeline::open(
            &self.fs,
            dir,
            self.node_id,
            self.no_sync,
            &self.open_files,
            self.pool.as_ref(),
        )
    }

    /// Whether fsyncs are skipped (`--no-sync`, tests only).
    pub fn no_sync(&self) -> bool {
        self.no_sync
    }

    /// Starts a pull of `ttid`: refused while another pull of it runs here or while a
    /// deletion of it has remote objects left. Returns the directory (unique, under `tmp/`,
    /// emptied at start-up) the pull builds it in, and the guard that ends the pull.
    pub fn begin_pull(
        &self,
        ttid: &TenantTimelineId,
    ) -> Result<(PathBuf, PullGuard), TimelineError> {
        self.refuse_while_deleting(ttid)?;
        if !self.pulling.lock().expect("pulling lock").insert(*ttid) {
            return Err(TimelineError::BadRequest(format!(
                "a pull of timeline {ttid} is in progress on this safekeeper"
            )));
        }
        let guard = PullGuard {
            pulling: self.pulling.clone(),
            ttid: *ttid,
        };
        let nanos = now_nanos();
        let dir = self.datadir.join(TMP_DIR).join(format!(
            "pull_{}_{}_{nanos}",
            ttid.tenant_id, ttid.timeline_id
        ));
        Ok((dir, guard))
    }

    /// Installs a pulled timeline built (and made durable) in `tmp`: under a durable tombstone
    /// (so a crash before the end leaves nothing that is served: start-up removes a tombstoned
    /// directory), renames it into place durably, opens it (which verifies it again), and only
    /// then clears its tombstones and registers it. Refuses if the timeline appeared meanwhile,
    /// or if it opens with another end of WAL than `flush` (the directory is then removed).
    /// Blocking.
    pub fn install_pulled(
        &self,
        ttid: TenantTimelineId,
        tmp: &Path,
        flush: sk_core::types::Lsn,
    ) -> Result<Arc<Timeline>, TimelineError> {
        let fs = &self.fs;
        let _creating = self.create_lock.lock().expect("create lock");
        if self.contains(&ttid) {
            let _ = fs.remove_dir_all(tmp);
            return Err(TimelineError::Exists(ttid));
        }
        if let Err(e) = self.refuse_while_deleting(&ttid) {
            let _ = fs.remove_dir_all(tmp);
            return Err(e);
        }
        let dir = self
            .datadir
            .join(ttid.tenant_id.to_string())
            .join(ttid.timeline_id.to_string());
        if fs.exists(&dir) {
            // Files of a timeline this node does not serve (its deletion was interrupted).
            remove_durably(fs, &self.datadir, &dir, self.no_sync)?;
        }
        let name = timeline_tombstone(&ttid);
        let tombstoned = self.is_tombstoned(&ttid);
        if !self
            .tombstones
            .lock()
            .expect("tombstones lock")
            .contains(&name)
        {
            // Not live until verified; no remote deletion to record (nothing was deleted).
            self.write_tombstone_with(&name, false)?;
        }
        let dir = self.rename_into_place(tmp, ttid)?;
        let opened = self.open_timeline(&dir).and_then(|tl| {
            if tl.positions().flush_lsn != flush {
                return Err(TimelineError::BadRequest(format!(
                    "the pulled timeline opened with its WAL ending at {}, the snapshot \
                         said {flush}",
                    tl.positions().flush_lsn
                )));
            }
            Ok(tl)
        });
        let tl = match opened {
            Ok(tl) => Arc::new(tl),
            Err(e) => {
                // Never served: remove it under its tombstone, and leave the tombstones as
                // they were.
                let _ = remove_durably(fs, &self.datadir, &dir, self.no_sync);
                if !tombstoned {
                    let _ = self.clear_tombstone(&name);
                }
                return Err(e);
            }
        };
        for name in [ttid.tenant_id.to_string(), name] {
            self.clear_tombstone(&name)?;
        }
        self.measure_new(&tl);
        self.map
            .lock()
            .expect("timelines lock")
            .insert(ttid, tl.clone());
        self.changed.notify_one();
        tracing::info!(%ttid, %flush, "pulled timeline installed");
        Ok(tl)
    }

    /// Writes tombstone `name` durably (its directory entry fsynced), marking its remote
    /// objects to delete if `remote`.
    fn write_tombstone_with(&self, name: &str, remote: bool) -> Result<(), TimelineError> {
        let fs = &self.fs;
        let dir = self.datadir.join(TOMBSTONE_DIR);
        let new_dir = !fs.exists(&dir);
        fs.create_dir_all(&dir)
            .map_err(|e| TimelineError::io(format!("creating {}", dir.display()), e))?;
        let path = dir.join(name);
        let file = fs
            .open(&path, OpenMode::CreateTruncate)
            .map_err(|e| TimelineError::io(format!("writing {}", path.display()), e))?;
        if remote {
            file.write_all_at(REMOTE_PENDING, 0)
                .map_err(|e| TimelineError::io(format!("writing {}", path.display()), e))?;
            if !self.no_sync {
                file.sync(sk_core::storage::fs::SyncKind::All)
                    .map_err(|e| TimelineError::io(format!("fsync {}", path.display()), e))?;
            }
        }
        drop(file);
        if remote {
            self.remote_pending
                .lock()
                .expect("remote pending lock")
                .insert(name.to_string());
        }
        if !self.no_sync {
            fsync_dir(fs, &dir)?;
            if new_dir {
                fsync_dir(fs, &self.datadir)?;
            }
        }
        self.tombstones
            .lock()
            .expect("tombstones lock")
            .insert(name.to_string());
        Ok(())
    }

    /// Removes tombstone `name` durably, if present.
    fn clear_tombstone(&self, name: &str) -> Result<(), TimelineError> {
        if !self
            .tombstones
            .lock()
            .expect("tombstones lock")
            .contains(name)
        {
            return Ok(());
        }
        let dir = self.datadir.join(TOMBSTONE_DIR);
        let path = dir.join(name);
        self.fs
            .remove_file(&path)
            .map_err(|e| TimelineError::io(format!("removing {}", path.display()), e))?;
        if !self.no_sync {
            fsync_dir(&self.fs, &dir)?;
        }
        self.tombstones
            .lock()
            .expect("tombstones lock")
            .remove(name);
        self.remote_pending
            .lock()
            .expect("remote pending lock")
            .remove(name);
        Ok(())
    }

    /// Whether a delete of `scope` of the timelines `tls` here also deletes their objects in
    /// the store ([`crate::manager::deletes_remote_objects`]: refused on a node that is not a
    /// member of one of them, naming `what`, the timeline or tenant deleted).
    fn deletes_remote(
        &self,
        scope: DeleteScope,
        tls: &[(TenantTimelineId, Configuration)],
        what: &str,
    ) -> Result<bool, TimelineError> {
        let remote = self.remote_on.load(Ordering::SeqCst);
        let decide = |mconf: Option<&Configuration>| {
            crate::manager::deletes_remote_objects(scope, remote, mconf, self.node_id)
        };
        let refuse = |reason| TimelineError::NotAMember {
            what: what.to_string(),
            reason,
        };
        let mut all = decide(None).map_err(refuse)?;
        for (ttid, mconf) in tls {
            all &= decide(Some(mconf)).map_err(|r| refuse(format!("timeline {ttid}: {r}")))?;
        }
        Ok(all)
    }

    /// The membership configurations of the timelines here (resident or evicted) whose ids
    /// `pick` chooses.
    fn mconfs(
        &self,
        pick: impl Fn(&TenantTimelineId) -> bool,
    ) -> Vec<(TenantTimelineId, Configuration)> {
        let mut v: Vec<_> = self
            .all()
            .into_iter()
            .filter(|t| pick(&t.ttid))
            .map(|t| (t.ttid, t.mconf()))
            .collect();
        v.extend(
            self.all_evicted()
                .into_iter()
                .filter(|e| pick(&e.ttid))
                .map(|e| (e.ttid, e.state.mconf.clone())),
        );
        v
    }

    /// The operator's delete of one timeline: a durable tombstone first (a late proposer
    /// cannot recreate it, a crash midway finishes the deletion at start-up), then its
    /// connections end, then its directory goes durably; with `scope` everywhere (and remote
    /// storage) the tombstone also records that its objects in the store are to be deleted.
    /// Returns whether it existed. Blocking.
    pub fn delete_timeline(
        &self,
        ttid: &TenantTimelineId,
        scope: DeleteScope,
    ) -> Result<bool, TimelineError> {
        let _deleting = self.create_lock.lock().expect("create lock");
        let here = self.mconfs(|t| t == ttid);
        let remote = self.deletes_remote(scope, &here, &format!("timeline {ttid}"))?;
        self.write_tombstone_with(&timeline_tombstone(ttid), remote)?;
        let tl = self.map.lock().expect("timelines lock").remove(ttid);
        let evicted = self.evicted.lock().expect("evicted lock").remove(ttid);
        if let Some(tl) = &tl {
            tl.mark_deleted();
        }
        let dir = self
            .datadir
            .join(ttid.tenant_id.to_string())
            .join(ttid.timeline_id.to_string());
        let existed = self.fs.exists(&dir);
        if existed {
            remove_durably(&self.fs, &self.datadir, &dir, self.no_sync)?;
        }
        self.changed.notify_one();
        tracing::info!(%ttid, existed, remote, "timeline deleted over HTTP");
        Ok(existed || tl.is_some() || evicted.is_some())
    }

    /// The operator's delete of a whole tenant, as [`GlobalTimelines::delete_timeline`] with
    /// one tombstone for the tenant (any timeline of it, known here or not). Returns how many
    /// timelines it had here. Blocking.
    pub fn delete_tenant(
        &self,
        tenant_id: &TenantId,
        scope: DeleteScope,
    ) -> Result<usize, TimelineError> {
        let _deleting = self.create_lock.lock().expect("create lock");
        let here = self.mconfs(|t| t.tenant_id == *tenant_id);
        let remote = self.deletes_remote(scope, &here, &format!("tenant {tenant_id}"))?;
        self.write_tombstone_with(&tenant_id.to_string(), remote)?;
        let gone: Vec<Arc<Timeline>> = {
            let mut map = self.map.lock().expect("timelines lock");
            let ids: Vec<_> = map
                .keys()
                .filter(|t| t.tenant_id == *tenant_id)
                .copied()
                .collect();
            ids.iter().filter_map(|t| map.remove(t)).collect()
        };
        let evicted = {
            let mut ev = self.evicted.lock().expect("evicted lock");
            let before = ev.len();
            ev.retain(|t, _| t.tenant_id != *tenant_id);
            before - ev.len()
        };
        for tl in &gone {
            tl.mark_deleted();
        }
        let dir = self.datadir.join(tenant_id.to_string());
        if self.fs.exists(&dir) {
            remove_durably(&self.fs, &self.datadir, &dir, self.no_sync)?;
        }
        self.changed.notify_one();
        tracing::info!(%tenant_id, timelines = gone.len() + evicted, "tenant deleted over HTTP");
        Ok(gone.len() + evicted)
    }

    /// Builds the directory of a new timeline under `tmp/`, makes its control file and its
    /// entries durable, renames it into its tenant directory durably, and opens it.
    fn create(&self, req: &CreateTimeline) -> Result<Timeline, TimelineError> {
        let fs = &self.fs;
        let io = |what: &str, path: &Path| {
            let context = format!("{what} {}", path.display());
            move |e| TimelineError::io(context, e)
        };
        let ttid = req.ttid;
        let tmp = self
            .datadir
            .join(TMP_DIR)
            .join(format!("{}_{}", ttid.tenant_id, ttid.timeline_id));
        if fs.exists(&tmp) {
            fs.remove_dir_all(&tmp).map_err(io("removing", &tmp))?;
        }
        fs.create_dir_all(&tmp).map_err(io("creating", &tmp))?;
        let created = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut state = TimelinePersistentState::new(
            ttid.tenant_id,
            ttid.timeline_id,
            req.mconf.clone(),
            req.server.clone(),
            created,
        );
        if req.start_lsn.is_valid() {
            state.timeline_start_lsn = req.start_lsn;
            state.local_start_lsn = req.start_lsn;
        }
        FileControlStore::create_new_in(fs.clone(), &tmp, state, self.no_sync)?;
        if !self.no_sync {
            fsync_dir(fs, &tmp)?;
        }
        let dir = self.rename_into_place(&tmp, ttid)?;
        self.open_timeline(&dir)
    }

    /// Renames the complete timeline directory `tmp` to `ttid`'s place (creating its tenant
    /// directory if needed) and makes the rename durable: the timeline directory is in its
    /// tenant directory, and a new tenant directory in the data directory, before anyone uses
    /// it. Returns the timeline directory.
    fn rename_into_place(
        &self,
        tmp: &Path,
        ttid: TenantTimelineId,
    ) -> Result<PathBuf, TimelineError> {
        let fs = &self.fs;
        let tenant_dir = self.datadir.join(ttid.tenant_id.to_string());
        let new_tenant = !fs.exists(&tenant_dir);
        fs.create_dir_all(&tenant_dir)
            .map_err(|e| TimelineError::io(format!("creating {}", tenant_dir.display()), e))?;
        let dir = tenant_dir.join(ttid.timeline_id.to_string());
        fs.rename(tmp, &dir).map_err(|e| {
            TimelineError::io(
                format!("renaming {} to {}", tmp.display(), dir.display()),
                e,
            )
        })?;
        if !self.no_sync {
            fsync_dir(fs, &tenant_dir)?;
            if new_tenant {
                fsync_dir(fs, &self.datadir)?;
            }
        }
        Ok(dir)
    }

    /// Persists every timeline's in-memory state (shutdown). Blocking. Failures are logged.
    pub fn persist_all(&self) {
        for tl in self.all() {
            if let Err(e) = tl.maybe_persist(true) {
                let _span = crate::timeline::span(&tl.ttid).entered();
                tracing::error!("persisting control file: {e}");
            }
        }
    }
}

/// The content of small file `path` (a tombstone).
fn read_small(fs: &Fs, path: &Path) -> Result<Vec<u8>, TimelineError> {
    let f = fs
        .open(path, OpenMode::Read)
        .map_err(|e| TimelineError::io(format!("reading {}", path.display()), e))?;
    let mut buf = vec![0u8; 64];
    let n = sk_core::storage::fs::read_full_at(&*f, &mut buf, 0)
        .map_err(|e| TimelineError::io(format!("reading {}", path.display()), e))?;
    buf.truncate(n);
    Ok(buf)
}

/// Restores running at once on a node, by default (`--max-concurrent-restores`).
pub const DEFAULT_RESTORES: usize = 8;

/// Where [`GlobalTimelines::evict_steps`] stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum EvictStep {
    /// After the flag is persisted.
    Flag,
    /// After the registry moved it.
    Registry,
    /// Not before the end.
    All,
}

/// Where [`GlobalTimelines::restore_steps`] stops.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RestoreStep {
    /// After the segment is written.
    Download,
    /// After the timeline is opened (the flag still set).
    Open,
    /// Not before the end.
    All,
}

/// A timeline as start-up found it.
enum Loaded {
    Resident(Box<Timeline>),
    Evicted(EvictedTimeline),
}

/// Loads the timeline in `dir`: an evicted one (its control file says so) has what is left of
/// its segment files removed and is not opened; any other is opened.
fn load_one(
    fs: &Fs,
    dir: &Path,
    node_id: NodeId,
    no_sync: bool,
    open_files: &OpenFiles,
    pool: Option<&SegmentPool>,
) -> Result<Loaded, TimelineError> {
    let control = FileControlStore::load_in(fs.clone(), dir, no_sync)?;
    if control.evicted {
        let removed = crate::evicted::remove_local_wal(
            fs,
            dir,
            u64::from(control.server.wal_seg_size),
            no_sync,
        )?;
        if removed > 0 {
            tracing::info!(
                removed,
                "finished an eviction (or undid a restore) cut short"
            );
        }
        return Ok(Loaded::Evicted(EvictedTimeline::new(
            dir.to_path_buf(),
            control.shared(),
        )));
    }
    Ok(Loaded::Resident(Box::new(Timeline::open_with(
        fs, dir, control, node_id, no_sync, open_files, pool,
    )?)))
}

/// Timelines opened at once at start-up. Opening one fsyncs its control file and recovered WAL;
/// fsyncs in flight together share the disk's cache flushes (one flush covers all the waiting
/// ones), so 10,000 timelines load in seconds rather than the minutes one at a time takes.
const LOAD_THREADS: usize = 32;

/// Opens the timelines of `dirs` (tenant and timeline names, directory) on up to
/// [`LOAD_THREADS`] threads. The first failure stops the others and is returned.
fn open_all(
    fs: &Fs,
    dirs: &[(String, String, PathBuf)],
    node_id: NodeId,
    no_sync: bool,
    open_files: &OpenFiles,
    pool: Option<&SegmentPool>,
) -> Result<Vec<Loaded>, TimelineError> {
    let next = AtomicUsize::new(0);
    let opened = Mutex::new(Vec::with_capacity(dirs.len()));
    let failed: Mutex<Option<TimelineError>> = Mutex::new(None);
    let open_next = || {
        while failed.lock().expect("load error lock").is_none() {
            let Some((tenant, timeline, dir)) = dirs.get(next.fetch_add(1, Ordering::Relaxed))
            else {
                return;
            };
            let _span =
                tracing::info_span!("timeline", tenant_id = %tenant, timeline_id = %timeline)
                    .entered();
            match load_one(fs, dir, node_id, no_sync, open_files, pool) {
                Ok(loaded) => {
                    match &loaded {
                        Loaded::Resident(tl) => {
                            tracing::info!(positions = ?tl.positions(), "timeline loaded")
                        }
                        Loaded::Evicted(e) => {
                            tracing::debug!(end = %e.end_lsn(), "evicted timeline loaded")
                        }
                    }
                    opened.lock().expect("loaded timelines lock").push(loaded);
                }
                Err(e) => {
                    failed.lock().expect("load error lock").get_or_insert(e);
                }
            }
        }
    };
    std::thread::scope(|s| {
        for _ in 1..LOAD_THREADS.min(dirs.len()) {
            s.spawn(open_next);
        }
        open_next();
    });
    match failed.into_inner().expect("load error lock") {
        Some(e) => Err(e),
        None => Ok(opened.into_inner().expect("loaded timelines lock")),
    }
}

/// Nanoseconds since the epoch: what makes a name under `tmp/` unique.
fn now_nanos() -> u128 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

/// Removes directory `dir` durably: renamed into `<datadir>/tmp/` (atomic; its parent's entry
/// fsynced), then removed (a crash leaves it in `tmp/`, emptied at start-up).
fn remove_durably(fs: &Fs, datadir: &Path, dir: &Path, no_sync: bool) -> Result<(), TimelineError> {
    let parent = dir.parent().unwrap_or(datadir);
    let tmp_dir = datadir.join(TMP_DIR);
    fs.create_dir_all(&tmp_dir)
        .map_err(|e| TimelineError::io(format!("creating {}", tmp_dir.display()), e))?;
    let nanos = now_nanos();
    let name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("dir");
    let target = tmp_dir.join(format!("deleting_{name}_{nanos}"));
    fs.rename(dir, &target).map_err(|e| {
        TimelineError::io(
            format!("renaming {} to {}", dir.display(), target.display()),
            e,
        )
    })?;
    if !no_sync {
        fsync_dir(fs, parent)?;
    }
    fs.remove_dir_all(&target)
        .map_err(|e| TimelineError::io(format!("removing {}", target.display()), e))
}

/// The entries of directory `dir`, as paths, in name order.
fn list_dir_sorted(fs: &Fs, dir: &Path) -> Result<Vec<PathBuf>, TimelineError> {
    let mut names = fs
        .list_dir(dir)
        .map_err(|e| TimelineError::io(format!("reading {}", dir.display()), e))?;
    names.sort();
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
}

/// `safekeeper_timelines{state}`: timelines by state (`active`: a proposer or reader connected;
/// `idle`: resident, nothing connected; `evicted`).
const TIMELINES_BY_STATE: (&str, &str) = (
    "safekeeper_timelines",
    "Timelines of this node by state: active (a connection), idle (resident), evicted",
);

/// `safekeeper_wal_bytes{location}`: WAL of every timeline of this node in its local segments
/// (`local`), and in remote storage by the timelines' LSNs (`remote`: complete segments backed
/// up; for an evicted timeline, all its WAL).
const WAL_BYTES: (&str, &str) = (
    "safekeeper_wal_bytes",
    "WAL of this node's timelines: in local segments (location=local), in remote storage \
     (location=remote: complete segments backed up, and all of an evicted timeline's WAL)",
);

/// Per-timeline gauges, read from the timelines at scrape time.
pub struct TimelineCollector {
    timelines: Weak<GlobalTimelines>,
    descs: Vec<Desc>,
}

const TIMELINE_GAUGES: &[(&str, &str)] = &[
    (
        "safekeeper_flush_lsn",
        "Durable end of the timeline's WAL (bytes)",
    ),
    (
        "safekeeper_commit_lsn",
        "Committed end of the timeline's WAL known here (bytes)",
    ),
    (
        "safekeeper_acceptor_term",
        "Current term of the timeline's acceptor",
    ),
    (
        "safekeeper_timeline_wal_receivers",
        "Proposers connected to the timeline",
    ),
    (
        "safekeeper_timeline_wal_readers",
        "Readers connected to the timeline",
    ),
    (
        "safekeeper_backup_lsn",
        "End of the timeline's WAL backed up to remote storage (bytes; 0 without remote storage)",
    ),
    (
        "safekeeper_backup_lag_bytes",
        "Committed WAL in complete segments not yet backed up (0 without remote storage)",
    ),
    (
        "safekeeper_timeline_local_wal_bytes",
        "WAL held in the timeline's local segments: from the first local segment to the flush LSN",
    ),
    (
        "safekeeper_reader_flush_lag_bytes_min",
        "Committed WAL not yet flushed by the timeline's least-lagging reporting reader (bytes)",
    ),
    (
        "safekeeper_reader_flush_lag_bytes_max",
        "Committed WAL not yet flushed by the timeline's most-lagging reporting reader (bytes)",
    ),
    (
        "safekeeper_reader_replay_lag_bytes_min",
        "Committed WAL not yet applied by the timeline's least-lagging reporting reader (bytes)",
    ),
    (
        "safekeeper_reader_replay_lag_bytes_max",
        "Committed WAL not yet applied by the timeline's most-lagging reporting reader (bytes)",
    ),
    (
        "safekeeper_readers_hs_feedback_xmin",
        "Oldest xmin the timeline's hot standbys need, as a full 64-bit xid (0: none)",
    ),
];

/// The per-timeline gauges in seconds, after the integer ones: Prometheus names carry base units.
const TIMELINE_SECONDS_GAUGES: &[(&str, &str)] = &[
    (
        "safekeeper_reader_flush_lag_seconds_max",
        "Largest time from sending WAL to a reader's report of flushing it (0: none measured)",
    ),
    (
        "safekeeper_reader_replay_lag_seconds_max",
        "Largest time from sending WAL to a reader's report of applying it (0: none measured)",
    ),
];

impl TimelineCollector {
    /// Registers the gauges of `timelines` in the default registry (once per process: a second
    /// daemon in one process, as tests start, keeps the first one's).
    pub fn register(timelines: &Arc<GlobalTimelines>) {
        let descs = TIMELINE_GAUGES
            .iter()
            .chain(TIMELINE_SECONDS_GAUGES)
            .map(|(name, help)| {
                Desc::new(
                    name.to_string(),
                    help.to_string(),
                    vec!["tenant_id".into(), "timeline_id".into()],
                    Default::default(),
                )
                .expect("valid metric")
            })
            .chain(
                [(TIMELINES_BY_STATE, "state"), (WAL_BYTES, "location")].map(
                    |((name, help), label)| {
                        Desc::new(
                            name.to_string(),
                            help.to_string(),
                            vec![label.into()],
                            Default::default(),
                        )
                        .expect("valid metric")
                    },
                ),
            )
            .collect();
        let c = TimelineCollector {
            timelines: Arc::downgrade(timelines),
            descs,
        };
        // A second daemon in one process (tests) finds it registered already: keep the first.
        let _ = prometheus::register(Box::new(c));
    }
}

/// One gauge vector per `(name, help)` of `gauges`, labelled by tenant and timeline.
fn timeline_gauges<V>(
    gauges: &[(&str, &str)],
    new: impl Fn(Opts, &[&str]) -> prometheus::Result<V>,
) -> Vec<V> {
    gauges
        .iter()
        .map(|(name, help)| {
            new(Opts::new(*name, *help), &["tenant_id", "timeline_id"]).expect("valid metric")
        })
        .collect()
}

impl Collector for TimelineCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Some(timelines) = self.timelines.upgrade() else {
            return Vec::new();
        };
        let vecs = timeline_gauges(TIMELINE_GAUGES, IntGaugeVec::new);
        let seconds = timeline_gauges(TIMELINE_SECONDS_GAUGES, GaugeVec::new);
        let by_state = IntGaugeVec::new(
            Opts::new(TIMELINES_BY_STATE.0, TIMELINES_BY_STATE.1),
            &["state"],
        )
        .expect("valid metric");
        let wal_bytes =
            IntGaugeVec::new(Opts::new(WAL_BYTES.0, WAL_BYTES.1), &["location"]).expect("valid");
        let (mut local_bytes, mut remote_bytes) = (0u64, 0u64);
        for e in timelines.all_evicted() {
            remote_bytes += e.end_lsn().0.saturating_sub(e.wal_start_lsn().0);
        }
        let resident = timelines.all();
        let active = resident.iter().filter(|t| t.connections() > 0).count();
        for (state, n) in [
            ("active", active),
            ("idle", resident.len() - active),
            ("evicted", timelines.counts().1),
        ] {
            by_state.with_label_values(&[state]).set(n as i64);
        }
        // Per-timeline series are for resident timelines; an evicted one is counted above.
        for tl in resident {
            let s = tl.status();
            let lags = tl.reader_lags();
            let t = tl.ttid.tenant_id.to_string();
            let l = tl.ttid.timeline_id.to_string();
            let labels = [t.as_str(), l.as_str()];
            let seg = u64::from(s.wal_seg_size).max(1);
            let backup_lag = match s.remote_location {
                Some(_) => (s.commit_lsn.0 - s.commit_lsn.0 % seg).saturating_sub(s.backup_lsn.0),
                None => 0,
            };
            let local_start = s.removal_horizon_lsn.max(s.local_start_lsn).0;
            let wal_start = s.local_start_lsn.max(s.timeline_start_lsn).0;
            local_bytes += s
                .flush_lsn
                .0
                .saturating_sub(local_start - local_start % seg);
            if s.remote_location.is_some() {
                remote_bytes += s.backup_lsn.0.saturating_sub(wal_start);
            }
            let values = [
                s.flush_lsn.0 as i64,
                s.commit_lsn.0 as i64,
                s.term.0 as i64,
                s.proposers as i64,
                s.readers as i64,
                s.backup_lsn.0 as i64,
                backup_lag as i64,
                s.flush_lsn
                    .0
                    .saturating_sub(local_start - local_start % seg) as i64,
                lags.flush_lag_bytes.0 as i64,
                lags.flush_lag_bytes.1 as i64,
                lags.replay_lag_bytes.0 as i64,
                lags.replay_lag_bytes.1 as i64,
                s.hs_feedback.xmin as i64,
            ];
            for (v, value) in vecs.iter().zip(values) {
                v.with_label_values(&labels).set(value);
            }
            for (v, value) in seconds
                .iter()
                .zip([lags.max_flush_lag, lags.max_replay_lag])
            {
                v.with_label_values(&labels).set(value);
            }
        }
        vecs.iter()
            .flat_map(|v| v.collect())
            .chain(seconds.iter().flat_map(|v| v.collect()))
            .chain(by_state.collect())
            .chain({
                wal_bytes
                    .with_label_values(&["local"])
                    .set(local_bytes as i64);
                wal_bytes
                    .with_label_values(&["remote"])
                    .set(remote_bytes as i64);
                wal_bytes.collect()
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use sk_core::protocol::{AcceptorProposerMessage, ProposerAcceptorMessage, VoteRequest};
    use sk_core::storage::fs::SimFs;
    use sk_core::types::{Generation, Term};

    use super::*;

    const DATADIR: &str = "/data";

    fn greeting(tl: u8) -> ProposerGreeting {
        crate::test_util::greeting(tl, 16 << 20)
    }

    /// An empty node on a simulated file system: the registry touches no real file.
    fn node() -> (Arc<SimFs>, Fs, GlobalTimelines) {
        let (sim, fs) = SimFs::with_dir(Path::new(DATADIR));
        let timelines = GlobalTimelines::load_in(fs.clone(), Path::new(DATADIR), NodeId(1), false)
            .expect("an empty datadir loads");
        (sim, fs, timelines)
    }

    #[test]
    fn greeting_creates_a_timeline_only_when_allowed() {
        let (_sim, _fs, timelines) = node();
        let g = greeting(1);
        assert!(matches!(
            timelines.get_or_create(&g, false),
            Err(TimelineError::NotFound(_))
        ));
        assert!(timelines.all().is_empty());
        let tl = timelines.get_or_create(&g, true).unwrap();
        assert_eq!(tl.system_id(), 42);
        let reply = tl
            .process_msg(&ProposerAcceptorMessage::Greeting(g.clone()))
            .unwrap();
        assert!(matches!(reply, Some(AcceptorProposerMessage::Greeting(_))));
        // Now it exists: no creation needed.
        let again = timelines.get_or_create(&g, false).unwrap();
        assert!(Arc::ptr_eq(&tl, &again));
    }

    #[test]
    fn timelines_are_independent() {
        let (_sim, _fs, timelines) = node();
        for tl in [1, 2] {
            timelines.get_or_create(&greeting(tl), true).unwrap();
        }
        let vote = ProposerAcceptorMessage::VoteRequest(VoteRequest {
            generation: Generation(0),
            term: Term(3),
        });
        let one = timelines.get(&greeting(1).ttid()).unwrap();
        one.process_msg(&vote).unwrap();
        assert_eq!(one.positions().term, Term(3));
        let two = timelines.get(&greeting(2).ttid()).unwrap();
        assert_eq!(two.positions().term, Term(0));
        assert_eq!(timelines.all().len(), 2);
    }

    #[test]
    fn invalid_segment_size_or_version_is_refused_before_touching_the_disk() {
        let (_sim, fs, timelines) = node();
        let g = ProposerGreeting {
            wal_seg_size: 3 << 20,
            ..greeting(1)
        };
        assert!(matches!(
            timelines.get_or_create(&g, true),
            Err(TimelineError::BadSegmentSize(_))
        ));
        assert!(fs.list_dir(Path::new(DATADIR)).unwrap().is_empty());
        for pg_version in [0, 130020, 190000] {
            let g = ProposerGreeting {
                pg_version,
                ..greeting(1)
            };
            let e = match timelines.get_or_create(&g, true) {
                Ok(_) => panic!("PostgreSQL {pg_version}: a timeline was created"),
                Err(e) => e,
            };
            assert!(matches!(e, TimelineError::UnsupportedVersion(_)), "{e}");
            assert!(e.to_string().contains("14 to 18"), "{e}");
        }
        assert!(fs.list_dir(Path::new(DATADIR)).unwrap().is_empty());
    }

    /// A control-file save begun before the timeline was deleted (the manager's, taken under
    /// the acceptor lock and written outside it) never writes: the directory holds the timeline
    /// created again since, whose vote it would take back.
    #[test]
    fn a_save_begun_before_deletion_never_overwrites_the_timeline_created_again() {
        let (_sim, fs, timelines) = node();
        let g = greeting(1);
        let vote = |tl: &Timeline, term: u64| {
            tl.process_msg(&ProposerAcceptorMessage::VoteRequest(VoteRequest {
                generation: Generation(0),
                term: Term(term),
            }))
            .unwrap();
        };
        let old = timelines.get_or_create(&g, true).unwrap();
        old.process_msg(&ProposerAcceptorMessage::Greeting(g.clone()))
            .unwrap();
        vote(&old, 5);
        old.set_backup_lsn(sk_core::types::Lsn(16 << 20));
        let save = old.begin_save(true).expect("a lazy value to save");

        assert!(
            timelines
                .delete_timeline(&g.ttid(), crate::manager::DeleteScope::OnlyLocal)
                .unwrap()
        );
        // The operator creates it again (a proposer may not: the tombstone).
        let new = timelines
            .create_explicit(&CreateTimeline {
                ttid: g.ttid(),
                server: ServerInfo {
                    pg_version: g.pg_version,
                    system_id: g.system_id,
                    wal_seg_size: g.wal_seg_size,
                },
                start_lsn: sk_core::types::Lsn(16 << 20),
                mconf: Configuration::default(),
            })
            .unwrap();
        new.process_msg(&ProposerAcceptorMessage::Greeting(g.clone()))
            .unwrap();
        vote(&new, 2);
        assert_eq!(new.positions().term, Term(2));

        let e = save
            .write()
            .expect_err("a deleted timeline's save was written");
        assert!(e.to_string().contains("deleted"), "{e}");
        drop((old, new, timelines));
        let again = GlobalTimelines::load_in(fs, Path::new(DATADIR), NodeId(1), false).unwrap();
        assert_eq!(again.get(&g.ttid()).unwrap().positions().term, Term(2));
    }

    /// A created timeline is durable where the next start looks for it, even after a power
    /// loss that forgets everything un-synced; leftovers of an interrupted creation are removed.
    #[test]
    fn a_created_timeline_is_loaded_again_after_power_loss() {
        let (sim, fs, timelines) = node();
        let g = greeting(7);
        timelines.get_or_create(&g, true).unwrap();
        fs.create_dir_all(&Path::new(DATADIR).join(TMP_DIR).join("half-built"))
            .unwrap();
        drop(timelines);
        sim.power_loss(&mut |_| 0);
        let reloaded =
            GlobalTimelines::load_in(fs.clone(), Path::new(DATADIR), NodeId(1), false).unwrap();
        let tl = reloaded.get(&g.ttid()).expect("the timeline survives");
        assert_eq!(tl.system_id(), 42);
        assert!(!fs.exists(&Path::new(DATADIR).join(TMP_DIR)));
    }

    /// A deletion cut by a power loss before any of its operations: afterwards the timeline is
    /// either whole and served, or gone and tombstoned (a late greeting refused), never gone
    /// without its tombstone (which a late proposer would recreate).
    #[test]
    fn a_deletion_cut_at_any_point_leaves_the_timeline_whole_or_tombstoned() {
        let g = greeting(3);
        let mut saw = (false, false);
        for ops in 0.. {
            let (sim, fs, timelines) = node();
            timelines.get_or_create(&g, true).unwrap();
            sim.arm_crash_after(ops);
            timelines
                .delete_timeline(&g.ttid(), DeleteScope::Everywhere)
                .unwrap();
            let cut = sim.crash_point_reached();
            drop(timelines);
            sim.power_loss(&mut |_| 0);
            let reloaded =
                GlobalTimelines::load_in(fs.clone(), Path::new(DATADIR), NodeId(1), false).unwrap();
            let present = reloaded.get(&g.ttid()).is_some();
            let tombstoned = reloaded.is_tombstoned(&g.ttid());
            assert!(
                present != tombstoned,
                "cut before op {ops}: present {present}, tombstoned {tombstoned}"
            );
            if !present {
                assert!(matches!(
                    reloaded.get_or_create(&g, true),
                    Err(TimelineError::Deleted(_))
                ));
                let dir = Path::new(DATADIR)
                    .join(g.ttid().tenant_id.to_string())
                    .join(g.ttid().timeline_id.to_string());
                assert!(!fs.exists(&dir), "cut before op {ops}: files left");
            }
            if present {
                saw.0 = true;
            } else {
                saw.1 = true;
            }
            if !cut {
                assert!(!present, "a finished deletion is durable");
                break;
            }
        }
        assert!(saw.0 && saw.1, "both outcomes were reached: {saw:?}");
    }

    /// Issue 26, defect 9: a timeline created between two rounds of the disk measurement is
    /// held to the limits from its first append (it used to be unlimited until the next
    /// round, up to a second of unpaced ingest).
    #[test]
    fn a_new_timeline_is_held_to_the_disk_limits_from_its_first_append() {
        use crate::test_util::{append_msg, elect, greeting, run};
        use pg_wal::generator::WalGenerator;
        use sk_core::types::Lsn;

        const SEG: u64 = 1 << 20;
        let dir = tempfile::tempdir().unwrap();
        let timelines =
            GlobalTimelines::load_in(Fs::real(), dir.path(), NodeId(1), true).expect("loads");
        // Below what a timeline's control file alone takes on disk.
        timelines.set_disk_limits(crate::disk_usage::DiskLimits {
            max_timeline_bytes: 512,
            max_fs_ratio: 0.0,
            datadir: dir.path().to_path_buf(),
        });
        let g = greeting(4, SEG);
        let tl = timelines.get_or_create(&g, true).unwrap();
        run(&tl, ProposerAcceptorMessage::Greeting(g.clone()));
        let start = Lsn(SEG);
        elect(&tl, 1, &[(1, start)]);
        let mut wal = Vec::new();
        WalGenerator::new(42, SEG, start)
            .unwrap()
            .fill(&mut wal, 8192, &[1; 100]);
        let err = crate::blocking::section(|| tl.process_msg(&append_msg(1, start, &wal, start)))
            .expect_err("refused at once");
        assert!(
            err.to_string().contains("--max-timeline-disk-usage"),
            "{err}"
        );
        assert_eq!(tl.positions().flush_lsn, start);

        // Under a limit it is far from, a timeline measured before it had WAL takes its WAL:
        // its bytes count from its first append, not from LSN 0 (which once refused it as
        // using its whole start LSN).
        timelines.set_disk_limits(crate::disk_usage::DiskLimits {
            max_timeline_bytes: 4 << 20,
            max_fs_ratio: 0.0,
            datadir: dir.path().to_path_buf(),
        });
        let g = greeting(5, SEG);
        let tl = timelines.get_or_create(&g, true).unwrap();
        run(&tl, ProposerAcceptorMessage::Greeting(g.clone()));
        let start = Lsn(64 * SEG);
        elect(&tl, 1, &[(1, start)]);
        let mut wal = Vec::new();
        let mut wal_gen = WalGenerator::new(42, SEG, start).unwrap();
        wal_gen.fill(&mut wal, 256 << 10, &[1; 100]);
        crate::test_util::append(&tl, 1, start, &wal, start, true);
        assert_eq!(tl.positions().flush_lsn, wal_gen.lsn());
    }

    /// Item 2 of issue 13: a process crash (kill -9, the abort after a failed fsync) keeps the
    /// page cache, so the restarted node decodes WAL that was never fsynced. It must make that
    /// WAL durable before anything reveals it: here a vote reveals the recovered flush LSN, then
    /// the power fails, and the flush LSN after the next start must not be below it.
    #[test]
    fn wal_revealed_after_a_crash_survives_a_later_power_loss() {
        use crate::test_util::{append, elect, greeting, load, run, sim_node, vote};
        use pg_wal::generator::WalGenerator;
        use sk_core::types::Lsn;

        const SEG: u64 = 1 << 20;
        let (sim, fs, timelines) = sim_node();
        let g = greeting(3, SEG);
        let tl = timelines.get_or_create(&g, true).unwrap();
        run(&tl, ProposerAcceptorMessage::Greeting(g.clone()));
        let start = Lsn(SEG);
        elect(&tl, 1, &[(1, start)]);
        let mut wal = WalGenerator::new(42, SEG, start).unwrap();
        // Durable and committed (persisted), so recovery starts here...
        let mut durable = Vec::new();
        wal.fill(&mut durable, 50_000, &[1; 200]);
        let committed = wal.lsn();
        append(&tl, 1, start, &durable, committed, true);
        assert!(tl.maybe_persist(true).unwrap());
        // ...and written but never fsynced (within the segment: completing one syncs it).
        let mut cached = Vec::new();
        wal.fill(&mut cached, 500_000, &[2; 3000]);
        append(&tl, 1, committed, &cached, Lsn::INVALID, false);
        assert_eq!(tl.positions().flush_lsn, committed);
        drop((tl, timelines));
        sim.process_crash();

        let timelines = load(&fs);
        let tl = timelines.get(&g.ttid()).expect("the timeline loads");
        let revealed = vote(&tl, 2).flush_lsn;
        assert_eq!(revealed, wal.lsn(), "recovery decodes the page cache");
        drop((tl, timelines));
        sim.power_loss(&mut |_| 0);

        let timelines = load(&fs);
        let tl = timelines.get(&g.ttid()).expect("the timeline loads");
        let flush = tl.positions().flush_lsn;
        assert!(
            flush >= revealed,
            "a vote revealed flush LSN {revealed}, but after a power loss WAL ends at {flush}"
        );
    }
}
