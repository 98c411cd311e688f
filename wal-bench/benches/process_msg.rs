//! `process_msg/fsync={false,true}/commit={false,true}/size=N`: one `AppendRequest` of
//! generated WAL (one logical message of N payload bytes) at a time into a real safekeeper
//! timeline with file storage (control file + 16 MiB WAL segments). `AppendRequest` writes and
//! flushes; with fsync=false the storage runs `no_sync`, so this is the CPU cost of an append
//! plus one `pwrite`. Throughput counts payload bytes; message generation is untimed.
//!
//! 1 MiB exceeds the protocol's 128 KiB `MAX_SEND_SIZE`: fine here, `process_msg` bypasses the
//! codec and the store takes any length.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use wal_bench::{Env, KIB, MIB};

profiling::global_allocator!();

const SIZES: [usize; 5] = [8, KIB, 8 * KIB, 128 * KIB, MIB];
/// Start a fresh timeline after this much WAL so the disk use stays bounded.
const RESET_AFTER: u64 = 1 << 30;

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("process_msg");
    for fsync in [false, true] {
        for commit in [false, true] {
            for size in SIZES {
                g.throughput(Throughput::Bytes(size as u64));
                let id = BenchmarkId::new(
                    format!("fsync={fsync}/commit={commit}"),
                    format!("size={size}"),
                );
                let payload = vec![b'x'; size];
                let mut env = Env::new(fsync).expect("bench env");
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        let mut done = 0;
                        while done < iters {
                            if env.generator.lsn().0 - wal_bench::START.0 > RESET_AFTER {
                                env = Env::new(fsync).expect("bench env");
                            }
                            // Generate a small batch untimed, then time its appends.
                            let n = (iters - done).min(64);
                            let msgs: Vec<_> =
                                (0..n).map(|_| env.next_append(&payload, commit)).collect();
                            let t = Instant::now();
                            for m in &msgs {
                                black_box(env.tl.process_msg(m).expect("append accepted"));
                            }
                            total += t.elapsed();
                            done += n;
                        }
                        total
                    })
                });
            }
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = wal_bench::criterion();
    targets = bench
}
criterion_main!(benches);
