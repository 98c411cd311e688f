//! The seeded simulation of the timeline manager: the real [`ManagerCore`] over real
//! [`Timeline`]s and [`GlobalTimelines`] of N nodes (3 by default), each on a simulated disk
//! ([`SimFs`]) of its own, backing up into one real in-memory object store, driven by one seeded
//! schedule. A proposer elects itself on a quorum, appends WAL to the nodes it reaches (a node
//! may miss appends and lag) and commits what a quorum acknowledged in its term; each node's
//! manager actions are performed in any order (as the tokio driver's concurrent tasks may
//! finish); the store has outages; readers take and release holds; any node crashes or loses
//! power between any two steps and restarts (and a new term may follow); a node is replaced by
//! pulling the timeline from the most advanced one; the timeline is deleted on every node and
//! created again with the same ids.
//!
//! Invariants, checked after every step:
//! - a crashed node restarts (its timelines load), and its WAL still reaches what it
//!   acknowledged;
//! - no node has removed a local segment that its persisted commit LSN, backup LSN or peers'
//!   horizon still needs, nor one a live reader's hold needs;
//! - every node's WAL is a prefix of the proposer's (byte for byte, below its flush LSN);
//! - every committed (quorum-acknowledged) byte is in the store or, identical, on a quorum of
//!   nodes; a new term's proposer finds all of it among its voters;
//! - a pull yields a verified copy of the donor's WAL or a clear refusal;
//! - a deleted timeline's remote objects are gone before a timeline with the same ids exists
//!   again, and while they are not, creating it is refused (also across restarts).
//!
//! Knobs: `MANAGER_SIM_SEEDS` (default 1000 on three nodes, 1000 on one) seeds of
//! `MANAGER_SIM_STEPS` (default 200) steps; `MANAGER_SIM_NODES` (default 3) nodes for the
//! replay; `MANAGER_SIM_SEED=s` replays one (the `#[ignore]`d `manager_sim_replay_one_seed`),
//! and a failure prints the command that does it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pg_wal::generator::WalGenerator;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sk_core::protocol::{
    AppendRequest, AppendRequestHeader, ProposerAcceptorMessage, ProposerElected,
};
use sk_core::state::{Configuration, ServerInfo};
use sk_core::storage::fs::{Fs, SimFs};
use sk_core::types::{Generation, Lsn, NodeId, TenantTimelineId, Term, TermHistory, TermLsn};

use super::tests::cfg;
use super::*;
use crate::lifecycle::observe;
use crate::registry::{CreateTimeline, EvictStep, GlobalTimelines, RestoreStep};
use crate::remove_wal::ReadHold;
use crate::test_util::{DATADIR, greeting, run, vote};
use crate::timeline::Timeline;
use crate::wal_backup::{Backup, RemoteStorage};

const SEG: u64 = 1 << 20;
const START: Lsn = Lsn(SEG);
/// The simulated nodes' `--partial-backup-timeout` (a step moves the clock 20 ms to 2.5 s).
const PARTIAL_TIMEOUT: Duration = Duration::from_secs(1);
/// The simulated nodes' `--eviction-min-idle`.
const EVICT_AFTER: Duration = Duration::from_secs(2);

/// The control file in `dir` as the next start-up would read it (loaded without the fsyncs a
/// load does, which would make the simulated disk durable where the node did not).
fn control_on_disk(fs: &Fs, dir: &Path) -> sk_core::state::TimelinePersistentState {
    let no_sync = true;
    (*crate::control_file::FileControlStore::load_in(fs.clone(), dir, no_sync)
        .expect("reading the control file"))
    .clone()
}

/// What a node's published state calls persisted and a restart must find again:
/// `(term, commit, backup, peers' horizon)`.
type Marks = (Term, Lsn, Lsn, Lsn);

fn marks_of(tl: &Timeline) -> Marks {
    let (_, persisted) = tl.lsns();
    (
        tl.positions().term,
        persisted.commit_lsn,
        persisted.backup_lsn,
        persisted.peer_horizon_lsn,
    )
}

/// Whether `now` is at least `before` in every mark.
fn covers(now: Marks, before: Marks) -> bool {
    now.0 >= before.0 && now.1 >= before.1 && now.2 >= before.2 && now.3 >= before.3
}

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The proposer (a primary whose own WAL is every byte it generated): its term, the history
/// it was elected with, and what a quorum acknowledged.
struct Proposer {
    term: u64,
    history: TermHistory,
    walgen: WalGenerator,
    /// Every WAL byte generated from [`START`] on (the primary's WAL).
    sent: Vec<u8>,
    /// Acknowledged by a quorum in this or an earlier term.
    committed: Lsn,
}

impl Proposer {
    fn end(&self) -> Lsn {
        Lsn(START.0 + self.sent.len() as u64)
    }
}

/// One live timeline on a node and its manager.
struct Live {
    tl: Arc<Timeline>,
    core: ManagerCore,
    /// Actions asked for and not yet performed (in flight).
    pending: Vec<Action>,
    /// Readers' holds, each with its connection (counted: an eviction is refused meanwhile).
    holds: Vec<(Lsn, ReadHold, crate::timeline::ConnectionGuard)>,
    /// A control-file save in flight between its phases ([`Timeline::maybe_persist`]):
    /// appends, votes, evictions and crashes land between them.
    save: Option<SaveInFlight>,
}

/// A two-phase control-file save, taken or written.
enum SaveInFlight {
    Taken(crate::control_file::PendingSave),
    Written(Option<crate::control_file::WrittenSave>),
}

/// One safekeeper.
struct Node {
    id: u64,
    sim: Arc<SimFs>,
    fs: Fs,
    /// `None` only while the process is down (within a crash step).
    timelines: Option<GlobalTimelines>,
    /// `None` while the timeline is deleted (or not pulled), or evicted.
    live: Option<Live>,
    /// The timeline is evicted on this node (its WAL wholly in the store; `live` is `None`).
    evicted: bool,
    /// The segment the last restore brought back: below it, the node's WAL is in the store
    /// only (eviction required it), whatever the peers' horizon.
    restored_from: Option<u64>,
    /// The end of WAL this node acknowledged to the proposer (durable there).
    acked: Lsn,
    /// The term the proposer last elected this node in (0: never, or since its restart).
    elected: u64,
    /// The highest of each mark this node's published state called persisted (a restart must
    /// find at least them).
    durable: Marks,
    /// A save in flight of a timeline object the node no longer runs (evicted, or deleted and
    /// maybe created again since): it must never reach the file.
    orphan: Option<(Arc<Timeline>, SaveInFlight)>,
}

impl Node {
    fn tls(&self) -> &GlobalTimelines {
        self.timelines.as_ref().expect("the node is up")
    }
}

struct Sim {
    seed: u64,
    rng: StdRng,
    rt: tokio::runtime::Runtime,
    backup: Backup,
    nodes: Vec<Node>,
    ttid: TenantTimelineId,
    proposer: Proposer,
    store_down: bool,
    /// A node the proposer cannot reach for a while (a partition): it lags by many segments,
    /// and the peers' horizon with it.
    cut_off: Option<usize>,
    now: Duration,
    stats: Stats,
    trace: bool,
    log: Vec<String>,
}

impl Sim {
    fn new(seed: u64, n: usize) -> Sim {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let store = RemoteStorage::with_store(
            Arc::new(object_store::memory::InMemory::new()),
            "memory://sim",
        );
        let nodes = (1..=n as u64)
            .map(|id| {
                let (sim, fs) = SimFs::with_dir(Path::new(DATADIR));
                let timelines = load(&fs, id);
                timelines.set_remote_storage(true);
                Node {
                    id,
                    sim,
                    fs,
                    timelines: Some(timelines),
                    live: None,
                    evicted: false,
                    restored_from: None,
                    acked: START,
                    elected: 0,
                    durable: Default::default(),
                    orphan: None,
                }
            })
            .collect();
        let mut s = Sim {
            seed,
            rng: StdRng::seed_from_u64(seed),
            rt,
            backup: Backup::new(store, 2),
            nodes,
            ttid: greeting(7, SEG).ttid(),
            proposer: Proposer {
                term: 0,
                history: TermHistory::empty(),
                walgen: WalGenerator::new(42, SEG, START).unwrap(),
                sent: Vec::new(),
                committed: START,
            },
            store_down: false,
            cut_off: None,
            now: Duration::ZERO,
            stats: Stats::default(),
            trace: std::env::var("MANAGER_SIM_TRACE").is_ok(),
            log: Vec::new(),
        };
        s.create();
        s
    }

    fn quorum(&self) -> usize {
        self.nodes.len() / 2 + 1
    }

    fn note(&mut self, what: String) {
        if self.trace {
            eprintln!("[{}] {what}", self.log.len());
        }
        self.log.push(what);
    }

    /// Creates the timeline on every node (explicitly, as an operator does) and elects term 1
    /// at [`START`] on all of them.
    fn create(&mut self) {
        let g = greeting(7, SEG);
        self.proposer = Proposer {
            term: 1,
            history: TermHistory(vec![TermLsn {
                term: Term(1),
                lsn: START,
            }]),
            walgen: WalGenerator::new(42, SEG, START).unwrap(),
            sent: Vec::new(),
            committed: START,
        };
        for i in 0..self.nodes.len() {
            let tl = crate::blocking::section(|| {
                self.nodes[i].tls().create_explicit(&CreateTimeline {
                    ttid: self.ttid,
                    server: ServerInfo {
                        pg_version: g.pg_version,
                        system_id: g.system_id,
                        wal_seg_size: g.wal_seg_size,
                    },
                    start_lsn: START,
                    mconf: Configuration::default(),
                })
            })
            .expect("the timeline is created");
            self.nodes[i].acked = START;
            self.nodes[i].durable = Default::default();
            self.nodes[i].restored_from = None;
            self.attach(i, tl);
            assert!(vote(&self.nodes[i].live.as_ref().unwrap().tl, 1).vote_given);
            self.elect_on(i);
        }
    }

    /// Starts a manager for `tl` on node `i`, as the supervisor does.
    fn attach(&mut self, i: usize, tl: Arc<Timeline>) {
        tl.set_remote(self.backup.storage.clone());
        let mut core = ManagerCore::new(
            Config {
                partial_timeout: Some(PARTIAL_TIMEOUT),
                evict_after: Some(EVICT_AFTER),
                ..cfg()
            },
            observe(&tl),
            tl.removed_below(),
        );
        let pending = core.step(Event::Tick(self.now));
        let node = &mut self.nodes[i];
        node.elected = 0;
        node.evicted = false;
        node.live = Some(Live {
            tl,
            core,
            pending,
            holds: Vec::new(),
            save: None,
        });
    }

    /// Sends node `i` the proposer's `ProposerElected` for its term, streaming from the highest
    /// point the node's WAL has in common with the proposer's history (as a real proposer
    /// computes it from the node's vote response).
    fn elect_on(&mut self, i: usize) {
        let Some(live) = &self.nodes[i].live else {
            return;
        };
        let tl = live.tl.clone();
        let st = tl.status();
        let history = self.proposer.history.clone();
        let start =
            TermHistory::find_highest_common_point(&history, &st.term_history, st.flush_lsn)
                .expect("the histories are consistent")
                .map_or(START, |p| p.lsn);
        run(&tl, ProposerAcceptorMessage::Greeting(greeting(7, SEG)));
        run(
            &tl,
            ProposerAcceptorMessage::Elected(ProposerElected {
                generation: Generation(0),
                term: Term(self.proposer.term),
                start_streaming_at: start,
                term_history: history,
            }),
        );
        let node = &mut self.nodes[i];
        // What the node held above `start` is truncated: it was not this history's WAL (a
        // lost committed byte would show in `check_content`, which counts copies).
        node.acked = node.acked.min(start);
        node.elected = self.proposer.term;
    }

    /// A new term: the proposer asks a random quorum of the nodes for votes, takes the most
    /// advanced voter's WAL as the term's start, and is elected on its voters.
    fn new_term(&mut self) {
        // A new proposer's greeting restores an evicted node.
        let candidates: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].live.is_some() || (self.nodes[i].evicted && self.restore(i)))
            .collect();
        if candidates.len() < self.quorum() {
            return;
        }
        let mut voters = candidates;
        while voters.len() > self.quorum() && self.rng.random_bool(0.5) {
            let k = self.rng.random_range(0..voters.len());
            voters.swap_remove(k);
        }
        let term = self.proposer.term + 1;
        let mut best: Option<(Term, Lsn, TermHistory)> = None;
        for &i in &voters {
            let v = vote(&self.nodes[i].live.as_ref().unwrap().tl, term);
            assert!(v.vote_given, "seed {}: no vote in term {term}", self.seed);
            let key = (v.term_history.last_log_term(), v.flush_lsn);
            if best.as_ref().is_none_or(|b| key > (b.0, b.1)) {
                best = Some((key.0, key.1, v.term_history));
            }
        }
        let (_, flush, mut history) = best.expect("a quorum voted");
        // Every committed byte is on some voter (any two quorums intersect).
        assert!(
            flush >= self.proposer.committed,
            "seed {}: term {term}'s voters end at {flush}, below the committed {}\n{}",
            self.seed,
            self.proposer.committed,
            self.replay_hint()
        );
        self.proposer.term = term;
        history.0.push(TermLsn {
            term: Term(term),
            lsn: flush,
        });
        self.proposer.history = history;
        self.note(format!("term {term} elected at {flush} by {voters:?}"));
        for &i in &voters {
            self.elect_on(i);
        }
        self.stats.terms += 1;
    }

    /// Feeds node `i`'s manager `event` and then what the timeline looks like now.
    fn feed(&mut self, i: usize, event: Event) {
        let (seed, now) = (self.seed, self.now);
        let Some(live) = self.nodes[i].live.as_mut() else {
            return;
        };
        let mut out = live.core.step(event);
        out.extend(live.core.step(Event::Observed(observe(&live.tl))));
        out.extend(live.core.step(Event::Tick(now)));
        for a in out {
            match a {
                Action::Missing { segno } => panic!(
                    "seed {seed}: segment {segno} reported missing: nothing in this schedule \
                     removes a segment that is not stored"
                ),
                Action::Finished => {}
                a => live.pending.push(a),
            }
        }
    }

    /// The primary generates a chunk of WAL; the proposer streams what each node it reaches
    /// lacks and commits what a quorum of this term's nodes acknowledged.
    fn append(&mut self) {
        if self.nodes.iter().all(|n| n.live.is_none() && !n.evicted) {
            return;
        }
        let size = self.rng.random_range(20_000..500_000);
        let mut wal = Vec::new();
        self.proposer.walgen.fill(&mut wal, size, &[5; 700]);
        self.proposer.sent.extend_from_slice(&wal);
        let mut reached = Vec::new();
        for i in 0..self.nodes.len() {
            let present = self.nodes[i].live.is_some() || self.nodes[i].evicted;
            if present && self.cut_off != Some(i) && self.rng.random_bool(0.8) {
                // The proposer's connection restores an evicted node (unless the store is
                // down: the node is not reached this time).
                if self.nodes[i].evicted && !self.restore(i) {
                    continue;
                }
                self.stream_to(i);
                reached.push(i + 1);
            }
        }
        let mut acks: Vec<Lsn> = self
            .nodes
            .iter()
            .filter(|n| n.elected == self.proposer.term)
            .map(|n| n.acked)
            .collect();
        acks.sort_unstable_by(|a, b| b.cmp(a));
        if let Some(&q) = acks.get(self.quorum() - 1) {
            self.proposer.committed = self.proposer.committed.max(q);
        }
        self.note(format!(
            "append ..{} to nodes {reached:?}, committed {}",
            self.proposer.end(),
            self.proposer.committed
        ));
    }

    /// The proposer brings node `i` to the end of its WAL (electing it in this term first if
    /// need be), with the commit LSN and the peers' horizon it knows.
    fn stream_to(&mut self, i: usize) {
        if self.nodes[i].elected != self.proposer.term {
            self.elect_on(i);
        }
        let end = self.proposer.end();
        // The peers' horizon: what every node has (the proposer's truncate LSN).
        let horizon = self
            .nodes
            .iter()
            .map(|n| n.acked)
            .min()
            .unwrap()
            .min(self.proposer.committed);
        let commit = self.proposer.committed;
        let tl = self.nodes[i].live.as_ref().unwrap().tl.clone();
        let from = tl.positions().flush_lsn;
        let bytes = &self.proposer.sent[(from.0 - START.0) as usize..];
        for (k, piece) in bytes.chunks(sk_core::protocol::MAX_SEND_SIZE).enumerate() {
            let b = Lsn(from.0 + (k * sk_core::protocol::MAX_SEND_SIZE) as u64);
            run(
                &tl,
                ProposerAcceptorMessage::AppendRequest(AppendRequest {
                    h: AppendRequestHeader {
                        generation: Generation(0),
                        term: Term(self.proposer.term),
                        begin_lsn: b,
                        end_lsn: Lsn(b.0 + piece.len() as u64),
                        commit_lsn: commit,
                        truncate_lsn: horizon,
                    },
                    wal_data: Bytes::copy_from_slice(piece),
                }),
            );
        }
        assert_eq!(tl.positions().flush_lsn, end, "seed {}: flushed", self.seed);
        self.nodes[i].acked = end;
        self.feed(i, Event::Observed(observe(&tl)));
    }

    /// The proposer tells the live nodes of its term the commit LSN (an empty append, as its
    /// keep-alive does): a quiet node's commit LSN reaches its end of WAL.
    fn heartbeat(&mut self) {
        let commit = self.proposer.committed;
        for i in 0..self.nodes.len() {
            let Some(live) = &self.nodes[i].live else {
                continue;
            };
            if self.nodes[i].elected != self.proposer.term || self.cut_off == Some(i) {
                continue;
            }
            let tl = live.tl.clone();
            let end = tl.positions().flush_lsn;
            run(
                &tl,
                crate::test_util::append_msg(self.proposer.term, end, &[], commit),
            );
            self.feed(i, Event::Observed(observe(&tl)));
        }
    }

    /// A quiet spell: no new WAL for seconds while the managers do their work (the
    /// primary's keep-alive carries the commit LSN): partial uploads, evictions.
    fn quiet(&mut self) {
        self.note("quiet spell".into());
        self.heartbeat();
        for _ in 0..4 {
            self.now += Duration::from_millis(self.rng.random_range(300..1500));
            for i in 0..self.nodes.len() {
                self.feed(i, Event::Tick(self.now));
            }
            for _ in 0..12 {
                self.perform();
            }
        }
    }

    /// Performs one action in flight of a random node, chosen at random (they finish in any
    /// order).
    fn perform(&mut self) {
        let i = self.rng.random_range(0..self.nodes.len());
        // An orphan runs once the timeline is live on the node again (created again, pulled or
        // restored): the moment its write would do harm.
        if self.nodes[i].orphan.is_some()
            && self.nodes[i].live.is_some()
            && self.rng.random_bool(0.5)
        {
            self.advance_orphan(i);
            return;
        }
        let Some(live) = self.nodes[i].live.as_mut() else {
            return;
        };
        if live.save.is_some() && (live.pending.is_empty() || self.rng.random_bool(0.5)) {
            self.advance_save(i);
            return;
        }
        if live.pending.is_empty() {
            return;
        }
        let k = self.rng.random_range(0..live.pending.len());
        let action = live.pending.swap_remove(k);
        let tl = live.tl.clone();
        let event = match action.clone() {
            Action::List => Event::Listed(if self.store_down {
                None
            } else {
                let l = self
                    .rt
                    .block_on(self.backup.storage.list_segments(&tl.ttid, SEG))
                    .expect("listing the in-memory store");
                Some(l.into_iter().map(|(n, _)| n).collect())
            }),
            Action::Upload {
                segno,
                valid_from,
                known_stored,
            } => {
                let ok = !self.store_down
                    && self
                        .rt
                        .block_on(self.backup.upload(&tl, segno, valid_from, known_stored))
                        .is_ok();
                Event::Uploaded { segno, ok }
            }
            Action::SetBackupLsn(lsn) => {
                crate::blocking::section(|| tl.set_backup_lsn(lsn));
                Event::Observed(observe(&tl))
            }
            Action::Save if self.rng.random_bool(0.5) => {
                let ok = crate::blocking::section(|| tl.maybe_persist(true)).is_ok();
                Event::Saved { ok }
            }
            Action::Save => match crate::blocking::section(|| tl.begin_save(true)) {
                // Its phases run as later steps.
                Some(taken) => {
                    self.nodes[i].live.as_mut().expect("a live timeline").save =
                        Some(SaveInFlight::Taken(taken));
                    self.note(format!("node {}: save taken", i + 1));
                    return;
                }
                None => Event::Saved { ok: true },
            },
            Action::Remove { horizon } => {
                crate::blocking::section(|| tl.remove_segments_below(horizon))
                    .expect("removing segments");
                Event::Removed {
                    first_local: tl.removed_below(),
                }
            }
            Action::UploadPartial {
                upto, valid_from, ..
            } => {
                let ok = !self.store_down
                    && self
                        .rt
                        .block_on(self.backup.upload_partial(&tl, upto, valid_from))
                        .is_ok();
                if ok {
                    self.stats.partial_uploads += 1;
                }
                Event::UploadedPartial { upto, ok }
            }
            Action::RemovePartials { below } => {
                let ok = !self.store_down
                    && self
                        .rt
                        .block_on(
                            self.backup
                                .storage
                                .remove_partials_below(&tl.ttid, SEG, below),
                        )
                        .is_ok();
                Event::RemovedPartials { below, ok }
            }
            Action::Evict { end } => {
                // Sometimes the process dies right after the flag, or after the registry moved
                // it (before its files are removed).
                let upto = match self.rng.random_range(0..8) {
                    0 => EvictStep::Flag,
                    1 => EvictStep::Registry,
                    _ => EvictStep::All,
                };
                let r =
                    crate::blocking::section(|| self.nodes[i].tls().evict_steps(&tl, end, upto));
                self.note(format!(
                    "node {}: evict at {end} ({upto:?}) -> {r:?}",
                    i + 1
                ));
                let ok = r.is_ok();
                drop(tl);
                self.feed(i, Event::Evicted { ok });
                if ok {
                    self.stats.evictions += 1;
                    if let Some(live) = self.nodes[i].live.take() {
                        self.orphan_save(i, live);
                    }
                    let node = &mut self.nodes[i];
                    node.evicted = true;
                    node.elected = 0;
                    if upto != EvictStep::All {
                        self.crash(i);
                    }
                }
                return;
            }
            a => panic!("seed {}: {a:?} is not performed by the driver", self.seed),
        };
        self.note(format!("node {}: {action:?} -> {event:?}", i + 1));
        let removed = matches!(action, Action::Remove { .. });
        drop(tl);
        self.feed(i, event);
        // The moment the review found (issue 26): a kill right after a removal.
        if removed && self.rng.random_bool(0.3) {
            self.crash(i);
        }
    }

    /// Runs the next phase of node `i`'s save in flight: the write (outside the acceptor
    /// lock), or the finish (the manager hears of it then).
    fn advance_save(&mut self, i: usize) {
        let live = self.nodes[i].live.as_mut().expect("a live timeline");
        let tl = live.tl.clone();
        let event = match live.save.take().expect("a save in flight") {
            SaveInFlight::Taken(taken) => {
                let r = crate::blocking::section(|| taken.write());
                let what = match &r {
                    Ok(Some(_)) => "written".to_string(),
                    Ok(None) => "skipped: the file holds a later save".to_string(),
                    Err(e) => format!("failed: {e}"),
                };
                self.note(format!("node {}: save {what}", i + 1));
                let live = self.nodes[i].live.as_mut().expect("a live timeline");
                match r {
                    Ok(Some(w)) => {
                        live.save = Some(SaveInFlight::Written(Some(w)));
                        return;
                    }
                    // A later save holds these values or newer.
                    Ok(None) => Event::Saved { ok: true },
                    Err(_) => Event::Saved { ok: false },
                }
            }
            SaveInFlight::Written(w) => {
                crate::blocking::section(|| tl.finish_save(w));
                self.note(format!("node {}: save finished", i + 1));
                Event::Saved { ok: true }
            }
        };
        drop(tl);
        self.feed(i, event);
    }

    /// Runs the next phase of node `i`'s orphaned save: its write must not happen (the
    /// eviction's flag is a later save; a deleted timeline's writes are refused).
    fn advance_orphan(&mut self, i: usize) {
        let (tl, save) = self.nodes[i].orphan.take().expect("an orphaned save");
        match save {
            SaveInFlight::Taken(taken) => {
                self.stats.orphans_run += 1;
                let r = crate::blocking::section(|| taken.write());
                self.note(format!(
                    "node {}: orphaned save -> {:?}",
                    i + 1,
                    r.as_ref().map(|w| w.is_some())
                ));
                assert!(
                    !matches!(r, Ok(Some(_))),
                    "seed {}: node {}: a save begun before the timeline was evicted or deleted \
                     was written\n{}",
                    self.seed,
                    i + 1,
                    self.replay_hint()
                );
            }
            SaveInFlight::Written(w) => crate::blocking::section(|| tl.finish_save(w)),
        }
    }

    /// Moves node `i`'s save in flight, if any, to its orphan (its timeline object is gone
    /// from the node).
    fn orphan_save(&mut self, i: usize, live: Live) {
        if let Some(save) = live.save {
            self.nodes[i].orphan = Some((live.tl, save));
        }
    }

    /// Node `i`'s process dies (or its machine loses power), and it starts again.
    fn crash(&mut self, i: usize) {
        let pending_before = self.nodes[i].tls().pending_remote_deletions();
        let power = self.rng.random_bool(0.5);
        let loss_seed: u64 = self.rng.random();
        {
            let node = &mut self.nodes[i];
            // The process is gone: no thread of it (a segment preparation, a save) touches the
            // disk.
            node.live = None;
            node.orphan = None;
            node.evicted = false;
            node.timelines = None;
            if power {
                let mut rng = StdRng::seed_from_u64(loss_seed);
                node.sim.power_loss(&mut |n| rng.random_range(0..=n));
            } else {
                node.sim.process_crash();
            }
        }
        self.note(format!("node {} crashes (power loss: {power})", i + 1));
        self.stats.crashes += 1;
        let timelines = self.restart(&self.nodes[i].fs, self.nodes[i].id, "a node");
        self.nodes[i].timelines = Some(timelines);
        assert_eq!(
            self.nodes[i].tls().pending_remote_deletions(),
            pending_before,
            "seed {}: a pending remote deletion survives a restart",
            self.seed
        );
        if let Some(tl) = self.nodes[i].tls().get(&self.ttid) {
            let found = marks_of(&tl);
            let d = self.nodes[i].durable;
            assert!(
                covers(found, d),
                "seed {}: node {} lost persisted state: (term, commit, backup, horizon) {found:?} \
                 after the restart, {d:?} before it\n{}",
                self.seed,
                i + 1,
                self.replay_hint()
            );
            let flush = tl.positions().flush_lsn;
            assert!(
                flush >= self.nodes[i].acked,
                "seed {}: node {} lost WAL it acknowledged: flush {flush} < acked {}\n{}",
                self.seed,
                i + 1,
                self.nodes[i].acked,
                self.replay_hint()
            );
            self.attach(i, tl);
            // Where a loss would show: right after the restart.
            self.check_content();
            // Sometimes the proposer restarted too: a new term.
            if self.rng.random_bool(0.3) {
                self.new_term();
            }
        } else if let Some(e) = self.nodes[i].tls().get_evicted(&self.ttid) {
            assert!(
                e.end_lsn() >= self.nodes[i].acked,
                "seed {}: evicted node {} lost WAL it acknowledged: its end {} < acked {}\n{}",
                self.seed,
                i + 1,
                e.end_lsn(),
                self.nodes[i].acked,
                self.replay_hint()
            );
            self.nodes[i].evicted = true;
            self.nodes[i].elected = 0;
        }
    }

    /// Restores node `i`'s evicted timeline as a proposer's or reader's connection does
    /// (download, then the registry's steps; sometimes the process dies at one of them, and
    /// the node restarts still evicted). Returns whether it is resident now.
    fn restore(&mut self, i: usize) -> bool {
        if self.store_down {
            return false;
        }
        let tls = self.nodes[i].tls();
        let e = tls.get_evicted(&self.ttid).expect("evicted");
        let data = e.segment_to_restore().map(|segno| {
            self.rt
                .block_on(crate::evict::download(
                    &self.backup.storage,
                    &self.ttid,
                    SEG,
                    segno,
                    e.end_lsn(),
                ))
                .expect("the in-memory store answers")
                .unwrap_or_else(|| {
                    panic!(
                        "seed {}: node {}'s evicted WAL (segment {segno} up to {}) is not in \
                         the store\n{}",
                        self.seed,
                        i + 1,
                        e.end_lsn(),
                        self.replay_hint()
                    )
                })
        });
        let upto = match self.rng.random_range(0..10) {
            0 => RestoreStep::Download,
            1 => RestoreStep::Open,
            _ => RestoreStep::All,
        };
        let r = crate::blocking::section(|| tls.restore_steps(&self.ttid, data.as_deref(), upto));
        self.note(format!(
            "node {}: restore ({upto:?}) -> {:?}",
            i + 1,
            r.as_ref()
                .map(|t| t.positions().flush_lsn)
                .map_err(|e| e.to_string())
        ));
        match r {
            Ok(tl) => {
                assert!(
                    tl.positions().flush_lsn >= self.nodes[i].acked,
                    "seed {}: restored node {} lost WAL it acknowledged\n{}",
                    self.seed,
                    i + 1,
                    self.replay_hint()
                );
                self.stats.restores += 1;
                let from = tl.positions().flush_lsn.segment_number(SEG);
                let node = &mut self.nodes[i];
                node.restored_from = Some(from);
                self.attach(i, tl);
                true
            }
            Err(e) if upto == RestoreStep::All => panic!(
                "seed {}: node {}'s restore failed: {e}\n{}",
                self.seed,
                i + 1,
                self.replay_hint()
            ),
            Err(_) => {
                self.crash(i);
                false
            }
        }
    }

    /// Starts node `id` on `fs` again after a crash (`who`: which node, for the failure), with
    /// remote storage on; a node that does not start fails the seed.
    fn restart(&self, fs: &Fs, id: u64, who: &str) -> GlobalTimelines {
        match GlobalTimelines::load_in(fs.clone(), Path::new(DATADIR), NodeId(id), false) {
            Ok(t) => {
                t.set_remote_storage(true);
                t
            }
            Err(e) => panic!(
                "seed {}: {who} (id {id}) does not start after a crash: {e}\n{}",
                self.seed,
                self.replay_hint()
            ),
        }
    }

    /// Node `target` is replaced (issue 26): a new node with the same id, on a disk of its
    /// own, pulls the timeline from the most advanced node while the donor goes on (appends,
    /// its manager's actions, a new term), and may lose power at any point of the pull. The
    /// pull yields a verified copy of the donor's WAL below the snapshot's end (the WAL below
    /// its start served from the store), or a clear refusal. An installed copy replaces the
    /// node; a refused one leaves the old node in place.
    fn pull(&mut self) {
        let Some(donor) = (0..self.nodes.len())
            .filter(|&i| self.nodes[i].live.is_some())
            .max_by_key(|&i| {
                let p = self.nodes[i].live.as_ref().unwrap().tl.positions();
                (p.last_log_term, p.flush_lsn)
            })
        else {
            return;
        };
        let target = if self.nodes.len() == 1 {
            None
        } else {
            Some((donor + self.rng.random_range(1..self.nodes.len())) % self.nodes.len())
        };
        let tl = self.nodes[donor].live.as_ref().unwrap().tl.clone();
        // What the puller's status request saw.
        let best = (tl.status().last_log_term, tl.positions().flush_lsn);
        let mut snap = match crate::pull::Snapshot::begin(tl.clone(), true) {
            Ok(s) => s,
            Err(e) => panic!("seed {}: no snapshot point: {e}", self.seed),
        };
        let (start, flush) = snap.range();
        let mut bytes = Vec::new();
        let mut aborted = None;
        loop {
            match snap.next_frame() {
                Ok(Some(f)) => bytes.extend_from_slice(&f),
                Ok(None) => break,
                Err(e) => {
                    aborted = Some(e);
                    break;
                }
            }
            // The cluster goes on meanwhile.
            match self.rng.random_range(0..12) {
                0..3 => self.append(),
                3..7 => self.perform(),
                7 => self.new_term(),
                _ => {}
            }
            if !self.nodes[donor]
                .live
                .as_ref()
                .is_some_and(|l| Arc::ptr_eq(&l.tl, &tl))
            {
                // The donor crashed (right after a removal): its stream ends here, whole if
                // its END frame was sent.
                if !snap.ended() {
                    aborted = Some("the donor crashed".to_string());
                }
                break;
            }
        }
        drop(snap);
        self.note(format!(
            "node {} snapshots [{start}, {flush}) in {} bytes for node {:?}, aborted: {aborted:?}",
            donor + 1,
            bytes.len(),
            target.map(|t| t + 1)
        ));
        // The replacement takes the replaced node's id; alone, the puller is a new node.
        let id = target.map_or(self.nodes.len() as u64 + 1, |t| self.nodes[t].id);
        let (psim, pfs) = SimFs::with_dir(Path::new(DATADIR));
        let puller = load(&pfs, id);
        puller.set_remote_storage(true);
        let (tmp, guard) = crate::blocking::section(|| puller.begin_pull(&self.ttid))
            .expect("the first pull on a new node begins");
        let crash_at = self.rng.random_range(0..80);
        let crash = self.rng.random_bool(0.3);
        if crash {
            psim.arm_crash_after(crash_at);
        }
        let r = crate::blocking::section(|| {
            crate::pull::pull_from(&puller, self.ttid, &tmp, &mut &bytes[..], "donor", best)
        });
        drop(guard);
        let crashed = crash && psim.crash_point_reached();
        if r.is_ok() {
            self.stats.pulls.installed += 1;
        } else {
            self.stats.pulls.refused += 1;
        }
        self.stats.pulls.puller_crashes += u64::from(crashed);
        self.note(format!(
            "pull -> {:?}, puller crashed: {crashed}",
            r.as_ref().map(|p| p.flush_lsn).map_err(|e| e.to_string())
        ));
        let puller = if crashed || self.rng.random_bool(0.3) {
            // The puller loses power (at its crash point, or after the pull) and restarts.
            drop(puller);
            let mut rng = StdRng::seed_from_u64(self.rng.random());
            psim.power_loss(&mut |n| rng.random_range(0..=n));
            self.restart(&pfs, id, "the puller")
        } else {
            psim.disarm();
            puller
        };
        match (&r, aborted) {
            (Err(e), Some(why)) => assert!(
                e.to_string().contains("ended early"),
                "seed {}: an aborted snapshot ({why}) is refused as such, not: {e}",
                self.seed
            ),
            (Ok(_), Some(why)) => panic!(
                "seed {}: a snapshot aborted by {why} was installed\n{}",
                self.seed,
                self.replay_hint()
            ),
            (Err(e), None) if !crashed => panic!(
                "seed {}: a whole snapshot [{start}, {flush}) was refused: {e}\n{}",
                self.seed,
                self.replay_hint()
            ),
            _ => {}
        }
        let Some(pulled) = puller.get(&self.ttid) else {
            assert!(
                crashed || r.is_err(),
                "seed {}: a pull that succeeded is gone after a power loss",
                self.seed
            );
            return;
        };
        // Installed (before or despite the crash): the whole, verified copy.
        assert_eq!(
            pulled.positions().flush_lsn,
            flush,
            "seed {}: the pulled timeline ends elsewhere than its snapshot",
            self.seed
        );
        self.check_wal_of(&pulled, &pfs, flush, "the pulled timeline");
        // The new node takes the old one's place (a membership switch keeps the count) once it
        // has caught up; what the old one held is gone with it.
        let Some(t) = target else { return };
        if self.nodes[t].live.is_none() && !self.nodes[t].evicted {
            // Deleted meanwhile on the cluster: the pulled copy is not installed.
            return;
        }
        self.nodes[t] = Node {
            id,
            sim: psim,
            fs: pfs,
            timelines: Some(puller),
            live: None,
            evicted: false,
            restored_from: None,
            acked: START,
            elected: 0,
            durable: Default::default(),
            orphan: None,
        };
        self.attach(t, pulled);
        // The membership switches once the new node has caught up with the proposer.
        self.stream_to(t);
        self.stats.replacements += 1;
        self.note(format!("node {} replaced by the pulled copy", t + 1));
        self.check_content();
    }

    /// The operator deletes the timeline on every node: each manager stops, its work in
    /// flight is dropped.
    fn delete(&mut self) {
        if self.nodes.iter().any(|n| n.live.is_none() && !n.evicted) {
            return;
        }
        for i in 0..self.nodes.len() {
            let live = self.nodes[i].live.take();
            self.nodes[i].evicted = false;
            crate::blocking::section(|| {
                self.nodes[i]
                    .tls()
                    .delete_timeline(&self.ttid, crate::manager::DeleteScope::Everywhere)
            })
            .expect("deleting the timeline");
            if let Some(mut live) = live {
                live.holds.clear();
                assert_eq!(live.core.step(Event::Deleted), vec![Action::Stop]);
                assert_eq!(live.core.step(Event::Stopped), vec![Action::Finished]);
                self.orphan_save(i, live);
            }
            assert!(
                !self.nodes[i].tls().pending_remote_deletions().is_empty(),
                "seed {}: a delete with remote storage leaves its objects to delete",
                self.seed
            );
        }
        self.note("delete on every node".into());
    }

    /// A node deletes the remote objects of its deletion (as the supervisor does), or, once
    /// no node has any left, the timeline is created again.
    fn after_delete(&mut self) {
        let pending: Vec<usize> = (0..self.nodes.len())
            .filter(|&i| !self.nodes[i].tls().pending_remote_deletions().is_empty())
            .collect();
        if pending.is_empty() {
            self.create();
            self.note("created again".into());
            let listed = self
                .rt
                .block_on(self.backup.storage.list_segments(&self.ttid, SEG))
                .unwrap();
            assert!(
                listed.is_empty(),
                "seed {}: the recreated timeline sees the old one's objects: {listed:?}",
                self.seed
            );
            return;
        }
        let i = pending[self.rng.random_range(0..pending.len())];
        let d = self.nodes[i].tls().pending_remote_deletions()[0].clone();
        // Creating it again there is refused meanwhile.
        let refused = crate::blocking::section(|| {
            self.nodes[i].tls().create_explicit(&CreateTimeline {
                ttid: self.ttid,
                server: ServerInfo {
                    pg_version: 150000,
                    system_id: 42,
                    wal_seg_size: SEG as u32,
                },
                start_lsn: START,
                mconf: Configuration::default(),
            })
        });
        assert!(
            matches!(
                refused,
                Err(crate::timeline::TimelineError::BeingDeleted(_))
            ),
            "seed {}: created while its remote deletion was pending: {:?}",
            self.seed,
            refused.map(|_| ())
        );
        if self.store_down {
            return;
        }
        self.rt
            .block_on(
                self.backup
                    .storage
                    .delete_objects(&d.tenant_id, d.timeline_id.as_ref()),
            )
            .expect("deleting objects");
        crate::blocking::section(|| self.nodes[i].tls().remote_deletion_done(&d.name))
            .expect("recording the remote deletion");
        self.note(format!("node {}: remote objects deleted", i + 1));
    }

    fn hold_or_release(&mut self) {
        let i = self.rng.random_range(0..self.nodes.len());
        let Some(live) = self.nodes[i].live.as_mut() else {
            return;
        };
        if !live.holds.is_empty() && self.rng.random_bool(0.5) {
            let k = self.rng.random_range(0..live.holds.len());
            live.holds.swap_remove(k);
            return;
        }
        let flush = live.tl.positions().flush_lsn;
        let lsn = Lsn(self.rng.random_range(START.0..=flush.0));
        if let Some(h) = live.tl.hold_wal(lsn) {
            live.holds.push((lsn, h, live.tl.reader_guard()));
        }
    }

    fn step(&mut self) {
        let deleted = self.nodes.iter().all(|n| n.live.is_none() && !n.evicted);
        match self.rng.random_range(0..100) {
            0..30 => self.append(),
            30..70 => self.perform(),
            70..78 => {
                self.now += Duration::from_millis(self.rng.random_range(20..2500));
                if self.rng.random_bool(0.5) {
                    self.heartbeat();
                }
                for i in 0..self.nodes.len() {
                    self.feed(i, Event::Tick(self.now));
                }
            }
            78..84 => self.hold_or_release(),
            84..88 => {
                self.store_down = !self.store_down;
                let down = self.store_down;
                self.note(format!("store down: {down}"));
            }
            88..92 => {
                let i = self.rng.random_range(0..self.nodes.len());
                self.crash(i);
            }
            92..94 if !deleted && self.rng.random_bool(0.3) => self.delete(),
            94 if !deleted => self.pull(),
            95 if !deleted => self.new_term(),
            96 if self.nodes.len() > 1 => {
                self.cut_off = match self.cut_off {
                    Some(_) => None,
                    None => Some(self.rng.random_range(0..self.nodes.len())),
                };
                let cut = self.cut_off;
                self.note(format!("cut off: {cut:?}"));
            }
            _ if deleted => self.after_delete(),
            97 => self.quiet(),
            _ => self.perform(),
        }
        if std::env::var("MANAGER_SIM_NO_CHECK").is_err() {
            self.check();
        }
    }

    /// The removal invariants (module docs), on every node.
    fn check(&mut self) {
        self.check_partials();
        let mut problem = None;
        for (i, node) in self.nodes.iter_mut().enumerate() {
            let Some(live) = &node.live else { continue };
            let now = marks_of(&live.tl);
            let d = node.durable;
            if !covers(now, d) {
                problem.get_or_insert(format!(
                    "node {}'s persisted state went back: (term, commit, backup, horizon) \
                     {now:?}, {d:?} before",
                    i + 1
                ));
            }
            node.durable = (
                d.0.max(now.0),
                d.1.max(now.1),
                d.2.max(now.2),
                d.3.max(now.3),
            );
            if live.save.is_none() {
                // No save of its own in flight: the file holds what the node calls persisted.
                let on_disk = control_on_disk(&node.fs, &live.tl.dir);
                let state = live.tl.persisted_state();
                if on_disk != *state {
                    problem.get_or_insert(format!(
                        "node {}'s control file is not its persisted state\n  file: \
                         {on_disk:?}\n  node: {state:?}",
                        i + 1
                    ));
                }
            }
        }
        if let Some(p) = problem {
            panic!("seed {}: {p}\n{}", self.seed, self.replay_hint());
        }
        for node in self.nodes.iter().filter(|n| n.evicted) {
            let e = node.tls().get_evicted(&self.ttid).unwrap_or_else(|| {
                panic!(
                    "seed {}: node {} is not evicted in its registry",
                    self.seed, node.id
                )
            });
            assert!(
                crate::wal_store::first_local_segment(&node.fs, &e.dir, SEG)
                    .unwrap()
                    .is_none(),
                "seed {}: evicted node {} keeps a segment file\n{}",
                self.seed,
                node.id,
                self.replay_hint()
            );
        }
        for node in &self.nodes {
            let Some(live) = &node.live else { continue };
            let tl = &live.tl;
            let first_local = crate::wal_store::first_local_segment(&node.fs, &tl.dir, SEG)
                .unwrap()
                .unwrap_or(u64::MAX);
            let start_seg = tl.status().local_start_lsn.segment_number(SEG);
            if first_local > start_seg && first_local != u64::MAX {
                let (_, persisted) = tl.lsns();
                let needed = [
                    ("persisted commit LSN", persisted.commit_lsn),
                    ("persisted backup LSN", persisted.backup_lsn),
                    (
                        "persisted peers' horizon (less a page)",
                        Lsn(persisted.peer_horizon_lsn.0.saturating_sub(8192)),
                    ),
                ];
                for (what, lsn) in needed {
                    let segno = lsn.segment_number(SEG);
                    // Below what a restore brought back, the WAL is the store's (eviction
                    // required every segment below its end stored).
                    let restored_over = node.restored_from.is_some_and(|f| first_local <= f)
                        && self
                            .rt
                            .block_on(self.backup.storage.read_segment(
                                &self.ttid,
                                segno.max(start_seg),
                                SEG,
                            ))
                            .unwrap()
                            .is_some();
                    assert!(
                        first_local <= segno || restored_over,
                        "seed {}: node {} removed segments below {first_local}, but the {what} \
                         {lsn} needs segment {} (restored from {:?})\n{}",
                        self.seed,
                        node.id,
                        lsn.segment_number(SEG),
                        node.restored_from,
                        self.replay_hint()
                    );
                }
            }
            for (lsn, _, _) in &live.holds {
                assert!(
                    lsn.segment_number(SEG) >= first_local.min(tl.removed_below()),
                    "seed {}: a reader of node {} holds {lsn} but segments below \
                     {first_local} are gone",
                    self.seed,
                    node.id
                );
            }
        }
    }

    /// Every node's WAL is the proposer's below its flush LSN, and every committed byte is in
    /// the store or on a quorum of nodes.
    fn check_content(&mut self) {
        if self.nodes.iter().all(|n| n.live.is_none() && !n.evicted) {
            return;
        }
        let mut holders = Vec::new();
        for node in &self.nodes {
            let Some(live) = &node.live else { continue };
            let flush = live.tl.positions().flush_lsn;
            let local = self.check_wal_of(&live.tl, &node.fs, flush, "a node's WAL");
            holders.push((flush, local));
        }
        let committed = self.proposer.committed;
        // (Checked byte for byte by `check_partials`.)
        let partials = self
            .rt
            .block_on(self.backup.storage.list_partials(&self.ttid, SEG))
            .expect("listing the in-memory store");
        let mut segno = START.segment_number(SEG);
        while Lsn(segno * SEG) < committed {
            let to = Lsn(((segno + 1) * SEG).min(committed.0));
            let local = holders
                .iter()
                .filter(|(flush, local)| *flush >= to && local.contains(&segno))
                .count();
            let stored = self
                .rt
                .block_on(self.backup.storage.read_segment(&self.ttid, segno, SEG))
                .unwrap()
                .is_some()
                || partials
                    .iter()
                    .any(|(s, _, upto, _)| *s == segno && *upto >= to);
            assert!(
                stored || local >= self.quorum(),
                "seed {}: committed WAL in segment {segno} (below {committed}) is on {local} \
                 nodes and not in the store\n{}",
                self.seed,
                self.replay_hint()
            );
            segno += 1;
        }
    }

    /// Every partial object in the store holds the proposer's committed WAL, byte for byte,
    /// from its segment's start (or the timeline's) to its end.
    fn check_partials(&self) {
        let storage = &self.backup.storage;
        let partials = self
            .rt
            .block_on(storage.list_partials(&self.ttid, SEG))
            .expect("listing the in-memory store");
        for (segno, term, upto, path) in partials {
            assert!(
                upto <= self.proposer.committed && term <= self.proposer.term,
                "seed {}: partial object {path} (term {term}) ends past the committed {}                  (term {})\n{}",
                self.seed,
                self.proposer.committed,
                self.proposer.term,
                self.replay_hint()
            );
            let bytes = self
                .rt
                .block_on(storage.read_object(&path))
                .expect("reading the in-memory store")
                .expect("listed above");
            let from = Lsn(segno * SEG).max(START);
            let off = from.segment_offset(SEG) as usize;
            assert_eq!(
                bytes.len() as u64,
                upto.segment_offset(SEG),
                "seed {}: partial object {path}'s size",
                self.seed
            );
            let want =
                &self.proposer.sent[(from.0 - START.0) as usize..(upto.0 - START.0) as usize];
            assert!(
                &bytes[off..] == want,
                "seed {}: partial object {path} differs from the committed WAL\n{}",
                self.seed,
                self.replay_hint()
            );
        }
    }

    /// `tl`'s WAL below `end` (on `fs`, or in the store where `fs` has no segment; not below
    /// the timeline's start on this node) is the proposer's. Returns the segments found
    /// locally. `what` names the copy for a failure.
    fn check_wal_of(&self, tl: &Timeline, fs: &Fs, end: Lsn, what: &str) -> Vec<u64> {
        let mut local = Vec::new();
        let mut segno = START.segment_number(SEG);
        while Lsn(segno * SEG) < end {
            let from = Lsn((segno * SEG).max(START.0));
            let to = Lsn(((segno + 1) * SEG).min(end.0));
            let want = &self.proposer.sent[(from.0 - START.0) as usize..(to.0 - START.0) as usize];
            let got = if tl.has_segment_at(from) {
                local.push(segno);
                // The file as the disk holds it (WalReader's reads are tested on their own;
                // a zero-filled read buffer is slow in unoptimized builds).
                let names =
                    [false, true].map(|p| crate::wal_store::segment_path(&tl.dir, segno, SEG, p));
                let f = names
                    .iter()
                    .find_map(|p| fs.open(p, sk_core::storage::fs::OpenMode::Read).ok())
                    .expect("the local segment opens");
                let mut buf = vec![0u8; (to.0 - from.0) as usize];
                sk_core::storage::fs::read_full_at(&*f, &mut buf, from.segment_offset(SEG))
                    .unwrap();
                buf
            } else {
                let stored = self
                    .rt
                    .block_on(self.backup.storage.read_segment(&tl.ttid, segno, SEG))
                    .unwrap()
                    .unwrap_or_else(|| {
                        panic!(
                            "seed {}: {what}: segment {segno} is neither local nor stored\n{}",
                            self.seed,
                            self.replay_hint()
                        )
                    });
                stored[from.segment_offset(SEG) as usize..(to.0 - segno * SEG) as usize].to_vec()
            };
            assert!(
                got == want,
                "seed {}: {what}: WAL {from}..{to} differs from the proposer's\n{}",
                self.seed,
                self.replay_hint()
            );
            segno += 1;
        }
        local
    }

    fn replay_hint(&self) -> String {
        format!(
            "replay: MANAGER_SIM_NODES={} MANAGER_SIM_SEED={} MANAGER_SIM_STEPS={} \
             MANAGER_SIM_TRACE=1 cargo test -p safekeeper --lib manager_sim_replay_one_seed -- \
             --ignored --nocapture\nlast steps: {:#?}",
            self.nodes.len(),
            self.seed,
            steps(),
            &self.log[self.log.len().saturating_sub(12)..]
        )
    }
}

/// What the simulation's pulls did.
#[derive(Clone, Copy, Debug, Default)]
struct PullCounts {
    installed: u64,
    /// Refused (their snapshots were aborted).
    refused: u64,
    /// Pullers that lost power in their pull (among the two above).
    puller_crashes: u64,
}

impl std::ops::AddAssign for PullCounts {
    fn add_assign(&mut self, o: PullCounts) {
        self.installed += o.installed;
        self.refused += o.refused;
        self.puller_crashes += o.puller_crashes;
    }
}

/// What a run did (a simulation that never removes proves nothing about removal).
#[derive(Clone, Copy, Debug, Default)]
struct Stats {
    removed: u64,
    evictions: u64,
    restores: u64,
    partial_uploads: u64,
    crashes: u64,
    terms: u64,
    replacements: u64,
    pulls: PullCounts,
    /// Saves begun before a deletion or eviction, run against the timeline live again.
    orphans_run: u64,
}

impl std::ops::AddAssign for Stats {
    fn add_assign(&mut self, o: Stats) {
        self.removed += o.removed;
        self.evictions += o.evictions;
        self.restores += o.restores;
        self.partial_uploads += o.partial_uploads;
        self.crashes += o.crashes;
        self.terms += o.terms;
        self.replacements += o.replacements;
        self.pulls += o.pulls;
        self.orphans_run += o.orphans_run;
    }
}

fn load(fs: &Fs, id: u64) -> GlobalTimelines {
    GlobalTimelines::load_in(fs.clone(), Path::new(DATADIR), NodeId(id), false).expect("loads")
}

fn steps() -> u64 {
    env_u64("MANAGER_SIM_STEPS").unwrap_or(200)
}

/// Runs one seed on `n` nodes.
fn run_seed(seed: u64, n: usize) -> Stats {
    let mut s = Sim::new(seed, n);
    for _ in 0..steps() {
        let before: Vec<Option<u64>> = s
            .nodes
            .iter()
            .map(|n| n.live.as_ref().map(|l| l.tl.removed_below()))
            .collect();
        s.step();
        for (b, node) in before.into_iter().zip(&s.nodes) {
            if let (Some(b), Some(l)) = (b, &node.live) {
                s.stats.removed += l.tl.removed_below().saturating_sub(b);
            }
        }
    }
    s.check_content();
    s.check_partials();
    s.stats
}

/// Runs `MANAGER_SIM_SEEDS` seeds (or `default`) on `n` nodes and checks the schedule did
/// exercise what it is for.
fn run_seeds(n: usize, default: u64) {
    let seeds = env_u64("MANAGER_SIM_SEEDS").unwrap_or(default);
    let base = env_u64("MANAGER_SIM_BASE").unwrap_or(0);
    let mut total = Stats::default();
    for seed in base..base + seeds {
        total += run_seed(seed, n);
    }
    eprintln!("{n} nodes, {seeds} seeds: {total:?}");
    assert!(total.removed > seeds, "removal ran too rarely: {total:?}");
    assert!(total.crashes > seeds, "crashes ran too rarely: {total:?}");
    assert!(
        total.evictions > seeds / 4 && total.restores > seeds / 8,
        "evictions or restores ran too rarely: {total:?}"
    );
    assert!(
        total.partial_uploads > seeds / 2,
        "partial segments were uploaded too rarely: {total:?}"
    );
    assert!(
        total.pulls.installed > seeds / 2
            && total.pulls.refused > 0
            && total.pulls.puller_crashes > 0,
        "pulls ran too rarely: {total:?}"
    );
    assert!(
        total.orphans_run > seeds / 100,
        "saves begun before a deletion ran too rarely against the timeline created again: \
         {total:?}"
    );
    if n > 1 {
        assert!(
            total.terms > seeds && total.replacements > seeds / 4,
            "elections or replacements ran too rarely: {total:?}"
        );
    }
}

#[test]
fn manager_sim_seeds_three_nodes() {
    run_seeds(3, 1000);
}

#[test]
fn manager_sim_seeds_one_node() {
    run_seeds(1, 1000);
}

#[test]
#[ignore = "replays MANAGER_SIM_SEED"]
fn manager_sim_replay_one_seed() {
    let seed = env_u64("MANAGER_SIM_SEED").expect("set MANAGER_SIM_SEED=<seed>");
    let n = env_u64("MANAGER_SIM_NODES").unwrap_or(3) as usize;
    let stats = run_seed(seed, n);
    eprintln!("seed {seed}, {n} nodes: {stats:?}");
}
