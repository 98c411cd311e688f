//! The real `WalAcceptor` (bounded queue → blocking `process_msg` loop with one `fdatasync`
//! per drained batch → replies), driven without a socket.
//!
//! - `wal_acceptor/fsync={false,true}/n={1,100,10000}`: a pipelined batch of n small records
//!   (one 64-byte logical message per append), timed until the flush acknowledgement covers
//!   the last one. Throughput: elements (appends).
//! - `wal_acceptor_throughput/fsync=../commit=../size={1024,8192,131072,1048576}`:
//!   `$WAL_BENCH_VOLUME` bytes (default 1 GiB) of appends of one `size`-byte record each,
//!   through the real queue sizes into a fresh timeline, until the last flush ack. Throughput:
//!   payload bytes.
//! - `durable_commit/fsync=true/size=8192`: single stream, one 8 KiB record per append, each
//!   waiting for its flush ack before the next is sent (compare with `pg_test_fsync`).
//! - `heap_profile_ingest/fsync=false/size={8,8192,131072}`: ingest at the append sizes whose
//!   heap-profiling cost is reported (`scripts/bench-report` runs it under
//!   `MALLOC_CONF=prof:false` and with the default `prof:true`, same binary, alternated): what
//!   a proposer connection's thread runs, `process_msg` of every append then one flush, on one
//!   thread, so no wake-up noise hides allocation costs; `fsync=false`, so the disk does not
//!   either. 8-byte appends use 1/8 of `$WAL_BENCH_VOLUME` (one record each: ~64 WAL bytes).
//! - `cpu_profile/profiler={off,99hz}/fsync=false/size=131072`: the throughput bench with and
//!   without a 99 Hz CPU profile of the whole process running, side by side.

#![allow(
    missing_docs,
    reason = "criterion_group! defines an undocumented `pub fn benches`"
)]

use std::time::{Duration, Instant};

use criterion::{
    BenchmarkId, Criterion, SamplingMode, Throughput, criterion_group, criterion_main,
};
use sk_core::protocol::ProposerAcceptorMessage;
use tokio::runtime::Runtime;
use wal_bench::{Acceptor, CpuProfile, Env, KIB, MIB, Workload, runtime, volume};

profiling::global_allocator!();

/// Payload of the small records of `wal_acceptor`.
const SMALL: usize = 64;

fn wal_acceptor(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("wal_acceptor");
    for fsync in [false, true] {
        for n in [1u64, 100, 10_000] {
            g.throughput(Throughput::Elements(n));
            let mut env = Env::new(fsync).expect("bench env");
            let mut acceptor = rt.block_on(async { Acceptor::spawn(env.tl.clone()) });
            let payload = [b'x'; SMALL];
            g.bench_function(
                BenchmarkId::new(format!("fsync={fsync}"), format!("n={n}")),
                |b| {
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            let msgs: Vec<_> =
                                (0..n).map(|_| env.next_append(&payload, true)).collect();
                            let end = env.generator.lsn();
                            let t = Instant::now();
                            rt.block_on(async {
                                for m in msgs {
                                    acceptor.push(m).await.expect("push");
                                    acceptor.poll_replies().expect("reply");
                                }
                                acceptor.wait_flushed(end).await.expect("flush ack");
                            });
                            total += t.elapsed();
                        }
                        total
                    })
                },
            );
            rt.block_on(acceptor.close()).expect("close acceptor");
        }
    }
    g.finish();
}

/// Pushes the whole workload into a fresh timeline's acceptor; returns the time from the first
/// push to the flush ack of the last append.
fn push_volume(rt: &Runtime, w: &Workload, fsync: bool) -> Duration {
    let env = Env::new(fsync).expect("bench env");
    let (elapsed, acceptor) = rt.block_on(async {
        let mut acceptor = Acceptor::spawn(env.tl.clone());
        let t = Instant::now();
        for m in &w.msgs {
            acceptor.push(m.clone()).await.expect("push");
            acceptor.poll_replies().expect("reply");
        }
        acceptor.wait_flushed(w.end).await.expect("flush ack");
        (t.elapsed(), acceptor)
    });
    rt.block_on(acceptor.close()).expect("close acceptor");
    drop(env);
    elapsed
}

fn throughput(c: &mut Criterion) {
    let rt = runtime();
    let vol = volume();
    let mut g = c.benchmark_group("wal_acceptor_throughput");
    // Long iterations: the same count per sample (10 in all) instead of 1+2+..+10.
    g.sampling_mode(SamplingMode::Flat);
    for fsync in [false, true] {
        for commit in [false, true] {
            for size in [KIB, 8 * KIB, 128 * KIB, MIB] {
                let w = Workload::new(size, 1, vol, commit);
                g.throughput(Throughput::Bytes(w.payload_bytes));
                g.bench_function(
                    BenchmarkId::new(
                        format!("fsync={fsync}/commit={commit}"),
                        format!("size={size}"),
                    ),
                    |b| {
                        b.iter_custom(|iters| (0..iters).map(|_| push_volume(&rt, &w, fsync)).sum())
                    },
                );
            }
        }
    }
    g.finish();
}

fn durable_commit(c: &mut Criterion) {
    let rt = runtime();
    let mut g = c.benchmark_group("durable_commit");
    let size = 8 * KIB;
    g.throughput(Throughput::Elements(1));
    let mut env = Env::new(true).expect("bench env");
    let mut acceptor = rt.block_on(async { Acceptor::spawn(env.tl.clone()) });
    let payload = vec![b'x'; size];
    g.bench_function(format!("fsync=true/size={size}"), |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let m = env.next_append(&payload, true);
                let end = env.generator.lsn();
                let t = Instant::now();
                rt.block_on(async {
                    acceptor.push(m).await.expect("push");
                    acceptor.wait_flushed(end).await.expect("flush ack");
                });
                total += t.elapsed();
            }
            total
        })
    });
    rt.block_on(acceptor.close()).expect("close acceptor");
    g.finish();
}

fn heap_profile_ingest(c: &mut Criterion) {
    let mut g = c.benchmark_group("heap_profile_ingest");
    g.sampling_mode(SamplingMode::Flat);
    for size in [8, 8 * KIB, 128 * KIB] {
        let vol = if size < KIB { volume() / 8 } else { volume() };
        let w = Workload::new(size, 1, vol, true);
        // What a proposer connection's thread runs per message (no queue, no other thread):
        // every append without a flush, then one flush.
        let msgs: Vec<_> = w
            .msgs
            .iter()
            .map(|m| match m {
                ProposerAcceptorMessage::AppendRequest(a) => {
                    ProposerAcceptorMessage::NoFlushAppendRequest(a.clone())
                }
                other => other.clone(),
            })
            .collect();
        g.throughput(Throughput::Bytes(w.payload_bytes));
        g.bench_function(format!("fsync=false/size={size}"), |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let env = Env::new(false).expect("bench env");
                    let t = Instant::now();
                    for m in &msgs {
                        std::hint::black_box(env.tl.process_msg(m).expect("append"));
                    }
                    env.tl
                        .process_msg(&ProposerAcceptorMessage::FlushWAL)
                        .expect("flush");
                    total += t.elapsed();
                }
                total
            })
        });
    }
    g.finish();
}

fn cpu_profile(c: &mut Criterion) {
    let rt = runtime();
    let size = 128 * KIB;
    let w = Workload::new(size, 1, volume().min(256 << 20), false);
    let mut g = c.benchmark_group("cpu_profile");
    // Long iterations: the same count per sample (10 in all) instead of 1+2+..+10.
    g.sampling_mode(SamplingMode::Flat);
    g.throughput(Throughput::Bytes(w.payload_bytes));
    for profiler in ["off", "99hz"] {
        g.bench_function(
            format!("profiler={profiler}/fsync=false/size={size}"),
            |b| {
                b.iter_custom(|iters| {
                    let _profile =
                        (profiler == "99hz").then(|| CpuProfile::start().expect("CPU profile"));
                    (0..iters).map(|_| push_volume(&rt, &w, false)).sum()
                })
            },
        );
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = wal_bench::criterion();
    targets = wal_acceptor, throughput, durable_commit, heap_profile_ingest, cpu_profile
}
criterion_main!(benches);
