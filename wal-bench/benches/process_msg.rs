//! `SafeKeeper::process_msg`, the consensus core, per append. Throughput counts payload bytes;
//! message generation is untimed (`iter_custom`, batches of 64).
//!
//! - `process_msg/fsync={false,true}/commit={false,true}/size=N`: one `AppendRequest` of
//!   generated WAL (one logical message of N payload bytes) at a time into a real safekeeper
//!   timeline with file storage (control file + 16 MiB WAL segments). `AppendRequest` writes
//!   and flushes; with fsync=false the storage runs `no_sync`, so this is the CPU cost of an
//!   append plus one `pwrite`.
//! - `process_msg/mem/flush={false,true}/size=N`: the same core over the in-memory storage
//!   fakes (`flush=false` is `NoFlushAppendRequest`, the ingest hot path): the core alone.
//! - `decode+process_msg/mem/size=N`: the same with the protocol-v3 decode of each frame.
//! - `pwrite/size=N`: one raw `pwrite` of the same size into a preallocated file, the floor any
//!   file-backed store pays per append.
//!
//! 1 MiB exceeds the protocol's 128 KiB `MAX_SEND_SIZE`: fine here, `process_msg` bypasses the
//! codec and the store takes any length (the decode group stays within it).

#![allow(
    missing_docs,
    reason = "criterion_group! defines an undocumented `pub fn benches`"
)]

use std::hint::black_box;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use sk_core::protocol::ProposerAcceptorMessage;
use sk_core::safekeeper::SafeKeeper;
use sk_core::state::{ServerInfo, TimelinePersistentState};
use sk_core::storage::WalStore;
use sk_core::storage::mem::{MemControlStore, MemWalStore};
use sk_core::types::NodeId;
use wal_bench::{Env, KIB, MIB, START, append_msg, election, greeting};

profiling::global_allocator!();

const SIZES: [usize; 5] = [8, KIB, 8 * KIB, 128 * KIB, MIB];
/// Sizes of the in-memory and `pwrite` groups (at most `MAX_SEND_SIZE`).
const MEM_SIZES: [usize; 3] = [8, 8 * KIB, 128 * KIB];
/// Start a fresh timeline after this much WAL so the disk use stays bounded.
const RESET_AFTER: u64 = 1 << 30;
/// Rewind the in-memory WAL after this many bytes so memory stays bounded.
const REWIND_AFTER: u64 = 64 << 20;

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

type MemSk = SafeKeeper<MemControlStore, MemWalStore>;

/// An acceptor over the in-memory fakes, elected at term 1 at [`START`].
fn elected_mem_sk() -> MemSk {
    let gr = greeting();
    let state = TimelinePersistentState::new(
        gr.tenant_id,
        gr.timeline_id,
        gr.mconf.clone(),
        ServerInfo {
            pg_version: gr.pg_version,
            system_id: gr.system_id,
            wal_seg_size: gr.wal_seg_size,
        },
        0,
    );
    let mut sk = SafeKeeper::new(NodeId(1), MemControlStore::new(state), MemWalStore::new())
        .expect("fresh timeline");
    for m in &election() {
        sk.process_msg(m).expect("election");
    }
    sk
}

/// How the in-memory appends reach `process_msg`.
#[derive(Clone, Copy)]
enum Mode {
    /// `AppendRequest`: written and flushed.
    Flush,
    /// `NoFlushAppendRequest`: written only (the ingest hot path).
    NoFlush,
    /// Encoded frames, decoded in the timed region, then `NoFlushAppendRequest`.
    Decode,
}

/// Times `iters` appends of `size` bytes; message construction and WAL rewinds are untimed.
fn run_mem_appends(sk: &mut MemSk, iters: u64, size: usize, mode: Mode) -> Duration {
    let data = Bytes::from(vec![0x5a; size]);
    let mut total = Duration::ZERO;
    let mut done = 0;
    while done < iters {
        if sk.write_lsn().0 - START.0 > REWIND_AFTER {
            sk.wal_mut().truncate_wal(START).expect("rewind");
        }
        let batch = (iters - done).min(64).min(REWIND_AFTER / size as u64 + 1);
        let mut lsn = sk.write_lsn();
        let mut frames = Vec::with_capacity(batch as usize);
        let mut msgs = Vec::with_capacity(batch as usize);
        for _ in 0..batch {
            let msg = append_msg(lsn, data.clone(), true);
            let ProposerAcceptorMessage::AppendRequest(a) = msg else {
                unreachable!("append_msg makes appends");
            };
            lsn = a.h.end_lsn;
            match mode {
                Mode::Decode => {
                    let mut b = BytesMut::new();
                    ProposerAcceptorMessage::AppendRequest(a)
                        .encode(&mut b)
                        .expect("encodable");
                    frames.push(b.freeze());
                }
                Mode::Flush => msgs.push(ProposerAcceptorMessage::AppendRequest(a)),
                Mode::NoFlush => msgs.push(ProposerAcceptorMessage::NoFlushAppendRequest(a)),
            }
        }
        let t = Instant::now();
        for f in &frames {
            let m = ProposerAcceptorMessage::decode(f).expect("valid frame");
            black_box(sk.process_msg(&m).expect("append accepted"));
        }
        for m in &msgs {
            black_box(sk.process_msg(m).expect("append accepted"));
        }
        total += t.elapsed();
        done += batch;
    }
    total
}

fn bench_mem(c: &mut Criterion) {
    let mut g = c.benchmark_group("process_msg/mem");
    for (flush, mode) in [(false, Mode::NoFlush), (true, Mode::Flush)] {
        for size in MEM_SIZES {
            g.throughput(Throughput::Bytes(size as u64));
            let mut sk = elected_mem_sk();
            g.bench_function(
                BenchmarkId::new(format!("flush={flush}"), format!("size={size}")),
                |b| b.iter_custom(|iters| run_mem_appends(&mut sk, iters, size, mode)),
            );
        }
    }
    g.finish();

    let mut g = c.benchmark_group("decode+process_msg/mem");
    for size in MEM_SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        let mut sk = elected_mem_sk();
        g.bench_function(format!("size={size}"), |b| {
            b.iter_custom(|iters| run_mem_appends(&mut sk, iters, size, Mode::Decode))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("pwrite");
    let dir = wal_bench::temp_dir().expect("bench dir");
    let file = std::fs::File::options()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(dir.path().join("pwrite"))
        .expect("bench file");
    let region: u64 = 64 << 20;
    file.set_len(region).expect("preallocate");
    for size in MEM_SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        let buf = vec![0x5au8; size];
        let mut off = 0u64;
        g.bench_function(format!("size={size}"), |b| {
            b.iter(|| {
                if off + size as u64 > region {
                    off = 0;
                }
                file.write_all_at(black_box(&buf), off).expect("pwrite");
                off += size as u64;
            })
        });
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = wal_bench::criterion();
    targets = bench, bench_mem
}
criterion_main!(benches);
