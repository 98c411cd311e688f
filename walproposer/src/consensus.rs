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
//! - **membership** (`reference/neon-safekeeper.md`, generations): in generation 0 every
//!   configured safekeeper is a member and a quorum is a majority of them; from generation 1 on
//!   the [`Configuration`] decides: a quorum is a majority of `members` *and*, while a joint
//!   configuration is in force, a majority of `new_members`, counted by node id (learnt from
//!   each safekeeper's greeting). Elections and the commit rule both use it. A greeting that
//!   shows a newer generation is adopted: the proposer connects to new members, stops talking
//!   to removed ones, reconnects to everyone to greet them in the new generation and
//!   *re-elects itself* with a higher term, so every term is elected entirely within one generation (the operator's
//!   switch condition in `docs/durability.md` relies on it). Its WAL buffer survives the
//!   re-election, and WAL pushed meanwhile waits in it: the new term continues at the new
//!   donor's flush LSN, which must lie on our own history (else another proposer wrote WAL and
//!   the election fails);
//! - **stepping down**: any reply carrying a higher term while elected ends this proposer for
//!   good;
//! - **what readers report back** (issue 31), from each safekeeper's last acknowledgement on its
//!   current connection: the oldest hot-standby xmin over the safekeepers
//!   ([`ProposerCore::hs_feedback`], which the relay passes to the primary), and
//!   **backpressure** ([`ProposerCore::backpressure`]): slow down from half of
//!   `max_replication_flush_lag` / `max_replication_apply_lag`, pause at it, measured from the end
//!   of our WAL to the slowest required reader's flushed / applied position.
//!
//! The safekeeper's side of the same rules is `SafeKeeper::process_msg` (`sk_core::safekeeper`).
//!
//! Not here: sockets, reconnecting and backoff, timeouts, fetching WAL over the network (the
//! driver does them and reports back as events); where WAL comes from (the sources).

use std::collections::{BTreeSet, VecDeque};

use bytes::Bytes;

use sk_core::protocol::{
    AcceptorGreeting, AcceptorProposerMessage, AppendRequest, AppendRequestHeader, AppendResponse,
    HotStandbyFeedback, MAX_SEND_SIZE, ProposerAcceptorMessage, ProposerElected, ProposerGreeting,
    VoteRequest, VoteResponse,
};
use sk_core::state::{Configuration, SafekeeperId};
use sk_core::types::{Generation, Lsn, NodeId, TenantTimelineId, Term, TermHistory, TermLsn};

/// Index of a safekeeper: `0..n` are the configured ones, later ones were added by a
/// membership configuration ([`Action::AddSafekeeper`]).
pub type SkId = usize;

/// Identifies one connection to a safekeeper; the driver assigns a new one to every connection
/// it makes, so events of a connection that is already gone can be told apart.
pub type ConnId = u64;

/// What the core needs to know about the timeline and its safekeepers.
#[derive(Clone, Debug)]
pub struct CoreConfig {
    /// Number of configured safekeepers; they are `0..n`.
    pub n_safekeepers: usize,
    /// Their `host:port` addresses (may be empty): a member of a newer configuration at one of
    /// these addresses is that safekeeper, not a new one.
    pub addrs: Vec<String>,
    /// The membership configuration to start with (generation 0: all configured safekeepers,
    /// a majority of them is a quorum).
    pub mconf: Configuration,
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
    /// Most bytes the slowest required reader may lag behind the end of our WAL in what it
    /// flushed before the writer pauses (0: no limit; neon's `max_replication_flush_lag`).
    pub max_replication_flush_lag: u64,
    /// The same for what it applied (neon's `max_replication_apply_lag`).
    pub max_replication_apply_lag: u64,
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
            addrs: Vec::new(),
            mconf: Configuration::default(),
            ttid,
            system_id,
            pg_version,
            wal_seg_size,
            start_lsn,
            max_in_flight: 16 << 20,
            max_retained_committed: 1 << 30,
            max_replication_flush_lag: 0,
            max_replication_apply_lag: 0,
        }
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
        /// The fetch's id.
        id: u64,
        /// Where the WAL starts.
        from: Lsn,
        /// The WAL.
        wal: Bytes,
    },
    /// [`Action::Fetch`] failed.
    FetchFailed {
        /// The fetch's id.
        id: u64,
        /// Why.
        reason: String,
    },
    /// Time passed (the driver ticks about once a second): idle streams get a heartbeat.
    Tick,
    /// The driver is ending the streams ([`ProposerCore::caught_up`] closes each): from now on
    /// every move of `truncate_lsn` is sent at once, so each safekeeper's last append carries the
    /// final peers' horizon (its WAL removal waits on it) rather than one from before the other
    /// members' last acknowledgements.
    Finishing,
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
    /// Close connection `conn` to `sk` and connect again at once (a membership change).
    Reconnect {
        /// The safekeeper.
        sk: SkId,
        /// The connection to close.
        conn: ConnId,
        /// Why, for the log.
        reason: String,
    },
    /// Read WAL `[from, to)` from safekeeper `sk` while its term is `term`
    /// (`START_REPLICATION … (term='N')`) and report back with [`Event::Fetched`] or
    /// [`Event::FetchFailed`] carrying `id`. At most one fetch is outstanding; answers to an
    /// older one are ignored.
    Fetch {
        /// Identifies this fetch.
        id: u64,
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
    /// A newer membership configuration was adopted; a re-election in it follows.
    Reconfigured {
        /// The configuration.
        mconf: Configuration,
    },
    /// A member of the configuration that is none of the known safekeepers (`sk` is the next
    /// unused index), or a retired one that is a member again: connect to it.
    AddSafekeeper {
        /// Its index.
        sk: SkId,
        /// Where it listens.
        id: SafekeeperId,
    },
    /// `sk` is not a member of the configuration any more: stop connecting to it.
    RetireSafekeeper {
        /// The safekeeper.
        sk: SkId,
    },
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
    /// `truncate_lsn` in the last append sent.
    sent_truncate: Lsn,
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
    /// Its node id, learnt from its greeting (or from the configuration that added it).
    node_id: Option<NodeId>,
    /// Its `host:port`, when known.
    addr: Option<String>,
    /// Not a member of the configuration: no connection, counts for nothing.
    retired: bool,
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
    /// What its readers reported in its last acknowledgement on connection `.0`: their oldest
    /// xmins and the slowest required reader's positions. Counts only while that connection is
    /// the current one.
    readers: Option<(ConnId, ReadersFeedback)>,
}

/// What one safekeeper's readers reported, from its `AppendResponse`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct ReadersFeedback {
    hs: HotStandbyFeedback,
    /// The required readers' least written, flushed and applied positions, each its own minimum
    /// (neon's pageserver feedback `ps_writelsn`, `ps_flushlsn`, `ps_applylsn`).
    slowest: Option<[Lsn; 3]>,
}

/// Whether the writer must wait for slow readers (`max_replication_*_lag`), from
/// [`ProposerCore::backpressure`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Backpressure {
    /// Below half of every limit (or no limit, or no required reader): full speed.
    #[default]
    Off,
    /// Between half of a limit and the limit: wait `delay_ms` before each new WAL (growing
    /// linearly from 0 at half the limit to [`MAX_SLOW_DELAY_MS`] at the limit).
    Slow {
        /// How long to wait before the next push.
        delay_ms: u64,
        /// The slowest required reader's lag behind the end of our WAL (bytes; flush or apply,
        /// whichever is nearer its limit).
        lag: u64,
    },
    /// At or past a limit: push nothing until the readers catch up.
    Paused {
        /// As in `Slow`.
        lag: u64,
    },
}

/// The longest wait before a push while slowed down (just below the limit).
pub const MAX_SLOW_DELAY_MS: u64 = 50;

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
    id: u64,
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
    /// The membership configuration in force.
    mconf: Configuration,
    /// While re-electing after a reconfiguration: the history of our previous term, which the
    /// WAL buffer follows.
    prev_history: Option<TermHistory>,
    members: Vec<Member>,
    wal: WalBuffer,
    /// Invariant: never decreases; only ever set by [`ProposerCore::recompute_commit`].
    commit: Lsn,
    /// Highest `truncate_lsn` among the votes: the peers' horizon is at least this.
    vote_truncate: Lsn,
    fetch: Option<PendingFetch>,
    /// Id of the last fetch requested.
    fetch_seq: u64,
    /// Set by [`Event::Finishing`]: every move of `truncate_lsn` is sent at once.
    finishing: bool,
    actions: Vec<Action>,
}

impl ProposerCore {
    /// A proposer that has not greeted anyone yet. Connections are reported with
    /// [`Event::Connected`].
    pub fn new(cfg: CoreConfig) -> ProposerCore {
        let n = cfg.n_safekeepers;
        let members = (0..n)
            .map(|i| Member {
                addr: cfg.addrs.get(i).cloned(),
                ..Member::default()
            })
            .collect();
        ProposerCore {
            wal: WalBuffer::new(cfg.start_lsn),
            mconf: cfg.mconf.clone(),
            prev_history: None,
            cfg,
            phase: Phase::Greeting,
            term: Term(0),
            term_start: Lsn::INVALID,
            history: TermHistory::empty(),
            donor: None,
            members,
            commit: Lsn::INVALID,
            vote_truncate: Lsn::INVALID,
            fetch: None,
            finishing: false,
            fetch_seq: 0,
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

    /// What the safekeepers' readers need kept: per field the oldest xid any currently
    /// connected safekeeper reported (the relay sends it to the primary as hot-standby feedback).
    pub fn hs_feedback(&self) -> HotStandbyFeedback {
        HotStandbyFeedback::oldest(self.readers_feedback().map(|f| f.hs))
    }

    /// Whether pushing must slow down or pause for the slowest required reader, by the
    /// `max_replication_*_lag` limits against the end of our WAL. Readers report through their
    /// safekeepers; a safekeeper that is not connected reports nothing.
    pub fn backpressure(&self) -> Backpressure {
        let limits = [
            self.cfg.max_replication_flush_lag,
            self.cfg.max_replication_apply_lag,
        ];
        // Each position's own minimum over the safekeepers: the apply limit holds against the
        // reader slowest to apply even where another one is slowest to flush.
        let Some(slowest) = self
            .readers_feedback()
            .filter_map(|f| f.slowest)
            .reduce(|a, b| [a[0].min(b[0]), a[1].min(b[1]), a[2].min(b[2])])
        else {
            return Backpressure::Off;
        };
        let mut worst: Option<(u64, u64)> = None; // (lag, limit) nearest its limit
        for (limit, pos) in limits.into_iter().zip([slowest[1], slowest[2]]) {
            if limit == 0 {
                continue;
            }
            let lag = self.wal.end.0.saturating_sub(pos.0);
            // lag/limit > wl/wlimit, without floating point.
            if worst.is_none_or(|(wl, wlim)| {
                u128::from(lag) * u128::from(wlim) > u128::from(wl) * u128::from(limit)
            }) {
                worst = Some((lag, limit));
            }
        }
        match worst {
            None => Backpressure::Off,
            Some((lag, limit)) if lag >= limit => Backpressure::Paused { lag },
            // Half the limit or more (`2 * lag`: an odd limit's half is not rounded down, so
            // the limit nearest its end by ratio is also the one past its half).
            Some((lag, limit)) if u128::from(lag) * 2 >= u128::from(limit) => {
                let half = limit / 2;
                let span = (limit - half).max(1);
                Backpressure::Slow {
                    delay_ms: MAX_SLOW_DELAY_MS * (lag - half) / span,
                    lag,
                }
            }
            Some(_) => Backpressure::Off,
        }
    }

    fn readers_feedback(&self) -> impl Iterator<Item = ReadersFeedback> + '_ {
        self.members
            .iter()
            .filter_map(|m| match (&m.readers, &m.conn) {
                (Some((id, f)), Some(c)) if !m.retired && *id == c.id => Some(*f),
                _ => None,
            })
    }

    /// Oldest WAL still in memory.
    pub fn buffer_start(&self) -> Lsn {
        self.wal.start
    }

    /// The flush LSN counted for `sk` (rule 1 of the module doc).
    pub fn counted_flush(&self, sk: SkId) -> Lsn {
        self.members[sk].flush
    }

    /// Whether a quorum of safekeepers persisted a commit LSN at or above the term start.
    pub fn synced(&self) -> bool {
        self.term_start.is_valid()
            && self.is_quorum(|i| {
                let c = self.members[i].persisted_commit;
                c.is_valid() && c >= self.term_start
            })
    }

    /// Oldest WAL a peer may still need: `min(commit, every member's counted flush)`, and never
    /// below what the voters reported.
    pub fn truncate_lsn(&self) -> Lsn {
        let min_flush = self
            .live()
            .map(|i| self.members[i].flush)
            .min()
            .unwrap_or(Lsn::INVALID);
        min_flush.min(self.commit).max(self.vote_truncate)
    }

    /// The membership configuration in force.
    pub fn mconf(&self) -> &Configuration {
        &self.mconf
    }

    /// Whether `sk` was retired (it is not a member of the configuration).
    pub fn retired(&self, sk: SkId) -> bool {
        self.members[sk].retired
    }

    /// What a quorum is, for logs and errors.
    pub fn quorum_description(&self) -> String {
        if self.mconf.generation == Generation::INVALID {
            let n = self.live().count();
            return format!("a majority ({}) of {n}", n / 2 + 1);
        }
        let ids = |set: &[SafekeeperId]| {
            set.iter()
                .map(|m| m.id.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        match &self.mconf.new_members {
            None => format!(
                "a majority of nodes {{{}}} (generation {})",
                ids(&self.mconf.members),
                self.mconf.generation
            ),
            Some(nm) => format!(
                "a majority of nodes {{{}}} and of {{{}}} (joint generation {})",
                ids(&self.mconf.members),
                ids(nm),
                self.mconf.generation
            ),
        }
    }

    /// Whether `sk`'s stream may end: it was sent all WAL, the current commit LSN and the current
    /// `truncate_lsn`, and that horizon is final: every other streaming member acknowledged
    /// all it was sent (a later acknowledgement would move the horizon after this stream
    /// ended, leaving the safekeeper's removal behind by the in-flight window).
    pub fn caught_up(&self, sk: SkId) -> bool {
        let sent_all = match &self.members[sk].conn {
            Some(Conn {
                state: ConnState::Streaming(s),
                ..
            }) => {
                s.next == self.wal.end
                    && s.sent_commit == self.commit
                    && s.sent_truncate == self.truncate_lsn()
            }
            _ => false,
        };
        sent_all
            && self.members.iter().all(|m| match &m.conn {
                Some(Conn {
                    state: ConnState::Streaming(s),
                    ..
                }) => m.retired || m.flush >= s.next,
                _ => true,
            })
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
                    None if m.retired => "retired".to_string(),
                    None => "down".to_string(),
                    Some(c) => match &c.state {
                        ConnState::Greeting => "greeting".into(),
                        ConnState::Greeted => format!("greeted (term {})", m.term),
                        ConnState::Voting => "voting".into(),
                        ConnState::Voted(v) => format!("voted (flush {})", v.flush_lsn),
                        ConnState::Streaming(s) => format!("streaming (sent up to {})", s.next),
                    },
                };
                let node = m
                    .node_id
                    .map(|n| format!(" (node {n})"))
                    .unwrap_or_default();
                format!("sk{i}{node}: {state}, acknowledged {}", m.flush)
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
    /// While re-electing after a reconfiguration the WAL waits in the buffer.
    pub fn push(&mut self, lsn: Lsn, wal: Bytes) -> Result<(), PushError> {
        let reelecting = self.prev_history.is_some() && self.phase != Phase::Stopped;
        if self.phase != Phase::Elected && !reelecting {
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
                    AcceptorProposerMessage::Greeting(g) => self.on_greeting(sk, conn, g),
                    AcceptorProposerMessage::VoteResponse(v) => self.on_vote(sk, conn, v),
                    AcceptorProposerMessage::AppendResponse(r) => {
                        self.on_append_response(sk, conn, r)
                    }
                }
            }
            Event::Fetched { id, from, wal } => {
                if self.fetch.is_some_and(|f| f.id == id) {
                    self.on_fetched(from, wal);
                }
            }
            Event::FetchFailed { id, reason } => {
                if self.fetch.is_some_and(|f| f.id == id) {
                    self.on_fetch_failed(reason);
                }
            }
            Event::Tick => self.on_tick(),
            Event::Finishing => {
                self.finishing = true;
                for sk in 0..self.members.len() {
                    self.pump(sk);
                }
            }
        }
    }

    fn is_current(&self, sk: SkId, conn: ConnId) -> bool {
        sk < self.members.len() && self.members[sk].conn.as_ref().is_some_and(|c| c.id == conn)
    }

    fn in_state(&self, sk: SkId, f: impl Fn(&ConnState) -> bool) -> bool {
        self.members[sk].conn.as_ref().is_some_and(|c| f(&c.state))
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

    // ----- quorums and membership ----------------------------------------------------------

    /// Safekeepers that are not retired.
    fn live(&self) -> impl Iterator<Item = SkId> + '_ {
        (0..self.members.len()).filter(|&i| !self.members[i].retired)
    }

    /// The halves of the configuration a quorum needs a majority of (generation 1 and later).
    fn config_sets(&self) -> impl Iterator<Item = &[SafekeeperId]> {
        std::iter::once(self.mconf.members.as_slice()).chain(self.mconf.new_members.as_deref())
    }

    /// Whether the safekeepers for which `has` holds make a quorum: a majority of all of them
    /// in generation 0; from generation 1 on, a majority of each half of the configuration,
    /// counted by node id.
    fn is_quorum(&self, has: impl Fn(SkId) -> bool) -> bool {
        if self.mconf.generation == Generation::INVALID {
            let live: Vec<SkId> = self.live().collect();
            return live.iter().filter(|&&i| has(i)).count() > live.len() / 2;
        }
        let ids: BTreeSet<NodeId> = self
            .live()
            .filter(|&i| has(i))
            .filter_map(|i| self.members[i].node_id)
            .collect();
        self.config_sets()
            .all(|set| set.iter().filter(|m| ids.contains(&m.id)).count() > set.len() / 2)
    }

    /// The highest LSN that the counted flushes of a quorum reach, at or above the term start
    /// (the commit rule: rules 2 and 3 of the module doc).
    fn quorum_flush(&self) -> Lsn {
        if self.mconf.generation == Generation::INVALID {
            let flushes: Vec<Lsn> = self.live().map(|i| self.members[i].flush).collect();
            return quorum_commit_lsn(&flushes, flushes.len() / 2 + 1, self.term_start);
        }
        self.config_sets()
            .map(|set| {
                let flushes: Vec<Lsn> = set.iter().map(|m| self.node_flush(m.id)).collect();
                quorum_commit_lsn(&flushes, set.len() / 2 + 1, self.term_start)
            })
            .min()
            .unwrap_or(Lsn::INVALID)
    }

    /// The counted flush of node `id` (of the safekeeper that greeted us as it).
    fn node_flush(&self, id: NodeId) -> Lsn {
        self.live()
            .filter(|&i| self.members[i].node_id == Some(id))
            .map(|i| self.members[i].flush)
            .max()
            .unwrap_or(Lsn::INVALID)
    }

    /// Adopts `mconf` (newer than ours, seen in `from`'s greeting): maps its members onto the
    /// known safekeepers (by node id, else by address), adds the others, retires known
    /// safekeepers that are not members, and re-elects in the new generation.
    fn reconfigure(&mut self, from: SkId, mconf: Configuration) {
        self.mconf = mconf.clone();
        self.actions.push(Action::Reconfigured {
            mconf: mconf.clone(),
        });
        let mut mapped = BTreeSet::new();
        for m in mconf
            .members
            .iter()
            .chain(mconf.new_members.iter().flatten())
        {
            let addr = format!("{}:{}", m.host, m.pg_port);
            let all = 0..self.members.len();
            let known = all
                .clone()
                .find(|&i| self.members[i].node_id == Some(m.id))
                .or_else(|| {
                    all.clone().find(|&i| {
                        self.members[i].node_id.is_none()
                            && self.members[i].addr.as_deref() == Some(addr.as_str())
                    })
                });
            if let Some(sk) = known.filter(|&i| self.members[i].retired) {
                // A member again: connect to it again.
                self.members[sk].retired = false;
                self.actions
                    .push(Action::AddSafekeeper { sk, id: m.clone() });
            }
            let sk = known.unwrap_or_else(|| {
                self.members.push(Member {
                    node_id: Some(m.id),
                    addr: Some(addr),
                    ..Member::default()
                });
                let sk = self.members.len() - 1;
                self.actions
                    .push(Action::AddSafekeeper { sk, id: m.clone() });
                sk
            });
            mapped.insert(sk);
        }
        // Safekeepers whose node id we do not know yet are told apart at their greeting.
        let gone: Vec<SkId> = self
            .live()
            .filter(|i| !mapped.contains(i) && self.members[*i].node_id.is_some())
            .collect();
        for sk in gone {
            self.retire(sk);
        }
        self.restart_election(from);
    }

    /// `sk` is not a member of the configuration: it counts for nothing from now on.
    fn retire(&mut self, sk: SkId) {
        let reason = format!(
            "not a member of configuration generation {}",
            self.mconf.generation
        );
        if let Some(id) = self.members[sk].conn.as_ref().map(|c| c.id) {
            self.close(sk, id, reason);
        }
        let m = &mut self.members[sk];
        m.retired = true;
        m.vote = None;
        m.flush = Lsn::INVALID;
        self.actions.push(Action::RetireSafekeeper { sk });
    }

    /// Starts a new election in the configuration just adopted. `greeted` answered a greeting
    /// in it; every other connection is made anew ([`Action::Reconnect`]). The WAL buffer
    /// stays: once elected again, the new term continues it (see
    /// [`ProposerCore::become_elected`]).
    ///
    /// Why not greet again on the connections we have: rule 1 of the module doc needs a
    /// connection on which the safekeeper processed nothing but this election's messages. On
    /// a connection that carried appends of the earlier term, the safekeeper may answer its
    /// idle flush of those appends *after* it voted in the new term and *before* it processes
    /// `elected`: an `AppendResponse` of the new term describing WAL of the old one, which
    /// would be counted (the seeded model found this).
    fn restart_election(&mut self, greeted: SkId) {
        if self.phase == Phase::Elected {
            self.prev_history = Some(self.history.clone());
        }
        self.phase = Phase::Greeting;
        self.donor = None;
        self.fetch = None; // its answer, if any, is ignored by id
        for m in &mut self.members {
            m.vote = None;
            // Rule 1: a flush counts only in the term that is being elected now.
            m.flush = Lsn::INVALID;
        }
        for sk in self.live().collect::<Vec<_>>() {
            let Some(c) = self.members[sk].conn.clone() else {
                continue;
            };
            if sk == greeted && matches!(c.state, ConnState::Greeting) {
                // A fresh connection: only our greeting went over it.
                self.set_state(sk, ConnState::Greeted);
            } else {
                self.members[sk].conn = None;
                self.actions.push(Action::Reconnect {
                    sk,
                    conn: c.id,
                    reason: format!(
                        "membership generation {}: greeting in it on a new connection",
                        self.mconf.generation
                    ),
                });
            }
        }
        self.try_choose_term();
    }

    // ----- election --------------------------------------------------------------------------

    fn greeting(&self) -> ProposerGreeting {
        ProposerGreeting {
            tenant_id: self.cfg.ttid.tenant_id,
            timeline_id: self.cfg.ttid.timeline_id,
            mconf: self.mconf.clone(),
            pg_version: self.cfg.pg_version,
            system_id: self.cfg.system_id,
            wal_seg_size: self.cfg.wal_seg_size,
        }
    }

    fn on_connected(&mut self, sk: SkId, conn: ConnId) {
        if sk >= self.members.len() {
            return;
        }
        if self.members[sk].retired {
            let reason = "not a member of the configuration".to_string();
            self.actions.push(Action::Close { sk, conn, reason });
            return;
        }
        self.members[sk].conn = Some(Conn {
            id: conn,
            state: ConnState::Greeting,
        });
        let greeting = self.greeting();
        self.send(sk, conn, ProposerAcceptorMessage::Greeting(greeting));
    }

    fn on_greeting(&mut self, sk: SkId, conn: ConnId, g: AcceptorGreeting) {
        if !self.in_state(sk, |s| matches!(s, ConnState::Greeting)) {
            return self.close(sk, conn, "unexpected greeting".into());
        }
        self.members[sk].term = g.term;
        self.members[sk].node_id = Some(g.node_id);
        if g.mconf.generation > self.mconf.generation {
            return self.reconfigure(sk, g.mconf);
        }
        if self.mconf.generation != Generation::INVALID && !self.mconf.contains(g.node_id) {
            return self.retire(sk);
        }
        if self.phase != Phase::Greeting {
            if g.term > self.term {
                return self.step_down(g.term);
            }
            return self.request_vote(sk, conn);
        }
        self.set_state(sk, ConnState::Greeted);
        self.try_choose_term();
    }

    /// With greetings from a quorum, chooses a term above every term seen (and above ours when
    /// re-electing) and asks for votes.
    fn try_choose_term(&mut self) {
        if self.phase != Phase::Greeting {
            return;
        }
        let greeted: Vec<(SkId, ConnId)> = self
            .live()
            .filter_map(|i| match &self.members[i].conn {
                Some(c) if matches!(c.state, ConnState::Greeted) => Some((i, c.id)),
                _ => None,
            })
            .collect();
        if !self.is_quorum(|i| greeted.iter().any(|&(g, _)| g == i)) {
            return;
        }
        let highest = greeted
            .iter()
            .map(|&(i, _)| self.members[i].term)
            .max()
            .unwrap_or(Term(0))
            .max(self.term);
        self.term = Term(highest.0 + 1);
        self.phase = Phase::Voting;
        for (i, c) in greeted {
            self.request_vote(i, c);
        }
    }

    fn request_vote(&mut self, sk: SkId, conn: ConnId) {
        self.set_state(sk, ConnState::Voting);
        let req = VoteRequest {
            generation: self.mconf.generation,
            term: self.term,
        };
        self.send(sk, conn, ProposerAcceptorMessage::VoteRequest(req));
    }

    fn on_vote(&mut self, sk: SkId, conn: ConnId, v: VoteResponse) {
        if !self.in_state(sk, |s| matches!(s, ConnState::Voting)) {
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
                if self.is_quorum(|i| self.members[i].vote.is_some()) {
                    let votes = self.granted_votes();
                    self.become_elected(votes);
                }
            }
            Phase::Elected => self.start_streaming(sk),
            Phase::Recovering | Phase::Greeting | Phase::Stopped => {}
        }
    }

    /// Safekeepers that granted us their vote in our term.
    fn granted_votes(&self) -> Vec<(SkId, VoteResponse)> {
        self.live()
            .filter_map(|i| self.members[i].vote.clone().map(|v| (i, v)))
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
        if let Some(prev) = &self.prev_history {
            // Re-elected: our buffered WAL continues the new term only if the donor's WAL up to
            // the term start is ours: its history is a prefix of ours (no term we do not know)
            // and its WAL does not run past where ours moved on to a later term.
            let donor_history = dv.term_history.up_to(dv.flush_lsn);
            let ours = prev.0.starts_with(&donor_history.0)
                && match TermHistory::find_highest_common_point(
                    prev,
                    &dv.term_history,
                    dv.flush_lsn,
                ) {
                    Ok(Some(p)) => p.lsn >= term_start,
                    Ok(None) => !dv.flush_lsn.is_valid(),
                    Err(_) => false,
                };
            if !ours || term_start < self.wal.start || term_start > self.wal.end {
                self.phase = Phase::Stopped;
                self.actions.push(Action::ElectionFailed {
                    reason: format!(
                        "re-elected in term {}, but the donor sk{donor}'s WAL up to {term_start} \
                         (history {:?}) does not continue ours (history {prev:?}, WAL [{}, {})): \
                         another proposer wrote WAL",
                        self.term, dv.term_history, self.wal.start, self.wal.end
                    ),
                });
                return;
            }
        } else {
            self.wal = WalBuffer::new(term_start);
        }
        self.term_start = term_start;
        self.history = history;
        self.donor = Some(donor);
        self.vote_truncate = votes
            .iter()
            .map(|(_, v)| v.truncate_lsn)
            .max()
            .unwrap_or(Lsn::INVALID);
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
        // (A re-elected proposer still has its buffer above `wal.start`.)
        if from < self.wal.start {
            self.request_fetch(from, self.wal.start);
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
            self.live()
                .filter(|&i| self.members[i].flush >= to)
                .max_by_key(|&i| self.members[i].flush)
        };
        let Some(sk) = source else {
            return;
        };
        self.fetch_seq += 1;
        let id = self.fetch_seq;
        self.fetch = Some(PendingFetch { id, from, to });
        self.actions.push(Action::Fetch {
            id,
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
        self.prev_history = None;
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
            generation: self.mconf.generation,
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
                sent_truncate: Lsn::INVALID,
                active: true,
                probe: true,
            }),
        );
        self.pump(sk);
    }

    // ----- streaming -------------------------------------------------------------------------

    /// Sends `sk` what it lacks, within the in-flight window; if there is no WAL to send but the
    /// commit LSN moved (or, once finishing, `truncate_lsn` did), an empty append carrying it.
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
            s.sent_truncate = truncate;
            s.active = true;
            s.probe = false;
            self.send(sk, id, ProposerAcceptorMessage::AppendRequest(msg));
        }
        // While streaming, `truncate_lsn` rides on the next append or heartbeat: sending each of
        // its moves would add a message per commit to every member.
        let truncate_moved = self.finishing && s.sent_truncate != truncate;
        if s.next == self.wal.end && (s.sent_commit < self.commit || s.probe || truncate_moved) {
            let msg = self.append(s.next, Bytes::new(), truncate);
            s.sent_commit = self.commit;
            s.sent_truncate = truncate;
            s.active = true;
            s.probe = false;
            self.send(sk, id, ProposerAcceptorMessage::AppendRequest(msg));
        }
        self.set_state(sk, ConnState::Streaming(s));
    }

    fn append(&self, begin: Lsn, data: Bytes, truncate_lsn: Lsn) -> AppendRequest {
        AppendRequest {
            h: AppendRequestHeader {
                generation: self.mconf.generation,
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
        m.readers = Some((
            conn,
            ReadersFeedback {
                hs: r.hs_feedback,
                slowest: r.pageserver_feedback.map(|p| {
                    [
                        p.last_received_lsn,
                        p.disk_consistent_lsn,
                        p.remote_consistent_lsn,
                    ]
                }),
            },
        ));
        m.persisted_commit = m.persisted_commit.max(r.commit_lsn);
        if r.flush_lsn > m.flush {
            m.flush = r.flush_lsn;
            self.recompute_commit();
            if self.finishing {
                // `truncate_lsn` may have moved: the others' last append must carry it.
                for other in (0..self.members.len()).filter(|&o| o != sk) {
                    self.pump(other);
                }
            }
        }
        // The window may have opened.
        self.pump(sk);
    }

    /// The commit rule (rules 2 and 3 of the module doc).
    fn recompute_commit(&mut self) {
        let commit = self.quorum_flush();
        if commit > self.commit {
            self.commit = commit;
            self.actions.push(Action::Commit(commit));
            // Keep what lagging safekeepers need, within the retention limit; never uncommitted
            // WAL.
            let min_flush = self
                .live()
                .map(|i| self.members[i].flush)
                .min()
                .unwrap_or(Lsn::INVALID);
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
                s.sent_truncate = truncate;
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
