//! `pq::client` against a REAL PostgreSQL 15 primary: startup on a replication connection,
//! IDENTIFY_SYSTEM / SHOW result sets, START_REPLICATION with XLogData whose first page is the
//! primary's long page header, status updates, the CopyDone handshake, and the real error text
//! for a start point beyond the primary's WAL.
//!
//! The cluster is started with `initdb`/`pg_ctl` from `pg_config --bindir` (as the `postgres`
//! user via `runuser` when we are root) in a temporary directory, and stopped on drop even when
//! the test fails. Skipped with a message when PostgreSQL is missing, unless `CI` is set.

mod pq_common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use pq_common::{require_pg_binary, run_with_deadline};
use safekeeper::pq::PqError;
use safekeeper::pq::client::{ClientConfig, ClientConn, CopyEvent};
use safekeeper::pq::codec::BackendMessage;
use safekeeper::pq::replication::{ReplicationMessage, StandbyMessage};
use safekeeper::types::Lsn;

const SEG_SIZE: u64 = 16 << 20;

/// A throwaway PostgreSQL cluster; stopped (immediate mode) on drop.
struct PgCluster {
    bindir: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    as_postgres: bool,
}

impl PgCluster {
    fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn command(&self, bin: &str) -> Command {
        if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(self.bindir.join(bin));
            c
        } else {
            Command::new(self.bindir.join(bin))
        }
    }

    fn run(&self, mut cmd: Command, what: &str) {
        cmd.current_dir(self.dir.path());
        let (ok, out, err) = run_with_deadline(cmd, Duration::from_secs(60));
        let log = std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default();
        assert!(ok, "{what} failed:\n{out}\n{err}\nserver log:\n{log}");
    }

    /// initdb + start on a free port. `None` (skip) when PostgreSQL is not installed.
    fn start() -> Option<PgCluster> {
        let initdb = require_pg_binary("initdb", "postgresql-15")?;
        let bindir = initdb.parent().expect("bindir").to_path_buf();
        // Only the server binaries in pg_config --bindir are usable; initdb on PATH would be a
        // Debian wrapper, so prefer the bindir.
        let bindir = Command::new("pg_config")
            .arg("--bindir")
            .output()
            .ok()
            .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
            .filter(|p| p.join("pg_ctl").exists())
            .unwrap_or(bindir);
        let as_postgres = unsafe { libc::geteuid() } == 0;
        let dir = tempfile::tempdir().expect("tempdir");
        if as_postgres {
            let st = Command::new("chown")
                .args(["postgres:postgres"])
                .arg(dir.path())
                .status()
                .expect("chown");
            assert!(st.success(), "chown the temp dir to postgres");
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .expect("bind")
            .local_addr()
            .expect("addr")
            .port();
        let c = PgCluster {
            bindir,
            dir,
            port,
            as_postgres,
        };
        let mut initdb = c.command("initdb");
        initdb
            .args(["-N", "--auth=trust", "-U", "postgres", "-D"])
            .arg(c.data());
        c.run(initdb, "initdb");
        let mut start = c.command("pg_ctl");
        start
            .args(["-w", "-D"])
            .arg(c.data())
            .arg("-l")
            .arg(c.dir.path().join("log"))
            .arg("-o")
            .arg(format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1 -c wal_level=replica \
                 -c max_wal_senders=4 -c fsync=off -c log_replication_commands=on",
                c.port,
                c.dir.path().display()
            ))
            .arg("start");
        c.run(start, "pg_ctl start");
        Some(c)
    }

    fn client_config(&self) -> ClientConfig {
        let mut cfg = ClientConfig::new("127.0.0.1", self.port, "postgres");
        cfg.application_name = Some("pq_real_postgres".into());
        cfg
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        let mut stop = self.command("pg_ctl");
        stop.args(["-D"])
            .arg(self.data())
            .args(["-m", "immediate", "stop"])
            .current_dir(self.dir.path());
        let _ = run_with_deadline(stop, Duration::from_secs(30));
    }
}

fn assert_dir_gone_or_temp(p: &Path) {
    assert!(p.starts_with(std::env::temp_dir()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_streams_wal_from_a_real_postgres_primary() {
    let Some(pg) = tokio::task::spawn_blocking(PgCluster::start)
        .await
        .expect("start thread")
    else {
        return;
    };
    assert_dir_gone_or_temp(pg.dir.path());

    let mut c = ClientConn::connect(&pg.client_config())
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
        send_time: safekeeper::pq::pg_now(),
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
    let c = ClientConn::connect(&pg.client_config())
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
