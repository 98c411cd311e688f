//! Tests of the WAL file store: durability across reopen and simulated power loss, segment
//! preparation, gathering of small appends, truncation, recovery and the reader.

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::time::Duration;

use sk_core::storage::fs::{FileSystem, OpenMode};

use super::*;
use pg_wal::{RecordPos, WalGenerator};

const SEG: u64 = 1 << 20;

fn opts() -> WalFileOptions {
    WalFileOptions {
        no_sync: false,
        system_id: 77,
        major: PgMajor::V15,
        wal_start_lsn: Lsn::INVALID,
        zero_fill: false,
        prepare_below_rate: 0,
        fs: Fs::default(),
        background: Background::default(),
        open_files: OpenFiles::default(),
        pool: None,
    }
}

/// A store holding nothing, ready for WAL at `start`.
fn fresh(dir: &Path, start: Lsn) -> WalFileStore {
    fresh_with(dir, start, opts())
}

fn fresh_with(dir: &Path, start: Lsn, o: WalFileOptions) -> WalFileStore {
    let mut s = WalFileStore::open(dir, SEG, Lsn::INVALID, o).unwrap();
    s.initialize_first_segment(start).unwrap();
    s.truncate_wal(start).unwrap();
    s
}

fn gen_wal(start: Lsn, sizes: &[usize]) -> (Vec<u8>, Vec<RecordPos>) {
    let mut g = WalGenerator::new(77, SEG, start).unwrap();
    let mut out = Vec::new();
    let msg = vec![0x42u8; sizes.iter().copied().max().unwrap_or(0)];
    let pos = sizes
        .iter()
        .map(|&n| g.append_logical_message(&mut out, &msg[..n]))
        .collect();
    (out, pos)
}

fn reopen(dir: &Path, commit: Lsn) -> Result<WalFileStore> {
    WalFileStore::open(dir, SEG, commit, opts())
}

/// Reopens the store in `dir` from `commit` and checks that it recovers exactly `bytes`
/// (the WAL from `start`) as durable.
fn assert_recovers(dir: &Path, commit: Lsn, o: WalFileOptions, start: Lsn, bytes: &[u8]) {
    let end = Lsn(start.0 + bytes.len() as u64);
    let s = WalFileStore::open(dir, SEG, commit, o).unwrap();
    assert_eq!(s.flush_lsn(), end);
    let mut back = Vec::new();
    s.read_wal(start, end, &mut back).unwrap();
    assert_eq!(back, bytes);
}

/// A simulated file system holding the empty directory `/tl`.
fn sim_dir() -> (
    std::sync::Arc<sk_core::storage::fs::SimFs>,
    Fs,
    &'static Path,
) {
    let dir = Path::new("/tl");
    let (sim, fs) = sk_core::storage::fs::SimFs::with_dir(dir);
    (sim, fs, dir)
}

#[test]
fn written_and_flushed_wal_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 8192 + 128);
    let mut s = fresh(dir.path(), start);
    let (bytes, pos) = gen_wal(start, &[10, 20_000, 300, 5]);
    s.write_wal(start, &bytes).unwrap();
    let end = pos.last().unwrap().end;
    assert_eq!((s.write_lsn(), s.write_record_lsn()), (end, end));
    assert_eq!(s.flush_lsn(), start, "nothing durable before flush");
    s.flush_wal().unwrap();
    assert_eq!(s.flush_lsn(), end);
    drop(s);
    assert_recovers(dir.path(), pos[1].end, opts(), start, &bytes);
}

/// On a file system that forgets un-synced directory entries (promise 1): WAL flushed
/// across a segment boundary survives the harshest power loss, because every new segment's
/// name is made durable (directory fsync) before WAL goes into it. Without that fsync the
/// segments vanish and the reopen finds nothing.
#[test]
fn flushed_wal_survives_power_loss_that_forgets_unsynced_directory_entries() {
    let (sim, fs, dir) = sim_dir();
    let o = WalFileOptions { fs, ..opts() };
    let start = Lsn(2 * SEG - 3 * 8192);
    let mut s = fresh_with(dir, start, o.clone());
    let (all, pos) = gen_wal(start, &[20_000, 9_000, 30_000, 100, 50]);
    let end = pos[3].end;
    let bytes = &all[..(end.0 - start.0) as usize];
    s.write_wal(start, bytes).unwrap();
    s.flush_wal().unwrap();
    assert!(end.segment_number(SEG) > start.segment_number(SEG));
    assert_eq!(s.flush_lsn(), end);
    // Written but never flushed: may be lost.
    s.write_wal(end, &all[bytes.len()..]).unwrap();
    drop(s);
    sim.power_loss(&mut |_| 0);
    assert_recovers(dir, pos[0].end, o, start, bytes);
}

/// The LRU of open segment files (cap 1, two stores on a file system that forgets unsynced
/// writes at a power loss): opening B's segment evicts A's, fsyncing A's unflushed WAL before the
/// descriptor closes; A's next write opens its segment again (evicting B, fsynced likewise);
/// readers are unaffected; and after a power loss both stores recover every byte written, though
/// B never flushed and A flushed only its last write. Without the fsync before the close the
/// unflushed bytes are gone.
#[test]
fn evicted_segment_is_fsynced_before_close_and_reopened_on_the_next_write() {
    let (sim, fs, _) = sim_dir();
    let files = OpenFiles::new(1);
    let o = WalFileOptions {
        fs,
        open_files: files.clone(),
        ..opts()
    };
    let (a_dir, b_dir) = (Path::new("/a"), Path::new("/b"));
    let start = Lsn(SEG + 8192);
    let mut a = fresh_with(a_dir, start, o.clone());
    let mut b = fresh_with(b_dir, start, o.clone());
    assert_eq!(files.open(), 0, "initialization closes its file");
    // Big enough to be written at once rather than gathered in memory.
    let (all, pos) = gen_wal(start, &[20_000; 8]);
    let mid = pos[3].end;
    let first = &all[..(mid.0 - start.0) as usize];
    a.write_wal(start, first).unwrap();
    assert_eq!((files.open(), files.evictions()), (1, 0));
    b.write_wal(start, &all).unwrap();
    assert_eq!(
        (files.open(), files.evictions()),
        (1, 1),
        "B's file evicted A's"
    );
    // A reader opens its own descriptor: an evicted segment reads as before (up to what was
    // written; callers read only below the flush LSN).
    let mut back = Vec::new();
    a.read_wal(start, mid, &mut back).unwrap();
    assert_eq!(back, first);
    // A writes more: its segment is opened again, B's is evicted.
    a.write_wal(mid, &all[first.len()..]).unwrap();
    a.flush_wal().unwrap();
    assert_eq!((files.open(), files.evictions()), (1, 2));
    let end = pos.last().unwrap().end;
    assert_eq!(a.flush_lsn(), end);
    assert_eq!(b.flush_lsn(), start, "B never flushed");
    drop((a, b));
    assert_eq!(files.open(), 0, "a dropped store closes its file");
    sim.power_loss(&mut |_| 0);
    assert_recovers(a_dir, pos[0].end, o.clone(), start, &all);
    assert_recovers(b_dir, pos[0].end, o, start, &all);
}

/// Many stores, a small cap: however many timelines write, at most the cap of segment files is
/// open, and every store's flushed WAL reads back intact after its file was evicted.
#[test]
fn open_segment_files_stay_under_the_cap() {
    let dir = tempfile::tempdir().unwrap();
    let files = OpenFiles::new(3);
    let o = WalFileOptions {
        open_files: files.clone(),
        ..opts()
    };
    let start = Lsn(SEG + 8192);
    let (all, pos) = gen_wal(start, &[100_000, 100_000]);
    let mid = pos[0].end;
    let mut stores: Vec<_> = (0..10)
        .map(|i| fresh_with(&dir.path().join(i.to_string()), start, o.clone()))
        .collect();
    for (from, to) in [(start, mid), (mid, pos[1].end)] {
        for s in &mut stores {
            let bytes = &all[(from.0 - start.0) as usize..(to.0 - start.0) as usize];
            s.write_wal(from, bytes).unwrap();
            s.flush_wal().unwrap();
            assert!(files.open() <= 3, "{} open", files.open());
        }
    }
    assert_eq!(files.evictions(), 2 * 10 - 3);
    for s in &stores {
        let mut back = Vec::new();
        s.read_wal(start, s.flush_lsn(), &mut back).unwrap();
        assert_eq!(back, all);
    }
}

/// Writes `records` of `bytes` (WAL from `start`) one per call, waiting after each for a
/// segment being prepared, so the background thread's work happens at fixed points.
fn write_waiting_for_preparation(
    s: &mut WalFileStore,
    start: Lsn,
    bytes: &[u8],
    records: &[RecordPos],
) {
    let mut at = start;
    for p in records {
        let off = (at.0 - start.0) as usize;
        let n = (p.end.0 - at.0) as usize;
        s.write_wal(at, &bytes[off..off + n]).unwrap();
        s.wait_for_prepared_segment();
        at = p.end;
    }
}

/// Slow WAL gets its next segments prepared off the ingest path: the current segment, only
/// partly written, has all its blocks allocated (it was zero-filled), unlike a sparse one;
/// its WAL reads back and survives a reopen. Not under `no_sync` (the zeros only spare an
/// fdatasync its block allocation).
#[test]
fn slow_wal_gets_zero_filled_segments_prepared_in_the_background() {
    use std::os::unix::fs::MetadataExt;
    let allocated = |dir: &Path, segno: u64| {
        std::fs::metadata(segment_path(dir, segno, SEG, true))
            .unwrap()
            .blocks()
            * 512
    };
    let start = Lsn(SEG + 8192);
    let (bytes, pos) = gen_wal(start, &[100_000; 35]);
    let end = pos.last().unwrap().end;
    let last = end.segment_number(SEG);
    assert!(last >= 4 && end.segment_offset(SEG) < SEG / 2);
    for (rate, no_sync, prepared) in [
        (u64::MAX, false, true),
        (0, false, false),
        (u64::MAX, true, false),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let o = WalFileOptions {
            prepare_below_rate: rate,
            no_sync,
            ..opts()
        };
        let mut s = fresh_with(dir.path(), start, o.clone());
        write_waiting_for_preparation(&mut s, start, &bytes, &pos);
        s.flush_wal().unwrap();
        assert_eq!(s.flush_lsn(), end);
        let blocks = allocated(dir.path(), last);
        assert_eq!(
            blocks >= SEG,
            prepared,
            "{blocks} bytes allocated, rate {rate}, no_sync {no_sync}"
        );
        drop(s);
        assert_recovers(dir.path(), pos[0].end, o, start, &bytes);
    }
}

/// A prepared segment's new name is durable before WAL goes into it: flushed WAL in
/// prepared segments survives the harshest power loss on the simulated file system.
#[test]
fn flushed_wal_in_prepared_segments_survives_power_loss() {
    let (sim, fs, dir) = sim_dir();
    let o = WalFileOptions {
        prepare_below_rate: u64::MAX,
        fs,
        ..opts()
    };
    let start = Lsn(SEG + 8192);
    let (bytes, pos) = gen_wal(start, &[100_000; 35]);
    let mut s = fresh_with(dir, start, o.clone());
    write_waiting_for_preparation(&mut s, start, &bytes, &pos);
    s.flush_wal().unwrap();
    let end = pos.last().unwrap().end;
    assert_eq!(s.flush_lsn(), end);
    drop(s);
    sim.power_loss(&mut |_| 0);
    assert_recovers(dir, pos[0].end, o, start, &bytes);
    assert!(
        !sim.exists(&dir.join(PREPARED_SEGMENT_NAME)),
        "leftover removed at open"
    );
}

/// Writes `records` of `bytes` (WAL from `start`) one per call, calling `between` after each.
fn write_records(
    s: &mut WalFileStore,
    start: Lsn,
    bytes: &[u8],
    records: &[RecordPos],
    mut between: impl FnMut(&mut WalFileStore),
) {
    let mut at = start;
    for p in records {
        let off = (at.0 - start.0) as usize;
        s.write_wal(at, &bytes[off..(p.end.0 - start.0) as usize])
            .unwrap();
        between(s);
        at = p.end;
    }
}

/// Options for a store on `fs` whose preparations run inline on `clock` and that prepares
/// segments filled slower than one per second.
fn inline_prep(fs: Fs, clock: &std::sync::Arc<Inline>) -> WalFileOptions {
    WalFileOptions {
        prepare_below_rate: SEG,
        fs,
        background: Background::new(clock.clone()),
        ..opts()
    }
}

/// The fill rate is measured on the injected clock: a segment filled while the clock stood
/// still gets no successor prepared; one that took two (simulated) seconds does, and the
/// preparation ran at once, on the writer's thread.
#[test]
fn preparation_follows_the_injected_clock() {
    let start = Lsn(SEG + 8192);
    let (bytes, pos) = gen_wal(start, &[100_000; 12]);
    assert_eq!(pos.last().unwrap().end.segment_number(SEG), 2);
    for (step, prepared) in [(Duration::ZERO, false), (Duration::from_millis(200), true)] {
        let (sim, fs, dir) = sim_dir();
        let clock = Inline::new();
        let mut s = fresh_with(dir, start, inline_prep(fs, &clock));
        write_records(&mut s, start, &bytes, &pos, |_| clock.advance(step));
        assert_eq!(
            sim.exists(&dir.join(PREPARED_SEGMENT_NAME)),
            prepared,
            "clock step {step:?}"
        );
    }
}

/// A power failure at any file-system call of an ingest whose segments are prepared inline
/// (the preparation's own create, write, fsync and the rename that takes it in included) loses
/// no flushed WAL, and the reopened store removes a half-prepared leftover.
#[test]
fn a_crash_anywhere_during_segment_preparation_loses_no_flushed_wal() {
    let start = Lsn(SEG + 8192);
    let (bytes, pos) = gen_wal(start, &[100_000; 25]);
    assert!(pos.last().unwrap().end.segment_number(SEG) >= 3);
    for crash_at in 0.. {
        let (sim, fs, dir) = sim_dir();
        let clock = Inline::new();
        let o = inline_prep(fs, &clock);
        let mut s = fresh_with(dir, start, o.clone());
        sim.arm_crash_after(crash_at);
        let mut durable = start;
        write_records(&mut s, start, &bytes, &pos, |s| {
            clock.advance(Duration::from_secs(2));
            s.flush_wal().unwrap();
            if !sim.crash_point_reached() {
                durable = s.flush_lsn();
            }
        });
        drop(s);
        if !sim.crash_point_reached() {
            assert!(
                crash_at > 20,
                "the ingest makes more than 20 file-system calls"
            );
            break;
        }
        sim.power_loss(&mut |_| 0);
        let s = WalFileStore::open(dir, SEG, start, o).unwrap();
        let end = s.flush_lsn();
        assert!(
            end >= durable,
            "crash at {crash_at}: {end} < flushed {durable}"
        );
        let mut back = Vec::new();
        s.read_wal(start, end, &mut back).unwrap();
        assert_eq!(back, bytes[..back.len()], "crash at {crash_at}");
        assert!(!sim.exists(&dir.join(PREPARED_SEGMENT_NAME)));
    }
}

#[test]
fn small_appends_are_gathered_and_durable_after_flush() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 8192);
    let mut s = fresh(dir.path(), start);
    let (bytes, pos) = gen_wal(start, &[100; 200]);
    let mut at = start;
    for p in &pos {
        let n = (p.end.0 - at.0) as usize;
        let off = (at.0 - start.0) as usize;
        s.write_wal(at, &bytes[off..off + n]).unwrap();
        at = p.end;
    }
    assert_eq!(s.write_lsn(), at);
    assert_eq!(s.flush_lsn(), start, "nothing durable before flush");
    s.flush_wal().unwrap();
    assert_eq!(s.flush_lsn(), at);
    drop(s);
    let s = reopen(dir.path(), pos[0].end).unwrap();
    assert_eq!(s.flush_lsn(), at, "every gathered byte reached the disk");
    let mut back = Vec::new();
    s.read_wal(start, at, &mut back).unwrap();
    assert_eq!(back, bytes);
}

/// Promise 7, a full disk: the write that fails says so (`NoSpace`, not an I/O error), reveals
/// nothing it did not write (the flush LSN stays at what was acknowledged), keeps the WAL it
/// took (gathered appends are written out again once space returns), and the same store goes
/// on: after a power loss every byte is there. Without keeping the gathered bytes, the next
/// flush would claim WAL that never reached the file.
#[test]
fn a_full_disk_fails_the_flush_and_the_store_resumes_when_space_returns() {
    let (sim, fs, dir) = sim_dir();
    let o = WalFileOptions { fs, ..opts() };
    let start = Lsn(SEG + 8192);
    let mut s = fresh_with(dir, start, o.clone());
    let (bytes, pos) = gen_wal(start, &[100; 60]);
    let mut at = start;
    let mut write = |s: &mut WalFileStore, upto: usize| {
        for p in &pos[..upto] {
            if p.end <= at {
                continue;
            }
            let off = (at.0 - start.0) as usize;
            s.write_wal(at, &bytes[off..(p.end.0 - start.0) as usize])
                .unwrap();
            at = p.end;
        }
    };
    write(&mut s, 20);
    s.flush_wal().unwrap();
    let acked = s.flush_lsn();
    assert_eq!(acked, pos[19].end);
    // Small appends are gathered: they reach the file at the flush, which the full disk fails.
    write(&mut s, 40);
    sim.set_full(true);
    let err = s.flush_wal().unwrap_err();
    assert!(matches!(err, Error::NoSpace(_)), "{err}");
    assert_eq!(s.flush_lsn(), acked, "a failed flush revealed nothing");
    let err = s.flush_wal().unwrap_err();
    assert!(matches!(err, Error::NoSpace(_)), "still full: {err}");
    sim.set_full(false);
    s.flush_wal().unwrap();
    assert_eq!(s.flush_lsn(), pos[39].end);
    write(&mut s, 60);
    s.flush_wal().unwrap();
    drop(s);
    sim.power_loss(&mut |_| 0);
    assert_recovers(dir, acked, o, start, &bytes);
}

#[test]
fn truncation_keeps_gathered_bytes_below_end_and_drops_the_rest() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 8192);
    let mut s = fresh(dir.path(), start);
    let (bytes, pos) = gen_wal(start, &[100; 20]);
    s.write_wal(start, &bytes).unwrap();
    // Nothing flushed: the truncation itself must write what stays.
    let keep = pos[9].end;
    s.truncate_wal(keep).unwrap();
    assert_eq!((s.write_lsn(), s.flush_lsn()), (keep, keep));
    let (more, more_pos) = gen_wal_from(keep, pos[9].start, &[50; 3]);
    s.write_wal(keep, &more).unwrap();
    s.flush_wal().unwrap();
    let end = more_pos.last().unwrap().end;
    drop(s);
    let s = reopen(dir.path(), keep).unwrap();
    assert_eq!(s.flush_lsn(), end);
    let mut back = Vec::new();
    s.read_wal(start, end, &mut back).unwrap();
    let mut want = bytes[..(keep.0 - start.0) as usize].to_vec();
    want.extend_from_slice(&more);
    assert_eq!(back, want);
}

fn gen_wal_from(start: Lsn, prev: Lsn, sizes: &[usize]) -> (Vec<u8>, Vec<RecordPos>) {
    let mut g = WalGenerator::new(77, SEG, start).unwrap().with_prev(prev);
    let mut out = Vec::new();
    let msg = vec![0x17u8; sizes.iter().copied().max().unwrap_or(0)];
    let pos = sizes
        .iter()
        .map(|&n| g.append_logical_message(&mut out, &msg[..n]))
        .collect();
    (out, pos)
}

#[test]
fn append_with_gap_or_rewrite_is_rejected() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let mut s = fresh(dir.path(), start);
    let (bytes, pos) = gen_wal(start, &[100, 100]);
    let mid = (pos[0].end.0 - start.0) as usize;
    s.write_wal(start, &bytes[..mid]).unwrap();
    let gap = s.write_wal(Lsn(pos[0].end.0 + 8), &bytes[mid..]);
    assert!(
        matches!(gap, Err(Error::Rejected(ref m)) if m.contains("gap")),
        "{gap:?}"
    );
    let rewrite = s.write_wal(start, &bytes[..mid]);
    assert!(matches!(rewrite, Err(Error::Rejected(ref m)) if m.contains("rewrite")));
    s.write_wal(pos[0].end, &bytes[mid..]).unwrap();
    assert_eq!(s.write_record_lsn(), pos[1].end);
}

#[test]
fn writes_are_refused_until_the_first_truncation_after_start() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let mut s = fresh(dir.path(), start);
    let (bytes, pos) = gen_wal(start, &[100, 100]);
    s.write_wal(start, &bytes).unwrap();
    s.flush_wal().unwrap();
    drop(s);
    let end = pos[1].end;
    let mut s = reopen(dir.path(), pos[0].end).unwrap();
    let (more, _) = gen_wal(end, &[1]);
    assert!(matches!(s.write_wal(end, &more), Err(Error::Rejected(_))));
    s.truncate_wal(end).unwrap();
    // The generator's first record has xl_prev 0, which the fresh decoder cannot check.
    s.write_wal(end, &more).unwrap();
}

#[test]
fn undecodable_write_is_refused_before_touching_disk() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let mut s = fresh(dir.path(), start);
    let (mut bytes, _) = gen_wal(start, &[100]);
    let last = bytes.len() - 10;
    bytes[last] ^= 0xff;
    assert!(matches!(
        s.write_wal(start, &bytes),
        Err(Error::Rejected(_))
    ));
    assert_eq!(s.write_lsn(), start);
}

#[test]
fn segment_completion_renames_partial_and_advances_flush_lsn() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let mut s = fresh(dir.path(), start);
    let mut g = WalGenerator::new(77, SEG, start).unwrap();
    let mut bytes = Vec::new();
    while g.lsn().0 < 2 * SEG + 4096 {
        g.append_logical_message(&mut bytes, &[1; 1000]);
    }
    let seg_end = (SEG) as usize; // bytes up to the end of segment 1
    s.write_wal(start, &bytes[..seg_end - 4096]).unwrap();
    assert!(segment_path(dir.path(), 1, SEG, true).exists());
    assert_eq!(s.flush_lsn(), start);
    s.write_wal(Lsn(2 * SEG - 4096), &bytes[seg_end - 4096..seg_end + 100])
        .unwrap();
    assert!(!segment_path(dir.path(), 1, SEG, true).exists());
    assert!(segment_path(dir.path(), 1, SEG, false).exists());
    assert!(segment_path(dir.path(), 2, SEG, true).exists());
    // The completed segment was fsynced: flush_lsn covers every record ending in it.
    assert!(s.flush_lsn().0 > 2 * SEG - 1100 && s.flush_lsn().0 <= 2 * SEG);
    assert_eq!(s.flush_byte_lsn(), Lsn(2 * SEG));
    assert_eq!(s.write_lsn(), Lsn(2 * SEG + 100));
}

#[test]
fn torn_tail_truncated_to_last_valid_record() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 8192 - 64);
    let mut s = fresh(dir.path(), start);
    // The last record spans a page boundary.
    let (bytes, pos) = gen_wal(start, &[30, 200, 9000]);
    s.write_wal(start, &bytes).unwrap();
    s.flush_wal().unwrap();
    drop(s);
    let path = segment_path(dir.path(), 1, SEG, true);
    let pristine = std::fs::read(&path).unwrap();
    let last = pos[2];
    let commit = pos[0].end;
    let seg_off = |l: Lsn| l.segment_offset(SEG) as usize;
    // Cut the file at every offset inside the last record (the rest reads as zeros).
    // Going down, each step zeroes one more byte.
    let f = OpenOptions::new().write(true).open(&path).unwrap();
    // The record's last byte (a message byte, non-zero); what follows is alignment padding.
    let last_byte = pristine[..seg_off(last.end)]
        .iter()
        .rposition(|&b| b != 0)
        .unwrap();
    for cut in (seg_off(last.chunk_start)..=last_byte).rev() {
        f.write_all_at(&[0], cut as u64).unwrap();
        let s = reopen(dir.path(), commit).unwrap();
        assert_eq!(s.flush_lsn(), pos[1].end, "cut at segment offset {cut}");
    }
    drop(f);
    // A file physically shorter than the segment is handled the same way.
    let short = &pristine[..seg_off(last.start) + 100];
    std::fs::write(&path, short).unwrap();
    assert_eq!(reopen(dir.path(), commit).unwrap().flush_lsn(), pos[1].end);
}

/// Writes `bytes` (WAL from `start`) durably into a fresh store in `dir` and returns the path
/// of segment `segno` and its content.
fn written(dir: &Path, start: Lsn, bytes: &[u8], segno: u64) -> (PathBuf, Vec<u8>) {
    let mut s = fresh(dir, start);
    s.write_wal(start, bytes).unwrap();
    s.flush_wal().unwrap();
    drop(s);
    let path = segment_path(dir, segno, SEG, true);
    let path = if path.exists() {
        path
    } else {
        segment_path(dir, segno, SEG, false)
    };
    let data = std::fs::read(&path).unwrap();
    (path, data)
}

/// Issue 13, item 3: a damaged record followed by valid WAL (no never-written sector between)
/// is corruption in the middle of the log, not its end: start-up refuses, naming the segment
/// file, the LSN and what was expected there, instead of silently dropping the records after
/// it.
#[test]
fn corrupt_record_in_the_middle_refuses_start() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let (bytes, pos) = gen_wal(start, &[100; 20]);
    let (path, mut data) = written(dir.path(), start, &bytes, 1);
    data[pos[10].start.segment_offset(SEG) as usize + 60] ^= 0x20;
    std::fs::write(&path, &data).unwrap();
    let err = reopen(dir.path(), pos[3].end).unwrap_err();
    let Error::WalCorruption {
        file,
        lsn,
        expected,
        valid_at,
        ..
    } = &err
    else {
        panic!("expected WAL corruption, got {err}");
    };
    assert_eq!(*file, path.display().to_string());
    assert_eq!((*lsn, *valid_at), (pos[10].start, pos[11].start));
    assert!(expected.contains("CRC"), "{expected}");
    let msg = err.to_string();
    for part in [path.display().to_string(), pos[10].start.to_string()] {
        assert!(msg.contains(&part), "{msg} lacks {part}");
    }
}

/// The same for a damaged page header in the middle of a segment, and for a damaged record at
/// the end of one segment with valid WAL in the next.
#[test]
fn corrupt_page_header_or_record_before_valid_wal_refuses_start() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let (bytes, pos) = gen_wal(start, &[3000; 40]);
    let (path, pristine) = written(dir.path(), start, &bytes, 1);
    let mut data = pristine.clone();
    data[3 * 8192] ^= 0x01; // the magic of the fourth page
    std::fs::write(&path, &data).unwrap();
    let err = reopen(dir.path(), pos[0].end).unwrap_err();
    assert!(
        matches!(err, Error::WalCorruption { lsn, .. } if lsn == Lsn(SEG + 3 * 8192)),
        "{err}"
    );
    assert!(err.to_string().contains("magic"), "{err}");

    // The record crossing into segment 2 damaged in segment 1; segment 2 valid.
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(2 * SEG - 4 * 8192);
    let (bytes, pos) = gen_wal(start, &[1000; 60]);
    let across = pos
        .iter()
        .position(|p| p.start.0 < 2 * SEG && p.end.0 > 2 * SEG)
        .unwrap();
    assert!(pos.last().unwrap().start.0 > 2 * SEG + 8192);
    let (path, mut data) = written(dir.path(), start, &bytes, 1);
    data[(pos[across].start.segment_offset(SEG) + 30) as usize] ^= 0x04;
    std::fs::write(&path, &data).unwrap();
    let err = reopen(dir.path(), pos[0].end).unwrap_err();
    assert!(
        matches!(err, Error::WalCorruption { lsn, valid_at, .. }
            if lsn == pos[across].start && valid_at == pos[across + 1].start),
        "{err}"
    );
}

/// A page that never reached the disk in the middle of the unsynced tail (writeback out of
/// order before a power loss) is a torn tail even with valid WAL after it: an `fdatasync`
/// covers every earlier write, so nothing past the hole was acknowledged. The same for a
/// zeroed 512-byte sector inside a record (etcd's `TestRepairWriteTearMiddle`).
#[test]
fn never_written_hole_before_valid_wal_is_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let (bytes, pos) = gen_wal(start, &[3000; 40]);
    let (path, pristine) = written(dir.path(), start, &bytes, 1);
    let hole = 5 * 8192;
    let before_hole = pos
        .iter()
        .rfind(|p| p.end.0 <= SEG + hole as u64)
        .unwrap()
        .end;
    let mut data = pristine.clone();
    data[hole..hole + 8192].fill(0);
    std::fs::write(&path, &data).unwrap();
    assert_eq!(
        reopen(dir.path(), pos[0].end).unwrap().flush_lsn(),
        before_hole
    );

    let mut data = pristine.clone();
    let victim = pos[20];
    let sector = (victim.start.segment_offset(SEG) as usize).next_multiple_of(512) + 512;
    assert!(sector + 512 < victim.end.segment_offset(SEG) as usize);
    data[sector..sector + 512].fill(0);
    std::fs::write(&path, &data).unwrap();
    assert_eq!(
        reopen(dir.path(), pos[0].end).unwrap().flush_lsn(),
        pos[19].end
    );
}

/// A record after the end whose CRC is valid but whose `xl_prev` does not link to the last
/// record is stale (an older generation's), as PostgreSQL treats it: the end of WAL, not
/// corruption.
#[test]
fn stale_record_after_the_end_is_the_end_of_wal() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 8192);
    let (bytes, pos) = gen_wal(start, &[500; 10]);
    let end = pos[9].end;
    let (stale, _) = gen_wal_from(end, Lsn(SEG + 16), &[500; 5]);
    let (path, mut data) = written(dir.path(), start, &bytes, 1);
    let off = end.segment_offset(SEG) as usize;
    data[off..off + stale.len()].copy_from_slice(&stale);
    std::fs::write(&path, &data).unwrap();
    assert_eq!(reopen(dir.path(), pos[2].end).unwrap().flush_lsn(), end);
}

#[test]
fn recovery_refuses_when_wal_ends_below_commit_lsn() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 8192 * 3 + 64);
    let mut s = fresh(dir.path(), start);
    let (bytes, pos) = gen_wal(start, &[5000; 10]);
    s.write_wal(start, &bytes).unwrap();
    s.flush_wal().unwrap();
    drop(s);
    let commit = pos[8].end;
    // Lose the page holding the byte before commit_lsn.
    let path = segment_path(dir.path(), 1, SEG, true);
    let mut data = std::fs::read(&path).unwrap();
    let page = Lsn(commit.0 - 1).page_start().segment_offset(SEG) as usize;
    data[page..].fill(0);
    std::fs::write(&path, &data).unwrap();
    let o = WalFileOptions {
        wal_start_lsn: start,
        ..opts()
    };
    let err = WalFileStore::open(dir.path(), SEG, commit, o.clone()).unwrap_err();
    let msg = err.to_string();
    assert!(matches!(err, Error::Corruption { .. }), "{msg}");
    assert!(msg.contains(&commit.to_string()), "{msg}");
    assert!(
        msg.contains(&Lsn(commit.0 - 1).page_start().to_string()),
        "{msg}"
    );
    // A missing segment is refused even without knowing where the WAL starts.
    std::fs::remove_file(&path).unwrap();
    let err = reopen(dir.path(), commit).unwrap_err();
    assert!(err.to_string().contains(&commit.to_string()), "{err}");
    assert!(err.to_string().contains(&Lsn(SEG).to_string()), "{err}");
}

#[test]
fn truncation_across_a_segment_boundary() {
    truncation_across_a_segment_boundary_with(opts());
}

#[test]
fn truncation_across_a_segment_boundary_with_zero_filled_segments() {
    truncation_across_a_segment_boundary_with(WalFileOptions {
        zero_fill: true,
        ..opts()
    });
}

fn truncation_across_a_segment_boundary_with(o: WalFileOptions) {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let mut s = fresh_with(dir.path(), start, o.clone());
    let (bytes, pos) = gen_wal(start, &[100_000; 25]);
    assert!(pos.last().unwrap().end.0 > 3 * SEG);
    s.write_wal(start, &bytes).unwrap();
    s.flush_wal().unwrap();
    // Truncate into segment 1, after a record that ends there.
    let keep = pos.iter().rfind(|p| p.end.0 < 2 * SEG).unwrap().end;
    s.truncate_wal(keep).unwrap();
    assert_eq!(
        (s.write_lsn(), s.write_record_lsn(), s.flush_lsn()),
        (keep, keep, keep)
    );
    assert!(
        segment_path(dir.path(), 1, SEG, true).exists(),
        "end segment is current again"
    );
    assert!(!segment_path(dir.path(), 1, SEG, false).exists());
    for segno in 2..5 {
        assert!(!segment_path(dir.path(), segno, SEG, true).exists());
        assert!(!segment_path(dir.path(), segno, SEG, false).exists());
    }
    // The tail is zero and recovery finds `keep`.
    let data = std::fs::read(segment_path(dir.path(), 1, SEG, true)).unwrap();
    assert_eq!(data.len() as u64, SEG);
    assert!(
        data[keep.segment_offset(SEG) as usize..]
            .iter()
            .all(|&b| b == 0)
    );
    drop(s);
    let mut s = WalFileStore::open(dir.path(), SEG, start, o).unwrap();
    assert_eq!(s.flush_lsn(), keep);
    // Writing resumes after the truncation with the rest of the stream.
    s.truncate_wal(keep).unwrap();
    let off = (keep.0 - start.0) as usize;
    s.write_wal(keep, &bytes[off..]).unwrap();
    s.flush_wal().unwrap();
    assert_eq!(s.flush_lsn(), pos.last().unwrap().end);
    // Truncating above the end is refused.
    let beyond = Lsn(s.write_record_lsn().0 + 8);
    assert!(matches!(s.truncate_wal(beyond), Err(Error::Rejected(_))));
}

#[test]
fn truncation_at_a_segment_boundary_keeps_the_completed_segment() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let mut s = fresh(dir.path(), start);
    let mut g = WalGenerator::new(77, SEG, start).unwrap();
    let mut bytes = Vec::new();
    let mut boundary = None;
    while g.lsn().0 < 2 * SEG + 50_000 {
        let p = g.append_logical_message(&mut bytes, &[3; 3000]);
        if p.end.0 >= 2 * SEG && boundary.is_none() {
            boundary = Some(p.end);
        }
    }
    s.write_wal(start, &bytes).unwrap();
    s.flush_wal().unwrap();
    let b = boundary.unwrap();
    s.truncate_wal(b).unwrap();
    assert_eq!(s.flush_lsn(), b);
    drop(s);
    assert_eq!(reopen(dir.path(), start).unwrap().flush_lsn(), b);
}

#[test]
fn removes_old_segments_but_not_the_current_one() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG);
    let mut s = fresh(dir.path(), start);
    let (bytes, _) = gen_wal(start, &[200_000; 16]);
    s.write_wal(start, &bytes).unwrap();
    let cur = s.write_lsn().segment_number(SEG);
    assert!(cur >= 3);
    assert!(matches!(
        s.remove_segments_up_to(cur),
        Err(Error::Rejected(_))
    ));
    assert_eq!(s.remove_segments_up_to(cur - 1).unwrap() as u64, cur - 1);
    assert!(segment_path(dir.path(), cur, SEG, true).exists());
    assert!(!segment_path(dir.path(), cur - 1, SEG, false).exists());
}

#[test]
fn reader_reads_across_segments_and_names() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 4096);
    let mut s = fresh(dir.path(), start);
    let (bytes, pos) = gen_wal(start, &[150_000; 10]);
    s.write_wal(start, &bytes).unwrap();
    let end = pos.last().unwrap().end;
    assert!(end.segment_number(SEG) == 2);
    let mut out = vec![9u8];
    s.reader()
        .read(Lsn(2 * SEG - 100), Lsn(2 * SEG + 100), &mut out)
        .unwrap();
    let at = (2 * SEG - 100 - start.0) as usize;
    assert_eq!(&out[1..], &bytes[at..at + 200]);
    // Reading past the existing segments fails and leaves `out` untouched.
    let mut out2 = Vec::new();
    assert!(
        s.read_wal(Lsn(3 * SEG - 10), Lsn(3 * SEG + 10), &mut out2)
            .is_err()
    );
    assert!(out2.is_empty());
}

/// The WAL stream a proposer would send: records generated on demand, rewound on
/// truncation (the following records then differ from the old ones).
struct Model {
    start: Lsn,
    stream: Vec<u8>,
    recs: Vec<RecordPos>,
    generator: WalGenerator,
}

impl Model {
    fn new(start: Lsn) -> Model {
        Model {
            start,
            stream: Vec::new(),
            recs: Vec::new(),
            generator: WalGenerator::new(77, SEG, start).unwrap(),
        }
    }

    fn bytes(&mut self, rng: &mut rand::rngs::SmallRng, from: Lsn, n: usize) -> &[u8] {
        use rand::Rng;
        while self.start.0 + (self.stream.len() as u64) < from.0 + n as u64 {
            let size = match rng.random_range(0..10) {
                0 => rng.random_range(8_000..60_000),
                _ => rng.random_range(0..2_000),
            };
            let fill = rng.random::<u8>() | 1;
            let p = self
                .generator
                .append_logical_message(&mut self.stream, &vec![fill; size]);
            self.recs.push(p);
        }
        let at = (from.0 - self.start.0) as usize;
        &self.stream[at..at + n]
    }

    /// Ends of complete records at or below `lsn`.
    fn last_end_at_or_below(&self, lsn: Lsn) -> Lsn {
        self.recs
            .iter()
            .rev()
            .map(|p| p.end)
            .find(|&e| e <= lsn)
            .unwrap_or(self.start)
    }

    fn rewind(&mut self, end: Lsn) {
        let keep = self.recs.iter().take_while(|p| p.end <= end).count();
        self.recs.truncate(keep);
        self.stream.truncate((end.0 - self.start.0) as usize);
        let prev = self.recs.last().map(|p| p.start).unwrap_or(Lsn(0));
        self.generator = WalGenerator::new(77, SEG, end).unwrap().with_prev(prev);
    }
}

#[test]
fn random_writes_flushes_truncations_and_reopens_keep_the_lsn_invariants() {
    use rand::{Rng, SeedableRng};
    // Replay another seed with WAL_TEST_SEED=<n>.
    let seed = std::env::var("WAL_TEST_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0xC0FFEE_u64);
    println!("seed {seed}");
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 2 * 8192 + 24);
    let mut model = Model::new(start);
    let mut s = fresh(dir.path(), start);
    for step in 0..400 {
        match rng.random_range(0..20) {
            0..=11 => {
                let n = rng.random_range(1..=150_000);
                let at = s.write_lsn();
                let bytes = model.bytes(&mut rng, at, n).to_vec();
                s.write_wal(at, &bytes).unwrap();
            }
            12..=14 => {
                s.flush_wal().unwrap();
                assert_eq!(s.flush_lsn(), s.write_record_lsn(), "step {step}");
            }
            15..=17 => {
                // Truncate at a record boundary at or below the end of complete records.
                let ends: Vec<Lsn> = std::iter::once(start)
                    .chain(model.recs.iter().map(|p| p.end))
                    .filter(|&e| e <= s.write_record_lsn())
                    .collect();
                let end = ends[rng.random_range(ends.len().saturating_sub(5)..ends.len())];
                s.truncate_wal(end).unwrap();
                model.rewind(end);
                assert_eq!(s.flush_lsn(), end, "step {step}");
            }
            _ => {
                // "Reboot" (the OS keeps unsynced writes: every complete record handed to
                // the OS is recovered; small appends still gathered in memory are not),
                // with commit_lsn some durable record boundary. A record whose data is
                // written but not its alignment padding is not counted by the writer yet,
                // but decodes on disk (preallocated padding reads as zeros).
                let in_os = s.os_write_lsn();
                let written = model
                    .recs
                    .iter()
                    .rev()
                    .find(|p| p.data_end <= in_os)
                    .map(|p| p.end)
                    .unwrap_or(start);
                assert!(
                    written >= s.flush_lsn(),
                    "step {step}: durable bytes not in the OS"
                );
                let commit = model.last_end_at_or_below(s.flush_lsn());
                drop(s);
                s = reopen(dir.path(), commit).unwrap();
                assert_eq!(s.flush_lsn(), written, "step {step}: recovered end");
                s.truncate_wal(written).unwrap();
                model.rewind(written);
            }
        }
        assert_eq!(
            s.write_record_lsn(),
            model.last_end_at_or_below(s.write_lsn()),
            "step {step}"
        );
        assert!(s.flush_lsn() <= s.write_record_lsn() && s.write_record_lsn() <= s.write_lsn());
    }
    // Everything handed to the OS reads back as the model's stream (readers never read past
    // the flush LSN, which is always written out).
    let end = s.os_write_lsn();
    let mut back = Vec::new();
    s.read_wal(start, end, &mut back).unwrap();
    assert!(back == model.stream[..back.len()], "read back differs");
}

#[test]
fn invalid_segment_sizes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    for bad in [0, 1 << 19, 3 << 20, 2 << 30] {
        assert!(WalFileStore::open(dir.path(), bad, Lsn::INVALID, opts()).is_err());
    }
}

/// Where an `XLOG_SWITCH` record sits in its segment.
#[derive(Clone, Copy, Debug)]
enum SwitchAt {
    /// On the segment's last page (WAL fills the segment).
    LastPage,
    /// On the segment's first page.
    FirstPage,
    /// On a page a long record continues onto.
    AfterLongRecord,
    /// With its header split across two pages.
    SplitHeader,
}

/// WAL from the segment start `start` whose last record is a switch placed as `at`, padded to
/// the segment end as PostgreSQL does. Returns the bytes, the first record's end and the
/// switch record's start.
fn wal_ending_with_a_switch(seg: u64, start: Lsn, at: SwitchAt) -> (Vec<u8>, Lsn, Lsn) {
    let mut g = WalGenerator::new(77, seg, start).unwrap();
    let mut out = Vec::new();
    let first = g.append_logical_message(&mut out, &[3; 100]).end;
    match at {
        SwitchAt::LastPage => {
            while g.lsn().0 < start.0 + seg - 8192 {
                g.append_logical_message(&mut out, &[4; 5000]);
            }
        }
        SwitchAt::FirstPage => {}
        SwitchAt::AfterLongRecord => {
            g.append_logical_message(&mut out, &[5; 30_000]);
        }
        SwitchAt::SplitHeader => {
            // Up to 8 bytes before the end of the second page: the header straddles it.
            let room = (2 * 8192 - 8) - (g.lsn().0 - start.0) as usize;
            // 69 bytes of headers and prefix, 24 of the continuation page header.
            g.append_logical_message(&mut out, &vec![6; room - 69 - 24]);
            assert_eq!(g.lsn().page_offset(), 8192 - 8);
        }
    }
    let sw = g.append_switch(&mut out);
    assert_eq!(sw.end, Lsn(start.0 + seg));
    (out, first, sw.start)
}

/// Issue 13, item 1: WAL whose last record is an `XLOG_SWITCH` ends at the segment end (what
/// the safekeeper acknowledged: the padding is part of the WAL). It survives a restart, clean
/// or after a crash that kept only the page cache (and then a power loss), with 1 MiB and
/// 16 MiB segments, the switch anywhere in its segment, and recovery starting at the segment
/// boundary, at the switch record (inside the last written page) or earlier; a new term then
/// continues into the next segment.
#[test]
fn wal_ending_with_a_switch_survives_restarts() {
    for seg in [1 << 20, 16 << 20] {
        for at in [
            SwitchAt::LastPage,
            SwitchAt::FirstPage,
            SwitchAt::AfterLongRecord,
            SwitchAt::SplitHeader,
        ] {
            for crash in [false, true] {
                switch_case(seg, at, crash);
            }
        }
    }
}

fn switch_case(seg: u64, at: SwitchAt, crash: bool) {
    let case = format!("segment {seg}, switch {at:?}, crash {crash}");
    let (sim, fs, dir) = sim_dir();
    let start = Lsn(seg);
    let boundary = Lsn(2 * seg);
    let o = WalFileOptions {
        fs,
        wal_start_lsn: start,
        ..opts()
    };
    let (wal, first_end, switch_start) = wal_ending_with_a_switch(seg, start, at);
    let mut s = WalFileStore::open(dir, seg, Lsn::INVALID, o.clone()).unwrap();
    s.initialize_first_segment(start).unwrap();
    s.truncate_wal(start).unwrap();
    s.write_wal(start, &wal).unwrap();
    assert_eq!(
        s.write_record_lsn(),
        boundary,
        "{case}: the record end is the segment end"
    );
    if crash {
        // kill -9 right after the write, before any flush (completing the segment synced it).
        drop(s);
        sim.process_crash();
    } else {
        s.flush_wal().unwrap();
        assert_eq!(s.flush_lsn(), boundary, "{case}");
        drop(s);
    }
    for commit in [boundary, switch_start, first_end] {
        let s = WalFileStore::open(dir, seg, commit, o.clone())
            .unwrap_or_else(|e| panic!("{case}, recovery from {commit}: {e}"));
        assert_eq!(s.flush_lsn(), boundary, "{case}, recovery from {commit}");
        verify_committed_wal(&o.fs, dir, seg, PgMajor::V15, start, commit).unwrap();
    }
    if crash {
        // Recovery made what it decoded durable: a power loss now keeps it.
        sim.power_loss(&mut |_| 0);
        let s = WalFileStore::open(dir, seg, first_end, o.clone()).unwrap();
        assert_eq!(s.flush_lsn(), boundary, "{case}, after a power loss");
    }
    // A new term continues in the next segment.
    let mut s = WalFileStore::open(dir, seg, boundary, o.clone()).unwrap();
    s.truncate_wal(boundary).unwrap();
    let mut g = WalGenerator::new(77, seg, boundary)
        .unwrap()
        .with_prev(switch_start);
    let mut next = Vec::new();
    g.fill(&mut next, 20_000, &[9; 700]);
    s.write_wal(boundary, &next).unwrap();
    s.flush_wal().unwrap();
    drop(s);
    let s = WalFileStore::open(dir, seg, g.lsn(), o.clone()).unwrap();
    assert_eq!(s.flush_lsn(), g.lsn(), "{case}");
    let mut back = Vec::new();
    s.read_wal(start, g.lsn(), &mut back).unwrap();
    assert_eq!(&back[..wal.len()], &wal[..], "{case}");
    assert_eq!(&back[wal.len()..], &next[..], "{case}");
    verify_committed_wal(&o.fs, dir, seg, PgMajor::V15, start, g.lsn()).unwrap();
}

/// Bytes of segment `segno` backed by allocated blocks (sparse holes excluded).
fn allocated_bytes(dir: &Path, segno: u64) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(segment_path(dir, segno, SEG, true))
        .unwrap()
        .blocks()
        * 512
}

/// Writes the records at `pos` (from `start`, bytes `bytes`), flushing after every
/// `per_flush` of them; returns the end.
fn write_flushing_every(
    s: &mut WalFileStore,
    start: Lsn,
    bytes: &[u8],
    pos: &[RecordPos],
    per_flush: usize,
) -> Lsn {
    let mut at = start;
    for (i, p) in pos.iter().enumerate() {
        let off = (at.0 - start.0) as usize;
        s.write_wal(at, &bytes[off..(p.end.0 - start.0) as usize])
            .unwrap();
        at = p.end;
        if (i + 1) % per_flush == 0 {
            s.flush_wal().unwrap();
        }
    }
    s.flush_wal().unwrap();
    at
}

/// Writes `records` 8 KiB records into a fresh segment, flushing after every `per_flush` of
/// them; `check` gets the bytes allocated to the segment file and where WAL ends in it; then
/// every byte must be recovered intact (zeros are only ever written past the end of WAL).
fn zero_ahead_case(records: usize, per_flush: usize, check: impl FnOnce(u64, u64)) {
    zero_ahead_case_with(opts(), records, per_flush, check)
}

/// [`zero_ahead_case`] with the store's options `o`.
fn zero_ahead_case_with(
    o: WalFileOptions,
    records: usize,
    per_flush: usize,
    check: impl FnOnce(u64, u64),
) {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 8192);
    let mut s = fresh_with(dir.path(), start, o);
    let (bytes, pos) = gen_wal(start, &vec![8000; records]);
    let end = write_flushing_every(&mut s, start, &bytes, &pos, per_flush);
    // Blocks the background fill claimed are its to write, possibly still in flight: measured
    // once it ended (measured at once, a loaded machine caught a piece unwritten).
    s.wait_for_fill();
    check(allocated_bytes(dir.path(), 1), end.segment_offset(SEG));
    drop(s);
    assert_recovers(dir.path(), pos[0].end, opts(), start, &bytes);
}

#[test]
fn a_commit_bound_stream_gets_zeros_written_ahead_and_keeps_every_byte() {
    // Single commits: one 8 KiB record per flush.
    zero_ahead_case(40, 1, |alloc, written| {
        assert!(
            alloc >= written + ZERO_AHEAD / 2,
            "blocks past the end of WAL are allocated ahead: {alloc} allocated, WAL ends at {written}"
        );
    });
}

/// The first commit into a sparse segment zeroes a little ahead inline and leaves the rest of
/// the segment to the background fill: once it ends, every block of the segment is allocated
/// (zero-ahead alone allocates [`ZERO_AHEAD`] at a time, as the stream reaches it).
#[test]
fn a_commit_bound_stream_gets_the_rest_of_its_sparse_segment_filled_in_the_background() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 8192);
    let mut s = fresh(dir.path(), start);
    let (bytes, pos) = gen_wal(start, &[8000; 4]);
    let end = write_flushing_every(&mut s, start, &bytes, &pos, 1);
    s.wait_for_fill();
    assert_eq!(
        allocated_bytes(dir.path(), 1),
        SEG,
        "the whole segment is allocated after four commits (WAL ends at {})",
        end.segment_offset(SEG)
    );
    drop(s);
    assert_recovers(dir.path(), pos[0].end, opts(), start, &bytes);
}

/// A runner whose fills rest long after every piece: the commit-bound writer overtakes the fill
/// again and again, so every write must claim its range from it first.
#[derive(Debug)]
struct SlowFill;

impl Runner for SlowFill {
    fn now(&self) -> std::time::Instant {
        std::time::Instant::now()
    }

    fn write_back_pause(&self) -> Duration {
        Duration::from_millis(3)
    }

    fn spawn(&self, job: prepare::Job) -> Option<prepare::Task> {
        Some(prepare::Task::Thread(std::thread::spawn(job)))
    }
}

/// The real file system, with every write of zeros at a 64 KiB boundary (where a background
/// fill's pieces start) waiting 2 ms first: a fill's piece stays in flight, claimed and not yet
/// written, long enough for the writer to reach it.
#[derive(Debug)]
struct SlowWriteBack(Fs);

#[derive(Debug)]
struct SlowWriteBackFile(Box<dyn FileHandle>);

impl FileHandle for SlowWriteBackFile {
    fn read_at(&self, buf: &mut [u8], off: u64) -> std::io::Result<usize> {
        self.0.read_at(buf, off)
    }
    fn write_all_at(&self, buf: &[u8], off: u64) -> std::io::Result<()> {
        if off.is_multiple_of(64 << 10) && buf.iter().all(|b| *b == 0) {
            std::thread::sleep(Duration::from_millis(2));
        }
        self.0.write_all_at(buf, off)
    }
    fn set_len(&self, len: u64) -> std::io::Result<()> {
        self.0.set_len(len)
    }
    fn sync(&self, kind: SyncKind) -> std::io::Result<()> {
        self.0.sync(kind)
    }
}

impl FileSystem for SlowWriteBack {
    fn open(&self, path: &Path, mode: OpenMode) -> std::io::Result<Box<dyn FileHandle>> {
        Ok(Box::new(SlowWriteBackFile(self.0.open(path, mode)?)))
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.0.rename(from, to)
    }
    fn remove_file(&self, path: &Path) -> std::io::Result<()> {
        self.0.remove_file(path)
    }
    fn create_dir_all(&self, path: &Path) -> std::io::Result<()> {
        self.0.create_dir_all(path)
    }
    fn remove_dir_all(&self, path: &Path) -> std::io::Result<()> {
        self.0.remove_dir_all(path)
    }
    fn list_dir(&self, path: &Path) -> std::io::Result<Vec<String>> {
        self.0.list_dir(path)
    }
    fn exists(&self, path: &Path) -> bool {
        self.0.exists(path)
    }
    fn is_dir(&self, path: &Path) -> bool {
        self.0.is_dir(path)
    }
    fn sync_dir(&self, path: &Path) -> std::io::Result<()> {
        self.0.sync_dir(path)
    }
}

/// The background fill and the writer race over three segments (real files, real threads, the
/// writer overtaking the fill): no zero ever lands on accepted WAL, every byte reads back and
/// recovers, whether the writer waits for the fill's piece, claims past it or finds its blocks
/// written.
#[test]
fn the_background_fill_never_writes_over_wal_while_the_writer_overtakes_it() {
    let dir = tempfile::tempdir().unwrap();
    let o = WalFileOptions {
        background: Background::new(std::sync::Arc::new(SlowFill)),
        fs: Fs::custom(std::sync::Arc::new(SlowWriteBack(Fs::real()))),
        ..opts()
    };
    let start = Lsn(SEG + 8192);
    let mut s = fresh_with(dir.path(), start, o.clone());
    // Varied sizes: some writes are gathered, some land inside the fill's piece.
    let sizes: Vec<usize> = (0..420).map(|i| 2000 + (i * 3779) % 14000).collect();
    let (bytes, pos) = gen_wal(start, &sizes);
    let end = write_flushing_every(&mut s, start, &bytes, &pos, 1);
    assert!(
        end.segment_number(SEG) >= 4,
        "three segments written, up to {end}"
    );
    let mut back = Vec::new();
    s.read_wal(start, end, &mut back).unwrap();
    assert!(
        back == bytes,
        "the WAL read back differs from what was written"
    );
    drop(s);
    assert_recovers(dir.path(), pos[0].end, o, start, &bytes);
}

/// Zeros ahead only spare a later fdatasync its block allocation: without fsyncs they would
/// double what is written (and stall every 32nd 8 KiB commit for the next 256 KiB of zeros).
#[test]
fn without_fsyncs_no_zeros_are_written_ahead() {
    let o = WalFileOptions {
        no_sync: true,
        ..opts()
    };
    zero_ahead_case_with(o, 40, 1, |alloc, written| {
        // The pages under WAL, and at most a few more (any zeros ahead are 256 KiB).
        assert!(
            alloc <= written.next_multiple_of(4096) + 16 * 1024,
            "no zeros ahead under no_sync: {alloc} allocated, WAL ends at {written}"
        );
    });
}

#[test]
fn a_pipelined_stream_writes_no_zeros_ahead() {
    // Batches of 32 records (~256 KiB) per flush.
    zero_ahead_case(64, 32, |alloc, written| {
        assert!(
            alloc < written + ZERO_AHEAD / 2,
            "no zeros ahead of a pipelined stream: {alloc} allocated, WAL ends at {written}"
        );
    });
}

/// Zeros land on exactly `[from, to)`, whatever the alignment, in every write size (paced
/// included: written back piece by piece on the real file system); the bytes around the range
/// are left alone.
#[test]
fn write_zeros_covers_exactly_the_range_in_pages_and_in_bulk() {
    use super::segment::{Zeros, write_zeros};
    use sk_core::storage::fs::OpenMode;
    let dir = tempfile::tempdir().unwrap();
    let paced = Zeros::Paced(Duration::from_micros(10));
    for how in [Zeros::Pages, Zeros::Bulk, paced] {
        for (from, to) in [
            (0, 4096),
            (1, 4095),
            (4000, 9000),
            (5, 200_000),
            (65_530, 65_542),
        ] {
            let path = dir.path().join("z");
            let len = 210_000usize;
            std::fs::write(&path, vec![0xAAu8; len]).unwrap();
            let f = Fs::real().open(&path, OpenMode::ReadWrite).unwrap();
            write_zeros(&*f, from, to, how).unwrap();
            drop(f);
            let got = std::fs::read(&path).unwrap();
            for (i, b) in got.iter().enumerate() {
                let want = if (from as usize..to as usize).contains(&i) {
                    0
                } else {
                    0xAA
                };
                assert_eq!(*b, want, "{how:?} [{from}, {to}) at byte {i}");
            }
        }
    }
}

/// An idle timeline keeps no gathering buffer: its memory goes with the flush that wrote it out
/// (with 100,000 mostly idle timelines, each kept its last batch's capacity).
#[test]
fn a_flush_releases_the_gathering_buffer() {
    let dir = tempfile::tempdir().unwrap();
    let start = Lsn(SEG + 8192);
    let mut s = fresh(dir.path(), start);
    let (bytes, pos) = gen_wal(start, &[8000, 8000]);
    s.write_wal(start, &bytes).unwrap();
    assert!(s.pending.capacity() > 0, "small appends are gathered");
    s.flush_wal().unwrap();
    assert_eq!(
        s.pending.capacity(),
        0,
        "the buffer is released at the flush"
    );
    assert_eq!(s.flush_lsn(), pos[1].end);
}

/// A pool of `n` segments, filled.
fn filled_pool(dir: &Path, n: usize) -> super::SegmentPool {
    let pool = super::SegmentPool::start(Fs::real(), dir, SEG, n, 0.0).unwrap();
    pool.wait_ready(n);
    pool
}

/// A truncation inside a segment this store made (zeros throughout, but what it wrote) zeroes
/// the discarded WAL in place: the blocks stay allocated (a cut would free them), nothing past
/// the end can be decoded (at once and after a reopen), the store still knows the blocks are
/// there (a commit-bound stream after it starts no zero-fill), and a new term's WAL written
/// over it is recovered whole.
#[test]
fn truncation_inside_a_fresh_segment_zeroes_in_place_and_keeps_its_blocks() {
    let dir = tempfile::tempdir().unwrap();
    let pool = filled_pool(&dir.path().join("pool"), 1);
    let tl = dir.path().join("tl");
    let start = Lsn(SEG + 8192);
    let mut s = fresh_with(
        &tl,
        start,
        WalFileOptions {
            pool: Some(pool.clone()),
            ..opts()
        },
    );
    assert_eq!(pool.taken(), 1);
    let (bytes, pos) = gen_wal(start, &[8000; 40]);
    let end = write_flushing_every(&mut s, start, &bytes, &pos, 1);
    let keep = pos[9].end;
    s.truncate_wal(keep).unwrap();
    assert!(
        allocated_bytes(&tl, 1) >= SEG,
        "the segment keeps its blocks"
    );
    // Every discarded byte is zero on disk.
    let file = std::fs::read(segment_path(&tl, 1, SEG, true)).unwrap();
    let (a, b) = ((keep.0 - SEG) as usize, (end.0 - SEG) as usize);
    assert!(
        file[a..b].iter().all(|&x| x == 0),
        "discarded WAL left on disk"
    );
    // A new term's WAL goes over it, commit by commit, and exactly that is recovered.
    let (more, more_pos) = gen_wal_from(keep, pos[9].start, &[3000; 5]);
    let new_end = write_flushing_every(&mut s, keep, &more, &more_pos, 1);
    assert!(new_end < end, "the old WAL ran past the new");
    assert!(
        s.fill.is_none(),
        "no zero-fill of blocks known to be allocated"
    );
    drop(s);
    let mut want = bytes[..(keep.0 - start.0) as usize].to_vec();
    want.extend_from_slice(&more);
    assert_recovers(&tl, keep, opts(), start, &want);
    // Truncated again after the reopen (a segment found on disk: cut, not zeroed in place),
    // the WAL still ends where it should.
    let mut s = reopen(&tl, keep).unwrap();
    s.truncate_wal(keep).unwrap();
    assert_eq!(s.flush_lsn(), keep);
    drop(s);
    assert_recovers(
        &tl,
        keep,
        opts(),
        start,
        &bytes[..(keep.0 - start.0) as usize],
    );
}

/// Segments of the node's pool: a store takes one for each new segment (its blocks allocated
/// from the first append), writes no zeros and prepares no segment of its own while the pool
/// has one, and keeps it allocated through the truncation every new term starts with.
#[test]
fn segments_come_from_the_node_pool_and_stay_allocated() {
    let dir = tempfile::tempdir().unwrap();
    let pool = filled_pool(&dir.path().join("pool"), 3);
    let tl = dir.path().join("tl");
    let o = WalFileOptions {
        pool: Some(pool.clone()),
        prepare_below_rate: u64::MAX,
        ..opts()
    };
    let start = Lsn(SEG + 8192);
    let mut s = fresh_with(&tl, start, o.clone());
    assert_eq!(pool.taken(), 1, "the first segment came from the pool");
    assert!(allocated_bytes(&tl, 1) >= SEG);
    // Commit-bound appends into it write no zeros of their own and start no fill.
    let (bytes, pos) = gen_wal(start, &[8000; 150]);
    let end = write_flushing_every(&mut s, start, &bytes, &pos, 1);
    assert!(
        end.0 > 2 * SEG && end.0 < 3 * SEG,
        "crossed into the second segment"
    );
    assert!(
        s.fill.is_none(),
        "no background zero-fill of a pooled segment"
    );
    assert!(
        !tl.join(super::PREPARED_SEGMENT_NAME).exists(),
        "nothing prepared"
    );
    assert_eq!(pool.taken(), 2, "the second segment came from the pool too");
    assert!(allocated_bytes(&tl, 2) >= SEG);
    drop(s);
    assert_recovers(&tl, start, o, start, &bytes);
}
