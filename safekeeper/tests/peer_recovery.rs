//! Peer recovery between in-process daemons over real sockets and files: a safekeeper that was
//! down while a proposer wrote catches up from its peers with no proposer connected, byte for
//! byte; a donor whose newest WAL is of another term than ours is refused until we are in its
//! term (then its history replaces our view and we catch up).

mod common;

use std::time::{Duration, Instant};

use common::*;
use sk_core::types::{Lsn, Term};
use walproposer::Proposer;
use walproposer::synthetic::{self, SyntheticOptions};

const START: Lsn = Lsn(SEG_SIZE);

fn lsn(v: &serde_json::Value) -> Lsn {
    v.as_str().expect("an LSN").parse().expect("a valid LSN")
}

async fn elect(over: &[&TestDaemon]) -> Proposer {
    Proposer::elect(proposer_config(
        over.iter().map(|d| d.addr()).collect(),
        START,
    ))
    .await
    .expect("elected")
}

/// Writes `bytes` of WAL through `p` (at `rate` bytes/s), waits for its commit; returns the end.
async fn write(p: &Proposer, bytes: u64, rate: Option<u64>) -> Lsn {
    let opts = SyntheticOptions {
        total_bytes: bytes,
        rate,
        ..SyntheticOptions::default()
    };
    synthetic::run(p, &opts).await.expect("WAL streamed");
    let end = p.progress().end_lsn;
    p.wait_commit(end).await.expect("committed")
}

/// A vote of `d` for `term`, from a proposer that then goes away.
async fn vote(d: &TestDaemon, term: u64) {
    let mut c = Client::connect(d).await;
    assert!(c.vote(Term(term)).await.vote_given);
}

/// Three recovery rounds of `d` take nothing: its WAL still ends at `at`, no session ran.
async fn takes_nothing_for_three_rounds(d: &TestDaemon, at: Lsn) {
    tokio::time::sleep(Duration::from_secs(3)).await;
    let s = d.timeline_status().await;
    assert_eq!(lsn(&s["flush_lsn"]), at, "{s}");
    assert_eq!(s["recovery"]["sessions"], 0, "{s}");
}

/// Nodes 1, 2, 3 in `dirs` and a proposer elected over them.
async fn three_and_a_proposer(
    dirs: &[tempfile::TempDir],
) -> (TestDaemon, TestDaemon, TestDaemon, Proposer) {
    let d1 = TestDaemon::start_as(dirs[0].path(), 1).await;
    let d2 = TestDaemon::start_as(dirs[1].path(), 2).await;
    let d3 = TestDaemon::start_as(dirs[2].path(), 3).await;
    let p = elect(&[&d1, &d2, &d3]).await;
    (d1, d2, d3, p)
}

/// `d`, restarted with `--peers` naming `peers` (and itself, which it skips).
async fn restart_with_peers(d: TestDaemon, id: u64, peers: &[(u64, &TestDaemon)]) -> TestDaemon {
    let dir = d.datadir.clone();
    d.stop().await.unwrap();
    let mut list: Vec<(u64, String)> = peers
        .iter()
        .map(|(i, p)| (*i, p.http.to_string()))
        .collect();
    list.push((id, "127.0.0.1:1".into()));
    TestDaemon::start_with(&dir, id, |c| c.peers = list).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lagging_safekeeper_catches_up_from_a_peer_with_no_proposer() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let (d1, d2, d3, p) = three_and_a_proposer(&dirs).await;
    // 20 MiB (past a segment end) at 20 MiB/s; node 3 goes down after the first MiB, and
    // nodes 1 and 2 commit the rest.
    let d3dir = d3.datadir.clone();
    let stop_d3 = async {
        poll("node 3 holds the first MiB", 10, async || {
            let s = d3.try_timeline_status().await;
            s.is_some_and(|s| lsn(&s["flush_lsn"]) >= Lsn(START.0 + (1 << 20)))
        })
        .await;
        d3.stop().await.unwrap();
    };
    let (end, ()) = tokio::join!(write(&p, 20 << 20, Some(20 << 20)), stop_d3);
    p.finish(Duration::from_secs(5)).await;
    let s1 = d1.timeline_status().await;
    assert_eq!(lsn(&s1["flush_lsn"]), end, "{s1}");
    assert_eq!(d2.timeline_status().await["flush_lsn"], s1["flush_lsn"]);

    // Node 3 comes back knowing its peers; no proposer is running.
    let started = Instant::now();
    let d3 = TestDaemon::start_with(&d3dir, 3, |c| {
        c.peers = vec![(1, d1.http.to_string()), (2, d2.http.to_string())]
    })
    .await;
    let behind = lsn(&d3.timeline_status().await["flush_lsn"]);
    assert!(behind < end, "node 3 lags: {behind} < {end}");
    let s1 = d1.timeline_status().await;
    poll(
        "node 3 reaches its peers' flush and commit LSNs",
        15,
        async || {
            let s3 = d3.timeline_status().await;
            s3["flush_lsn"] == s1["flush_lsn"] && s3["commit_lsn"] == s1["commit_lsn"]
        },
    )
    .await;
    let took = started.elapsed();
    let s3 = d3.timeline_status().await;
    eprintln!(
        "peer recovery: {} bytes in {took:?} ({:.1} MB/s, daemon start included)",
        end.0 - behind.0,
        (end.0 - behind.0) as f64 / took.as_secs_f64() / 1e6
    );
    assert_eq!(s3["term_history"], s1["term_history"], "{s3}");
    assert_eq!(s3["recovery"]["active"], false, "{s3}");
    assert!(
        s3["recovery"]["bytes"].as_u64().unwrap() >= end.0 - behind.0,
        "{s3}"
    );
    assert!(
        [1, 2].contains(&s3["recovery"]["donor"].as_u64().unwrap()),
        "{s3}"
    );
    assert_eq!(
        wal_bytes(&d3dir, START, end),
        wal_bytes(dirs[0].path(), START, end),
        "node 3 holds other WAL than node 1"
    );
    // Durable: after a restart (start-up verifies the committed WAL) it is all still there.
    d3.stop().await.unwrap();
    let d3 = TestDaemon::start_as(&d3dir, 3).await;
    assert_eq!(lsn(&d3.timeline_status().await["flush_lsn"]), end);
    for d in [d1, d2, d3] {
        d.stop().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_donor_of_another_term_is_refused_until_we_are_in_its_term() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let (d1, d2, d3, p) = three_and_a_proposer(&dirs).await;
    let first = write(&p, 1 << 20, None).await;
    poll("node 3 holds term 1's WAL", 10, async || {
        lsn(&d3.timeline_status().await["flush_lsn"]) >= first
    })
    .await;
    p.finish(Duration::from_secs(5)).await;
    // Term 2 is elected by nodes 1 and 2 alone and writes more; node 3 stays in term 1.
    let p2 = elect(&[&d1, &d2]).await;
    assert_eq!(p2.term(), Term(2));
    let end = write(&p2, 2 << 20, None).await;
    p2.finish(Duration::from_secs(5)).await;
    let d3 = restart_with_peers(d3, 3, &[(1, &d1), (2, &d2)]).await;
    let s3 = d3.timeline_status().await;
    assert_eq!(
        (s3["term"].as_u64(), s3["last_log_term"].as_u64()),
        (Some(1), Some(1))
    );

    // The peers' newest WAL is of term 2, ours is term 1: three recovery rounds take nothing.
    takes_nothing_for_three_rounds(&d3, first).await;

    // Node 3 votes in term 2 (a proposer that then goes away): now the peers are donors, and
    // node 3 takes term 2's history from them.
    vote(&d3, 2).await;
    let s1 = d1.timeline_status().await;
    poll("node 3 catches up in term 2", 15, async || {
        d3.timeline_status().await["flush_lsn"] == s1["flush_lsn"]
    })
    .await;
    let s3 = d3.timeline_status().await;
    assert_eq!(s3["term_history"], s1["term_history"], "{s3}");
    assert_eq!(s3["last_log_term"], 2, "{s3}");
    assert_eq!(
        wal_bytes(&d3.datadir, START, end),
        wal_bytes(dirs[0].path(), START, end)
    );
    for d in [d1, d2, d3] {
        d.stop().await.unwrap();
    }
}

/// The hazard of `(term='N')` streams: a peer that voted for term N but never got its
/// `ProposerElected` serves its older WAL under term N, and that tail may be truncated by term
/// N's proposer. Such a peer is never a donor, even when it is ahead; once a proposer of a later
/// term wrote on the peers, node 3 (in that term) catches up from them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_only_voted_in_our_term_is_not_a_donor() {
    let dirs: Vec<_> = (0..3).map(|_| tempfile::tempdir().unwrap()).collect();
    let (d1, d2, d3, p) = three_and_a_proposer(&dirs).await;
    let stop_d3 = async {
        poll("node 3 holds the first MiB", 10, async || {
            let s = d3.try_timeline_status().await;
            s.is_some_and(|s| lsn(&s["flush_lsn"]) >= Lsn(START.0 + (1 << 20)))
        })
        .await;
        let dir = d3.datadir.clone();
        d3.stop().await.unwrap();
        dir
    };
    let (_, d3dir) = tokio::join!(write(&p, 4 << 20, Some(20 << 20)), stop_d3);
    p.finish(Duration::from_secs(5)).await;
    // Term 2 is only voted for, on nodes 1 and 3: node 1 is ahead, in our term, but its newest
    // WAL is of term 1.
    let d3 = TestDaemon::start_as(&d3dir, 3).await;
    vote(&d1, 2).await;
    vote(&d3, 2).await;
    let behind = lsn(&d3.timeline_status().await["flush_lsn"]);
    let d3 = restart_with_peers(d3, 3, &[(1, &d1), (2, &d2)]).await;
    takes_nothing_for_three_rounds(&d3, behind).await;

    // Term 3 is elected by nodes 1 and 2 (node 3 votes for it first) and writes: now they are
    // donors in node 3's term.
    vote(&d3, 3).await;
    let p3 = elect(&[&d1, &d2]).await;
    assert_eq!(p3.term(), Term(3));
    let end = write(&p3, 1 << 20, None).await;
    p3.finish(Duration::from_secs(5)).await;
    poll("node 3 catches up in term 3", 15, async || {
        lsn(&d3.timeline_status().await["flush_lsn"]) == end
    })
    .await;
    let (s1, s3) = (d1.timeline_status().await, d3.timeline_status().await);
    assert_eq!(s3["term_history"], s1["term_history"], "{s3}");
    assert_eq!(
        wal_bytes(&d3.datadir, START, end),
        wal_bytes(dirs[0].path(), START, end)
    );
    for d in [d1, d2, d3] {
        d.stop().await.unwrap();
    }
}
