//! `pull_timeline` between in-process daemons over real sockets and files: the copy is
//! byte-identical to the source up to its flush LSN, serves readers and proposers afterwards,
//! and the error cases (exists, no quorum, unknown timeline) are clear.

mod common;

use common::*;
use pg_wal::generator::WalGenerator;
use sk_core::types::Lsn;

const START: Lsn = Lsn(SEG_SIZE);

/// A daemon holding `bytes` of generated WAL, committed, from `START`.
async fn source_with_wal(dir: &std::path::Path, id: u64, bytes: usize) -> (TestDaemon, Lsn) {
    let d = TestDaemon::start_as(dir, id).await;
    let (mut p, _) = Client::elect(&d, START).await;
    let mut g = WalGenerator::new(SYSID, SEG_SIZE, START).unwrap();
    let mut wal = Vec::new();
    g.fill(&mut wal, bytes, &[0x5a; 300]);
    let end = Lsn(START.0 + wal.len() as u64);
    for (i, chunk) in wal.chunks(64 << 10).enumerate() {
        let at = Lsn(START.0 + (i * (64 << 10)) as u64);
        p.writer.queue(&p.append(at, chunk, Lsn::INVALID)).unwrap();
    }
    p.writer.queue(&p.append(end, &[], end)).unwrap();
    p.writer.flush().await.unwrap();
    p.wait_flushed(end).await;
    p.writer.finish().await.unwrap();
    while p.reader.recv().await.is_ok() {}
    (d, end)
}

fn pull_body(hosts: &[&TestDaemon]) -> String {
    let hosts: Vec<String> = hosts.iter().map(|d| format!("\"{}\"", d.http)).collect();
    format!(
        r#"{{"tenant_id":"{}","timeline_id":"{}","http_hosts":[{}]}}"#,
        ttid().tenant_id,
        ttid().timeline_id,
        hosts.join(",")
    )
}

/// `POST /v1/pull_timeline` of the test timeline on `on` from `peers`: (status, body).
async fn pull(on: &TestDaemon, peers: &[&TestDaemon]) -> (u16, String) {
    http_request(
        on.http,
        "POST",
        "/v1/pull_timeline",
        Some(&pull_body(peers)),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pulled_timeline_is_byte_identical_and_serves() {
    let (d1dir, d2dir, d3dir) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    // 20 MiB: more than one segment, the last one partial.
    let (d1, end) = source_with_wal(d1dir.path(), 1, 20 << 20).await;
    let d2 = TestDaemon::start_as(d2dir.path(), 2).await;
    let d3 = TestDaemon::start_as(d3dir.path(), 3).await; // has no copy: a lagging peer

    // Errors first: bad body, no hosts, unknown timeline everywhere, no quorum.
    let (code, body) = http_request(d2.http, "POST", "/v1/pull_timeline", Some("{}")).await;
    assert_eq!(code, 400, "{body}");
    let (code, body) = pull(&d2, &[]).await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("http_hosts is empty"), "{body}");
    let (code, body) = pull(&d2, &[&d3]).await;
    assert_eq!(code, 502, "{body}");
    assert!(body.contains("majority"), "{body}");
    // Only one of three peers answers (d3 has no timeline; d2 asks itself: none either).
    let (code, body) = pull(&d2, &[&d1, &d2, &d3]).await;
    assert_eq!(code, 502, "{body}");
    assert!(body.contains("only 1 of 3"), "{body}");
    assert_eq!(d2.timeline_count().await, 0);

    // A majority of {1, 3}... needs both: pull from {1} alone (a quorum of one peer).
    let (code, body) = pull(&d2, &[&d1]).await;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["flush_lsn"], end.to_string(), "{v}");
    let s1 = d1.timeline_status().await;
    let s2 = d2.timeline_status().await;
    for field in [
        "term",
        "flush_lsn",
        "term_history",
        "timeline_start_lsn",
        "system_id",
        "generation",
    ] {
        assert_eq!(s1[field], s2[field], "{field}: {s1} vs {s2}");
    }
    assert_eq!(
        wal_bytes(d1dir.path(), START, end),
        wal_bytes(d2dir.path(), START, end)
    );
    // Pulling again: 409.
    let (code, body) = pull(&d2, &[&d1]).await;
    assert_eq!(code, 409, "{body}");

    // Durable and valid: a restart opens it (verifying the committed WAL) at the same end.
    d2.stop().await.unwrap();
    let d2 = TestDaemon::start_as(d2dir.path(), 2).await;
    let s2 = d2.timeline_status().await;
    assert_eq!(s2["flush_lsn"], end.to_string(), "{s2}");
    // And a proposer can be elected on it and continue.
    let (_p, start) = Client::elect(&d2, START).await;
    assert_eq!(start, end);
    for d in [d1, d2, d3] {
        d.stop().await.unwrap();
    }
}

/// With remote storage the snapshot starts at the donor's backed-up point and the puller
/// serves the WAL below it from its own store: a puller on another store than the donor's is
/// refused, naming both (it would have served the early WAL from a store that lacks it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pull_needs_the_donors_remote_storage() {
    let (d1dir, d2dir, store1, store2) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let on = |store: &tempfile::TempDir| {
        let url = format!("file://{}", store.path().display());
        move |c: &mut safekeeper::config::Conf| c.remote_storage = Some(url)
    };
    let d1 = TestDaemon::start_with(d1dir.path(), 1, on(&store1)).await;
    let (mut p, _) = Client::elect(&d1, START).await;
    let mut wal = Vec::new();
    WalGenerator::new(SYSID, SEG_SIZE, START)
        .unwrap()
        .fill(&mut wal, 64 << 10, &[1; 300]);
    let end = Lsn(START.0 + wal.len() as u64);
    p.writer
        .send(&p.append(START, &wal, Lsn::INVALID))
        .await
        .unwrap();
    p.wait_flushed(end).await;
    let d2 = TestDaemon::start_with(d2dir.path(), 2, on(&store2)).await;
    let (code, body) = pull(&d2, &[&d1]).await;
    assert_eq!(code, 502, "{body}");
    let (s1, s2) = (
        store1.path().display().to_string(),
        store2.path().display().to_string(),
    );
    assert!(
        body.contains("same remote storage") && body.contains(&s1) && body.contains(&s2),
        "{body}"
    );
    assert!(
        d2.try_timeline_status().await.is_none(),
        "nothing installed"
    );
    // On the donor's store, the same pull goes through.
    d2.stop().await.unwrap();
    let d2 = TestDaemon::start_with(d2dir.path(), 2, on(&store1)).await;
    let (code, body) = pull(&d2, &[&d1]).await;
    assert_eq!(code, 200, "{body}");
    drop(p);
    for d in [d1, d2] {
        d.stop().await.unwrap();
    }
}
