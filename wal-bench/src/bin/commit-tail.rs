//! Commit latency by percentile, beside the physical limits measured the same way: every
//! sample is kept, so the tail (p99, max) is seen, not only Criterion's mean.
//!
//! - `commit-tail disk --dir D [--files 2]`: 8 KiB `pwrite` + `fdatasync` at consecutive
//!   offsets of a preallocated file on the disk under test (with `--files 2`, two files by two
//!   threads at once, a round ending when both are synced: the floor of a 2-of-3 quorum whose
//!   nodes share one disk).
//! - `commit-tail echo`: one 8 KiB frame to a zero-cost echo peer in another process
//!   (`echo-peer`, beside this binary) and its 64-byte reply: the loopback round trip.
//! - `commit-tail commit --safekeeper HOST:PORT ...`: the independent protocol-v3 client
//!   (`wal_bench::raw_client`) commits one ~8 KiB record at a time on a new timeline, each
//!   after the previous one's majority flush.
//!
//! Each prints one JSON object (n, mean, p50, p90, p99, p99.9, max in µs, rate by the mean).

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, ensure};
use clap::{Parser, Subcommand};
use sk_core::types::{TenantId, TenantTimelineId, TimelineId};
use wal_bench::raw_client::{Tail, commit_latencies, micros};

profiling::global_allocator!();

#[derive(Parser)]
#[command(about = "Commit latency percentiles beside the disk's and the loopback's own")]
struct Args {
    #[command(subcommand)]
    what: What,
    /// Samples to keep.
    #[arg(long, default_value_t = 5000, global = true)]
    samples: usize,
    /// Samples first run and dropped.
    #[arg(long, default_value_t = 200, global = true)]
    warm_up: usize,
    /// Bytes per write, frame or commit.
    #[arg(long, default_value_t = 8192, global = true)]
    size: usize,
    /// Also write every kept sample (µs, in order, one per line) to this file: where in the run
    /// the slow ones fall.
    #[arg(long, global = true)]
    dump: Option<PathBuf>,
}

#[derive(Subcommand)]
enum What {
    /// pwrite + fdatasync on preallocated files in DIR.
    Disk {
        /// Directory on the disk under test.
        #[arg(long)]
        dir: PathBuf,
        /// Files written and synced at once, one thread each.
        #[arg(long, default_value_t = 1)]
        files: usize,
    },
    /// Round trips to a zero-cost echo peer in another process.
    Echo,
    /// Commits through the safekeepers (a majority of them per commit).
    Commit {
        /// A safekeeper's PostgreSQL port (repeat for each).
        #[arg(long = "safekeeper", required = true)]
        safekeepers: Vec<SocketAddr>,
    },
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let total = args.warm_up + args.samples;
    let (name, samples) = match &args.what {
        What::Disk { dir, files } => (
            format!("disk/files={files}"),
            disk(dir, *files, args.size, total)?,
        ),
        What::Echo => ("echo".to_string(), echo(args.size, total)?),
        What::Commit { safekeepers } => {
            let samples = commit_latencies(safekeepers, fresh_ttid(), args.size, total)?;
            (format!("commit/safekeepers={}", safekeepers.len()), samples)
        }
    };
    // The first `--warm-up` samples of every measurement are dropped.
    let kept = &samples[samples.len().saturating_sub(args.samples)..];
    let tail = Tail::of(kept).context("no samples")?;
    if let Some(path) = &args.dump {
        let lines: String = kept
            .iter()
            .map(|&d| format!("{:.1}\n", micros(d)))
            .collect();
        std::fs::write(path, lines).with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{}", tail.json(&name));
    Ok(())
}

/// A timeline no earlier run created: the commit client elects itself on a fresh one.
fn fresh_ttid() -> TenantTimelineId {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    let mut timeline = [0u8; 16];
    timeline.copy_from_slice(&nanos.to_be_bytes());
    TenantTimelineId {
        tenant_id: TenantId([0x7a; 16]),
        timeline_id: TimelineId(timeline),
    }
}

/// `rounds` rounds of one `size`-byte write + fdatasync on each of `files` preallocated files
/// at once.
fn disk(dir: &Path, files: usize, size: usize, rounds: usize) -> anyhow::Result<Vec<Duration>> {
    ensure!(files >= 1, "--files must be at least 1");
    let len = (size * rounds) as u64;
    let mut handles = Vec::new();
    for i in 0..files {
        let path = dir.join(format!("commit-tail-{}-{i}", std::process::id()));
        let f = OpenOptions::new()
            .create(true)
            .truncate(true)
            .read(true)
            .write(true)
            .open(&path)
            .with_context(|| format!("creating {}", path.display()))?;
        // Preallocated and written once, as a recycled WAL segment is: the loop below
        // measures data syncs, not block allocation.
        let zeros = vec![0u8; 1 << 20];
        let mut off = 0;
        while off < len {
            f.write_all_at(&zeros, off)?;
            off += zeros.len() as u64;
        }
        f.sync_all()?;
        std::fs::remove_file(&path)?;
        handles.push(f);
    }
    let start = Arc::new(Barrier::new(files + 1));
    let done = Arc::new(Barrier::new(files + 1));
    let mut threads = Vec::new();
    for f in handles {
        let (start, done) = (start.clone(), done.clone());
        threads.push(std::thread::spawn(move || -> std::io::Result<()> {
            let buf = vec![0x5au8; size];
            let mut first_error = None;
            for r in 0..rounds {
                start.wait();
                let res = f
                    .write_all_at(&buf, (r * size) as u64)
                    .and_then(|()| f.sync_data());
                // Every round is joined, even after an error: the others wait at the barrier.
                done.wait();
                if let Err(e) = res {
                    first_error.get_or_insert(e);
                }
            }
            first_error.map_or(Ok(()), Err)
        }));
    }
    let mut out = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        start.wait();
        done.wait();
        out.push(t.elapsed());
    }
    for t in threads {
        t.join().expect("disk thread")?;
    }
    Ok(out)
}

/// `rounds` round trips of a `size`-byte frame to `echo-peer`.
fn echo(size: usize, rounds: usize) -> anyhow::Result<Vec<Duration>> {
    let exe = std::env::current_exe()?;
    let peer = exe.with_file_name("echo-peer");
    let mut child = Command::new(&peer)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {} (cargo build -p wal-bench)", peer.display()))?;
    let mut line = String::new();
    BufReader::new(child.stdout.take().context("echo-peer stdout")?).read_line(&mut line)?;
    let port: u16 = line.trim().parse().context("echo-peer's port")?;
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    s.set_nodelay(true)?;
    let mut frame = (size as u32).to_be_bytes().to_vec();
    frame.resize(4 + size, 0x5a);
    let mut reply = [0u8; 64];
    let mut out = Vec::with_capacity(rounds);
    for _ in 0..rounds {
        let t = Instant::now();
        s.write_all(&frame)?;
        s.read_exact(&mut reply)?;
        out.push(t.elapsed());
    }
    drop(child.stdin.take());
    let _ = child.wait();
    Ok(out)
}
