//! One timeline as the tokio layer sees it: a [`SafeKeeper`] over file storage behind a lock, a
//! watch channel that publishes its positions (walsenders wait on it), connection counts, and
//! [`TimelineError`], the typed error of opening, finding and creating timelines.
//!
//! Locking, the one order: **the acceptor lock, then at most one leaf lock**
//! ([`crate::blocking`], checked in debug builds). The acceptor lock is a `std::sync::Mutex`
//! held for one synchronous `process_msg`, which may write and fsync: it is taken only in
//! blocking sections, never on an async worker. After every acceptor operation the timeline
//! publishes, under the acceptor lock, a view of what async code reads (positions, write
//! LSN, in-memory and persisted state) behind a leaf lock: [`Timeline::status`] and the other
//! accessors read the view and never wait for an fsync. The readers' holds, the disk-limit
//! flag and the recovery status are leaf locks too; removal takes only the holds' lock
//! ([`crate::remove_wal`]), never the acceptor's.
//!
//! Not here: the node's set of timelines, their loading and creation ([`crate::registry`]).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use pg_wal::PgMajor;
use serde::Serialize;
use sk_core::protocol::{AcceptorProposerMessage, ProposerAcceptorMessage};
use sk_core::safekeeper::{InMemoryState, SafeKeeper, SafeKeeperError};
use sk_core::state::{Configuration, TimelinePersistentState};
use sk_core::storage;
use sk_core::storage::fs::Fs;
use sk_core::types::{Lsn, NodeId, TenantId, TenantTimelineId, Term, TermHistory, TimelineId};
use tokio::sync::{Notify, watch};
use tokio_util::sync::CancellationToken;

use crate::blocking::LeafMutex;
use crate::control_file::{FileControlStore, PendingSave, WrittenSave};
use crate::feedback::{ReaderHandle, ReaderInfo, ReaderStatus, Readers};
use crate::manager::Lsns;
use crate::manager::recovery::{LocalView, RecoveryStatus};
use crate::remote_storage::RemoteStorage;
use crate::remove_wal::{ReadHold, ReadHolds};
use crate::wal_store::{
    OpenFiles, SegmentPool, WalFileOptions, WalFileStore, WalReader, verify_committed_wal,
};

/// Segments are prepared (zero-filled off the ingest path) for timelines whose WAL arrives
/// slower than this: there commits wait on each `fdatasync`, which is ~25% faster into written
/// blocks than into a sparse file's (wal-bench `durable_commit`); faster streams batch their
/// `fdatasync`s, and a second write of every segment would cost them a third of their
/// bandwidth (`wal_acceptor_throughput`).
pub const PREPARE_SEGMENTS_BELOW_RATE: u64 = 256 << 20;

/// The acceptor of one timeline over real files.
pub type Acceptor = SafeKeeper<FileControlStore, WalFileStore>;

/// In-memory LSNs older than this are persisted even if they moved little.
const CONTROL_FILE_SAVE_INTERVAL: Duration = Duration::from_secs(5);

/// Positions of a timeline, published on every change.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Positions {
    /// The acceptor's term.
    pub term: Term,
    /// The term of the newest WAL held.
    pub last_log_term: Term,
    /// Durable end of WAL (record boundary).
    pub flush_lsn: Lsn,
    /// Committed WAL available here. Invariant: `commit_lsn <= flush_lsn`.
    pub commit_lsn: Lsn,
}

/// The outcome of [`Timeline::read_wal_in_term`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TermRead {
    /// The bytes were read while the term held and the range was durable WAL.
    Read,
    /// The acceptor's term is now this one: nothing was read.
    TermChanged(Term),
    /// The term of the newest WAL is now this one (a proposer was elected in the same
    /// acceptor term and rewrote the history): nothing was read.
    LogTermChanged(Term),
    /// The durable WAL now ends here, below the requested range: nothing was read.
    Truncated(Lsn),
}

/// What `GET /v1/tenant/{t}/timeline/{tl}` shows.
#[derive(Clone, Debug, Serialize)]
pub struct TimelineStatus {
    /// The tenant.
    pub tenant_id: TenantId,
    /// The timeline.
    pub timeline_id: TimelineId,
    /// This node's id.
    pub node_id: NodeId,
    /// The acceptor's term.
    pub term: Term,
    /// The term of the newest WAL held.
    pub last_log_term: Term,
    /// The history of the WAL held.
    pub term_history: TermHistory,
    /// Durable end of WAL (record boundary).
    pub flush_lsn: Lsn,
    /// End of WAL handed to the OS (may be beyond `flush_lsn`).
    pub write_lsn: Lsn,
    /// Commit LSN known in memory.
    pub commit_lsn: Lsn,
    /// Commit LSN in the control file.
    pub persisted_commit_lsn: Lsn,
    /// Where the timeline's WAL begins (globally).
    pub timeline_start_lsn: Lsn,
    /// Where this node's WAL begins.
    pub local_start_lsn: Lsn,
    /// Oldest WAL any peer may still need.
    pub peer_horizon_lsn: Lsn,
    /// PostgreSQL system identifier.
    pub system_id: u64,
    /// PostgreSQL version of the proposer.
    pub pg_version: u32,
    /// WAL segment size in bytes.
    pub wal_seg_size: u32,
    /// Membership configuration generation.
    pub generation: u32,
    /// The membership configuration in force.
    pub mconf: Configuration,
    /// The generation the newest term of `term_history` was elected in.
    pub elected_generation: u32,
    /// Connected proposers.
    pub proposers: usize,
    /// Connected readers.
    pub readers: usize,
    /// What each reader of committed WAL reports back: positions, lags, hot-standby feedback.
    pub reader_feedback: Vec<ReaderStatus>,
    /// The oldest xmin and catalog xmin the readers need (sent to the proposer).
    pub hs_feedback: HsFeedbackStatus,
    /// Complete segments below this are in remote storage.
    pub backup_lsn: Lsn,
    /// Local segments below this LSN were removed (served from remote storage).
    pub removal_horizon_lsn: Lsn,
    /// Where this timeline's segments are backed up (`None` without remote storage).
    pub remote_location: Option<String>,
    /// Peer recovery ([`crate::recovery`]).
    pub recovery: RecoveryStatus,
    /// Evicted ([`crate::evict`]): only the control file is local; the WAL is in remote
    /// storage and ends at `flush_lsn` (= `commit_lsn`). Restored on demand.
    pub evicted: bool,
}

impl TimelineStatus {
    /// The status of evicted timeline `e` of node `node_id`, from its control file, with its
    /// objects at `remote_location`.
    pub fn of_evicted(
        e: &crate::evicted::EvictedTimeline,
        node_id: NodeId,
        remote_location: Option<String>,
    ) -> TimelineStatus {
        let s = &e.state;
        let end = e.end_lsn();
        TimelineStatus {
            tenant_id: s.tenant_id,
            timeline_id: s.timeline_id,
            node_id,
            term: s.acceptor_state.term,
            last_log_term: s.acceptor_state.term_history.up_to(end).last_log_term(),
            term_history: s.acceptor_state.term_history.up_to(end),
            flush_lsn: end,
            write_lsn: end,
            commit_lsn: end,
            persisted_commit_lsn: end,
            timeline_start_lsn: s.timeline_start_lsn,
            local_start_lsn: s.local_start_lsn,
            peer_horizon_lsn: s.peer_horizon_lsn,
            system_id: s.server.system_id,
            pg_version: s.server.pg_version,
            wal_seg_size: s.server.wal_seg_size,
            generation: s.mconf.generation.0,
            mconf: s.mconf.clone(),
            elected_generation: s.acceptor_state.elected_generation.0,
            proposers: 0,
            readers: 0,
            reader_feedback: Vec::new(),
            hs_feedback: HsFeedbackStatus::default(),
            backup_lsn: s.backup_lsn,
            removal_horizon_lsn: end.segment_start(e.seg_size()),
            remote_location,
            recovery: RecoveryStatus::default(),
            evicted: true,
        }
    }
}

/// The readers' oldest xmin and catalog xmin, as full 64-bit transaction ids (0: none).
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct HsFeedbackStatus {
    /// Oldest xmin any reader needs.
    pub xmin: u64,
    /// Oldest catalog xmin any reader needs.
    pub catalog_xmin: u64,
}

impl From<sk_core::protocol::HotStandbyFeedback> for HsFeedbackStatus {
    fn from(f: sk_core::protocol::HotStandbyFeedback) -> Self {
        HsFeedbackStatus {
            xmin: f.xmin,
            catalog_xmin: f.catalog_xmin,
        }
    }
}

/// The span of everything done for timeline `ttid`: every log line inside it carries the
/// timeline's `tenant_id` and `timeline_id` as fields (in JSON logs, under `span`).
pub fn span(ttid: &TenantTimelineId) -> tracing::Span {
    tracing::info_span!(
        "timeline",
        tenant_id = %ttid.tenant_id,
        timeline_id = %ttid.timeline_id
    )
}

/// One timeline of this node.
pub struct Timeline {
    /// Which timeline.
    pub ttid: TenantTimelineId,
    /// Its directory (control file and WAL segments).
    pub dir: PathBuf,
    /// Invariant: a valid segment size; fixed for the life of the timeline.
    pub seg_size: u64,
    acceptor: Mutex<Acceptor>,
    /// What async code reads, published under the acceptor lock ([`Timeline::publish`]).
    view: LeafMutex<View>,
    node_id: NodeId,
    fs: Fs,
    no_sync: bool,
    reader: WalReader,
    positions: watch::Sender<Positions>,
    proposers: AtomicUsize,
    readers: AtomicUsize,
    /// What connected readers report back ([`crate::feedback`]).
    feedback: Arc<Readers>,
    last_persist: LeafMutex<Instant>,
    /// Cancelled when the timeline is deleted: its connections end, its acceptor refuses
    /// every message.
    deleted: CancellationToken,
    /// Readers' holds on local WAL, and what removal took (issue 19).
    holds: Arc<ReadHolds>,
    /// The node's remote storage, set by the backup driver when it first sees the timeline.
    remote: std::sync::OnceLock<Arc<RemoteStorage>>,
    /// The last disk-usage measurement and its limits ([`crate::disk_usage::Gauge`]).
    disk: LeafMutex<crate::disk_usage::Gauge>,
    /// Wakes a peer recovery when a proposer connects (its stream wins).
    proposer_arrived: Notify,
    /// Set while a peer-recovery check or session of this timeline runs (one at a time).
    recovery_busy: Arc<AtomicBool>,
    /// Set (under the acceptor lock) once the timeline is evicted ([`crate::evict`]): this
    /// object then refuses every message and save; a restore opens a new one.
    evicted: AtomicBool,
    /// What the status shows of peer recovery.
    recovery: LeafMutex<RecoveryStatus>,
    /// Test hook: runs in a walsender between its term check and its WAL read.
    #[cfg(test)]
    pub(crate) before_wal_read: Mutex<Option<Box<dyn FnMut() + Send>>>,
}

impl Timeline {
    /// Opens an existing timeline directory on `fs`: loads and verifies the control file,
    /// recovers the end of WAL from its `commit_lsn` (refusing a WAL that ends below it) and
    /// verifies the committed WAL below it. Its segment file joins the node's LRU `open_files`;
    /// its new segments come from the node's `pool` while it has some.
    pub fn open(
        fs: &Fs,
        dir: &Path,
        node_id: NodeId,
        no_sync: bool,
        open_files: &OpenFiles,
        pool: Option<&SegmentPool>,
    ) -> Result<Timeline, TimelineError> {
        let control = FileControlStore::load_in(fs.clone(), dir, no_sync)?;
        Timeline::open_with(fs, dir, control, node_id, no_sync, open_files, pool)
    }

    /// [`Timeline::open`] with its control file already loaded (start-up reads it first to
    /// tell an evicted timeline, which it does not open).
    pub fn open_with(
        fs: &Fs,
        dir: &Path,
        control: FileControlStore,
        node_id: NodeId,
        no_sync: bool,
        open_files: &OpenFiles,
        pool: Option<&SegmentPool>,
    ) -> Result<Timeline, TimelineError> {
        let seg_size = control.server.wal_seg_size as u64;
        // A stored 0 is a timeline made before versions were checked, when all WAL was
        // PostgreSQL 15's.
        let stored = match control.server.pg_version {
            0 => 150000,
            v => v,
        };
        let major = PgMajor::from_server_version(stored).map_err(|e| {
            TimelineError::Storage(storage::Error::Corruption {
                file: dir.display().to_string(),
                reason: format!("the control file's server: {e}"),
            })
        })?;
        let wal = WalFileStore::open(
            dir,
            seg_size,
            control.commit_lsn,
            WalFileOptions {
                no_sync,
                system_id: control.server.system_id,
                major,
                wal_start_lsn: control.local_start_lsn,
                zero_fill: false,
                prepare_below_rate: PREPARE_SEGMENTS_BELOW_RATE,
                fs: fs.clone(),
                // On a simulated disk, preparations and fills run on the simulation's thread
                // (a clock that never moves: no preparation), so every seed replays exactly.
                background: if fs.simulated() {
                    crate::wal_store::Background::new(crate::wal_store::Inline::new())
                } else {
                    Default::default()
                },
                open_files: open_files.clone(),
                pool: pool.cloned(),
            },
        )?;
        let ttid = TenantTimelineId {
            tenant_id: control.tenant_id,
            timeline_id: control.timeline_id,
        };
        // Segments below the first local one were removed after backup: verify from there.
        let first_local = crate::wal_store::first_local_segment(fs, dir, seg_size)?;
        let verify_from = match first_local {
            Some(n) if Lsn(n * seg_size) > control.local_start_lsn => Lsn(n * seg_size),
            _ => control.local_start_lsn,
        };
        verify_committed_wal(fs, dir, seg_size, major, verify_from, control.commit_lsn).map_err(
            |e| match e {
                storage::Error::Corruption { file, reason } => storage::Error::Corruption {
                    file,
                    reason: format!("{reason}: refusing to start"),
                },
                other => other,
            },
        )?;
        let reader = wal.reader();
        let acceptor =
            SafeKeeper::new(node_id, control, wal).map_err(|source| TimelineError::Acceptor {
                ttid,
                dir: dir.display().to_string(),
                source: Box::new(source),
            })?;
        let positions = positions_of(&acceptor);
        let view = View::of(&acceptor);
        Ok(Timeline {
            ttid,
            dir: dir.to_path_buf(),
            seg_size,
            reader,
            acceptor: Mutex::new(acceptor),
            view: LeafMutex::new(view),
            node_id,
            fs: fs.clone(),
            no_sync,
            positions: watch::Sender::new(positions),
            proposers: AtomicUsize::new(0),
            readers: AtomicUsize::new(0),
            feedback: Arc::default(),
            last_persist: LeafMutex::new(Instant::now()),
            deleted: CancellationToken::new(),
            holds: Arc::new(ReadHolds::new(first_local.unwrap_or(0))),
            remote: std::sync::OnceLock::new(),
            disk: LeafMutex::new(Default::default()),
            proposer_arrived: Notify::new(),
            recovery_busy: Arc::new(AtomicBool::new(false)),
            evicted: AtomicBool::new(false),
            recovery: LeafMutex::new(RecoveryStatus::default()),
            #[cfg(test)]
            before_wal_read: Mutex::new(None),
        })
    }

    /// The acceptor lock. Debug builds panic if it is taken on an async worker or under a
    /// leaf lock ([`crate::blocking::assert_may_block`]).
    #[track_caller]
    fn lock(&self) -> MutexGuard<'_, Acceptor> {
        crate::blocking::assert_may_block("the acceptor lock");
        self.acceptor.lock().expect("acceptor lock poisoned")
    }

    /// Publishes what async code reads of `a` (under the acceptor lock, so views are published
    /// in the order of the operations).
    fn publish(&self, a: &Acceptor) {
        let now = positions_of(a);
        {
            let mut v = self.view.lock();
            v.write_lsn = a.write_lsn();
            v.inmem = a.inmem();
            if !std::ptr::eq(&*v.state, a.state()) {
                v.state = a.control().shared();
            }
        }
        self.positions.send_if_modified(|p| {
            let changed = *p != now;
            *p = now;
            changed
        });
    }

    /// A copy of the published view.
    fn view(&self) -> View {
        self.view.lock().clone()
    }

    /// Runs one message through the acceptor and publishes the new positions. Blocking: it may
    /// write and fsync. Call it from a blocking thread.
    pub fn process_msg(
        &self,
        msg: &ProposerAcceptorMessage,
    ) -> Result<Option<AcceptorProposerMessage>, SafeKeeperError> {
        self.process(msg, false)
    }

    /// [`Timeline::process_msg`] for a message of a peer recovery: refused, under the acceptor
    /// lock, once a proposer is connected. The proposer's count is raised before its first
    /// message is queued, so no recovery message is applied after any message of a proposer
    /// (its stream wins; recovery's queued messages are refused, never interleaved).
    pub fn process_recovery_msg(
        &self,
        msg: &ProposerAcceptorMessage,
    ) -> Result<Option<AcceptorProposerMessage>, SafeKeeperError> {
        self.process(msg, true)
    }

    fn process(
        &self,
        msg: &ProposerAcceptorMessage,
        recovery: bool,
    ) -> Result<Option<AcceptorProposerMessage>, SafeKeeperError> {
        let append = match msg {
            ProposerAcceptorMessage::AppendRequest(a)
            | ProposerAcceptorMessage::NoFlushAppendRequest(a) => Some(a),
            _ => None,
        };
        // Read first: the leaf lock's guard must not live across the append below.
        let limit = append.filter(|a| !a.wal_data.is_empty()).and_then(|a| {
            let mut gauge = self.disk.lock();
            // Measured before the timeline had WAL: its bytes count from its first append.
            if !gauge.at.is_valid() {
                gauge.at = a.h.begin_lsn;
            }
            gauge.refusal(a.h.begin_lsn)
        });
        if let Some(a) = append
            && let Some(why) = limit
        {
            // The WAL is refused, but its header is still taken (as an empty append would be):
            // the commit LSN (capped at our flush) and the peers' horizon. Removal below that
            // horizon is what frees the space; without it a node at its limit would wait for a
            // horizon that only an accepted append can bring.
            let header_only = sk_core::protocol::AppendRequest {
                h: sk_core::protocol::AppendRequestHeader {
                    end_lsn: a.h.begin_lsn,
                    ..a.h
                },
                wal_data: bytes::Bytes::new(),
            };
            self.process(
                &ProposerAcceptorMessage::NoFlushAppendRequest(header_only),
                recovery,
            )?;
            return Err(storage::Error::NoSpace(why).into());
        }
        let mut acceptor = self.lock();
        self.refuse_if_deleted()?;
        self.refuse_if_evicted()?;
        if recovery && self.proposers.load(Ordering::SeqCst) > 0 {
            return Err(storage::Error::Rejected(
                "a proposer is connected: peer recovery's WAL is refused".into(),
            )
            .into());
        }
        let mut result = acceptor.process_msg(msg);
        self.publish(&acceptor);
        drop(acceptor);
        // What the readers tell us rides on every acknowledgement (neon's hs_feedback; the
        // slowest required reader as its pageserver feedback): the proposer relays the first to
        // the primary and slows down on the second.
        if let Ok(Some(AcceptorProposerMessage::AppendResponse(r))) = &mut result
            && !recovery
        {
            (r.hs_feedback, r.pageserver_feedback) = self.feedback.for_append();
        }
        if let Some(a) = append
            && result.is_ok()
        {
            crate::disk_usage::APPENDED_BYTES.fetch_add(a.wal_data.len() as u64, Ordering::Relaxed);
        }
        result
    }

    /// A consistent starting point for a snapshot ([`crate::pull`]), read under the acceptor
    /// lock: the durable state, the term and the newest WAL's term, and the WAL to send,
    /// `[start, flush)`, held from removal until the returned point drops. The start is
    /// [`crate::manager::snapshot_start`]'s: with `remote` (donor and puller have remote
    /// storage) the backed-up point, else the first WAL, which must all be local. Blocking.
    pub fn snapshot_point(&self, remote: bool) -> Result<SnapshotPoint, String> {
        let remote = remote && self.remote().is_some();
        // A removal may claim segments between the choice and the hold: choose again.
        for _ in 0..8 {
            let a = self.lock();
            self.refuse_if_evicted().map_err(|e| e.to_string())?;
            let state = a.state().clone();
            let flush = a.flush_lsn();
            let inmem = lsns_of(&a.inmem());
            let (term, last_log_term) = (a.term(), a.last_log_term());
            drop(a);
            let horizon = crate::manager::horizon_of(&inmem, flush, remote, 0);
            let start = crate::manager::snapshot_start(&crate::manager::SnapshotInputs {
                seg_size: self.seg_size,
                wal_start: state.local_start_lsn.max(state.timeline_start_lsn),
                first_local: Lsn(self.holds.removed_below() * self.seg_size),
                flush,
                horizon,
                remote,
            })?;
            let Some(hold) = self.holds.hold(start, self.seg_size) else {
                continue;
            };
            return Ok(SnapshotPoint {
                state,
                term,
                last_log_term,
                start,
                flush,
                _hold: hold,
            });
        }
        Err("WAL removal kept overtaking the snapshot's start; pull again".into())
    }

    /// Marks the timeline deleted: waits for a `process_msg` in progress, then every later
    /// message is refused and [`Timeline::deleted`] fires (connections end with an error); a
    /// control-file save begun earlier and not yet written never writes.
    pub fn mark_deleted(&self) {
        let acceptor = self.lock();
        self.deleted.cancel();
        // A save begun before this point must not write: the directory may hold another
        // timeline's control file by then.
        acceptor.control().close();
    }

    /// The persisted state as published (what the control file holds, once saves in flight
    /// have finished).
    #[cfg(test)]
    pub(crate) fn persisted_state(&self) -> Arc<TimelinePersistentState> {
        self.view().state
    }

    /// Fires when the timeline is deleted.
    pub fn deleted(&self) -> &CancellationToken {
        &self.deleted
    }

    /// Switches the timeline to membership configuration `mconf`, durably before it returns
    /// (see `SafeKeeper::set_membership`: only forward). Returns whether it changed anything.
    /// Blocking (a control-file write and fsync).
    pub fn set_membership(&self, mconf: Configuration) -> Result<bool, SafeKeeperError> {
        let mut a = self.lock();
        // Its control file is closed (a save would fail): refused cleanly instead.
        self.refuse_if_deleted()?;
        self.refuse_if_evicted()?;
        let r = a.set_membership(mconf);
        self.publish(&a);
        r
    }

    /// Refused once deleted (read under the acceptor lock).
    fn refuse_if_deleted(&self) -> Result<(), storage::Error> {
        if self.deleted.is_cancelled() {
            return Err(storage::Error::Rejected(format!(
                "timeline {} was deleted on this safekeeper",
                self.ttid
            )));
        }
        Ok(())
    }

    /// Refused once evicted (read under the acceptor lock).
    fn refuse_if_evicted(&self) -> Result<(), storage::Error> {
        if self.evicted.load(Ordering::SeqCst) {
            return Err(storage::Error::Rejected(format!(
                "timeline {} was evicted on this safekeeper: reconnect to have it restored",
                self.ttid
            )));
        }
        Ok(())
    }

    /// The first step of an eviction ([`crate::evict`]): under the acceptor lock, refused while
    /// a proposer or reader is connected, after a deletion, or unless every byte of WAL is
    /// written, durable and committed (in memory and in the control file) at `end`. Then the
    /// control file is persisted with the eviction flag and the WAL store released; from here
    /// on this object refuses every message. Returns the persisted state. Blocking.
    pub fn begin_eviction(&self, end: Lsn) -> Result<Arc<TimelinePersistentState>, TimelineError> {
        let refuse = |why: String| TimelineError::Storage(storage::Error::Rejected(why));
        let mut a = self.lock();
        if self.deleted.is_cancelled() || self.evicted.load(Ordering::SeqCst) {
            return Err(refuse(format!(
                "timeline {} is deleted or evicted",
                self.ttid
            )));
        }
        let (proposers, readers) = (
            self.proposers.load(Ordering::SeqCst),
            self.readers.load(Ordering::SeqCst),
        );
        if proposers + readers > 0 {
            return Err(refuse(format!(
                "{proposers} proposer(s) and {readers} reader(s) are connected"
            )));
        }
        let (write, flush) = (a.write_lsn(), a.flush_lsn());
        let (inmem, persisted) = (a.inmem().commit_lsn, a.control().commit_lsn);
        if write != end || flush != end || inmem != end || persisted != end {
            return Err(refuse(format!(
                "the WAL moved: written {write}, durable {flush}, committed {inmem} (persisted \
                 {persisted}), eviction was decided at {end}"
            )));
        }
        a.persist_evicted(true)
            .map_err(|e| refuse(format!("persisting the eviction flag: {e}")))?;
        self.evicted.store(true, Ordering::SeqCst);
        if let Err(e) = a.wal_mut().release() {
            // Only a leftover prepared segment failed to go: the flag is set, the files are
            // removed next (and at start-up), and no write is taken any more.
            tracing::warn!("releasing the WAL store: {e}");
        }
        self.publish(&a);
        Ok(a.control().shared())
    }

    /// The last step of a restore ([`crate::evict`]): clears the eviction flag of a timeline
    /// just opened from an evicted directory, durably. Blocking.
    pub fn finish_restore(&self) -> Result<(), SafeKeeperError> {
        let mut a = self.lock();
        a.persist_evicted(false)?;
        self.publish(&a);
        Ok(())
    }

    /// Whether this object was evicted (a restore made a new one).
    pub fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::SeqCst)
    }

    /// The latest positions.
    pub fn positions(&self) -> Positions {
        *self.positions.borrow()
    }

    /// A receiver that wakes on every change of the positions.
    pub fn subscribe(&self) -> watch::Receiver<Positions> {
        self.positions.subscribe()
    }

    /// Appends WAL bytes `[from, to)` to `out`. Blocking (file reads). For committed WAL only,
    /// which no term truncates; WAL served to a `(term='N')` reader goes through
    /// [`Timeline::read_wal_in_term`].
    pub fn read_wal(&self, from: Lsn, to: Lsn, out: &mut Vec<u8>) -> storage::Result<()> {
        self.reader.read(from, to, out)
    }

    /// Appends WAL bytes `[from, to)` to `out` if they are still term `term`'s durable WAL: the
    /// term check and the read happen under the acceptor lock, which every truncation holds,
    /// so no new term can truncate and rewrite the range between the check and the read.
    /// Blocking (file reads, and it waits for a `process_msg` in progress).
    /// With `last_log_term`, the newest WAL's term must also still be that one (a snapshot's
    /// check: a proposer elected in the same acceptor term rewrites the history).
    pub fn read_wal_in_term(
        &self,
        term: Term,
        last_log_term: Option<Term>,
        from: Lsn,
        to: Lsn,
        out: &mut Vec<u8>,
    ) -> storage::Result<TermRead> {
        let acceptor = self.lock();
        if acceptor.term() != term {
            return Ok(TermRead::TermChanged(acceptor.term()));
        }
        if let Some(t) = last_log_term
            && acceptor.last_log_term() != t
        {
            return Ok(TermRead::LogTermChanged(acceptor.last_log_term()));
        }
        if to > acceptor.flush_lsn() {
            // Truncated in this term (a proposer's election) since the caller looked.
            return Ok(TermRead::Truncated(acceptor.flush_lsn()));
        }
        self.reader.read(from, to, out)?;
        drop(acceptor);
        Ok(TermRead::Read)
    }

    /// Runs (once) the test hook set in `before_wal_read`.
    #[cfg(test)]
    pub(crate) fn run_before_wal_read_hook(&self) {
        let hook = self.before_wal_read.lock().expect("hook lock").take();
        if let Some(mut hook) = hook {
            hook();
        }
    }

    /// The first `len` bytes of segment `segno` (a partial segment's committed part). Blocking.
    pub fn read_segment_prefix(&self, segno: u64, len: usize) -> storage::Result<Vec<u8>> {
        let mut buf = vec![0u8; len];
        self.read_segment_range(segno, 0, &mut buf)?;
        Ok(buf)
    }

    /// Segment `segno`'s bytes from `offset` on, as many as `buf` holds. Blocking.
    pub fn read_segment_range(
        &self,
        segno: u64,
        offset: u64,
        buf: &mut [u8],
    ) -> storage::Result<()> {
        crate::blocking::assert_may_block("reading a segment file");
        self.reader
            .read_into(Lsn(segno * self.seg_size + offset), buf)
    }

    /// Whether the segment holding `lsn` exists here.
    pub fn has_segment_at(&self, lsn: Lsn) -> bool {
        self.reader.has_segment(lsn.segment_number(self.seg_size))
    }

    /// PostgreSQL system identifier of the timeline.
    pub fn system_id(&self) -> u64 {
        self.view.lock().state.server.system_id
    }

    /// `server_version_num` of the timeline's primary (e.g. 170010).
    pub fn pg_version(&self) -> u32 {
        self.view.lock().state.server.pg_version
    }

    /// The oldest LSN a reader can start at: the start of the segment holding the first WAL
    /// this node has (earlier segments never existed here).
    pub fn oldest_available_lsn(&self) -> Lsn {
        let start = self.wal_start_lsn();
        let removed = Lsn(self.holds.removed_below() * self.seg_size);
        start.segment_start(self.seg_size).max(removed)
    }

    /// The oldest LSN a reader can start at, locally or from remote storage: with remote storage
    /// the start of this node's WAL (removed segments are served from the backup), else
    /// [`Timeline::oldest_available_lsn`].
    pub fn oldest_servable_lsn(&self) -> Lsn {
        if self.remote().is_some() {
            // From the timeline's start: a pulled timeline's local WAL begins at its snapshot's
            // start, and the store holds what is below (issue 26).
            let v = self.view.lock();
            let start = if v.state.timeline_start_lsn.is_valid() {
                v.state.timeline_start_lsn
            } else {
                v.state.local_start_lsn
            };
            start.segment_start(self.seg_size)
        } else {
            self.oldest_available_lsn()
        }
    }

    /// Where this node's WAL begins: `max(local_start_lsn, timeline_start_lsn)` (invalid for a
    /// timeline without WAL yet).
    pub fn wal_start_lsn(&self) -> Lsn {
        let v = self.view.lock();
        v.state.local_start_lsn.max(v.state.timeline_start_lsn)
    }

    /// Complete segments below this are in remote storage (in memory; see
    /// [`Timeline::lsns`] for what the control file holds).
    pub fn backup_lsn(&self) -> Lsn {
        self.view.lock().inmem.backup_lsn
    }

    /// The LSNs the timeline manager decides from: in memory, and as the control file holds
    /// them (what removal may go by).
    pub fn lsns(&self) -> (Lsns, Lsns) {
        let v = self.view.lock();
        (
            lsns_of(&v.inmem),
            Lsns {
                commit_lsn: v.state.commit_lsn,
                peer_horizon_lsn: v.state.peer_horizon_lsn,
                backup_lsn: v.state.backup_lsn,
            },
        )
    }

    /// Records that complete segments below `lsn` are in remote storage (persisted with the
    /// other in-memory LSNs by the timeline manager). Never moves back. Blocking (it waits for
    /// a `process_msg` in progress).
    pub fn set_backup_lsn(&self, lsn: Lsn) {
        let mut a = self.lock();
        a.set_backup_lsn(lsn);
        self.publish(&a);
    }

    /// The node's remote storage, once the backup driver has set it.
    pub fn remote(&self) -> Option<&Arc<RemoteStorage>> {
        self.remote.get()
    }

    /// Sets the node's remote storage (first call wins).
    pub fn set_remote(&self, remote: Arc<RemoteStorage>) {
        let _ = self.remote.set(remote);
    }

    /// Installs a new disk-usage measurement. Returns the refusal now in force (or `None` for
    /// "appends resume") if it changed between refusing and taking appends.
    pub fn set_disk_gauge(&self, gauge: crate::disk_usage::Gauge) -> Option<Option<String>> {
        let at = self.view.lock().write_lsn;
        let mut cur = self.disk.lock();
        let before = cur.refusal(at);
        let after = gauge.refusal(at);
        *cur = gauge;
        (before.is_some() != after.is_some()).then_some(after)
    }

    /// Measures this timeline's directory against `limits` (with `fs`, the file system's
    /// sample, if measured) and installs the gauge; returns what [`Timeline::set_disk_gauge`]
    /// does. Blocking (reads the directory).
    pub fn measure_disk(
        &self,
        limits: &crate::disk_usage::DiskLimits,
        fs: Option<crate::disk_usage::FsSample>,
    ) -> std::io::Result<Option<Option<String>>> {
        // The write LSN before the directory is read: bytes written meanwhile count twice.
        let at = self.view.lock().write_lsn;
        let used = crate::disk_usage::dir_usage(&self.dir)?;
        Ok(self.set_disk_gauge(crate::disk_usage::Gauge {
            limits: Some(limits.clone()),
            used,
            at,
            fs,
        }))
    }

    /// Every local segment below this number was removed (or is being removed).
    pub fn removed_below(&self) -> u64 {
        self.holds.removed_below()
    }

    /// Holds local WAL from `lsn` on for a reader; `None` if its segment was removed.
    pub fn hold_wal(&self, lsn: Lsn) -> Option<ReadHold> {
        self.holds.hold(lsn, self.seg_size)
    }

    /// Removes the local segments below the removal horizon computed from the *persisted*
    /// state (see [`crate::remove_wal`]): a crash right after the unlink restarts from the
    /// control file, whose commit LSN must still find its WAL here. Keeps `wal_keep_size` bytes
    /// below the flush LSN; nothing without remote storage. Durable (directory fsync) before it
    /// returns the number of segments removed. Blocking. The timeline manager decides the same
    /// way ([`crate::manager`]) and calls [`Timeline::remove_segments_below`].
    pub fn remove_old_wal(&self, wal_keep_size: u64) -> storage::Result<usize> {
        let (_, persisted) = self.lsns();
        let horizon = crate::manager::horizon_of(
            &persisted,
            self.positions().flush_lsn,
            self.remote().is_some(),
            wal_keep_size,
        );
        self.remove_segments_below(horizon)
    }

    /// Removes the local segments wholly below `horizon` and below every reader's hold,
    /// without the acceptor lock (the segments are below the persisted commit LSN, which the
    /// writer has passed for good). Durable before it returns how many it removed. Blocking.
    pub fn remove_segments_below(&self, horizon: Lsn) -> storage::Result<usize> {
        crate::blocking::assert_may_block("removing WAL segments");
        let writing = self.view.lock().write_lsn.segment_number(self.seg_size);
        self.holds.remove_below(
            self.seg_size,
            |oldest| {
                let h = oldest.map_or(horizon, |r| r.min(horizon));
                h.min(Lsn(writing * self.seg_size))
            },
            |below| {
                crate::wal_store::remove_segments_below(
                    &self.fs,
                    &self.dir,
                    self.seg_size,
                    below,
                    self.no_sync,
                )
            },
        )
    }

    /// Everything the HTTP status shows, from the published view (never waits for an fsync).
    pub fn status(&self) -> TimelineStatus {
        let v = self.view();
        let p = self.positions();
        let s = &v.state;
        TimelineStatus {
            tenant_id: s.tenant_id,
            timeline_id: s.timeline_id,
            node_id: self.node_id,
            term: p.term,
            last_log_term: p.last_log_term,
            term_history: s.acceptor_state.term_history.up_to(p.flush_lsn),
            flush_lsn: p.flush_lsn,
            write_lsn: v.write_lsn,
            commit_lsn: v.inmem.commit_lsn,
            persisted_commit_lsn: s.commit_lsn,
            timeline_start_lsn: s.timeline_start_lsn,
            local_start_lsn: s.local_start_lsn,
            peer_horizon_lsn: v.inmem.peer_horizon_lsn,
            system_id: s.server.system_id,
            pg_version: s.server.pg_version,
            wal_seg_size: s.server.wal_seg_size,
            generation: s.mconf.generation.0,
            mconf: s.mconf.clone(),
            elected_generation: s.acceptor_state.elected_generation.0,
            proposers: self.proposers.load(Ordering::Relaxed),
            readers: self.readers.load(Ordering::Relaxed),
            reader_feedback: self.feedback.statuses(v.inmem.commit_lsn, Instant::now()),
            hs_feedback: self.feedback.hs_feedback().into(),
            backup_lsn: v.inmem.backup_lsn,
            removal_horizon_lsn: Lsn(self.holds.removed_below() * self.seg_size),
            remote_location: self.remote().map(|r| r.timeline_location(&self.ttid)),
            recovery: self.recovery.lock().clone(),
            evicted: false,
        }
    }

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// The membership configuration as this node persisted it.
    pub fn mconf(&self) -> sk_core::state::Configuration {
        self.view.lock().state.mconf.clone()
    }

    /// Connected proposers.
    pub fn proposer_count(&self) -> usize {
        self.proposers.load(Ordering::Relaxed)
    }

    /// Completes when a proposer connects after the future was created (or enabled).
    pub fn proposer_arrived(&self) -> tokio::sync::futures::Notified<'_> {
        self.proposer_arrived.notified()
    }

    /// Takes the timeline's one peer-recovery slot; `None` if a check or session holds it. The
    /// slot is free again when the returned guard drops.
    pub fn recovery_slot(&self) -> Option<RecoverySlot> {
        (!self.recovery_busy.swap(true, Ordering::AcqRel))
            .then(|| RecoverySlot(self.recovery_busy.clone()))
    }

    /// Changes what the status shows of peer recovery.
    pub fn update_recovery(&self, f: impl FnOnce(&mut RecoveryStatus)) {
        f(&mut self.recovery.lock());
    }

    /// What peer recovery compares with its peers, read at one moment.
    pub fn recovery_view(&self) -> LocalView {
        let v = self.view();
        let p = self.positions();
        LocalView {
            term: p.term,
            term_history: v.state.acceptor_state.term_history.up_to(p.flush_lsn),
            flush_lsn: p.flush_lsn,
            commit_lsn: v.inmem.commit_lsn,
            generation: v.state.mconf.generation,
        }
    }

    /// Persists in-memory LSNs if they are due (or always with `force`). Blocking. Returns
    /// whether it wrote.
    ///
    /// The write runs outside the acceptor lock: appends and their replies go on meanwhile
    /// (a control-file save takes milliseconds, the commits behind it would wait that long).
    /// The store's save numbers keep it from taking back a vote or any other state saved
    /// after this one was taken ([`FileControlStore::begin_save`]).
    pub fn maybe_persist(&self, force: bool) -> Result<bool, SafeKeeperError> {
        let due = force || self.last_persist.lock().elapsed() >= CONTROL_FILE_SAVE_INTERVAL;
        // A write is skipped only when a later save reached the file first; every save carries
        // the lazy values as they were when it was taken, so that one holds these or newer.
        let mut wrote = false;
        if let Some(save) = self.begin_save(due) {
            let written = save.write().map_err(SafeKeeperError::from)?;
            wrote = written.is_some();
            self.finish_save(written);
        }
        if wrote || due {
            *self.last_persist.lock() = Instant::now();
        }
        Ok(wrote)
    }

    /// The first phase of [`Timeline::maybe_persist`]: takes the state to save, under the
    /// acceptor lock. `None`: nothing to save (or the timeline is evicted).
    pub(crate) fn begin_save(&self, due: bool) -> Option<PendingSave> {
        let mut a = self.lock();
        if self.evicted.load(Ordering::SeqCst) || self.deleted.is_cancelled() {
            // The control file is the evicted timeline's (or its restored successor's) now,
            // or gone with the deleted timeline.
            return None;
        }
        let s = a.inmem_to_save(due)?;
        Some(a.control_mut().begin_save(s))
    }

    /// The last phase of [`Timeline::maybe_persist`]: a written save becomes the persisted
    /// state (unless a later one did meanwhile) and is published.
    pub(crate) fn finish_save(&self, written: Option<WrittenSave>) {
        let Some(saved) = written else { return };
        let mut a = self.lock();
        if a.control_mut().finish_save(saved) {
            self.publish(&a);
        }
    }

    /// Proposers and readers connected now.
    pub fn connections(&self) -> usize {
        self.proposers.load(Ordering::SeqCst) + self.readers.load(Ordering::SeqCst)
    }

    /// Counts a connected proposer until the guard drops.
    pub fn proposer_guard(self: &Arc<Self>) -> ConnectionGuard {
        ConnectionGuard::new(self.clone(), Role::Proposer)
    }

    /// Counts a connected reader until the guard drops.
    pub fn reader_guard(self: &Arc<Self>) -> ConnectionGuard {
        ConnectionGuard::new(self.clone(), Role::Reader)
    }

    /// Keeps what a reader of committed WAL, streaming from `start`, reports back until the
    /// handle drops ([`crate::feedback`]).
    pub fn register_reader(&self, info: ReaderInfo, start: Lsn) -> ReaderHandle {
        self.feedback.register(info, start)
    }

    /// The readers' lags, min and max over them (for Prometheus).
    pub fn reader_lags(&self) -> crate::feedback::LagSummary {
        self.feedback
            .summary(self.view().inmem.commit_lsn, Instant::now())
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

/// What async code reads of a timeline without the acceptor lock ([`Timeline::publish`]).
#[derive(Clone)]
struct View {
    /// End of WAL handed to the OS.
    write_lsn: Lsn,
    /// The acceptor's in-memory LSNs.
    inmem: InMemoryState,
    /// The persisted state (the control file's).
    state: Arc<TimelinePersistentState>,
}

impl View {
    fn of(a: &Acceptor) -> View {
        View {
            write_lsn: a.write_lsn(),
            inmem: a.inmem(),
            state: a.control().shared(),
        }
    }
}

/// The lazily persisted LSNs among the acceptor's in-memory ones.
fn lsns_of(m: &InMemoryState) -> Lsns {
    Lsns {
        commit_lsn: m.commit_lsn,
        peer_horizon_lsn: m.peer_horizon_lsn,
        backup_lsn: m.backup_lsn,
    }
}

/// Where a snapshot starts: see [`Timeline::snapshot_point`].
pub struct SnapshotPoint {
    /// The durable state (what the control file holds).
    pub state: TimelinePersistentState,
    /// The acceptor's term: the snapshot's WAL is read in it (a new term aborts the snapshot).
    pub term: Term,
    /// The newest WAL's term: a change (a new history in the same term) aborts it too.
    pub last_log_term: Term,
    /// Keeps `[start, …)` from removal while the snapshot is sent.
    _hold: ReadHold,
    /// The first WAL byte held here.
    pub start: Lsn,
    /// The durable end of WAL.
    pub flush: Lsn,
}

/// Holds a timeline's peer-recovery slot ([`Timeline::recovery_slot`]).
pub struct RecoverySlot(Arc<AtomicBool>);

impl Drop for RecoverySlot {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
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
                // SeqCst: read under the acceptor lock by `process_recovery_msg`.
                tl.proposers.fetch_add(1, Ordering::SeqCst);
                tl.proposer_arrived.notify_waiters();
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

/// Why a timeline could not be opened, found or created. A storage failure keeps its kind
/// (`Corruption`, `NoSpace`, `Io`, `Rejected` of [`storage::Error`]) up to where it is answered:
/// [`TimelineError::sqlstate`] on the wire, the HTTP error mapping, the daemon's start-up.
#[derive(Debug, thiserror::Error)]
pub enum TimelineError {
    /// No such timeline, and the proposer did not allow creating it.
    #[error("timeline {0} does not exist (and the proposer did not allow creating it)")]
    NotFound(TenantTimelineId),
    /// The timeline (or its tenant) was deleted here; only an explicit create brings it back.
    #[error(
        "timeline {0} was deleted on this safekeeper; only an explicit create \
         (POST /v1/tenant/{{tenant_id}}/timeline) serves it again"
    )]
    Deleted(TenantTimelineId),
    /// A create or pull of a timeline whose deletion (of the same ids) still has remote
    /// objects to delete.
    #[error(
        "timeline {0} was deleted and its objects in remote storage are still being deleted; \
         retry once the deletion finished"
    )]
    BeingDeleted(TenantTimelineId),
    /// A delete that would remove objects in remote storage that belong to other nodes.
    #[error("refusing to delete {what} everywhere: {reason}")]
    NotAMember {
        /// The timeline or tenant.
        what: String,
        /// Why, and what to do instead.
        reason: String,
    },
    /// The timeline is evicted here: restore it first ([`crate::evict::restore`]).
    #[error("timeline {0} is evicted on this safekeeper (it is restored on demand)")]
    Evicted(TenantTimelineId),
    /// An evicted timeline could not be restored (remote storage failed or lacks its WAL); it
    /// stays evicted and the next demand tries again.
    #[error("restoring evicted timeline {ttid}: {reason} (it stays evicted; retry)")]
    RestoreFailed {
        /// The timeline.
        ttid: TenantTimelineId,
        /// Why.
        reason: String,
    },
    /// An explicit create of a timeline that exists.
    #[error("timeline {0} exists already")]
    Exists(TenantTimelineId),
    /// A create request that is not valid.
    #[error("{0}")]
    BadRequest(String),
    /// A greeting asked for a segment size PostgreSQL does not support.
    #[error("invalid WAL segment size {0}: must be a power of two from 1 MiB to 1 GiB")]
    BadSegmentSize(u32),
    /// A greeting or create request of a PostgreSQL version whose WAL is not supported.
    #[error(transparent)]
    UnsupportedVersion(#[from] pg_wal::UnsupportedVersion),
    /// Storage failed: stored data that fails verification (the timeline refuses to start), a
    /// full disk, another I/O error, or a request the stored state refuses.
    #[error(transparent)]
    Storage(#[from] storage::Error),
    /// The acceptor refused the stored state.
    #[error("starting timeline {ttid} in {dir}: {source}")]
    Acceptor {
        /// The timeline.
        ttid: TenantTimelineId,
        /// Its directory.
        dir: String,
        /// Why (boxed: the acceptor's error is large and this path is cold).
        #[source]
        source: Box<SafeKeeperError>,
    },
}

impl TimelineError {
    /// An I/O error of the file-system seam, with ENOSPC kept apart.
    pub fn io(context: impl Into<String>, source: std::io::Error) -> TimelineError {
        storage::Error::io(context, source).into()
    }

    /// The SQLSTATE a proposer is sent when its greeting's timeline cannot be used.
    ///
    /// Every kind answers `undefined_object` today, as before the error was typed; the match
    /// is where a kind gets its own code (disk full, data corrupted).
    pub fn sqlstate(&self) -> &'static str {
        match self {
            TimelineError::NotFound(_)
            | TimelineError::Evicted(_)
            | TimelineError::RestoreFailed { .. }
            | TimelineError::Deleted(_)
            | TimelineError::Exists(_)
            | TimelineError::BeingDeleted(_)
            | TimelineError::NotAMember { .. }
            | TimelineError::BadRequest(_)
            | TimelineError::BadSegmentSize(_)
            | TimelineError::UnsupportedVersion(_)
            | TimelineError::Storage(
                storage::Error::Corruption { .. }
                | storage::Error::WalCorruption { .. }
                | storage::Error::NoSpace(_)
                | storage::Error::Io { .. }
                | storage::Error::Rejected(_),
            )
            | TimelineError::Acceptor { .. } => pq_proto::sqlstate::UNDEFINED_OBJECT,
        }
    }
}
