//! Peer recovery's decisions, sans I/O (issue 26: the timeline's decisions live in the manager
//! core): which peer may give this node WAL, where its WAL is appended, whether a donor still
//! qualifies when it is read again, and how long a failing timeline waits. The rules are
//! explained in [`crate::recovery`], the tokio driver that performs them.

use std::time::{Duration, Instant};

use serde::Serialize;
use sk_core::types::{Generation, Lsn, NodeId, Term, TermHistory};

/// How often each timeline is checked for a donor.
pub const RECOVERY_TICK: Duration = Duration::from_secs(1);

/// The longest wait before a timeline whose recovery sessions keep failing is tried again.
pub const MAX_RETRY_BACKOFF: Duration = Duration::from_secs(30);

/// The wait after a failed session, given the wait after the one before (zero if it succeeded
/// or there was none): doubles from [`RECOVERY_TICK`] up to [`MAX_RETRY_BACKOFF`].
pub fn next_backoff(prev: Duration) -> Duration {
    (prev * 2).clamp(RECOVERY_TICK, MAX_RETRY_BACKOFF)
}

/// What `/v1/timelines` shows of a timeline's peer recovery.
#[derive(Clone, Debug, Default, Serialize)]
pub struct RecoveryStatus {
    /// Whether WAL is being fetched from a peer now.
    pub active: bool,
    /// The peer it is (or was last) fetched from.
    pub donor: Option<NodeId>,
    /// WAL bytes received by recovery on this timeline since the daemon started.
    pub bytes: u64,
    /// Completed recovery sessions.
    pub sessions: u64,
    /// Why the last session failed, if it did (cleared by one that succeeds).
    pub last_error: Option<String>,
    /// The wait after the last failed session ([`next_backoff`]; zero after a success).
    #[serde(skip)]
    pub backoff: Duration,
    /// No check of this timeline before then (set after a failed session).
    #[serde(skip)]
    pub retry_at: Option<Instant>,
}

/// This node's side of the comparison, read under the acceptor lock.
#[derive(Clone, Debug)]
pub struct LocalView {
    /// The acceptor's term.
    pub term: Term,
    /// The history of the WAL held (up to `flush_lsn`).
    pub term_history: TermHistory,
    /// Durable end of WAL.
    pub flush_lsn: Lsn,
    /// Commit LSN known in memory.
    pub commit_lsn: Lsn,
    /// The membership generation in force.
    pub generation: Generation,
}

impl LocalView {
    /// The term of the newest WAL held.
    pub fn last_log_term(&self) -> Term {
        self.term_history.last_log_term()
    }
}

/// A peer's timeline status, as far as recovery needs it.
#[derive(Clone, Debug)]
pub struct PeerView {
    /// The peer's node id.
    pub id: NodeId,
    /// Its HTTP address (as in `--peers`).
    pub http: String,
    /// Its acceptor's term.
    pub term: Term,
    /// The history of its WAL.
    pub term_history: TermHistory,
    /// Its durable end of WAL.
    pub flush_lsn: Lsn,
    /// Its commit LSN.
    pub commit_lsn: Lsn,
    /// The generation its newest term was elected in.
    pub elected_generation: Generation,
}

impl PeerView {
    /// The term of the newest WAL held.
    pub fn last_log_term(&self) -> Term {
        self.term_history.last_log_term()
    }
}

/// Why a peer is not a donor (logged at debug level; shown in the tests).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotADonor {
    /// We have voted in no term yet: there is no term N to recover WAL of.
    NoTerm,
    /// Not ahead of us.
    NotAhead,
    /// Its term or its newest WAL's term is not our term.
    OtherTerm {
        /// Our term.
        ours: Term,
        /// The peer's term.
        term: Term,
        /// The term of the peer's newest WAL.
        last_log_term: Term,
    },
    /// Its term was elected in another membership generation than ours.
    OtherGeneration {
        /// Ours.
        ours: Generation,
        /// Where the peer's term was elected.
        elected: Generation,
    },
}

/// Whether `peer` may give `me` WAL (the module's donor rules).
pub fn check_donor(me: &LocalView, peer: &PeerView) -> Result<(), NotADonor> {
    if me.term == Term(0) {
        return Err(NotADonor::NoTerm);
    }
    if (peer.last_log_term(), peer.flush_lsn) <= (me.last_log_term(), me.flush_lsn) {
        return Err(NotADonor::NotAhead);
    }
    if peer.term != me.term || peer.last_log_term() != me.term {
        return Err(NotADonor::OtherTerm {
            ours: me.term,
            term: peer.term,
            last_log_term: peer.last_log_term(),
        });
    }
    if peer.elected_generation != me.generation {
        return Err(NotADonor::OtherGeneration {
            ours: me.generation,
            elected: peer.elected_generation,
        });
    }
    Ok(())
}

/// The most advanced donor among `peers`, if any.
pub fn choose_donor<'a>(me: &LocalView, peers: &'a [PeerView]) -> Option<&'a PeerView> {
    peers
        .iter()
        .filter(|p| match check_donor(me, p) {
            Ok(()) => true,
            Err(why) => {
                tracing::debug!(peer = %p.id, ?why, "not a donor");
                false
            }
        })
        .max_by_key(|p| p.flush_lsn)
}

/// Where the donor's WAL is appended: the highest point our history has in common with the
/// donor's (what `process_msg` computes for the `ProposerElected`), or the donor history's start
/// if none.
pub fn start_point(me: &LocalView, donor: &PeerView) -> Result<Lsn, String> {
    let first = donor
        .term_history
        .0
        .first()
        .ok_or("the donor's term history is empty")?;
    let common =
        TermHistory::find_highest_common_point(&donor.term_history, &me.term_history, me.flush_lsn)
            .map_err(|e| e.to_string())?;
    Ok(common.map(|c| c.lsn).unwrap_or(first.lsn))
}

/// Whether the donor's status read again (`fresh`) still allows recovering term `term`'s WAL
/// as the session began it: its term and its newest WAL's term are `term`, its term was
/// elected in the same generation, and its history's entry for `term` (where term `term`'s
/// WAL starts) is the one our `ProposerElected` carries.
pub fn recheck_donor(donor: &PeerView, fresh: &PeerView, term: Term) -> Result<(), String> {
    if fresh.term != term || fresh.last_log_term() != term {
        return Err(format!(
            "the donor moved on: its term is {}, its newest WAL's term {}, ours {term}",
            fresh.term,
            fresh.last_log_term()
        ));
    }
    if fresh.elected_generation != donor.elected_generation {
        return Err(format!(
            "the donor's term was elected in generation {}, not {}",
            fresh.elected_generation.0, donor.elected_generation.0
        ));
    }
    let entry = |h: &TermHistory| h.0.iter().find(|e| e.term == term).copied();
    if entry(&fresh.term_history) != entry(&donor.term_history) {
        return Err(format!(
            "the donor's history of term {term} changed: {:?}, was {:?}",
            entry(&fresh.term_history),
            entry(&donor.term_history)
        ));
    }
    Ok(())
}
