//! many-timelines: one process driving many timelines through one safekeeper, each with its own
//! elected proposer (protocol v3, the real [`Proposer`]) and its own connection. Thin: flags,
//! tracing, then the loop below.
//!
//! - Populate (`--seconds 0`): create `--timelines` timelines, each with one commit of
//!   `--commit-size` bytes of WAL, `--concurrency` at a time, then disconnect.
//! - Bench (`--seconds S`): elect all of them (they stay connected), then every timeline commits
//!   `--commit-size` bytes `--rate` times a second (one at a time, waiting for each commit) for
//!   `S` seconds; prints commit latency p50/p99/max over all commits and, with
//!   `--safekeeper-pid`, the daemon's CPU and RSS over the measured window, as one JSON line.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use clap::Parser;
use pg_wal::generator::WalGenerator;
use sk_core::types::{Lsn, TenantId, TenantTimelineId, TimelineId};
use tokio::sync::{Barrier, Semaphore};
use walproposer::conn::SafekeeperAddr;
use walproposer::{Proposer, ProposerConfig};

profiling::global_allocator!();

/// Drives many timelines through one safekeeper (populate or bench).
#[derive(Parser, Debug)]
struct Args {
    /// The safekeeper's PostgreSQL-protocol address (`host:port`).
    #[arg(long)]
    safekeeper: String,
    /// Tenant id (32 hex characters); timeline `i` is `i + 1` in hex.
    #[arg(long, default_value = "de200bd42b49cc1814412c7e592dd6e9")]
    tenant_id: TenantId,
    /// How many timelines.
    #[arg(long, default_value_t = 1000)]
    timelines: u32,
    /// The first timeline's index (timelines `first..first + timelines`).
    #[arg(long, default_value_t = 0)]
    first: u32,
    /// Bytes of WAL per commit (one record).
    #[arg(long, default_value_t = 8192)]
    commit_size: usize,
    /// Commits per second per timeline (bench).
    #[arg(long, default_value_t = 10.0)]
    rate: f64,
    /// Measured seconds of the bench; 0: populate (one commit per timeline, then disconnect).
    #[arg(long, default_value_t = 0.0)]
    seconds: f64,
    /// Elections (and, populating, whole timelines) in progress at once.
    #[arg(long, default_value_t = 32)]
    concurrency: usize,
    /// WAL segment size of new timelines.
    #[arg(long, default_value_t = 16 << 20)]
    wal_seg_size: u32,
    /// The safekeeper's pid: report its CPU time and RSS over the measured window.
    #[arg(long)]
    safekeeper_pid: Option<u32>,
}

/// CPU seconds (user + system) and RSS bytes of process `pid`, from /proc.
fn proc_usage(pid: u32) -> anyhow::Result<(f64, u64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name (which may hold spaces) start at state, field 3.
    let rest = stat.rsplit_once(')').context("/proc/PID/stat format")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rss_kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .context("VmRSS")?
        .parse()?;
    Ok((ticks / hz, rss_kib * 1024))
}

/// Raises the soft open-files limit to the hard one: the bench holds a connection per timeline.
fn raise_open_files_limit() {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read/write one `rlimit` through a valid pointer.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 && lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &lim);
        }
    }
}

/// An elected proposer and a generator positioned at its end of WAL.
struct Timeline {
    proposer: Proposer,
    generator: WalGenerator,
}

async fn elect(args: &Args, addr: &SafekeeperAddr, i: u32) -> anyhow::Result<Timeline> {
    let mut id = [0u8; 16];
    id[12..].copy_from_slice(&(args.first + i + 1).to_be_bytes());
    let cfg = ProposerConfig {
        safekeepers: vec![addr.clone()],
        ttid: TenantTimelineId {
            tenant_id: args.tenant_id,
            timeline_id: TimelineId(id),
        },
        system_id: 7_400_000_000_000_000_001,
        pg_version: 150018,
        wal_seg_size: args.wal_seg_size,
        start_lsn: Lsn(args.wal_seg_size as u64),
        allow_timeline_creation: true,
        max_replication_flush_lag: 0,
        max_replication_apply_lag: 0,
    };
    let proposer = Proposer::elect(cfg)
        .await
        .with_context(|| format!("electing timeline {i}"))?;
    let prev = proposer.prev_record_start().await?;
    let generator = WalGenerator::new(
        proposer.system_id(),
        proposer.wal_seg_size() as u64,
        proposer.term_start_lsn(),
    )
    .map_err(|e| anyhow::anyhow!("generator: {e}"))?
    .with_prev(prev);
    Ok(Timeline {
        proposer,
        generator,
    })
}

impl Timeline {
    /// Pushes one record of about `size` bytes of WAL and waits for its commit.
    async fn commit(&mut self, size: usize, payload: &[u8]) -> anyhow::Result<Duration> {
        let at = self.generator.lsn();
        let mut buf = Vec::with_capacity(size + 8192);
        self.generator.fill(&mut buf, size, payload);
        let end = self.generator.lsn();
        let t = Instant::now();
        self.proposer.push(at, Bytes::from(buf))?;
        self.proposer.wait_commit(end).await?;
        Ok(t.elapsed())
    }
}

/// Elections tried per timeline before the bench gives up on it.
const ELECTION_TRIES: usize = 5;

/// What every timeline's task shares.
struct Ctx {
    args: Arc<Args>,
    addr: SafekeeperAddr,
    payload: Arc<[u8]>,
    /// Elections (and, populating, whole timelines) in progress at once.
    elections: Semaphore,
}

fn percentile(sorted: &[Duration], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    sorted[i].as_secs_f64() * 1000.0
}

async fn run(args: Args) -> anyhow::Result<()> {
    let args = Arc::new(args);
    let addr = SafekeeperAddr::parse(&args.safekeeper).map_err(anyhow::Error::msg)?;
    // A record of `commit_size - 60` payload bytes is just over `commit_size` bytes of WAL, so
    // each commit is one record (as e2e_commit).
    let payload: Arc<[u8]> = vec![b'x'; args.commit_size.saturating_sub(60).max(1)].into();
    let n = args.timelines as usize;
    let elections = Semaphore::new(args.concurrency.max(1));
    let ctx = Arc::new(Ctx {
        args: args.clone(),
        addr,
        payload,
        elections,
    });
    let started = Instant::now();
    if args.seconds <= 0.0 {
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..args.timelines {
            let ctx = ctx.clone();
            tasks.spawn(async move {
                let _permit = ctx.elections.acquire().await.expect("semaphore open");
                let mut tl = elect(&ctx.args, &ctx.addr, i).await?;
                tl.commit(ctx.args.commit_size, &ctx.payload).await?;
                tl.proposer.finish(Duration::from_secs(10)).await;
                anyhow::Ok(())
            });
        }
        while let Some(r) = tasks.join_next().await {
            r??;
        }
        let secs = started.elapsed().as_secs_f64();
        println!(
            "{}",
            serde_json::json!({"timelines": n, "populate_seconds": secs})
        );
        return Ok(());
    }

    let measure_start = Arc::new(Barrier::new(n + 1));
    let latencies: Arc<Mutex<Vec<Duration>>> = Arc::default();
    let errors = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let window = Duration::from_secs_f64(args.seconds);
    let period = Duration::from_secs_f64(1.0 / args.rate);
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..args.timelines {
        let ctx = ctx.clone();
        let (barrier, latencies, errors) =
            (measure_start.clone(), latencies.clone(), errors.clone());
        tasks.spawn(async move {
            let (args, payload) = (&ctx.args, &ctx.payload);
            let permit = ctx.elections.acquire().await.expect("semaphore open");
            // Creating a timeline fsyncs several times under one lock: with hundreds waiting
            // on a busy disk an election can time out; the timeline exists by the next try.
            let mut elected = elect(args, &ctx.addr, i).await;
            for _ in 1..ELECTION_TRIES {
                if elected.is_ok() {
                    break;
                }
                elected = elect(args, &ctx.addr, i).await;
            }
            drop(permit);
            barrier.wait().await;
            let mut tl = elected?;
            // Spread the timelines' commits over the period.
            let t0 = Instant::now() + period.mul_f64(i as f64 / args.timelines as f64);
            let mut mine = Vec::new();
            let mut k = 0u32;
            loop {
                let due = t0 + period * k;
                if due >= t0 + window {
                    break;
                }
                tokio::time::sleep_until(due.into()).await;
                match tl.commit(args.commit_size, payload).await {
                    Ok(d) => mine.push(d),
                    Err(e) => {
                        errors.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        return Err(e);
                    }
                }
                k += 1;
            }
            latencies.lock().expect("latencies").extend(mine);
            tl.proposer.finish(Duration::from_secs(10)).await;
            anyhow::Ok(())
        });
    }
    measure_start.wait().await;
    let elect_seconds = started.elapsed().as_secs_f64();
    let before = args.safekeeper_pid.map(proc_usage).transpose()?;
    let t = Instant::now();
    // The window ends when the last timeline's last commit is due (+ its spread offset).
    tokio::time::sleep(window + period).await;
    let measured = t.elapsed().as_secs_f64();
    let after = args.safekeeper_pid.map(proc_usage).transpose()?;
    let mut failed = 0;
    while let Some(r) = tasks.join_next().await {
        if let Err(e) = r? {
            tracing::error!("{e:#}");
            failed += 1;
        }
    }
    let mut l = latencies.lock().expect("latencies").clone();
    l.sort();
    let mut out = serde_json::json!({
        "timelines": n,
        "rate_per_timeline": args.rate,
        "commit_size": args.commit_size,
        "elect_seconds": elect_seconds,
        "seconds": measured,
        "commits": l.len(),
        "commits_per_second": l.len() as f64 / measured,
        "errors": errors.load(std::sync::atomic::Ordering::Relaxed),
        "failed_timelines": failed,
        "commit_p50_ms": percentile(&l, 0.5),
        "commit_p99_ms": percentile(&l, 0.99),
        "commit_max_ms": percentile(&l, 1.0),
    });
    if let (Some((cpu0, _)), Some((cpu1, rss))) = (before, after) {
        out["safekeeper_cpu_percent"] = ((cpu1 - cpu0) / measured * 100.0).into();
        out["safekeeper_rss_mib"] = (rss as f64 / (1 << 20) as f64).into();
    }
    println!("{out}");
    Ok(())
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    raise_open_files_limit();
    if let Err(e) = run(Args::parse()).await {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}
