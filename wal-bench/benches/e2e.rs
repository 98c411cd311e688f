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

#![allow(
    missing_docs,
    reason = "criterion_group! defines an undocumented `pub fn benches`"
)]

use std::path::Path;
use std::time::Duration;

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use safekeeper::config::Conf;
use safekeeper::daemon;
use tokio::runtime::Runtime;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use wal_bench::{KIB, SEG_SIZE, START, SYSID, runtime, temp_dir, ttid, volume};
use walproposer::conn::SafekeeperAddr;
use walproposer::synthetic::{self, SyntheticOptions};
use walproposer::{Proposer, ProposerConfig};

profiling::global_allocator!();

/// A daemon running inside the bench process.
struct Daemon {
    addr: SafekeeperAddr,
    stop: oneshot::Sender<()>,
    task: JoinHandle<anyhow::Result<()>>,
}

async fn start_daemon(datadir: &Path, id: u64) -> Daemon {
    let mut conf = Conf::for_tests(datadir.to_path_buf());
    conf.id = id;
    let listeners = daemon::bind(&conf).await.expect("bind");
    let addr = SafekeeperAddr {
        host: "127.0.0.1".into(),
        port: listeners.pg_addr().port(),
        password: None,
    };
    let (stop, rx) = oneshot::channel();
    let task = tokio::spawn(daemon::run(conf, listeners, async move {
        let _ = rx.await;
    }));
    Daemon { addr, stop, task }
}

/// Starts `n` fresh daemons, elects a proposer over them, runs `opts`; returns the time from
/// the first push to the commit of the last byte.
fn run_once(rt: &Runtime, n: u64, opts: &SyntheticOptions) -> Duration {
    let dirs: Vec<_> = (0..n).map(|_| temp_dir().expect("bench dir")).collect();
    rt.block_on(async {
        let mut daemons = Vec::new();
        for (i, d) in dirs.iter().enumerate() {
            daemons.push(start_daemon(d.path(), i as u64 + 1).await);
        }
        let cfg = ProposerConfig {
            safekeepers: daemons.iter().map(|d| d.addr.clone()).collect(),
            ttid: ttid(),
            system_id: SYSID,
            pg_version: 150018,
            wal_seg_size: SEG_SIZE as u32,
            start_lsn: START,
            allow_timeline_creation: true,
        };
        let proposer = Proposer::elect(cfg).await.expect("election");
        let stats = synthetic::run(&proposer, opts)
            .await
            .expect("synthetic WAL");
        proposer.finish(Duration::from_secs(5)).await;
        for d in daemons {
            let _ = d.stop.send(());
            d.task.await.expect("daemon task").expect("daemon");
        }
        Duration::from_secs_f64(stats.seconds)
    })
}

fn e2e(c: &mut Criterion) {
    let rt = runtime();
    let total = volume().min(256 << 20);
    let mut g = c.benchmark_group("e2e");
    // Long iterations: the same count per sample (10 in all) instead of 1+2+..+10.
    g.sampling_mode(SamplingMode::Flat);
    for n in [1, 3] {
        for size in [KIB, 128 * KIB] {
            let opts = SyntheticOptions {
                record_size: size,
                total_bytes: total,
                rate: None,
                chunk_bytes: 128 * KIB,
                window: 32 << 20,
            };
            g.throughput(Throughput::Bytes(total));
            g.bench_function(
                BenchmarkId::new(format!("safekeepers={n}"), format!("size={size}")),
                |b| b.iter_custom(|iters| (0..iters).map(|_| run_once(&rt, n, &opts)).sum()),
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
                // One iteration = one commit: `iters` appends of one record each (a record of
                // 8192 - 60 payload bytes is just over 8 KiB of WAL, so each 8 KiB chunk the
                // synthetic source asks for is exactly one record).
                b.iter_custom(|iters| {
                    let opts = SyntheticOptions {
                        record_size: size - 60,
                        total_bytes: iters * size as u64,
                        rate: None,
                        chunk_bytes: size,
                        window: 0,
                    };
                    run_once(&rt, n, &opts)
                })
            },
        );
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = wal_bench::criterion();
    targets = e2e
}
criterion_main!(benches);
