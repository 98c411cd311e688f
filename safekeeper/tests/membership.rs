//! The walproposer's tokio driver through a membership change, against four real daemons. An
//! operator moves the timeline from members {1, 2, 3} to the joint {1, 2, 3} + {1, 3, 4} and
//! then to {1, 3, 4}, here by greeting each safekeeper with the new configuration (a member
//! adopts a newer generation from any greeting; the daemon's HTTP endpoint does the same through
//! `SafeKeeper::set_membership`). Meanwhile the proposer streams WAL: it must notice each new
//! generation (its appends are refused), re-elect itself in it, connect to node 4 by itself (it
//! was never told its address), stop counting node 2, and keep committing; at the end the three
//! members hold identical WAL up to the commit LSN.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::{TestDaemon, greeting, proposer_config, ttid};
use sk_core::protocol::{AcceptorProposerMessage, ProposerAcceptorMessage};
use sk_core::state::{Configuration, SafekeeperId};
use sk_core::types::{Generation, Lsn, NodeId, Term};
use walproposer::Proposer;
use walproposer::conn::connect_push;
use walproposer::synthetic::{self, SyntheticOptions};

fn member(d: &TestDaemon, id: u64) -> SafekeeperId {
    SafekeeperId {
        id: NodeId(id),
        host: "127.0.0.1".into(),
        pg_port: d.pg.port(),
    }
}

/// What an operator does to switch `d` to `mconf`: a greeting carrying it.
async fn switch(
    d: &TestDaemon,
    mconf: &Configuration,
) -> Result<AcceptorProposerMessage, walproposer::conn::ConnError> {
    let (mut reader, mut writer) = connect_push(&d.addr(), ttid(), true, "operator")
        .await
        .expect("connect");
    let ProposerAcceptorMessage::Greeting(mut g) = greeting() else {
        unreachable!("a greeting")
    };
    g.mconf = mconf.clone();
    writer
        .queue(&ProposerAcceptorMessage::Greeting(g))
        .expect("encode");
    writer.flush().await.expect("send");
    reader.recv().await
}

fn lsn(v: &serde_json::Value) -> Lsn {
    v.as_str().expect("an LSN").parse().expect("a valid LSN")
}

/// Whether `d` holds WAL up to the start of a term elected in generation `g` or later (the
/// operator's switch condition, `docs/durability.md` promise 10).
async fn holds_a_term_elected_in(d: &TestDaemon, g: u64) -> bool {
    let s = d.timeline_status().await;
    let newest = s["term_history"].as_array().and_then(|h| h.last()).cloned();
    s["elected_generation"].as_u64().expect("a generation") >= g
        && newest.is_some_and(|e| lsn(&e["lsn"]) <= lsn(&s["flush_lsn"]))
}

async fn poll(what: String, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !done().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proposer_follows_a_membership_change_and_keeps_committing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_test_writer()
        .try_init();
    let dirs: Vec<_> = (0..4).map(|_| tempfile::tempdir().unwrap()).collect();
    let mut d = Vec::new();
    for (i, dir) in dirs.iter().enumerate() {
        d.push(TestDaemon::start_as(dir.path(), i as u64 + 1).await);
    }
    let first = Configuration {
        generation: Generation(1),
        members: vec![member(&d[0], 1), member(&d[1], 2), member(&d[2], 3)],
        new_members: None,
    };
    for sk in &d[..3] {
        switch(sk, &first).await.expect("switched");
    }
    let proposer = Proposer::elect(proposer_config(
        d[..3].iter().map(|sk| sk.addr()).collect(),
        Lsn(0x0100_0000),
    ))
    .await
    .expect("elected over {1, 2, 3}");
    assert_eq!(proposer.term(), Term(1));

    // 12 MiB of WAL at 3 MiB/s: the changes below happen while it streams.
    let opts = SyntheticOptions {
        total_bytes: 12 << 20,
        rate: Some(3 << 20),
        chunk_bytes: 64 << 10,
        window: 4 << 20,
        ..SyntheticOptions::default()
    };
    let wal = async {
        synthetic::run(&proposer, &opts)
            .await
            .expect("streams through");
        proposer.progress().end_lsn
    };
    let operator = async {
        tokio::time::sleep(Duration::from_millis(800)).await;
        let before = proposer.progress().commit_lsn;
        // 1. The joint configuration on the old and the new members.
        let joint = Configuration {
            generation: Generation(2),
            new_members: Some(vec![member(&d[0], 1), member(&d[2], 3), member(&d[3], 4)]),
            ..first.clone()
        };
        for sk in &d {
            switch(sk, &joint).await.expect("switched");
        }
        // 2. The switch condition on the new set.
        for i in [0, 2, 3] {
            let what = format!("node {} holds a term elected in generation 2", i + 1);
            poll(what, async || holds_a_term_elected_in(&d[i], 2).await).await;
        }
        assert!(
            proposer.progress().commit_lsn > before,
            "commits went on through the joint configuration"
        );
        // 3. The new configuration alone; node 2 is not a member and refuses it.
        let last = Configuration {
            generation: Generation(3),
            members: joint.new_members.clone().unwrap(),
            new_members: None,
        };
        for i in [0, 2, 3] {
            switch(&d[i], &last).await.expect("switched");
        }
        let refused = switch(&d[1], &last).await;
        assert!(
            matches!(&refused, Err(e) if e.to_string().contains("not a member")),
            "node 2 is not a member of generation 3: {refused:?}"
        );
        proposer.progress().commit_lsn
    };
    // The longest time the commit LSN stood still while WAL waited: the stall of a switch.
    let done = AtomicBool::new(false);
    let stall = async {
        let mut rx = proposer.subscribe();
        let (mut longest, mut since, mut last) = (Duration::ZERO, Instant::now(), Lsn::INVALID);
        while !done.load(Ordering::Relaxed) {
            let p = *rx.borrow_and_update();
            if p.commit_lsn != last || p.end_lsn <= p.commit_lsn {
                last = p.commit_lsn;
                since = Instant::now();
            }
            longest = longest.max(since.elapsed());
            let _ = tokio::time::timeout(Duration::from_millis(5), rx.changed()).await;
        }
        longest
    };
    let run = async {
        let both = tokio::join!(wal, operator);
        done.store(true, Ordering::Relaxed);
        both
    };
    let ((end, switched_at), longest) = tokio::join!(run, stall);
    eprintln!("longest commit stall while WAL waited (two membership switches): {longest:?}");
    assert!(
        longest < Duration::from_secs(5),
        "commits stalled for {longest:?}"
    );
    assert!(end > switched_at, "commits went on after the last switch");
    let committed = proposer.wait_commit(end).await.expect("all committed");
    assert!(
        proposer.term() >= Term(3),
        "re-elected in generations 2 and 3"
    );
    proposer.finish(Duration::from_secs(5)).await;

    // Node 2 is gone for good; the members agree byte for byte up to the commit LSN.
    let mut wal = Vec::new();
    for i in [0, 2, 3] {
        let s = d[i].timeline_status().await;
        assert!(lsn(&s["flush_lsn"]) >= committed, "node {}: {s}", i + 1);
        assert_eq!(s["generation"], 3, "node {}: {s}", i + 1);
        let term = Term(s["term"].as_u64().unwrap());
        wal.push(
            walproposer::fetch::fetch_wal(&d[i].addr(), ttid(), term, Lsn(0x0100_0000), committed)
                .await
                .expect("read the WAL back"),
        );
    }
    assert!(
        wal[0] == wal[1] && wal[1] == wal[2],
        "members hold different WAL"
    );
    for sk in d {
        sk.stop().await.unwrap();
    }
}
