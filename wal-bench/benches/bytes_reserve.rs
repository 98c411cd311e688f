//! `bytes_reserve/size=N`: `BytesMut::new()` + `reserve(N)` + drop, the allocator path of
//! message parsing (emulates neon's `FeMessage::parse` bench). Runs on jemalloc with heap
//! profiling on; compare with profiling off in the same binary:
//! `MALLOC_CONF=prof:false cargo bench -p wal-bench --bench bytes_reserve`.

#![allow(
    missing_docs,
    reason = "criterion_group! defines an undocumented `pub fn benches`"
)]

use std::hint::black_box;

use bytes::BytesMut;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use wal_bench::KIB;

profiling::global_allocator!();

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("bytes_reserve");
    for size in [1, 64, KIB, 8 * KIB, 128 * KIB] {
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(format!("size={size}"), |b| {
            b.iter(|| {
                let mut buf = BytesMut::new();
                buf.reserve(black_box(size));
                black_box(buf)
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = wal_bench::criterion();
    targets = bench
}
criterion_main!(benches);
