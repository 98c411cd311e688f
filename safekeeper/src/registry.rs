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
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use pg_wal::format::is_valid_seg_size;
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{IntGaugeVec, Opts};
use sk_core::protocol::ProposerGreeting;
use sk_core::state::{Configuration, ServerInfo, TimelinePersistentState};
use sk_core::storage::durable::fsync_dir;
use sk_core::storage::fs::Fs;
use sk_core::types::{NodeId, TenantId, TenantTimelineId};

use crate::control_file::{CONTROL_FILE_NAME, FileControlStore};
use crate::timeline::{Timeline, TimelineError};

/// How often the timeline manager looks for in-memory state to persist.
const MANAGER_TICK: Duration = Duration::from_millis(300);
/// Where new timelines are built before they are renamed into place.
const TMP_DIR: &str = "tmp";

/// All timelines of this node.
pub struct GlobalTimelines {
    fs: Fs,
    datadir: PathBuf,
    node_id: NodeId,
    no_sync: bool,
    map: Mutex<HashMap<TenantTimelineId, Arc<Timeline>>>,
    /// Serializes creations (a blocking section: directory creation and fsyncs).
    create_lock: Mutex<()>,
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

    /// Loads every timeline under `datadir` on `fs`. Any timeline that fails verification (a
    /// corrupt control file, WAL ending below its commit LSN) stops start-up: serving on would
    /// risk acknowledged data.
    pub fn load_in(
        fs: Fs,
        datadir: &Path,
        node_id: NodeId,
        no_sync: bool,
    ) -> Result<GlobalTimelines, TimelineError> {
        let tmp = datadir.join(TMP_DIR);
        if fs.exists(&tmp) {
            // Half-built timelines from a crash during creation: never acknowledged anything.
            fs.remove_dir_all(&tmp)
                .map_err(|e| TimelineError::io(format!("removing {}", tmp.display()), e))?;
        }
        let mut map = HashMap::new();
        for tenant in list_dir_sorted(&fs, datadir)? {
            let Some(name) = tenant.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if !fs.is_dir(&tenant) || name.parse::<TenantId>().is_err() {
                continue;
            }
            for dir in list_dir_sorted(&fs, &tenant)? {
                if !fs.exists(&dir.join(CONTROL_FILE_NAME)) {
                    continue;
                }
                let timeline_name = dir.file_name().and_then(|n| n.to_str()).unwrap_or("");
                let _span = tracing::info_span!(
                    "timeline",
                    tenant_id = %name,
                    timeline_id = %timeline_name
                )
                .entered();
                let tl = Timeline::open(&fs, &dir, node_id, no_sync)?;
                tracing::info!(positions = ?tl.positions(), "timeline loaded");
                map.insert(tl.ttid, Arc::new(tl));
            }
        }
        Ok(GlobalTimelines {
            fs,
            datadir: datadir.to_path_buf(),
            node_id,
            no_sync,
            map: Mutex::new(map),
            create_lock: Mutex::new(()),
        })
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// The timeline `ttid`, if this node has it.
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
        let tl = Arc::new(self.create(greeting)?);
        self.map
            .lock()
            .expect("timelines lock")
            .insert(ttid, tl.clone());
        tracing::info!(seg_size = greeting.wal_seg_size, "timeline created");
        Ok(tl)
    }

    /// Builds the directory of a new timeline under `tmp/`, makes its control file and its
    /// entries durable, renames it into its tenant directory durably, and opens it.
    fn create(&self, g: &ProposerGreeting) -> Result<Timeline, TimelineError> {
        let fs = &self.fs;
        let io = |what: &str, path: &Path| {
            let context = format!("{what} {}", path.display());
            move |e| TimelineError::io(context, e)
        };
        let ttid = g.ttid();
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
        FileControlStore::create_new_in(fs.clone(), &tmp, state, self.no_sync)?;
        let tenant_dir = self.datadir.join(ttid.tenant_id.to_string());
        let new_tenant = !fs.exists(&tenant_dir);
        fs.create_dir_all(&tenant_dir)
            .map_err(io("creating", &tenant_dir))?;
        let dir = tenant_dir.join(ttid.timeline_id.to_string());
        if !self.no_sync {
            fsync_dir(fs, &tmp);
        }
        fs.rename(&tmp, &dir).map_err(|e| {
            TimelineError::io(
                format!("renaming {} to {}", tmp.display(), dir.display()),
                e,
            )
        })?;
        // The timeline directory is durable in its tenant directory before anyone uses it.
        if !self.no_sync {
            fsync_dir(fs, &tenant_dir);
            if new_tenant {
                fsync_dir(fs, &self.datadir);
            }
        }
        Timeline::open(fs, &dir, self.node_id, self.no_sync)
    }

    /// Persists every timeline's in-memory state that is due, or all of it with `force`.
    /// Blocking. Failures are logged: the next round (or shutdown) tries again.
    fn persist(&self, force: bool) {
        for tl in self.all() {
            if let Err(e) = tl.maybe_persist(force) {
                let _span = crate::timeline::span(&tl.ttid).entered();
                tracing::error!("persisting control file: {e}");
            }
        }
    }

    /// Persists every timeline's in-memory state (shutdown). Blocking.
    pub fn persist_all(&self) {
        self.persist(true);
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
            if let Err(e) = tokio::task::spawn_blocking(move || me.persist(false)).await {
                tracing::error!("timeline manager task failed: {e}");
            }
        }
    }
}

/// The entries of directory `dir`, as paths, in name order.
fn list_dir_sorted(fs: &Fs, dir: &Path) -> Result<Vec<PathBuf>, TimelineError> {
    let mut names = fs
        .list_dir(dir)
        .map_err(|e| TimelineError::io(format!("reading {}", dir.display()), e))?;
    names.sort();
    Ok(names.into_iter().map(|n| dir.join(n)).collect())
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
    /// Registers the gauges of `timelines` in the default registry (once per process: a second
    /// daemon in one process, as tests start, keeps the first one's).
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
    fn invalid_segment_size_is_refused_before_touching_the_disk() {
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
