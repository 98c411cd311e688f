//! Unit tests of the proposer core: each drives the state machine with scripted replies. The
//! seeded model (`tests/model.rs`) drives it against real acceptors.

use super::*;
use sk_core::protocol::{AcceptorGreeting, HotStandbyFeedback};
use sk_core::types::{NodeId, TenantId, TimelineId};

fn cfg(n: usize) -> CoreConfig {
    CoreConfig::new(
        n,
        TenantTimelineId {
            tenant_id: TenantId([1; 16]),
            timeline_id: TimelineId([2; 16]),
        },
        42,
        150000,
        16 << 20,
        Lsn(0x100_0000),
    )
}

fn h(entries: &[(u64, u64)]) -> TermHistory {
    TermHistory::from_pairs(entries)
}

fn greeting(term: u64) -> AcceptorProposerMessage {
    AcceptorProposerMessage::Greeting(AcceptorGreeting {
        node_id: NodeId(1),
        mconf: Configuration::default(),
        term: Term(term),
    })
}

fn vote(term: u64, given: bool, flush: u64, history: TermHistory) -> AcceptorProposerMessage {
    AcceptorProposerMessage::VoteResponse(VoteResponse {
        generation: Generation::INVALID,
        term: Term(term),
        vote_given: given,
        flush_lsn: Lsn(flush),
        truncate_lsn: Lsn(0),
        term_history: history,
    })
}

fn ack(term: u64, flush: u64, commit: u64) -> AcceptorProposerMessage {
    AcceptorProposerMessage::AppendResponse(AppendResponse {
        generation: Generation::INVALID,
        term: Term(term),
        flush_lsn: Lsn(flush),
        commit_lsn: Lsn(commit),
        hs_feedback: HotStandbyFeedback::default(),
        pageserver_feedback: None,
    })
}

/// A core with connection `sk + 1` to each safekeeper `sk`.
struct Harness {
    core: ProposerCore,
    actions: Vec<Action>,
}

impl Harness {
    fn new(n: usize) -> Harness {
        Harness {
            core: ProposerCore::new(cfg(n)),
            actions: Vec::new(),
        }
    }

    fn step(&mut self, e: Event) {
        self.core.step(e);
        self.actions.extend(self.core.take_actions());
    }

    fn connect(&mut self, sk: SkId) {
        self.step(Event::Connected {
            sk,
            conn: sk as u64 + 1,
        });
    }

    fn recv(&mut self, sk: SkId, msg: AcceptorProposerMessage) {
        self.step(Event::Received {
            sk,
            conn: sk as u64 + 1,
            msg,
        });
    }

    fn drop_conn(&mut self, sk: SkId) {
        self.step(Event::Disconnected {
            sk,
            conn: sk as u64 + 1,
        });
    }

    /// Messages sent to `sk` since the last call (and forgets them).
    fn sent_to(&mut self, sk: SkId) -> Vec<ProposerAcceptorMessage> {
        let mut out = Vec::new();
        self.actions.retain(|a| match a {
            Action::Send { sk: s, msg, .. } if *s == sk => {
                out.push(msg.clone());
                false
            }
            _ => true,
        });
        out
    }

    /// The id of the last fetch the core asked for.
    fn fetch_id(&self) -> u64 {
        self.actions
            .iter()
            .rev()
            .find_map(|a| match a {
                Action::Fetch { id, .. } => Some(*id),
                _ => None,
            })
            .expect("a fetch was asked for")
    }

    fn commits(&self) -> Vec<Lsn> {
        self.actions
            .iter()
            .filter_map(|a| match a {
                Action::Commit(l) => Some(*l),
                _ => None,
            })
            .collect()
    }

    /// Greets all `n` safekeepers at term `terms[i]` and returns the chosen term.
    fn greet_all(&mut self, terms: &[u64]) -> u64 {
        for (sk, &t) in terms.iter().enumerate() {
            self.connect(sk);
            self.recv(sk, greeting(t));
        }
        self.core.term().0
    }
}

fn elected_start(msgs: &[ProposerAcceptorMessage]) -> Option<Lsn> {
    msgs.iter().find_map(|m| match m {
        ProposerAcceptorMessage::Elected(e) => Some(e.start_streaming_at),
        _ => None,
    })
}

fn appends(msgs: &[ProposerAcceptorMessage]) -> Vec<(Lsn, Lsn, Lsn)> {
    msgs.iter()
        .filter_map(|m| match m {
            ProposerAcceptorMessage::AppendRequest(a) => {
                Some((a.h.begin_lsn, a.h.end_lsn, a.h.commit_lsn))
            }
            _ => None,
        })
        .collect()
}

#[test]
fn commit_is_the_quorum_flush_at_or_above_term_start() {
    let l = |v: &[u64]| v.iter().map(|&x| Lsn(x)).collect::<Vec<_>>();
    assert_eq!(quorum_commit_lsn(&l(&[30, 10, 20]), 2, Lsn(0)), Lsn(20));
    assert_eq!(quorum_commit_lsn(&l(&[30, 10, 20]), 3, Lsn(0)), Lsn(10));
    // Below the term start counts as nothing: 2 of 3 needed, one at or above the start.
    assert_eq!(quorum_commit_lsn(&l(&[30, 10, 15]), 2, Lsn(20)), Lsn(0));
    assert_eq!(quorum_commit_lsn(&l(&[30, 25, 15]), 2, Lsn(20)), Lsn(25));
    assert_eq!(quorum_commit_lsn(&l(&[5]), 1, Lsn(0)), Lsn(5));
    assert_eq!(quorum_commit_lsn(&l(&[]), 1, Lsn(0)), Lsn(0));
}

#[test]
fn wal_buffer_slices_chunks_without_copying_and_trims() {
    let mut b = WalBuffer::new(Lsn(100));
    b.push(Bytes::from_static(&[1, 2, 3, 4]));
    b.push(Bytes::from_static(&[5, 6]));
    assert_eq!(
        b.slice(Lsn(101), 10).unwrap(),
        &[2, 3, 4][..],
        "stops at the chunk end"
    );
    assert_eq!(b.slice(Lsn(104), 1).unwrap(), &[5][..]);
    assert_eq!(b.slice(Lsn(106), 10).unwrap(), &[][..]);
    assert!(b.slice(Lsn(99), 10).is_none());
    assert!(b.slice(Lsn(107), 10).is_none());
    let mut out = Vec::new();
    assert!(b.read(Lsn(102), Lsn(106), &mut out));
    assert_eq!(out, vec![3, 4, 5, 6]);
    b.trim_to(Lsn(103));
    assert_eq!((b.start, b.end), (Lsn(103), Lsn(106)));
    assert!(!b.read(Lsn(102), Lsn(104), &mut out));
    assert_eq!(b.slice(Lsn(103), 10).unwrap(), &[4][..]);
    b.prepend(Lsn(100), Bytes::from_static(&[1, 2, 3]));
    assert!(b.read(Lsn(100), Lsn(106), &mut out));
    assert_eq!(out, vec![1, 2, 3, 4, 5, 6]);
    b.trim_to(Lsn(200));
    assert_eq!(
        (b.start, b.end),
        (Lsn(106), Lsn(106)),
        "never trims past the end"
    );
}

#[test]
fn empty_timeline_elects_and_streams_from_the_start_lsn() {
    let mut t = Harness::new(3);
    assert_eq!(
        t.greet_all(&[0, 0, 0]),
        1,
        "term is the highest greeting + 1"
    );
    assert_eq!(
        t.core.phase(),
        Phase::Voting,
        "a quorum of greetings starts the vote"
    );
    for sk in 0..3 {
        let sent = t.sent_to(sk);
        assert!(matches!(
            sent[..],
            [
                ProposerAcceptorMessage::Greeting(_),
                ProposerAcceptorMessage::VoteRequest(VoteRequest { term: Term(1), .. })
            ]
        ));
    }
    t.recv(0, vote(1, true, 0, h(&[])));
    assert_eq!(t.core.phase(), Phase::Voting, "one vote is not a quorum");
    t.recv(1, vote(1, true, 0, h(&[])));
    assert_eq!(t.core.phase(), Phase::Elected);
    assert_eq!(t.core.term_start(), Lsn(0x100_0000));
    assert_eq!(t.core.history(), &h(&[(1, 0x100_0000)]));
    assert_eq!(elected_start(&t.sent_to(0)), Some(Lsn(0x100_0000)));
    assert_eq!(elected_start(&t.sent_to(1)), Some(Lsn(0x100_0000)));
    assert!(
        t.sent_to(2).is_empty(),
        "no elected before it answers the vote"
    );
    t.recv(2, vote(1, true, 0, h(&[])));
    assert_eq!(
        elected_start(&t.sent_to(2)),
        Some(Lsn(0x100_0000)),
        "a late voter joins"
    );
}

/// The defect of issue 12, at the core: a safekeeper that voted, and whose start point is the
/// term start, has acknowledged nothing of this term until it answers an append after
/// `elected`. With one real acknowledgement of 2 needed, nothing may be committed.
#[test]
fn a_start_point_is_not_an_acknowledgement() {
    let mut t = Harness::new(3);
    t.greet_all(&[2, 2, 2]);
    // A (0) holds [0, 100) of term 1; C (2) is empty. A is the donor: the term starts at 100.
    t.recv(0, vote(3, true, 0x100_0100, h(&[(1, 0x100_0000)])));
    t.recv(2, vote(3, true, 0, h(&[])));
    // C lacks A's WAL: it is fetched from the donor before anyone is told `elected`.
    let fetch = t.actions.iter().find_map(|a| match a {
        Action::Fetch { sk, from, to, .. } => Some((*sk, *from, *to)),
        _ => None,
    });
    assert_eq!(fetch, Some((0, Lsn(0x100_0000), Lsn(0x100_0100))));
    let id = t.fetch_id();
    t.step(Event::Fetched {
        id,
        from: Lsn(0x100_0000),
        wal: Bytes::from(vec![7u8; 0x100]),
    });
    assert_eq!(t.core.phase(), Phase::Elected);
    assert_eq!(elected_start(&t.sent_to(0)), Some(Lsn(0x100_0100)));
    let to_c = t.sent_to(2);
    assert_eq!(elected_start(&to_c), Some(Lsn(0x100_0000)));
    assert_eq!(
        appends(&to_c),
        vec![(Lsn(0x100_0000), Lsn(0x100_0100), Lsn(0))]
    );
    // A's connection drops before A processed `elected`; C acknowledges all of it.
    t.drop_conn(0);
    t.recv(2, ack(3, 0x100_0100, 0));
    assert_eq!(
        t.core.counted_flush(0),
        Lsn(0),
        "A acknowledged nothing in term 3"
    );
    assert_eq!(
        t.core.commit_lsn(),
        Lsn(0),
        "one acknowledgement of two is no commit"
    );
    assert!(t.commits().is_empty());
}

#[test]
fn commit_needs_a_quorum_of_acknowledgements_at_or_above_the_term_start() {
    let mut t = Harness::new(3);
    t.greet_all(&[1, 1, 1]);
    let hist = h(&[(1, 0x100_0000)]);
    t.recv(0, vote(2, true, 0x100_1000, hist.clone()));
    t.recv(1, vote(2, true, 0x100_1000, hist.clone()));
    assert_eq!(t.core.phase(), Phase::Elected);
    t.core
        .push(Lsn(0x100_1000), Bytes::from(vec![1u8; 0x100]))
        .unwrap();
    t.actions.extend(t.core.take_actions());
    // Both acknowledge the term start only: that is WAL of term 1, committed only together with
    // term 2's (it is at the term start, so it counts).
    t.recv(0, ack(2, 0x100_1000, 0));
    assert_eq!(t.core.commit_lsn(), Lsn(0));
    t.recv(1, ack(2, 0x100_1000, 0));
    assert_eq!(t.core.commit_lsn(), Lsn(0x100_1000));
    t.recv(0, ack(2, 0x100_1100, 0));
    assert_eq!(t.core.commit_lsn(), Lsn(0x100_1000), "one of two above");
    t.recv(1, ack(2, 0x100_1100, 0));
    assert_eq!(t.core.commit_lsn(), Lsn(0x100_1100));
    assert_eq!(t.commits(), vec![Lsn(0x100_1000), Lsn(0x100_1100)]);
}

#[test]
fn replies_before_elected_or_beyond_what_was_sent_are_not_counted() {
    let mut t = Harness::new(3);
    t.greet_all(&[0, 0, 0]);
    t.recv(0, vote(1, true, 0, h(&[])));
    t.recv(1, vote(1, true, 0, h(&[])));
    t.core
        .push(Lsn(0x100_0000), Bytes::from(vec![1u8; 0x100]))
        .unwrap();
    t.actions.extend(t.core.take_actions());
    // sk 2 has not voted yet: an append response on its connection is a protocol violation.
    t.connect(2);
    t.recv(2, greeting(1));
    t.recv(2, ack(1, 0x100_0100, 0));
    assert!(!t.core.connected(2));
    assert_eq!(t.core.counted_flush(2), Lsn(0));
    // sk 0 claims more than was ever sent to it.
    t.recv(0, ack(1, 0x100_0200, 0));
    assert!(!t.core.connected(0));
    assert_eq!(t.core.counted_flush(0), Lsn(0));
    t.recv(1, ack(1, 0x100_0100, 0));
    assert_eq!(t.core.commit_lsn(), Lsn(0));
}

#[test]
fn a_higher_term_anywhere_steps_down() {
    for reply in [vote(5, false, 0, h(&[])), ack(5, 0, 0)] {
        let mut t = Harness::new(3);
        t.greet_all(&[0, 0, 0]);
        t.recv(0, vote(1, true, 0, h(&[])));
        t.recv(1, vote(1, true, 0, h(&[])));
        t.recv(2, reply);
        assert_eq!(t.core.phase(), Phase::Stopped, "{:?}", t.actions);
        assert!(t.actions.contains(&Action::SteppedDown { seen: Term(5) }));
        t.actions.clear();
        t.core
            .push(Lsn(0x100_0000), Bytes::from_static(b"x"))
            .unwrap_err();
        t.recv(1, ack(1, 0x100_0000, 0));
        assert!(t.actions.is_empty(), "a stopped proposer does nothing");
    }
}

#[test]
fn in_flight_window_holds_wal_until_acknowledged() {
    let mut c = cfg(1);
    c.max_in_flight = 256 << 10;
    let mut t = Harness {
        core: ProposerCore::new(c),
        actions: Vec::new(),
    };
    t.greet_all(&[0]);
    t.recv(0, vote(1, true, 0, h(&[])));
    t.sent_to(0);
    let start = 0x100_0000u64;
    for i in 0..8u64 {
        t.core
            .push(
                Lsn(start + i * (64 << 10)),
                Bytes::from(vec![0u8; 64 << 10]),
            )
            .unwrap();
    }
    t.actions.extend(t.core.take_actions());
    let sent = appends(&t.sent_to(0));
    assert_eq!(sent.len(), 4, "256 KiB window of 64 KiB appends");
    t.recv(0, ack(1, start + (128 << 10), 0));
    let sent = appends(&t.sent_to(0));
    assert_eq!(sent.len(), 2, "acknowledging 128 KiB opens 128 KiB");
    assert_eq!(sent[0].0, Lsn(start + (256 << 10)));
    assert_eq!(
        sent[0].2,
        Lsn(start + (128 << 10)),
        "appends carry the commit LSN"
    );
}

#[test]
fn late_voter_below_the_buffer_is_caught_up_by_a_fetch() {
    let mut t = Harness::new(3);
    t.greet_all(&[1, 1, 1]);
    let hist = h(&[(1, 0x100_0000)]);
    t.recv(0, vote(2, true, 0x100_1000, hist.clone()));
    t.recv(1, vote(2, true, 0x100_1000, hist));
    assert_eq!(t.core.phase(), Phase::Elected);
    assert_eq!(t.core.buffer_start(), Lsn(0x100_1000));
    // sk 2 was far behind: it holds term 1 up to 0x100_0800.
    t.recv(2, vote(2, true, 0x100_0800, h(&[(1, 0x100_0000)])));
    let fetch = t.actions.iter().find_map(|a| match a {
        Action::Fetch { sk, from, to, .. } => Some((*sk, *from, *to)),
        _ => None,
    });
    let donor = t.core.donor().expect("elected");
    assert_eq!(
        fetch,
        Some((donor, Lsn(0x100_0800), Lsn(0x100_1000))),
        "from the donor"
    );
    assert!(elected_start(&t.sent_to(2)).is_none(), "waits for the WAL");
    let id = t.fetch_id();
    t.step(Event::Fetched {
        id,
        from: Lsn(0x100_0800),
        wal: Bytes::from(vec![3u8; 0x800]),
    });
    let to_2 = t.sent_to(2);
    assert_eq!(elected_start(&to_2), Some(Lsn(0x100_0800)));
    assert_eq!(
        appends(&to_2),
        vec![(Lsn(0x100_0800), Lsn(0x100_1000), Lsn(0))]
    );
}

#[test]
fn failed_recovery_fails_the_election() {
    let mut t = Harness::new(3);
    t.greet_all(&[0, 0, 0]);
    t.recv(0, vote(1, true, 0x100_0100, h(&[(0, 0x100_0000)])));
    t.recv(1, vote(1, true, 0, h(&[])));
    assert_eq!(t.core.phase(), Phase::Recovering);
    let id = t.fetch_id();
    t.step(Event::FetchFailed {
        id,
        reason: "connection refused".into(),
    });
    assert_eq!(t.core.phase(), Phase::Stopped);
    assert!(
        t.actions
            .iter()
            .any(|a| matches!(a, Action::ElectionFailed { reason } if reason.contains("refused")))
    );
}

#[test]
fn stale_connection_events_are_ignored() {
    let mut t = Harness::new(1);
    t.greet_all(&[0]);
    t.recv(0, vote(1, true, 0, h(&[])));
    t.core
        .push(Lsn(0x100_0000), Bytes::from(vec![1u8; 16]))
        .unwrap();
    // Reconnected: connection 7 replaces connection 1.
    t.step(Event::Connected { sk: 0, conn: 7 });
    t.recv(0, ack(1, 0x100_0010, 0)); // on the old connection 1
    assert_eq!(t.core.counted_flush(0), Lsn(0));
    assert_eq!(t.core.commit_lsn(), Lsn(0));
}

#[test]
fn idle_streams_get_a_heartbeat_each_tick() {
    let mut t = Harness::new(1);
    t.greet_all(&[0]);
    t.recv(0, vote(1, true, 0, h(&[])));
    t.sent_to(0);
    t.step(Event::Tick); // activity since the last tick (elected): no heartbeat
    t.step(Event::Tick);
    assert_eq!(
        appends(&t.sent_to(0)),
        vec![(Lsn(0x100_0000), Lsn(0x100_0000), Lsn(0))]
    );
}

/// Issue 19: a safekeeper removes WAL only below the peers' horizon it was sent (the append's
/// `truncate_lsn`). While finishing, a stream may end only once its last append carries the
/// final horizon, which moves with the *other* members' last acknowledgements.
#[test]
fn finishing_streams_end_with_the_final_truncate_lsn() {
    let mut t = Harness::new(3);
    t.greet_all(&[0, 0, 0]);
    for sk in 0..3 {
        t.recv(sk, vote(1, true, 0, h(&[])));
    }
    let start = 0x100_0000u64;
    let end = start + (64 << 10);
    t.core
        .push(Lsn(start), Bytes::from(vec![0u8; 64 << 10]))
        .unwrap();
    t.actions.extend(t.core.take_actions());
    for sk in 0..3 {
        t.sent_to(sk);
    }
    t.recv(0, ack(1, end, 0));
    t.recv(1, ack(1, end, 0));
    assert_eq!(t.core.commit_lsn(), Lsn(end));
    t.recv(0, ack(1, end, end));
    t.recv(1, ack(1, end, end));
    // Safekeeper 2 has acknowledged nothing in this term: the horizon is unknown.
    assert_eq!(t.core.truncate_lsn(), Lsn(0));
    for sk in 0..3 {
        t.sent_to(sk);
    }
    t.step(Event::Finishing);
    assert!(
        !t.core.caught_up(0),
        "sent all WAL, the commit and the horizon, but safekeeper 2's acknowledgement will move it"
    );
    // Safekeeper 2's acknowledgement moves the horizon: 0 and 1 are behind on it again, and are
    // sent an empty append carrying it.
    t.recv(2, ack(1, end, 0));
    assert_eq!(t.core.truncate_lsn(), Lsn(end));
    for sk in 0..3 {
        let last = t.sent_to(sk).into_iter().rev().find_map(|m| match m {
            ProposerAcceptorMessage::AppendRequest(a) => Some(a.h),
            _ => None,
        });
        let last = last.unwrap_or_else(|| panic!("safekeeper {sk} was sent the new horizon"));
        assert_eq!((last.truncate_lsn, last.commit_lsn), (Lsn(end), Lsn(end)));
        assert!(t.core.caught_up(sk));
    }
}

// ----- membership ------------------------------------------------------------------------------

fn member(node: u64) -> SafekeeperId {
    SafekeeperId {
        id: NodeId(node),
        host: format!("sk{node}"),
        pg_port: 5454,
    }
}

fn mconf(generation: u32, members: &[u64], new: Option<&[u64]>) -> Configuration {
    Configuration {
        generation: Generation(generation),
        members: members.iter().map(|&n| member(n)).collect(),
        new_members: new.map(|n| n.iter().map(|&n| member(n)).collect()),
    }
}

/// The greeting of node `node` (safekeeper `node - 1`) in configuration `c`.
fn greeting_of(node: u64, term: u64, c: &Configuration) -> AcceptorProposerMessage {
    AcceptorProposerMessage::Greeting(AcceptorGreeting {
        node_id: NodeId(node),
        mconf: c.clone(),
        term: Term(term),
    })
}

fn vote_in(
    generation: u32,
    term: u64,
    flush: u64,
    history: TermHistory,
) -> AcceptorProposerMessage {
    AcceptorProposerMessage::VoteResponse(VoteResponse {
        generation: Generation(generation),
        term: Term(term),
        vote_given: true,
        flush_lsn: Lsn(flush),
        truncate_lsn: Lsn(0),
        term_history: history,
    })
}

fn ack_in(generation: u32, term: u64, flush: u64) -> AcceptorProposerMessage {
    AcceptorProposerMessage::AppendResponse(AppendResponse {
        generation: Generation(generation),
        term: Term(term),
        flush_lsn: Lsn(flush),
        commit_lsn: Lsn(0),
        hs_feedback: HotStandbyFeedback::default(),
        pageserver_feedback: None,
    })
}

fn harness_in(n: usize, c: &Configuration) -> Harness {
    let mut config = cfg(n);
    config.addrs = (1..=n).map(|i| format!("sk{i}:5454")).collect();
    config.mconf = c.clone();
    Harness {
        core: ProposerCore::new(config),
        actions: Vec::new(),
    }
}

/// Joint consensus: greetings, votes and acknowledgements all need a majority of the old
/// members *and* of the new ones (node 3 is in both).
#[test]
fn a_joint_configuration_needs_a_majority_of_both_halves() {
    let joint = mconf(1, &[1, 2, 3], Some(&[3, 4, 5]));
    let mut t = harness_in(5, &joint);
    for sk in 0..5 {
        t.connect(sk);
    }
    for sk in 0..3 {
        t.recv(sk, greeting_of(sk as u64 + 1, 0, &joint));
    }
    assert_eq!(
        t.core.phase(),
        Phase::Greeting,
        "nodes 1-3: a majority of the old half, one of the new"
    );
    t.recv(3, greeting_of(4, 0, &joint));
    assert_eq!(t.core.phase(), Phase::Voting);
    assert!(t.sent_to(0).iter().any(|m| matches!(
        m,
        ProposerAcceptorMessage::VoteRequest(VoteRequest {
            generation: Generation(1),
            ..
        })
    )));
    for sk in [0, 1, 3] {
        t.recv(sk, vote_in(1, 1, 0, h(&[])));
    }
    assert_eq!(
        t.core.phase(),
        Phase::Voting,
        "nodes 1, 2, 4: no majority of {{3, 4, 5}}"
    );
    t.recv(2, vote_in(1, 1, 0, h(&[])));
    assert_eq!(t.core.phase(), Phase::Elected);
    t.core
        .push(Lsn(0x100_0000), Bytes::from(vec![1u8; 0x100]))
        .unwrap();
    let end = 0x100_0100;
    t.recv(0, ack_in(1, 1, end));
    t.recv(1, ack_in(1, 1, end));
    t.recv(3, ack_in(1, 1, end));
    assert!(
        t.commits().is_empty(),
        "nodes 1, 2, 4 acknowledged: the new half has only one"
    );
    t.recv(2, ack_in(1, 1, end));
    assert_eq!(t.commits(), vec![Lsn(end)], "node 3 makes both majorities");
    let elected_gen = t.sent_to(2).iter().find_map(|m| match m {
        ProposerAcceptorMessage::Elected(e) => Some(e.generation),
        _ => None,
    });
    assert_eq!(
        elected_gen,
        Some(Generation(1)),
        "messages carry the generation"
    );
}

/// Elects nodes 1-3 in generation 1 (members 1-3), streams `[start, start + 0x100)` and commits
/// it on all three. Returns the harness.
fn elected_in_generation_one() -> Harness {
    let g1 = mconf(1, &[1, 2, 3], None);
    let mut t = harness_in(3, &g1);
    for sk in 0..3 {
        t.connect(sk);
        t.recv(sk, greeting_of(sk as u64 + 1, 0, &g1));
    }
    for sk in 0..3 {
        t.recv(sk, vote_in(1, 1, 0, h(&[])));
    }
    assert_eq!(t.core.phase(), Phase::Elected);
    t.core
        .push(Lsn(0x100_0000), Bytes::from(vec![1u8; 0x100]))
        .unwrap();
    for sk in 0..3 {
        t.recv(sk, ack_in(1, 1, 0x100_0100));
    }
    assert_eq!(t.core.commit_lsn(), Lsn(0x100_0100));
    t.actions.clear();
    t
}

/// A greeting shows a newer configuration: the proposer adopts it, adds the new member, retires
/// the removed one, greets again, and re-elects itself with a higher term in the new generation
/// while WAL pushed meanwhile waits; the new term continues the same WAL.
#[test]
fn a_newer_configuration_re_elects_in_it_and_keeps_the_wal() {
    let mut t = elected_in_generation_one();
    // An append answered before the change, still in flight on sk 1's connection.
    t.core
        .push(Lsn(0x100_0100), Bytes::from(vec![2u8; 0x80]))
        .unwrap();
    let joint = mconf(2, &[1, 2, 3], Some(&[1, 2, 4]));
    // sk 0's safekeeper switched: it refused our append and closed; we reconnect.
    t.drop_conn(0);
    t.connect(0);
    t.recv(0, greeting_of(1, 1, &joint));
    assert!(
        t.actions
            .iter()
            .any(|a| matches!(a, Action::Reconfigured { mconf } if *mconf == joint))
    );
    assert!(
        t.actions.iter().any(|a| matches!(
            a,
            Action::AddSafekeeper { sk: 3, id } if id.id == NodeId(4) && id.host == "sk4"
        )),
        "node 4 is new: {:?}",
        t.actions
    );
    assert_eq!(t.core.phase(), Phase::Greeting);
    assert_eq!(t.core.mconf(), &joint);
    // WAL keeps coming while the proposer re-elects itself.
    t.core
        .push(Lsn(0x100_0180), Bytes::from(vec![3u8; 0x80]))
        .unwrap();
    // The other connections carried the old term's appends: they are made anew (see
    // `restart_election`), and greeted on the new connection.
    for sk in [1, 2] {
        assert!(
            t.actions
                .iter()
                .any(|a| matches!(a, Action::Reconnect { sk: s, .. } if *s == sk)),
            "sk{sk} reconnects"
        );
        assert!(!t.core.connected(sk));
    }
    t.connect(1);
    assert!(matches!(
        t.sent_to(1)[..],
        [.., ProposerAcceptorMessage::Greeting(ref g)] if g.mconf == joint
    ));
    t.recv(1, greeting_of(2, 1, &joint));
    t.connect(3);
    t.recv(3, greeting_of(4, 0, &joint));
    assert_eq!(
        t.core.phase(),
        Phase::Voting,
        "nodes 1, 2, 4 make both majorities"
    );
    assert_eq!(t.core.term(), Term(2), "a term above ours");
    // Node 2 holds everything (the donor); node 4 is empty.
    t.recv(0, vote_in(2, 2, 0x100_0100, h(&[(1, 0x100_0000)])));
    t.recv(1, vote_in(2, 2, 0x100_0180, h(&[(1, 0x100_0000)])));
    assert_eq!(
        t.core.phase(),
        Phase::Elected,
        "nodes 1 and 2 are a quorum: {:?}",
        t.actions
    );
    assert_eq!(t.core.term_start(), Lsn(0x100_0180), "the donor is node 2");
    assert_eq!(
        t.core.end_lsn(),
        Lsn(0x100_0200),
        "the WAL pushed meanwhile is kept"
    );
    assert_eq!(t.core.history(), &h(&[(1, 0x100_0000), (2, 0x100_0180)]));
    assert!(
        !t.actions.iter().any(|a| matches!(a, Action::Fetch { .. })),
        "the voters' WAL is all in the buffer"
    );
    // Node 4 is empty: it gets everything from the buffer, in the new term.
    t.recv(3, vote_in(2, 2, 0, h(&[])));
    let to_4 = t.sent_to(3);
    assert_eq!(elected_start(&to_4), Some(Lsn(0x100_0000)));
    assert!(to_4.iter().all(|m| match m {
        ProposerAcceptorMessage::AppendRequest(a) => a.h.generation == Generation(2),
        ProposerAcceptorMessage::Elected(e) => e.generation == Generation(2),
        _ => true,
    }));
    // Commits in the new term need both halves: nodes 1 and 2 are a majority of each.
    t.recv(0, ack_in(2, 2, 0x100_0200));
    assert!(t.commits().is_empty());
    t.recv(1, ack_in(2, 2, 0x100_0200));
    assert_eq!(t.commits(), vec![Lsn(0x100_0200)]);
}

/// Removed members are retired (no more connections); a greeting from a node that is not a
/// member retires it too.
#[test]
fn members_that_are_not_in_the_configuration_are_retired() {
    let mut t = elected_in_generation_one();
    let next = mconf(2, &[1, 2, 4], None);
    t.drop_conn(0);
    t.connect(0);
    t.recv(0, greeting_of(1, 1, &next));
    assert!(
        t.actions
            .iter()
            .any(|a| matches!(a, Action::RetireSafekeeper { sk: 2 }))
    );
    assert!(t.core.retired(2) && !t.core.connected(2));
    assert!(
        t.actions
            .iter()
            .any(|a| matches!(a, Action::Close { sk: 2, .. }))
    );
    // Its reconnection is refused at once.
    t.actions.clear();
    t.connect(2);
    assert!(matches!(t.actions[..], [Action::Close { sk: 2, .. }]));
}

/// If the new donor's WAL was written by a term we do not know (another proposer), our buffer
/// does not continue it: the re-election fails instead of mixing two WAL streams.
#[test]
fn re_election_fails_if_the_donor_holds_another_proposers_wal() {
    let mut t = elected_in_generation_one();
    let next = mconf(2, &[1, 2, 3], None);
    t.drop_conn(0);
    t.connect(0);
    t.recv(0, greeting_of(1, 5, &next));
    t.drop_conn(1);
    t.connect(1);
    t.recv(1, greeting_of(2, 1, &next));
    assert_eq!(t.core.term(), Term(6));
    t.recv(
        0,
        vote_in(2, 6, 0x100_0200, h(&[(1, 0x100_0000), (5, 0x100_0100)])),
    );
    t.recv(1, vote_in(2, 6, 0x100_0100, h(&[(1, 0x100_0000)])));
    assert_eq!(t.core.phase(), Phase::Stopped);
    assert!(t.actions.iter().any(|a| matches!(
        a,
        Action::ElectionFailed { reason } if reason.contains("another proposer")
    )));
}

/// An acknowledgement of `flush` that carries the readers' feedback: their oldest xmin and the
/// slowest required reader's flushed and applied positions.
fn ack_with_readers(flush: u64, xmin: u64, slowest: Option<(u64, u64)>) -> AcceptorProposerMessage {
    AcceptorProposerMessage::AppendResponse(AppendResponse {
        generation: Generation::INVALID,
        term: Term(1),
        flush_lsn: Lsn(flush),
        commit_lsn: Lsn(0),
        hs_feedback: HotStandbyFeedback {
            ts: 1,
            xmin,
            catalog_xmin: 0,
        },
        pageserver_feedback: slowest.map(|(f, a)| sk_core::protocol::PageserverFeedback {
            last_received_lsn: Lsn(f),
            disk_consistent_lsn: Lsn(f),
            remote_consistent_lsn: Lsn(a),
            ..Default::default()
        }),
    })
}

/// Elected over 3 safekeepers with the given lag limits, `len` bytes pushed; returns the
/// harness and the term start.
fn elected_with_limits(flush_limit: u64, apply_limit: u64, len: u64) -> (Harness, u64) {
    let mut c = cfg(3);
    c.max_replication_flush_lag = flush_limit;
    c.max_replication_apply_lag = apply_limit;
    let mut t = Harness {
        core: ProposerCore::new(c),
        actions: Vec::new(),
    };
    t.greet_all(&[0, 0, 0]);
    for sk in 0..3 {
        t.recv(sk, vote(1, true, 0, h(&[])));
    }
    let start = 0x100_0000u64;
    t.core
        .push(Lsn(start), Bytes::from(vec![0u8; len as usize]))
        .unwrap();
    t.actions.extend(t.core.take_actions());
    (t, start)
}

#[test]
fn backpressure_slows_from_half_the_limit_and_pauses_at_it() {
    let (mut t, start) = elected_with_limits(1000, 0, 2000);
    let end = start + 2000;
    assert_eq!(
        t.core.backpressure(),
        Backpressure::Off,
        "no reader reports"
    );
    // The slowest required reader flushed 1400 of 2000: 600 behind, over half of 1000.
    t.recv(
        0,
        ack_with_readers(end, 0, Some((start + 1400, start + 1400))),
    );
    assert_eq!(
        t.core.backpressure(),
        Backpressure::Slow {
            delay_ms: MAX_SLOW_DELAY_MS / 5,
            lag: 600
        }
    );
    // Another safekeeper's reader is slower: 1001 behind, past the limit.
    t.recv(
        1,
        ack_with_readers(end, 0, Some((start + 999, start + 999))),
    );
    assert_eq!(t.core.backpressure(), Backpressure::Paused { lag: 1001 });
    // One byte under the limit only slows.
    t.recv(
        1,
        ack_with_readers(end, 0, Some((start + 1001, start + 1001))),
    );
    assert!(matches!(
        t.core.backpressure(),
        Backpressure::Slow { lag: 999, .. }
    ));
    // Below half: full speed again.
    t.recv(
        0,
        ack_with_readers(end, 0, Some((start + 1600, start + 1600))),
    );
    t.recv(1, ack_with_readers(end, 0, None));
    assert_eq!(t.core.backpressure(), Backpressure::Off);
    // A paused reader's safekeeper disconnects: its report counts no more.
    t.recv(2, ack_with_readers(end, 0, Some((start, start))));
    assert!(matches!(t.core.backpressure(), Backpressure::Paused { .. }));
    t.drop_conn(2);
    assert_eq!(t.core.backpressure(), Backpressure::Off);
}

#[test]
fn apply_lag_limit_counts_the_applied_position_and_no_limit_never_pauses() {
    let (mut t, start) = elected_with_limits(0, 500, 2000);
    let end = start + 2000;
    // Flushed everything but applied only 1000: 1000 behind, past the apply limit.
    t.recv(0, ack_with_readers(end, 0, Some((end, start + 1000))));
    assert_eq!(t.core.backpressure(), Backpressure::Paused { lag: 1000 });

    let (mut t, start) = elected_with_limits(0, 0, 2000);
    t.recv(0, ack_with_readers(start + 2000, 0, Some((start, start))));
    assert_eq!(t.core.backpressure(), Backpressure::Off, "no limit set");
}

#[test]
fn hot_standby_feedback_is_the_oldest_over_connected_safekeepers() {
    let (mut t, start) = elected_with_limits(0, 0, 100);
    let end = start + 100;
    assert!(t.core.hs_feedback().is_empty());
    t.recv(0, ack_with_readers(end, (2 << 32) | 10, None));
    t.recv(1, ack_with_readers(end, (1 << 32) | 4_000_000_000, None));
    t.recv(2, ack_with_readers(end, 0, None));
    assert_eq!(t.core.hs_feedback().xmin, (1 << 32) | 4_000_000_000);
    // The safekeeper with the older xmin goes away: the other's remains.
    t.drop_conn(1);
    assert_eq!(t.core.hs_feedback().xmin, (2 << 32) | 10);
    // Its readers released it.
    t.recv(0, ack_with_readers(end, 0, None));
    assert!(t.core.hs_feedback().is_empty());
}
