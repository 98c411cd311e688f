//! The persistent state of one timeline (what the control file holds) and its membership
//! configuration. Pure data: storage lives in [`crate::storage`].

use crate::types::{Generation, Lsn, NodeId, TenantId, Term, TermHistory, TimelineId};

/// One member of a safekeeper set.
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
pub struct SafekeeperId {
    /// The member's node id.
    pub id: NodeId,
    /// Host name or address its PostgreSQL-protocol port listens on.
    pub host: String,
    /// Its PostgreSQL-protocol port.
    pub pg_port: u16,
}

/// Membership configuration of a timeline.
///
/// Invariant: a non-zero `generation` has at least one member; member ids are unique.
#[derive(Clone, Default, PartialEq, Eq, Debug, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Configuration {
    /// The configuration's generation (0: no membership configuration, legacy mode).
    pub generation: Generation,
    /// The members (the old half of a joint configuration).
    pub members: Vec<SafekeeperId>,
    /// Set during a joint-consensus change.
    pub new_members: Option<Vec<SafekeeperId>>,
}

impl Configuration {
    /// Checks the invariant of a configuration in force: each half (members, and new members
    /// when set) is non-empty with unique node ids. Generation 0 (no configuration) is always
    /// valid.
    pub fn validate(&self) -> Result<(), String> {
        if self.generation.0 == 0 {
            return Ok(());
        }
        let valid_half = |half: &[SafekeeperId]| {
            let mut ids: Vec<NodeId> = half.iter().map(|m| m.id).collect();
            ids.sort_unstable();
            ids.dedup();
            !half.is_empty() && ids.len() == half.len()
        };
        if !valid_half(&self.members) || !self.new_members.as_deref().is_none_or(valid_half) {
            return Err(format!(
                "generation {}: each half of the configuration needs members with unique node ids",
                self.generation
            ));
        }
        Ok(())
    }

    /// Whether `id` is a member (of either half of a joint configuration).
    pub fn contains(&self, id: NodeId) -> bool {
        self.members.iter().any(|m| m.id == id)
            || self
                .new_members
                .as_ref()
                .is_some_and(|nm| nm.iter().any(|m| m.id == id))
    }
}

/// The acceptor's durable consensus state.
#[derive(Clone, Default, PartialEq, Eq, Debug, serde::Serialize)]
pub struct AcceptorState {
    /// Highest term this acceptor has voted in or seen. Only grows.
    pub term: Term,
    /// Which term wrote which part of the WAL this acceptor holds (may extend past its flush
    /// LSN; readers use `TermHistory::up_to(flush_lsn)`).
    pub term_history: TermHistory,
    /// The membership generation of the `ProposerElected` that started the newest term of the
    /// history: the generation that term was elected in (a proposer re-elects itself when it
    /// adopts a newer generation). An operator switching from a joint configuration to the new
    /// one waits until a majority of the new set holds WAL of a term elected in the joint one.
    pub elected_generation: Generation,
}

/// What the proposer's PostgreSQL server looks like.
#[derive(Clone, Default, PartialEq, Eq, Debug, serde::Serialize)]
pub struct ServerInfo {
    /// Full version number, e.g. 150018; 0 = unknown.
    pub pg_version: u32,
    /// PostgreSQL system identifier; 0 = unknown.
    pub system_id: u64,
    /// WAL segment size in bytes: a power of two in 1 MiB..=1 GiB.
    pub wal_seg_size: u32,
}

/// Everything about a timeline that must survive a restart (the control file's body).
#[derive(Clone, PartialEq, Eq, Debug, serde::Serialize)]
pub struct TimelinePersistentState {
    /// The tenant of the timeline.
    pub tenant_id: TenantId,
    /// The timeline.
    pub timeline_id: TimelineId,
    /// The membership configuration this acceptor knows.
    pub mconf: Configuration,
    /// Term and term history.
    pub acceptor_state: AcceptorState,
    /// The proposer's PostgreSQL server.
    pub server: ServerInfo,
    /// Where the timeline's WAL begins (globally).
    pub timeline_start_lsn: Lsn,
    /// Where this safekeeper's WAL begins.
    pub local_start_lsn: Lsn,
    /// Committed and locally available. Invariant: commit_lsn <= the WAL end found at start-up.
    pub commit_lsn: Lsn,
    /// Oldest WAL a peer may still need (the proposer's truncate_lsn).
    pub peer_horizon_lsn: Lsn,
    /// WAL before this is consumed downstream and may be removed.
    pub remote_consistent_lsn: Lsn,
    /// Complete segments below this are stored in remote storage (0 without remote storage).
    /// Only grows; committed WAL only, so no term truncates below it.
    pub backup_lsn: Lsn,
    /// Whether this node evicted the timeline: its WAL is wholly in remote storage (complete
    /// segments below `backup_lsn`, the segment holding `commit_lsn` as a partial object) and
    /// its local segment files are (being) removed; `commit_lsn` is its end of WAL. Set and
    /// cleared by the node, never by the consensus core.
    pub evicted: bool,
    /// Creation time, seconds since the Unix epoch (set by whoever creates the timeline; the
    /// consensus core never reads the clock).
    pub creation_ts: u64,
}

impl TimelinePersistentState {
    /// The state of a freshly created, empty timeline.
    pub fn new(
        tenant_id: TenantId,
        timeline_id: TimelineId,
        mconf: Configuration,
        server: ServerInfo,
        creation_ts: u64,
    ) -> TimelinePersistentState {
        TimelinePersistentState {
            tenant_id,
            timeline_id,
            mconf,
            acceptor_state: AcceptorState::default(),
            server,
            timeline_start_lsn: Lsn::INVALID,
            local_start_lsn: Lsn::INVALID,
            commit_lsn: Lsn::INVALID,
            peer_horizon_lsn: Lsn::INVALID,
            remote_consistent_lsn: Lsn::INVALID,
            backup_lsn: Lsn::INVALID,
            evicted: false,
            creation_ts,
        }
    }
}
