//! The proposer's consensus state machine, sans-IO: [`ProposerCore::step`] takes an [`Event`]
//! (a connection came up or went down, a safekeeper's reply, recovered WAL, a tick) and queues
//! [`Action`]s (messages to send, WAL to fetch, a new commit LSN, stepping down) that the caller
//! takes with [`ProposerCore::take_actions`] and carries out. No sockets, no tasks, no clock: the
//! tokio driver ([`super`]) and the seeded model test drive the same code.
//!
//! What it owns (neon's walproposer, `reference/neon-safekeeper.md` §1, §2.4):
//! - **greetings and term choice**: with a quorum of greetings the term is the highest term seen
//!   plus one;
//! - **votes and donor choice**: with a quorum of granted votes the donor is the voter with the
//!   highest `(last_log_term, flush_lsn)`; the term starts at the donor's flush LSN and the
//!   proposer's history is the donor's plus `(term, start)`; the WAL voters lack is fetched from
//!   the donor ([`Action::Fetch`]) before anyone is told `elected`;
//! - **each safekeeper's start point**: the highest common point of the two histories, sent in
//!   `ProposerElected`; then appends from there, from the in-memory WAL buffer, within an
//!   in-flight window;
//! - **the commit rule**, the heart of it:
//!   1. a safekeeper's flush LSN counts only when it comes from an `AppendResponse` of the
//!      current term received on a connection *after* `ProposerElected` was sent on it. The
//!      acceptor processes a connection's messages in order and answers appends only after
//!      them, so such a reply describes WAL it holds under this term's history (truncated at the
//!      start point, then appended by us). Nothing is assumed from a vote or a start point: the
//!      safekeeper may never process `elected` (its connection can drop first), and its old WAL
//!      of an earlier term is then not ours to count;
//!   2. counted flushes below the term start count as nothing (Raft's figure 8: WAL of an earlier
//!      term is committed only together with WAL of this term);
//!   3. the commit LSN is the highest LSN that a quorum's counted flushes reach; it never goes
//!      back;
//! - **stepping down**: any reply carrying a higher term ends this proposer for good.
//!
//! The safekeeper's side of the same rules is `SafeKeeper::process_msg` (`sk_core::safekeeper`).
//!
//! Not here: sockets, reconnecting and backoff, timeouts, fetching WAL over the network (the
//! driver does them and reports back as events); where WAL comes from (the sources).

use std::collections::VecDeque;

use bytes::Bytes;

use sk_core::protocol::{
    AcceptorProposerMessage, AppendRequest, AppendRequestHeader, AppendResponse, MAX_SEND_SIZE,
    ProposerAcceptorMessage, ProposerElected, ProposerGreeting, VoteRequest, VoteResponse,
};
use sk_core::state::Configuration;
use sk_core::types::{Generation, Lsn, TenantTimelineId, Term, TermHistory, TermLsn};

/// Index of a safekeeper in the configured list.
pub type SkId = usize;

/// Identifies one connection to a safekeeper; the driver assigns a new one to every connection
/// it makes, so events of a connection that is already gone can be told apart.
pub type ConnId = u64;

/// What the core needs to know about the timeline and its safekeepers.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// Number of safekeepers; they are `0..n`.
    pub n_safekeepers: usize,
    /// The timeline written.
    pub ttid: TenantTimelineId,
    /// PostgreSQL system identifier, sent in the greeting.
    pub system_id: u64,
    /// PostgreSQL version, sent in the greeting.
    pub pg_version: u32,
    /// WAL segment size, sent in the greeting.
    pub wal_seg_size: u32,
    /// Where WAL begins if every safekeeper is empty (a record boundary).
    pub start_lsn: Lsn,
    /// WAL sent to one safekeeper beyond what it acknowledged.
    pub max_in_flight: u64,
    /// Committed WAL kept in memory for safekeepers that fall behind (they are caught up from it
    /// when they come back). WAL that is not committed is always kept.
    pub max_retained_committed: u64,
}

impl CoreConfig {
    /// Defaults for the in-flight window and retention.
    pub fn new(
        n_safekeepers: usize,
        ttid: TenantTimelineId,
        system_id: u64,
        pg_version: u32,
        wal_seg_size: u32,
        start_lsn: Lsn,
    ) -> CoreConfig {
        CoreConfig {
            n_safekeepers,
            ttid,
            system_id,
            pg_version,
            wal_seg_size,
            start_lsn,
            max_in_flight: 16 << 20,
            max_retained_committed: 1 << 30,
        }
    }

    /// Safekeepers needed for a quorum: a majority.
    pub fn quorum(&self) -> usize {
        self.n_safekeepers / 2 + 1
    }
}

/// Something that happened, for [`ProposerCore::step`].
#[derive(Clone, Debug)]
pub enum Event {
    /// A new connection to `sk` is ready for protocol messages (after `START_WAL_PUSH`).
    Connected {
        /// The safekeeper.
        sk: SkId,
        /// The new connection.
        conn: ConnId,
    },
    /// The connection is gone (error, close, or the driver gave up on it).
    Disconnected {
        /// The safekeeper.
        sk: SkId,
        /// The connection that is gone.
        conn: ConnId,
    },
    /// `sk` sent `msg` on `conn`.
    Received {
        /// The safekeeper.
        sk: SkId,
        /// The connection it came on.
        conn: ConnId,
        /// The reply.
        msg: AcceptorProposerMessage,
    },
    /// The answer to [`Action::Fetch`]: WAL `[from, from + wal.len())`.
    Fetched {
        /// Where the WAL starts.
        from: Lsn,
        /// The WAL.
        wal: Bytes,
    },
    /// [`Action::Fetch`] failed.
    FetchFailed {
        /// Why.
        reason: String,
    },
    /// Time passed (the driver ticks about once a second): idle streams get a heartbeat.
    Tick,
}

/// Something the caller must do, queued by [`ProposerCore::step`] and [`ProposerCore::push`].
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Send `msg` to `sk` on connection `conn` (drop it if that connection is gone).
    Send {
        /// The safekeeper.
        sk: SkId,
        /// The connection to send on.
        conn: ConnId,
        /// The message.
        msg: ProposerAcceptorMessage,
    },
    /// Close connection `conn` to `sk` (it broke the protocol, or it cannot be served now); the
    /// driver reconnects later.
    Close {
        /// The safekeeper.
        sk: SkId,
        /// The connection to close.
        conn: ConnId,
        /// Why, for the log.
        reason: String,
    },
    /// Read WAL `[from, to)` from safekeeper `sk` while its term is `term`
    /// (`START_REPLICATION … (term='N')`) and report back with [`Event::Fetched`] or
    /// [`Event::FetchFailed`]. At most one fetch is outstanding.
    Fetch {
        /// The safekeeper to read from.
        sk: SkId,
        /// The term it must still be in.
        term: Term,
        /// Start of the WAL to read.
        from: Lsn,
        /// End of the WAL to read.
        to: Lsn,
    },
    /// This proposer is elected: its term, where the term's WAL starts, and its history.
    Elected {
        /// Our term.
        term: Term,
        /// Where this term's WAL starts.
        term_start: Lsn,
        /// Our history: the donor's plus `(term, term_start)`.
        history: TermHistory,
    },
    /// The commit LSN advanced: WAL below it is on a quorum under this term's history.
    Commit(Lsn),
    /// A safekeeper is at `seen`, above our term: this proposer is done.
    SteppedDown {
        /// The higher term.
        seen: Term,
    },
    /// Recovering the donor's WAL failed: the election cannot complete.
    ElectionFailed {
        /// Why.
        reason: String,
    },
}

/// Why [`ProposerCore::push`] refused WAL.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PushError {
    #[error("not elected")]
    /// Only an elected proposer takes WAL.
    NotElected,
    #[error("WAL must continue at {expected}, got {got}")]
    /// WAL must continue the proposer's WAL.
    Discontinuous {
        /// The end of the proposer's WAL.
        expected: Lsn,
        /// Where the pushed WAL started.
        got: Lsn,
    },
}

/// Where the election stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Collecting greetings to choose a term.
    Greeting,
    /// Term chosen, collecting votes.
    Voting,
    /// Elected by a quorum; fetching the WAL voters lack from the donor.
    Recovering,
    /// Streaming WAL.
    Elected,
    /// Saw a higher term, or the election failed: does nothing more.
    Stopped,
}

/// One connection's progress through the protocol.
#[derive(Clone, Debug)]
enum ConnState {
    /// Greeting sent, waiting for the answer.
    Greeting,
    /// Greeted; waiting for the term to be chosen.
    Greeted,
    /// Vote request sent.
    Voting,
    /// Answered the vote request with our term (granted, or it already follows our term);
    /// waiting for the election or for WAL below its start point to be fetched.
    Voted(Box<VoteResponse>),
    /// `ProposerElected` sent; streaming.
    Streaming(Stream),
}

/// A connection that was sent `ProposerElected`.
#[derive(Clone, Copy, Debug)]
struct Stream {
    /// Where this safekeeper's WAL continues (its `start_streaming_at`).
    start: Lsn,
    /// Next LSN to send. Invariant: `start <= next`.
    next: Lsn,
    /// Commit LSN in the last append sent.
    sent_commit: Lsn,
    /// Whether anything was sent since the last tick.
    active: bool,
    /// Send an append even if there is nothing new: right after `elected`, so the safekeeper
    /// acknowledges its start point in this term.
    probe: bool,
}

#[derive(Clone, Debug)]
struct Conn {
    id: ConnId,
    state: ConnState,
}

/// The core's view of one safekeeper.
#[derive(Clone, Debug, Default)]
struct Member {
    conn: Option<Conn>,
    /// Highest flush LSN this safekeeper acknowledged in our term after processing our
    /// `ProposerElected` (rule 1 of the module doc). Survives reconnects: it is durable there.
    flush: Lsn,
    /// Highest *persisted* commit LSN it reported (sync mode waits for a quorum at the term
    /// start).
    persisted_commit: Lsn,
    /// Its term as of its last greeting or vote.
    term: Term,
    /// Its granted vote in our term (kept after its connection drops: the vote is durable).
    vote: Option<VoteResponse>,
}

/// WAL in memory as the chunks it was pushed in: `[start, end)`.
#[derive(Debug)]
struct WalBuffer {
    start: Lsn,
    end: Lsn,
    /// `(lsn, bytes)` in order, contiguous, none empty.
    chunks: VecDeque<(Lsn, Bytes)>,
}

impl WalBuffer {
    fn new(at: Lsn) -> WalBuffer {
        WalBuffer {
            start: at,
            end: at,
            chunks: VecDeque::new(),
        }
    }

    fn push(&mut self, wal: Bytes) {
        if wal.is_empty() {
            return;
        }
        let at = self.end;
        self.end = Lsn(at.0 + wal.len() as u64);
        self.chunks.push_back((at, wal));
    }

    /// Puts `wal` in front: it must end where the buffer starts.
    fn prepend(&mut self, from: Lsn, wal: Bytes) {
        debug_assert_eq!(from.0 + wal.len() as u64, self.start.0);
        if !wal.is_empty() {
            self.chunks.push_front((from, wal));
        }
        self.start = from;
    }

    /// Up to `max` bytes from `from`, never crossing a chunk (zero-copy); `None` if `from` is
    /// outside `[start, end]`, empty at the end.
    fn slice(&self, from: Lsn, max: usize) -> Option<Bytes> {
        if from < self.start || from > self.end {
            return None;
        }
        if from == self.end {
            return Some(Bytes::new());
        }
        // The chunk holding `from`: the last one starting at or below it.
        let i = self.chunks.partition_point(|(lsn, _)| *lsn <= from) - 1;
        let (lsn, bytes) = &self.chunks[i];
        let off = (from.0 - lsn.0) as usize;
        let n = max.min(bytes.len() - off);
        Some(bytes.slice(off..off + n))
    }

    /// Copies `[from, to)` into `out`; false if it is not all buffered.
    fn read(&self, from: Lsn, to: Lsn, out: &mut Vec<u8>) -> bool {
        out.clear();
        if from < self.start || to > self.end || from > to {
            return false;
        }
        let mut pos = from;
        while pos < to {
            let s = self
                .slice(pos, (to.0 - pos.0) as usize)
                .expect("inside the buffer");
            out.extend_from_slice(&s);
            pos = Lsn(pos.0 + s.len() as u64);
        }
        true
    }

    /// Drops WAL below `lsn` (never beyond the end).
    fn trim_to(&mut self, lsn: Lsn) {
        let lsn = lsn.min(self.end);
        if lsn <= self.start {
            return;
        }
        while let Some((at, bytes)) = self.chunks.front_mut() {
            let chunk_end = Lsn(at.0 + bytes.len() as u64);
            if chunk_end <= lsn {
                self.chunks.pop_front();
            } else {
                if *at < lsn {
                    let cut = (lsn.0 - at.0) as usize;
                    *bytes = bytes.slice(cut..);
                    *at = lsn;
                }
                break;
            }
        }
        self.start = lsn;
    }
}

/// A pending fetch: whose WAL and what range.
#[derive(Clone, Copy, Debug)]
struct PendingFetch {
    from: Lsn,
    to: Lsn,
}

/// The proposer state machine. See the module doc.
#[derive(Debug)]
pub struct ProposerCore {
    cfg: CoreConfig,
    phase: Phase,
    /// Our term; `Term(0)` until chosen.
    term: Term,
    /// Term start (the donor's flush LSN, or `cfg.start_lsn` on an empty timeline). Valid from
    /// `Recovering` on.
    term_start: Lsn,
    /// Our history: the donor's plus `(term, term_start)`. Valid from `Recovering` on.
    history: TermHistory,
    /// The donor of the election.
    donor: Option<SkId>,
    members: Vec<Member>,
    wal: WalBuffer,
    /// Invariant: never decreases; only ever set by [`ProposerCore::recompute_commit`].
    commit: Lsn,
    /// Highest `truncate_lsn` among the votes: the peers' horizon is at least this.
    vote_truncate: Lsn,
    fetch: Option<PendingFetch>,
    actions: Vec<Action>,
}

impl ProposerCore {
    /// A proposer that has not greeted anyone yet. Connections are reported with
    /// [`Event::Connected`].
    pub fn new(cfg: CoreConfig) -> ProposerCore {
        let n = cfg.n_safekeepers;
        ProposerCore {
            wal: WalBuffer::new(cfg.start_lsn),
            cfg,
            phase: Phase::Greeting,
            term: Term(0),
            term_start: Lsn::INVALID,
            history: TermHistory::empty(),
            donor: None,
            members: vec![Member::default(); n],
            commit: Lsn::INVALID,
            vote_truncate: Lsn::INVALID,
            fetch: None,
            actions: Vec::new(),
        }
    }

    // ----- accessors -------------------------------------------------------------------------

    /// The configuration.
    pub fn config(&self) -> &CoreConfig {
        &self.cfg
    }

    /// Where the election stands.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// Our term (`Term(0)` before one is chosen).
    pub fn term(&self) -> Term {
        self.term
    }

    /// Where this term's WAL starts (valid once elected).
    pub fn term_start(&self) -> Lsn {
        self.term_start
    }

    /// Our history (valid once elected).
    pub fn history(&self) -> &TermHistory {
        &self.history
    }

    /// The donor chosen by the election.
    pub fn donor(&self) -> Option<SkId> {
        self.donor
    }

    /// Highest LSN committed on a quorum in this term (`Lsn::INVALID` before the first commit).
    pub fn commit_lsn(&self) -> Lsn {
        self.commit
    }

    /// End of the WAL this proposer has (the term start until something is pushed).
    pub fn end_lsn(&self) -> Lsn {
        self.wal.end
    }

    /// Oldest WAL still in memory.
    pub fn buffer_start(&self) -> Lsn {
        self.wal.start
    }

    /// The flush LSN counted for `sk` (rule 1 of the module doc).
    pub fn counted_flush(&self, sk: SkId) -> Lsn {
        self.members[sk].flush
    }

    /// Safekeepers whose persisted commit LSN reached the term start.
    pub fn synced(&self) -> usize {
        if !self.term_start.is_valid() {
            return 0;
        }
        self.members
            .iter()
            .filter(|m| m.persisted_commit.is_valid() && m.persisted_commit >= self.term_start)
            .count()
    }

    /// Oldest WAL a peer may still need: `min(commit, every safekeeper's counted flush)`, and
    /// never below what the voters reported.
    pub fn truncate_lsn(&self) -> Lsn {
        let min_flush = self
            .members
            .iter()
            .map(|m| m.flush)
            .min()
            .unwrap_or(Lsn::INVALID);
        min_flush.min(self.commit).max(self.vote_truncate)
    }

    /// Whether connection `conn` of `sk` was sent everything: all WAL and the current commit LSN.
    pub fn caught_up(&self, sk: SkId) -> bool {
        match &self.members[sk].conn {
            Some(Conn {
                state: ConnState::Streaming(s),
                ..
            }) => s.next == self.wal.end && s.sent_commit == self.commit,
            _ => false,
        }
    }

    /// Safekeepers that granted us their vote in our term.
    pub fn votes_granted(&self) -> usize {
        self.members.iter().filter(|m| m.vote.is_some()).count()
    }

    /// Whether `sk` has a live connection.
    pub fn connected(&self, sk: SkId) -> bool {
        self.members[sk].conn.is_some()
    }

    /// A one-line description of every safekeeper, for logs and errors.
    pub fn describe(&self) -> String {
        self.members
            .iter()
            .enumerate()
            .map(|(i, m)| {
                let state = match &m.conn {
                    None => "down".to_string(),
                    Some(c) => match &c.state {
                        ConnState::Greeting => "greeting".into(),
                        ConnState::Greeted => format!("greeted (term {})", m.term),
                        ConnState::Voting => "voting".into(),
                        ConnState::Voted(v) => format!("voted (flush {})", v.flush_lsn),
                        ConnState::Streaming(s) => format!("streaming (sent up to {})", s.next),
                    },
                };
                format!("sk{i}: {state}, acknowledged {}", m.flush)
            })
            .collect::<Vec<_>>()
            .join("; ")
    }

    /// Copies buffered WAL `[from, to)` into `out`; false if not all of it is buffered.
    pub fn read_buffered(&self, from: Lsn, to: Lsn, out: &mut Vec<u8>) -> bool {
        self.wal.read(from, to, out)
    }

    /// Takes the queued actions, oldest first.
    pub fn take_actions(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.actions)
    }

    /// Whether actions are queued.
    pub fn has_actions(&self) -> bool {
        !self.actions.is_empty()
    }

    // ----- input -----------------------------------------------------------------------------

    /// Appends WAL at `lsn` (which must be the end of WAL) and streams it. Only when elected.
    pub fn push(&mut self, lsn: Lsn, wal: Bytes) -> Result<(), PushError> {
        if self.phase != Phase::Elected {
            return Err(PushError::NotElected);
        }
        if lsn != self.wal.end {
            return Err(PushError::Discontinuous {
                expected: self.wal.end,
                got: lsn,
            });
        }
        self.wal.push(wal);
        for sk in 0..self.members.len() {
            self.pump(sk);
        }
        Ok(())
    }

    /// Processes one event; queued actions are taken with [`ProposerCore::take_actions`].
    pub fn step(&mut self, event: Event) {
        if self.phase == Phase::Stopped {
            return;
        }
        match event {
            Event::Connected { sk, conn } => self.on_connected(sk, conn),
            Event::Disconnected { sk, conn } => {
                if self.is_current(sk, conn) {
                    self.members[sk].conn = None;
                }
            }
            Event::Received { sk, conn, msg } => {
                if !self.is_current(sk, conn) {
                    return; // a connection we already gave up on
                }
                match msg {
                    AcceptorProposerMessage::Greeting(g) => self.on_greeting(sk, conn, g.term),
                    AcceptorProposerMessage::VoteResponse(v) => self.on_vote(sk, conn, v),
                    AcceptorProposerMessage::AppendResponse(r) => {
                        self.on_append_response(sk, conn, r)
                    }
                }
            }
            Event::Fetched { from, wal } => self.on_fetched(from, wal),
            Event::FetchFailed { reason } => self.on_fetch_failed(reason),
            Event::Tick => self.on_tick(),
        }
    }

    fn is_current(&self, sk: SkId, conn: ConnId) -> bool {
        sk < self.members.len() && self.members[sk].conn.as_ref().is_some_and(|c| c.id == conn)
    }

    fn send(&mut self, sk: SkId, conn: ConnId, msg: ProposerAcceptorMessage) {
        self.actions.push(Action::Send { sk, conn, msg });
    }

    fn close(&mut self, sk: SkId, conn: ConnId, reason: String) {
        self.members[sk].conn = None;
        self.actions.push(Action::Close { sk, conn, reason });
    }

    fn set_state(&mut self, sk: SkId, state: ConnState) {
        if let Some(c) = self.members[sk].conn.as_mut() {
            c.state = state;
        }
    }

    fn step_down(&mut self, seen: Term) {
        self.phase = Phase::Stopped;
        self.actions.push(Action::SteppedDown { seen });
    }

    // ----- election --------------------------------------------------------------------------

    fn on_connected(&mut self, sk: SkId, conn: ConnId) {
        if sk >= self.members.len() {
            return;
        }
        self.members[sk].conn = Some(Conn {
            id: conn,
            state: ConnState::Greeting,
        });
        let greeting = ProposerGreeting {
            tenant_id: self.cfg.ttid.tenant_id,
            timeline_id: self.cfg.ttid.timeline_id,
            mconf: Configuration::default(),
            pg_version: self.cfg.pg_version,
            system_id: self.cfg.system_id,
            wal_seg_size: self.cfg.wal_seg_size,
        };
        self.send(sk, conn, ProposerAcceptorMessage::Greeting(greeting));
    }

    fn on_greeting(&mut self, sk: SkId, conn: ConnId, term: Term) {
        if !matches!(
            self.members[sk].conn.as_ref().map(|c| &c.state),
            Some(ConnState::Greeting)
        ) {
            return self.close(sk, conn, "unexpected greeting".into());
        }
        self.members[sk].term = term;
        if self.phase != Phase::Greeting {
            if term > self.term {
                return self.step_down(term);
            }
            return self.request_vote(sk, conn);
        }
        self.set_state(sk, ConnState::Greeted);
        let greeted: Vec<(SkId, ConnId)> = self
            .members
            .iter()
            .enumerate()
            .filter_map(|(i, m)| match &m.conn {
                Some(c) if matches!(c.state, ConnState::Greeted) => Some((i, c.id)),
                _ => None,
            })
            .collect();
        if greeted.len() < self.cfg.quorum() {
            return;
        }
        let highest = greeted
            .iter()
            .map(|&(i, _)| self.members[i].term)
            .max()
            .unwrap_or(Term(0));
        self.term = Term(highest.0 + 1);
        self.phase = Phase::Voting;
        for (i, c) in greeted {
            self.request_vote(i, c);
        }
    }

    fn request_vote(&mut self, sk: SkId, conn: ConnId) {
        self.set_state(sk, ConnState::Voting);
        let req = VoteRequest {
            generation: Generation::INVALID,
            term: self.term,
        };
        self.send(sk, conn, ProposerAcceptorMessage::VoteRequest(req));
    }

    fn on_vote(&mut self, sk: SkId, conn: ConnId, v: VoteResponse) {
        if !matches!(
            self.members[sk].conn.as_ref().map(|c| &c.state),
            Some(ConnState::Voting)
        ) {
            return self.close(sk, conn, "unexpected vote response".into());
        }
        self.members[sk].term = v.term;
        if v.term > self.term {
            return self.step_down(v.term);
        }
        // A refusal in our own term means the safekeeper already follows this term (it voted in
        // it before, for us or for a candidate that cannot win without it): usable once we are
        // elected, but not a vote.
        let granted = v.vote_given && v.term == self.term;
        if v.term != self.term {
            return self.close(sk, conn, format!("vote answered for term {}", v.term));
        }
        if let Err(e) = v.term_history.validate() {
            return self.close(sk, conn, format!("invalid term history in vote: {e}"));
        }
        if granted {
            // A vote is a durable promise: it counts even if this connection drops later.
            self.members[sk].vote = Some(v.clone());
        }
        self.set_state(sk, ConnState::Voted(Box::new(v)));
        match self.phase {
            Phase::Voting => {
                let votes = self.granted_votes();
                if votes.len() >= self.cfg.quorum() {
                    self.become_elected(votes);
                }
            }
            Phase::Elected => self.start_streaming(sk),
            Phase::Recovering | Phase::Greeting | Phase::Stopped => {}
        }
    }

    /// Safekeepers that granted us their vote in our term.
    fn granted_votes(&self) -> Vec<(SkId, VoteResponse)> {
        self.members
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.vote.clone().map(|v| (i, v)))
            .collect()
    }

    fn become_elected(&mut self, votes: Vec<(SkId, VoteResponse)>) {
        let (donor, dv) = votes
            .iter()
            .max_by_key(|(_, v)| (v.term_history.last_log_term(), v.flush_lsn))
            .expect("a quorum is not empty");
        let (donor, dv) = (*donor, dv.clone());
        let (term_start, mut history) = if dv.flush_lsn.is_valid() {
            (dv.flush_lsn, dv.term_history.up_to(dv.flush_lsn))
        } else {
            (self.cfg.start_lsn, TermHistory::empty())
        };
        history.0.push(TermLsn {
            term: self.term,
            lsn: term_start,
        });
        self.term_start = term_start;
        self.history = history;
        self.donor = Some(donor);
        self.vote_truncate = votes
            .iter()
            .map(|(_, v)| v.truncate_lsn)
            .max()
            .unwrap_or(Lsn::INVALID);
        self.wal = WalBuffer::new(term_start);
        self.phase = Phase::Recovering;
        // Everything the voters lack below the term start comes from the donor first.
        let mut from = term_start;
        for (sk, v) in &votes {
            match self.start_point(v) {
                Ok(s) => from = from.min(s),
                Err(e) => {
                    if let Some(conn) = self.members[*sk].conn.as_ref().map(|c| c.id) {
                        self.close(*sk, conn, e);
                    }
                }
            }
        }
        if from < term_start {
            self.request_fetch(from, term_start);
        } else {
            self.finish_election();
        }
    }

    /// Where a safekeeper that answered `v` must continue: the highest common point of the
    /// histories, or our first entry when they share none.
    fn start_point(&self, v: &VoteResponse) -> Result<Lsn, String> {
        let hcp =
            TermHistory::find_highest_common_point(&self.history, &v.term_history, v.flush_lsn)
                .map_err(|e| format!("safekeeper's history disagrees with ours: {e}"))?;
        Ok(match hcp {
            Some(p) => p.lsn,
            None => self.history.0[0].lsn,
        })
    }

    fn request_fetch(&mut self, from: Lsn, to: Lsn) {
        if self.fetch.is_some() {
            return;
        }
        // The donor holds everything below the term start in our history. Above it, a
        // safekeeper that acknowledged the range in our term has it.
        let source = if to <= self.term_start {
            self.donor
        } else {
            (0..self.members.len())
                .filter(|&i| self.members[i].flush >= to)
                .max_by_key(|&i| self.members[i].flush)
        };
        let Some(sk) = source else {
            return;
        };
        self.fetch = Some(PendingFetch { from, to });
        self.actions.push(Action::Fetch {
            sk,
            term: self.term,
            from,
            to,
        });
    }

    fn on_fetched(&mut self, from: Lsn, wal: Bytes) {
        let Some(f) = self.fetch.take() else {
            return;
        };
        if from != f.from || from.0 + wal.len() as u64 != f.to.0 || f.to != self.wal.start {
            return self.on_fetch_failed(format!(
                "fetched [{from}, +{}) does not fill the requested [{}, {})",
                wal.len(),
                f.from,
                f.to
            ));
        }
        self.wal.prepend(from, wal);
        if self.phase == Phase::Recovering {
            self.finish_election();
        } else {
            self.start_streaming_all_voted();
        }
    }

    fn on_fetch_failed(&mut self, reason: String) {
        self.fetch = None;
        if self.phase == Phase::Recovering {
            self.phase = Phase::Stopped;
            self.actions.push(Action::ElectionFailed {
                reason: format!("recovering WAL from the donor: {reason}"),
            });
            return;
        }
        // Safekeepers waiting for that WAL reconnect later and try again.
        for sk in 0..self.members.len() {
            if let Some(Conn {
                id,
                state: ConnState::Voted(_),
            }) = self.members[sk].conn.clone()
            {
                self.close(sk, id, format!("catching up: {reason}"));
            }
        }
    }

    fn finish_election(&mut self) {
        self.phase = Phase::Elected;
        self.actions.push(Action::Elected {
            term: self.term,
            term_start: self.term_start,
            history: self.history.clone(),
        });
        self.start_streaming_all_voted();
    }

    /// Starts streaming to every safekeeper that answered our vote request and waits.
    fn start_streaming_all_voted(&mut self) {
        for sk in 0..self.members.len() {
            self.start_streaming(sk);
        }
    }

    /// Sends `ProposerElected` to a safekeeper that answered our vote request, then WAL.
    fn start_streaming(&mut self, sk: SkId) {
        let Some(Conn {
            id,
            state: ConnState::Voted(v),
        }) = self.members[sk].conn.clone()
        else {
            return;
        };
        let start = match self.start_point(&v) {
            Ok(s) => s,
            Err(e) => return self.close(sk, id, e),
        };
        if start < self.wal.start {
            // It needs WAL we no longer (or never) had in memory: fetch it, then come back.
            self.request_fetch(start, self.wal.start);
            if self.fetch.is_none() {
                self.close(sk, id, format!("WAL at {start} is not available to send"));
            }
            return;
        }
        if start > self.wal.end {
            return self.close(
                sk,
                id,
                format!("start point {start} is beyond our WAL ({})", self.wal.end),
            );
        }
        let elected = ProposerElected {
            generation: Generation::INVALID,
            term: self.term,
            start_streaming_at: start,
            term_history: self.history.clone(),
        };
        self.send(sk, id, ProposerAcceptorMessage::Elected(elected));
        self.set_state(
            sk,
            ConnState::Streaming(Stream {
                start,
                next: start,
                sent_commit: Lsn::INVALID,
                active: true,
                probe: true,
            }),
        );
        self.pump(sk);
    }

    // ----- streaming -------------------------------------------------------------------------

    /// Sends `sk` what it lacks, within the in-flight window; if there is no WAL to send but the
    /// commit LSN moved, an empty append carrying it.
    fn pump(&mut self, sk: SkId) {
        let Some(Conn {
            id,
            state: ConnState::Streaming(mut s),
        }) = self.members[sk].conn.clone()
        else {
            return;
        };
        let acked = self.members[sk].flush.max(s.start);
        let truncate = self.truncate_lsn();
        while s.next < self.wal.end && s.next.0.saturating_sub(acked.0) < self.cfg.max_in_flight {
            let Some(data) = self.wal.slice(s.next, MAX_SEND_SIZE) else {
                // Trimmed below what it needs: reconnecting makes it ask again from its flush.
                return self.close(sk, id, format!("WAL at {} is no longer buffered", s.next));
            };
            let msg = self.append(s.next, data, truncate);
            s.next = msg.h.end_lsn;
            s.sent_commit = self.commit;
            s.active = true;
            s.probe = false;
            self.send(sk, id, ProposerAcceptorMessage::AppendRequest(msg));
        }
        if s.next == self.wal.end && (s.sent_commit < self.commit || s.probe) {
            let msg = self.append(s.next, Bytes::new(), truncate);
            s.sent_commit = self.commit;
            s.active = true;
            s.probe = false;
            self.send(sk, id, ProposerAcceptorMessage::AppendRequest(msg));
        }
        self.set_state(sk, ConnState::Streaming(s));
    }

    fn append(&self, begin: Lsn, data: Bytes, truncate_lsn: Lsn) -> AppendRequest {
        AppendRequest {
            h: AppendRequestHeader {
                generation: Generation::INVALID,
                term: self.term,
                begin_lsn: begin,
                end_lsn: Lsn(begin.0 + data.len() as u64),
                commit_lsn: self.commit,
                truncate_lsn,
            },
            wal_data: data,
        }
    }

    fn on_append_response(&mut self, sk: SkId, conn: ConnId, r: AppendResponse) {
        if r.term > self.term {
            return self.step_down(r.term);
        }
        let Some(ConnState::Streaming(s)) = self.members[sk].conn.as_ref().map(|c| &c.state) else {
            // Not sent `elected` on this connection: nothing it says about its WAL is ours.
            return self.close(sk, conn, "append response before elected".into());
        };
        let sent = s.next;
        if r.term != self.term {
            return self.close(sk, conn, format!("append response in term {}", r.term));
        }
        if r.flush_lsn > sent {
            // After `elected` its WAL ends at the start point plus what we sent: a larger flush
            // LSN cannot describe our WAL.
            return self.close(
                sk,
                conn,
                format!(
                    "acknowledged flush {} beyond the WAL sent on this connection ({sent})",
                    r.flush_lsn
                ),
            );
        }
        let m = &mut self.members[sk];
        m.persisted_commit = m.persisted_commit.max(r.commit_lsn);
        if r.flush_lsn > m.flush {
            m.flush = r.flush_lsn;
            self.recompute_commit();
        }
        // The window may have opened.
        self.pump(sk);
    }

    /// The commit rule (rules 2 and 3 of the module doc).
    fn recompute_commit(&mut self) {
        let flushes: Vec<Lsn> = self.members.iter().map(|m| m.flush).collect();
        let commit = quorum_commit_lsn(&flushes, self.cfg.quorum(), self.term_start);
        if commit > self.commit {
            self.commit = commit;
            self.actions.push(Action::Commit(commit));
            // Keep what lagging safekeepers need, within the retention limit; never uncommitted
            // WAL.
            let min_flush = flushes.iter().copied().min().unwrap_or(Lsn::INVALID);
            let floor = Lsn(commit.0.saturating_sub(self.cfg.max_retained_committed));
            self.wal.trim_to(min_flush.max(floor).min(commit));
            for sk in 0..self.members.len() {
                self.pump(sk);
            }
        }
    }

    fn on_tick(&mut self) {
        if self.phase != Phase::Elected {
            return;
        }
        let truncate = self.truncate_lsn();
        for sk in 0..self.members.len() {
            let Some(Conn {
                id,
                state: ConnState::Streaming(mut s),
            }) = self.members[sk].conn.clone()
            else {
                continue;
            };
            if !s.active {
                // Idle for a whole tick: a heartbeat keeps the connection (and the safekeeper's
                // view of the commit LSN) fresh.
                let msg = self.append(s.next, Bytes::new(), truncate);
                s.sent_commit = self.commit;
                self.send(sk, id, ProposerAcceptorMessage::AppendRequest(msg));
            }
            s.active = false;
            self.set_state(sk, ConnState::Streaming(s));
        }
    }
}

/// The commit rule over counted flush LSNs: the highest LSN that `quorum` of them reach, where a
/// flush below `term_start` counts as nothing (WAL of earlier terms is committed only together
/// with the new term's).
pub fn quorum_commit_lsn(flush: &[Lsn], quorum: usize, term_start: Lsn) -> Lsn {
    if quorum == 0 || quorum > flush.len() {
        return Lsn::INVALID;
    }
    let mut v: Vec<Lsn> = flush
        .iter()
        .map(|&f| if f < term_start { Lsn::INVALID } else { f })
        .collect();
    v.sort_unstable();
    v[v.len() - quorum]
}

#[cfg(test)]
mod tests;
