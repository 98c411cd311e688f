//! End to end over loopback TCP: in-process daemons (`safekeeper::daemon::{bind, run}`, the real
//! PostgreSQL-protocol listener and WAL service) and the real protocol-v3 proposer
//! (`proposer::Proposer`, elected over all of them, quorum commit) pushing generated WAL with
//! `proposer::synthetic::run`. Every iteration starts fresh daemons and a fresh election
//! (untimed); the time is from the first push to the quorum commit of the last byte.
//!
//! - `e2e/safekeepers={1,3}/size={1024,131072}`: throughput, records of `size` payload bytes,
//!   128 KiB appends, up to 32 MiB in flight; `min($WAL_BENCH_VOLUME, 256 MiB)` per iteration.
//!   Throughput: WAL bytes.
//! - `e2e_commit/safekeepers={1,3}/size=8192`: single stream: one ~8 KiB append (one record)
//!   at a time, the next only after the previous is committed (window 0). Throughput: commits.
//! - `e2e_tls/tls={off,on}/size=131072` and `e2e_tls_commit/tls={off,on}/size=8192`: the same
//!   with one safekeeper, over plain TCP and over TLS (rustls, `--sslmode require`), in the
//!   same run: the ratio is what TLS costs ingest.
//! - `e2e_backup/backup={off,on,on+partial=1s}/size=131072`: 3 safekeepers, 128 KiB pipelined,
//!   without and with `--remote-storage file://` (backup of complete segments beside the data
//!   directory, or under `$WAL_BENCH_BACKUP_DIR`; partial-segment backup off, then with
//!   `--partial-backup-timeout 1s` and `--eviction-min-idle 2s`), in the same run: the ratios are
//!   what WAL backup, and then partial-segment backup and eviction, cost ingest.
//! - `echo_rtt/size=8192`: the physical limit beside the commits: one round trip to a
//!   zero-cost echo peer in another process (`src/bin/echo-peer.rs`): an 8 KiB frame out, a
//!   64-byte reply back, blocking I/O on both ends. Throughput: round trips. One end-to-end
//!   commit cannot beat one of these plus one `fdatasync`.
//! - `e2e_connect/{plain,tls,jwt,tls+jwt}`: connection set-up: TCP connect, TLS handshake,
//!   startup and authentication (a JWT checked against an Ed25519 key) until ReadyForQuery.
//!   Throughput: connections.

#![allow(
    missing_docs,
    reason = "criterion_group! defines an undocumented `pub fn benches`"
)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use safekeeper::config::Conf;
use tokio::runtime::Runtime;
use wal_bench::{Daemon, KIB, ServerCert, proposer_config, single_commits, temp_dir, ttid, volume};
use walproposer::Proposer;
use walproposer::synthetic::{self, SyntheticOptions};

profiling::global_allocator!();

/// A CA-less self-signed certificate and an Ed25519 JWT key pair made by the `openssl` CLI.
struct Secrets {
    _dir: tempfile::TempDir,
    tls: ServerCert,
    jwt_public: PathBuf,
    token: String,
}

fn openssl(args: &[&str]) {
    wal_bench::openssl(args).expect("openssl");
}

fn secrets() -> Secrets {
    let dir = temp_dir().expect("bench dir");
    let p = |n: &str| dir.path().join(n);
    let (jwt_key, jwt_public) = (p("jwt.key"), p("jwt.pub"));
    let s = |p: &PathBuf| p.to_str().expect("UTF-8 path").to_string();
    let tls = wal_bench::self_signed_cert(dir.path()).expect("TLS certificate");
    openssl(&["genpkey", "-algorithm", "ed25519", "-out", &s(&jwt_key)]);
    openssl(&[
        "pkey",
        "-in",
        &s(&jwt_key),
        "-pubout",
        "-out",
        &s(&jwt_public),
    ]);
    let signing = jsonwebtoken::EncodingKey::from_ed_pem(&std::fs::read(&jwt_key).expect("key"))
        .expect("Ed25519 key");
    let token = jsonwebtoken::encode(
        &jsonwebtoken::Header::new(jsonwebtoken::Algorithm::EdDSA),
        &serde_json::json!({"scope": "safekeeperdata"}),
        &signing,
    )
    .expect("token");
    Secrets {
        _dir: dir,
        tls,
        jwt_public,
        token,
    }
}

/// How a bench daemon and its clients talk.
#[derive(Clone, Copy, PartialEq)]
struct Security {
    tls: bool,
    jwt: bool,
    /// WAL backup to a `file://` store beside the data directory (issue 19).
    backup: bool,
    /// With `backup`: `--partial-backup-timeout` and `--eviction-min-idle` (issue 30; zero:
    /// both off).
    partial: Duration,
}

const PLAIN: Security = Security {
    tls: false,
    jwt: false,
    backup: false,
    partial: Duration::ZERO,
};

/// `store`: the `file://` remote storage the run's nodes share (with `sec.backup`).
async fn start_daemon(
    datadir: &Path,
    id: u64,
    sec: Security,
    secrets: &Secrets,
    store: Option<&Path>,
) -> Daemon {
    let mut conf = Conf::for_tests(datadir.to_path_buf());
    conf.id = Some(id);
    if sec.jwt {
        conf.auth_public_key_path = Some(secrets.jwt_public.clone());
    }
    if let Some(store) = store {
        conf.remote_storage = Some(format!("file://{}", store.display()));
        conf.partial_backup_timeout = sec.partial;
        conf.eviction_min_idle = sec.partial * 2;
    }
    let tls = sec.tls.then_some(&secrets.tls);
    Daemon::start(conf, sec.jwt.then(|| secrets.token.clone()), tls)
        .await
        .expect("daemon")
}

/// Starts `n` fresh daemons, elects a proposer over them, runs `opts`; returns the time from
/// the first push to the commit of the last byte.
fn run_once(
    rt: &Runtime,
    n: u64,
    opts: &SyntheticOptions,
    sec: Security,
    secrets: &Secrets,
) -> Duration {
    let dirs: Vec<_> = (0..n).map(|_| temp_dir().expect("bench dir")).collect();
    // One store shared by the nodes, as in a deployment: each segment is uploaded once and
    // verified by the others. `WAL_BENCH_BACKUP_DIR` puts it elsewhere (e.g. /dev/shm: what an
    // object store on another machine costs this one, without a second local write of every
    // byte on the WAL's disk).
    let store = sec
        .backup
        .then(|| match std::env::var_os("WAL_BENCH_BACKUP_DIR") {
            Some(d) => tempfile::tempdir_in(d).expect("bench store dir"),
            None => temp_dir().expect("bench store dir"),
        });
    rt.block_on(async {
        let mut daemons = Vec::new();
        for (i, d) in dirs.iter().enumerate() {
            let store = store.as_ref().map(|s| s.path());
            daemons.push(start_daemon(d.path(), i as u64 + 1, sec, secrets, store).await);
        }
        let cfg = proposer_config(daemons.iter().map(|d| d.addr.clone()).collect());
        let proposer = Proposer::elect(cfg).await.expect("election");
        let stats = synthetic::run(&proposer, opts)
            .await
            .expect("synthetic WAL");
        proposer.finish(Duration::from_secs(5)).await;
        for d in daemons {
            d.stop().await.expect("daemon");
        }
        Duration::from_secs_f64(stats.seconds)
    })
}

/// Ingest of `total` bytes in records of `size`, pipelined.
fn ingest_opts(size: usize, total: u64) -> SyntheticOptions {
    SyntheticOptions {
        record_size: size,
        total_bytes: total,
        rate: None,
        chunk_bytes: 128 * KIB,
        window: 32 << 20,
    }
}

/// `iters` whole runs of `opts`, one after the other.
fn run_times(
    iters: u64,
    rt: &Runtime,
    n: u64,
    opts: &SyntheticOptions,
    sec: Security,
    secrets: &Secrets,
) -> Duration {
    (0..iters)
        .map(|_| run_once(rt, n, opts, sec, secrets))
        .sum()
}

/// The echo peer process; killed when dropped.
struct EchoPeer {
    child: std::process::Child,
    port: u16,
}

impl EchoPeer {
    fn start() -> EchoPeer {
        use std::io::BufRead;
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_echo-peer"))
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("starting echo-peer");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("echo-peer's port");
        let port = line.trim().parse().expect("a port number");
        EchoPeer { child, port }
    }
}

impl Drop for EchoPeer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Round trips to a zero-cost peer in another process: the loopback part of a commit's limit.
fn echo_rtt(c: &mut Criterion) {
    use std::io::{Read, Write};
    let peer = EchoPeer::start();
    let mut s = std::net::TcpStream::connect(("127.0.0.1", peer.port)).expect("connect");
    s.set_nodelay(true).expect("nodelay");
    let size = 8 * KIB;
    let mut frame = (size as u32).to_be_bytes().to_vec();
    frame.resize(4 + size, b'x');
    let mut reply = [0u8; 64];
    let mut g = c.benchmark_group("echo_rtt");
    g.throughput(Throughput::Elements(1));
    g.bench_function(format!("size={size}"), |b| {
        b.iter(|| {
            s.write_all(&frame).expect("write");
            s.read_exact(&mut reply).expect("read");
        })
    });
    g.finish();
}

fn e2e(c: &mut Criterion) {
    // The proposer's runtime, as the walproposer binary's: one thread (see its docs). Each
    // daemon's WAL connections run on threads of their own. WAL_BENCH_PROPOSER_RUNTIME=multi
    // gives it 2 worker threads instead (what that hand-off costs a commit).
    let rt = if std::env::var("WAL_BENCH_PROPOSER_RUNTIME").as_deref() == Ok("multi") {
        wal_bench::runtime()
    } else {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
    };
    let secrets = secrets();
    let secrets = &secrets;
    let total = volume().min(256 << 20);
    let mut g = c.benchmark_group("e2e");
    // Long iterations: the same count per sample (10 in all) instead of 1+2+..+10.
    g.sampling_mode(SamplingMode::Flat);
    for n in [1, 3] {
        for size in [KIB, 128 * KIB] {
            let opts = ingest_opts(size, total);
            g.throughput(Throughput::Bytes(total));
            g.bench_function(
                BenchmarkId::new(format!("safekeepers={n}"), format!("size={size}")),
                |b| b.iter_custom(|iters| run_times(iters, &rt, n, &opts, PLAIN, secrets)),
            );
        }
    }
    g.finish();

    let mut g = c.benchmark_group("e2e_commit");
    // Long iterations: the same count per sample (10 in all) instead of 1+2+..+10.
    g.sampling_mode(SamplingMode::Flat);
    let size = 8 * KIB;
    g.throughput(Throughput::Elements(1));
    for n in [1, 3] {
        g.bench_function(
            BenchmarkId::new(format!("safekeepers={n}"), format!("size={size}")),
            |b| {
                // One iteration = one commit (`single_commits`: one record per append).
                b.iter_custom(|iters| {
                    run_once(&rt, n, &single_commits(size, iters), PLAIN, secrets)
                })
            },
        );
    }
    g.finish();

    // TLS against plain TCP, one safekeeper, same run.
    let tls_modes = [
        ("off", PLAIN),
        (
            "on",
            Security {
                tls: true,
                jwt: false,
                ..PLAIN
            },
        ),
    ];
    let mut g = c.benchmark_group("e2e_tls");
    g.sampling_mode(SamplingMode::Flat);
    let size = 128 * KIB;
    let opts = ingest_opts(size, total);
    g.throughput(Throughput::Bytes(total));
    for (name, sec) in tls_modes {
        g.bench_function(
            BenchmarkId::new(format!("tls={name}"), format!("size={size}")),
            |b| b.iter_custom(|iters| run_times(iters, &rt, 1, &opts, sec, secrets)),
        );
    }
    g.finish();
    // WAL backup on against off (file:// store on the same disk), 3 safekeepers, same run: the
    // ratio is what backup costs ingest.
    let mut g = c.benchmark_group("e2e_backup");
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(Throughput::Bytes(total));
    for (name, backup, partial) in [
        ("off", false, Duration::ZERO),
        ("on", true, Duration::ZERO),
        ("on+partial=1s", true, Duration::from_secs(1)),
    ] {
        let sec = Security {
            backup,
            partial,
            ..PLAIN
        };
        g.bench_function(
            BenchmarkId::new(format!("backup={name}"), format!("size={size}")),
            |b| b.iter_custom(|iters| run_times(iters, &rt, 3, &opts, sec, secrets)),
        );
    }
    g.finish();

    let mut g = c.benchmark_group("e2e_tls_commit");
    g.sampling_mode(SamplingMode::Flat);
    let size = 8 * KIB;
    g.throughput(Throughput::Elements(1));
    for (name, sec) in tls_modes {
        g.bench_function(
            BenchmarkId::new(format!("tls={name}"), format!("size={size}")),
            |b| b.iter_custom(|iters| run_once(&rt, 1, &single_commits(size, iters), sec, secrets)),
        );
    }
    g.finish();

    // Connection set-up: connect, TLS, startup, authentication, until ReadyForQuery.
    let mut g = c.benchmark_group("e2e_connect");
    g.throughput(Throughput::Elements(1));
    for (name, sec) in [
        ("plain", PLAIN),
        (
            "tls",
            Security {
                tls: true,
                jwt: false,
                ..PLAIN
            },
        ),
        (
            "jwt",
            Security {
                tls: false,
                jwt: true,
                ..PLAIN
            },
        ),
        (
            "tls+jwt",
            Security {
                tls: true,
                jwt: true,
                ..PLAIN
            },
        ),
    ] {
        let dir = temp_dir().expect("bench dir");
        let d = rt.block_on(start_daemon(dir.path(), 1, sec, secrets, None));
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                rt.block_on(async {
                    let started = std::time::Instant::now();
                    for _ in 0..iters {
                        let c = d.addr.connect(ttid(), "bench").await.expect("connect");
                        drop(c);
                    }
                    started.elapsed()
                })
            })
        });
        rt.block_on(d.stop()).expect("daemon");
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = wal_bench::criterion();
    targets = echo_rtt, e2e
}
criterion_main!(benches);
