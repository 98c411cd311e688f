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
    TermHistory(
        entries
            .iter()
            .map(|&(t, l)| TermLsn {
                term: Term(t),
                lsn: Lsn(l),
            })
            .collect(),
    )
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
    t.step(Event::Fetched {
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
    t.step(Event::Fetched {
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
    t.step(Event::FetchFailed {
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
