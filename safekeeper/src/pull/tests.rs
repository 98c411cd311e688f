//! pull_timeline's verification, each rule alone (issue 27): a real donor timeline and a real
//! puller node on simulated disks, the snapshot stream as the donor produces it, then cut,
//! corrupted or made stale on its way to the puller.

use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use pg_wal::generator::WalGenerator;
use sk_core::protocol::{ProposerAcceptorMessage, ProposerElected};
use sk_core::state::Configuration;
use sk_core::storage::fs::SimFs;
use sk_core::types::{Generation, Lsn, NodeId, TenantTimelineId, Term, TermHistory, TermLsn};

use super::*;
use crate::test_util::{append, elected_timeline, greeting, run, sim_node, vote};

const SEG: u64 = 1 << 20;
const START: Lsn = Lsn(SEG);

struct Donor {
    _sim: Arc<SimFs>,
    _timelines: GlobalTimelines,
    tl: Arc<Timeline>,
    wal: Vec<u8>,
}

/// A donor holding about `size` bytes of generated WAL in term 1, committed.
fn donor(size: usize) -> Donor {
    let (sim, _fs, timelines) = sim_node();
    let tl = elected_timeline(&timelines, 7, SEG, START);
    let mut generator = WalGenerator::new(42, SEG, START).unwrap();
    let mut wal = Vec::new();
    generator.fill(&mut wal, size, &[5; 700]);
    append(&tl, 1, START, &wal, Lsn::INVALID, true);
    let end = Lsn(START.0 + wal.len() as u64);
    append(&tl, 1, end, &[], end, true);
    Donor {
        _sim: sim,
        _timelines: timelines,
        tl,
        wal,
    }
}

fn ttid() -> TenantTimelineId {
    greeting(7, SEG).ttid()
}

/// Every frame of a snapshot of `tl`, as the donor sends them.
fn frames(tl: &Arc<Timeline>) -> Vec<Bytes> {
    let mut snap = Snapshot::begin(tl.clone(), false).expect("a snapshot point");
    let mut out = Vec::new();
    while let Some(f) = snap.next_frame().expect("the snapshot is read") {
        out.push(f);
    }
    out
}

fn stream(frames: &[Bytes]) -> Vec<u8> {
    frames.iter().flat_map(|f| f.iter().copied()).collect()
}

/// A puller node (its own disk) and the result of pulling `bytes` into it.
fn pull(bytes: &[u8], best: (Term, Lsn)) -> (Arc<SimFs>, GlobalTimelines, Result<Pulled, String>) {
    let (sim, fs, puller) = sim_node();
    let (tmp, guard) = puller.begin_pull(&ttid()).expect("a pull may begin");
    let r = pull_from(&puller, ttid(), &tmp, &mut &bytes[..], "donor", best);
    drop(guard);
    let r = r.map_err(|e| e.to_string());
    if r.is_err() {
        assert!(
            puller.get(&ttid()).is_none(),
            "a refused pull installed a timeline"
        );
        assert!(!fs.exists(&tmp), "a refused pull left {}", tmp.display());
    }
    (sim, puller, r)
}

fn refused(bytes: &[u8], best: (Term, Lsn)) -> String {
    match pull(bytes, best).2 {
        Ok(p) => panic!("the pull was not refused: {p:?}"),
        Err(e) => e,
    }
}

fn best(d: &Donor) -> (Term, Lsn) {
    (Term(1), d.tl.positions().flush_lsn)
}

#[test]
fn a_snapshot_installs_a_verified_copy_that_survives_power_loss() {
    let d = donor(3 << 20);
    let flush = d.tl.positions().flush_lsn;
    let (sim, puller, r) = pull(&stream(&frames(&d.tl)), best(&d));
    let p = r.expect("the pull succeeds");
    assert_eq!((p.start_lsn, p.flush_lsn), (START, flush));
    let tl = puller.get(&ttid()).expect("installed and live");
    let mut got = Vec::new();
    tl.read_wal(START, flush, &mut got).unwrap();
    assert!(got == d.wal, "the pulled WAL differs from the donor's");
    drop((tl, puller));
    sim.power_loss(&mut |_| 0);
    let again = crate::test_util::load(&Fs::sim(sim.clone()));
    let tl = again.get(&ttid()).expect("the pulled timeline is durable");
    assert_eq!(tl.positions().flush_lsn, flush);
}

#[test]
fn a_short_snapshot_is_refused_and_leaves_nothing_behind() {
    let d = donor(3 << 20);
    let frames = frames(&d.tl);
    let bytes = stream(&frames);
    // Cut at every frame boundary, and inside the control, a WAL and the END frame.
    let mut cuts = Vec::new();
    let mut at = 0;
    for f in &frames {
        cuts.push(at);
        cuts.push(at + f.len() / 2);
        at += f.len();
    }
    cuts.push(bytes.len() - 1);
    for cut in cuts {
        let e = refused(&bytes[..cut], best(&d));
        assert!(
            e.contains("ended early") || e.contains("reading the snapshot"),
            "cut at {cut}: {e}"
        );
    }
    // Nothing of the refused pulls stands in the way of a whole one.
    pull(&bytes, best(&d)).2.expect("the whole snapshot pulls");
}

#[test]
fn a_snapshot_missing_a_wal_frame_is_refused() {
    let d = donor(3 << 20);
    let frames = frames(&d.tl);
    // magic, control, WAL…, END.
    let wal_frames = frames.len() - 3;
    assert!(wal_frames >= 3, "{wal_frames} WAL frames");
    let mut middle = frames.clone();
    middle.remove(3);
    let e = refused(&stream(&middle), best(&d));
    assert!(e.contains("was expected"), "{e}");
    let mut last = frames.clone();
    last.remove(frames.len() - 2);
    let e = refused(&stream(&last), best(&d));
    assert!(e.contains("snapshot ended at"), "{e}");
}

/// Replaces the END frame's checksum with one over the WAL frames as they are now.
fn reseal(frames: &mut [Bytes]) {
    let mut crc = 0;
    for f in &frames[2..frames.len() - 1] {
        crc = crc32c::crc32c_append(crc, &f[17..]);
    }
    let end = frames.last_mut().unwrap();
    let mut e = end.to_vec();
    e[17..21].copy_from_slice(&u32::to_le_bytes(crc));
    *end = Bytes::from(e);
}

fn flip(f: &mut Bytes, at: usize) {
    let mut v = f.to_vec();
    v[at] ^= 0x40;
    *f = Bytes::from(v);
}

#[test]
fn a_corrupt_snapshot_is_refused() {
    let d = donor(3 << 20);
    let good = frames(&d.tl);
    // A flipped WAL byte: the stream's checksum.
    let mut wal = good.clone();
    flip(&mut wal[3], 5000);
    let e = refused(&stream(&wal), best(&d));
    assert!(e.contains("checksum mismatch"), "{e}");
    // The same with a checksum that matches (a donor that read corrupt WAL): the records'.
    reseal(&mut wal);
    let e = refused(&stream(&wal), best(&d));
    assert!(e.contains("does not verify"), "{e}");
    // A flipped byte of the control file image: its own CRC.
    let mut control = good.clone();
    let n = control[1].len();
    flip(&mut control[1], n - 20);
    let e = refused(&stream(&control), best(&d));
    assert!(e.contains("control file checksum mismatch"), "{e}");
}

#[test]
fn a_snapshot_older_than_the_peers_status_is_refused() {
    let d = donor(1 << 20);
    let bytes = stream(&frames(&d.tl));
    let (term, flush) = best(&d);
    for newer in [(term, Lsn(flush.0 + 1)), (Term(2), flush)] {
        let e = refused(&bytes, newer);
        assert!(e.contains("stale snapshot"), "{newer:?}: {e}");
    }
    pull(&bytes, (term, flush))
        .2
        .expect("as new as the status said");
}

#[test]
fn a_new_term_during_the_snapshot_aborts_it() {
    let d = donor(3 << 20);
    let mut snap = Snapshot::begin(d.tl.clone(), false).unwrap();
    for _ in 0..3 {
        snap.next_frame().unwrap().expect("magic, control, WAL");
    }
    assert!(vote(&d.tl, 2).vote_given);
    let e = snap
        .next_frame()
        .expect_err("a new term aborts the snapshot");
    assert!(e.contains("term changed from 1 to 2"), "{e}");
}

#[test]
fn a_new_history_in_the_same_term_aborts_the_snapshot() {
    let d = donor(3 << 20);
    let flush = d.tl.positions().flush_lsn;
    // The acceptor is in term 2 while its newest WAL is still term 1's.
    assert!(vote(&d.tl, 2).vote_given);
    let mut snap = Snapshot::begin(d.tl.clone(), false).unwrap();
    for _ in 0..3 {
        snap.next_frame().unwrap().expect("magic, control, WAL");
    }
    // Term 2's proposer is elected: the newest WAL is term 2's from here on.
    run(
        &d.tl,
        ProposerAcceptorMessage::Elected(ProposerElected {
            generation: Generation(0),
            term: Term(2),
            start_streaming_at: flush,
            term_history: TermHistory(vec![
                TermLsn {
                    term: Term(1),
                    lsn: START,
                },
                TermLsn {
                    term: Term(2),
                    lsn: flush,
                },
            ]),
        }),
    );
    let e = snap
        .next_frame()
        .expect_err("a new history aborts the snapshot");
    assert!(e.contains("newest WAL's term changed from 1 to 2"), "{e}");
}

fn answer(id: u64, term: u64, flush: u64) -> PeerAnswer {
    PeerAnswer {
        pos: (Term(term), Lsn(flush)),
        host: format!("sk{id}"),
        id: NodeId(id),
        mconf: Configuration::default(),
    }
}

#[test]
fn the_most_advanced_peer_of_a_quorum_is_chosen() {
    // The newest WAL's term decides before the flush LSN: a longer log of an older term
    // may hold WAL that the newer term truncates.
    let answers = vec![
        answer(1, 1, 0x300_0000),
        answer(2, 2, 0x200_0000),
        answer(3, 2, 0x180_0000),
    ];
    let (host, pos) = choose_source(answers, &[], 3).unwrap();
    assert_eq!((host.as_str(), pos), ("sk2", (Term(2), Lsn(0x200_0000))));
    // Answers in any order.
    let answers = vec![
        answer(3, 1, 0x100),
        answer(2, 1, 0x300),
        answer(1, 1, 0x200),
    ];
    assert_eq!(choose_source(answers, &[], 3).unwrap().0, "sk2");
    // One of three cannot tell the newest copy.
    let e = choose_source(vec![answer(1, 5, 0x900)], &["sk2: refused".into()], 3)
        .expect_err("no quorum")
        .to_string();
    assert!(
        e.contains("only 1 of 3") && e.contains("sk2: refused"),
        "{e}"
    );
}

#[test]
fn a_pull_is_refused_while_another_of_the_same_timeline_runs() {
    let (_sim, _fs, puller) = sim_node();
    let (tmp, guard) = puller.begin_pull(&ttid()).unwrap();
    let e = puller
        .begin_pull(&ttid())
        .map(|_| ())
        .expect_err("one at a time");
    assert!(e.to_string().contains("in progress"), "{e}");
    drop(guard);
    let (tmp2, _guard) = puller.begin_pull(&ttid()).expect("after the first ended");
    assert_ne!(tmp, tmp2, "each pull has its own directory");
    assert!(tmp2.starts_with(Path::new(crate::test_util::DATADIR)));
}
