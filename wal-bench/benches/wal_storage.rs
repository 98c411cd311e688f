//! Micro-benchmarks of the WAL format and the WAL file store (throughput in bytes):
//! - `crc32c/size=N`: CRC-32C throughput (hardware-accelerated `crc32c` crate).
//! - `generate/msg=N`: logical-message WAL generation (1 MiB of WAL per iteration).
//! - `decode/msg=N`: the streaming decoder over 1 MiB of generated WAL.
//! - `write/store_no_sync/size=N`: `WalFileStore::write_wal` without fsync (decode + `pwrite`
//!   into page cache, segment creation included): the CPU cost of an append.
//! - `write_flush/store/seg=S/{sparse,zeroed}/size=N`: `WalFileStore::write_wal` + `flush_wal`
//!   (decode, write, fdatasync) per append; with a 1 GiB segment it stays in one preallocated
//!   segment, with 16 MiB segments creation and completion are included.
//!
//! The raw `pwrite` + `fdatasync` baselines these compare against (sparse, zero-filled and
//! `pg_test_fsync`'s rewrite of one block) are the `file_write` bench.

#![allow(
    missing_docs,
    reason = "criterion_group! defines an undocumented `pub fn benches`"
)]

use std::hint::black_box;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use pg_wal::{WalGenerator, WalStreamDecoder};
use safekeeper::wal_store::{WalFileOptions, WalFileStore};
use sk_core::storage::WalStore;
use sk_core::types::Lsn;
use wal_bench::{KIB, MIB, temp_dir};

profiling::global_allocator!();

fn crc(c: &mut Criterion) {
    let mut g = c.benchmark_group("crc32c");
    for size in [64, 8 * KIB, 128 * KIB, MIB] {
        let data = vec![0xA5u8; size];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(format!("size={size}"), &data, |b, d| {
            b.iter(|| crc32c::crc32c(black_box(d)))
        });
    }
    g.finish();
}

fn generate(c: &mut Criterion) {
    let mut g = c.benchmark_group("generate");
    for msg in [64, KIB, 8 * KIB, 128 * KIB] {
        let message = vec![0x5Au8; msg];
        let mut out = Vec::with_capacity(2 * MIB);
        let mut generator = WalGenerator::new(1, 16 << 20, Lsn(16 << 20)).unwrap();
        g.throughput(Throughput::Bytes(MIB as u64));
        g.bench_function(format!("msg={msg}"), |b| {
            b.iter(|| {
                out.clear();
                generator.fill(&mut out, MIB, &message);
                black_box(out.len())
            })
        });
    }
    g.finish();
}

fn decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    for msg in [64, KIB, 128 * KIB] {
        let start = Lsn(16 << 20);
        let mut generator = WalGenerator::new(1, 16 << 20, start).unwrap();
        let mut wal = Vec::new();
        generator.fill(&mut wal, MIB, &vec![0x5Au8; msg]);
        g.throughput(Throughput::Bytes(wal.len() as u64));
        g.bench_function(format!("msg={msg}"), |b| {
            b.iter(|| {
                let mut d = WalStreamDecoder::new(start, 16 << 20, pg_wal::PgMajor::V15);
                for chunk in wal.chunks(128 * KIB) {
                    d.feed(chunk).expect("generated WAL decodes");
                }
                black_box(d.last_record_end())
            })
        });
    }
    g.finish();
}

fn write_flush(c: &mut Criterion) {
    let mut g = c.benchmark_group("write_flush");
    g.sample_size(20);
    // The WAL store: decode + write + fdatasync per append. `seg=1GiB`: one preallocated
    // segment (the brief's micro-bench); `seg=16MiB`: the default size, segment creation and
    // completion included, sparse (`set_len`) or zero-filled segments.
    for (label, seg_size, zero_fill) in [
        ("store/seg=1GiB/sparse/size", 1u64 << 30, false),
        ("store/seg=16MiB/sparse/size", 16u64 << 20, false),
        ("store/seg=16MiB/zeroed/size", 16u64 << 20, true),
    ] {
        for size in [8 * KIB, 128 * KIB] {
            let dir = temp_dir().unwrap();
            let opts = WalFileOptions {
                zero_fill,
                ..Default::default()
            };
            let mut store = bench_store(dir.path(), seg_size, opts);
            let mut feed = WalFeed::new(seg_size);
            g.throughput(Throughput::Bytes(size as u64));
            g.bench_function(format!("{label}={size}"), |b| {
                b.iter_custom(|iters| time_appends(&mut store, &mut feed, iters, size, true))
            });
            // Segments this run left behind go with the temp dir.
            drop(store);
        }
    }
    g.finish();
}

/// A WAL store in `dir` holding nothing, ready for WAL at the start of its second segment.
fn bench_store(dir: &Path, seg_size: u64, opts: WalFileOptions) -> WalFileStore {
    let start = Lsn(seg_size);
    let mut store = WalFileStore::open(dir, seg_size, Lsn::INVALID, opts).unwrap();
    store.initialize_first_segment(start).unwrap();
    store.truncate_wal(start).unwrap();
    store
}

/// Generated WAL (1000-byte messages) for a [`bench_store`], handed out in pieces of any size
/// that continue each other; generated 2 MiB at a time, outside the timed part.
struct WalFeed {
    generator: WalGenerator,
    message: Vec<u8>,
    pending: Vec<u8>,
    consumed: usize,
}

impl WalFeed {
    fn new(seg_size: u64) -> WalFeed {
        WalFeed {
            generator: WalGenerator::new(1, seg_size, Lsn(seg_size)).unwrap(),
            message: vec![0x5Au8; 1000],
            pending: Vec::with_capacity(4 * MIB),
            consumed: 0,
        }
    }

    /// The next `size` bytes of WAL.
    fn next(&mut self, size: usize) -> &[u8] {
        if self.pending.len() - self.consumed < size {
            self.pending.drain(..self.consumed);
            self.consumed = 0;
            self.generator
                .fill(&mut self.pending, 2 * MIB, &self.message);
        }
        self.consumed += size;
        &self.pending[self.consumed - size..self.consumed]
    }
}

/// Times `iters` appends of `size` bytes of `feed` into `store`, each flushed if `flush`.
/// Without flushes (a `no_sync` store) old segments are removed after each append, untimed:
/// segment creation is part of the cost, disk space is not.
fn time_appends(
    store: &mut WalFileStore,
    feed: &mut WalFeed,
    iters: u64,
    size: usize,
    flush: bool,
) -> Duration {
    let mut total = Duration::ZERO;
    for _ in 0..iters {
        let wal = feed.next(size);
        let lsn = store.write_lsn();
        let t = Instant::now();
        store.write_wal(lsn, wal).unwrap();
        if flush {
            store.flush_wal().unwrap();
        }
        total += t.elapsed();
        let cur = store.write_lsn().segment_number(store.seg_size());
        if !flush && cur > 2 {
            store.remove_segments_up_to(cur - 2).unwrap();
        }
    }
    total
}

/// The CPU side of an append: decode + `pwrite` to the page cache, no fsync (`no_sync`).
fn write_no_sync(c: &mut Criterion) {
    let mut g = c.benchmark_group("write");
    for size in [8 * KIB, 128 * KIB] {
        let dir = temp_dir().unwrap();
        let seg_size = 16u64 << 20;
        let opts = WalFileOptions {
            no_sync: true,
            ..Default::default()
        };
        let mut store = bench_store(dir.path(), seg_size, opts);
        let mut feed = WalFeed::new(seg_size);
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_function(format!("store_no_sync/size={size}"), |b| {
            b.iter_custom(|iters| time_appends(&mut store, &mut feed, iters, size, false))
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = wal_bench::criterion();
    targets = crc, generate, decode, write_no_sync, write_flush
}
criterion_main!(benches);
