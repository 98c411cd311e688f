//! `process_msg` cost per append over the in-memory storage fakes, against one raw `pwrite`
//! syscall of the same size into a preallocated file (the floor any file-backed store pays).
//!
//! Groups: `process_msg/mem/flush={false,true}/size=N` (flush=false is the ingest hot path,
//! `NoFlushAppendRequest`), `decode+process_msg/mem/size=N` (codec included), and
//! `pwrite/size=N`. Run: `cargo bench -p safekeeper --bench process_msg`.

use std::hint::black_box;
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};

use sk_core::protocol::{
    AppendRequest, AppendRequestHeader, ProposerAcceptorMessage, ProposerElected, VoteRequest,
};
use sk_core::safekeeper::SafeKeeper;
use sk_core::state::{Configuration, ServerInfo, TimelinePersistentState};
use sk_core::storage::WalStore;
use sk_core::storage::mem::{MemControlStore, MemWalStore};
use sk_core::types::{Generation, Lsn, NodeId, TenantId, Term, TermHistory, TermLsn, TimelineId};

const START: Lsn = Lsn(0x0100_0000);
const SIZES: [usize; 3] = [8, 8 << 10, 128 << 10];
/// Rewind the in-memory WAL after this many bytes so memory stays bounded.
const REWIND_AFTER: u64 = 64 << 20;

type Sk = SafeKeeper<MemControlStore, MemWalStore>;

/// An acceptor elected in term 1 at `START`, ready for appends.
fn elected_sk() -> Sk {
    let state = TimelinePersistentState::new(
        TenantId([1; 16]),
        TimelineId([2; 16]),
        Configuration::default(),
        ServerInfo {
            pg_version: 150000,
            system_id: 1,
            wal_seg_size: 16 << 20,
        },
        0,
    );
    let mut sk = SafeKeeper::new(NodeId(1), MemControlStore::new(state), MemWalStore::new())
        .expect("fresh timeline");
    sk.process_msg(&ProposerAcceptorMessage::VoteRequest(VoteRequest {
        generation: Generation(0),
        term: Term(1),
    }))
    .expect("vote");
    sk.process_msg(&ProposerAcceptorMessage::Elected(ProposerElected {
        generation: Generation(0),
        term: Term(1),
        start_streaming_at: START,
        term_history: TermHistory(vec![TermLsn {
            term: Term(1),
            lsn: START,
        }]),
    }))
    .expect("elected");
    sk
}

fn append(begin: Lsn, data: &Bytes) -> AppendRequest {
    AppendRequest {
        h: AppendRequestHeader {
            generation: Generation(0),
            term: Term(1),
            begin_lsn: begin,
            end_lsn: Lsn(begin.0 + data.len() as u64),
            commit_lsn: begin,
            truncate_lsn: Lsn(0),
        },
        wal_data: data.clone(),
    }
}

/// Times `iters` appends of `size` bytes; message construction and WAL rewinds are untimed.
fn run_appends(sk: &mut Sk, iters: u64, size: usize, flush: bool, decode: bool) -> Duration {
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
            let a = append(lsn, &data);
            lsn = a.h.end_lsn;
            if decode {
                let mut b = BytesMut::new();
                ProposerAcceptorMessage::AppendRequest(a)
                    .encode(&mut b)
                    .expect("encodable");
                frames.push(b.freeze());
            } else if flush {
                msgs.push(ProposerAcceptorMessage::AppendRequest(a));
            } else {
                msgs.push(ProposerAcceptorMessage::NoFlushAppendRequest(a));
            }
        }
        let t = Instant::now();
        if decode {
            for f in &frames {
                let m = ProposerAcceptorMessage::decode(f).expect("valid frame");
                black_box(sk.process_msg(&m).expect("append accepted"));
            }
        } else {
            for m in &msgs {
                black_box(sk.process_msg(m).expect("append accepted"));
            }
        }
        total += t.elapsed();
        done += batch;
    }
    total
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("process_msg/mem");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    for flush in [false, true] {
        for size in SIZES {
            g.throughput(Throughput::Bytes(size as u64));
            let mut sk = elected_sk();
            g.bench_function(
                BenchmarkId::new(format!("flush={flush}"), format!("size={size}")),
                |b| b.iter_custom(|iters| run_appends(&mut sk, iters, size, flush, false)),
            );
        }
    }
    g.finish();

    let mut g = c.benchmark_group("decode+process_msg/mem");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    for size in SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        let mut sk = elected_sk();
        g.bench_function(format!("size={size}"), |b| {
            b.iter_custom(|iters| run_appends(&mut sk, iters, size, false, true))
        });
    }
    g.finish();

    let mut g = c.benchmark_group("pwrite");
    g.warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    let file = tempfile::tempfile().expect("temp file");
    let region: u64 = 64 << 20;
    file.set_len(region).expect("preallocate");
    for size in SIZES {
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

criterion_group!(benches, bench);
criterion_main!(benches);
