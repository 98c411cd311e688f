//! Eviction and restore on a simulated disk: what stays local, what comes back, and a crash
//! (process kill or power loss) at every file-system operation of both.

use std::path::Path;
use std::sync::Arc;

use pg_wal::generator::WalGenerator;
use sk_core::storage::fs::{Fs, SimFs};
use sk_core::types::{Lsn, TenantTimelineId};

use super::*;
use crate::registry::{EvictStep, GlobalTimelines, RestoreStep};
use crate::remote_storage::RemoteStorage;
use crate::test_util::{DATADIR, append, append_msg, elect, elected_timeline, load, sim_node};
use crate::wal_backup::Backup;

const SEG: u64 = 1 << 20;
const START: Lsn = Lsn(SEG);

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

fn memory_store() -> Arc<RemoteStorage> {
    Arc::new(RemoteStorage::with_store(
        Arc::new(object_store::memory::InMemory::new()),
        "memory://evict",
    ))
}

/// A node whose timeline holds 2.5 segments of committed WAL, every byte of it in `storage`
/// (complete segments 1 and 2, segment 3 as a partial object up to the end), saved. Returns
/// the node, the timeline, its WAL (from [`START`]) and its end.
fn stored_timeline(
    fs: &Fs,
    storage: &Arc<RemoteStorage>,
) -> (GlobalTimelines, Arc<Timeline>, Vec<u8>, Lsn) {
    stored_timeline_with(fs, storage, 2 * SEG + SEG / 2, false)
}

/// [`stored_timeline`], evicted: the node, the WAL and its end.
fn evicted_timeline(fs: &Fs, storage: &Arc<RemoteStorage>) -> (GlobalTimelines, Vec<u8>, Lsn) {
    let (timelines, tl, wal, end) = stored_timeline(fs, storage);
    crate::blocking::section(|| timelines.evict(&tl, end)).unwrap();
    (timelines, wal, end)
}

/// [`stored_timeline`] with `size` bytes of WAL (at least), then a WAL switch if `switch`
/// (which ends the WAL at a segment boundary).
fn stored_timeline_with(
    fs: &Fs,
    storage: &Arc<RemoteStorage>,
    size: u64,
    switch: bool,
) -> (GlobalTimelines, Arc<Timeline>, Vec<u8>, Lsn) {
    let timelines = load(fs);
    timelines.set_storage(storage.clone());
    let tl = elected_timeline(&timelines, 1, SEG, START);
    let mut walgen = WalGenerator::new(42, SEG, START).unwrap();
    let mut wal = Vec::new();
    if size > 0 {
        walgen.fill(&mut wal, size as usize, &[5; 900]);
    }
    if switch {
        walgen.append_switch(&mut wal);
        assert_eq!(walgen.lsn().segment_offset(SEG), 0);
    }
    let end = walgen.lsn();
    if wal.is_empty() {
        crate::blocking::section(|| tl.maybe_persist(true).unwrap());
        let end = tl.positions().flush_lsn;
        return (timelines, tl, wal, end);
    }
    append(&tl, 1, START, &wal, end, true);
    append(&tl, 1, end, &[], end, true);
    let backup = Backup {
        storage: storage.clone(),
        permits: Arc::new(tokio::sync::Semaphore::new(1)),
        parallelism: 1,
    };
    rt().block_on(async {
        for segno in [1, 2, 3] {
            if segno < end.segment_number(SEG) {
                backup.upload(&tl, segno, 0, false).await.unwrap();
            }
        }
        if end.segment_offset(SEG) != 0 {
            backup.upload_partial(&tl, end, 0).await.unwrap();
        }
    });
    crate::blocking::section(|| {
        tl.set_backup_lsn(end.segment_start(SEG));
        tl.maybe_persist(true).unwrap();
    });
    (timelines, tl, wal, end)
}

fn files(fs: &Fs, dir: &Path) -> Vec<String> {
    let mut v = fs.list_dir(dir).unwrap();
    v.sort();
    v
}

fn ttid() -> TenantTimelineId {
    crate::test_util::greeting(1, SEG).ttid()
}

/// Restores `ttid` on `timelines` as [`restore`] does, stopping after `upto`.
fn restore_upto(
    timelines: &GlobalTimelines,
    storage: &RemoteStorage,
    upto: RestoreStep,
) -> Result<Arc<Timeline>, TimelineError> {
    let e = timelines.get_evicted(&ttid()).expect("evicted");
    let data = e.segment_to_restore().map(|segno| {
        rt().block_on(download(storage, &e.ttid, SEG, segno, e.end_lsn()))
            .unwrap()
            .expect("stored")
    });
    crate::blocking::section(|| timelines.restore_steps(&ttid(), data.as_deref(), upto))
}

/// The restored timeline serves its WAL byte for byte up to `end`, takes a new term's appends
/// after it, and its control file no longer says evicted.
fn check_restored(tl: &Timeline, wal: &[u8], end: Lsn) {
    assert_eq!(tl.positions().flush_lsn, end);
    assert!(!tl.is_evicted());
    // The restored segment's WAL (below it, removed locally, the store serves readers).
    let from = Lsn(end.0.saturating_sub(1))
        .segment_start(SEG)
        .max(START)
        .min(end);
    let mut out = Vec::new();
    tl.read_wal(from, end, &mut out).unwrap();
    let off = (from.0 - START.0) as usize;
    assert_eq!(out, &wal[off..], "the restored segment's WAL");
    if end == START {
        elect(tl, 2, &[(2, end)]);
    } else {
        elect(tl, 2, &[(1, START), (2, end)]);
    }
    let mut walgen = WalGenerator::new(42, SEG, end).unwrap();
    let mut more = Vec::new();
    walgen.fill(&mut more, 20_000, &[6; 500]);
    crate::test_util::run(tl, append_msg(2, end, &more, end));
    assert_eq!(tl.positions().flush_lsn, walgen.lsn());
}

/// An evicted timeline keeps only its control file (also across a restart, without opening
/// its WAL); its old object refuses every message; a restore brings its WAL back from the
/// store and it serves a new proposer.
#[test]
fn an_evicted_timeline_keeps_only_its_control_file_and_comes_back_with_its_wal() {
    let (_sim, fs, _) = sim_node();
    let storage = memory_store();
    let (timelines, tl, wal, end) = stored_timeline(&fs, &storage);
    let dir = tl.dir.clone();
    assert!(files(&fs, &dir).len() > 1);
    let removed = crate::blocking::section(|| timelines.evict(&tl, end)).unwrap();
    assert!(removed >= 3, "{removed}");
    assert_eq!(
        files(&fs, &dir),
        vec![crate::control_file::CONTROL_FILE_NAME]
    );
    assert_eq!(timelines.counts(), (0, 1));
    assert!(timelines.get(&ttid()).is_none());
    let refused = crate::blocking::section(|| tl.process_msg(&append_msg(1, end, &[], end)));
    assert!(
        refused.unwrap_err().to_string().contains("evicted"),
        "the old object refuses"
    );
    // A greeting is told to restore, not given a new timeline.
    assert!(matches!(
        timelines.get_or_create(&crate::test_util::greeting(1, SEG), true),
        Err(TimelineError::Evicted(_))
    ));
    drop((timelines, tl));
    let timelines = Arc::new(load(&fs));
    assert_eq!(timelines.counts(), (0, 1), "still evicted after a restart");
    assert_eq!(timelines.get_evicted(&ttid()).unwrap().end_lsn(), end);
    timelines.set_storage(storage.clone());
    let tl = rt()
        .block_on(restore(&timelines, &ttid()))
        .unwrap()
        .expect("restored");
    assert_eq!(timelines.counts(), (1, 0));
    assert_eq!(
        files(&fs, &dir).len(),
        2,
        "the control file and the end's segment: {:?}",
        files(&fs, &dir)
    );
    check_restored(&tl, &wal, end);
    drop(tl);
    // Restored for good: a restart opens it resident.
    let again = load(&fs);
    assert_eq!(again.counts(), (1, 0));
}

/// The node's last check refuses an eviction whose WAL moved since the decision, or while a
/// proposer is connected; nothing changes.
#[test]
fn an_eviction_is_refused_when_the_wal_moved_or_a_proposer_is_connected() {
    let (_sim, fs, _) = sim_node();
    let storage = memory_store();
    let (timelines, tl, _wal, end) = stored_timeline(&fs, &storage);
    let moved = crate::blocking::section(|| timelines.evict(&tl, Lsn(end.0 - 8)));
    assert!(moved.unwrap_err().to_string().contains("moved"));
    let guard = tl.proposer_guard();
    let busy = crate::blocking::section(|| timelines.evict(&tl, end));
    assert!(busy.unwrap_err().to_string().contains("connected"));
    drop(guard);
    assert_eq!(timelines.counts(), (1, 0));
    assert!(!tl.is_evicted());
    crate::test_util::run(&tl, append_msg(1, end, &[], end));
}

/// A restore that finds nothing in the store holding its WAL fails with a clear error and the
/// timeline stays evicted; once the object is back, the next restore succeeds.
#[test]
fn a_restore_without_its_wal_in_the_store_fails_clearly_and_is_retried() {
    let (_sim, fs, _) = sim_node();
    let storage = memory_store();
    let (timelines, wal, end) = evicted_timeline(&fs, &storage);
    let timelines = Arc::new(timelines);
    let empty = memory_store();
    // A node whose store lost the object (or another store): the restore reads that one.
    let other = Arc::new(load(&fs));
    other.set_storage(empty.clone());
    let err = match rt().block_on(restore(&other, &ttid())) {
        Err(e) => e,
        Ok(_) => panic!("restored without its WAL in the store"),
    };
    let msg = err.to_string();
    assert!(
        matches!(err, TimelineError::RestoreFailed { .. }) && msg.contains("no object"),
        "{msg}"
    );
    assert_eq!(other.counts(), (0, 1), "still evicted");
    drop(other);
    let tl = rt()
        .block_on(restore(&timelines, &ttid()))
        .unwrap()
        .unwrap();
    check_restored(&tl, &wal, end);
}

/// A crash at every file-system operation of an eviction and of a restore, either a process
/// kill or a power loss: the node always loads, its timeline is either resident with all its
/// WAL or evicted with no segment left, and an evicted one restores with all its WAL.
#[test]
fn a_crash_at_any_step_of_eviction_or_restore_loses_nothing() {
    let mut cases = 0;
    for power in [false, true] {
        cases += crash_at_every_op(power, "evict", |sim, op, timelines, tl, end, _| {
            sim.arm_crash_after(op);
            let _ = crate::blocking::section(|| timelines.evict_steps(&tl, end, EvictStep::All));
        });
        cases += crash_at_every_op(power, "restore", |sim, op, timelines, tl, end, storage| {
            crate::blocking::section(|| timelines.evict(&tl, end)).unwrap();
            drop(tl);
            sim.arm_crash_after(op);
            let _ = restore_upto(&timelines, storage, RestoreStep::All);
        });
    }
    assert!(cases > 20, "{cases} crash points");
    // And the steps themselves, stopped where a kill would stop them.
    for upto in [EvictStep::Flag, EvictStep::Registry] {
        let (sim, fs) = SimFs::with_dir(Path::new(DATADIR));
        let storage = memory_store();
        let (timelines, tl, wal, end) = stored_timeline(&fs, &storage);
        crate::blocking::section(|| timelines.evict_steps(&tl, end, upto)).unwrap();
        drop((timelines, tl));
        sim.process_crash();
        check_after_crash(&fs, &storage, &wal, end, &format!("{upto:?}"));
    }
    for upto in [RestoreStep::Download, RestoreStep::Open] {
        let (sim, fs) = SimFs::with_dir(Path::new(DATADIR));
        let storage = memory_store();
        let (timelines, wal, end) = evicted_timeline(&fs, &storage);
        assert!(restore_upto(&timelines, &storage, upto).is_err());
        drop(timelines);
        sim.process_crash();
        check_after_crash(&fs, &storage, &wal, end, &format!("{upto:?}"));
    }
}

/// Runs `act` on a fresh node (its timeline stored, [`stored_timeline`]) with a crash at
/// file-system operation 0, 1, ... (`act` arms it, `sim.arm_crash_after(op)`, where its work
/// starts) until `act` finishes before the crash point; after each crash, a process kill or
/// with `power` a power loss, the node must hold what [`check_after_crash`] requires. Returns
/// how many crash points it ran.
fn crash_at_every_op(
    power: bool,
    what: &str,
    act: impl Fn(&SimFs, u64, GlobalTimelines, Arc<Timeline>, Lsn, &Arc<RemoteStorage>),
) -> u64 {
    for op in 0.. {
        let (sim, fs) = SimFs::with_dir(Path::new(DATADIR));
        let storage = memory_store();
        let (timelines, tl, wal, end) = stored_timeline(&fs, &storage);
        act(&sim, op, timelines, tl, end, &storage);
        let reached = sim.crash_point_reached();
        crash(&sim, power);
        check_after_crash(
            &fs,
            &storage,
            &wal,
            end,
            &format!("{what} op {op} power {power}"),
        );
        if !reached {
            return op + 1;
        }
    }
    unreachable!("a crash point past every operation")
}

fn crash(sim: &SimFs, power: bool) {
    if power {
        sim.power_loss(&mut |_| 0);
    } else {
        sim.process_crash();
    }
}

/// After a crash: the node loads; resident with its WAL to `end`, or evicted with only its
/// control file, in which case it restores with its WAL.
fn check_after_crash(fs: &Fs, storage: &Arc<RemoteStorage>, wal: &[u8], end: Lsn, what: &str) {
    let timelines = load(fs);
    timelines.set_storage(storage.clone());
    match timelines.counts() {
        (1, 0) => {
            let tl = timelines.get(&ttid()).unwrap();
            // Never evicted (all local), or restored (from the end's segment on; the store
            // holds the rest).
            let first = crate::wal_store::first_local_segment(fs, &tl.dir, SEG)
                .unwrap()
                .expect("a local segment");
            let from = START.max(Lsn(first * SEG));
            let mut out = Vec::new();
            tl.read_wal(from, end, &mut out).unwrap();
            assert_eq!(
                out,
                &wal[(from.0 - START.0) as usize..],
                "{what}: resident WAL"
            );
            assert_eq!(tl.positions().flush_lsn, end, "{what}");
        }
        (0, 1) => {
            let dir = timelines.get_evicted(&ttid()).unwrap().dir.clone();
            // (A control file's temporary copy may be left by a cut save: it is not WAL.)
            let left: Vec<String> = files(fs, &dir)
                .into_iter()
                .filter(|n| !n.starts_with(crate::control_file::CONTROL_FILE_NAME))
                .collect();
            assert!(
                left.is_empty(),
                "{what}: an evicted timeline keeps only its control file: {left:?}"
            );
            let tl = restore_upto(&timelines, storage, RestoreStep::All)
                .unwrap_or_else(|e| panic!("{what}: restore: {e}"));
            check_restored(&tl, wal, end);
        }
        other => panic!("{what}: {other:?} timelines"),
    }
}

/// WAL that ends at a segment boundary (a WAL switch) is evicted without a partial object, and
/// restored from its last complete segment (where the start-up's search for the end reads); a
/// timeline without WAL is evicted and restored with no download at all.
#[test]
fn wal_ending_at_a_segment_boundary_and_a_timeline_without_wal_are_restored() {
    for (size, switch) in [(SEG + SEG / 2, true), (0, false)] {
        let (_sim, fs, _) = sim_node();
        let storage = memory_store();
        let (timelines, tl, wal, end) = stored_timeline_with(&fs, &storage, size, switch);
        let what = format!("{size} bytes, switch {switch}, end {end}");
        assert!(
            rt().block_on(storage.list_partials(&ttid(), SEG))
                .unwrap()
                .is_empty(),
            "{what}"
        );
        crate::blocking::section(|| timelines.evict(&tl, end)).unwrap();
        drop((timelines, tl));
        let timelines = Arc::new(load(&fs));
        timelines.set_storage(storage.clone());
        let tl = rt()
            .block_on(restore(&timelines, &ttid()))
            .unwrap_or_else(|e| panic!("{what}: {e}"))
            .expect("restored");
        check_restored(&tl, &wal, end);
    }
}

/// A snapshot (a pull's donor side) of a timeline flagged by an eviction in progress is refused:
/// its state would carry the flag, and its files are about to go.
#[test]
fn a_snapshot_of_a_timeline_being_evicted_is_refused() {
    let (_sim, fs, _) = sim_node();
    let storage = memory_store();
    let (timelines, tl, _wal, end) = stored_timeline(&fs, &storage);
    crate::blocking::section(|| timelines.evict_steps(&tl, end, EvictStep::Flag)).unwrap();
    let err = crate::blocking::section(|| crate::pull::Snapshot::begin(tl.clone(), true))
        .err()
        .expect("refused");
    assert!(err.contains("evicted"), "{err}");
    assert!(matches!(
        timelines.get_or_create(&crate::test_util::greeting(1, SEG), true),
        Err(TimelineError::Evicted(_))
    ));
}

/// A stored copy of the end's segment that does not verify (another node's partial object,
/// valid only from a later start) gives way to the next one; with none that verifies the
/// restore fails naming why, and the timeline stays evicted.
#[test]
fn a_stored_copy_that_does_not_verify_gives_way_to_the_next() {
    let (_sim, fs, _) = sim_node();
    let storage = memory_store();
    let (timelines, wal, end) = evicted_timeline(&fs, &storage);
    let timelines = Arc::new(timelines);
    let segno = end.segment_number(SEG);
    let off = end.segment_offset(SEG) as usize;
    let ours = rt()
        .block_on(download(&storage, &ttid(), SEG, segno, end))
        .unwrap()
        .unwrap();
    // Ours goes (superseded), a longer one of zeros below its start comes first, then a good one.
    let put = |upto: Lsn, data: Vec<u8>| {
        rt().block_on(storage.backup_partial(&ttid(), SEG, 1, upto, data.into(), 0))
            .unwrap();
    };
    rt().block_on(storage.remove_partials_below(&ttid(), SEG, Lsn(end.0 + 1)))
        .unwrap();
    let mut bad = vec![0u8; off + 100];
    bad[off / 2..off].copy_from_slice(&ours[off / 2..off]);
    put(Lsn(end.0 + 100), bad);
    let failed = rt().block_on(restore(&timelines, &ttid()));
    let msg = failed.err().expect("nothing stored restores").to_string();
    assert!(msg.contains("no stored copy"), "{msg}");
    assert_eq!(timelines.counts(), (0, 1), "still evicted");
    let mut good = ours[..off].to_vec();
    good.resize(off + 200, 0);
    put(Lsn(end.0 + 200), good);
    let tl = rt()
        .block_on(restore(&timelines, &ttid()))
        .unwrap()
        .expect("restored from the good copy");
    check_restored(&tl, &wal, end);
}
