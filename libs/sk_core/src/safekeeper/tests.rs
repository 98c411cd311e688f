//! Unit tests of `process_msg`, one property each, over the in-memory fakes.

use bytes::Bytes;

use super::*;
use crate::protocol::{AppendRequestHeader, ProposerElected};
use crate::state::{Configuration, SafekeeperId, ServerInfo};
use crate::storage::mem::{MemControlStore, MemWalStore};
use crate::types::{TenantId, TimelineId};

type Sk = SafeKeeper<MemControlStore, MemWalStore>;

const S: u64 = 0x0100_0000;
const SEG: u32 = 16 << 20;

fn new_sk() -> Sk {
    new_sk_with_version(150000)
}

fn new_sk_with_version(pg_version: u32) -> Sk {
    let state = TimelinePersistentState::new(
        TenantId([1; 16]),
        TimelineId([2; 16]),
        Configuration::default(),
        ServerInfo {
            pg_version,
            system_id: 0,
            wal_seg_size: SEG,
        },
        0,
    );
    SafeKeeper::new(NodeId(1), MemControlStore::new(state), MemWalStore::new()).unwrap()
}

/// Power loss: un-synced WAL is gone; the SafeKeeper is rebuilt from persisted state only.
fn reboot(sk: Sk) -> Sk {
    let (ctrl, mut wal) = sk.into_storage();
    wal.power_loss();
    SafeKeeper::new(NodeId(1), ctrl, wal).unwrap()
}

fn hist(entries: &[(u64, u64)]) -> TermHistory {
    TermHistory::from_pairs(entries)
}

fn greeting() -> ProposerGreeting {
    ProposerGreeting {
        tenant_id: TenantId([1; 16]),
        timeline_id: TimelineId([2; 16]),
        mconf: Configuration::default(),
        pg_version: 150002,
        system_id: 77,
        wal_seg_size: SEG,
    }
}

fn vote(sk: &mut Sk, term: u64) -> VoteResponse {
    match sk
        .process_msg(&ProposerAcceptorMessage::VoteRequest(VoteRequest {
            generation: Generation(0),
            term: Term(term),
        }))
        .unwrap()
    {
        Some(AcceptorProposerMessage::VoteResponse(v)) => v,
        other => panic!("expected a vote response, got {other:?}"),
    }
}

fn elect(
    sk: &mut Sk,
    term: u64,
    history: &[(u64, u64)],
    start: u64,
) -> Result<(), SafeKeeperError> {
    let r = sk.process_msg(&ProposerAcceptorMessage::Elected(ProposerElected {
        generation: Generation(0),
        term: Term(term),
        start_streaming_at: Lsn(start),
        term_history: hist(history),
    }))?;
    assert!(r.is_none(), "elected has no reply");
    Ok(())
}

fn append_msg(term: u64, begin: u64, data: &[u8], commit: u64) -> AppendRequest {
    AppendRequest {
        h: AppendRequestHeader {
            generation: Generation(0),
            term: Term(term),
            begin_lsn: Lsn(begin),
            end_lsn: Lsn(begin + data.len() as u64),
            commit_lsn: Lsn(commit),
            truncate_lsn: Lsn(0),
        },
        wal_data: Bytes::copy_from_slice(data),
    }
}

fn append(
    sk: &mut Sk,
    term: u64,
    begin: u64,
    data: &[u8],
    commit: u64,
) -> Result<Option<AppendResponse>, SafeKeeperError> {
    let r = sk.process_msg(&ProposerAcceptorMessage::AppendRequest(append_msg(
        term, begin, data, commit,
    )))?;
    Ok(r.map(|m| match m {
        AcceptorProposerMessage::AppendResponse(a) => a,
        other => panic!("expected an append response, got {other:?}"),
    }))
}

fn append_noflush(
    sk: &mut Sk,
    term: u64,
    begin: u64,
    data: &[u8],
    commit: u64,
) -> Option<AcceptorProposerMessage> {
    sk.process_msg(&ProposerAcceptorMessage::NoFlushAppendRequest(append_msg(
        term, begin, data, commit,
    )))
    .unwrap()
}

/// An acceptor elected in term 1 at `S`, holding `len` durable bytes of term-1 WAL.
fn sk_with_term1_wal(len: usize) -> Sk {
    let mut sk = new_sk();
    assert!(vote(&mut sk, 1).vote_given);
    elect(&mut sk, 1, &[(1, S)], S).unwrap();
    if len > 0 {
        append(&mut sk, 1, S, &vec![0xab; len], 0).unwrap();
    }
    sk
}

// ----- voting --------------------------------------------------------------------------------

#[test]
fn vote_survives_reboot() {
    let mut sk = new_sk();
    assert!(vote(&mut sk, 1).vote_given);
    let mut sk = reboot(sk);
    assert_eq!(sk.term(), Term(1));
    let v = vote(&mut sk, 1);
    assert!(
        !v.vote_given,
        "the term-1 vote was already given before the reboot"
    );
    assert_eq!(v.term, Term(1));
}

#[test]
fn no_second_vote_in_same_term() {
    let mut sk = new_sk();
    assert!(vote(&mut sk, 2).vote_given);
    assert!(!vote(&mut sk, 2).vote_given);
    assert!(!vote(&mut sk, 1).vote_given);
    let v = vote(&mut sk, 3);
    assert!(v.vote_given);
    assert_eq!(v.term, Term(3));
}

#[test]
fn vote_is_persisted_before_the_reply() {
    let mut sk = new_sk();
    let before = sk.control().persist_count();
    let v = vote(&mut sk, 5);
    assert!(v.vote_given);
    assert_eq!(sk.control().persist_count(), before + 1);
    assert_eq!(sk.state().acceptor_state.term, Term(5));
}

#[test]
fn vote_flushes_wal_first() {
    let mut sk = sk_with_term1_wal(10);
    assert!(append_noflush(&mut sk, 1, S + 10, b"unsynced", 0).is_none());
    assert_eq!(sk.flush_lsn(), Lsn(S + 10));
    let v = vote(&mut sk, 2);
    assert_eq!(v.flush_lsn, Lsn(S + 18));
    assert_eq!(v.term_history, hist(&[(1, S)]));
}

#[test]
fn vote_reports_history_only_up_to_flush() {
    let mut sk = sk_with_term1_wal(10);
    vote(&mut sk, 3);
    // Term 3's history claims WAL from S+20, but this acceptor's WAL ends at S+10... after the
    // truncation at the common point it holds term 3 from S+10 on.
    elect(&mut sk, 3, &[(1, S), (3, S + 10)], S + 10).unwrap();
    assert_eq!(sk.get_term_history(), hist(&[(1, S), (3, S + 10)]));
    let mut sk2 = sk_with_term1_wal(10);
    vote(&mut sk2, 3);
    sk2.control
        .persist(&{
            let mut s = sk2.state().clone();
            s.acceptor_state.term_history = hist(&[(1, S), (3, S + 20)]);
            s
        })
        .unwrap();
    assert_eq!(vote(&mut sk2, 4).term_history, hist(&[(1, S)]));
}

// ----- greeting ------------------------------------------------------------------------------

#[test]
fn greeting_adopts_system_id_durably() {
    let mut sk = new_sk();
    let r = sk
        .process_msg(&ProposerAcceptorMessage::Greeting(greeting()))
        .unwrap();
    let Some(AcceptorProposerMessage::Greeting(g)) = r else {
        panic!("expected a greeting reply");
    };
    assert_eq!(g.node_id, NodeId(1));
    assert_eq!(g.term, Term(0));
    let sk = reboot(sk);
    assert_eq!(sk.state().server.system_id, 77);
    assert_eq!(sk.state().server.pg_version, 150002);
}

#[test]
fn greeting_for_another_timeline_is_rejected() {
    let mut sk = new_sk();
    let mut g = greeting();
    g.timeline_id = TimelineId([9; 16]);
    assert!(matches!(
        sk.process_msg(&ProposerAcceptorMessage::Greeting(g)),
        Err(SafeKeeperError::WrongTimeline { .. })
    ));
}

#[test]
fn greeting_of_an_unsupported_version_is_refused_naming_the_range_and_not_adopted() {
    for bad in [0, 130020, 190000] {
        let mut sk = new_sk();
        let before = sk.state().clone();
        let mut g = greeting();
        g.pg_version = bad;
        let e = sk
            .process_msg(&ProposerAcceptorMessage::Greeting(g))
            .unwrap_err();
        assert!(matches!(e, SafeKeeperError::UnsupportedPgVersion(_)), "{e}");
        assert!(e.to_string().contains("14 to 18"), "{e}");
        assert_eq!(sk.state(), &before);
    }
    for ok in [140023, 150018, 180004] {
        let mut sk = new_sk_with_version(ok);
        let mut g = greeting();
        g.pg_version = ok;
        sk.process_msg(&ProposerAcceptorMessage::Greeting(g))
            .unwrap();
    }
}

#[test]
fn greeting_with_other_pg_major_or_segment_size_is_rejected() {
    let mut sk = new_sk();
    let mut g = greeting();
    g.pg_version = 160000;
    assert!(matches!(
        sk.process_msg(&ProposerAcceptorMessage::Greeting(g)),
        Err(SafeKeeperError::PgVersionMismatch { .. })
    ));
    let mut g = greeting();
    g.wal_seg_size = 1 << 20;
    assert!(matches!(
        sk.process_msg(&ProposerAcceptorMessage::Greeting(g)),
        Err(SafeKeeperError::WalSegSizeMismatch { .. })
    ));
}

fn mconf(generation: u32, ids: &[u64]) -> Configuration {
    Configuration {
        generation: Generation(generation),
        members: ids
            .iter()
            .map(|&id| SafekeeperId {
                id: NodeId(id),
                host: format!("sk{id}"),
                pg_port: 5454,
            })
            .collect(),
        new_members: None,
    }
}

#[test]
fn greeting_adopts_higher_generation_durably_and_ignores_lower() {
    let mut sk = new_sk();
    let mut g = greeting();
    g.mconf = mconf(3, &[1, 2, 3]);
    sk.process_msg(&ProposerAcceptorMessage::Greeting(g))
        .unwrap();
    let mut sk = reboot(sk);
    assert_eq!(sk.state().mconf, mconf(3, &[1, 2, 3]));
    let mut g = greeting();
    g.mconf = mconf(2, &[1, 2]);
    sk.process_msg(&ProposerAcceptorMessage::Greeting(g))
        .unwrap();
    assert_eq!(sk.state().mconf.generation, Generation(3));
}

#[test]
fn greeting_with_higher_generation_excluding_us_is_rejected() {
    let mut sk = new_sk();
    let mut g = greeting();
    g.mconf = mconf(2, &[2, 3, 4]);
    assert!(matches!(
        sk.process_msg(&ProposerAcceptorMessage::Greeting(g)),
        Err(SafeKeeperError::NotAMember { .. })
    ));
    assert_eq!(sk.state().mconf.generation, Generation(0));
}

/// Issue 26: a greeting's configuration is validated as the HTTP one is, before it is adopted.
#[test]
fn greeting_with_an_invalid_configuration_is_refused_and_not_adopted() {
    let mut sk = new_sk();
    let mut g = greeting();
    g.mconf = mconf(2, &[1, 1, 2]);
    let r = sk.process_msg(&ProposerAcceptorMessage::Greeting(g));
    assert!(
        matches!(r, Err(SafeKeeperError::InvalidMembership(ref m)) if m.contains("unique")),
        "{r:?}"
    );
    assert_eq!(reboot(sk).state().mconf.generation, Generation(0));
}

#[test]
fn generation_mismatch_is_rejected() {
    let mut sk = new_sk();
    let mut g = greeting();
    g.mconf = mconf(2, &[1, 2, 3]);
    sk.process_msg(&ProposerAcceptorMessage::Greeting(g))
        .unwrap();
    for gen_ in [1, 3] {
        let r = sk.process_msg(&ProposerAcceptorMessage::VoteRequest(VoteRequest {
            generation: Generation(gen_),
            term: Term(1),
        }));
        assert!(matches!(r, Err(SafeKeeperError::GenerationMismatch { .. })));
    }
    assert_eq!(sk.term(), Term(0), "a refused vote changes nothing");
    let r = sk.process_msg(&ProposerAcceptorMessage::Elected(ProposerElected {
        generation: Generation(0),
        term: Term(1),
        start_streaming_at: Lsn(S),
        term_history: hist(&[(1, S)]),
    }));
    assert!(matches!(r, Err(SafeKeeperError::GenerationMismatch { .. })));
    let r = sk.process_msg(&ProposerAcceptorMessage::AppendRequest(append_msg(
        0, S, b"x", 0,
    )));
    assert!(matches!(r, Err(SafeKeeperError::GenerationMismatch { .. })));
}

#[test]
fn set_membership_moves_forward_durably_and_refuses_older_generations() {
    let mut sk = new_sk();
    let joint = Configuration {
        new_members: Some(mconf(2, &[1, 2, 4]).members),
        ..mconf(2, &[1, 2, 3])
    };
    assert!(sk.set_membership(joint.clone()).unwrap());
    assert!(
        !sk.set_membership(joint.clone()).unwrap(),
        "the same again is a no-op"
    );
    let mut sk = reboot(sk);
    assert_eq!(sk.state().mconf, joint, "persisted before it returned");
    assert!(matches!(
        sk.set_membership(mconf(1, &[1, 2, 3])),
        Err(SafeKeeperError::MembershipNotNewer { .. })
    ));
    assert!(matches!(
        sk.set_membership(mconf(2, &[1, 2])),
        Err(SafeKeeperError::MembershipNotNewer { .. })
    ));
    for bad in [
        mconf(3, &[]),
        mconf(3, &[1, 1, 2]),
        Configuration {
            new_members: Some(Vec::new()),
            ..mconf(3, &[1, 2, 3])
        },
    ] {
        assert!(matches!(
            sk.set_membership(bad),
            Err(SafeKeeperError::InvalidMembership(_))
        ));
    }
    assert_eq!(sk.state().mconf, joint, "refusals change nothing");
    // Messages of the old generation are refused from now on.
    let r = sk.process_msg(&ProposerAcceptorMessage::VoteRequest(VoteRequest {
        generation: Generation(1),
        term: Term(1),
    }));
    assert!(matches!(r, Err(SafeKeeperError::GenerationMismatch { .. })));
    // A node that is not a member of the next configuration keeps its state and takes it.
    assert!(sk.set_membership(mconf(3, &[2, 3, 4])).unwrap());
    assert_eq!(sk.state().mconf.generation, Generation(3));
}

// ----- elected -------------------------------------------------------------------------------

#[test]
fn elected_initializes_an_empty_timeline() {
    let mut sk = new_sk();
    vote(&mut sk, 1);
    elect(&mut sk, 1, &[(1, S)], S).unwrap();
    assert_eq!(sk.wal().initialized_at(), Some(Lsn(S)));
    let sk = reboot(sk);
    let st = sk.state();
    assert_eq!(st.timeline_start_lsn, Lsn(S));
    assert_eq!(st.local_start_lsn, Lsn(S));
    assert_eq!(st.commit_lsn, Lsn(S));
    assert_eq!(st.peer_horizon_lsn, Lsn(S));
    assert_eq!(st.acceptor_state.term_history, hist(&[(1, S)]));
    assert_eq!(sk.flush_lsn(), Lsn(S));
}

#[test]
fn elected_adopts_a_higher_term_durably() {
    let mut sk = new_sk();
    // This acceptor never voted for term 4 (the proposer won elsewhere).
    elect(&mut sk, 4, &[(4, S)], S).unwrap();
    let sk = reboot(sk);
    assert_eq!(sk.term(), Term(4));
}

#[test]
fn elected_for_a_lower_term_is_ignored() {
    let mut sk = sk_with_term1_wal(10);
    vote(&mut sk, 5);
    elect(&mut sk, 2, &[(1, S), (2, S + 5)], S + 5).unwrap();
    assert_eq!(sk.flush_lsn(), Lsn(S + 10), "nothing truncated");
    assert_eq!(sk.state().acceptor_state.term_history, hist(&[(1, S)]));
}

#[test]
fn elected_truncates_uncommitted_tail() {
    let mut sk = sk_with_term1_wal(100);
    append(&mut sk, 1, S + 100, b"", S + 10).unwrap();
    assert_eq!(sk.commit_lsn(), Lsn(S + 10));
    vote(&mut sk, 2);
    // The new proposer's history diverges from ours at S+50.
    elect(&mut sk, 2, &[(1, S), (2, S + 50)], S + 50).unwrap();
    assert_eq!(sk.flush_lsn(), Lsn(S + 50));
    assert_eq!(sk.write_lsn(), Lsn(S + 50));
    assert_eq!(sk.term_start_lsn(), Lsn(S + 50));
    let sk = reboot(sk);
    assert_eq!(sk.flush_lsn(), Lsn(S + 50), "the truncation is durable");
    assert_eq!(
        sk.state().acceptor_state.term_history,
        hist(&[(1, S), (2, S + 50)])
    );
    assert_eq!(sk.wal().read(Lsn(S), Lsn(S + 50)), Some(&[0xab; 50][..]));
}

#[test]
fn elected_never_truncates_below_commit() {
    let mut sk = sk_with_term1_wal(100);
    append(&mut sk, 1, S + 100, b"", S + 60).unwrap();
    vote(&mut sk, 2);
    let r = elect(&mut sk, 2, &[(1, S), (2, S + 50)], S + 50);
    assert!(matches!(
        r,
        Err(SafeKeeperError::TruncateBelowCommit { .. })
    ));
    assert_eq!(sk.flush_lsn(), Lsn(S + 100));
}

#[test]
fn elected_start_must_be_the_highest_common_point() {
    let mut sk = sk_with_term1_wal(100);
    vote(&mut sk, 2);
    // Common point is S+50 (where term 2 starts), not S+40.
    let r = elect(&mut sk, 2, &[(1, S), (2, S + 50)], S + 40);
    assert!(matches!(
        r,
        Err(SafeKeeperError::StartStreamingMismatch { common_point, .. }) if common_point == Lsn(S + 50)
    ));
    // The proposer's last term is common: the point is our end.
    let mut sk = sk_with_term1_wal(100);
    elect(&mut sk, 1, &[(1, S)], S + 100).unwrap();
    assert_eq!(sk.flush_lsn(), Lsn(S + 100));
}

#[test]
fn elected_without_common_point_starts_at_history_start() {
    let mut sk = sk_with_term1_wal(30);
    vote(&mut sk, 2);
    // Term 2 was elected without ever seeing term 1's (uncommitted) WAL.
    elect(&mut sk, 2, &[(2, S)], S).unwrap();
    assert_eq!(sk.flush_lsn(), Lsn(S));
    assert_eq!(sk.get_term_history(), hist(&[(2, S)]));
}

#[test]
fn elected_with_empty_or_foreign_history_is_rejected() {
    let mut sk = new_sk();
    assert!(matches!(
        elect(&mut sk, 1, &[], S),
        Err(SafeKeeperError::EmptyTermHistory)
    ));
    assert!(matches!(
        elect(&mut sk, 2, &[(1, S)], S),
        Err(SafeKeeperError::HistoryTermMismatch { .. })
    ));
}

// ----- append --------------------------------------------------------------------------------

#[test]
fn append_with_gap_is_rejected() {
    let mut sk = sk_with_term1_wal(16);
    let r = append(&mut sk, 1, S + 20, b"gap", 0);
    assert!(matches!(
        r,
        Err(SafeKeeperError::Storage(storage::Error::Rejected(_)))
    ));
    let r = append(&mut sk, 1, S + 8, b"rewrite", 0);
    assert!(matches!(
        r,
        Err(SafeKeeperError::Storage(storage::Error::Rejected(_)))
    ));
    assert_eq!(sk.write_lsn(), Lsn(S + 16));
}

#[test]
fn append_in_lower_term_gets_term_only_reply() {
    let mut sk = sk_with_term1_wal(16);
    vote(&mut sk, 3);
    let r = append(&mut sk, 1, S + 16, b"old", 0).unwrap().unwrap();
    assert_eq!(r, AppendResponse::term_only(Generation(0), Term(3)));
    assert_eq!(sk.write_lsn(), Lsn(S + 16));
}

#[test]
fn append_before_elected_is_rejected() {
    let mut sk = sk_with_term1_wal(16);
    assert!(matches!(
        append(&mut sk, 2, S + 16, b"x", 0),
        Err(SafeKeeperError::AppendBeforeElected { .. })
    ));
    // Voted for term 2, but no ProposerElected yet: still refused.
    vote(&mut sk, 2);
    assert!(matches!(
        append(&mut sk, 2, S + 16, b"x", 0),
        Err(SafeKeeperError::AppendBeforeElected { .. })
    ));
}

#[test]
fn appends_are_refused_after_reboot_until_elected() {
    let sk = sk_with_term1_wal(16);
    let mut sk = reboot(sk);
    assert!(append(&mut sk, 1, S + 16, b"x", 0).is_err());
    elect(&mut sk, 1, &[(1, S)], S + 16).unwrap();
    append(&mut sk, 1, S + 16, b"x", 0).unwrap();
}

#[test]
fn commit_never_exceeds_flush() {
    let mut sk = sk_with_term1_wal(0);
    // Written but not synced, with a commit LSN far ahead: commit stays at the durable end.
    assert!(append_noflush(&mut sk, 1, S, &[1; 40], S + 1000).is_none());
    assert_eq!(sk.commit_lsn(), Lsn(S));
    let Some(AcceptorProposerMessage::AppendResponse(r)) =
        sk.process_msg(&ProposerAcceptorMessage::FlushWAL).unwrap()
    else {
        panic!("FlushWAL always answers");
    };
    assert_eq!(r.flush_lsn, Lsn(S + 40));
    append(&mut sk, 1, S + 40, b"", S + 1000).unwrap();
    assert_eq!(sk.commit_lsn(), Lsn(S + 40));
    assert!(sk.commit_lsn() <= sk.flush_lsn());
    // And it never goes back.
    append(&mut sk, 1, S + 40, b"", S + 5).unwrap();
    assert_eq!(sk.commit_lsn(), Lsn(S + 40));
}

#[test]
fn append_reply_reports_persisted_commit_not_in_memory() {
    let mut sk = sk_with_term1_wal(100);
    let r = append(&mut sk, 1, S + 100, b"", S + 60).unwrap().unwrap();
    assert_eq!(sk.commit_lsn(), Lsn(S + 60));
    assert_eq!(r.commit_lsn, Lsn(S), "S+60 is only in memory");
    assert_eq!(r.flush_lsn, Lsn(S + 100));
    assert!(sk.maybe_persist_inmem(true).unwrap());
    let r = append(&mut sk, 1, S + 100, b"", 0).unwrap().unwrap();
    assert_eq!(r.commit_lsn, Lsn(S + 60));
}

#[test]
fn commit_first_reaching_term_start_is_persisted_at_once() {
    let mut sk = sk_with_term1_wal(100);
    vote(&mut sk, 2);
    elect(&mut sk, 2, &[(1, S), (2, S + 100)], S + 100).unwrap();
    append(&mut sk, 2, S + 100, &[2; 50], 0).unwrap();
    // Below the term start: memory only.
    append(&mut sk, 2, S + 150, b"", S + 90).unwrap();
    assert_eq!(sk.persisted_commit_lsn(), Lsn(S));
    // Crossing the term start: persisted by the append itself.
    let before = sk.control().persist_count();
    let r = append(&mut sk, 2, S + 150, b"", S + 120).unwrap().unwrap();
    assert_eq!(sk.control().persist_count(), before + 1);
    assert_eq!(sk.persisted_commit_lsn(), Lsn(S + 120));
    assert_eq!(r.commit_lsn, Lsn(S + 120));
    // Later commits in the same term stay in memory.
    append(&mut sk, 2, S + 150, b"", S + 150).unwrap();
    assert_eq!(sk.persisted_commit_lsn(), Lsn(S + 120));
    let sk = reboot(sk);
    assert_eq!(sk.commit_lsn(), Lsn(S + 120));
}

#[test]
fn inmem_state_is_persisted_lazily_by_the_manager() {
    let mut sk = sk_with_term1_wal(100);
    let mut m = append_msg(1, S + 100, b"", S + 80);
    m.h.truncate_lsn = Lsn(S + 70);
    sk.process_msg(&ProposerAcceptorMessage::AppendRequest(m))
        .unwrap();
    let writes = sk.control().persist_count();
    assert!(
        !sk.maybe_persist_inmem(false).unwrap(),
        "lag below one segment"
    );
    assert_eq!(sk.control().persist_count(), writes);
    assert!(sk.maybe_persist_inmem(true).unwrap());
    assert!(!sk.persist_inmem().unwrap(), "nothing changed since");
    let sk = reboot(sk);
    assert_eq!(sk.state().commit_lsn, Lsn(S + 80));
    assert_eq!(sk.state().peer_horizon_lsn, Lsn(S + 70));
}

#[test]
fn maybe_persist_writes_when_commit_lags_a_segment() {
    let mut sk = sk_with_term1_wal(0);
    sk.inmem.commit_lsn = Lsn(S + SEG as u64);
    assert!(sk.maybe_persist_inmem(false).unwrap());
}

#[test]
fn no_flush_append_replies_only_when_flush_moves() {
    let mut sk = sk_with_term1_wal(0);
    assert!(append_noflush(&mut sk, 1, S, b"abc", 0).is_none());
    assert_eq!(sk.flush_lsn(), Lsn(S));
    // A flushing append always answers, with the durable end.
    let r = append(&mut sk, 1, S + 3, b"de", 0).unwrap().unwrap();
    assert_eq!(r.flush_lsn, Lsn(S + 5));
    // FlushWAL always answers, even with nothing to flush.
    let r = sk.process_msg(&ProposerAcceptorMessage::FlushWAL).unwrap();
    assert!(
        matches!(r, Some(AcceptorProposerMessage::AppendResponse(a)) if a.flush_lsn == Lsn(S + 5))
    );
}

#[test]
fn reboot_with_wal_below_commit_is_refused() {
    let mut sk = sk_with_term1_wal(100);
    append(&mut sk, 1, S + 100, b"", S + 100).unwrap();
    sk.persist_inmem().unwrap();
    let (ctrl, _) = sk.into_storage();
    let mut wal = MemWalStore::new();
    wal.truncate_wal(Lsn(S + 50)).unwrap();
    assert!(matches!(
        SafeKeeper::new(NodeId(1), ctrl, wal),
        Err(SafeKeeperError::WalBelowCommit { .. })
    ));
}

#[test]
fn unsynced_append_is_lost_on_power_loss_but_synced_is_not() {
    let mut sk = sk_with_term1_wal(10);
    append_noflush(&mut sk, 1, S + 10, b"volatile", 0);
    let sk = reboot(sk);
    assert_eq!(sk.flush_lsn(), Lsn(S + 10));
    assert_eq!(sk.write_lsn(), Lsn(S + 10));
}

/// Like the file store, syncs by itself when a write completes a segment.
struct SegmentSyncingWal {
    inner: MemWalStore,
    seg: u64,
}

impl WalStore for SegmentSyncingWal {
    fn write_lsn(&self) -> Lsn {
        self.inner.write_lsn()
    }
    fn write_record_lsn(&self) -> Lsn {
        self.inner.write_record_lsn()
    }
    fn flush_lsn(&self) -> Lsn {
        self.inner.flush_lsn()
    }
    fn write_wal(&mut self, start: Lsn, buf: &[u8]) -> storage::Result<()> {
        self.inner.write_wal(start, buf)?;
        if (start.0 + buf.len() as u64).is_multiple_of(self.seg) {
            self.inner.flush_wal()?;
        }
        Ok(())
    }
    fn truncate_wal(&mut self, end: Lsn) -> storage::Result<()> {
        self.inner.truncate_wal(end)
    }
    fn flush_wal(&mut self) -> storage::Result<()> {
        self.inner.flush_wal()
    }
    fn initialize_first_segment(&mut self, init_lsn: Lsn) -> storage::Result<()> {
        self.inner.initialize_first_segment(init_lsn)
    }
}

#[test]
fn no_flush_append_completing_a_segment_replies_with_the_new_flush_lsn() {
    let seg = 0x100;
    let state = new_sk().state().clone();
    let wal = SegmentSyncingWal {
        inner: MemWalStore::new(),
        seg,
    };
    let mut sk = SafeKeeper::new(NodeId(1), MemControlStore::new(state), wal).unwrap();
    sk.process_msg(&ProposerAcceptorMessage::Elected(ProposerElected {
        generation: Generation(0),
        term: Term(1),
        start_streaming_at: Lsn(S),
        term_history: hist(&[(1, S)]),
    }))
    .unwrap();
    let noflush = |begin: u64, len: usize| {
        ProposerAcceptorMessage::NoFlushAppendRequest(append_msg(1, begin, &vec![1; len], 0))
    };
    assert!(sk.process_msg(&noflush(S, 0x80)).unwrap().is_none());
    let r = sk.process_msg(&noflush(S + 0x80, 0x80)).unwrap();
    assert!(
        matches!(r, Some(AcceptorProposerMessage::AppendResponse(a)) if a.flush_lsn == Lsn(S + seg)),
        "segment completion made WAL durable: the proposer must hear of it"
    );
}

#[test]
fn peer_commit_is_adopted_only_for_the_same_last_log_term() {
    let mut sk = sk_with_term1_wal(100);
    sk.record_peer_commit_lsn(Term(2), Lsn(S + 50)).unwrap();
    assert_eq!(sk.commit_lsn(), Lsn(S));
    sk.record_peer_commit_lsn(Term(1), Lsn(S + 500)).unwrap();
    assert_eq!(sk.commit_lsn(), Lsn(S + 100), "capped by our flush LSN");
}

#[test]
fn term_bump_is_durable_and_never_lowers_the_term() {
    let mut sk = new_sk();
    assert_eq!(sk.term_bump(None).unwrap(), (Term(0), Term(1)));
    assert_eq!(sk.term_bump(Some(Term(5))).unwrap(), (Term(1), Term(5)));
    assert_eq!(sk.term_bump(Some(Term(3))).unwrap(), (Term(5), Term(5)));
    let mut sk = reboot(sk);
    assert_eq!(sk.term(), Term(5));
    assert!(!vote(&mut sk, 5).vote_given);
}
