//! Seeded model test of the consensus core: a deterministic in-memory cluster of 3 acceptors
//! (the real `SafeKeeper` over the in-memory fakes) and 2 competing proposers (a small but
//! faithful model of walproposer), with random message interleaving, connection drops, acceptor
//! power losses (un-synced WAL lost, the acceptor rebuilt from persisted state only),
//! proposer crashes, and stale connections (an acceptor still reading messages a proposer sent
//! on a connection it has already given up on). Every message goes through the real codec.
//!
//! After every step the TLA+ invariants of neon's `ProposerAcceptorStatic.tla` are checked:
//! election safety (one proposer elected per term), log monotonicity (each acceptor's WAL is
//! written by non-decreasing terms, matching its term history), log safety (acceptors agree on
//! committed bytes), and durability of commits (bytes a proposer saw committed stay present and
//! identical on a quorum's durable WAL).
//!
//! Knobs: `MODEL_SEEDS=n` runs `n` seeds (default 3000 of 400 steps, and 20 of 3000 steps in
//! the long variant) from `MODEL_SEED_START` (default 0), `MODEL_STEPS` sets the steps;
//! `MODEL_SEED=s` replays one seed (test `model_replay_one_seed`) and `MODEL_TRACE=1` prints its
//! events. A failure prints its seed.

use std::collections::{BTreeMap, VecDeque};

use bytes::{Bytes, BytesMut};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

use safekeeper::protocol::{
    AcceptorGreeting, AcceptorProposerMessage, AppendRequest, AppendRequestHeader,
    ProposerAcceptorMessage, ProposerElected, ProposerGreeting, VoteRequest, VoteResponse,
};
use safekeeper::safekeeper::{SafeKeeper, SafeKeeperError};
use safekeeper::state::{Configuration, ServerInfo, TimelinePersistentState};
use safekeeper::storage::mem::{MemControlStore, MemWalStore};
use safekeeper::types::{
    Generation, Lsn, NodeId, TenantId, Term, TermHistory, TermLsn, TimelineId,
};

const N_ACC: usize = 3;
const N_PROP: usize = 2;
const QUORUM: usize = N_ACC / 2 + 1;
/// Where the timeline's WAL begins.
const START: Lsn = Lsn(0x0100_0000);
const SEG: u32 = 16 << 20;
const DEFAULT_SEEDS: u64 = 3000;
const STEPS: usize = 400;
/// Seeds and steps of the long-schedule variant (deeper histories, bigger logs).
const LONG_SEEDS: u64 = 20;
const LONG_STEPS: usize = 3000;
/// Record layout: `u8 total_len`, `u64 term`, `u8 proposer`, `u64 seq`, filler.
const RECORD_HEADER: usize = 18;

type Sk = SafeKeeper<MemControlStore, MemWalStore>;

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
    /// WAL bytes `[START, START + log.len())`. Invariant (checked): every byte below `commit`
    /// is globally committed.
    log: Vec<u8>,
    commit: Lsn,
    truncate_lsn: Lsn,
    seq: u64,
}

impl Proposer {
    fn new() -> Proposer {
        Proposer {
            incarnation: 0,
            phase: Phase::Idle,
            term: Term(0),
            views: vec![AccView::default(); N_ACC],
            history: TermHistory::empty(),
            term_start: Lsn(0),
            log: Vec::new(),
            commit: Lsn(0),
            truncate_lsn: Lsn(0),
            seq: 0,
        }
    }

    fn log_end(&self) -> Lsn {
        Lsn(START.0 + self.log.len() as u64)
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
    drops: u64,
    committed_bytes: u64,
    stale_delivered: u64,
    acceptor_errors: BTreeMap<String, u64>,
}

struct Cluster {
    rng: SmallRng,
    trace: bool,
    acceptors: Vec<Option<Sk>>,
    proposers: Vec<Proposer>,
    /// `conns[p][a]`.
    conns: Vec<Vec<Conn>>,
    /// Queues of dropped connections that the acceptor may still read: the proposer gave up on
    /// the socket, but bytes it had sent sit in the acceptor's receive buffer. `(p, a, queue)`;
    /// replies go nowhere.
    zombies: Vec<(usize, usize, VecDeque<Bytes>)>,
    /// term → (proposer, incarnation) elected in it.
    elected: BTreeMap<Term, (usize, u64)>,
    /// The longest committed prefix any proposer observed: bytes `[START, START + len)`.
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
    stats: Stats,
}

fn new_acceptor(id: usize) -> Sk {
    let state = TimelinePersistentState::new(
        tenant(),
        timeline(),
        Configuration::default(),
        ServerInfo {
            pg_version: 150000,
            system_id: 0,
            wal_seg_size: SEG,
        },
        0,
    );
    SafeKeeper::new(
        NodeId(id as u64 + 1),
        MemControlStore::new(state),
        MemWalStore::new(),
    )
    .expect("a fresh timeline starts")
}

impl Cluster {
    fn new(seed: u64, trace: bool) -> Cluster {
        let mut rng = SmallRng::seed_from_u64(seed);
        let fault_rate = [0.005, 0.02, 0.06, 0.15][rng.random_range(0..4)];
        Cluster {
            rng,
            fault_rate,
            trace,
            acceptors: (0..N_ACC).map(|a| Some(new_acceptor(a))).collect(),
            proposers: (0..N_PROP).map(|_| Proposer::new()).collect(),
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
            stats: Stats::default(),
        }
    }

    fn log(&self, f: impl FnOnce() -> String) {
        if self.trace {
            eprintln!("{}", f());
        }
    }

    fn sk(&self, a: usize) -> &Sk {
        self.acceptors[a]
            .as_ref()
            .expect("acceptor present between steps")
    }

    fn sk_mut(&mut self, a: usize) -> &mut Sk {
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
            system_id: 0x5eed,
            wal_seg_size: SEG,
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
        let result = self.sk_mut(a).process_msg(&msg);
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
        let (ctrl, mut wal) = sk.into_storage();
        let keep = self.rng.random_range(0..=wal.unsynced_write_count());
        wal.power_loss_keeping(keep);
        self.stats.power_losses += 1;
        let sk = SafeKeeper::new(NodeId(a as u64 + 1), ctrl, wal)
            .unwrap_or_else(|e| panic!("acceptor a{a} cannot restart after power loss: {e}"));
        self.log(|| {
            format!(
                "power loss a{a} (kept {keep} unsynced writes): flush {} commit {}",
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
        self.proposers[p] = Proposer::new();
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
        let log = if dv.flush_lsn > START {
            match d.wal().read(START, dv.flush_lsn) {
                Some(bytes) => bytes.to_vec(),
                None => {
                    self.step_down(p, &format!("donor a{donor} lost WAL before recovery"));
                    return;
                }
            }
        } else {
            Vec::new()
        };
        let term_start = Lsn(START.0 + log.len() as u64);
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

        let prop = &mut self.proposers[p];
        prop.phase = Phase::Elected;
        prop.history = history;
        prop.term_start = term_start;
        prop.log = log;
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
        let required_len = (required.0.saturating_sub(START.0)) as usize;
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
            start >= START && start <= prop.log_end(),
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
    /// heartbeat carrying the commit LSN).
    fn stream(&mut self, p: usize, a: usize) {
        let prop = &self.proposers[p];
        let view = &prop.views[a];
        if !view.elected_sent || !self.conns[p][a].up {
            return;
        }
        let begin = view.next_lsn;
        let end = prop.log_end();
        let data = Bytes::copy_from_slice(&prop.log[(begin.0 - START.0) as usize..]);
        assert!(data.len() <= safekeeper::protocol::MAX_SEND_SIZE);
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
        let len = self.rng.random_range(RECORD_HEADER..=60);
        let prop = &mut self.proposers[p];
        prop.seq += 1;
        let mut rec = Vec::with_capacity(len);
        rec.push(len as u8);
        rec.extend_from_slice(&prop.term.0.to_be_bytes());
        rec.push(p as u8);
        rec.extend_from_slice(&prop.seq.to_be_bytes());
        while rec.len() < len {
            rec.push(self.rng.random());
        }
        prop.log.extend_from_slice(&rec);
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
        let upto = (candidate.0 - START.0) as usize;
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
        let committed_end = Lsn(START.0 + self.committed.len() as u64);
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

            // Log monotonicity: records in the durable WAL carry non-decreasing terms, each
            // the term its history says wrote that LSN.
            let wal = sk.wal();
            let durable = if flush > START {
                wal.read(START, flush)
                    .unwrap_or_else(|| panic!("a{a}: durable WAL [{START}, {flush}) not held"))
            } else {
                &[]
            };
            let mut off = 0usize;
            let mut last_term = Term(0);
            while off < durable.len() {
                let len = durable[off] as usize;
                assert!(
                    len >= RECORD_HEADER && off + len <= durable.len(),
                    "a{a}: torn or garbage record at {}",
                    Lsn(START.0 + off as u64)
                );
                let rec_term = Term(u64::from_be_bytes(
                    durable[off + 1..off + 9].try_into().expect("8 bytes"),
                ));
                let lsn = Lsn(START.0 + off as u64);
                let by_history = hist.0.iter().rev().find(|e| e.lsn <= lsn).map(|e| e.term);
                assert_eq!(
                    by_history,
                    Some(rec_term),
                    "a{a}: record at {lsn} has term {rec_term}, history {hist:?}"
                );
                assert!(rec_term >= last_term, "a{a}: log terms decrease at {lsn}");
                last_term = rec_term;
                off += len;
            }

            // Log safety against everything committed.
            let upto = (commit.0.saturating_sub(START.0)) as usize;
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
                if c > START {
                    assert_eq!(
                        self.sk(a).wal().read(START, c),
                        self.sk(b).wal().read(START, c),
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
fn run_seed(seed: u64, steps: usize, trace: bool) -> Stats {
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let mut c = Cluster::new(seed, trace);
        for _ in 0..steps {
            c.step();
            c.check();
        }
        c.stats.committed_bytes = c.committed.len() as u64;
        c.stats
    }));
    match result {
        Ok(stats) => stats,
        Err(e) => {
            eprintln!(
                "model test failed for seed {seed} ({steps} steps); replay with MODEL_SEED={seed} \
                 MODEL_STEPS={steps} MODEL_TRACE=1 cargo test -p safekeeper --test model \
                 model_replay_one_seed -- --nocapture"
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
    run_many(DEFAULT_SEEDS, STEPS);
}

/// Fewer, much longer schedules: many elections and power losses within one history.
#[test]
fn model_long_schedules_keep_consensus_invariants() {
    run_many(LONG_SEEDS, LONG_STEPS);
}

fn run_many(default_seeds: u64, default_steps: usize) {
    let seeds = env_u64("MODEL_SEEDS").unwrap_or(default_seeds);
    let first = env_u64("MODEL_SEED_START").unwrap_or(0);
    let steps = env_u64("MODEL_STEPS").map_or(default_steps, |s| s as usize);
    let mut total = Stats::default();
    let mut seeds_with_commits = 0;
    for seed in first..first + seeds {
        let s = run_seed(seed, steps, false);
        if s.commits_observed > 0 {
            seeds_with_commits += 1;
        }
        total.elections += s.elections;
        total.commits_observed += s.commits_observed;
        total.power_losses += s.power_losses;
        total.drops += s.drops;
        total.committed_bytes += s.committed_bytes;
        total.stale_delivered += s.stale_delivered;
        for (k, v) in s.acceptor_errors {
            *total.acceptor_errors.entry(k).or_default() += v;
        }
    }
    eprintln!(
        "model: {seeds} seeds x {steps} steps, {seeds_with_commits} seeds committed: {total:?}"
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
    let stats = run_seed(seed, steps, trace);
    eprintln!("seed {seed}: {stats:?}");
}
