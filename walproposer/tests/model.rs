//! Seeded model test of the consensus: a deterministic cluster of 3 acceptors (the real
//! `SafeKeeper`) and 2 competing, restarting proposers (the real sans-IO proposer core,
//! `proposer::consensus::ProposerCore`, the same code the walproposer runs; the harness plays
//! its driver: connections, fetches, timeouts). Schedules interleave messages at random and
//! inject connection drops (also right after an acceptor processed `elected`, before any
//! append), duplicated and reordered replies, failed fetches, acceptor power losses (everything
//! un-synced lost, the acceptor rebuilt from durable state only), proposer crashes and campaign
//! timeouts, and stale connections (an acceptor still reading messages a proposer sent on a
//! connection it has already given up on). Readers on each acceptor follow its committed WAL,
//! stall and resume, and report back on every acknowledgement; on a third of the seeds the
//! proposers hold their writer back by them (`max_replication_*_lag`), and the harness, like
//! the driver, pushes nothing while the core says paused. Every message goes through the real codec, and the
//! WAL is real PostgreSQL WAL from the generator, each record stamped with its term in
//! `xl_xid`.
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
//! identical on a quorum's durable WAL). Commit safety is judged from what each proposer
//! *announces* (`Action::Commit`: what its commit LSN, the `--ack-log` and a relayed primary's
//! flush feedback are made of): no two different bytes are ever announced committed at the same
//! LSN, and an elected proposer's WAL holds everything committed in earlier terms. The core's
//! view of the readers is checked too: its hot-standby feedback and its backpressure (off,
//! slowed, paused) are those of the acknowledgements it took on its open connections.
//!
//! Knobs: `MODEL_SEEDS=n` runs `n` seeds per test (defaults: `Mem` 3000 of 400 steps and 20 of
//! 3000 steps; `SimFs` 400 of 400 steps and 6 of 3000 steps) from `MODEL_SEED_START` (default
//! 0), `MODEL_STEPS` sets the steps; `MODEL_SEED=s` replays one seed (test
//! `model_replay_one_seed`, backend `MODEL_BACKEND=mem|simfs`, default mem) and `MODEL_TRACE=1`
//! prints its events. A failure prints its seed and the command that replays it.

use std::collections::{BTreeMap, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use pg_wal::format::page_header_size;
use pg_wal::{WalGenerator, WalStreamDecoder};
use safekeeper::control_file::FileControlStore;
use safekeeper::wal_store::prepare::{Background, Inline};
use safekeeper::wal_store::{WalFileOptions, WalFileStore};
use sk_core::protocol::{
    AcceptorProposerMessage, HotStandbyFeedback, PageserverFeedback, ProposerAcceptorMessage,
};
use sk_core::safekeeper::{SafeKeeper, SafeKeeperError};
use sk_core::state::{Configuration, SafekeeperId, ServerInfo, TimelinePersistentState};
use sk_core::storage::fs::{FileSystem, Fs, SimFs};
use sk_core::storage::mem::{MemControlStore, MemWalStore};
use sk_core::storage::{ControlStore, WalStore};
use sk_core::types::{
    Generation, Lsn, NodeId, TenantId, TenantTimelineId, Term, TermHistory, TimelineId,
};
use walproposer::consensus::{
    Action, Backpressure, ConnId, CoreConfig, Event, Phase, ProposerCore,
};

const N_ACC: usize = 5;
const N_PROP: usize = 2;
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
    /// Backpressure limits are multiples of this: a few records' worth.
    const LAG_LIMIT_UNIT: u64;
    /// Where the timeline's WAL begins (a page boundary).
    const START: Lsn;

    fn new(rng: &mut SmallRng) -> Self;
    /// A fresh acceptor with an empty timeline.
    fn new_acceptor(&mut self, a: usize) -> Sk<Self>;
    /// Loses everything `sk`'s storage has not made durable and rebuilds the acceptor from
    /// what is left; returns it and a description of what was lost.
    fn power_loss(&mut self, a: usize, sk: Sk<Self>, rng: &mut SmallRng) -> (Sk<Self>, String);
    /// The acceptor's process dies (`kill -9`, the abort after a failed fsync) and restarts on
    /// the same machine: the page cache survives, so un-synced writes are still there (and still
    /// un-synced, for a later power loss), and start-up recovery must make what it reads
    /// durable before revealing it.
    fn process_crash(&mut self, a: usize, sk: Sk<Self>) -> Sk<Self>;
    /// Time passes (the clock of background segment preparation).
    fn advance_clock(&mut self, _rng: &mut SmallRng) {}
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
    const LAG_LIMIT_UNIT: u64 = 512;

    fn new(_rng: &mut SmallRng) -> Mem {
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

    fn process_crash(&mut self, a: usize, sk: Sk<Mem>) -> Sk<Mem> {
        // The fake has no page cache: a restart that reads every written byte and makes it
        // durable (as the file store's start-up sync does) keeps all un-synced writes.
        let (ctrl, mut wal) = sk.into_storage();
        let all = wal.unsynced_write_count();
        wal.power_loss_keeping(all);
        SafeKeeper::new(NodeId(a as u64 + 1), ctrl, wal)
            .unwrap_or_else(|e| panic!("acceptor a{a} cannot restart after a crash: {e}"))
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
    /// Per acceptor: the clock of its background segment preparation, which runs inline (so a
    /// crash point can land inside it) and is moved by the schedule.
    clocks: Vec<Arc<Inline>>,
    /// `prepare_below_rate` of the stores: half the seeds prepare segments in the background.
    prepare_below_rate: u64,
    /// Un-synced operations power losses forgot: file writes/size changes, directory entries.
    file_ops_lost: u64,
    dir_ops_lost: u64,
}

fn timeline_dir() -> PathBuf {
    PathBuf::from("/sk/tenant/timeline")
}

fn open_file_stores(
    fs: &Arc<SimFs>,
    a: usize,
    clock: &Arc<Inline>,
    prepare_below_rate: u64,
) -> Result<Sk<SimFsBackend>, String> {
    let dir = timeline_dir();
    let ctrl = FileControlStore::load_in(Fs::sim(fs.clone()), &dir, false)
        .map_err(|e| format!("loading the control file: {e}"))?;
    let opts = WalFileOptions {
        system_id: SYSTEM_ID,
        wal_start_lsn: ctrl.local_start_lsn,
        fs: Fs::sim(fs.clone()),
        prepare_below_rate,
        background: Background::new(clock.clone()),
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
    const LAG_LIMIT_UNIT: u64 = 16 << 10;

    fn new(rng: &mut SmallRng) -> SimFsBackend {
        SimFsBackend {
            fs: (0..N_ACC).map(|_| SimFs::new()).collect(),
            clocks: (0..N_ACC).map(|_| Inline::new()).collect(),
            prepare_below_rate: if rng.random_bool(0.5) { 64 << 20 } else { 0 },
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
        open_file_stores(fs, a, &self.clocks[a], self.prepare_below_rate)
            .expect("a fresh timeline starts")
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
        let sk = open_file_stores(&self.fs[a], a, &self.clocks[a], self.prepare_below_rate)
            .unwrap_or_else(|e| panic!("acceptor a{a} cannot restart after power loss: {e}"));
        (sk, format!("{report:?}"))
    }

    fn process_crash(&mut self, a: usize, sk: Sk<SimFsBackend>) -> Sk<SimFsBackend> {
        drop(sk.into_storage());
        self.fs[a].process_crash();
        open_file_stores(&self.fs[a], a, &self.clocks[a], self.prepare_below_rate)
            .unwrap_or_else(|e| panic!("acceptor a{a} cannot restart after a crash: {e}"))
    }

    fn advance_clock(&mut self, rng: &mut SmallRng) {
        for c in &self.clocks {
            c.advance(Duration::from_millis(rng.random_range(0..20)));
        }
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
            (
                "seeds_preparing_segments",
                u64::from(self.prepare_below_rate > 0),
            ),
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
            decoder: WalStreamDecoder::new(wal_start, seg as u64, pg_wal::PgMajor::V15),
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

/// Length of the longest common prefix of `a` and `b` (memcmp per 4 KiB block: this runs after
/// every step over the whole WAL).
fn common_prefix(a: &[u8], b: &[u8]) -> usize {
    let n = a.len().min(b.len());
    let mut i = 0;
    while i < n {
        let end = (i + 4096).min(n);
        if a[i..end] != b[i..end] {
            return i + a[i..end]
                .iter()
                .zip(&b[i..end])
                .take_while(|(x, y)| x == y)
                .count();
        }
        i = end;
    }
    n
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
    /// The core's id of this connection (a new one per connection).
    id: ConnId,
    to_acc: VecDeque<Bytes>,
    to_prop: VecDeque<Bytes>,
    /// Acceptor side: no-flush appends processed since the last FlushWAL (neon's `dirty`).
    dirty: bool,
}

/// A proposer process: the real [`ProposerCore`] and what the harness knows about its WAL.
struct ModelProposer {
    /// Bumped on every restart; (id, incarnation) identifies who was elected.
    incarnation: u64,
    /// `None` while the process is down or idle.
    core: Option<ProposerCore>,
    /// The proposer's WAL `[B::START, B::START + log.len())`, known from the moment the core
    /// chose its donor: the donor's WAL as its granted vote described it, then what was pushed.
    /// Every commit the core announces is judged against these bytes.
    log: Option<Vec<u8>>,
    /// End of every record of `log`, ascending.
    rec_ends: Vec<Lsn>,
    /// Generates this term's records, continuing the `xl_prev` chain of `log`.
    wal_gen: Option<WalGenerator>,
    /// Highest commit LSN the core announced.
    commit: Lsn,
    /// The last push was held back by backpressure.
    paused: bool,
}

impl ModelProposer {
    fn new() -> ModelProposer {
        ModelProposer {
            incarnation: 0,
            core: None,
            log: None,
            rec_ends: Vec::new(),
            wal_gen: None,
            commit: Lsn(0),
            paused: false,
        }
    }

    fn phase(&self) -> Option<Phase> {
        self.core.as_ref().map(|c| c.phase())
    }
}

/// A reader of an acceptor's committed WAL (a `pg_receivewal` or a standby, every one required
/// for backpressure): what it reports back rides on the acceptor's acknowledgements, as the
/// safekeeper's `Timeline::process_msg` puts it there.
#[derive(Clone, Copy, Debug)]
struct ModelReader {
    /// Written, flushed and applied positions; none ever moves back.
    pos: [Lsn; 3],
    /// The snapshot it holds (0: none).
    xmin: u64,
    /// A stalled reader reports but does not move (a paused standby, a slow disk).
    stalled: bool,
}

/// What an acknowledgement told a proposer about `a`'s readers, as the harness computed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ReportedFeedback {
    hs: HotStandbyFeedback,
    /// Least written, flushed and applied positions over the readers, each its own minimum.
    least: Option<[Lsn; 3]>,
}

/// Each position's own minimum of two (written, flushed, applied) triples.
fn least_of(x: [Lsn; 3], y: [Lsn; 3]) -> [Lsn; 3] {
    [x[0].min(y[0]), x[1].min(y[1]), x[2].min(y[2])]
}

/// A fetch the core asked for, answered by a later step (or failed).
struct PendingFetch {
    id: u64,
    p: usize,
    incarnation: u64,
    sk: usize,
    term: Term,
    from: Lsn,
    to: Lsn,
}

#[derive(Default, Debug)]
struct Stats {
    elections: u64,
    commits_observed: u64,
    power_losses: u64,
    /// Power losses or process crashes in the middle of a storage call.
    crash_points: u64,
    /// Process crashes (the page cache survives), and power losses that came later.
    process_crashes: u64,
    power_losses_after_process_crash: u64,
    drops: u64,
    /// Connections dropped right after the acceptor processed `elected`.
    drops_after_elected: u64,
    /// Replies duplicated or reordered on a connection.
    replies_duplicated: u64,
    replies_reordered: u64,
    fetches: u64,
    fetch_failures: u64,
    committed_bytes: u64,
    stale_delivered: u64,
    /// Configurations the operator switched to (joint and final), and re-elections the
    /// proposers started on learning one.
    membership_switches: u64,
    reconfigurations: u64,
    /// Pushes the backpressure held back (the slowest reader at a limit), and pushes that went
    /// through after one on the same proposer (it released).
    backpressure_pauses: u64,
    backpressure_releases: u64,
    acceptor_errors: BTreeMap<String, u64>,
    closes: BTreeMap<String, u64>,
    backend: BTreeMap<&'static str, u64>,
}

impl Stats {
    fn add(&mut self, s: Stats) {
        self.elections += s.elections;
        self.commits_observed += s.commits_observed;
        self.power_losses += s.power_losses;
        self.crash_points += s.crash_points;
        self.process_crashes += s.process_crashes;
        self.power_losses_after_process_crash += s.power_losses_after_process_crash;
        self.drops += s.drops;
        self.drops_after_elected += s.drops_after_elected;
        self.replies_duplicated += s.replies_duplicated;
        self.replies_reordered += s.replies_reordered;
        self.fetches += s.fetches;
        self.fetch_failures += s.fetch_failures;
        self.committed_bytes += s.committed_bytes;
        self.stale_delivered += s.stale_delivered;
        self.membership_switches += s.membership_switches;
        self.reconfigurations += s.reconfigurations;
        self.backpressure_pauses += s.backpressure_pauses;
        self.backpressure_releases += s.backpressure_releases;
        for (k, v) in s.acceptor_errors {
            *self.acceptor_errors.entry(k).or_default() += v;
        }
        for (k, v) in s.closes {
            *self.closes.entry(k).or_default() += v;
        }
        for (k, v) in s.backend {
            *self.backend.entry(k).or_default() += v;
        }
    }
}

/// How a seed configures membership.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Generation 0: all five acceptors are members; a quorum is three of them.
    Legacy,
    /// Generation 1 with members a0, a1, a2 (a quorum is two of them); a3 and a4 are not
    /// members and refuse the proposers.
    Fixed,
    /// Starts as `Fixed`; an operator replaces one member at a time with the procedure of
    /// `docs/durability.md` (joint configuration, wait for the switch condition, new
    /// configuration), one acceptor per step, while proposers run and faults happen.
    Replacing,
}

impl Mode {
    fn of_seed(seed: u64) -> Mode {
        [Mode::Legacy, Mode::Fixed, Mode::Replacing][(seed % 3) as usize]
    }
}

/// Where the operator of [`Mode::Replacing`] is in the procedure.
#[derive(Clone, Debug)]
enum OpPhase {
    /// `members` is the configuration.
    Idle,
    /// The joint configuration (`members`, `new`) is being applied.
    Joint,
    /// The switch condition held: `new` alone is being applied.
    Switch,
}

#[derive(Clone, Debug)]
struct Operator {
    generation: u32,
    members: Vec<usize>,
    new: Vec<usize>,
    /// Acceptors that took the configuration of the current phase.
    applied: Vec<usize>,
    phase: OpPhase,
}

fn safekeeper_id(a: usize) -> SafekeeperId {
    SafekeeperId {
        id: NodeId(a as u64 + 1),
        host: format!("a{a}"),
        pg_port: 5432,
    }
}

fn configuration(generation: u32, members: &[usize], new: Option<&[usize]>) -> Configuration {
    Configuration {
        generation: Generation(generation),
        members: members.iter().map(|&a| safekeeper_id(a)).collect(),
        new_members: new.map(|n| n.iter().map(|&a| safekeeper_id(a)).collect()),
    }
}

fn majority(set: &[usize], has: impl Fn(usize) -> bool) -> bool {
    set.iter().filter(|&&a| has(a)).count() > set.len() / 2
}

struct Cluster<B: Backend> {
    rng: SmallRng,
    mode: Mode,
    operator: Operator,
    trace: bool,
    backend: B,
    acceptors: Vec<Option<Sk<B>>>,
    proposers: Vec<ModelProposer>,
    /// `conns[p][a]`.
    conns: Vec<Vec<Conn>>,
    next_conn_id: ConnId,
    /// Queues of dropped connections that the acceptor may still read: the proposer gave up on
    /// the socket, but bytes it had sent sit in the acceptor's receive buffer. `(p, a, queue)`;
    /// replies go nowhere.
    zombies: Vec<(usize, usize, VecDeque<Bytes>)>,
    fetches: Vec<PendingFetch>,
    /// Per proposer and acceptor: the acceptor's durable WAL `[B::START, flush)` when it granted
    /// the proposer's current incarnation its vote (what that vote's flush LSN describes).
    vote_wal: Vec<Vec<Option<Vec<u8>>>>,
    /// term → (proposer, incarnation) elected in it.
    elected: BTreeMap<Term, (usize, u64)>,
    /// The longest committed prefix any proposer announced: bytes `[B::START, B::START + len)`.
    committed: Vec<u8>,
    /// Highest commit LSN announced by the proposer of each term.
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
    /// Per acceptor: a process crash happened since its last power loss.
    crashed_since_power_loss: Vec<bool>,
    /// A directed scenario drives the steps itself: no random faults or batching in delivery.
    scripted: bool,
    /// Per acceptor: its readers.
    readers: Vec<Vec<ModelReader>>,
    /// The readers' own randomness, apart from `rng`, so the schedules of seeds without
    /// backpressure are those they had before readers existed.
    reader_rng: SmallRng,
    /// `max_replication_flush_lag` and `max_replication_apply_lag` of this seed's proposers
    /// (0: none).
    lag_limits: [u64; 2],
    /// `reported[p][a]`: what `a`'s last acknowledgement on its current connection to `p` said
    /// of its readers, once the core took it.
    reported: Vec<Vec<Option<ReportedFeedback>>>,
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

fn core_config<B: Backend>(mode: Mode, lag_limits: [u64; 2]) -> CoreConfig {
    let mut cfg = CoreConfig::new(
        N_ACC,
        TenantTimelineId {
            tenant_id: tenant(),
            timeline_id: timeline(),
        },
        SYSTEM_ID,
        150000,
        B::SEG,
        B::START,
    );
    // Small enough that some schedules trim the buffer and catch lagging acceptors up by a
    // fetch.
    cfg.max_retained_committed = 64 << 10;
    cfg.max_in_flight = 256 << 10;
    // Every acceptor is configured, so a safekeeper's index is its acceptor's; the membership
    // decides which of them count.
    cfg.addrs = (0..N_ACC).map(|a| format!("a{a}:5432")).collect();
    if mode != Mode::Legacy {
        cfg.mconf = configuration(1, &[0, 1, 2], None);
    }
    [cfg.max_replication_flush_lag, cfg.max_replication_apply_lag] = lag_limits;
    cfg
}

impl<B: Backend> Cluster<B> {
    fn new(seed: u64, trace: bool, mode: Mode) -> Cluster<B> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let fault_rate = [0.005, 0.02, 0.06, 0.15][rng.random_range(0..4)];
        let mut backend = B::new(&mut rng);
        let mut acceptors: Vec<Option<Sk<B>>> =
            (0..N_ACC).map(|a| Some(backend.new_acceptor(a))).collect();
        if mode != Mode::Legacy {
            // The timeline was created with members a0, a1, a2.
            for acc in acceptors.iter_mut().take(3).flatten() {
                acc.set_membership(configuration(1, &[0, 1, 2], None))
                    .expect("the first configuration");
            }
        }
        // Readers on every acceptor; a third of the seeds (not those whose operator replaces
        // members, whose retired members' reports stop counting) hold the writer back by them,
        // with limits of a few records.
        let mut reader_rng = SmallRng::seed_from_u64(seed ^ 0xfeed_bac4);
        let readers = (0..N_ACC)
            .map(|_| {
                let n = reader_rng.random_range(0..=2);
                vec![
                    ModelReader {
                        pos: [B::START; 3],
                        xmin: 0,
                        stalled: false,
                    };
                    n
                ]
            })
            .collect();
        // Either limit, or both (of unrelated sizes: the apply limit may bind first).
        let lag_limits = if mode != Mode::Replacing && reader_rng.random_bool(0.5) {
            let which = reader_rng.random_range(0..3);
            let mut limit = || reader_rng.random_range(1..=8) * B::LAG_LIMIT_UNIT;
            match which {
                0 => [limit(), 0],
                1 => [0, limit()],
                _ => [limit(), limit()],
            }
        } else {
            [0, 0]
        };
        Cluster {
            rng,
            mode,
            operator: Operator {
                generation: 1,
                members: vec![0, 1, 2],
                new: Vec::new(),
                applied: Vec::new(),
                phase: OpPhase::Idle,
            },
            fault_rate,
            trace,
            acceptors,
            backend,
            proposers: (0..N_PROP).map(|_| ModelProposer::new()).collect(),
            conns: (0..N_PROP)
                .map(|_| (0..N_ACC).map(|_| Conn::default()).collect())
                .collect(),
            next_conn_id: 1,
            zombies: Vec::new(),
            fetches: Vec::new(),
            vote_wal: vec![vec![None; N_ACC]; N_PROP],
            elected: BTreeMap::new(),
            committed: Vec::new(),
            commit_by_term: BTreeMap::new(),
            acc_term_seen: vec![Term(0); N_ACC],
            acc_commit_seen: vec![Lsn(0); N_ACC],
            acc_flush_revealed: vec![Lsn(0); N_ACC],
            acc_commit_revealed: vec![Lsn(0); N_ACC],
            log_check: (0..N_ACC).map(|_| None).collect(),
            crashed_since_power_loss: vec![false; N_ACC],
            scripted: false,
            readers,
            reader_rng,
            lag_limits,
            reported: vec![vec![None; N_ACC]; N_PROP],
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

    /// Connection lost: in-flight messages are gone, the proposer's core is told.
    fn drop_conn(&mut self, p: usize, a: usize, why: &str) {
        let conn = &mut self.conns[p][a];
        if !conn.up {
            return;
        }
        let (dirty, id) = (conn.dirty, conn.id);
        let in_flight = std::mem::take(&mut conn.to_acc);
        *conn = Conn::default();
        self.reported[p][a] = None;
        let dying = why == "power loss" || why == "process crash";
        let acceptor_closed = dying || why.starts_with("acceptor") || why.starts_with("flush");
        if !acceptor_closed && !in_flight.is_empty() && self.rng.random_bool(0.3) {
            self.zombies.push((p, a, in_flight));
        }
        self.stats.drops += 1;
        self.log(|| format!("drop p{p}-a{a}: {why}"));
        // neon's WalAcceptor flushes on disconnect, unless the process is dying.
        if dirty && !dying && self.rng.random_bool(0.5) {
            let _ = self
                .sk_mut(a)
                .process_msg(&ProposerAcceptorMessage::FlushWAL);
        }
        self.step_core(p, Event::Disconnected { sk: a, conn: id });
    }

    /// The proposer's driver opens a connection to `a`.
    fn connect(&mut self, p: usize, a: usize) {
        if self.proposers[p].core.is_none() {
            return;
        }
        self.drop_conn(p, a, "reconnect");
        let id = self.next_conn_id;
        self.next_conn_id += 1;
        self.conns[p][a] = Conn {
            up: true,
            id,
            ..Conn::default()
        };
        self.step_core(p, Event::Connected { sk: a, conn: id });
    }

    // ----- acceptor side ------------------------------------------------------------------

    fn deliver_to_acceptor(&mut self, p: usize, a: usize) {
        let Some(frame) = self.conns[p][a].to_acc.pop_front() else {
            return;
        };
        let msg = ProposerAcceptorMessage::decode(&frame).expect("proposer frames decode");
        // The WAL receiver turns appends into no-flush appends and syncs when idle.
        let msg = match msg {
            ProposerAcceptorMessage::AppendRequest(r)
                if !self.scripted && self.rng.random_bool(0.6) =>
            {
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
        let mut result = self.sk_mut(a).process_msg(&msg);
        if let Ok(Some(reply)) = &mut result {
            self.add_reader_feedback(a, reply);
        }
        if crash_armed && self.backend.crash_point_reached(a) {
            self.stats.crash_points += 1;
            if let ProposerAcceptorMessage::Elected(e) = &msg {
                // The truncation to the start point may have begun: WAL above it is
                // legitimately gone (the new term's proposer does not have it).
                let floor = self.acc_flush_revealed[a].min(e.start_streaming_at);
                self.acc_flush_revealed[a] = floor;
            }
            if self.rng.random_bool(0.5) {
                self.log(|| format!("a{a} loses power while handling that message"));
                self.power_loss(a);
            } else {
                self.log(|| format!("a{a}'s process dies while handling that message"));
                self.process_crash(a);
            }
            return;
        }
        if matches!(msg, ProposerAcceptorMessage::Elected(_)) {
            // Elected may truncate: what was revealed above the new end is legitimately gone.
            let flush = self.sk(a).flush_lsn();
            self.acc_flush_revealed[a] = self.acc_flush_revealed[a].min(flush);
        }
        if let Ok(Some(reply)) = &result {
            self.note_revealed(a, reply);
            if let AcceptorProposerMessage::VoteResponse(v) = reply
                && v.vote_given
            {
                // What this vote's flush LSN describes, should its voter become the donor.
                let wal = if v.flush_lsn > B::START {
                    B::read(self.sk(a), B::START, v.flush_lsn).expect("voted WAL is durable")
                } else {
                    Vec::new()
                };
                self.vote_wal[p][a] = Some(wal);
            }
        }
        let elected = matches!(msg, ProposerAcceptorMessage::Elected(_));
        match result {
            Ok(Some(reply)) => {
                self.log(|| format!("a{a} -> p{p}: {reply:?}"));
                self.conns[p][a].to_prop.push_back(encode_ap(&reply));
            }
            Ok(None) if elected && !self.scripted && self.rng.random_bool(0.1) => {
                // The connection breaks after `elected` and before any append got through.
                self.stats.drops_after_elected += 1;
                self.drop_conn(p, a, "network, right after elected");
            }
            Ok(None) => {}
            Err(e) => {
                self.on_acceptor_error(a, &e);
                self.drop_conn(p, a, &format!("acceptor error: {e}"));
            }
        }
    }

    /// Each running proposer's view of the readers is that of the acknowledgements it took on its
    /// open connections: its hot-standby feedback is their oldest, and its backpressure is off,
    /// slowed or paused as the least flushed and least applied positions among them lag its WAL's
    /// end by half a limit or a whole one. (Not with an operator replacing members: a retired
    /// member's reports stop counting while its connection lingers.)
    fn check_reader_feedback(&self) {
        if self.mode == Mode::Replacing {
            return;
        }
        for (p, prop) in self.proposers.iter().enumerate() {
            let Some(core) = prop.core.as_ref() else {
                continue;
            };
            let taken: Vec<ReportedFeedback> = (0..N_ACC)
                .filter(|&a| self.conns[p][a].up)
                .filter_map(|a| self.reported[p][a])
                .collect();
            let hs = HotStandbyFeedback::oldest(taken.iter().map(|f| f.hs));
            assert_eq!(
                core.hs_feedback(),
                hs,
                "p{p}: hot-standby feedback of {taken:?}"
            );
            let least = taken.iter().filter_map(|f| f.least).reduce(least_of);
            let mut expected = "off";
            if let Some(least) = least {
                for (limit, pos) in self.lag_limits.into_iter().zip([least[1], least[2]]) {
                    let lag = core.end_lsn().0.saturating_sub(pos.0);
                    if limit == 0 {
                        continue;
                    } else if lag >= limit {
                        expected = "paused";
                    } else if 2 * lag >= limit && expected == "off" {
                        expected = "slowed";
                    }
                }
            }
            let got = match core.backpressure() {
                Backpressure::Off => "off",
                Backpressure::Slow { .. } => "slowed",
                Backpressure::Paused { .. } => "paused",
            };
            assert_eq!(
                got,
                expected,
                "p{p}: backpressure with limits {:?}, WAL end {}, reports {taken:?}",
                self.lag_limits,
                core.end_lsn()
            );
        }
    }

    /// What `a`'s readers report, computed here independently of the safekeeper's code.
    fn reader_feedback(&self, a: usize) -> ReportedFeedback {
        let readers = &self.readers[a];
        let least = readers.iter().map(|r| r.pos).reduce(least_of);
        let xmin = readers.iter().map(|r| r.xmin).filter(|&x| x != 0).min();
        ReportedFeedback {
            hs: HotStandbyFeedback {
                ts: xmin.map_or(0, |_| 1),
                xmin: xmin.unwrap_or(0),
                catalog_xmin: 0,
            },
            least,
        }
    }

    /// Every acknowledgement carries what the acceptor's readers report, as the safekeeper's
    /// `Timeline::process_msg` adds it.
    fn add_reader_feedback(&self, a: usize, reply: &mut AcceptorProposerMessage) {
        if let AcceptorProposerMessage::AppendResponse(r) = reply {
            let f = self.reader_feedback(a);
            r.hs_feedback = f.hs;
            r.pageserver_feedback = f.least.map(|[write, flush, apply]| PageserverFeedback {
                last_received_lsn: write,
                disk_consistent_lsn: flush,
                remote_consistent_lsn: apply,
                ..PageserverFeedback::default()
            });
        }
    }

    /// A reader step: one reader of a random acceptor moves toward that acceptor's commit LSN
    /// (writing first, then flushing, then applying), stalls, resumes, or takes or releases a
    /// snapshot.
    fn reader_step(&mut self) {
        let a = self.reader_rng.random_range(0..N_ACC);
        if self.readers[a].is_empty() {
            return;
        }
        let i = self.reader_rng.random_range(0..self.readers[a].len());
        let commit = self.sk(a).commit_lsn();
        let rng = &mut self.reader_rng;
        let r = &mut self.readers[a][i];
        match rng.random_range(0..100) {
            0..=4 => r.stalled = !r.stalled,
            5..=9 => {
                r.xmin = if r.xmin == 0 {
                    rng.random_range(3..1000)
                } else {
                    0
                }
            }
            _ if r.stalled => {}
            _ => {
                // Readers get committed WAL only; a power loss may set the acceptor's commit
                // back below what a reader already has, which it keeps.
                let toward = |from: Lsn, to: Lsn, rng: &mut SmallRng| {
                    if to > from {
                        Lsn(rng.random_range(from.0..=to.0))
                    } else {
                        from
                    }
                };
                // Each position moves on its own (a standby may flush far ahead of what
                // it applied), never past the one before it.
                r.pos[0] = toward(r.pos[0], commit, rng);
                if rng.random_bool(0.6) {
                    r.pos[1] = toward(r.pos[1], r.pos[0], rng);
                }
                if rng.random_bool(0.4) {
                    r.pos[2] = toward(r.pos[2], r.pos[1], rng);
                }
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
            Ok(Some(mut reply)) => {
                self.add_reader_feedback(a, &mut reply);
                self.conns[p][a].to_prop.push_back(encode_ap(&reply));
            }
            Ok(None) => unreachable!("FlushWAL always answers"),
            Err(e) => self.drop_conn(p, a, &format!("flush error: {e}")),
        }
    }

    fn power_loss(&mut self, a: usize) {
        for p in 0..N_PROP {
            self.drop_conn(p, a, "power loss");
        }
        self.zombies.retain(|(_, za, _)| *za != a);
        if std::mem::take(&mut self.crashed_since_power_loss[a]) {
            self.stats.power_losses_after_process_crash += 1;
        }
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

    /// The acceptor's process dies and restarts: connections end, the page cache survives.
    fn process_crash(&mut self, a: usize) {
        for p in 0..N_PROP {
            self.drop_conn(p, a, "process crash");
        }
        self.zombies.retain(|(_, za, _)| *za != a);
        let sk = self.acceptors[a].take().expect("acceptor present");
        let sk = self.backend.process_crash(a, sk);
        self.stats.process_crashes += 1;
        self.crashed_since_power_loss[a] = true;
        self.log(|| format!("process crash a{a}: flush {}", sk.flush_lsn()));
        self.acceptors[a] = Some(sk);
    }

    // ----- proposer side ------------------------------------------------------------------

    // ----- proposer side ------------------------------------------------------------------

    /// Feeds `event` to proposer `p`'s core (if it runs) and carries out its actions.
    fn step_core(&mut self, p: usize, event: Event) {
        let Some(core) = self.proposers[p].core.as_mut() else {
            return;
        };
        let phase_before = core.phase();
        core.step(event);
        self.after_core(p, phase_before);
    }

    /// Carries out what proposer `p`'s core queued.
    fn after_core(&mut self, p: usize, phase_before: Phase) {
        let Some(core) = self.proposers[p].core.as_mut() else {
            return;
        };
        let phase = core.phase();
        let actions = core.take_actions();
        if phase_before == Phase::Voting && matches!(phase, Phase::Recovering | Phase::Elected) {
            self.on_donor_chosen(p);
        }
        for action in actions {
            match action {
                Action::Send { sk, conn, msg } => {
                    let c = &mut self.conns[p][sk];
                    if c.up && c.id == conn {
                        c.to_acc.push_back(encode_pa(&msg));
                    }
                }
                Action::Close { sk, conn, reason } => {
                    let kind = reason.split([':', '(']).next().unwrap_or("").to_string();
                    *self.stats.closes.entry(kind).or_default() += 1;
                    if self.conns[p][sk].id == conn {
                        self.drop_conn(p, sk, &format!("proposer closes: {reason}"));
                    }
                }
                Action::Reconnect { sk, conn, reason } => {
                    *self.stats.closes.entry("reconnect".into()).or_default() += 1;
                    if self.conns[p][sk].id == conn {
                        self.drop_conn(p, sk, &format!("proposer reconnects: {reason}"));
                    }
                }
                Action::Fetch {
                    id,
                    sk,
                    term,
                    from,
                    to,
                } => {
                    self.log(|| format!("p{p} fetches [{from}, {to}) from a{sk} in term {term}"));
                    let incarnation = self.proposers[p].incarnation;
                    self.fetches.push(PendingFetch {
                        id,
                        p,
                        incarnation,
                        sk,
                        term,
                        from,
                        to,
                    });
                }
                Action::Elected {
                    term, term_start, ..
                } => self.on_elected(p, term, term_start),
                Action::Commit(lsn) => self.on_commit(p, lsn),
                Action::SteppedDown { seen } => {
                    self.stop_proposer(p, &format!("stepped down: term {seen} seen"));
                    return;
                }
                Action::ElectionFailed { reason } => {
                    self.stop_proposer(p, &format!("election failed: {reason}"));
                    return;
                }
                Action::Reconfigured { mconf } => {
                    self.stats.reconfigurations += 1;
                    self.log(|| {
                        let core = self.proposers[p].core.as_ref().expect("running");
                        format!(
                            "p{p} adopts generation {}: {}",
                            mconf.generation,
                            core.describe()
                        )
                    });
                }
                Action::AddSafekeeper { sk, id } => {
                    assert_eq!(sk as u64 + 1, id.id.0, "every acceptor is configured");
                }
                Action::RetireSafekeeper { sk } => {
                    self.log(|| format!("p{p} retires a{sk}"));
                }
            }
        }
    }

    fn start_campaign(&mut self, p: usize) {
        let prop = &mut self.proposers[p];
        prop.core = Some(ProposerCore::new(core_config::<B>(
            self.mode,
            self.lag_limits,
        )));
        prop.log = None;
        prop.rec_ends.clear();
        prop.paused = false;
        prop.wal_gen = None;
        prop.commit = Lsn(0);
        self.vote_wal[p] = vec![None; N_ACC];
        self.log(|| format!("p{p} starts a campaign"));
        for a in 0..N_ACC {
            self.connect(p, a);
        }
    }

    /// The process stops (stepped down, election failed or timed out, crashed): connections
    /// close, a new incarnation may campaign later.
    fn stop_proposer(&mut self, p: usize, why: &str) {
        self.log(|| format!("p{p} stops: {why}"));
        for a in 0..N_ACC {
            self.drop_conn(p, a, "proposer stopped");
        }
        let prop = &mut self.proposers[p];
        prop.core = None;
        prop.incarnation += 1;
    }

    fn deliver_to_proposer(&mut self, p: usize, a: usize) {
        let Some(frame) = self.conns[p][a].to_prop.pop_front() else {
            return;
        };
        let msg = AcceptorProposerMessage::decode(&frame).expect("acceptor frames decode");
        let conn = self.conns[p][a].id;
        let feedback = match &msg {
            AcceptorProposerMessage::AppendResponse(r) => Some(ReportedFeedback {
                hs: r.hs_feedback,
                least: r.pageserver_feedback.map(|f| {
                    [
                        f.last_received_lsn,
                        f.disk_consistent_lsn,
                        f.remote_consistent_lsn,
                    ]
                }),
            }),
            _ => None,
        };
        self.step_core(p, Event::Received { sk: a, conn, msg });
        // The core refuses an acknowledgement by closing its connection: one still open was
        // taken, and what it said of the readers counts until the next one or the end of it.
        if feedback.is_some() && self.conns[p][a].up && self.conns[p][a].id == conn {
            self.reported[p][a] = feedback;
        }
    }

    /// The core chose its donor: the proposer's WAL below the term start is the donor's WAL as
    /// its vote described it.
    fn on_donor_chosen(&mut self, p: usize) {
        let core = self.proposers[p].core.as_ref().expect("running");
        let donor = core.donor().expect("chosen");
        let term_start = core.term_start();
        let wal = self.vote_wal[p][donor]
            .clone()
            .expect("the donor's granted vote was recorded");
        assert_eq!(
            Lsn(B::START.0 + wal.len() as u64).max(B::START),
            term_start.max(B::START),
            "p{p}: the term starts at the donor's flush LSN"
        );
        if let Some(log) = self.proposers[p]
            .log
            .as_ref()
            .filter(|_| self.proposers[p].wal_gen.is_some())
        {
            // Re-electing after a membership change: the core continues its own WAL, so the
            // new donor's WAL must be a prefix of it (the core checks the histories).
            assert!(
                log.starts_with(&wal),
                "p{p} re-elected with donor a{donor} whose WAL is not a prefix of its own"
            );
            return;
        }
        self.proposers[p].log = Some(wal);
    }

    fn on_elected(&mut self, p: usize, term: Term, term_start: Lsn) {
        let incarnation = self.proposers[p].incarnation;
        if let Some(&(q, inc)) = self.elected.get(&term) {
            panic!("election safety: term {term} elected p{q}#{inc} and now p{p}#{incarnation}");
        }
        self.elected.insert(term, (p, incarnation));
        self.stats.elections += 1;
        let donor = self.proposers[p].core.as_ref().and_then(|c| c.donor());
        self.log(|| format!("p{p} elected in term {term}, donor {donor:?}, start {term_start}"));
        let log = self.proposers[p].log.clone().expect("donor chosen");
        // Leader completeness (Raft): the log of term T's leader holds everything committed in
        // terms below T.
        let required = self
            .commit_by_term
            .range(..term)
            .map(|(_, &lsn)| lsn)
            .max()
            .unwrap_or(Lsn(0));
        let required_len = (required.0.saturating_sub(B::START.0)) as usize;
        assert!(
            log.len() >= required_len,
            "elected proposer p{p} in term {term} lacks WAL committed in earlier terms: log ends \
             at {}, committed up to {required}",
            Lsn(B::START.0 + log.len() as u64),
        );
        assert_eq!(
            log[..required_len],
            self.committed[..required_len],
            "elected proposer p{p} in term {term} disagrees with WAL committed in earlier terms"
        );
        if let Some(wal_gen) = self.proposers[p].wal_gen.as_mut() {
            // Re-elected: the same WAL continues; new records carry the new term.
            wal_gen.set_xid(u32::try_from(term.0).expect("model terms stay small"));
            return;
        }
        // Continue the donor's xl_prev chain; stamp this term's records with the term.
        let rec = records(&log, B::START, B::SEG, &format!("p{p}'s donor WAL"));
        let mut wal_gen = WalGenerator::new(SYSTEM_ID, B::SEG as u64, term_start)
            .expect("a record end is a record boundary")
            .with_prev(rec.last().map_or(Lsn(0), |r| r.0));
        wal_gen.set_xid(u32::try_from(term.0).expect("model terms stay small"));
        let prop = &mut self.proposers[p];
        prop.rec_ends = rec.iter().map(|r| r.1).collect();
        prop.wal_gen = Some(wal_gen);
    }

    /// Commit safety, judged from what the proposer announces: the bytes below its commit LSN
    /// agree with everything any proposer ever announced committed.
    fn on_commit(&mut self, p: usize, commit: Lsn) {
        let prop = &mut self.proposers[p];
        assert!(commit > prop.commit, "p{p}: commit LSN went back");
        prop.commit = commit;
        let log = prop
            .log
            .as_ref()
            .expect("a committing proposer knows its WAL");
        assert!(
            commit.0 <= B::START.0 + log.len() as u64,
            "p{p}: commit {commit} beyond its own WAL"
        );
        let term = prop.core.as_ref().expect("running").term();
        let upto = (commit.0 - B::START.0) as usize;
        let common = upto.min(self.committed.len());
        assert_eq!(
            log[..common],
            self.committed[..common],
            "commit safety: p{p} (term {term}) announced committed bytes below {commit} that \
             differ from WAL announced committed before"
        );
        if upto > self.committed.len() {
            self.committed = log[..upto].to_vec();
        }
        let by_term = self.commit_by_term.entry(term).or_default();
        *by_term = (*by_term).max(commit);
        self.stats.commits_observed += 1;
        self.log(|| {
            let core = self.proposers[p].core.as_ref().expect("running");
            format!(
                "p{p} (term {term}) commits {commit} with {}: {}",
                core.quorum_description(),
                core.describe()
            )
        });
    }

    /// Whether `p` takes WAL: elected, or re-electing itself after a membership change (the
    /// WAL waits in its buffer).
    fn can_push(&self, p: usize) -> bool {
        let prop = &self.proposers[p];
        match prop.phase() {
            Some(Phase::Elected) => true,
            Some(Phase::Greeting | Phase::Voting | Phase::Recovering) => prop.wal_gen.is_some(),
            _ => false,
        }
    }

    fn append_record(&mut self, p: usize) {
        if !self.can_push(p) {
            return;
        }
        // The driver waits while backpressure pauses the writer (a directed scenario drives
        // its own steps and pushes regardless; its cores' view is still checked).
        let paused = matches!(
            self.proposers[p].core.as_ref().map(|c| c.backpressure()),
            Some(Backpressure::Paused { .. })
        );
        if paused && !self.scripted {
            self.stats.backpressure_pauses += 1;
            self.proposers[p].paused = true;
            return;
        }
        if std::mem::take(&mut self.proposers[p].paused) {
            self.stats.backpressure_releases += 1;
        }
        let phase = self.proposers[p].phase().expect("running");
        let len = B::message_len(&mut self.rng);
        let mut message = vec![p as u8; len];
        self.rng.fill(&mut message[..]);
        let prop = &mut self.proposers[p];
        let log = prop.log.as_mut().expect("elected");
        let before = log.len();
        let pos = prop
            .wal_gen
            .as_mut()
            .expect("an elected proposer generates WAL")
            .append_logical_message(log, &message);
        prop.rec_ends.push(pos.end);
        let at = Lsn(B::START.0 + before as u64);
        let bytes = Bytes::copy_from_slice(&log[before..]);
        let core = prop.core.as_mut().expect("elected");
        core.push(at, bytes)
            .expect("pushes continue the core's WAL");
        self.after_core(p, phase);
    }

    /// Answers the oldest fetch of a random proposer: the walsender serves durable WAL while
    /// the acceptor's term is the requested one.
    fn deliver_fetch(&mut self, i: usize) {
        let f = self.fetches.swap_remove(i);
        if self.proposers[f.p].incarnation != f.incarnation || self.proposers[f.p].core.is_none() {
            return; // the process that asked is gone
        }
        self.stats.fetches += 1;
        let network_error = !self.scripted && self.rng.random_bool(self.fault_rate);
        let sk = self.sk(f.sk);
        let served = if network_error {
            Err("network error".to_string())
        } else if sk.term() != f.term {
            Err(format!("term is {}, not {}", sk.term(), f.term))
        } else if sk.flush_lsn() < f.to {
            Err(format!("WAL ends at {}", sk.flush_lsn()))
        } else {
            B::read(sk, f.from, f.to).ok_or_else(|| "not held".to_string())
        };
        let event = match served {
            Ok(wal) => {
                // What the walsender serves in our term is our WAL.
                let log = self.proposers[f.p].log.as_ref().expect("donor chosen");
                let (from, to) = (
                    (f.from.0 - B::START.0) as usize,
                    (f.to.0 - B::START.0) as usize,
                );
                assert_eq!(
                    wal[..],
                    log[from..to],
                    "a{} served WAL [{}, {}) in term {} that differs from p{}'s",
                    f.sk,
                    f.from,
                    f.to,
                    f.term,
                    f.p
                );
                Event::Fetched {
                    id: f.id,
                    from: f.from,
                    wal: Bytes::from(wal),
                }
            }
            Err(reason) => {
                self.stats.fetch_failures += 1;
                Event::FetchFailed { id: f.id, reason }
            }
        };
        self.step_core(f.p, event);
    }

    /// A reply is delivered twice, or two replies swap places: the core must not care.
    fn disturb_replies(&mut self, p: usize, a: usize) {
        let q = &mut self.conns[p][a].to_prop;
        let is_append = |b: &Bytes| {
            matches!(
                AcceptorProposerMessage::decode(b),
                Ok(AcceptorProposerMessage::AppendResponse(_))
            )
        };
        if q.len() >= 2 && is_append(&q[0]) && is_append(&q[1]) && self.rng.random_bool(0.5) {
            q.swap(0, 1);
            self.stats.replies_reordered += 1;
        } else if let Some(front) = q.front().cloned().filter(|b| is_append(b)) {
            q.push_front(front);
            self.stats.replies_duplicated += 1;
        }
    }

    // ----- invariants ---------------------------------------------------------------------

    fn check(&mut self) {
        self.check_reader_feedback();
        let committed_end = Lsn(B::START.0 + self.committed.len() as u64);
        let mut holders = Vec::with_capacity(N_ACC);
        // Per acceptor: the term of its newest durable WAL and how far that WAL agrees with
        // the committed WAL.
        let mut held: Vec<(Term, usize)> = Vec::with_capacity(N_ACC);
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
            holders.push(
                durable.len() >= self.committed.len()
                    && durable[..self.committed.len()] == self.committed[..],
            );
            let agree = common_prefix(&durable, &self.committed);
            held.push((hist.last_log_term(), agree));
        }
        // Committed WAL is safe only if the next election's donor must have it: WAL committed
        // in term T is held, durably, by a quorum whose newest WAL is of term T or later (the
        // donor is chosen by `(last_log_term, flush_lsn)`). A quorum holding the bytes under an
        // older term is not enough: a newer term's WAL elsewhere wins the next election.
        // The quorums that must hold it are those of the configuration in force.
        let sets = self.quorum_sets();
        for (&term, &lsn) in &self.commit_by_term {
            let len = (lsn.0 - B::START.0) as usize;
            if len == 0 {
                continue; // no WAL committed yet, nothing to lose
            }
            for set in &sets {
                assert!(
                    majority(set, |a| held[a].0 >= term && held[a].1 >= len),
                    "WAL committed up to {lsn} in term {term} is held under term {term} or later \
                     by no majority of {set:?} ({held:?}): the next election may lose it \
                     (operator: {:?})",
                    self.operator
                );
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
        for set in &sets {
            assert!(
                majority(set, |a| holders[a]),
                "committed WAL up to {committed_end} is durable on no majority of {set:?} \
                 ({holders:?})"
            );
        }
    }

    /// The acceptor sets a majority of which must hold committed WAL: the configuration in
    /// force (during a replacement: the old one until the switch condition holds, then the new
    /// one).
    fn quorum_sets(&self) -> Vec<Vec<usize>> {
        match self.mode {
            Mode::Legacy => vec![(0..N_ACC).collect()],
            Mode::Fixed => vec![vec![0, 1, 2]],
            Mode::Replacing => match self.operator.phase {
                OpPhase::Idle | OpPhase::Joint => vec![self.operator.members.clone()],
                OpPhase::Switch => vec![self.operator.new.clone()],
            },
        }
    }

    // ----- the operator -------------------------------------------------------------------

    /// One step of the replacement procedure (`docs/durability.md`), done as the real
    /// operator (`scripts/local-cluster replace`) does it, through `SafeKeeper::set_membership`
    /// (the daemon's `PUT …/membership`).
    fn operator_step(&mut self) {
        let op = &self.operator;
        match op.phase.clone() {
            OpPhase::Idle => {
                let out = op.members[self.rng.random_range(0..op.members.len())];
                let spare: Vec<usize> = (0..N_ACC).filter(|a| !op.members.contains(a)).collect();
                let into = spare[self.rng.random_range(0..spare.len())];
                let mut new: Vec<usize> = op
                    .members
                    .iter()
                    .copied()
                    .filter(|&a| a != out)
                    .chain([into])
                    .collect();
                new.sort_unstable();
                self.log(|| {
                    format!(
                        "operator: replace a{out} by a{into}: joint {:?} + {new:?}",
                        op.members
                    )
                });
                let op = &mut self.operator;
                op.generation += 1;
                op.new = new;
                op.applied.clear();
                op.phase = OpPhase::Joint;
                self.stats.membership_switches += 1;
            }
            OpPhase::Joint => {
                let joint = op.generation;
                let cfg = configuration(joint, &op.members, Some(&op.new));
                self.apply_one(&cfg);
                // The switch condition: a majority of the new set holds WAL up to the start of
                // a term elected in the joint configuration (such a term's election saw a
                // majority of the old set, so its start holds everything committed before).
                let op = &self.operator;
                let caught_up = |a: usize| {
                    let sk = self.sk(a);
                    let s = sk.state();
                    s.acceptor_state.elected_generation >= Generation(joint)
                        && s.acceptor_state
                            .term_history
                            .0
                            .last()
                            .is_some_and(|e| e.lsn <= sk.flush_lsn())
                };
                if majority(&op.new, caught_up) {
                    self.log(|| {
                        format!(
                            "operator: switch condition holds; switching to {:?}",
                            op.new
                        )
                    });
                    let op = &mut self.operator;
                    op.generation += 1;
                    op.applied.clear();
                    op.phase = OpPhase::Switch;
                    self.stats.membership_switches += 1;
                }
            }
            OpPhase::Switch => {
                let cfg = configuration(op.generation, &op.new, None);
                self.apply_one(&cfg);
                let op = &mut self.operator;
                let all: Vec<usize> = op.members.iter().chain(&op.new).copied().collect();
                if all.iter().all(|a| op.applied.contains(a)) {
                    op.members = std::mem::take(&mut op.new);
                    op.phase = OpPhase::Idle;
                }
            }
        }
    }

    /// Switches one acceptor of the current procedure step that has not switched yet.
    fn apply_one(&mut self, cfg: &Configuration) {
        let op = &self.operator;
        let pending: Vec<usize> = op
            .members
            .iter()
            .chain(&op.new)
            .copied()
            .filter(|a| !op.applied.contains(a))
            .collect();
        if pending.is_empty() {
            return;
        }
        let a = pending[self.rng.random_range(0..pending.len())];
        self.sk_mut(a)
            .set_membership(cfg.clone())
            .unwrap_or_else(|e| panic!("a{a} refused generation {}: {e}", cfg.generation));
        self.log(|| format!("operator: a{a} now in generation {}", cfg.generation));
        self.operator.applied.push(a);
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
            // A proposer that re-elected itself after a membership change re-sends the WAL it
            // buffered in its earlier term (its own records and those of its first donor) in the
            // new one.
            let reelected = |t: Term| {
                t > rec_term
                    && self.elected.get(&t).is_some_and(|who| {
                        self.elected.range(..t).any(|(_, earlier)| earlier == who)
                    })
            };
            assert!(
                by_history == Some(rec_term) || by_history.is_some_and(reelected),
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
        if self.reader_rng.random_bool(0.3) {
            self.reader_step();
        }
        self.backend.advance_clock(&mut self.rng);
        let p = self.rng.random_range(0..N_PROP);
        let a = self.rng.random_range(0..N_ACC);
        if self.rng.random_bool(self.fault_rate) {
            match self.rng.random_range(0..100) {
                0..=39 => self.drop_conn(p, a, "network"),
                40..=51 => self.power_loss(a),
                52..=59 => self.process_crash(a),
                60..=69 => {
                    // A proposer stuck in a campaign (e.g. it lost the vote race) gives up.
                    if matches!(
                        self.proposers[p].phase(),
                        Some(Phase::Greeting | Phase::Voting | Phase::Recovering)
                    ) {
                        self.stop_proposer(p, "campaign timeout");
                    }
                }
                70..=84 => {
                    if self.conns[p][a].up {
                        self.disturb_replies(p, a);
                    }
                }
                _ => {
                    if self.proposers[p].core.is_some() {
                        self.stop_proposer(p, "crash");
                    }
                }
            }
            return;
        }
        if self.mode == Mode::Replacing && self.rng.random_bool(0.02) {
            return self.operator_step();
        }
        match self.rng.random_range(0..100) {
            0..=54 => self.deliver_random(),
            55..=71 => {
                if self.can_push(p) {
                    self.append_record(p);
                } else {
                    self.deliver_random();
                }
            }
            72..=76 => self.step_core(p, Event::Tick),
            77..=87 => self.idle_flush(p, a),
            88..=89 => {
                let force = self.rng.random_bool(0.5);
                let _ = self.sk_mut(a).maybe_persist_inmem(force);
            }
            _ => {
                if self.proposers[p].core.is_none() {
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

    /// Delivers everything queued between `p` and `a`, both ways, until both queues are empty.
    fn exchange(&mut self, p: usize, a: usize) {
        loop {
            if !self.conns[p][a].to_acc.is_empty() {
                self.deliver_to_acceptor(p, a);
            } else if !self.conns[p][a].to_prop.is_empty() {
                self.deliver_to_proposer(p, a);
            } else {
                return;
            }
            self.check();
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
        let n = queues.len() + self.zombies.len() + self.fetches.len();
        if n == 0 {
            return;
        }
        let pick = self.rng.random_range(0..n);
        if pick >= queues.len() + self.zombies.len() {
            self.deliver_fetch(pick - queues.len() - self.zombies.len());
            return;
        }
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
        let mut c = Cluster::<B>::new(seed, trace, Mode::of_seed(seed));
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
                 cargo test -p walproposer --test model model_replay_one_seed -- --ignored --nocapture",
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
        total.add(s);
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
    if seeds >= 100 {
        // Every kind of trouble the schedule can cause happened somewhere.
        assert!(
            total.drops_after_elected > 0
                && total.fetches > 0
                && total.fetch_failures > 0
                && total.replies_duplicated > 0
                && total.replies_reordered > 0
                && total.stale_delivered > 0
                && total.process_crashes > 0
                && total.power_losses_after_process_crash > 0
                && total.membership_switches > 0
                && total.reconfigurations > 0
                && total.backpressure_pauses > 0
                && total.backpressure_releases > 0,
            "a fault kind never happened: {total:?}"
        );
    }
}

#[test]
#[ignore = "replays MODEL_SEED (MODEL_TRACE=1 prints the schedule)"]
fn model_replay_one_seed() {
    let seed = env_u64("MODEL_SEED").expect("set MODEL_SEED=<seed> to replay one schedule");
    let trace = std::env::var("MODEL_TRACE").is_ok_and(|v| v != "0");
    let steps = env_u64("MODEL_STEPS").map_or(STEPS, |s| s as usize);
    let stats = match std::env::var("MODEL_BACKEND").as_deref() {
        Ok("simfs") => run_seed::<SimFsBackend>(seed, steps, trace),
        Ok("mem") | Err(_) => run_seed::<Mem>(seed, steps, trace),
        Ok(other) => panic!("MODEL_BACKEND={other}: expected mem or simfs"),
    };
    eprintln!("seed {seed}: {stats:?}");
}

/// The trace of issue 12, replayed step by step on real acceptors and real proposer cores
/// (A, B, C = acceptors 0, 1, 2). A proposer that counted a safekeeper's start point as an
/// acknowledgement announced WAL committed that a later term then overwrote at the same LSNs;
/// the invariant checks after every step (commit safety, committed WAL held by a quorum under
/// its term) fail on such a proposer.
#[test]
fn start_point_is_not_an_acknowledgement_issue_12_trace() {
    let (a, b, c) = (0, 1, 2);
    let mut cl = Cluster::<Mem>::new(0, std::env::var("MODEL_TRACE").is_ok(), Mode::Fixed);
    cl.scripted = true;
    let term_of = |cl: &Cluster<Mem>, p: usize| cl.proposers[p].core.as_ref().map(|c| c.term());

    // 1. Term 1: elected by A and B; its WAL W1 reaches A only.
    cl.start_campaign(0);
    cl.drop_conn(0, c, "unreachable");
    cl.exchange(0, a);
    cl.exchange(0, b); // B's greeting makes the quorum; B votes
    cl.exchange(0, a); // A votes: elected; A gets `elected`
    assert_eq!(term_of(&cl, 0), Some(Term(1)));
    cl.drop_conn(0, b, "B never gets elected");
    cl.append_record(0);
    cl.exchange(0, a);
    let nothing_committed =
        |cl: &Cluster<Mem>| cl.commit_by_term.values().all(|&l| l <= Mem::START);
    assert!(nothing_committed(&cl), "W1 is on A only");
    cl.stop_proposer(0, "crash");

    // 2. Term 2: elected by B and C; its different WAL W2 reaches B only.
    cl.start_campaign(1);
    cl.drop_conn(1, a, "unreachable");
    cl.exchange(1, b);
    cl.exchange(1, c);
    cl.exchange(1, b);
    assert_eq!(term_of(&cl, 1), Some(Term(2)));
    cl.drop_conn(1, c, "C never gets elected");
    cl.append_record(1);
    cl.exchange(1, b);
    assert!(nothing_committed(&cl), "W2 is on B only");
    cl.stop_proposer(1, "crash");

    // 3. Term 3: elected by A and C. A is the donor (last log term 1 > 0): the term starts at
    //    the end of W1, which is fetched from A for C. A's connection drops before A processes
    //    `elected`; C gets W1 and acknowledges it.
    cl.start_campaign(0);
    cl.drop_conn(0, b, "unreachable");
    cl.exchange(0, a);
    cl.exchange(0, c);
    cl.exchange(0, a);
    assert_eq!(
        cl.proposers[0].core.as_ref().and_then(|c| c.donor()),
        Some(a)
    );
    assert_eq!(cl.fetches.len(), 1, "C lacks W1");
    cl.deliver_fetch(0);
    assert_eq!(term_of(&cl, 0), Some(Term(3)));
    cl.drop_conn(0, a, "A drops before processing elected");
    cl.exchange(0, c);
    cl.check();
    assert!(
        cl.proposers[0].commit <= Mem::START,
        "one acknowledgement of the two needed is no commit"
    );
    cl.stop_proposer(0, "crash");

    // 4. Term 4: elected by A and B. B is the donor (last log term 2 > 1): A is truncated and
    //    W2 is committed at the LSNs where W1 was.
    cl.start_campaign(1);
    cl.drop_conn(1, c, "unreachable");
    cl.exchange(1, a);
    cl.exchange(1, b);
    cl.exchange(1, a);
    assert_eq!(cl.fetches.len(), 1, "A lacks W2");
    cl.deliver_fetch(0);
    assert_eq!(term_of(&cl, 1), Some(Term(4)));
    assert_eq!(
        cl.proposers[1].core.as_ref().and_then(|c| c.donor()),
        Some(b)
    );
    cl.append_record(1);
    cl.exchange(1, a);
    cl.exchange(1, b);
    cl.check();
    assert!(
        cl.commit_by_term
            .get(&Term(4))
            .is_some_and(|&l| l > Mem::START),
        "term 4 commits: {:?}",
        cl.commit_by_term
    );
    assert!(
        cl.commit_by_term
            .get(&Term(3))
            .is_none_or(|&l| l <= Mem::START)
    );
}

/// The connection-reuse hazard the model found (seed 2159), step by step: a proposer that
/// re-elects itself after a membership change must not keep a connection that carried appends
/// of its earlier term. The acceptor at the other end may answer its idle flush of those appends
/// after it voted in the new term and before it processes `elected` (whose start point then
/// truncates them): an `AppendResponse` of the new term describing WAL it is about to drop.
#[test]
fn re_election_makes_every_connection_anew_trace() {
    let (a, b, c) = (0, 1, 2);
    let mut cl = Cluster::<Mem>::new(0, std::env::var("MODEL_TRACE").is_ok(), Mode::Fixed);
    cl.scripted = true;
    let term_of = |cl: &Cluster<Mem>| cl.proposers[0].core.as_ref().map(|c| c.term());

    // Term 1 in generation 1, elected by A, B and C; W1 committed everywhere.
    cl.start_campaign(0);
    for x in [3, 4] {
        cl.drop_conn(0, x, "not a member");
    }
    for _ in 0..2 {
        for x in [a, b, c] {
            cl.exchange(0, x);
        }
    }
    assert_eq!(term_of(&cl), Some(Term(1)));
    cl.append_record(0);
    for x in [a, b, c] {
        cl.exchange(0, x);
        cl.idle_flush(0, x);
        cl.exchange(0, x);
    }
    let w1_end = cl.proposers[0].commit;
    assert!(w1_end > Mem::START, "W1 is committed");

    // W2 reaches A only, not yet flushed: A's connection is dirty.
    cl.append_record(0);
    cl.exchange(0, a);

    // The operator moves every member to generation 2; the proposer learns it on a new
    // connection to B.
    let g2 = configuration(2, &[a, b, c], None);
    for x in [a, b, c] {
        cl.sk_mut(x).set_membership(g2.clone()).unwrap();
    }
    cl.drop_conn(0, b, "refused: generation 2");
    cl.connect(0, b);
    cl.exchange(0, b);
    assert!(
        !cl.conns[0][a].up && !cl.conns[0][c].up,
        "every connection but the new one is made anew"
    );

    // Re-elected by B and C (donor at the end of W1), then A joins on a fresh connection: its
    // vote flushes W2, `elected` truncates it to the term start, and W2 comes again in term 2.
    cl.connect(0, c);
    cl.exchange(0, c);
    cl.exchange(0, b);
    cl.exchange(0, c);
    assert_eq!(term_of(&cl), Some(Term(2)));
    assert_eq!(
        cl.proposers[0].core.as_ref().map(|c| c.term_start()),
        Some(w1_end)
    );
    cl.connect(0, a);
    cl.exchange(0, a);
    cl.idle_flush(0, a);
    cl.exchange(0, a);
    cl.exchange(0, b);
    cl.idle_flush(0, b);
    cl.exchange(0, b);
    cl.check();
    assert!(cl.proposers[0].commit > w1_end, "W2 is committed in term 2");
}
