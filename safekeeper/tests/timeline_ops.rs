//! The operator's timeline routes against in-process daemons over real sockets and files:
//! `PUT …/membership`, `POST /v1/tenant/{t}/timeline`, `DELETE …/timeline/{tl}` and
//! `DELETE /v1/tenant/{t}`, their error cases, and that what they do survives a restart.

mod common;

use common::{Client, SEG_SIZE, SYSID, TestDaemon, greeting, http_request, poll, ttid};
use sk_core::protocol::AcceptorProposerMessage;
use sk_core::types::{Lsn, TimelineId};
use walproposer::conn::connect_push;

fn tl_path() -> String {
    format!(
        "/v1/tenant/{}/timeline/{}",
        ttid().tenant_id,
        ttid().timeline_id
    )
}

fn membership(generation: u32, ids: &[u64]) -> String {
    let members: Vec<String> = ids
        .iter()
        .map(|id| {
            format!(
                r#"{{"id":{id},"host":"127.0.0.1","pg_port":{}}}"#,
                5450 + id
            )
        })
        .collect();
    format!(
        r#"{{"generation":{generation},"members":[{}]}}"#,
        members.join(",")
    )
}

fn create_body(timeline_id: &str, extra: &str) -> String {
    format!(
        r#"{{"timeline_id":"{timeline_id}","system_id":{SYSID},"pg_version":150018,"wal_seg_size":{SEG_SIZE}{extra}}}"#
    )
}

/// What a proposer's greeting gets: the reply, or the error text that ended the connection.
async fn greet(d: &TestDaemon) -> Result<AcceptorProposerMessage, String> {
    let (mut reader, mut writer) = connect_push(&d.addr(), ttid(), true, "late proposer")
        .await
        .map_err(|e| e.to_string())?;
    writer.send(&greeting()).await.map_err(|e| e.to_string())?;
    reader.recv().await.map_err(|e| e.to_string())
}

#[tokio::test]
async fn membership_put_is_forward_only_durable_and_shown_in_status() {
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let path = format!("{}/membership", tl_path());

    let (code, body) = http_request(d.http, "PUT", &path, Some(&membership(1, &[1]))).await;
    assert_eq!(code, 404, "no timeline yet: {body}");

    Client::connect(&d).await; // the greeting creates the timeline
    let (code, body) = http_request(d.http, "PUT", &path, Some(&membership(2, &[1, 2, 3]))).await;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["generation"], 2);
    assert_eq!(v["mconf"]["members"].as_array().unwrap().len(), 3);
    assert_eq!(v["elected_generation"], 0);

    // The same configuration again: a no-op.
    let (code, _) = http_request(d.http, "PUT", &path, Some(&membership(2, &[1, 2, 3]))).await;
    assert_eq!(code, 200);
    // Older, or the same generation with other members: 409 with the reason.
    for stale in [membership(1, &[1]), membership(2, &[1, 3, 4])] {
        let (code, body) = http_request(d.http, "PUT", &path, Some(&stale)).await;
        assert_eq!(code, 409, "{body}");
        assert!(body.contains("not newer"), "{body}");
    }
    // Malformed: duplicate ids, no members, not JSON, unknown fields.
    for bad in [
        membership(3, &[1, 1]),
        membership(3, &[]),
        "{".to_string(),
        r#"{"generation":3,"members":[],"extra":1}"#.to_string(),
    ] {
        let (code, body) = http_request(d.http, "PUT", &path, Some(&bad)).await;
        assert_eq!(code, 400, "{bad}: {body}");
    }
    let (code, _) = http_request(
        d.http,
        "PUT",
        "/v1/tenant/nothex/timeline/x/membership",
        Some(&membership(3, &[1])),
    )
    .await;
    assert_eq!(code, 400);

    // Durable: a restarted daemon shows generation 2 and refuses the older one.
    d.stop().await.unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let v = d.timeline_status().await;
    assert_eq!(v["generation"], 2, "{v}");
    let (code, _) = http_request(d.http, "PUT", &path, Some(&membership(1, &[1]))).await;
    assert_eq!(code, 409);
    d.stop().await.unwrap();
}

#[tokio::test]
async fn create_refuses_duplicates_and_bad_input_and_starts_at_start_lsn() {
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let create = format!("/v1/tenant/{}/timeline", ttid().tenant_id);
    let tl = ttid().timeline_id.to_string();
    let start = Lsn(3 * SEG_SIZE + 0x28);

    for (bad, why) in [
        (create_body("zz", ""), "invalid id"),
        (
            format!(
                r#"{{"timeline_id":"{tl}","system_id":1,"pg_version":150018,"wal_seg_size":12345}}"#
            ),
            "segment size",
        ),
        (create_body(&tl, r#","start_lsn":"nope""#), "start_lsn"),
        (
            create_body(&tl, r#","mconf":{"generation":1,"members":[]}"#),
            "unique node ids",
        ),
        (r#"{"timeline_id":"x"}"#.to_string(), "missing field"),
    ] {
        let (code, body) = http_request(d.http, "POST", &create, Some(&bad)).await;
        assert_eq!(code, 400, "{bad}: {body}");
        assert!(body.contains(why), "{bad}: {body}");
    }
    assert_eq!(d.timeline_count().await, 0);

    let body = create_body(
        &tl,
        &format!(r#","start_lsn":"{start}","mconf":{}"#, membership(1, &[1])),
    );
    let (code, resp) = http_request(d.http, "POST", &create, Some(&body)).await;
    assert_eq!(code, 201, "{resp}");
    let (code, resp) = http_request(d.http, "POST", &create, Some(&body)).await;
    assert_eq!(code, 409, "{resp}");
    assert!(resp.contains("exists"), "{resp}");

    let v = d.timeline_status().await;
    assert_eq!(v["generation"], 1, "{v}");
    assert_eq!(v["timeline_start_lsn"], start.to_string(), "{v}");
    assert_eq!(v["flush_lsn"], start.to_string(), "{v}");
    d.stop().await.unwrap();
    // Durable: there after a restart.
    let d = TestDaemon::start(dir.path()).await;
    let v = d.timeline_status().await;
    assert_eq!(v["system_id"], SYSID, "{v}");
    d.stop().await.unwrap();
}

#[tokio::test]
async fn deleted_timeline_ends_connections_and_is_not_recreated_by_a_late_proposer() {
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let (mut proposer, _) = Client::elect(&d, Lsn(SEG_SIZE)).await;
    let tl_dir = dir
        .path()
        .join(ttid().tenant_id.to_string())
        .join(ttid().timeline_id.to_string());
    assert!(tl_dir.exists());

    let (code, body) = http_request(d.http, "DELETE", &tl_path(), None).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""existed":true"#), "{body}");
    assert!(!tl_dir.exists(), "files removed");
    // The open proposer connection ends with the reason.
    let err = proposer.reader.recv().await.expect_err("connection ended");
    assert!(err.to_string().contains("deleted"), "{err}");
    // A late proposer cannot recreate it.
    let err = greet(&d).await.expect_err("refused");
    assert!(err.contains("was deleted"), "{err}");
    assert!(!tl_dir.exists());
    let (code, _) = http_request(d.http, "GET", &tl_path(), None).await;
    assert_eq!(code, 404);

    // Also not after a restart (the tombstone is durable).
    d.stop().await.unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let err = greet(&d).await.expect_err("refused after a restart");
    assert!(err.contains("was deleted"), "{err}");
    // Deleting again is fine (nothing left but the tombstone).
    let (code, body) = http_request(d.http, "DELETE", &tl_path(), None).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""existed":false"#), "{body}");

    // An explicit create clears the tombstone: proposers are served again.
    let create = format!("/v1/tenant/{}/timeline", ttid().tenant_id);
    let (code, body) = http_request(
        d.http,
        "POST",
        &create,
        Some(&create_body(&ttid().timeline_id.to_string(), "")),
    )
    .await;
    assert_eq!(code, 201, "{body}");
    assert!(matches!(
        greet(&d).await,
        Ok(AcceptorProposerMessage::Greeting(_))
    ));
    d.stop().await.unwrap();
}

#[tokio::test]
async fn deleted_tenant_takes_every_timeline_and_stays_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let tenant = ttid().tenant_id;
    let create = format!("/v1/tenant/{tenant}/timeline");
    let other: TimelineId = "00000000000000000000000000000002".parse().unwrap();
    for tl in [ttid().timeline_id, other] {
        let (code, body) = http_request(
            d.http,
            "POST",
            &create,
            Some(&create_body(&tl.to_string(), "")),
        )
        .await;
        assert_eq!(code, 201, "{body}");
    }
    let (code, body) = http_request(d.http, "DELETE", "/v1/tenant/zz", None).await;
    assert_eq!(code, 400, "{body}");
    let (code, body) = http_request(d.http, "DELETE", &format!("/v1/tenant/{tenant}"), None).await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""timelines":2"#), "{body}");
    assert!(!dir.path().join(tenant.to_string()).exists());
    assert_eq!(d.timeline_count().await, 0);
    d.stop().await.unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let err = greet(&d).await.expect_err("refused");
    assert!(err.contains("was deleted"), "{err}");
    d.stop().await.unwrap();
}

/// The timeline's objects in the `file://` store under `store` (an upload in progress is a
/// `name#n` file there until it is renamed into place).
fn stored_segments(store: &std::path::Path) -> Vec<String> {
    let dir = store
        .join(ttid().tenant_id.to_string())
        .join(ttid().timeline_id.to_string());
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .map(|it| {
            it.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default();
    names.sort();
    names
}

/// The store's objects are one copy shared by every member (with `--wal-keep-size 0`, the only
/// copy of the early WAL): a node that is no longer a member of the timeline (node 2 after
/// "replace 2 by 3") is refused a delete everywhere, with the way out named; its
/// `?only_local=true` delete leaves the store alone; a member's delete then deletes the objects.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_that_is_no_longer_a_member_deletes_only_its_own_copy() {
    let (d1dir, d2dir, store) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let url = format!("file://{}", store.path().display());
    let start = |dir: std::path::PathBuf, id: u64| {
        let url = url.clone();
        async move {
            TestDaemon::start_with(&dir, id, move |c| {
                c.remote_storage = Some(url);
                c.wal_keep_size = 0;
            })
            .await
        }
    };
    let (d1, d2) = (
        start(d1dir.path().into(), 1).await,
        start(d2dir.path().into(), 2).await,
    );
    let p = walproposer::Proposer::elect(common::proposer_config(
        vec![d1.addr(), d2.addr()],
        Lsn(SEG_SIZE),
    ))
    .await
    .expect("elected");
    let opts = walproposer::synthetic::SyntheticOptions {
        total_bytes: SEG_SIZE + (1 << 20),
        ..Default::default()
    };
    walproposer::synthetic::run(&p, &opts).await.expect("WAL");
    p.wait_commit(p.progress().end_lsn).await.expect("commit");
    p.finish(std::time::Duration::from_secs(5)).await;
    let settled = |names: &[String]| !names.is_empty() && !names.iter().any(|n| n.contains('#'));
    poll("a segment is backed up", 30, async || {
        settled(&stored_segments(store.path()))
    })
    .await;
    let stored = stored_segments(store.path());

    // Node 3 took node 2's place: generation 1 is {1, 3}, on node 2 as well.
    for d in [&d1, &d2] {
        let (code, body) = http_request(
            d.http,
            "PUT",
            &format!("{}/membership", tl_path()),
            Some(&membership(1, &[1, 3])),
        )
        .await;
        assert_eq!(code, 200, "{body}");
    }
    let (code, body) = http_request(d2.http, "DELETE", &tl_path(), None).await;
    assert_eq!(code, 409, "{body}");
    assert!(
        body.contains("not a member") && body.contains("only_local=true"),
        "{body}"
    );
    assert_eq!(
        d2.timeline_status().await["flush_lsn"],
        d1.timeline_status().await["flush_lsn"]
    );
    let (code, body) = http_request(
        d2.http,
        "DELETE",
        &format!("{}?only_local=true", tl_path()),
        None,
    )
    .await;
    assert_eq!(code, 200, "{body}");
    assert!(body.contains(r#""existed":true"#), "{body}");
    // A node deletes pending remote objects within a supervision round (1 s; it also wakes on
    // the deletion): after three, the store still has everything.
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(stored_segments(store.path()), stored);
    // After a restart too (the tombstone records no remote deletion).
    d2.stop().await.unwrap();
    let d2 = start(d2dir.path().into(), 2).await;
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    assert_eq!(stored_segments(store.path()), stored);

    // A member's delete is the timeline's end: its objects go.
    let (code, body) = http_request(d1.http, "DELETE", &tl_path(), None).await;
    assert_eq!(code, 200, "{body}");
    poll("the member's delete took the objects", 30, async || {
        stored_segments(store.path()).is_empty()
    })
    .await;
    for d in [d1, d2] {
        d.stop().await.unwrap();
    }
}

/// Promise 9: a graceful stop persists every timeline's state. The control file's commit LSN
/// is saved lazily while the daemon runs (a segment behind, or every few seconds), so after a
/// quick commit it lags the commit LSN in memory; the stop saves it, and the restarted node
/// reports the same commit LSN at once (before any proposer tells it again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_graceful_stop_persists_the_commit_lsn() {
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let (mut p, _) = Client::elect(&d, Lsn(SEG_SIZE)).await;
    let mut g = pg_wal::generator::WalGenerator::new(SYSID, SEG_SIZE, Lsn(SEG_SIZE)).unwrap();
    let mut wal = Vec::new();
    g.fill(&mut wal, 64 << 10, &[7; 200]);
    let end = Lsn(SEG_SIZE + wal.len() as u64);
    p.writer
        .send(&p.append(Lsn(SEG_SIZE), &wal, end))
        .await
        .unwrap();
    // Once flushed, the commit LSN rides on the next append (here one without WAL).
    p.wait_flushed(end).await;
    p.writer.send(&p.append(end, &[], end)).await.unwrap();
    let mut before = serde_json::Value::Null;
    poll("the commit LSN reaches the end", 30, async || {
        before = d.timeline_status().await;
        before["commit_lsn"] == end.to_string()
    })
    .await;
    assert_ne!(
        before["persisted_commit_lsn"], before["commit_lsn"],
        "the lazy save already ran, so this run cannot tell: {before}"
    );
    drop(p);
    d.stop().await.unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let after = d.timeline_status().await;
    assert_eq!(after["persisted_commit_lsn"], end.to_string(), "{after}");
    assert_eq!(after["commit_lsn"], end.to_string(), "{after}");
    d.stop().await.unwrap();
}
