//! Plain readers (a standby, `pg_receivewal`) against an in-process daemon over real sockets:
//! they are served committed WAL only, also while this node has flushed more.

mod common;

use std::time::Duration;

use common::*;
use pg_wal::generator::WalGenerator;
use pq_proto::client::{ClientConn, CopyEvent};
use pq_proto::replication::ReplicationMessage;
use sk_core::types::{Lsn, Term};

const START: Lsn = Lsn(SEG_SIZE);

/// Promise 3: the WAL past the commit LSN may still be truncated by the next term's proposer,
/// and a standby cannot un-apply it, so a plain reader streams up to the commit LSN, never to
/// the flush LSN. Here the node holds 256 KiB flushed and 100 KiB committed: the reader gets the
/// 100 KiB, then keepalives saying the WAL ends there; once the commit LSN moves, the rest.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_reader_gets_committed_wal_only_while_more_is_flushed() {
    let dir = tempfile::tempdir().unwrap();
    let d = TestDaemon::start(dir.path()).await;
    let (mut p, _) = Client::elect(&d, START).await;
    let mut g = WalGenerator::new(SYSID, SEG_SIZE, START).unwrap();
    let mut wal = Vec::new();
    g.fill(&mut wal, 256 << 10, &[0x5a; 300]);
    let end = Lsn(START.0 + wal.len() as u64);
    let commit = Lsn(START.0 + (100 << 10));
    // In appends of at most the protocol's 128 KiB.
    for (i, piece) in wal.chunks(64 << 10).enumerate() {
        let at = Lsn(START.0 + (i as u64) * (64 << 10));
        p.writer.queue(&p.append(at, piece, Lsn::INVALID)).unwrap();
    }
    p.writer.flush().await.unwrap();
    p.wait_flushed(end).await;
    p.writer
        .send(&append_msg(Term(1), end, &[], commit))
        .await
        .unwrap();
    poll("the commit LSN moves", 30, async || {
        d.timeline_status().await["commit_lsn"] == commit.to_string()
    })
    .await;
    assert_eq!(d.timeline_status().await["flush_lsn"], end.to_string());

    let conn = ClientConn::connect(&client_config(&d)).await.unwrap();
    let (mut r, _w) = conn
        .start_copy_both(&format!("START_REPLICATION PHYSICAL {START} TIMELINE 1"))
        .await
        .unwrap();
    let mut got = Vec::new();
    // WAL up to the commit LSN, then keepalives that say the WAL ends there (three of them:
    // the first may be sent before the last XLogData is read, never after it with more WAL).
    let mut keepalives_at_commit = 0;
    while keepalives_at_commit < 3 {
        let CopyEvent::Data(m) = r.read().await.unwrap() else {
            panic!("stream ended")
        };
        match ReplicationMessage::decode(m).unwrap() {
            ReplicationMessage::XLogData {
                wal_start, data, ..
            } => {
                assert_eq!(wal_start.0, START.0 + got.len() as u64);
                got.extend_from_slice(&data);
                assert!(
                    START.0 + got.len() as u64 <= commit.0,
                    "a plain reader got WAL up to {} past the commit LSN {commit}",
                    Lsn(START.0 + got.len() as u64)
                );
            }
            ReplicationMessage::Keepalive { wal_end, .. } => {
                assert!(
                    wal_end <= commit,
                    "keepalive says the WAL ends at {wal_end}"
                );
                if wal_end == commit && START.0 + got.len() as u64 == commit.0 {
                    keepalives_at_commit += 1;
                }
            }
        }
    }
    assert_eq!(got, wal[..got.len()]);

    // The commit LSN moves to the end: the reader gets the rest.
    p.writer
        .send(&append_msg(Term(1), end, &[], end))
        .await
        .unwrap();
    while (got.len() as u64) < end.0 - START.0 {
        let CopyEvent::Data(m) = r.read().await.unwrap() else {
            panic!("stream ended")
        };
        if let ReplicationMessage::XLogData { data, .. } = ReplicationMessage::decode(m).unwrap() {
            got.extend_from_slice(&data);
        }
    }
    assert!(got == wal, "streamed WAL differs from what was pushed");
    d.stop().await.unwrap();
}

/// `--max-reader-hold` (issue 26): a reader within the limit holds its local WAL against
/// removal; one that stopped reading blocks the walsender in its send, and its hold must still
/// end once the WAL is more than the limit past it, or removal waits for it forever (with a
/// disk limit, refusing every append). Here a reader takes its hold at the start, reads one
/// message and stops; 64 MiB more are committed and backed up; removal passes the reader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_stopped_reading_holds_no_wal_past_the_limit() {
    let (dir, store) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let url = format!("file://{}", store.path().display());
    let d = TestDaemon::start_with(dir.path(), 1, |c| {
        c.remote_storage = Some(url);
        c.wal_keep_size = 0;
        c.max_reader_hold = SEG_SIZE;
    })
    .await;
    let p = walproposer::Proposer::elect(proposer_config(vec![d.addr()], START))
        .await
        .expect("elected");
    // 65 MiB at 32 MiB/s; the reader attaches at the start meanwhile.
    let opts = walproposer::synthetic::SyntheticOptions {
        total_bytes: 4 * SEG_SIZE + (1 << 20),
        rate: Some(32 << 20),
        ..Default::default()
    };
    let push = async {
        walproposer::synthetic::run(&p, &opts).await.expect("WAL");
        p.wait_commit(p.progress().end_lsn).await.expect("commit")
    };
    let attach = async {
        loop {
            let s = d.try_timeline_status().await;
            if s.is_some_and(|s| s["commit_lsn"].as_str().unwrap().parse::<Lsn>().unwrap() > START)
            {
                break;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let conn = ClientConn::connect(&client_config(&d)).await.unwrap();
        let (mut r, w) = conn
            .start_copy_both(&format!("START_REPLICATION PHYSICAL {START} TIMELINE 1"))
            .await
            .unwrap();
        loop {
            let CopyEvent::Data(m) = r.read().await.unwrap() else {
                panic!("stream ended")
            };
            if let ReplicationMessage::XLogData { .. } = ReplicationMessage::decode(m).unwrap() {
                // The reader reads no more; its hold was taken at the start (within the limit).
                return (r, w);
            }
        }
    };
    let (end, reader) = tokio::join!(push, attach);
    let what = format!("removal passes the stopped reader (end {end})");
    poll(&what, 60, async || {
        let s = d.timeline_status().await;
        let horizon: Lsn = s["removal_horizon_lsn"].as_str().unwrap().parse().unwrap();
        horizon.0 >= START.0 + 3 * SEG_SIZE
    })
    .await;
    drop(reader);
    p.finish(Duration::from_secs(5)).await;
    d.stop().await.unwrap();
}
