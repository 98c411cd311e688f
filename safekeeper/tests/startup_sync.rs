//! What the start-up sync costs (issue 13, item 2): load a real data directory of many
//! timelines (knob `STARTUP_TIMELINES`, default 1000) with and without the fsyncs recovery now
//! does before revealing WAL, and print both times. Ignored by default (it is a measurement,
//! not a check); run it in a release build with `scripts/startup-time`.
//!
//! "Before" is the load with `no_sync` (which skips exactly the start-up sync at load: loading
//! does no other fsync); "after" is the production load. Each is the median of a few loads,
//! alternating, after `sync(2)` so that both find clean files (the usual restart); the first
//! load after the writes, with dirty pages, is reported too.

use std::path::Path;
use std::time::{Duration, Instant};

use bytes::Bytes;
use pg_wal::generator::WalGenerator;
use safekeeper::registry::GlobalTimelines;
use sk_core::protocol::{
    AppendRequest, AppendRequestHeader, ProposerAcceptorMessage, ProposerElected, ProposerGreeting,
    VoteRequest,
};
use sk_core::state::Configuration;
use sk_core::types::{Generation, Lsn, NodeId, TenantId, Term, TermHistory, TermLsn, TimelineId};

const SEG: u64 = 16 << 20;

fn greeting(i: u32) -> ProposerGreeting {
    let mut tl = [0u8; 16];
    tl[..4].copy_from_slice(&i.to_be_bytes());
    ProposerGreeting {
        tenant_id: TenantId([1; 16]),
        timeline_id: TimelineId(tl),
        mconf: Configuration::default(),
        pg_version: 150000,
        system_id: 42,
        wal_seg_size: SEG as u32,
    }
}

/// Creates timeline `i` with `wal_bytes` of committed, persisted WAL.
fn populate(timelines: &GlobalTimelines, i: u32, wal_bytes: usize) {
    let g = greeting(i);
    let tl = timelines.get_or_create(&g, true).unwrap();
    let run = |m| {
        tl.process_msg(&m).unwrap();
    };
    run(ProposerAcceptorMessage::Greeting(g));
    run(ProposerAcceptorMessage::VoteRequest(VoteRequest {
        generation: Generation(0),
        term: Term(1),
    }));
    let start = Lsn(SEG);
    run(ProposerAcceptorMessage::Elected(ProposerElected {
        generation: Generation(0),
        term: Term(1),
        start_streaming_at: start,
        term_history: TermHistory(vec![TermLsn {
            term: Term(1),
            lsn: start,
        }]),
    }));
    let mut wal = Vec::new();
    let mut g = WalGenerator::new(42, SEG, start).unwrap();
    // Committed half-way (a record boundary): recovery decodes (and syncs) the rest.
    g.fill(&mut wal, wal_bytes / 2, &[7; 200]);
    let commit = g.lsn();
    g.fill(&mut wal, wal_bytes - wal_bytes / 2, &[7; 200]);
    let end = g.lsn();
    assert!(commit < end);
    let mut at = 0;
    while at < wal.len() {
        let n = (wal.len() - at).min(128 << 10);
        let begin = Lsn(start.0 + at as u64);
        run(ProposerAcceptorMessage::AppendRequest(AppendRequest {
            h: AppendRequestHeader {
                generation: Generation(0),
                term: Term(1),
                begin_lsn: begin,
                end_lsn: Lsn(begin.0 + n as u64),
                commit_lsn: if begin.0 + n as u64 == end.0 {
                    commit
                } else {
                    Lsn::INVALID
                },
                truncate_lsn: Lsn::INVALID,
            },
            wal_data: Bytes::copy_from_slice(&wal[at..at + n]),
        }));
        at += n;
    }
    tl.maybe_persist(true).unwrap();
}

fn load(dir: &Path, no_sync: bool, expect: usize) -> Duration {
    let t = Instant::now();
    let timelines = GlobalTimelines::load(dir, NodeId(1), no_sync).unwrap();
    let took = t.elapsed();
    assert_eq!(timelines.all().len(), expect);
    took
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

#[test]
#[ignore = "a measurement: run it with scripts/startup-time"]
fn startup_time_with_many_timelines_with_and_without_the_startup_sync() {
    let n: u32 = std::env::var("STARTUP_TIMELINES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1000);
    let wal_bytes: usize = std::env::var("STARTUP_WAL_BYTES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(64 << 10);
    let base = std::env::var("STARTUP_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let dir = tempfile::tempdir_in(base).unwrap();
    let t = Instant::now();
    {
        // no_sync while populating: the measurement is the load, not the set-up.
        let timelines = GlobalTimelines::load(dir.path(), NodeId(1), true).unwrap();
        for i in 0..n {
            populate(&timelines, i, wal_bytes);
        }
    }
    println!(
        "populated {n} timelines with {wal_bytes} bytes of WAL each in {:?}",
        t.elapsed()
    );
    let dirty = load(dir.path(), false, n as usize);
    println!("first load with the start-up sync, pages still dirty: {dirty:?}");
    // SAFETY: sync(2) takes no arguments and cannot fail.
    unsafe { libc::sync() };
    let (mut before, mut after) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        before.push(load(dir.path(), true, n as usize));
        after.push(load(dir.path(), false, n as usize));
    }
    let (b, a) = (median(before), median(after));
    println!(
        "start-up with {n} timelines: without the start-up sync {b:?}, with it {a:?} \
         (median of 5 each, clean page cache)"
    );
}
