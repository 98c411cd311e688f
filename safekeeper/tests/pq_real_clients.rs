//! Real PostgreSQL 15 clients (`psql`, `pg_receivewal`) against a tiny server built from
//! `pq_proto::server`: proves that our handshake, ParameterStatus values, result sets, errors and
//! CopyBoth stream are accepted by libpq and by pg_receivewal's checks.
//!
//! Skipped with a message when the binaries are missing, unless `CI` is set (then they fail).

mod pq_common;

use std::process::Command;
use std::time::Duration;

use pq_common::*;
use pq_proto::server::ServerConfig;

const DEADLINE: Duration = Duration::from_secs(30);

fn conninfo(port: u16, extra: &str) -> String {
    format!("host=127.0.0.1 port={port} user=postgres sslmode=prefer connect_timeout=10 {extra}")
}

/// Runs psql (blocking, on a blocking thread so the server keeps running).
async fn psql(
    conn: String,
    sql: &'static str,
    env: Vec<(&'static str, &'static str)>,
) -> (bool, String, String) {
    let psql = require_pg_binary("psql", "postgresql-client-15").expect("checked by caller");
    tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new(psql);
        cmd.arg(conn).args(["-X", "-A", "-t", "-c", sql]);
        cmd.env_remove("PGPASSWORD");
        for (k, v) in env {
            cmd.env(k, v);
        }
        run_with_deadline(cmd, DEADLINE)
    })
    .await
    .expect("psql thread")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_runs_identify_system_and_show_over_replication_connection() {
    if require_pg_binary("psql", "postgresql-client-15").is_none() {
        return;
    }
    let srv = start_server(ServerConfig::default(), StartMode::Refuse).await;
    let port = srv.addr.port();

    let (ok, out, err) = psql(
        conninfo(port, "replication=true"),
        "IDENTIFY_SYSTEM",
        vec![],
    )
    .await;
    assert!(ok, "psql failed: {err}");
    assert_eq!(out.trim(), format!("{SYSTEM_ID}|1|{XLOGPOS}|"));

    let (ok, out, err) = psql(
        conninfo(port, "replication=true"),
        "SHOW wal_segment_size",
        vec![],
    )
    .await;
    assert!(ok, "psql failed: {err}");
    assert_eq!(out.trim(), "16MB");

    // A command we do not serve: psql shows our error naming it, and exits non-zero.
    let (ok, _, err) = psql(conninfo(port, "replication=true"), "BASE_BACKUP", vec![]).await;
    assert!(!ok);
    assert!(
        err.contains("unsupported command BASE_BACKUP"),
        "stderr: {err}"
    );

    let log = srv.log.entries();
    assert!(
        log.contains(&"startup:replication=true".to_string()),
        "{log:?}"
    );
    assert!(
        log.contains(&"startup:user=postgres".to_string()),
        "{log:?}"
    );
    assert_eq!(
        srv.log.queries(),
        vec!["IDENTIFY_SYSTEM", "SHOW wal_segment_size", "BASE_BACKUP"]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_connections_we_refuse_show_our_error_text() {
    if require_pg_binary("psql", "postgresql-client-15").is_none() {
        return;
    }
    let srv = start_server(ServerConfig::default(), StartMode::Refuse).await;
    let port = srv.addr.port();

    // A normal (non-replication) connection.
    let (ok, _, err) = psql(conninfo(port, ""), "SELECT 1", vec![]).await;
    assert!(!ok);
    assert!(
        err.contains("accepts only physical replication connections"),
        "stderr: {err}"
    );

    // Logical replication mode.
    let (ok, _, err) = psql(
        conninfo(port, "replication=database"),
        "IDENTIFY_SYSTEM",
        vec![],
    )
    .await;
    assert!(!ok);
    assert!(err.contains("replication=database"), "stderr: {err}");
    assert!(srv.log.queries().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn psql_authenticates_with_the_shared_secret_as_password() {
    if require_pg_binary("psql", "postgresql-client-15").is_none() {
        return;
    }
    let config = ServerConfig {
        password: Some(b"s3cret".to_vec()),
        ..ServerConfig::default()
    };
    let srv = start_server(config, StartMode::Refuse).await;
    let port = srv.addr.port();

    let (ok, out, err) = psql(
        conninfo(port, "replication=true"),
        "IDENTIFY_SYSTEM",
        vec![("PGPASSWORD", "s3cret")],
    )
    .await;
    assert!(ok, "psql failed: {err}");
    assert!(out.starts_with(SYSTEM_ID));

    let (ok, _, err) = psql(
        conninfo(port, "replication=true"),
        "IDENTIFY_SYSTEM",
        vec![("PGPASSWORD", "wrong")],
    )
    .await;
    assert!(!ok);
    assert!(
        err.contains("password authentication failed for user \"postgres\""),
        "stderr: {err}"
    );
    assert_eq!(srv.log.queries(), vec!["IDENTIFY_SYSTEM"]);
}

async fn pg_receivewal(port: u16, dir: &std::path::Path, extra: &[&str]) -> (bool, String, String) {
    pg_receivewal_env(port, dir, extra, &[]).await
}

async fn pg_receivewal_env(
    port: u16,
    dir: &std::path::Path,
    extra: &[&str],
    env: &[(&str, &str)],
) -> (bool, String, String) {
    let bin =
        require_pg_binary("pg_receivewal", "postgresql-client-15").expect("checked by caller");
    let mut cmd = Command::new(bin);
    cmd.env_remove("PGPASSWORD");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.args(["--no-loop", "--verbose", "--no-password", "-D"])
        .arg(dir)
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-U", "postgres"])
        .args(extra);
    tokio::task::spawn_blocking(move || run_with_deadline(cmd, DEADLINE))
        .await
        .expect("pg_receivewal thread")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_receivewal_gets_through_handshake_to_start_replication_and_shows_our_error() {
    if require_pg_binary("pg_receivewal", "postgresql-client-15").is_none() {
        return;
    }
    let srv = start_server(ServerConfig::default(), StartMode::Refuse).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, _, err) = pg_receivewal(srv.addr.port(), dir.path(), &[]).await;
    assert!(!ok, "pg_receivewal must exit non-zero after our error");
    assert!(
        err.contains("requested starting point 0/1000000 is ahead of the WAL flush position"),
        "stderr: {err}"
    );
    let queries = srv.log.queries();
    // The order pg_receivewal 15 uses (measured against a real primary).
    assert_eq!(
        queries.first().map(String::as_str),
        Some("SHOW data_directory_mode")
    );
    let pos = |q: &str| queries.iter().position(|x| x == q);
    assert!(
        pos("IDENTIFY_SYSTEM") < pos("SHOW wal_segment_size"),
        "{queries:?}"
    );
    assert_eq!(
        queries.last().map(String::as_str),
        Some("START_REPLICATION 0/1000000 TIMELINE 1"),
        "starts at the segment start of IDENTIFY_SYSTEM's xlogpos {XLOGPOS}: {queries:?}"
    );
    assert!(
        srv.log
            .entries()
            .contains(&"startup:application_name=pg_receivewal".to_string())
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_receivewal_with_slot_reads_replication_slot_first() {
    if require_pg_binary("pg_receivewal", "postgresql-client-15").is_none() {
        return;
    }
    let srv = start_server(ServerConfig::default(), StartMode::Refuse).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (ok, _, err) = pg_receivewal(srv.addr.port(), dir.path(), &["--slot=s1"]).await;
    assert!(!ok);
    assert!(
        err.contains("is ahead of the WAL flush position"),
        "stderr: {err}"
    );
    let queries = srv.log.queries();
    // PostgreSQL 15.20's pg_receivewal quotes the slot name here; earlier 15.x did not.
    assert!(
        queries
            .iter()
            .any(|q| q == "READ_REPLICATION_SLOT s1" || q == "READ_REPLICATION_SLOT \"s1\""),
        "{queries:?}"
    );
    assert_eq!(
        queries.last().map(String::as_str),
        Some("START_REPLICATION SLOT \"s1\" 0/1000000 TIMELINE 1"),
        "{queries:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pg_receivewal_accepts_our_wal_stream_and_answers_keepalives() {
    if require_pg_binary("pg_receivewal", "postgresql-client-15").is_none() {
        return;
    }
    let srv = start_server(ServerConfig::default(), StartMode::Stream).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, _, err) = pg_receivewal(srv.addr.port(), dir.path(), &[]).await;
    assert!(
        err.contains("starting log streaming at 0/1000000 (timeline 1)"),
        "stderr: {err}"
    );
    let log = srv.log.entries();
    // pg_receivewal answered the keepalive with a status update reporting our WAL written.
    let end = format!("r:0/{:X}/", 0x100_0000 + STREAM_LEN);
    assert!(
        log.iter().any(|e| e.starts_with(&end)),
        "{log:?}\nstderr: {err}"
    );
    // It ended its side of the copy after ours.
    assert!(log.contains(&"c".to_string()), "{log:?}\nstderr: {err}");
    assert!(!log.iter().any(|e| e.starts_with("timeout")), "{log:?}");
    // The bytes we sent are at the start of the (partial) first segment.
    let seg = dir.path().join("000000010000000000000001.partial");
    let got = std::fs::read(&seg).unwrap_or_else(|e| panic!("{seg:?}: {e}; stderr: {err}"));
    assert_eq!(got.len() as u64, SEG_SIZE);
    assert_eq!(&got[..STREAM_LEN], &stream_bytes()[..]);
    assert!(got[STREAM_LEN..].iter().all(|&b| b == 0));
}

const TENANT: &str = "de200bd42b49cc1814412c7e592dd6e9";
const TIMELINE: &str = "0102030405060708090a0b0c0d0e0f10";

/// How a reader names the timeline: libpq passes `options` verbatim, and our parser reads it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn libpq_clients_pass_options_verbatim_and_send_the_password() {
    if require_pg_binary("pg_receivewal", "postgresql-client-15").is_none()
        || require_pg_binary("psql", "postgresql-client-15").is_none()
    {
        return;
    }
    let config = ServerConfig {
        password: Some(b"tok".to_vec()),
        ..ServerConfig::default()
    };
    let srv = start_server(config, StartMode::Refuse).await;
    let options = format!("-c tenant_id={TENANT} timeline_id={TIMELINE}");
    let dir = tempfile::tempdir().expect("tempdir");
    let (_, _, err) = pg_receivewal_env(
        srv.addr.port(),
        dir.path(),
        &["-d", &format!("options='{options}'")],
        &[("PGPASSWORD", "tok")],
    )
    .await;
    assert!(
        err.contains("is ahead of the WAL flush position"),
        "stderr: {err}"
    );

    let (ok, _, err) = psql(
        conninfo(
            srv.addr.port(),
            &format!("replication=true options='-ctenant_id={TENANT} -ctimeline_id={TIMELINE}'"),
        ),
        "IDENTIFY_SYSTEM",
        vec![("PGPASSWORD", "tok")],
    )
    .await;
    assert!(ok, "psql: {err}");

    let sent: Vec<String> = srv
        .log
        .entries()
        .into_iter()
        .filter_map(|e| e.strip_prefix("startup:options=").map(str::to_string))
        .collect();
    assert_eq!(
        sent,
        vec![
            options,
            format!("-ctenant_id={TENANT} -ctimeline_id={TIMELINE}")
        ]
    );
    for s in &sent {
        let o = safekeeper::command::parse_options(s).expect("options parse");
        assert_eq!(o.tenant_id.map(|t| t.to_string()).as_deref(), Some(TENANT));
        assert_eq!(
            o.timeline_id.map(|t| t.to_string()).as_deref(),
            Some(TIMELINE)
        );
    }
}
