//! Timelines as the tokio layer sees them: a [`SafeKeeper`] over file storage behind a lock, a
//! watch channel that publishes its positions (walsenders wait on it), and the registry of all
//! timelines of the node ([`GlobalTimelines`]), which loads them at start-up and creates new ones
//! on a proposer's greeting.
//!
//! Layout on disk: `<datadir>/<tenant_id>/<timeline_id>/` holds `safekeeper.control` and the WAL
//! segments. A new timeline is built under `<datadir>/tmp/` and renamed into place durably, so a
//! crash never leaves a half-created timeline behind.
//!
//! Locking: the acceptor lock is a `std::sync::Mutex` held only for one synchronous
//! `process_msg` (which may write and fsync) or a status read; callers on the async executor take
//! it from blocking threads (the WAL acceptor) or for short reads only.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntGaugeVec, Opts};
use serde::Serialize;
use tokio::sync::watch;

use crate::control_file::{CONTROL_FILE_NAME, FileControlStore};
use crate::wal_store::{WalFileOptions, WalFileStore, WalReader, verify_committed_wal};
use pg_wal::format::is_valid_seg_size;
use sk_core::protocol::{AcceptorProposerMessage, ProposerAcceptorMessage, ProposerGreeting};
use sk_core::safekeeper::{SafeKeeper, SafeKeeperError};
use sk_core::state::{Configuration, ServerInfo, TimelinePersistentState};
use sk_core::storage;
use sk_core::storage::durable::fsync_dir;
use sk_core::storage::fs::Fs;
use sk_core::types::{Lsn, NodeId, TenantId, TenantTimelineId, Term, TermHistory, TimelineId};

/// Segments are prepared (zero-filled off the ingest path) for timelines whose WAL arrives
/// slower than this: there commits wait on each `fdatasync`, which is ~25% faster into written
/// blocks than into a sparse file's (wal-bench `durable_commit`); faster streams batch their
/// `fdatasync`s, and a second write of every segment would cost them a third of their
/// bandwidth (`wal_acceptor_throughput`).
pub const PREPARE_SEGMENTS_BELOW_RATE: u64 = 256 << 20;

/// The acceptor of one timeline over real files.
pub type Acceptor = SafeKeeper<FileControlStore, WalFileStore>;

/// How often the timeline manager looks for in-memory state to persist.
const MANAGER_TICK: Duration = Duration::from_millis(300);
/// In-memory LSNs older than this are persisted even if they moved little.
const CONTROL_FILE_SAVE_INTERVAL: Duration = Duration::from_secs(5);

/// Positions of a timeline, published on every change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Positions {
    pub term: Term,
    pub last_log_term: Term,
    /// Durable end of WAL (record boundary).
    pub flush_lsn: Lsn,
    /// Committed WAL available here. Invariant: `commit_lsn <= flush_lsn`.
    pub commit_lsn: Lsn,
}

/// What `GET /v1/tenant/{t}/timeline/{tl}` shows.
#[derive(Clone, Debug, Serialize)]
pub struct TimelineStatus {
    pub tenant_id: TenantId,
    pub timeline_id: TimelineId,
    pub term: Term,
    pub last_log_term: Term,
    pub term_history: TermHistory,
    pub flush_lsn: Lsn,
    pub write_lsn: Lsn,
    pub commit_lsn: Lsn,
    pub persisted_commit_lsn: Lsn,
    pub timeline_start_lsn: Lsn,
    pub local_start_lsn: Lsn,
    pub peer_horizon_lsn: Lsn,
    pub system_id: u64,
    pub pg_version: u32,
    pub wal_seg_size: u32,
    pub generation: u32,
    pub proposers: usize,
    pub readers: usize,
}

/// One timeline of this node.
pub struct Timeline {
    pub ttid: TenantTimelineId,
    pub dir: PathBuf,
    /// Invariant: a valid segment size; fixed for the life of the timeline.
    pub seg_size: u64,
    acceptor: Mutex<Acceptor>,
    reader: WalReader,
    positions: watch::Sender<Positions>,
    proposers: AtomicUsize,
    readers: AtomicUsize,
    last_persist: Mutex<Instant>,
}

impl Timeline {
    /// Opens an existing timeline directory: loads and verifies the control file, recovers the
    /// end of WAL from its `commit_lsn` (refusing a WAL that ends below it).
    pub fn open(dir: &Path, node_id: NodeId, no_sync: bool) -> anyhow::Result<Timeline> {
        let control = FileControlStore::load(dir, no_sync)?;
        let seg_size = control.server.wal_seg_size as u64;
        let wal = WalFileStore::open(
            dir,
            seg_size,
            control.commit_lsn,
            WalFileOptions {
                no_sync,
                system_id: control.server.system_id,
                wal_start_lsn: control.local_start_lsn,
                zero_fill: false,
                prepare_below_rate: PREPARE_SEGMENTS_BELOW_RATE,
                fs: Fs::default(),
                background: Default::default(),
            },
        )?;
        let ttid = TenantTimelineId {
            tenant_id: control.tenant_id,
            timeline_id: control.timeline_id,
        };
        verify_committed_wal(
            &Fs::default(),
            dir,
            seg_size,
            control.local_start_lsn,
            control.commit_lsn,
        )?;
        let acceptor = SafeKeeper::new(node_id, control, wal)
            .with_context(|| format!("starting timeline {ttid} in {}", dir.display()))?;
        let positions = positions_of(&acceptor);
        Ok(Timeline {
            ttid,
            dir: dir.to_path_buf(),
            seg_size,
            reader: WalReader::new(dir, seg_size),
            acceptor: Mutex::new(acceptor),
            positions: watch::Sender::new(positions),
            proposers: AtomicUsize::new(0),
            readers: AtomicUsize::new(0),
            last_persist: Mutex::new(Instant::now()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Acceptor> {
        self.acceptor.lock().expect("acceptor lock poisoned")
    }

    /// Runs one message through the acceptor and publishes the new positions. Blocking: it may
    /// write and fsync. Call it from a blocking thread.
    pub fn process_msg(
        &self,
        msg: &ProposerAcceptorMessage,
    ) -> Result<Option<AcceptorProposerMessage>, SafeKeeperError> {
        let mut acceptor = self.lock();
        let result = acceptor.process_msg(msg);
        let now = positions_of(&acceptor);
        drop(acceptor);
        self.positions.send_if_modified(|p| {
            let changed = *p != now;
            *p = now;
            changed
        });
        result
    }

    /// The latest positions.
    pub fn positions(&self) -> Positions {
        *self.positions.borrow()
    }

    /// A receiver that wakes on every change of the positions.
    pub fn subscribe(&self) -> watch::Receiver<Positions> {
        self.positions.subscribe()
    }

    /// Appends WAL bytes `[from, to)` to `out`. Blocking (file reads).
    pub fn read_wal(&self, from: Lsn, to: Lsn, out: &mut Vec<u8>) -> storage::Result<()> {
        self.reader.read(from, to, out)
    }

    pub fn system_id(&self) -> u64 {
        self.lock().state().server.system_id
    }

    /// The oldest LSN a reader can start at: the start of the segment holding the first WAL
    /// this node has (earlier segments never existed here).
    pub fn oldest_available_lsn(&self) -> Lsn {
        let a = self.lock();
        let start = a.state().local_start_lsn.max(a.state().timeline_start_lsn);
        start.segment_start(self.seg_size)
    }

    pub fn status(&self) -> TimelineStatus {
        let a = self.lock();
        let s = a.state();
        TimelineStatus {
            tenant_id: s.tenant_id,
            timeline_id: s.timeline_id,
            term: a.term(),
            last_log_term: a.last_log_term(),
            term_history: a.get_term_history(),
            flush_lsn: a.flush_lsn(),
            write_lsn: a.write_lsn(),
            commit_lsn: a.commit_lsn(),
            persisted_commit_lsn: a.persisted_commit_lsn(),
            timeline_start_lsn: s.timeline_start_lsn,
            local_start_lsn: s.local_start_lsn,
            peer_horizon_lsn: a.inmem().peer_horizon_lsn,
            system_id: s.server.system_id,
            pg_version: s.server.pg_version,
            wal_seg_size: s.server.wal_seg_size,
            generation: s.mconf.generation.0,
            proposers: self.proposers.load(Ordering::Relaxed),
            readers: self.readers.load(Ordering::Relaxed),
        }
    }

    /// Persists in-memory LSNs if they are due (or always with `force`). Blocking.
    pub fn maybe_persist(&self, force: bool) -> Result<bool, SafeKeeperError> {
        let mut last = self.last_persist.lock().expect("persist lock poisoned");
        let due = force || last.elapsed() >= CONTROL_FILE_SAVE_INTERVAL;
        let wrote = self.lock().maybe_persist_inmem(due)?;
        if wrote || due {
            *last = Instant::now();
        }
        Ok(wrote)
    }

    /// Counts a connected proposer until the guard drops.
    pub fn proposer_guard(self: &Arc<Self>) -> ConnectionGuard {
        ConnectionGuard::new(self.clone(), Role::Proposer)
    }

    /// Counts a connected reader until the guard drops.
    pub fn reader_guard(self: &Arc<Self>) -> ConnectionGuard {
        ConnectionGuard::new(self.clone(), Role::Reader)
    }
}

fn positions_of(a: &Acceptor) -> Positions {
    Positions {
        term: a.term(),
        last_log_term: a.last_log_term(),
        flush_lsn: a.flush_lsn(),
        commit_lsn: a.commit_lsn().min(a.flush_lsn()),
    }
}

#[derive(Clone, Copy)]
enum Role {
    Proposer,
    Reader,
}

/// Keeps a timeline's and the node's connection counts right, also when a task is cancelled.
pub struct ConnectionGuard {
    tl: Arc<Timeline>,
    role: Role,
}

impl ConnectionGuard {
    fn new(tl: Arc<Timeline>, role: Role) -> ConnectionGuard {
        match role {
            Role::Proposer => {
                tl.proposers.fetch_add(1, Ordering::Relaxed);
                crate::metrics::WAL_RECEIVERS.inc();
            }
            Role::Reader => {
                tl.readers.fetch_add(1, Ordering::Relaxed);
                crate::metrics::WAL_READERS.inc();
            }
        }
        ConnectionGuard { tl, role }
    }
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        match self.role {
            Role::Proposer => {
                self.tl.proposers.fetch_sub(1, Ordering::Relaxed);
                crate::metrics::WAL_RECEIVERS.dec();
            }
            Role::Reader => {
                self.tl.readers.fetch_sub(1, Ordering::Relaxed);
                crate::metrics::WAL_READERS.dec();
            }
        }
    }
}

/// Why a timeline could not be found or created.
#[derive(Debug, thiserror::Error)]
pub enum TimelineError {
    #[error("timeline {0} does not exist (and the proposer did not allow creating it)")]
    NotFound(TenantTimelineId),
    #[error("invalid WAL segment size {0}: must be a power of two from 1 MiB to 1 GiB")]
    BadSegmentSize(u32),
    #[error("creating timeline {ttid}: {source:#}")]
    Create {
        ttid: TenantTimelineId,
        source: anyhow::Error,
    },
}

/// All timelines of this node.
pub struct GlobalTimelines {
    datadir: PathBuf,
    node_id: NodeId,
    no_sync: bool,
    map: Mutex<HashMap<TenantTimelineId, Arc<Timeline>>>,
    /// Serializes creations (a blocking section: directory creation and fsyncs).
    create_lock: Mutex<()>,
}

impl GlobalTimelines {
    /// Loads every timeline under `datadir`. Any timeline that fails verification (a corrupt
    /// control file, WAL ending below its commit LSN) stops start-up: serving on would risk
    /// acknowledged data.
    pub fn load(datadir: &Path, node_id: NodeId, no_sync: bool) -> anyhow::Result<GlobalTimelines> {
        let tmp = datadir.join("tmp");
        if tmp.exists() {
            // Half-built timelines from a crash during creation: never acknowledged anything.
            std::fs::remove_dir_all(&tmp).with_context(|| format!("removing {}", tmp.display()))?;
        }
        let mut map = HashMap::new();
        for tenant in read_dir_sorted(datadir)? {
            let Some(name) = tenant.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !tenant.is_dir() || name.parse::<TenantId>().is_err() {
                continue;
            }
            for dir in read_dir_sorted(&tenant)? {
                if !dir.join(CONTROL_FILE_NAME).exists() {
                    continue;
                }
                let tl = Timeline::open(&dir, node_id, no_sync)
                    .with_context(|| format!("loading timeline in {}", dir.display()))?;
                tracing::info!(ttid = %tl.ttid, positions = ?tl.positions(), "timeline loaded");
                map.insert(tl.ttid, Arc::new(tl));
            }
        }
        Ok(GlobalTimelines {
            datadir: datadir.to_path_buf(),
            node_id,
            no_sync,
            map: Mutex::new(map),
            create_lock: Mutex::new(()),
        })
    }

    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    pub fn get(&self, ttid: &TenantTimelineId) -> Option<Arc<Timeline>> {
        self.map.lock().expect("timelines lock").get(ttid).cloned()
    }

    /// Every timeline, ordered by id.
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
            return Ok(tl);
        }
        if !allow_creation {
            return Err(TimelineError::NotFound(ttid));
        }
        if !is_valid_seg_size(greeting.wal_seg_size as u64) {
            return Err(TimelineError::BadSegmentSize(greeting.wal_seg_size));
        }
        let _creating = self.create_lock.lock().expect("create lock");
        if let Some(tl) = self.get(&ttid) {
            return Ok(tl);
        }
        let tl = self
            .create(greeting)
            .map_err(|source| TimelineError::Create { ttid, source })?;
        let tl = Arc::new(tl);
        self.map
            .lock()
            .expect("timelines lock")
            .insert(ttid, tl.clone());
        tracing::info!(%ttid, seg_size = greeting.wal_seg_size, "timeline created");
        Ok(tl)
    }

    fn create(&self, g: &ProposerGreeting) -> anyhow::Result<Timeline> {
        let ttid = g.ttid();
        let tmp_root = self.datadir.join("tmp");
        let tmp = tmp_root.join(format!("{}_{}", ttid.tenant_id, ttid.timeline_id));
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp)?;
        }
        std::fs::create_dir_all(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
        let created = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        // Membership starts empty (generation 0); the greeting itself is processed next and
        // adopts the proposer's configuration through the usual checks.
        let state = TimelinePersistentState::new(
            ttid.tenant_id,
            ttid.timeline_id,
            Configuration::default(),
            ServerInfo {
                pg_version: g.pg_version,
                system_id: g.system_id,
                wal_seg_size: g.wal_seg_size,
            },
            created,
        );
        FileControlStore::create_new(&tmp, state, self.no_sync)?;
        let tenant_dir = self.datadir.join(ttid.tenant_id.to_string());
        let new_tenant = !tenant_dir.exists();
        std::fs::create_dir_all(&tenant_dir)
            .with_context(|| format!("creating {}", tenant_dir.display()))?;
        let dir = tenant_dir.join(ttid.timeline_id.to_string());
        if !self.no_sync {
            fsync_dir(&Fs::real(), &tmp);
        }
        std::fs::rename(&tmp, &dir)
            .with_context(|| format!("renaming {} to {}", tmp.display(), dir.display()))?;
        // The timeline directory is durable in its tenant directory before anyone uses it.
        if !self.no_sync {
            fsync_dir(&Fs::real(), &tenant_dir);
            if new_tenant {
                fsync_dir(&Fs::real(), &self.datadir);
            }
        }
        Timeline::open(&dir, self.node_id, self.no_sync)
    }

    /// Persists every timeline's in-memory state (shutdown). Blocking.
    pub fn persist_all(&self) {
        for tl in self.all() {
            if let Err(e) = tl.maybe_persist(true) {
                tracing::error!(ttid = %tl.ttid, "persisting control file: {e}");
            }
        }
    }

    /// The timeline manager: persists in-memory LSNs off the ingest path, every 300 ms when due.
    /// Runs until `shutdown` is cancelled. Cancellation-safe.
    pub async fn run_manager(self: Arc<Self>, shutdown: tokio_util::sync::CancellationToken) {
        let mut tick = tokio::time::interval(MANAGER_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                _ = shutdown.cancelled() => return,
            }
            let me = self.clone();
            let res = tokio::task::spawn_blocking(move || {
                for tl in me.all() {
                    if let Err(e) = tl.maybe_persist(false) {
                        tracing::error!(ttid = %tl.ttid, "persisting control file: {e}");
                    }
                }
            })
            .await;
            if let Err(e) = res {
                tracing::error!("timeline manager task failed: {e}");
            }
        }
    }
}

fn read_dir_sorted(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut v = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        v.push(entry?.path());
    }
    v.sort();
    Ok(v)
}

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
];

impl TimelineCollector {
    pub fn register(timelines: &Arc<GlobalTimelines>) {
        let descs = TIMELINE_GAUGES
            .iter()
            .map(|(name, help)| {
                Desc::new(
                    name.to_string(),
                    help.to_string(),
                    vec!["tenant_id".into(), "timeline_id".into()],
                    Default::default(),
                )
                .expect("valid metric")
            })
            .collect();
        let c = TimelineCollector {
            timelines: Arc::downgrade(timelines),
            descs,
        };
        // A second daemon in one process (tests) finds it registered already: keep the first.
        let _ = prometheus::register(Box::new(c));
    }
}

impl Collector for TimelineCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let Some(timelines) = self.timelines.upgrade() else {
            return Vec::new();
        };
        let vecs: Vec<IntGaugeVec> = TIMELINE_GAUGES
            .iter()
            .map(|(name, help)| {
                IntGaugeVec::new(Opts::new(*name, *help), &["tenant_id", "timeline_id"])
                    .expect("valid metric")
            })
            .collect();
        for tl in timelines.all() {
            let s = tl.status();
            let t = tl.ttid.tenant_id.to_string();
            let l = tl.ttid.timeline_id.to_string();
            let labels = [t.as_str(), l.as_str()];
            let values = [
                s.flush_lsn.0 as i64,
                s.commit_lsn.0 as i64,
                s.term.0 as i64,
                s.proposers as i64,
                s.readers as i64,
            ];
            for (v, value) in vecs.iter().zip(values) {
                v.with_label_values(&labels).set(value);
            }
        }
        vecs.iter().flat_map(|v| v.collect()).collect()
    }
}
