//! The acceptor's consensus state machine for one timeline: [`SafeKeeper::process_msg`].
//!
//! Sans-IO: it owns a [`ControlStore`] and a [`WalStore`] and does nothing but call them; no
//! sockets, no clock, no tasks. Callers serialize calls per timeline (the network layer holds the
//! timeline's lock around each `process_msg`). Any `Err` means "tear down this connection": the
//! proposer reconnects and starts over with a greeting.
//!
//! Rules (neon's `safekeeper.rs`, `shared/reference/neon-safekeeper.md` §2.4):
//! - a reply never reveals state that is not durable: votes are persisted before the reply
//!   exists, `flush_lsn` comes from the WAL store's durable end, and `AppendResponse.commit_lsn`
//!   is the *persisted* commit LSN;
//! - the commit LSN and peer horizon move in memory on the ingest path and are persisted off it
//!   by [`SafeKeeper::maybe_persist_inmem`], which the timeline manager runs periodically; the
//!   one exception is the first commit at or past the term start, which is persisted at once
//!   (sync-safekeepers waits for it);
//! - WAL below the commit LSN is never truncated.

use crate::protocol::{
    AcceptorGreeting, AcceptorProposerMessage, AppendRequest, AppendResponse, HotStandbyFeedback,
    ProposerAcceptorMessage, ProposerElected, ProposerGreeting, VoteRequest, VoteResponse,
};
use crate::state::{Configuration, TimelinePersistentState};
use crate::storage::{self, ControlStore, WalStore};
use crate::types::{
    Generation, Lsn, NodeId, TenantTimelineId, Term, TermHistory, TermHistoryError,
};

/// Why a message was refused. Every variant closes the proposer's connection.
#[derive(Debug, thiserror::Error)]
pub enum SafeKeeperError {
    /// A greeting for another timeline than this acceptor's.
    #[error("greeting is for timeline {got}, this is {ours}")]
    WrongTimeline {
        /// This acceptor's timeline.
        ours: TenantTimelineId,
        /// The greeting's.
        got: TenantTimelineId,
    },
    /// A proposer of a PostgreSQL version whose WAL is not supported.
    #[error("the proposer's {0}")]
    UnsupportedPgVersion(#[from] pg_wal::UnsupportedVersion),
    /// A proposer of another PostgreSQL major version than the timeline's: one timeline's WAL
    /// is of one major version (its page magic), so a primary upgraded to another major version
    /// starts a new timeline.
    #[error(
        "proposer runs PostgreSQL server_version_num {theirs}, the timeline's WAL is of major \
         version {}: mixed major versions within a timeline are refused",
        ours / 10000
    )]
    PgVersionMismatch {
        /// The timeline's version.
        ours: u32,
        /// The proposer's.
        theirs: u32,
    },
    /// A proposer with another WAL segment size than the timeline's.
    #[error("proposer uses WAL segment size {theirs}, timeline has {ours}")]
    WalSegSizeMismatch {
        /// The timeline's segment size.
        ours: u32,
        /// The proposer's.
        theirs: u32,
    },
    /// The proposer's configuration does not include this node.
    #[error("node {node_id} is not a member of configuration generation {generation}")]
    NotAMember {
        /// This node.
        node_id: NodeId,
        /// The configuration's generation.
        generation: Generation,
    },
    /// A message of another membership generation than the acceptor's.
    #[error("message generation {theirs} differs from ours {ours}")]
    GenerationMismatch {
        /// The acceptor's generation.
        ours: Generation,
        /// The message's.
        theirs: Generation,
    },
    /// A membership configuration that is not newer than the one in force.
    #[error("membership generation {theirs} is not newer than ours ({ours}) with other members")]
    MembershipNotNewer {
        /// The generation in force.
        ours: Generation,
        /// The one offered.
        theirs: Generation,
    },
    /// A malformed membership configuration.
    #[error("invalid membership configuration: {0}")]
    InvalidMembership(String),
    /// An append of the current term before the `ProposerElected` that starts it.
    #[error("append in term {theirs} before ProposerElected (our term {ours})")]
    AppendBeforeElected {
        /// The acceptor's term.
        ours: Term,
        /// The append's.
        theirs: Term,
    },
    /// `ProposerElected` with a start that is not the highest common point of the histories.
    #[error(
        "elected: start_streaming_at {start_streaming_at} differs from the highest common point {common_point}"
    )]
    StartStreamingMismatch {
        /// The message's start.
        start_streaming_at: Lsn,
        /// The highest common point the acceptor computed.
        common_point: Lsn,
    },
    /// `ProposerElected` that would truncate committed WAL.
    #[error("elected: start_streaming_at {start_streaming_at} is below commit_lsn {commit_lsn}")]
    TruncateBelowCommit {
        /// The message's start.
        start_streaming_at: Lsn,
        /// The acceptor's commit LSN.
        commit_lsn: Lsn,
    },
    /// `ProposerElected` without a term history.
    #[error("elected: empty term history")]
    EmptyTermHistory,
    /// `ProposerElected` whose history does not end with its own term.
    #[error("elected: last history entry is term {last}, message term is {term}")]
    HistoryTermMismatch {
        /// The history's last term.
        last: Term,
        /// The message's term.
        term: Term,
    },
    /// Inconsistent term histories.
    #[error(transparent)]
    TermHistory(#[from] TermHistoryError),
    /// At start-up: the WAL found ends below the persisted commit LSN.
    #[error("WAL ends at {flush_lsn}, below the persisted commit_lsn {commit_lsn}: data loss")]
    WalBelowCommit {
        /// Where the WAL ends.
        flush_lsn: Lsn,
        /// The persisted commit LSN.
        commit_lsn: Lsn,
    },
    /// Storage failed (the message had no effect beyond what the error says).
    #[error("storage: {0}")]
    Storage(#[from] storage::Error),
}

/// Values that move on the ingest path and are persisted lazily.
///
/// Invariant: each is `>=` its persisted counterpart in the control file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct InMemoryState {
    /// Invariant: `commit_lsn <= flush_lsn()`; never decreases.
    pub commit_lsn: Lsn,
    /// Oldest WAL any peer may still need (the proposer's `truncate_lsn`).
    pub peer_horizon_lsn: Lsn,
    /// WAL the pageserver has uploaded to remote storage.
    pub remote_consistent_lsn: Lsn,
    /// Complete segments below this are in remote storage (set by the backup task).
    pub backup_lsn: Lsn,
}

/// One timeline's acceptor.
pub struct SafeKeeper<CTRL: ControlStore, WAL: WalStore> {
    node_id: NodeId,
    /// The durable state (derefs to the last persisted `TimelinePersistentState`).
    control: CTRL,
    inmem: InMemoryState,
    wal: WAL,
    /// Where the current term's WAL starts (last entry of the elected history). Not persisted:
    /// `Lsn::INVALID` until a `ProposerElected` is processed after start-up, and appends are
    /// refused until then.
    term_start_lsn: Lsn,
}

impl<CTRL: ControlStore, WAL: WalStore> SafeKeeper<CTRL, WAL> {
    /// Builds the acceptor from persisted state only (start-up or reboot). Refuses a WAL that
    /// ends below the persisted commit LSN.
    pub fn new(node_id: NodeId, control: CTRL, wal: WAL) -> Result<Self, SafeKeeperError> {
        let flush_lsn = wal.flush_lsn().max(control.timeline_start_lsn);
        if control.commit_lsn > flush_lsn {
            return Err(SafeKeeperError::WalBelowCommit {
                flush_lsn,
                commit_lsn: control.commit_lsn,
            });
        }
        let inmem = InMemoryState {
            commit_lsn: control.commit_lsn,
            peer_horizon_lsn: control.peer_horizon_lsn,
            remote_consistent_lsn: control.remote_consistent_lsn,
            backup_lsn: control.backup_lsn,
        };
        Ok(SafeKeeper {
            node_id,
            control,
            inmem,
            wal,
            term_start_lsn: Lsn::INVALID,
        })
    }

    /// Processes one message; `Ok(None)` means "no reply".
    pub fn process_msg(
        &mut self,
        msg: &ProposerAcceptorMessage,
    ) -> Result<Option<AcceptorProposerMessage>, SafeKeeperError> {
        match msg {
            ProposerAcceptorMessage::Greeting(m) => self.handle_greeting(m).map(Some),
            ProposerAcceptorMessage::VoteRequest(m) => self.handle_vote_request(m).map(Some),
            ProposerAcceptorMessage::Elected(m) => self.handle_elected(m).map(|()| None),
            ProposerAcceptorMessage::AppendRequest(m) => self.handle_append(m, true),
            ProposerAcceptorMessage::NoFlushAppendRequest(m) => self.handle_append(m, false),
            ProposerAcceptorMessage::FlushWAL => {
                self.wal.flush_wal()?;
                Ok(Some(AcceptorProposerMessage::AppendResponse(
                    self.append_response(),
                )))
            }
        }
    }

    // ----- accessors -----------------------------------------------------------------------

    /// This node's id.
    pub fn node_id(&self) -> NodeId {
        self.node_id
    }

    /// The last persisted state.
    pub fn state(&self) -> &TimelinePersistentState {
        &self.control
    }

    /// The lazily persisted values as they are now.
    pub fn inmem(&self) -> InMemoryState {
        self.inmem
    }

    /// The timeline this acceptor serves.
    pub fn ttid(&self) -> TenantTimelineId {
        TenantTimelineId {
            tenant_id: self.control.tenant_id,
            timeline_id: self.control.timeline_id,
        }
    }

    /// Highest term voted in or seen.
    pub fn term(&self) -> Term {
        self.control.acceptor_state.term
    }

    /// Durable end of WAL: `max(wal.flush_lsn(), timeline_start_lsn)`.
    pub fn flush_lsn(&self) -> Lsn {
        self.wal.flush_lsn().max(self.control.timeline_start_lsn)
    }

    /// End of WAL handed to storage (possibly not durable).
    pub fn write_lsn(&self) -> Lsn {
        self.wal.write_lsn()
    }

    /// Commit LSN known in memory (`>=` the persisted one).
    pub fn commit_lsn(&self) -> Lsn {
        self.inmem.commit_lsn
    }

    /// Commit LSN in the control file (what replies report).
    pub fn persisted_commit_lsn(&self) -> Lsn {
        self.control.commit_lsn
    }

    /// Start of the current term's WAL, `Lsn::INVALID` before `ProposerElected`.
    pub fn term_start_lsn(&self) -> Lsn {
        self.term_start_lsn
    }

    /// The term history of the WAL this acceptor actually holds (entries up to `flush_lsn()`).
    pub fn get_term_history(&self) -> TermHistory {
        self.control
            .acceptor_state
            .term_history
            .up_to(self.flush_lsn())
    }

    /// Term of the newest WAL held.
    pub fn last_log_term(&self) -> Term {
        self.get_term_history().last_log_term()
    }

    /// The WAL store.
    pub fn wal(&self) -> &WAL {
        &self.wal
    }

    /// The WAL store, to change it behind the acceptor's back (benches rewind it).
    pub fn wal_mut(&mut self) -> &mut WAL {
        &mut self.wal
    }

    /// The control store.
    pub fn control(&self) -> &CTRL {
        &self.control
    }

    /// The control store, to finish a save written outside the caller's lock (see
    /// [`SafeKeeper::inmem_to_save`]). The state it then holds must be durable.
    pub fn control_mut(&mut self) -> &mut CTRL {
        &mut self.control
    }

    /// Gives the storage back (a test "reboot" rebuilds a `SafeKeeper` from it).
    pub fn into_storage(self) -> (CTRL, WAL) {
        (self.control, self.wal)
    }

    // ----- persistence off the hot path ----------------------------------------------------

    /// The persisted state with the in-memory values laid over it.
    fn state_with_inmem(&self) -> TimelinePersistentState {
        let mut s = self.control.clone();
        s.commit_lsn = self.inmem.commit_lsn;
        s.peer_horizon_lsn = self.inmem.peer_horizon_lsn;
        s.remote_consistent_lsn = self.inmem.remote_consistent_lsn;
        s.backup_lsn = self.inmem.backup_lsn;
        s
    }

    /// Records that complete segments below `lsn` are stored remotely (persisted lazily with
    /// the other in-memory values). Never moves back.
    pub fn set_backup_lsn(&mut self, lsn: Lsn) {
        self.inmem.backup_lsn = self.inmem.backup_lsn.max(lsn);
    }

    /// Persists the in-memory values if they differ from the control file. Returns whether it
    /// wrote.
    pub fn persist_inmem(&mut self) -> Result<bool, SafeKeeperError> {
        self.maybe_persist_inmem(true)
    }

    /// Persists the in-memory values with the eviction flag set to `evicted` (see
    /// [`TimelinePersistentState::evicted`]; the node decides when, the core never reads it).
    pub fn persist_evicted(&mut self, evicted: bool) -> Result<(), SafeKeeperError> {
        let mut s = self.state_with_inmem();
        s.evicted = evicted;
        if s != *self.control {
            self.control.persist(&s)?;
        }
        Ok(())
    }

    /// Run by the timeline manager periodically (neon: every 300 ms). Persists the in-memory
    /// values if `force` (the caller's save interval elapsed, or shutdown) or if the commit LSN
    /// ran a whole segment ahead of the persisted one. Returns whether it wrote.
    pub fn maybe_persist_inmem(&mut self, force: bool) -> Result<bool, SafeKeeperError> {
        match self.inmem_to_save(force) {
            Some(s) => {
                self.control.persist(&s)?;
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// The state [`SafeKeeper::maybe_persist_inmem`] would persist now, for a caller that
    /// writes it outside its lock (the file store's two-phase save) and then makes it the
    /// persisted state through [`SafeKeeper::control_mut`].
    pub fn inmem_to_save(&self, force: bool) -> Option<TimelinePersistentState> {
        let seg = u64::from(self.control.server.wal_seg_size.max(1));
        let lag = self
            .inmem
            .commit_lsn
            .0
            .saturating_sub(self.control.commit_lsn.0);
        if !force && lag < seg {
            return None;
        }
        let s = self.state_with_inmem();
        (s != *self.control).then_some(s)
    }

    /// Records the pageserver's `remote_consistent_lsn` (in memory; persisted lazily).
    pub fn record_remote_consistent_lsn(&mut self, lsn: Lsn) {
        self.inmem.remote_consistent_lsn = self.inmem.remote_consistent_lsn.max(lsn);
    }

    /// Peer gossip (broker/HTTP): adopt a peer's commit LSN if the peer's newest WAL is of our
    /// last log term, so the same history is being committed. Capped by our flush LSN.
    pub fn record_peer_commit_lsn(
        &mut self,
        peer_last_log_term: Term,
        peer_commit_lsn: Lsn,
    ) -> Result<(), SafeKeeperError> {
        if peer_commit_lsn.is_valid() && peer_last_log_term == self.last_log_term() {
            self.update_commit_lsn(peer_commit_lsn)?;
        }
        Ok(())
    }

    /// Switches to membership configuration `mconf` (the operator's `PUT …/membership`),
    /// durably before it returns. Only forward: a lower generation, or the same generation with
    /// other members, is refused; the configuration in force again is a no-op. Returns whether
    /// it changed anything. Messages of other generations are refused from now on; a node that
    /// is not a member keeps its WAL but takes no part.
    pub fn set_membership(&mut self, mconf: Configuration) -> Result<bool, SafeKeeperError> {
        let ours = &self.control.mconf;
        if mconf == *ours {
            return Ok(false);
        }
        if mconf.generation <= ours.generation {
            return Err(SafeKeeperError::MembershipNotNewer {
                ours: ours.generation,
                theirs: mconf.generation,
            });
        }
        mconf
            .validate()
            .map_err(SafeKeeperError::InvalidMembership)?;
        let mut s = self.state_with_inmem();
        s.mconf = mconf;
        self.control.persist(&s)?;
        Ok(true)
    }

    /// HTTP term bump: raises the term to `to` (if higher) or by one, durably, so the current
    /// proposer must re-elect. Returns `(previous, current)`.
    pub fn term_bump(&mut self, to: Option<Term>) -> Result<(Term, Term), SafeKeeperError> {
        let previous = self.term();
        let current = match to {
            Some(to) => previous.max(to),
            None => Term(previous.0.saturating_add(1)),
        };
        if current != previous {
            let mut s = self.state_with_inmem();
            s.acceptor_state.term = current;
            self.control.persist(&s)?;
        }
        Ok((previous, current))
    }

    // ----- handlers ------------------------------------------------------------------------

    fn check_generation(&self, theirs: Generation) -> Result<(), SafeKeeperError> {
        let ours = self.control.mconf.generation;
        if theirs != ours {
            return Err(SafeKeeperError::GenerationMismatch { ours, theirs });
        }
        Ok(())
    }

    fn handle_greeting(
        &mut self,
        msg: &ProposerGreeting,
    ) -> Result<AcceptorProposerMessage, SafeKeeperError> {
        if msg.ttid() != self.ttid() {
            return Err(SafeKeeperError::WrongTimeline {
                ours: self.ttid(),
                got: msg.ttid(),
            });
        }
        pg_wal::PgMajor::from_server_version(msg.pg_version)?;
        let server = &self.control.server;
        if server.pg_version != 0 && msg.pg_version / 10000 != server.pg_version / 10000 {
            return Err(SafeKeeperError::PgVersionMismatch {
                ours: server.pg_version,
                theirs: msg.pg_version,
            });
        }
        // A stored size of 0 means "unknown" (adopted below); neon always has one stored.
        if server.wal_seg_size != 0 && msg.wal_seg_size != server.wal_seg_size {
            return Err(SafeKeeperError::WalSegSizeMismatch {
                ours: server.wal_seg_size,
                theirs: msg.wal_seg_size,
            });
        }
        // A newer configuration is adopted below: validated first, as the HTTP path validates
        // it (`set_membership`), so no greeting installs one with duplicate or no members.
        if msg.mconf.generation > self.control.mconf.generation {
            msg.mconf
                .validate()
                .map_err(SafeKeeperError::InvalidMembership)?;
        }
        if msg.mconf.generation > self.control.mconf.generation && !msg.mconf.contains(self.node_id)
        {
            return Err(SafeKeeperError::NotAMember {
                node_id: self.node_id,
                generation: msg.mconf.generation,
            });
        }

        let mut s = self.state_with_inmem();
        let mut changed = false;
        if msg.system_id != 0 && msg.system_id != s.server.system_id {
            s.server.system_id = msg.system_id;
            if msg.pg_version != 0 {
                s.server.pg_version = msg.pg_version;
            }
            changed = true;
        }
        if s.server.wal_seg_size == 0 && msg.wal_seg_size != 0 {
            s.server.wal_seg_size = msg.wal_seg_size;
            changed = true;
        }
        if msg.mconf.generation > s.mconf.generation {
            s.mconf = msg.mconf.clone();
            changed = true;
        }
        if changed {
            self.control.persist(&s)?;
        }
        Ok(AcceptorProposerMessage::Greeting(AcceptorGreeting {
            node_id: self.node_id,
            mconf: self.control.mconf.clone(),
            term: self.term(),
        }))
    }

    fn handle_vote_request(
        &mut self,
        msg: &VoteRequest,
    ) -> Result<AcceptorProposerMessage, SafeKeeperError> {
        self.check_generation(msg.generation)?;
        // Flush first so the reported flush_lsn covers everything received: the proposer must
        // not pick a start point below WAL we already hold (neon #9259).
        self.wal.flush_wal()?;
        let mut resp = VoteResponse {
            generation: self.control.mconf.generation,
            term: self.term(),
            vote_given: false,
            flush_lsn: self.flush_lsn(),
            truncate_lsn: self.inmem.peer_horizon_lsn,
            term_history: self.get_term_history(),
        };
        if self.term() < msg.term {
            let mut s = self.state_with_inmem();
            s.acceptor_state.term = msg.term;
            // The vote is durable before the reply exists.
            self.control.persist(&s)?;
            resp.term = msg.term;
            resp.vote_given = true;
        }
        Ok(AcceptorProposerMessage::VoteResponse(resp))
    }

    fn handle_elected(&mut self, msg: &ProposerElected) -> Result<(), SafeKeeperError> {
        self.check_generation(msg.generation)?;
        if self.term() > msg.term {
            // A newer term exists; the next AppendResponse tells the proposer.
            return Ok(());
        }
        msg.term_history.validate()?;
        let (first, last) = match (msg.term_history.0.first(), msg.term_history.0.last()) {
            (Some(f), Some(l)) => (*f, *l),
            _ => return Err(SafeKeeperError::EmptyTermHistory),
        };
        if last.term != msg.term {
            return Err(SafeKeeperError::HistoryTermMismatch {
                last: last.term,
                term: msg.term,
            });
        }
        if self.term() < msg.term {
            let mut s = self.state_with_inmem();
            s.acceptor_state.term = msg.term;
            self.control.persist(&s)?;
        }

        let flush_lsn = self.flush_lsn();
        let common = TermHistory::find_highest_common_point(
            &msg.term_history,
            &self.get_term_history(),
            flush_lsn,
        )?
        .map(|tl| tl.lsn)
        .unwrap_or(first.lsn);
        if common != msg.start_streaming_at {
            return Err(SafeKeeperError::StartStreamingMismatch {
                start_streaming_at: msg.start_streaming_at,
                common_point: common,
            });
        }
        if msg.start_streaming_at < self.inmem.commit_lsn {
            return Err(SafeKeeperError::TruncateBelowCommit {
                start_streaming_at: msg.start_streaming_at,
                commit_lsn: self.inmem.commit_lsn,
            });
        }
        if !self.wal.flush_lsn().is_valid() {
            self.wal.initialize_first_segment(msg.start_streaming_at)?;
        }
        self.wal.truncate_wal(msg.start_streaming_at)?;

        // One atomic persist of the new history and the start LSNs.
        let mut s = self.state_with_inmem();
        if !s.timeline_start_lsn.is_valid() {
            s.timeline_start_lsn = first.lsn;
        }
        if !s.peer_horizon_lsn.is_valid() {
            s.peer_horizon_lsn = s.timeline_start_lsn;
        }
        if !s.local_start_lsn.is_valid() {
            s.local_start_lsn = msg.start_streaming_at;
        }
        s.commit_lsn = s.commit_lsn.max(s.timeline_start_lsn);
        s.remote_consistent_lsn = s.remote_consistent_lsn.max(s.timeline_start_lsn);
        s.acceptor_state.term_history = msg.term_history.clone();
        s.acceptor_state.elected_generation = msg.generation;
        self.control.persist(&s)?;
        self.inmem.commit_lsn = s.commit_lsn;
        self.inmem.peer_horizon_lsn = s.peer_horizon_lsn;
        self.inmem.remote_consistent_lsn = s.remote_consistent_lsn;

        self.term_start_lsn = last.lsn;
        Ok(())
    }

    fn handle_append(
        &mut self,
        msg: &AppendRequest,
        require_flush: bool,
    ) -> Result<Option<AcceptorProposerMessage>, SafeKeeperError> {
        self.check_generation(msg.h.generation)?;
        if self.term() > msg.h.term {
            // A higher term: the proposer must re-elect, not just reconnect.
            return Ok(Some(AcceptorProposerMessage::AppendResponse(
                AppendResponse::term_only(self.control.mconf.generation, self.term()),
            )));
        }
        // Same term, but our WAL must have been aligned by this term's ProposerElected.
        if self.term() < msg.h.term
            || !self.term_start_lsn.is_valid()
            || self.control.acceptor_state.term_history.last_log_term() != msg.h.term
        {
            return Err(SafeKeeperError::AppendBeforeElected {
                ours: self.term(),
                theirs: msg.h.term,
            });
        }

        let flush_before = self.flush_lsn();
        if !msg.wal_data.is_empty() {
            // Continuity (no gap, no rewrite) is enforced by the store.
            self.wal.write_wal(msg.h.begin_lsn, &msg.wal_data)?;
        }
        if require_flush {
            self.wal.flush_wal()?;
        }
        if msg.h.commit_lsn.is_valid() {
            self.update_commit_lsn(msg.h.commit_lsn)?;
        }
        self.inmem.peer_horizon_lsn = self.inmem.peer_horizon_lsn.max(msg.h.truncate_lsn);

        if !require_flush && self.flush_lsn() == flush_before {
            return Ok(None);
        }
        Ok(Some(AcceptorProposerMessage::AppendResponse(
            self.append_response(),
        )))
    }

    /// `commit = min(max(candidate, known), flush_lsn())`; persists at once when commit first
    /// reaches the term start.
    fn update_commit_lsn(&mut self, candidate: Lsn) -> Result<(), SafeKeeperError> {
        let commit = candidate
            .max(self.inmem.commit_lsn)
            .min(self.flush_lsn())
            .max(self.inmem.commit_lsn);
        self.inmem.commit_lsn = commit;
        let persisted = self.control.commit_lsn;
        if self.term_start_lsn.is_valid()
            && persisted < self.term_start_lsn
            && self.term_start_lsn <= commit
        {
            self.persist_inmem()?;
        }
        Ok(())
    }

    fn append_response(&self) -> AppendResponse {
        AppendResponse {
            generation: self.control.mconf.generation,
            term: self.term(),
            flush_lsn: self.flush_lsn(),
            // The persisted value: a reply never reveals what a crash could take back.
            commit_lsn: self.control.commit_lsn,
            hs_feedback: HotStandbyFeedback::default(),
            pageserver_feedback: None,
        }
    }
}

#[cfg(test)]
mod tests;
