//! `pq_proto::client` against a REAL PostgreSQL 15 primary: startup on a replication connection,
//! IDENTIFY_SYSTEM / SHOW result sets, START_REPLICATION with XLogData whose first page is the
//! primary's long page header, status updates, the CopyDone handshake, and the real error text
//! for a start point beyond the primary's WAL.
//!
//! The cluster is started with `initdb`/`pg_ctl` from `pg_config --bindir` (as the `postgres`
//! user via `runuser` when we are root) in a temporary directory, and stopped on drop even when
//! the test fails. Skipped with a message when PostgreSQL is missing, unless `CI` is set.

mod pq_common;

use std::time::Duration;

use pq_common::{PgCluster, SEG_SIZE};
use pq_proto::BackendMessage;
use pq_proto::PqError;
use pq_proto::client::{ClientConn, CopyEvent};
use pq_proto::replication::{ReplicationMessage, StandbyMessage};
use sk_core::types::Lsn;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_streams_wal_from_a_real_postgres_primary() {
    let Some(pg) = tokio::task::spawn_blocking(PgCluster::init_primary)
        .await
        .expect("start thread")
    else {
        return;
    };

    let mut c = ClientConn::connect(&pg.client_config("pq_real_postgres"))
        .await
        .unwrap_or_else(|e| panic!("connect: {e}\n{}", pg.log()));
    assert!(
        c.parameter("server_version")
            .is_some_and(|v| v.starts_with("15.")),
        "{:?}",
        c.parameter("server_version")
    );
    assert_eq!(c.parameter("integer_datetimes"), Some("on"));

    let full = c
        .simple_query_full("IDENTIFY_SYSTEM")
        .await
        .expect("IDENTIFY_SYSTEM");
    let names: Vec<_> = full.columns.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["systemid", "timeline", "xlogpos", "dbname"]);
    let row = &full.rows[0];
    let system_id: u64 = row[0].as_deref().expect("systemid").parse().expect("u64");
    assert_eq!(row[1].as_deref(), Some("1"));
    let xlogpos: Lsn = row[2].as_deref().expect("xlogpos").parse().expect("X/X");
    assert_eq!(row[3], None, "dbname is NULL on a physical connection");

    let rows = c.simple_query("SHOW wal_segment_size").await.expect("SHOW");
    assert_eq!(rows, vec![vec![Some("16MB".to_string())]]);
    let err = c.simple_query("SELECT 1").await.unwrap_err();
    assert!(matches!(err, PqError::Server(_)), "{err}");

    // Stream from the segment start, as standbys and pg_receivewal do.
    let start = xlogpos.segment_start(SEG_SIZE);
    let (mut r, mut w) = c
        .start_copy_both(&format!("START_REPLICATION PHYSICAL {start} TIMELINE 1"))
        .await
        .expect("START_REPLICATION");
    let mut next = start;
    let mut first_page = Vec::new();
    while next < xlogpos {
        let ev = tokio::time::timeout(Duration::from_secs(20), r.read())
            .await
            .expect("WAL arrives")
            .expect("read");
        let CopyEvent::Data(d) = ev else {
            panic!("server ended the copy early")
        };
        match ReplicationMessage::decode(d).expect("valid replication message") {
            ReplicationMessage::XLogData {
                wal_start, data, ..
            } => {
                assert_eq!(wal_start, next, "contiguous WAL");
                if first_page.len() < 40 {
                    first_page.extend_from_slice(&data[..data.len().min(40)]);
                }
                next = next.checked_add(data.len() as u64).expect("no overflow");
            }
            ReplicationMessage::Keepalive { .. } => {}
        }
    }
    // The first bytes are the segment's long page header: magic 0xD110 (little-endian on disk),
    // XLP_LONG_HEADER set, pageaddr = start, and the long header's system id.
    assert_eq!(&first_page[0..2], &[0x10, 0xD1]);
    assert_ne!(first_page[2] & 0x02, 0, "XLP_LONG_HEADER");
    let u64le = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
    assert_eq!(u64le(&first_page[8..16]), start.0, "xlp_pageaddr");
    assert_eq!(u64le(&first_page[24..32]), system_id, "xlp_sysid");

    // Report progress, then end the copy from our side and see the server's clean tail.
    w.write_standby_message(&StandbyMessage::StatusUpdate {
        write: next,
        flush: next,
        apply: Lsn(0),
        send_time: pq_proto::pg_now(),
        reply_requested: false,
    });
    w.flush().await.expect("status update");
    w.send_copy_done().await.expect("CopyDone");
    // WAL may still arrive before the server's CopyDone.
    while let CopyEvent::Data(_) = tokio::time::timeout(Duration::from_secs(20), r.read())
        .await
        .expect("CopyDone arrives")
        .expect("read")
    {}
    loop {
        match r.read_message().await.expect("tail") {
            BackendMessage::ReadyForQuery(_) => break,
            BackendMessage::CommandComplete(_)
            | BackendMessage::RowDescription(_)
            | BackendMessage::DataRow(_) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    w.terminate().await.expect("terminate");

    // A start point beyond the primary's WAL: the real error text comes back as a Server error.
    let c = ClientConn::connect(&pg.client_config("pq_real_postgres"))
        .await
        .expect("connect");
    let err = match c
        .start_copy_both("START_REPLICATION PHYSICAL FF/0 TIMELINE 1")
        .await
    {
        Err(e) => e,
        // PostgreSQL 15 answers CopyBothResponse first and then reports the error.
        Ok((mut r, _w)) => r.read().await.expect_err("an error, not WAL"),
    };
    let PqError::Server(e) = &err else {
        panic!("{err}")
    };
    assert!(
        e.message.contains("is ahead of the WAL flush position"),
        "{e}"
    );

    let log = pg.log();
    assert!(
        log.contains(&format!("START_REPLICATION PHYSICAL {start} TIMELINE 1")),
        "the primary logged our command:\n{log}"
    );
}
