//! Helpers shared by the `wal-bench` Criterion benchmarks (the benches live in `benches/`; see
//! `README.md` for how to run, filter, profile and compare them).
//!
//! - [`criterion()`]: the Criterion configuration every bench uses (short defaults for a 2-core
//!   machine, pprof flamegraphs under `--profile-time`);
//! - [`Env`]: a real timeline (control file + WAL segments) in a temp dir on the disk under
//!   test, elected at term 1 through `process_msg` ([`election`]), with a WAL generator
//!   positioned at its end;
//! - [`Workload`]: pre-generated appends of valid logical-message WAL, so generation stays out
//!   of timed regions;
//! - [`Acceptor`]: the real `WalAcceptor` pipeline stage (`receive_wal::spawn_acceptor`) driven
//!   without a socket;
//! - [`CpuProfile`]: a 99 Hz CPU profile running in the background (profiler overhead benches);
//! - [`raw_client`]: an independent, minimal protocol-v3 proposer (hand-encoded frames over
//!   blocking sockets) that commits one append at a time, and [`raw_client::Tail`], the
//!   percentiles of a latency sample (used by `src/bin/commit-tail.rs`).
//!
//! What it leaves to others: the allocator (each bench binary calls
//! `profiling::global_allocator!()`, so benches run on jemalloc with heap profiling on, as the
//! daemon does) and the measurements themselves.

pub mod raw_client;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use bytes::Bytes;
use criterion::Criterion;
use pg_wal::WalGenerator;
use pprof::criterion::{Output, PProfProfiler};
use safekeeper::receive_wal::{self, Outgoing, QueuedMsg, REPLY_QUEUE_SIZE};
use safekeeper::registry::GlobalTimelines;
use safekeeper::timeline::Timeline;
use sk_core::protocol::{
    AcceptorProposerMessage, AppendRequest, AppendRequestHeader, ProposerAcceptorMessage,
    ProposerElected, ProposerGreeting, VoteRequest,
};
use sk_core::state::Configuration;
use sk_core::types::{
    Generation, Lsn, NodeId, TenantId, TenantTimelineId, Term, TermHistory, TermLsn, TimelineId,
};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use walproposer::ProposerConfig;
use walproposer::conn::SafekeeperAddr;
use walproposer::synthetic::SyntheticOptions;
use walproposer::tls::{ClientTls, SslMode};

/// 1 KiB.
pub const KIB: usize = 1024;
/// 1 MiB.
pub const MIB: usize = 1024 * KIB;
/// WAL segment size of bench timelines (PostgreSQL's default).
pub const SEG_SIZE: u64 = 16 << 20;
/// PostgreSQL system identifier of bench timelines.
pub const SYSID: u64 = 7_400_000_000_000_000_042;
/// Where bench WAL starts: the beginning of segment 1 (0/1000000).
pub const START: Lsn = Lsn(SEG_SIZE);
/// Sampling rate of CPU profiles (the daemon's default).
pub const PROFILE_HZ: i32 = 99;

/// The Criterion configuration of every wal-bench group: 1 s warm-up, 3 s measurement, 10
/// samples (command-line options still override these), and pprof flamegraphs written to
/// `target/criterion/<group>/<bench>/profile/flamegraph.svg` when run with `--profile-time N`.
pub fn criterion() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
        .with_profiler(PProfProfiler::new(PROFILE_HZ, Output::Flamegraph(None)))
}

/// Directory bench files go to: `$WAL_BENCH_DIR`, else `wal-bench/` under the Cargo target dir
/// (`$CARGO_TARGET_DIR` or the workspace's `target/`). Never a tmpfs by default: fsync costs are
/// the point.
pub fn bench_dir() -> anyhow::Result<PathBuf> {
    let dir = match std::env::var_os("WAL_BENCH_DIR") {
        Some(d) => PathBuf::from(d),
        None => std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target"))
            .join("wal-bench"),
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}

/// A fresh temp dir under [`bench_dir`], removed on drop.
pub fn temp_dir() -> anyhow::Result<tempfile::TempDir> {
    let dir = bench_dir()?;
    tempfile::tempdir_in(&dir).with_context(|| format!("temp dir in {}", dir.display()))
}

/// Runs the `openssl` CLI (Debian package `openssl`); its stderr in the error.
pub fn openssl(args: &[&str]) -> anyhow::Result<()> {
    let out = std::process::Command::new("openssl")
        .args(args)
        .output()
        .context("running openssl (Debian package openssl)")?;
    if !out.status.success() {
        bail!("openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// A certificate and its key, as PEM files: what a bench safekeeper serves TLS with.
pub struct ServerCert {
    /// The certificate (`--tls-cert`).
    pub cert: PathBuf,
    /// Its private key (`--tls-key`).
    pub key: PathBuf,
}

/// A self-signed P-256 certificate for `localhost` and 127.0.0.1, and its key, written by the
/// `openssl` CLI into `dir` as `cert.pem` and `key.pem` (its clients use `sslmode=require`).
pub fn self_signed_cert(dir: &std::path::Path) -> anyhow::Result<ServerCert> {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let path = |p: &PathBuf| p.to_str().map(str::to_string).context("a UTF-8 path");
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:prime256v1",
        "-nodes",
        "-keyout",
        &path(&key)?,
        "-out",
        &path(&cert)?,
        "-days",
        "2",
        "-subj",
        "/CN=localhost",
        "-addext",
        "subjectAltName=DNS:localhost,IP:127.0.0.1",
    ])?;
    Ok(ServerCert { cert, key })
}

/// A safekeeper daemon running inside the bench process: its real listeners (loopback) and
/// services, on the current tokio runtime.
pub struct Daemon {
    /// Its PostgreSQL port, with the password and TLS its clients use.
    pub addr: SafekeeperAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<anyhow::Result<()>>,
}

impl Daemon {
    /// Binds `conf`'s listeners and runs the daemon; clients reach it with `password` (a JWT).
    /// With `tls`, the daemon serves TLS with that certificate and requires it, and its
    /// clients connect with `sslmode=require`.
    pub async fn start(
        mut conf: safekeeper::config::Conf,
        password: Option<String>,
        tls: Option<&ServerCert>,
    ) -> anyhow::Result<Daemon> {
        let client_tls = match tls {
            Some(c) => {
                conf.tls_cert = Some(c.cert.clone());
                conf.tls_key = Some(c.key.clone());
                ClientTls::new(SslMode::Require, None)?
            }
            None => None,
        };
        let listeners = safekeeper::daemon::bind(&conf).await?;
        let addr = SafekeeperAddr {
            host: "127.0.0.1".into(),
            port: listeners.pg_addr().port(),
            password,
            tls: client_tls,
        };
        let (stop, stopped) = oneshot::channel();
        let task = tokio::spawn(safekeeper::daemon::run(conf, listeners, async move {
            let _ = stopped.await;
        }));
        Ok(Daemon { addr, stop, task })
    }

    /// Shuts it down as SIGTERM does and waits for it to end.
    pub async fn stop(self) -> anyhow::Result<()> {
        let _ = self.stop.send(());
        self.task.await?
    }
}

/// A proposer for the bench timeline ([`ttid`], 16 MiB segments, PostgreSQL 15) over
/// `safekeepers`, allowed to create it.
pub fn proposer_config(safekeepers: Vec<SafekeeperAddr>) -> ProposerConfig {
    ProposerConfig {
        safekeepers,
        ttid: ttid(),
        system_id: SYSID,
        pg_version: 150018,
        wal_seg_size: SEG_SIZE as u32,
        start_lsn: START,
        allow_timeline_creation: true,
        max_replication_flush_lag: 0,
        max_replication_apply_lag: 0,
    }
}

/// A record of `size - COMMIT_RECORD_OVERHEAD` payload bytes (one logical message) is just over
/// `size` bytes of WAL: what the single-commit benches subtract to make one commit one record.
pub const COMMIT_RECORD_OVERHEAD: usize = 60;

/// `commits` single commits of `size` bytes of WAL each, one at a time: each `size`-byte
/// chunk the synthetic source asks for is exactly one record ([`COMMIT_RECORD_OVERHEAD`]), and
/// one commit.
pub fn single_commits(size: usize, commits: u64) -> SyntheticOptions {
    SyntheticOptions {
        record_size: size - COMMIT_RECORD_OVERHEAD,
        total_bytes: commits * size as u64,
        rate: None,
        chunk_bytes: size,
        window: 0,
    }
}

/// Bytes of WAL a throughput iteration pushes: `$WAL_BENCH_VOLUME` (default 1 GiB).
pub fn volume() -> u64 {
    std::env::var("WAL_BENCH_VOLUME")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&v: &u64| v > 0)
        .unwrap_or(1 << 30)
}

/// The timeline every bench writes.
pub fn ttid() -> TenantTimelineId {
    TenantTimelineId {
        tenant_id: TenantId([0xbe; 16]),
        timeline_id: TimelineId([0x7c; 16]),
    }
}

/// A proposer's greeting for [`ttid`] (16 MiB segments, PostgreSQL 15).
pub fn greeting() -> ProposerGreeting {
    let t = ttid();
    ProposerGreeting {
        tenant_id: t.tenant_id,
        timeline_id: t.timeline_id,
        mconf: Configuration::default(),
        pg_version: 150018,
        system_id: SYSID,
        wal_seg_size: SEG_SIZE as u32,
    }
}

/// Greeting, vote and `ProposerElected`: what elects a proposer at term 1 with WAL starting at
/// [`START`] on a fresh timeline.
pub fn election() -> [ProposerAcceptorMessage; 3] {
    [
        ProposerAcceptorMessage::Greeting(greeting()),
        ProposerAcceptorMessage::VoteRequest(VoteRequest {
            generation: Generation(0),
            term: Term(1),
        }),
        ProposerAcceptorMessage::Elected(ProposerElected {
            generation: Generation(0),
            term: Term(1),
            start_streaming_at: START,
            term_history: TermHistory(vec![TermLsn {
                term: Term(1),
                lsn: START,
            }]),
        }),
    ]
}

/// One timeline on the real disk, elected at term 1 with WAL starting at [`START`].
pub struct Env {
    /// The timeline.
    pub tl: Arc<Timeline>,
    /// The registry holding it.
    pub timelines: Arc<GlobalTimelines>,
    /// Generates the WAL that continues this timeline's end.
    pub generator: WalGenerator,
    /// Whether the storage really fsyncs (`no_sync` otherwise).
    pub fsync: bool,
    // Last: removed after the timeline has closed its files.
    _dir: tempfile::TempDir,
}

impl Env {
    /// Creates the timeline (durably, as the daemon does) and runs greeting, vote and
    /// `ProposerElected` through `process_msg`.
    pub fn new(fsync: bool) -> anyhow::Result<Env> {
        let dir = temp_dir()?;
        let timelines = Arc::new(GlobalTimelines::load(dir.path(), NodeId(1), !fsync)?);
        let tl = timelines.get_or_create(&greeting(), true)?;
        for msg in &election() {
            tl.process_msg(msg)?;
        }
        Ok(Env {
            tl,
            timelines,
            generator: WalGenerator::new(SYSID, SEG_SIZE, START)?,
            fsync,
            _dir: dir,
        })
    }

    /// The next append: one logical message of `payload` bytes (`AppendRequest`, which
    /// `process_msg` writes and flushes). With `commit`, it carries `commit_lsn` = its own
    /// begin (everything sent before), as a streaming proposer's would; otherwise the term
    /// start.
    pub fn next_append(&mut self, payload: &[u8], commit: bool) -> ProposerAcceptorMessage {
        let (pos, wal) = self.generator.next_record(payload);
        append_msg(pos.chunk_start, Bytes::from(wal), commit)
    }
}

/// An `AppendRequest` of `wal` at `begin` in term 1.
pub fn append_msg(begin: Lsn, wal: Bytes, commit: bool) -> ProposerAcceptorMessage {
    ProposerAcceptorMessage::AppendRequest(AppendRequest {
        h: AppendRequestHeader {
            generation: Generation(0),
            term: Term(1),
            begin_lsn: begin,
            end_lsn: Lsn(begin.0 + wal.len() as u64),
            commit_lsn: if commit { begin } else { START },
            truncate_lsn: Lsn::INVALID,
        },
        wal_data: wal,
    })
}

/// Pre-generated appends continuing from [`START`] on a fresh [`Env`]: the same workload is
/// valid for every fresh timeline, so it is generated once per benchmark.
pub struct Workload {
    /// The appends, in order.
    pub msgs: Vec<ProposerAcceptorMessage>,
    /// Payload bytes (logical-message contents) in `msgs`.
    pub payload_bytes: u64,
    /// End of the last append.
    pub end: Lsn,
}

impl Workload {
    /// Appends of `append_size` WAL bytes each (the last may be shorter), made of records
    /// with `record_size`-byte payloads, totalling at least `volume` WAL bytes.
    pub fn new(record_size: usize, append_size: usize, volume: u64, commit: bool) -> Workload {
        let mut g = WalGenerator::new(SYSID, SEG_SIZE, START).expect("START is a record boundary");
        let message = vec![b'x'; record_size];
        let mut msgs = Vec::new();
        let mut payload_bytes = 0u64;
        let mut begin = START;
        let mut buf = Vec::with_capacity(append_size + record_size + 1024);
        while begin.0 - START.0 < volume {
            buf.clear();
            while buf.len() < append_size {
                g.append_logical_message(&mut buf, &message);
                payload_bytes += record_size as u64;
            }
            let wal = Bytes::copy_from_slice(&buf);
            let len = wal.len() as u64;
            msgs.push(append_msg(begin, wal, commit));
            begin = Lsn(begin.0 + len);
        }
        Workload {
            msgs,
            payload_bytes,
            end: begin,
        }
    }
}

/// The real `WalAcceptor` of a timeline, driven without a socket: messages go through the
/// same bounded queue and blocking loop (batched `fdatasync`) as a proposer connection's.
pub struct Acceptor {
    tx: Option<mpsc::Sender<QueuedMsg>>,
    replies: mpsc::Receiver<Outgoing>,
    task: Option<JoinHandle<()>>,
    /// Highest `flush_lsn` acknowledged so far.
    pub flushed: Lsn,
}

impl Acceptor {
    /// Starts the acceptor of `tl`. Call inside a tokio runtime.
    pub fn spawn(tl: Arc<Timeline>) -> Acceptor {
        let (reply_tx, replies) = mpsc::channel(REPLY_QUEUE_SIZE);
        let (tx, task) = receive_wal::spawn_acceptor(tl, reply_tx, receive_wal::Source::Proposer);
        Acceptor {
            tx: Some(tx),
            replies,
            task: Some(task),
            flushed: Lsn::INVALID,
        }
    }

    /// Queues one message (waits while the queue is full).
    pub async fn push(&mut self, msg: ProposerAcceptorMessage) -> anyhow::Result<()> {
        let tx = self.tx.as_ref().context("acceptor closed")?;
        if !receive_wal::enqueue(tx, msg).await {
            bail!("the acceptor stopped: {:?}", self.replies.try_recv().ok());
        }
        Ok(())
    }

    /// Drains replies that are already there (keeps the reply queue from blocking the
    /// acceptor while we push).
    pub fn poll_replies(&mut self) -> anyhow::Result<()> {
        while let Ok(r) = self.replies.try_recv() {
            self.note(r)?;
        }
        Ok(())
    }

    /// Waits until an acknowledged `flush_lsn` reaches `lsn`.
    pub async fn wait_flushed(&mut self, lsn: Lsn) -> anyhow::Result<()> {
        while self.flushed < lsn {
            let r = self.replies.recv().await.context("acceptor ended")?;
            self.note(r)?;
        }
        Ok(())
    }

    fn note(&mut self, r: Outgoing) -> anyhow::Result<()> {
        match r {
            Outgoing::Reply(AcceptorProposerMessage::AppendResponse(a)) => {
                self.flushed = self.flushed.max(a.flush_lsn);
                Ok(())
            }
            Outgoing::Reply(_) => Ok(()),
            Outgoing::Error(e) => bail!("acceptor error: {}", e.message),
        }
    }

    /// Closes the queue and waits for the acceptor to flush and exit.
    pub async fn close(mut self) -> anyhow::Result<()> {
        drop(self.tx.take());
        let task = self.task.take().context("closed twice")?;
        // Keep draining so the acceptor never blocks on a full reply queue.
        let drain = async { while self.replies.recv().await.is_some() {} };
        let (joined, ()) = tokio::join!(task, drain);
        joined.context("acceptor task")
    }
}

/// A CPU profile sampling the whole process at [`PROFILE_HZ`] while it lives (dropped: stops,
/// report discarded). The overhead being measured is the sampling itself.
pub struct CpuProfile(#[allow(dead_code)] pprof::ProfilerGuard<'static>);

impl CpuProfile {
    /// Starts sampling.
    pub fn start() -> anyhow::Result<CpuProfile> {
        let guard = pprof::ProfilerGuardBuilder::default()
            .frequency(PROFILE_HZ)
            .build()
            .context("starting the CPU profiler")?;
        Ok(CpuProfile(guard))
    }
}

/// A multi-threaded tokio runtime with 2 workers (the machine has 2 cores).
pub fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}
