//! `file_write/{stdlib,tokio}/fsync={false,true}/file={append,sparse,zeroed,rewrite}/size=N`: the raw
//! baseline the ingest path is measured against: one N-byte write (plus `fdatasync` with
//! fsync=true) at a time, sequentially, into
//! - `append`: a file that grows with each write (size metadata changes every time);
//! - `sparse`: a file preallocated with `set_len` (how our WAL segments are created): no size
//!   change, but each first write to a block allocates it;
//! - `zeroed`: a file written full of zeros first (how `pg_test_fsync` prepares its file):
//!   overwrites only, so `fdatasync` has no metadata to journal;
//! - `rewrite`: the zero-filled file, but every write goes to offset 0 (what `pg_test_fsync`'s
//!   "one 8kB write" test actually does: it seeks back after each fdatasync).
//!
//! `fdatasync_quorum/files={1,3}/size=8192`: the disk's part of a quorum commit when every node
//! shares this one disk (as the 3-node benches and tests here do): `files` threads each write
//! 8 KiB into a zero-filled file of their own and `fdatasync` it, all at once; an iteration is
//! the time until a majority (1 of 1, 2 of 3) is durable. `files=1` is the same harness with
//! one node, so the ratio of the two is what sharing one disk costs a 3-node commit.
//!
//! `stdlib` uses `std::fs::File` (`pwrite`); `tokio` uses `tokio::fs::File` (each call hops to
//! the blocking pool). Throughput: bytes written. Resets (truncation, re-preallocation) happen
//! outside the timed region.

#![allow(
    missing_docs,
    reason = "criterion_group! defines an undocumented `pub fn benches`"
)]

use std::fs::{File, OpenOptions};
use std::io::SeekFrom;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::time::{Duration, Instant};

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use tokio::io::{AsyncSeekExt, AsyncWriteExt};
use wal_bench::{KIB, MIB, runtime, temp_dir};

profiling::global_allocator!();

const SIZES: [usize; 4] = [KIB, 8 * KIB, 128 * KIB, MIB];
/// Region written before wrapping around (append: truncate; sparse: re-create the file).
const REGION: u64 = 64 << 20;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Append,
    Sparse,
    Zeroed,
    Rewrite,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::Append => "append",
            Kind::Sparse => "sparse",
            Kind::Zeroed => "zeroed",
            Kind::Rewrite => "rewrite",
        }
    }
}

/// (Re)creates the file at `path` in the state `kind` starts from.
fn prepare(path: &Path, kind: Kind) -> File {
    let f = OpenOptions::new()
        .create(true)
        .truncate(true)
        .read(true)
        .write(true)
        .open(path)
        .expect("bench file");
    match kind {
        Kind::Append => {}
        Kind::Sparse => f.set_len(REGION).expect("set_len"),
        Kind::Zeroed | Kind::Rewrite => {
            let zeros = vec![0u8; MIB];
            for i in 0..REGION / MIB as u64 {
                f.write_all_at(&zeros, i * MIB as u64).expect("zero fill");
            }
        }
    }
    f.sync_all().expect("fsync");
    f
}

fn stdlib(c: &mut Criterion) {
    let dir = temp_dir().expect("bench dir");
    let path = dir.path().join("file_write");
    let mut g = c.benchmark_group("file_write");
    for fsync in [false, true] {
        for kind in [Kind::Append, Kind::Sparse, Kind::Zeroed, Kind::Rewrite] {
            for size in SIZES {
                g.throughput(Throughput::Bytes(size as u64));
                let buf = vec![0x5au8; size];
                let mut f = prepare(&path, kind);
                let mut off = 0u64;
                let id = BenchmarkId::new(
                    format!("stdlib/fsync={fsync}/file={}", kind.name()),
                    format!("size={size}"),
                );
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        let mut total = Duration::ZERO;
                        for _ in 0..iters {
                            if off + size as u64 > REGION || kind == Kind::Rewrite {
                                // Zeroed files are simply overwritten again.
                                if kind == Kind::Append || kind == Kind::Sparse {
                                    f = prepare(&path, kind);
                                }
                                off = 0;
                            }
                            let t = Instant::now();
                            f.write_all_at(&buf, off).expect("write");
                            if fsync {
                                f.sync_data().expect("fdatasync");
                            }
                            total += t.elapsed();
                            off += size as u64;
                        }
                        total
                    })
                });
            }
        }
    }
    g.finish();
}

fn tokio_fs(c: &mut Criterion) {
    let rt = runtime();
    let dir = temp_dir().expect("bench dir");
    let path = dir.path().join("file_write_tokio");
    let mut g = c.benchmark_group("file_write");
    for fsync in [false, true] {
        for kind in [Kind::Append, Kind::Sparse, Kind::Zeroed] {
            for size in SIZES {
                g.throughput(Throughput::Bytes(size as u64));
                let buf = vec![0x5au8; size];
                let mut f = tokio::fs::File::from_std(prepare(&path, kind));
                let mut off = 0u64;
                let id = BenchmarkId::new(
                    format!("tokio/fsync={fsync}/file={}", kind.name()),
                    format!("size={size}"),
                );
                g.bench_function(id, |b| {
                    b.iter_custom(|iters| {
                        rt.block_on(async {
                            let mut total = Duration::ZERO;
                            for _ in 0..iters {
                                if off + size as u64 > REGION {
                                    if kind != Kind::Zeroed {
                                        f = tokio::fs::File::from_std(prepare(&path, kind));
                                    }
                                    f.seek(SeekFrom::Start(0)).await.expect("seek");
                                    off = 0;
                                }
                                let t = Instant::now();
                                f.write_all(&buf).await.expect("write");
                                // tokio buffers: flush() completes the write before the sync.
                                f.flush().await.expect("flush");
                                if fsync {
                                    f.sync_data().await.expect("fdatasync");
                                }
                                total += t.elapsed();
                                off += size as u64;
                            }
                            total
                        })
                    })
                });
            }
        }
    }
    g.finish();
}

/// Concurrent `pwrite`+`fdatasync` rounds on `files` files, timed to a majority's completion.
fn fdatasync_quorum(c: &mut Criterion) {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Barrier, Mutex};
    let size = 8 * KIB;
    let mut g = c.benchmark_group("fdatasync_quorum");
    g.throughput(Throughput::Elements(1));
    for files in [1usize, 3] {
        let dir = temp_dir().expect("bench dir");
        let start = Arc::new(Barrier::new(files + 1));
        let end = Arc::new(Barrier::new(files + 1));
        let stop = Arc::new(AtomicBool::new(false));
        // Each node's completion time in the current round.
        let done: Arc<Mutex<Vec<Instant>>> = Arc::default();
        let nodes: Vec<_> = (0..files)
            .map(|i| {
                let f = prepare(&dir.path().join(format!("node{i}")), Kind::Zeroed);
                let (start, end, stop, done) =
                    (start.clone(), end.clone(), stop.clone(), done.clone());
                std::thread::spawn(move || {
                    let buf = vec![0x5au8; size];
                    let mut off = 0u64;
                    loop {
                        start.wait();
                        if stop.load(Ordering::SeqCst) {
                            return;
                        }
                        f.write_all_at(&buf, off).expect("write");
                        f.sync_data().expect("fdatasync");
                        done.lock().expect("done").push(Instant::now());
                        off = (off + size as u64) % REGION;
                        end.wait();
                    }
                })
            })
            .collect();
        g.bench_function(
            BenchmarkId::new(format!("files={files}"), format!("size={size}")),
            |b| {
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        done.lock().expect("done").clear();
                        let t = Instant::now();
                        start.wait();
                        end.wait();
                        let mut round = done.lock().expect("done").clone();
                        round.sort();
                        total += round[files / 2] - t;
                    }
                    total
                })
            },
        );
        stop.store(true, Ordering::SeqCst);
        start.wait();
        for n in nodes {
            n.join().expect("node thread");
        }
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = wal_bench::criterion();
    targets = stdlib, tokio_fs, fdatasync_quorum
}
criterion_main!(benches);
