//! Shared by the `pq_*` integration tests: a tiny replication server built from `pq_proto::server`
//! that answers the commands real clients send, records what arrived, and either refuses or
//! serves a small WAL stream on START_REPLICATION; plus helpers to find real PostgreSQL binaries.

#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use pq_proto::PqError;
use pq_proto::backend::FieldDescription;
use pq_proto::client::ClientConfig;
use pq_proto::replication::StandbyMessage;
use pq_proto::server::{ServerConfig, ServerConn};
use pq_proto::{ErrorFields, FrontendMessage, sqlstate};
use safekeeper::command::{ReplicationCommand, parse_command};
use sk_core::types::Lsn;
use tokio::net::{TcpListener, TcpStream};

pub const SYSTEM_ID: &str = "7000000000000000001";
/// The end of WAL the test server reports in IDENTIFY_SYSTEM.
pub const XLOGPOS: Lsn = Lsn(0x0100_0100);
pub const SEG_SIZE: u64 = 16 << 20;
/// How many WAL bytes the streaming mode sends.
pub const STREAM_LEN: usize = 8192;

/// What the test server does on START_REPLICATION.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StartMode {
    /// ErrorResponse with the text real PostgreSQL uses for a start point beyond its WAL.
    Refuse,
    /// CopyBothResponse, one XLogData of [`STREAM_LEN`] bytes at the requested LSN, a keepalive
    /// asking for a reply; once an `r` reporting that data arrives, CopyDone; after the client's
    /// CopyDone, CommandComplete + ReadyForQuery.
    Stream,
}

/// What arrived, in order: `Q:<query>`, `r:<write>/<flush>`, `h`, `c` (CopyDone), `X`,
/// `startup:<key>=<value>`, `error:<message>` (connection-level errors).
#[derive(Clone, Default)]
pub struct Log(pub Arc<Mutex<Vec<String>>>);

impl Log {
    pub fn push(&self, s: impl Into<String>) {
        self.0.lock().expect("log lock").push(s.into());
    }

    pub fn entries(&self) -> Vec<String> {
        self.0.lock().expect("log lock").clone()
    }

    pub fn queries(&self) -> Vec<String> {
        self.entries()
            .into_iter()
            .filter_map(|e| e.strip_prefix("Q:").map(str::to_string))
            .collect()
    }
}

pub struct TestServer {
    pub addr: SocketAddr,
    pub log: Log,
}

/// Starts the test server on 127.0.0.1:0; it serves connections until the runtime ends.
pub async fn start_server(config: ServerConfig, mode: StartMode) -> TestServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("local addr");
    let log = Log::default();
    let log2 = log.clone();
    tokio::spawn(async move {
        loop {
            let Ok((sock, _)) = listener.accept().await else {
                return;
            };
            let log = log2.clone();
            let config = config.clone();
            tokio::spawn(async move {
                if let Err(e) = serve(sock, config, mode, log.clone()).await {
                    log.push(format!("error:{e}"));
                }
            });
        }
    });
    TestServer { addr, log }
}

fn one_row(
    fields: Vec<FieldDescription>,
    row: Vec<Option<String>>,
) -> (Vec<FieldDescription>, Vec<Vec<Option<String>>>) {
    (fields, vec![row])
}

async fn serve(
    sock: TcpStream,
    config: ServerConfig,
    mode: StartMode,
    log: Log,
) -> Result<(), PqError> {
    sock.set_nodelay(true)?;
    let mut conn = ServerConn::new(sock, config);
    let params = conn.handshake().await?;
    for (k, v) in &params.0 {
        log.push(format!("startup:{k}={v}"));
    }
    loop {
        let Some(msg) = conn.read_message().await? else {
            log.push("eof");
            return Ok(());
        };
        let query = match msg {
            FrontendMessage::Query(q) => q,
            FrontendMessage::Terminate => {
                log.push("X");
                return Ok(());
            }
            other => {
                conn.send_fatal(ErrorFields::fatal(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("unexpected message {other:?}"),
                ))
                .await?;
                return Ok(());
            }
        };
        log.push(format!("Q:{query}"));
        let cmd = match parse_command(&query) {
            Ok(c) => c,
            Err(e) => {
                conn.send_error(e.to_error_fields()).await?;
                continue;
            }
        };
        let (fields, rows, tag) = match cmd {
            ReplicationCommand::IdentifySystem => {
                let (f, r) = one_row(
                    vec![
                        FieldDescription::text("systemid"),
                        FieldDescription::int4("timeline"),
                        FieldDescription::text("xlogpos"),
                        FieldDescription::text("dbname"),
                    ],
                    vec![
                        Some(SYSTEM_ID.into()),
                        Some("1".into()),
                        Some(XLOGPOS.to_string()),
                        None,
                    ],
                );
                (f, r, "IDENTIFY_SYSTEM")
            }
            ReplicationCommand::Show(name) => {
                let value = match name.as_str() {
                    "data_directory_mode" => "0700",
                    "wal_segment_size" => "16MB",
                    _ => {
                        conn.send_error(ErrorFields::error(
                            sqlstate::UNDEFINED_OBJECT,
                            format!("unrecognized configuration parameter \"{name}\""),
                        ))
                        .await?;
                        continue;
                    }
                };
                let (f, r) = one_row(
                    vec![FieldDescription::text(&name)],
                    vec![Some(value.into())],
                );
                (f, r, "SHOW")
            }
            ReplicationCommand::ReadReplicationSlot(_) => {
                let (f, r) = one_row(
                    vec![
                        FieldDescription::text("slot_type"),
                        FieldDescription::text("restart_lsn"),
                        FieldDescription::int8("restart_tli"),
                    ],
                    vec![
                        Some("physical".into()),
                        Some(XLOGPOS.to_string()),
                        Some("1".into()),
                    ],
                );
                (f, r, "READ_REPLICATION_SLOT")
            }
            ReplicationCommand::TimelineStatus => {
                let (f, r) = one_row(
                    vec![
                        FieldDescription::text("flush_lsn"),
                        FieldDescription::text("commit_lsn"),
                    ],
                    vec![Some(XLOGPOS.to_string()), Some(XLOGPOS.to_string())],
                );
                (f, r, "TIMELINE_STATUS")
            }
            ReplicationCommand::SetDatestyle => {
                conn.send_command_complete("SET").await?;
                continue;
            }
            ReplicationCommand::StartReplication { start_lsn, .. } => match mode {
                StartMode::Refuse => {
                    conn.send_error(ErrorFields::error(
                            sqlstate::OBJECT_NOT_IN_PREREQUISITE_STATE,
                            format!(
                                "requested starting point {start_lsn} is ahead of the WAL flush position of this server {}",
                                Lsn(0)
                            ),
                        ))
                        .await?;
                    continue;
                }
                StartMode::Stream => {
                    return stream(conn, start_lsn, log).await;
                }
            },
            ReplicationCommand::StartWalPush { .. } | ReplicationCommand::TimelineHistory(_) => {
                conn.send_error(ErrorFields::error(
                    sqlstate::FEATURE_NOT_SUPPORTED,
                    "not served by the test server",
                ))
                .await?;
                continue;
            }
        };
        conn.send_result_set(&fields, &rows, tag).await?;
    }
}

/// The Stream mode of START_REPLICATION: a reader task records `r`/`h`/`c`, the writer sends
/// WAL, a keepalive, and ends the copy once the client reports the WAL written.
async fn stream(mut conn: ServerConn<TcpStream>, start: Lsn, log: Log) -> Result<(), PqError> {
    conn.send_copy_both_response().await?;
    let (mut reader, mut writer) = conn.split();
    let end = start.checked_add(STREAM_LEN as u64).expect("small LSN");
    let (written_tx, mut written_rx) = tokio::sync::mpsc::channel::<()>(4);
    let (done_tx, mut done_rx) = tokio::sync::mpsc::channel::<()>(1);
    let rlog = log.clone();
    let reader_task = tokio::spawn(async move {
        loop {
            match reader.read_message().await? {
                Some(FrontendMessage::CopyData(d)) => match StandbyMessage::decode(d) {
                    Ok(StandbyMessage::StatusUpdate { write, flush, .. }) => {
                        rlog.push(format!("r:{write}/{flush}"));
                        if write >= end {
                            let _ = written_tx.try_send(());
                        }
                    }
                    Ok(StandbyMessage::HotStandbyFeedback { .. }) => rlog.push("h"),
                    Ok(StandbyMessage::NeonFeedback(_)) => rlog.push("z"),
                    Err(e) => rlog.push(format!("bad copy data: {e}")),
                },
                Some(FrontendMessage::CopyDone) => {
                    rlog.push("c");
                    let _ = done_tx.try_send(());
                    return Ok::<_, PqError>(reader);
                }
                Some(other) => rlog.push(format!("unexpected:{other:?}")),
                None => {
                    rlog.push("eof");
                    return Err(PqError::ConnectionClosed);
                }
            }
        }
    });
    // WAL bytes: a recognizable pattern (pg_receivewal does not validate WAL contents).
    let data: Vec<u8> = (0..STREAM_LEN).map(|i| (i % 251) as u8).collect();
    writer.write_xlog_data(start, end, pq_proto::pg_now(), &data);
    writer.write_keepalive(end, pq_proto::pg_now(), true);
    writer.flush().await?;
    let timeout = Duration::from_secs(20);
    if tokio::time::timeout(timeout, written_rx.recv())
        .await
        .is_err()
    {
        log.push("timeout waiting for r");
    }
    writer.write_message(&pq_proto::BackendMessage::CopyDone);
    writer.flush().await?;
    if tokio::time::timeout(timeout, done_rx.recv()).await.is_err() {
        log.push("timeout waiting for client CopyDone");
        return Ok(());
    }
    let reader = reader_task.await.expect("reader task")?;
    let mut conn = reader.unsplit(writer);
    conn.send_command_complete("START_STREAMING").await?;
    // The client may send Terminate or just close.
    while let Ok(Some(m)) = conn.read_message().await {
        log.push(format!("after copy:{m:?}"));
    }
    Ok(())
}

/// Finds a PostgreSQL binary: on PATH, or in `pg_config --bindir`. When it is missing, a test
/// fails if the env var `CI` is set and is skipped (returns `None`, with a message) otherwise.
pub fn require_pg_binary(name: &str, package: &str) -> Option<PathBuf> {
    let in_bindir = std::process::Command::new("pg_config")
        .arg("--bindir")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()).join(name))
        .filter(|p| p.exists());
    let on_path = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(name))
            .find(|p| p.exists())
    });
    match on_path.or(in_bindir) {
        Some(p) => Some(p),
        None if std::env::var_os("CI").is_some() => {
            panic!("{name} not found: install the Debian package {package}")
        }
        None => {
            eprintln!("SKIPPED: {name} not found; install the Debian package {package}");
            None
        }
    }
}

/// Runs a command to completion with a deadline (killing it if it overruns); returns
/// (exit success, stdout, stderr).
pub fn run_with_deadline(
    mut cmd: std::process::Command,
    deadline: Duration,
) -> (bool, String, String) {
    use std::io::Read;
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn client");
    let start = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("try_wait") {
            break Some(s);
        }
        if start.elapsed() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut out = String::new();
    let mut err = String::new();
    if let Some(mut o) = child.stdout.take() {
        let _ = o.read_to_string(&mut out);
    }
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut err);
    }
    if status.is_none() {
        err.push_str("\n[killed after deadline]");
    }
    (status.is_some_and(|s| s.success()), out, err)
}

/// Bytes of the XLogData the Stream mode sends.
pub fn stream_bytes() -> Bytes {
    (0..STREAM_LEN).map(|i| (i % 251) as u8).collect()
}

impl Log {
    /// Waits (up to 10 s, polling) until an entry equals `entry`; the server task logs
    /// asynchronously after the client has moved on.
    pub async fn wait_for(&self, entry: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while !self.entries().iter().any(|e| e == entry) {
            assert!(
                tokio::time::Instant::now() < deadline,
                "server never logged {entry:?}: {:?}",
                self.entries()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }
}

/// A throwaway PostgreSQL cluster in a temporary directory, run as the `postgres` user (via
/// `runuser`) when we are root. Stopped (immediate mode) on drop, also when a test fails.
pub struct PgCluster {
    bindir: PathBuf,
    pub dir: tempfile::TempDir,
    pub port: u16,
    as_postgres: bool,
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .expect("bind")
        .local_addr()
        .expect("addr")
        .port()
}

impl PgCluster {
    /// A new, empty cluster directory (not initialized). `None` (skip) when PostgreSQL is
    /// missing and `CI` is not set.
    fn new() -> Option<PgCluster> {
        require_pg_binary("initdb", "postgresql-15")?;
        // The server binaries live in pg_config --bindir (not on PATH on Debian).
        let bindir = Command::new("pg_config")
            .arg("--bindir")
            .output()
            .ok()
            .map(|o| PathBuf::from(String::from_utf8_lossy(&o.stdout).trim()))
            .filter(|p| p.join("pg_ctl").exists())
            .expect("pg_config --bindir holds pg_ctl");
        // SAFETY: geteuid takes no arguments, touches no memory of ours and cannot fail.
        let as_postgres = unsafe { libc::geteuid() } == 0;
        let dir = tempfile::tempdir().expect("tempdir");
        if as_postgres {
            let st = Command::new("chown")
                .arg("postgres:postgres")
                .arg(dir.path())
                .status()
                .expect("chown");
            assert!(st.success(), "chown the temp dir to postgres");
        }
        Some(PgCluster {
            bindir,
            dir,
            port: free_port(),
            as_postgres,
        })
    }

    pub fn data(&self) -> PathBuf {
        self.dir.path().join("data")
    }

    fn command(&self, bin: &str) -> Command {
        let mut c = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(self.bindir.join(bin));
            c
        } else {
            Command::new(self.bindir.join(bin))
        };
        c.current_dir(self.dir.path());
        c
    }

    fn run(&self, cmd: Command, what: &str) {
        let (ok, out, err) = run_with_deadline(cmd, Duration::from_secs(90));
        assert!(
            ok,
            "{what} failed:\n{out}\n{err}\nserver log:\n{}",
            self.log()
        );
    }

    fn pg_ctl_start(&self, extra_opts: &str) {
        let mut start = self.command("pg_ctl");
        start
            .args(["-w", "-t", "60", "-D"])
            .arg(self.data())
            .arg("-l")
            .arg(self.dir.path().join("log"))
            .arg("-o")
            .arg(format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off {extra_opts}",
                self.port,
                self.dir.path().display()
            ))
            .arg("start");
        self.run(start, "pg_ctl start");
    }

    /// initdb + start a primary on a free port (wal_level=replica, replication commands logged).
    pub fn init_primary() -> Option<PgCluster> {
        let c = PgCluster::new()?;
        let mut initdb = c.command("initdb");
        initdb
            .args(["-N", "--auth=trust", "-U", "postgres", "-D"])
            .arg(c.data());
        c.run(initdb, "initdb");
        c.pg_ctl_start("-c wal_level=replica -c max_wal_senders=10 -c log_replication_commands=on");
        Some(c)
    }

    /// A hot standby from `pg_basebackup -X none` of `primary` (so every WAL byte it replays
    /// comes through its walreceiver), streaming from `upstream_port` with `wal_receiver_timeout`
    /// 5 s (so missing keepalive answers show). `pg_ctl -w` returns once it is consistent.
    pub fn start_standby(primary: &PgCluster, upstream_port: u16) -> PgCluster {
        let c = PgCluster::new().expect("checked by the primary");
        let mut bb = c.command("pg_basebackup");
        bb.args([
            "-h",
            "127.0.0.1",
            "-p",
            &primary.port.to_string(),
            "-U",
            "postgres",
        ])
        .args(["-X", "none", "-c", "fast", "-D"])
        .arg(c.data());
        c.run(bb, "pg_basebackup");
        std::fs::write(c.data().join("standby.signal"), "").expect("standby.signal");
        let mut conf = std::fs::OpenOptions::new()
            .append(true)
            .open(c.data().join("postgresql.auto.conf"))
            .expect("postgresql.auto.conf");
        use std::io::Write;
        writeln!(
            conf,
            "primary_conninfo = 'host=127.0.0.1 port={upstream_port} user=postgres \
             application_name=standby1'\nhot_standby = on\nhot_standby_feedback = on\n\
             wal_receiver_timeout = '5s'\nwal_retrieve_retry_interval = '1s'\n\
             wal_receiver_status_interval = '1s'"
        )
        .expect("write conf");
        c.pg_ctl_start("");
        c
    }

    /// Runs SQL with psql over TCP; returns unaligned, tuples-only output.
    pub fn psql(&self, sql: &str) -> String {
        let mut cmd = Command::new("psql");
        cmd.args(["-X", "-A", "-t", "-v", "ON_ERROR_STOP=1", "-h", "127.0.0.1"])
            .args([
                "-p",
                &self.port.to_string(),
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-c",
                sql,
            ]);
        let (ok, out, err) = run_with_deadline(cmd, Duration::from_secs(30));
        assert!(
            ok,
            "psql {sql:?} failed: {err}\nserver log:\n{}",
            self.log()
        );
        out.trim().to_string()
    }

    pub fn client_config(&self, application_name: &str) -> ClientConfig {
        let mut cfg = ClientConfig::new("127.0.0.1", self.port, "postgres");
        cfg.application_name = Some(application_name.into());
        cfg
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("log")).unwrap_or_default()
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for PgCluster {
    fn drop(&mut self) {
        if !self.data().join("postmaster.pid").exists() {
            return;
        }
        let mut stop = self.command("pg_ctl");
        stop.args(["-D"])
            .arg(self.data())
            .args(["-m", "immediate", "stop"]);
        let _ = run_with_deadline(stop, Duration::from_secs(30));
    }
}
