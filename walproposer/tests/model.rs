//! Seeded model test of the consensus core: a deterministic in-memory cluster of 3 acceptors
//! (the real `SafeKeeper`) and 2 competing proposers (a small but faithful model of
//! walproposer), with random message interleaving, connection drops, acceptor power losses
//! (everything un-synced lost, the acceptor rebuilt from durable state only), proposer crashes,
//! and stale connections (an acceptor still reading messages a proposer sent on a connection it
//! has already given up on). Every message goes through the real codec, and the WAL is real
//! PostgreSQL WAL from the generator, each record stamped with its term in `xl_xid`.
//!
//! Two storage backends:
//! - `Mem`: the in-memory fakes of `sk_core::storage::mem` (a power loss drops un-synced WAL
//!   writes; control-file persists are atomic and durable). Fast: thousands of seeds.
//! - `SimFs`: the real file stores (`safekeeper::wal_store`, `safekeeper::control_file`) on the
//!   simulated file system `sk_core::storage::fs::SimFs`, whose power loss also forgets
//!   directory entries (new segments, renames of the control file) that no directory fsync made
//!   durable, and keeps a random prefix of each file's and directory's un-synced operations. This is
//!   the variant that catches a missing directory fsync.
//!
//! After every step the TLA+ invariants of neon's `ProposerAcceptorStatic.tla` are checked:
//! election safety (one proposer elected per term), log monotonicity (each acceptor's WAL is
//! written by non-decreasing terms, matching its term history), log safety (acceptors agree on
//! committed bytes), and durability of commits (bytes a proposer saw committed stay present and
//! identical on a quorum's durable WAL).
//!
//! Knobs: `MODEL_SEEDS=n` runs `n` seeds per test (defaults: `Mem` 3000 of 400 steps and 20 of
//! 3000 steps; `SimFs` 400 of 400 steps and 6 of 3000 steps) from `MODEL_SEED_START` (default
//! 0), `MODEL_STEPS` sets the steps; `MODEL_SEED=s` replays one seed (test
//! `model_replay_one_seed`, backend `MODEL_BACKEND=mem|simfs`, default mem) and `MODEL_TRACE=1`
//! prints its events. A failure prints its seed and the command that replays it.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use pg_wal::format::page_header_size;
use pg_wal::{WalGenerator, WalStreamDecoder};
use safekeeper::control_file::FileControlStore;
use safekeeper::wal_store::{WalFileOptions, WalFileStore};
use sk_core::protocol::{
    AcceptorGreeting, AcceptorProposerMessage, AppendRequest, AppendRequestHeader,
    ProposerAcceptorMessage, ProposerElected, ProposerGreeting, VoteRequest, VoteResponse,
};
use sk_core::safekeeper::{SafeKeeper, SafeKeeperError};
use sk_core::state::{Configuration, ServerInfo, TimelinePersistentState};
use sk_core::storage::fs::{FileSystem, Fs, SimFs};
use sk_core::storage::mem::{MemControlStore, MemWalStore};
use sk_core::storage::{ControlStore, WalStore};
use sk_core::types::{Generation, Lsn, NodeId, TenantId, Term, TermHistory, TermLsn, TimelineId};

const N_ACC: usize = 3;
const N_PROP: usize = 2;
const QUORUM: usize = N_ACC / 2 + 1;
const STEPS: usize = 400;
/// Steps of the long-schedule variants (deeper histories, bigger logs).
const LONG_STEPS: usize = 3000;
/// Offset of `xl_xid` in `XLogRecord`: the record's term.
const XID_OFFSET: usize = 4;
const SYSTEM_ID: u64 = 0x5eed;

type Sk<B> = SafeKeeper<<B as Backend>::Ctrl, <B as Backend>::Wal>;

/// Where acceptors keep their state, and what a power loss does to it.
trait Backend: Sized {
    type Ctrl: ControlStore;
    type Wal: WalStore;
    const NAME: &'static str;
    /// WAL segment size of the timeline.
    const SEG: u32;
    /// Where the timeline's WAL begins (a page boundary).
    const START: Lsn;

    fn new() -> Self;
    /// A fresh acceptor with an empty timeline.
    fn new_acceptor(&mut self, a: usize) -> Sk<Self>;
    /// Loses everything `sk`'s storage has not made durable and rebuilds the acceptor from
    /// what is left; returns it and a description of what was lost.
    fn power_loss(&mut self, a: usize, sk: Sk<Self>, rng: &mut SmallRng) -> (Sk<Self>, String);
    /// The acceptor's WAL `[start, end)` (below its flush LSN: durable), if held.
    fn read(sk: &Sk<Self>, start: Lsn, end: Lsn) -> Option<Vec<u8>>;
    /// Length of the message of the next record.
    fn message_len(rng: &mut SmallRng) -> usize;
    /// Backend-specific counts for the summary.
    fn counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }
    /// Whether the power can fail in the middle of a storage call (see [`Backend::arm_crash`]).
    const CRASH_POINTS: bool = false;
    /// Arms a power failure just before acceptor `a`'s storage operation numbered `ops` from
    /// now; the call goes on, and if the point was reached the acceptor then loses power there.
    fn arm_crash(&mut self, _a: usize, _ops: u64) {}
    /// Whether the armed point was reached (and disarms it if not).
    fn crash_point_reached(&mut self, _a: usize) -> bool {
        false
    }
}

fn initial_state(seg: u32) -> TimelinePersistentState {
    TimelinePersistentState::new(
        tenant(),
        timeline(),
        Configuration::default(),
        ServerInfo {
            pg_version: 150000,
            system_id: SYSTEM_ID,
            wal_seg_size: seg,
        },
        0,
    )
}

/// The in-memory fakes.
struct Mem;

impl Backend for Mem {
    type Ctrl = MemControlStore;
    type Wal = MemWalStore;
    const NAME: &'static str = "mem";
    const SEG: u32 = 16 << 20;
    const START: Lsn = Lsn(0x0100_0000);

    fn new() -> Mem {
        Mem
    }

    fn new_acceptor(&mut self, a: usize) -> Sk<Mem> {
        SafeKeeper::new(
            NodeId(a as u64 + 1),
            MemControlStore::new(initial_state(Self::SEG)),
            MemWalStore::new(),
        )
        .expect("a fresh timeline starts")
    }

    fn power_loss(&mut self, a: usize, sk: Sk<Mem>, rng: &mut SmallRng) -> (Sk<Mem>, String) {
        let (ctrl, mut wal) = sk.into_storage();
        let keep = rng.random_range(0..=wal.unsynced_write_count());
        wal.power_loss_keeping(keep);
        let sk = SafeKeeper::new(NodeId(a as u64 + 1), ctrl, wal)
            .unwrap_or_else(|e| panic!("acceptor a{a} cannot restart after power loss: {e}"));
        (sk, format!("kept {keep} unsynced writes"))
    }

    fn read(sk: &Sk<Mem>, start: Lsn, end: Lsn) -> Option<Vec<u8>> {
        sk.wal().read(start, end).map(<[u8]>::to_vec)
    }

    fn message_len(rng: &mut SmallRng) -> usize {
        rng.random_range(0..=120)
    }
}

/// The real file stores on a simulated file system per acceptor.
struct SimFsBackend {
    fs: Vec<Arc<SimFs>>,
    /// Un-synced operations power losses forgot: file writes/size changes, directory entries.
    file_ops_lost: u64,
    dir_ops_lost: u64,
}

fn timeline_dir() -> PathBuf {
    PathBuf::from("/sk/tenant/timeline")
}

fn open_file_stores(fs: &Arc<SimFs>, a: usize) -> Result<Sk<SimFsBackend>, String> {
    let dir = timeline_dir();
    let ctrl = FileControlStore::load_in(Fs::sim(fs.clone()), &dir, false)
        .map_err(|e| format!("loading the control file: {e}"))?;
    let opts = WalFileOptions {
        system_id: SYSTEM_ID,
        wal_start_lsn: ctrl.local_start_lsn,
        fs: Fs::sim(fs.clone()),
        ..WalFileOptions::default()
    };
    let wal = WalFileStore::open(&dir, SimFsBackend::SEG as u64, ctrl.commit_lsn, opts)
        .map_err(|e| format!("opening the WAL: {e}"))?;
    SafeKeeper::new(NodeId(a as u64 + 1), ctrl, wal).map_err(|e| e.to_string())
}

impl Backend for SimFsBackend {
    type Ctrl = FileControlStore;
    type Wal = WalFileStore;
    const NAME: &'static str = "simfs";
    /// The smallest segment PostgreSQL allows, so schedules cross segment boundaries.
    const SEG: u32 = 1 << 20;
    /// 32 KiB before a segment ends: the first segment starts mid-segment (its first pages are
    /// written by `initialize_first_segment`) and most schedules cross into the next segment.
    const START: Lsn = Lsn(0x0110_0000 - (32 << 10));

    fn new() -> SimFsBackend {
        SimFsBackend {
            fs: (0..N_ACC).map(|_| SimFs::new()).collect(),
            file_ops_lost: 0,
            dir_ops_lost: 0,
        }
    }

    fn new_acceptor(&mut self, a: usize) -> Sk<SimFsBackend> {
        let fs = &self.fs[a];
        fs.create_dir_all(&timeline_dir()).expect("simulated mkdir");
        FileControlStore::create_new_in(
            Fs::sim(fs.clone()),
            timeline_dir(),
            initial_state(Self::SEG),
            false,
        )
        .expect("a fresh control file");
        open_file_stores(fs, a).expect("a fresh timeline starts")
    }

    fn power_loss(
        &mut self,
        a: usize,
        sk: Sk<SimFsBackend>,
        rng: &mut SmallRng,
    ) -> (Sk<SimFsBackend>, String) {
        drop(sk.into_storage());
        // Half the time the harshest outcome (nothing un-synced survives), otherwise a random
        // prefix of each file's and directory's un-synced operations.
        let harsh = rng.random_bool(0.5);
        let report = self.fs[a].power_loss(&mut |n| {
            if harsh { 0 } else { rng.random_range(0..=n) }
        });
        self.file_ops_lost += report.file_ops_lost as u64;
        self.dir_ops_lost += report.dir_ops_lost as u64;
        let sk = open_file_stores(&self.fs[a], a)
            .unwrap_or_else(|e| panic!("acceptor a{a} cannot restart after power loss: {e}"));
        (sk, format!("{report:?}"))
    }

    fn read(sk: &Sk<SimFsBackend>, start: Lsn, end: Lsn) -> Option<Vec<u8>> {
        let mut out = vec![0; (end.0 - start.0) as usize];
        sk.wal()
            .reader()
            .read_into(start, &mut out)
            .ok()
            .map(|()| out)
    }

    fn message_len(rng: &mut SmallRng) -> usize {
        // Mostly small records; some large ones cross pages and segments.
        if rng.random_bool(0.08) {
            rng.random_range(8 << 10..=100 << 10)
        } else {
            rng.random_range(0..=400)
        }
    }

    const CRASH_POINTS: bool = true;

    fn arm_crash(&mut self, a: usize, ops: u64) {
        self.fs[a].arm_crash_after(ops);
    }

    fn crash_point_reached(&mut self, a: usize) -> bool {
        let reached = self.fs[a].crash_point_reached();
        if !reached {
            self.fs[a].disarm();
        }
        reached
    }

    fn counters(&self) -> Vec<(&'static str, u64)> {
        let (fsyncs, dir_fsyncs) = self
            .fs
            .iter()
            .map(|fs| fs.sync_counts())
            .fold((0, 0), |(a, b), (c, d)| (a + c, b + d));
        vec![
            ("file_fsyncs", fsyncs),
            ("dir_fsyncs", dir_fsyncs),
            ("file_ops_lost", self.file_ops_lost),
            ("dir_ops_lost", self.dir_ops_lost),
        ]
    }
}

/// Start of the record that follows a record ending at `end` (the next record's header comes
/// after the page header when `end` is a page boundary).
fn next_record_start(end: Lsn, seg: u32) -> Lsn {
    if end.page_offset() == 0 {
        Lsn(end.0 + page_header_size(end, seg as u64) as u64)
    } else {
        end
    }
}

/// `(start, end)` of every record of `wal` (WAL beginning at `wal_start`); panics naming `who`
/// if it does not decode to its end.
fn records(wal: &[u8], wal_start: Lsn, seg: u32, who: &str) -> Vec<(Lsn, Lsn)> {
    RecordWalker::new(wal_start, seg).feed(wal, who)
}

/// Finds record boundaries in WAL fed piece by piece.
struct RecordWalker {
    seg: u32,
    decoder: WalStreamDecoder,
    /// Start of the next record.
    next_start: Lsn,
}

impl RecordWalker {
    fn new(wal_start: Lsn, seg: u32) -> RecordWalker {
        RecordWalker {
            seg,
            decoder: WalStreamDecoder::new(wal_start, seg as u64),
            next_start: next_record_start(wal_start, seg),
        }
    }

    /// `(start, end)` of the records completed by `wal` (the bytes after those fed before);
    /// panics naming `who` if they do not decode or stop in the middle of a record.
    fn feed(&mut self, wal: &[u8], who: &str) -> Vec<(Lsn, Lsn)> {
        let mut out = Vec::new();
        let seg = self.seg;
        let next_start = &mut self.next_start;
        self.decoder
            .feed_with(wal, |end| {
                out.push((*next_start, end));
                *next_start = next_record_start(end, seg);
            })
            .unwrap_or_else(|e| panic!("{who}: WAL does not decode: {e}"));
        assert_eq!(
            self.decoder.last_record_end(),
            self.decoder.lsn(),
            "{who}: WAL ends in the middle of a record"
        );
        out
    }
}

/// The term of the record at `start` of `wal` (WAL beginning at `wal_start`): stamped in its
/// `xl_xid`.
fn record_term(wal: &[u8], wal_start: Lsn, start: Lsn) -> Term {
    let off = (start.0 - wal_start.0) as usize + XID_OFFSET;
    Term(u32::from_le_bytes(wal[off..off + 4].try_into().expect("4 bytes")) as u64)
}

fn tenant() -> TenantId {
    TenantId([0x11; 16])
}

fn timeline() -> TimelineId {
    TimelineId([0x22; 16])
}

fn encode_pa(msg: &ProposerAcceptorMessage) -> Bytes {
    let mut b = BytesMut::new();
    msg.encode(&mut b).expect("model sends wire messages only");
    b.freeze()
}

fn encode_ap(msg: &AcceptorProposerMessage) -> Bytes {
    let mut b = BytesMut::new();
    msg.encode(&mut b).expect("acceptor replies are encodable");
    b.freeze()
}

/// A FIFO connection between proposer `p` and acceptor `a`.
#[derive(Default)]
struct Conn {
    up: bool,
    to_acc: VecDeque<Bytes>,
    to_prop: VecDeque<Bytes>,
    /// Acceptor side: no-flush appends processed since the last FlushWAL (neon's `dirty`).
    dirty: bool,
}

/// A proposer's view of one acceptor; reset when the connection goes down.
#[derive(Default, Clone)]
struct AccView {
    greeting: Option<AcceptorGreeting>,
    vote: Option<VoteResponse>,
    elected_sent: bool,
    /// Next LSN to stream to this acceptor.
    next_lsn: Lsn,
    /// Highest flush_lsn this acceptor reported in our term.
    flush_lsn: Lsn,
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Idle,
    Greeting,
    Voting,
    Elected,
}

struct Proposer {
    /// Bumped on every restart; (id, incarnation) identifies who was elected.
    incarnation: u64,
    phase: Phase,
    term: Term,
    views: Vec<AccView>,
    history: TermHistory,
    term_start: Lsn,
    /// Where the timeline's WAL begins.
    start: Lsn,
    /// WAL bytes `[start, start + log.len())`. Invariant (checked): every byte below `commit`
    /// is globally committed.
    log: Vec<u8>,
    /// End of every record of `log`, ascending (appends are cut at record boundaries).
    rec_ends: Vec<Lsn>,
    /// Generates this term's records, continuing the `xl_prev` chain of `log`.
    wal_gen: Option<WalGenerator>,
    commit: Lsn,
    truncate_lsn: Lsn,
}

impl Proposer {
    fn new(start: Lsn) -> Proposer {
        Proposer {
            start,
            incarnation: 0,
            phase: Phase::Idle,
            term: Term(0),
            views: vec![AccView::default(); N_ACC],
            history: TermHistory::empty(),
            term_start: Lsn(0),
            log: Vec::new(),
            rec_ends: Vec::new(),
            wal_gen: None,
            commit: Lsn(0),
            truncate_lsn: Lsn(0),
        }
    }

    fn log_end(&self) -> Lsn {
        Lsn(self.start.0 + self.log.len() as u64)
    }

    fn greetings(&self) -> usize {
        self.views.iter().filter(|v| v.greeting.is_some()).count()
    }
}

#[derive(Default, Debug)]
struct Stats {
    elections: u64,
    commits_observed: u64,
    power_losses: u64,
    /// Power losses in the middle of a storage call.
    crash_points: u64,
    drops: u64,
    committed_bytes: u64,
    stale_delivered: u64,
    acceptor_errors: BTreeMap<String, u64>,
    backend: BTreeMap<&'static str, u64>,
}

struct Cluster<B: Backend> {
    rng: SmallRng,
    trace: bool,
    backend: B,
    acceptors: Vec<Option<Sk<B>>>,
    proposers: Vec<Proposer>,
    /// `conns[p][a]`.
    conns: Vec<Vec<Conn>>,
    /// Queues of dropped connections that the acceptor may still read: the proposer gave up on
    /// the socket, but bytes it had sent sit in the acceptor's receive buffer. `(p, a, queue)`;
    /// replies go nowhere.
    zombies: Vec<(usize, usize, VecDeque<Bytes>)>,
    /// term → (proposer, incarnation) elected in it.
    elected: BTreeMap<Term, (usize, u64)>,
    /// The longest committed prefix any proposer observed: bytes `[B::START, B::START + len)`.
    committed: Vec<u8>,
    /// Highest commit LSN observed by the proposer of each term.
    commit_by_term: BTreeMap<Term, Lsn>,
    /// Per acceptor: highest term, persisted commit seen so far (monotonicity across reboots).
    acc_term_seen: Vec<Term>,
    acc_commit_seen: Vec<Lsn>,
    /// Per acceptor: highest flush LSN revealed in a reply since its last truncation, and
    /// highest commit LSN revealed; both must survive any power loss.
    acc_flush_revealed: Vec<Lsn>,
    acc_commit_revealed: Vec<Lsn>,
    /// Probability that a step is a fault (drop, power loss, timeout, crash); per seed, so
    /// some schedules are calm and long-running and others stormy.
    fault_rate: f64,
    /// Per acceptor: how far its durable WAL's terms were checked.
    log_check: Vec<Option<LogCheck>>,
    stats: Stats,
}

/// A checked prefix of an acceptor's durable WAL and where its checking stopped.
struct LogCheck {
    bytes: Vec<u8>,
    hist: TermHistory,
    /// Positioned after `bytes`.
    walker: RecordWalker,
    last_term: Term,
}

impl<B: Backend> Cluster<B> {
    fn new(seed: u64, trace: bool) -> Cluster<B> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let fault_rate = [0.005, 0.02, 0.06, 0.15][rng.random_range(0..4)];
        let mut backend = B::new();
        Cluster {
            rng,
            fault_rate,
            trace,
            acceptors: (0..N_ACC).map(|a| Some(backend.new_acceptor(a))).collect(),
            backend,
            proposers: (0..N_PROP).map(|_| Proposer::new(B::START)).collect(),
            conns: (0..N_PROP)
                .map(|_| (0..N_ACC).map(|_| Conn::default()).collect())
                .collect(),
            zombies: Vec::new(),
            elected: BTreeMap::new(),
            committed: Vec::new(),
            commit_by_term: BTreeMap::new(),
            acc_term_seen: vec![Term(0); N_ACC],
            acc_commit_seen: vec![Lsn(0); N_ACC],
            acc_flush_revealed: vec![Lsn(0); N_ACC],
            acc_commit_revealed: vec![Lsn(0); N_ACC],
            log_check: (0..N_ACC).map(|_| None).collect(),
            stats: Stats::default(),
        }
    }

    fn log(&self, f: impl FnOnce() -> String) {
        if self.trace {
            eprintln!("{}", f());
        }
    }

    fn sk(&self, a: usize) -> &Sk<B> {
        self.acceptors[a]
            .as_ref()
            .expect("acceptor present between steps")
    }

    fn sk_mut(&mut self, a: usize) -> &mut Sk<B> {
        self.acceptors[a]
            .as_mut()
            .expect("acceptor present between steps")
    }

    // ----- connections -------------------------------------------------------------------

    fn send(&mut self, p: usize, a: usize, msg: ProposerAcceptorMessage) {
        let conn = &mut self.conns[p][a];
        if conn.up {
            conn.to_acc.push_back(encode_pa(&msg));
        }
    }

    /// Connection lost: in-flight messages are gone, the proposer forgets its view.
    fn drop_conn(&mut self, p: usize, a: usize, why: &str) {
        let conn = &mut self.conns[p][a];
        if !conn.up {
            return;
        }
        let dirty = conn.dirty;
        let in_flight = std::mem::take(&mut conn.to_acc);
        *conn = Conn::default();
        let acceptor_closed =
            why == "power loss" || why.starts_with("acceptor") || why.starts_with("flush");
        if !acceptor_closed && !in_flight.is_empty() && self.rng.random_bool(0.3) {
            self.zombies.push((p, a, in_flight));
        }
        self.proposers[p].views[a] = AccView::default();
        self.stats.drops += 1;
        self.log(|| format!("drop p{p}-a{a}: {why}"));
        // neon's WalAcceptor flushes on disconnect, unless the process is dying.
        if dirty && why != "power loss" && self.rng.random_bool(0.5) {
            let _ = self
                .sk_mut(a)
                .process_msg(&ProposerAcceptorMessage::FlushWAL);
        }
    }

    fn connect(&mut self, p: usize, a: usize) {
        self.drop_conn(p, a, "reconnect");
        self.conns[p][a].up = true;
        let greeting = ProposerGreeting {
            tenant_id: tenant(),
            timeline_id: timeline(),
            mconf: Configuration::default(),
            pg_version: 150000,
            system_id: SYSTEM_ID,
            wal_seg_size: B::SEG,
        };
        self.send(p, a, ProposerAcceptorMessage::Greeting(greeting));
    }

    // ----- acceptor side ------------------------------------------------------------------

    fn deliver_to_acceptor(&mut self, p: usize, a: usize) {
        let Some(frame) = self.conns[p][a].to_acc.pop_front() else {
            return;
        };
        let msg = ProposerAcceptorMessage::decode(&frame).expect("proposer frames decode");
        // The WAL receiver turns appends into no-flush appends and syncs when idle.
        let msg = match msg {
            ProposerAcceptorMessage::AppendRequest(r) if self.rng.random_bool(0.6) => {
                self.conns[p][a].dirty = true;
                ProposerAcceptorMessage::NoFlushAppendRequest(r)
            }
            m => m,
        };
        self.log(|| format!("p{p} -> a{a}: {}", describe_pa(&msg)));
        // Sometimes the power fails in the middle of handling the message, a few file-system
        // operations in: the acceptor never replies, and restarts from what was durable there.
        let crash_armed = B::CRASH_POINTS && self.rng.random_bool(self.fault_rate);
        if crash_armed {
            let ops = self.rng.random_range(0..8);
            self.backend.arm_crash(a, ops);
        }
        let result = self.sk_mut(a).process_msg(&msg);
        if crash_armed && self.backend.crash_point_reached(a) {
            self.stats.crash_points += 1;
            self.log(|| format!("a{a} loses power while handling that message"));
            if let ProposerAcceptorMessage::Elected(e) = &msg {
                // The truncation to the start point may have begun: WAL above it is
                // legitimately gone (the new term's proposer does not have it).
                let floor = self.acc_flush_revealed[a].min(e.start_streaming_at);
                self.acc_flush_revealed[a] = floor;
            }
            self.power_loss(a);
            return;
        }
        if matches!(msg, ProposerAcceptorMessage::Elected(_)) {
            // Elected may truncate: what was revealed above the new end is legitimately gone.
            let flush = self.sk(a).flush_lsn();
            self.acc_flush_revealed[a] = self.acc_flush_revealed[a].min(flush);
        }
        if let Ok(Some(reply)) = &result {
            self.note_revealed(a, reply);
        }
        match result {
            Ok(Some(reply)) => {
                self.log(|| format!("a{a} -> p{p}: {reply:?}"));
                self.conns[p][a].to_prop.push_back(encode_ap(&reply));
            }
            Ok(None) => {}
            Err(e) => {
                self.on_acceptor_error(a, &e);
                self.drop_conn(p, a, &format!("acceptor error: {e}"));
            }
        }
    }

    /// Safety errors fail the test; others close the connection (counted by kind).
    fn on_acceptor_error(&mut self, a: usize, e: &SafeKeeperError) {
        match e {
            SafeKeeperError::TruncateBelowCommit { .. }
            | SafeKeeperError::TermHistory(_)
            | SafeKeeperError::WalBelowCommit { .. } => {
                panic!("acceptor a{a} hit a safety error: {e}")
            }
            _ => {}
        }
        let kind = format!("{e:?}")
            .split([' ', '(', '{'])
            .next()
            .unwrap_or("")
            .to_string();
        *self.stats.acceptor_errors.entry(kind).or_default() += 1;
    }

    /// The acceptor reads one more message of a connection the proposer already dropped.
    fn deliver_zombie(&mut self, i: usize) {
        let (p, a) = (self.zombies[i].0, self.zombies[i].1);
        let Some(frame) = self.zombies[i].2.pop_front() else {
            self.zombies.swap_remove(i);
            return;
        };
        let msg = ProposerAcceptorMessage::decode(&frame).expect("proposer frames decode");
        let msg = match msg {
            ProposerAcceptorMessage::AppendRequest(r) if self.rng.random_bool(0.6) => {
                ProposerAcceptorMessage::NoFlushAppendRequest(r)
            }
            m => m,
        };
        self.log(|| format!("(stale) p{p} -> a{a}: {}", describe_pa(&msg)));
        let result = self.sk_mut(a).process_msg(&msg);
        if matches!(msg, ProposerAcceptorMessage::Elected(_)) {
            let flush = self.sk(a).flush_lsn();
            self.acc_flush_revealed[a] = self.acc_flush_revealed[a].min(flush);
        }
        self.stats.stale_delivered += 1;
        match result {
            Ok(_) => {
                if self.zombies[i].2.is_empty() {
                    self.zombies.swap_remove(i);
                }
            }
            Err(e) => {
                self.log(|| format!("(stale) a{a} closes p{p}'s old connection: {e}"));
                self.on_acceptor_error(a, &e);
                self.zombies.swap_remove(i);
            }
        }
    }

    /// A reply reveals only durable state: remember what it claimed.
    fn note_revealed(&mut self, a: usize, reply: &AcceptorProposerMessage) {
        let (flush, commit) = match reply {
            AcceptorProposerMessage::AppendResponse(r) => (r.flush_lsn, r.commit_lsn),
            AcceptorProposerMessage::VoteResponse(v) => (v.flush_lsn, Lsn(0)),
            AcceptorProposerMessage::Greeting(_) => return,
        };
        self.acc_flush_revealed[a] = self.acc_flush_revealed[a].max(flush);
        self.acc_commit_revealed[a] = self.acc_commit_revealed[a].max(commit);
    }

    fn idle_flush(&mut self, p: usize, a: usize) {
        if !self.conns[p][a].up || !self.conns[p][a].dirty {
            return;
        }
        self.conns[p][a].dirty = false;
        match self
            .sk_mut(a)
            .process_msg(&ProposerAcceptorMessage::FlushWAL)
        {
            Ok(Some(reply)) => self.conns[p][a].to_prop.push_back(encode_ap(&reply)),
            Ok(None) => unreachable!("FlushWAL always answers"),
            Err(e) => self.drop_conn(p, a, &format!("flush error: {e}")),
        }
    }

    fn power_loss(&mut self, a: usize) {
        for p in 0..N_PROP {
            self.drop_conn(p, a, "power loss");
        }
        self.zombies.retain(|(_, za, _)| *za != a);
        let sk = self.acceptors[a].take().expect("acceptor present");
        let (sk, what) = self.backend.power_loss(a, sk, &mut self.rng);
        self.stats.power_losses += 1;
        self.log(|| {
            format!(
                "power loss a{a} ({what}): flush {} commit {}",
                sk.flush_lsn(),
                sk.commit_lsn()
            )
        });
        self.acceptors[a] = Some(sk);
    }

    // ----- proposer side ------------------------------------------------------------------

    fn start_campaign(&mut self, p: usize) {
        self.proposers[p].phase = Phase::Greeting;
        self.proposers[p].views = vec![AccView::default(); N_ACC];
        self.log(|| format!("p{p} starts a campaign"));
        for a in 0..N_ACC {
            self.connect(p, a);
        }
    }

    /// Superseded by a higher term (or crashed): disconnect and wait.
    fn step_down(&mut self, p: usize, why: &str) {
        self.log(|| format!("p{p} steps down: {why}"));
        self.proposers[p].phase = Phase::Idle;
        for a in 0..N_ACC {
            self.drop_conn(p, a, "proposer stepped down");
        }
    }

    fn crash_proposer(&mut self, p: usize) {
        self.step_down(p, "crash");
        let inc = self.proposers[p].incarnation + 1;
        self.proposers[p] = Proposer::new(B::START);
        self.proposers[p].incarnation = inc;
    }

    fn deliver_to_proposer(&mut self, p: usize, a: usize) {
        let Some(frame) = self.conns[p][a].to_prop.pop_front() else {
            return;
        };
        let msg = AcceptorProposerMessage::decode(&frame).expect("acceptor frames decode");
        match msg {
            AcceptorProposerMessage::Greeting(g) => self.on_greeting(p, a, g),
            AcceptorProposerMessage::VoteResponse(v) => self.on_vote(p, a, v),
            AcceptorProposerMessage::AppendResponse(r) => {
                let prop = &mut self.proposers[p];
                if r.term > prop.term {
                    self.step_down(p, &format!("a{a} is in term {}", r.term));
                    return;
                }
                if prop.phase != Phase::Elected || !prop.views[a].elected_sent {
                    return;
                }
                prop.views[a].flush_lsn = prop.views[a].flush_lsn.max(r.flush_lsn);
                self.update_commit(p);
            }
        }
    }

    fn on_greeting(&mut self, p: usize, a: usize, g: AcceptorGreeting) {
        let prop = &mut self.proposers[p];
        prop.views[a].greeting = Some(g);
        match prop.phase {
            Phase::Idle => {}
            Phase::Greeting => {
                if prop.greetings() >= QUORUM {
                    let max = prop
                        .views
                        .iter()
                        .filter_map(|v| v.greeting.as_ref().map(|g| g.term))
                        .max()
                        .expect("a quorum of greetings");
                    prop.term = Term(max.0.max(prop.term.0) + 1);
                    prop.phase = Phase::Voting;
                    let term = prop.term;
                    self.log(|| format!("p{p} campaigns for term {term}"));
                    for a in 0..N_ACC {
                        if self.proposers[p].views[a].greeting.is_some() {
                            self.send_vote_request(p, a);
                        }
                    }
                }
            }
            Phase::Voting | Phase::Elected => self.send_vote_request(p, a),
        }
    }

    fn send_vote_request(&mut self, p: usize, a: usize) {
        let term = self.proposers[p].term;
        self.send(
            p,
            a,
            ProposerAcceptorMessage::VoteRequest(VoteRequest {
                generation: Generation(0),
                term,
            }),
        );
    }

    fn on_vote(&mut self, p: usize, a: usize, v: VoteResponse) {
        let prop = &mut self.proposers[p];
        if v.term > prop.term {
            self.step_down(p, &format!("a{a} refused: it is in term {}", v.term));
            return;
        }
        prop.views[a].vote = Some(v);
        match prop.phase {
            Phase::Voting => {
                let votes = prop
                    .views
                    .iter()
                    .filter(|w| w.vote.as_ref().is_some_and(|v| v.vote_given))
                    .count();
                if votes >= QUORUM {
                    self.become_elected(p);
                }
            }
            Phase::Elected => self.send_elected(p, a),
            Phase::Idle | Phase::Greeting => {}
        }
    }

    fn become_elected(&mut self, p: usize) {
        let prop = &self.proposers[p];
        let term = prop.term;
        // Donor: the voter with the highest (last_log_term, flush_lsn).
        let (donor, dv) = prop
            .views
            .iter()
            .enumerate()
            .filter_map(|(a, w)| w.vote.as_ref().filter(|v| v.vote_given).map(|v| (a, v)))
            .max_by_key(|(_, v)| (v.term_history.last_log_term(), v.flush_lsn))
            .expect("a quorum of votes");
        let dv = dv.clone();
        let truncate_lsn = prop
            .views
            .iter()
            .filter_map(|w| w.vote.as_ref().map(|v| v.truncate_lsn))
            .max()
            .unwrap_or(Lsn(0));
        // Fetch the donor's WAL up to its reported flush (recovery with a term check: the
        // donor's WAL must still be what it voted with).
        let d = self.sk(donor);
        if d.term() != term || d.get_term_history().up_to(dv.flush_lsn) != dv.term_history {
            self.step_down(p, &format!("donor a{donor} changed before recovery"));
            return;
        }
        let log = if dv.flush_lsn > B::START {
            match B::read(d, B::START, dv.flush_lsn) {
                Some(bytes) => bytes,
                None => {
                    self.step_down(p, &format!("donor a{donor} lost WAL before recovery"));
                    return;
                }
            }
        } else {
            Vec::new()
        };
        let term_start = Lsn(B::START.0 + log.len() as u64);
        let mut history = dv.term_history.clone();
        history.0.push(TermLsn {
            term,
            lsn: term_start,
        });
        history.validate().expect("proposer history is ordered");

        let incarnation = self.proposers[p].incarnation;
        if let Some(&(q, inc)) = self.elected.get(&term) {
            panic!("election safety: term {term} elected p{q}#{inc} and now p{p}#{incarnation}");
        }
        self.elected.insert(term, (p, incarnation));
        self.stats.elections += 1;
        self.log(|| format!("p{p} elected in term {term}, donor a{donor}, start {term_start}"));

        // Continue the donor's xl_prev chain; stamp this term's records with the term.
        let rec = records(&log, B::START, B::SEG, &format!("donor a{donor}"));
        let mut wal_gen = WalGenerator::new(SYSTEM_ID, B::SEG as u64, term_start)
            .expect("a record end is a record boundary")
            .with_prev(rec.last().map_or(Lsn(0), |r| r.0));
        wal_gen.set_xid(u32::try_from(term.0).expect("model terms stay small"));
        let prop = &mut self.proposers[p];
        prop.phase = Phase::Elected;
        prop.history = history;
        prop.term_start = term_start;
        prop.log = log;
        prop.rec_ends = rec.iter().map(|r| r.1).collect();
        prop.wal_gen = Some(wal_gen);
        prop.commit = Lsn(0);
        prop.truncate_lsn = truncate_lsn;
        for v in prop.views.iter_mut() {
            v.flush_lsn = Lsn(0);
        }
        // Leader completeness (Raft): the log of term T's leader holds everything committed in
        // terms below T. Commits of later terms need not be there: this leader is stale and
        // cannot commit, since a quorum has moved past its term.
        let required = self
            .commit_by_term
            .range(..term)
            .map(|(_, &lsn)| lsn)
            .max()
            .unwrap_or(Lsn(0));
        let required_len = (required.0.saturating_sub(B::START.0)) as usize;
        let log = &self.proposers[p].log;
        assert!(
            log.len() >= required_len,
            "elected proposer p{p} in term {term} lacks WAL committed in earlier terms: log ends \
             at {}, committed up to {required}",
            self.proposers[p].log_end(),
        );
        assert_eq!(
            log[..required_len],
            self.committed[..required_len],
            "elected proposer p{p} in term {term} disagrees with WAL committed in earlier terms"
        );
        for a in 0..N_ACC {
            if self.proposers[p].views[a].vote.is_some() {
                self.send_elected(p, a);
            }
        }
    }

    fn send_elected(&mut self, p: usize, a: usize) {
        let prop = &self.proposers[p];
        let Some(v) = prop.views[a].vote.as_ref() else {
            return;
        };
        let start =
            TermHistory::find_highest_common_point(&prop.history, &v.term_history, v.flush_lsn)
                .expect("histories of one cluster are consistent")
                .map(|tl| tl.lsn)
                .unwrap_or(prop.history.0[0].lsn);
        assert!(
            start >= B::START && start <= prop.log_end(),
            "start_streaming_at {start} outside the proposer's log"
        );
        let msg = ProposerElected {
            generation: Generation(0),
            term: prop.term,
            start_streaming_at: start,
            term_history: prop.history.clone(),
        };
        self.send(p, a, ProposerAcceptorMessage::Elected(msg));
        let prop = &mut self.proposers[p];
        prop.views[a].elected_sent = true;
        prop.views[a].next_lsn = start;
        self.stream(p, a);
    }

    /// Sends everything from the acceptor's next LSN to the end of the log (may be empty: a
    /// heartbeat carrying the commit LSN), in appends of at most `MAX_SEND_SIZE` bytes cut at
    /// record boundaries (the in-memory WAL fake needs whole records).
    fn stream(&mut self, p: usize, a: usize) {
        loop {
            let prop = &self.proposers[p];
            let view = &prop.views[a];
            if !view.elected_sent || !self.conns[p][a].up {
                return;
            }
            let begin = view.next_lsn;
            let limit = Lsn(begin.0 + sk_core::protocol::MAX_SEND_SIZE as u64);
            let end = if prop.log_end() <= limit {
                prop.log_end()
            } else {
                let i = prop.rec_ends.partition_point(|&e| e <= limit);
                assert!(
                    i > 0 && prop.rec_ends[i - 1] > begin,
                    "a record larger than an append"
                );
                prop.rec_ends[i - 1]
            };
            self.send_append(p, a, begin, end);
            if end == self.proposers[p].log_end() {
                return;
            }
        }
    }

    fn send_append(&mut self, p: usize, a: usize, begin: Lsn, end: Lsn) {
        let prop = &self.proposers[p];
        let data = Bytes::copy_from_slice(
            &prop.log[(begin.0 - B::START.0) as usize..(end.0 - B::START.0) as usize],
        );
        let msg = AppendRequest {
            h: AppendRequestHeader {
                generation: Generation(0),
                term: prop.term,
                begin_lsn: begin,
                end_lsn: end,
                commit_lsn: prop.commit,
                truncate_lsn: prop.truncate_lsn,
            },
            wal_data: data,
        };
        self.proposers[p].views[a].next_lsn = end;
        self.send(p, a, ProposerAcceptorMessage::AppendRequest(msg));
    }

    fn append_record(&mut self, p: usize) {
        let len = B::message_len(&mut self.rng);
        let mut message = vec![p as u8; len];
        self.rng.fill(&mut message[..]);
        let prop = &mut self.proposers[p];
        let wal_gen = prop
            .wal_gen
            .as_mut()
            .expect("an elected proposer generates WAL");
        let pos = wal_gen.append_logical_message(&mut prop.log, &message);
        assert_eq!(pos.end, prop.log_end(), "generator and log agree");
        prop.rec_ends.push(pos.end);
        for a in 0..N_ACC {
            self.stream(p, a);
        }
    }

    /// Commit rule: ascending flush LSNs (values below the term start count as nothing), the
    /// element at index `n - quorum`.
    fn update_commit(&mut self, p: usize) {
        let prop = &mut self.proposers[p];
        let mut flushes: Vec<Lsn> = prop
            .views
            .iter()
            .map(|v| {
                if v.flush_lsn >= prop.term_start {
                    v.flush_lsn
                } else {
                    Lsn(0)
                }
            })
            .collect();
        flushes.sort();
        let candidate = flushes[N_ACC - QUORUM];
        if candidate <= prop.commit {
            return;
        }
        assert!(candidate <= prop.log_end(), "acceptor flushed past our log");
        prop.commit = candidate;
        // Known flush LSNs below the commit bound what peers may still need.
        prop.truncate_lsn = prop
            .truncate_lsn
            .max(flushes[0].min(candidate))
            .min(candidate);
        let upto = (candidate.0 - B::START.0) as usize;
        let term = prop.term;
        let by_term = self.commit_by_term.entry(term).or_default();
        *by_term = (*by_term).max(candidate);
        self.stats.commits_observed += 1;
        self.log(|| format!("p{p} (term {term}) commits {candidate}"));
        let log = &self.proposers[p].log;
        let common = upto.min(self.committed.len());
        assert_eq!(
            log[..common],
            self.committed[..common],
            "p{p} committed bytes that disagree with earlier committed WAL"
        );
        if upto > self.committed.len() {
            self.committed = log[..upto].to_vec();
        }
    }

    // ----- invariants ---------------------------------------------------------------------

    fn check(&mut self) {
        let committed_end = Lsn(B::START.0 + self.committed.len() as u64);
        let mut holders = 0;
        for a in 0..N_ACC {
            let sk = self.acceptors[a]
                .as_ref()
                .expect("acceptor present between steps");
            let term = sk.term();
            let hist = sk.get_term_history();
            let flush = sk.flush_lsn();
            let commit = sk.commit_lsn();
            let persisted_commit = sk.persisted_commit_lsn();
            assert!(term >= self.acc_term_seen[a], "a{a}: term went back");
            assert!(
                persisted_commit >= self.acc_commit_seen[a],
                "a{a}: persisted commit went back"
            );
            assert!(
                flush >= self.acc_flush_revealed[a],
                "a{a}: flush {flush} below the {} a reply revealed",
                self.acc_flush_revealed[a]
            );
            assert!(
                persisted_commit >= self.acc_commit_revealed[a],
                "a{a}: persisted commit {persisted_commit} below the {} a reply revealed",
                self.acc_commit_revealed[a]
            );
            self.acc_term_seen[a] = term;
            self.acc_commit_seen[a] = persisted_commit;
            hist.validate()
                .unwrap_or_else(|e| panic!("a{a}: history {hist:?}: {e}"));
            assert!(hist.last_log_term() <= term, "a{a}: log term above term");
            assert!(commit >= persisted_commit);
            assert!(commit <= flush, "a{a}: commit {commit} above flush {flush}");
            assert!(
                commit <= committed_end || !commit.is_valid(),
                "a{a}: commit {commit} beyond anything a proposer committed ({committed_end})"
            );

            // Log monotonicity: the durable WAL decodes to its end, and its records carry
            // non-decreasing terms, each the term its history says wrote that LSN.
            let durable = if flush > B::START {
                B::read(sk, B::START, flush)
                    .unwrap_or_else(|| panic!("a{a}: durable WAL [{}, {flush}) not held", B::START))
            } else {
                Vec::new()
            };
            self.check_log_terms(a, &durable);

            // Log safety against everything committed.
            let upto = (commit.0.saturating_sub(B::START.0)) as usize;
            assert_eq!(
                durable[..upto],
                self.committed[..upto],
                "a{a}: committed bytes differ from the committed WAL"
            );
            if durable.len() >= self.committed.len()
                && durable[..self.committed.len()] == self.committed[..]
            {
                holders += 1;
            }
        }
        // Pairwise log safety.
        for a in 0..N_ACC {
            for b in a + 1..N_ACC {
                let c = self.sk(a).commit_lsn().min(self.sk(b).commit_lsn());
                if c > B::START {
                    assert_eq!(
                        B::read(self.sk(a), B::START, c),
                        B::read(self.sk(b), B::START, c),
                        "a{a} and a{b} disagree below their commit {c}"
                    );
                }
            }
        }
        assert!(
            holders >= QUORUM,
            "committed WAL up to {committed_end} is durable on only {holders} acceptors"
        );
    }

    /// Checks the terms of the records of acceptor `a`'s durable WAL against its history,
    /// decoding only what was not checked before (the check runs after every step).
    fn check_log_terms(&mut self, a: usize, durable: &[u8]) {
        let hist = self.sk(a).get_term_history();
        let cached = self.log_check[a]
            .take()
            .filter(|c| c.hist == hist && durable.starts_with(&c.bytes));
        let mut c = cached.unwrap_or_else(|| LogCheck {
            bytes: Vec::new(),
            hist: hist.clone(),
            walker: RecordWalker::new(B::START, B::SEG),
            last_term: Term(0),
        });
        let from = c.bytes.len();
        for (lsn, _end) in c
            .walker
            .feed(&durable[from..], &format!("a{a}'s durable WAL"))
        {
            let rec_term = record_term(durable, B::START, lsn);
            let by_history = hist.0.iter().rev().find(|e| e.lsn <= lsn).map(|e| e.term);
            assert_eq!(
                by_history,
                Some(rec_term),
                "a{a}: record at {lsn} has term {rec_term}, history {hist:?}"
            );
            assert!(rec_term >= c.last_term, "a{a}: log terms decrease at {lsn}");
            c.last_term = rec_term;
        }
        c.bytes.extend_from_slice(&durable[from..]);
        self.log_check[a] = Some(c);
    }

    // ----- the schedule -------------------------------------------------------------------

    fn step(&mut self) {
        let p = self.rng.random_range(0..N_PROP);
        let a = self.rng.random_range(0..N_ACC);
        if self.rng.random_bool(self.fault_rate) {
            match self.rng.random_range(0..100) {
                0..=49 => self.drop_conn(p, a, "network"),
                50..=74 => self.power_loss(a),
                75..=89 => {
                    // A proposer stuck in a campaign (e.g. it lost the vote race) gives up.
                    if matches!(self.proposers[p].phase, Phase::Greeting | Phase::Voting) {
                        self.step_down(p, "campaign timeout");
                    }
                }
                _ => self.crash_proposer(p),
            }
            return;
        }
        match self.rng.random_range(0..100) {
            0..=54 => self.deliver_random(),
            55..=71 => {
                if self.proposers[p].phase == Phase::Elected {
                    self.append_record(p);
                } else {
                    self.deliver_random();
                }
            }
            72..=76 => {
                if self.proposers[p].phase == Phase::Elected {
                    for a in 0..N_ACC {
                        self.stream(p, a);
                    }
                }
            }
            77..=87 => self.idle_flush(p, a),
            88..=89 => {
                let force = self.rng.random_bool(0.5);
                let _ = self.sk_mut(a).maybe_persist_inmem(force);
            }
            _ => {
                if self.proposers[p].phase == Phase::Idle {
                    // The other proposer may be fine: compete only sometimes.
                    if self.rng.random_bool(0.3) {
                        self.start_campaign(p);
                    }
                } else if !self.conns[p][a].up {
                    self.connect(p, a);
                }
            }
        }
    }

    fn deliver_random(&mut self) {
        let mut queues = Vec::new();
        for p in 0..N_PROP {
            for a in 0..N_ACC {
                if !self.conns[p][a].to_acc.is_empty() {
                    queues.push((p, a, true));
                }
                if !self.conns[p][a].to_prop.is_empty() {
                    queues.push((p, a, false));
                }
            }
        }
        let n = queues.len() + self.zombies.len();
        if n == 0 {
            return;
        }
        let pick = self.rng.random_range(0..n);
        if pick >= queues.len() {
            self.deliver_zombie(pick - queues.len());
            return;
        }
        let (p, a, to_acc) = queues[pick];
        if to_acc {
            self.deliver_to_acceptor(p, a);
        } else {
            self.deliver_to_proposer(p, a);
        }
    }
}

fn describe_pa(msg: &ProposerAcceptorMessage) -> String {
    match msg {
        ProposerAcceptorMessage::AppendRequest(r)
        | ProposerAcceptorMessage::NoFlushAppendRequest(r) => {
            format!(
                "{} term {} [{}, {}) commit {}",
                if matches!(msg, ProposerAcceptorMessage::AppendRequest(_)) {
                    "append"
                } else {
                    "append(noflush)"
                },
                r.h.term,
                r.h.begin_lsn,
                r.h.end_lsn,
                r.h.commit_lsn
            )
        }
        other => format!("{other:?}"),
    }
}

/// Runs one seed; returns its stats. Panics (with the seed) on an invariant violation.
fn run_seed<B: Backend>(seed: u64, steps: usize, trace: bool) -> Stats {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut c = Cluster::<B>::new(seed, trace);
        for _ in 0..steps {
            c.step();
            c.check();
        }
        c.stats.committed_bytes = c.committed.len() as u64;
        c.stats.backend = c.backend.counters().into_iter().collect();
        c.stats
    }));
    match result {
        Ok(stats) => stats,
        Err(e) => {
            eprintln!(
                "model test ({backend}) failed for seed {seed} ({steps} steps); replay with \
                 MODEL_BACKEND={backend} MODEL_SEED={seed} MODEL_STEPS={steps} MODEL_TRACE=1 \
                 cargo test -p walproposer --test model model_replay_one_seed -- --nocapture",
                backend = B::NAME,
            );
            std::panic::resume_unwind(e)
        }
    }
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

#[test]
fn model_random_schedules_keep_consensus_invariants() {
    run_many::<Mem>(3000, STEPS);
}

/// Fewer, much longer schedules: many elections and power losses within one history.
#[test]
fn model_long_schedules_keep_consensus_invariants() {
    run_many::<Mem>(20, LONG_STEPS);
}

/// The real file stores on a file system that forgets un-synced data *and* un-synced directory
/// entries on power loss (durability promise 1: an acknowledged flush LSN, vote or commit is on
/// disk; promise 2: nothing acknowledged is lost).
#[test]
fn model_file_stores_on_simulated_fs_survive_power_loss() {
    run_many::<SimFsBackend>(400, STEPS);
}

#[test]
fn model_file_stores_long_schedules_survive_power_loss() {
    run_many::<SimFsBackend>(6, LONG_STEPS);
}

fn run_many<B: Backend>(default_seeds: u64, default_steps: usize) {
    let seeds = env_u64("MODEL_SEEDS").unwrap_or(default_seeds);
    let first = env_u64("MODEL_SEED_START").unwrap_or(0);
    let steps = env_u64("MODEL_STEPS").map_or(default_steps, |s| s as usize);
    let mut total = Stats::default();
    let mut seeds_with_commits = 0;
    for seed in first..first + seeds {
        let s = run_seed::<B>(seed, steps, false);
        if s.commits_observed > 0 {
            seeds_with_commits += 1;
        }
        total.elections += s.elections;
        total.commits_observed += s.commits_observed;
        total.power_losses += s.power_losses;
        total.crash_points += s.crash_points;
        total.drops += s.drops;
        total.committed_bytes += s.committed_bytes;
        total.stale_delivered += s.stale_delivered;
        for (k, v) in s.acceptor_errors {
            *total.acceptor_errors.entry(k).or_default() += v;
        }
        for (k, v) in s.backend {
            *total.backend.entry(k).or_default() += v;
        }
    }
    eprintln!(
        "model ({}): {seeds} seeds x {steps} steps, {seeds_with_commits} seeds committed: {total:?}",
        B::NAME
    );
    // The schedule must exercise the protocol, not idle: most seeds elect and commit.
    assert!(
        seeds_with_commits * 2 >= seeds,
        "only {seeds_with_commits} of {seeds} seeds committed anything"
    );
    assert!(total.power_losses > 0 && total.elections > seeds);
}

#[test]
fn model_replay_one_seed() {
    let Some(seed) = env_u64("MODEL_SEED") else {
        eprintln!("set MODEL_SEED=<seed> to replay one schedule (MODEL_TRACE=1 prints it)");
        return;
    };
    let trace = std::env::var("MODEL_TRACE").is_ok_and(|v| v != "0");
    let steps = env_u64("MODEL_STEPS").map_or(STEPS, |s| s as usize);
    let stats = match std::env::var("MODEL_BACKEND").as_deref() {
        Ok("simfs") => run_seed::<SimFsBackend>(seed, steps, trace),
        Ok("mem") | Err(_) => run_seed::<Mem>(seed, steps, trace),
        Ok(other) => panic!("MODEL_BACKEND={other}: expected mem or simfs"),
    };
    eprintln!("seed {seed}: {stats:?}");
}
