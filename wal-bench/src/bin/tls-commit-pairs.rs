//! What TLS costs a single commit, measured in back-to-back pairs: each pair runs the same
//! number of single 8 KiB commits over plain TCP and then over TLS, each against a fresh
//! in-process safekeeper (one, as `e2e_tls_commit` does) with a fresh data directory, and
//! prints both per-commit times and their ratio. Drift of the disk and of the host between
//! pairs then touches both halves of a pair alike, which a Criterion group, one mode after
//! the other, cannot promise.
//!
//! ```sh
//! cargo run --release -p wal-bench --bin tls-commit-pairs -- --pairs 12 --commits 3000
//! # CPU only: no fdatasync, everything on one vCPU
//! taskset -c 1 target/release/tls-commit-pairs --no-sync
//! # one mode only, for counters of that mode alone (CPU time, context switches, syscalls)
//! perf stat -e task-clock,context-switches,cpu-migrations \
//!     target/release/tls-commit-pairs --only tls --pairs 2
//! strace -f -c target/release/tls-commit-pairs --only plain --pairs 1 --commits 2000
//! ```
//!
//! Output: one line per pair (`plain_us tls_us ratio`; with `--only`, one line per run), then
//! the mean, smallest and largest ratio and the mean time TLS adds. Data directories go under `$WAL_BENCH_DIR` (see
//! `wal_bench::bench_dir`), on the disk under test.

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Parser;
use safekeeper::config::Conf;
use wal_bench::{Daemon, ServerCert};
use walproposer::Proposer;
use walproposer::synthetic;

profiling::global_allocator!();

#[derive(Parser)]
#[command(about = "Single-commit latency over plain TCP and TLS, in back-to-back pairs")]
struct Args {
    /// Pairs (plain, then TLS) to run.
    #[arg(long, default_value_t = 12)]
    pairs: u32,
    /// Single 8 KiB commits per run.
    #[arg(long, default_value_t = 3000)]
    commits: u64,
    /// Run the safekeeper with --no-sync (what TLS costs the CPU alone).
    #[arg(long)]
    no_sync: bool,
    /// Run one mode only, `--pairs` times (for counters of one mode: `perf stat`, `strace -c`).
    #[arg(long, value_enum)]
    only: Option<Mode>,
}

#[derive(Clone, Copy, PartialEq, clap::ValueEnum)]
enum Mode {
    Plain,
    Tls,
}

/// Bytes of WAL per commit (as `e2e_tls_commit`).
const COMMIT: usize = 8192;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // One thread, as the walproposer binary's runtime; the safekeeper's WAL connection runs on
    // a thread of its own.
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let secrets = wal_bench::temp_dir()?;
    let tls = wal_bench::self_signed_cert(secrets.path())?;
    if let Some(mode) = args.only {
        println!("{}_us", if mode == Mode::Tls { "tls" } else { "plain" });
        for _ in 0..args.pairs {
            let us = rt.block_on(per_commit((mode == Mode::Tls).then_some(&tls), &args))?;
            println!("{us:.1}");
        }
        return Ok(());
    }
    let mut ratios = Vec::new();
    let mut added = 0.0;
    println!("plain_us tls_us ratio");
    for _ in 0..args.pairs {
        let plain = rt.block_on(per_commit(None, &args))?;
        let over_tls = rt.block_on(per_commit(Some(&tls), &args))?;
        let ratio = plain / over_tls;
        println!("{plain:.1} {over_tls:.1} {ratio:.3}");
        ratios.push(ratio);
        added += over_tls - plain;
    }
    let n = ratios.len().max(1) as f64;
    let min = ratios.iter().copied().fold(f64::INFINITY, f64::min);
    let max = ratios.iter().copied().fold(0.0, f64::max);
    println!(
        "TLS ÷ plain commits/s: mean {:.3}, min {min:.3}, max {max:.3}; TLS adds {:.1} µs per commit",
        ratios.iter().sum::<f64>() / n,
        added / n
    );
    Ok(())
}

/// One run: a fresh safekeeper (TLS with `tls`: certificate and key), an elected proposer,
/// `args.commits` single commits; returns µs per commit.
async fn per_commit(tls: Option<&ServerCert>, args: &Args) -> anyhow::Result<f64> {
    let dir = wal_bench::temp_dir()?;
    let mut conf = Conf::for_tests(dir.path().to_path_buf());
    conf.no_sync = args.no_sync;
    let daemon = Daemon::start(conf, None, tls).await?;
    let proposer = Proposer::elect(wal_bench::proposer_config(vec![daemon.addr.clone()]))
        .await
        .context("election")?;
    let opts = wal_bench::single_commits(COMMIT, args.commits);
    let started = Instant::now();
    synthetic::run(&proposer, &opts).await?;
    let elapsed = started.elapsed();
    proposer.finish(Duration::from_secs(5)).await;
    daemon.stop().await?;
    Ok(elapsed.as_secs_f64() * 1e6 / args.commits as f64)
}
