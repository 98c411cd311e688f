//! The seeded simulation of the timeline manager: the real [`ManagerCore`] over a real
//! [`Timeline`] and [`GlobalTimelines`] on a simulated disk ([`SimFs`]) with a real in-memory
//! object store, driven by one seeded schedule. A term-1 proposer appends and commits WAL;
//! the core's actions are performed in any order (as the tokio driver's concurrent tasks may
//! finish), the store has outages, readers take and release holds, the process crashes or the
//! machine loses power between any two steps, and the timeline is deleted and created again
//! with the same ids.
//!
//! Invariants, checked after every step:
//! - a crashed node restarts (its timelines load);
//! - no local segment is gone that the persisted commit LSN, backup LSN or peers' horizon
//!   still needs, nor one a live reader's hold needs;
//! - every acknowledged WAL byte is either local or in the store, identical (checked against
//!   the bytes the proposer sent);
//! - a deleted timeline's remote objects are gone before a timeline with the same ids exists
//!   again, and while they are not, creating it is refused (also across restarts).
//!
//! Knobs: `MANAGER_SIM_SEEDS` (default 1000) seeds of `MANAGER_SIM_STEPS` (default 200) steps;
//! `MANAGER_SIM_SEED=s` replays one (the `#[ignore]`d `manager_sim_replay_one_seed`), and a
//! failure prints the command that does it.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use pg_wal::generator::WalGenerator;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use sk_core::protocol::{AppendRequest, AppendRequestHeader, ProposerAcceptorMessage};
use sk_core::state::{Configuration, ServerInfo};
use sk_core::storage::fs::{Fs, SimFs};
use sk_core::types::{Generation, Lsn, NodeId, TenantTimelineId, Term};

use super::tests::cfg;
use super::*;
use crate::lifecycle::observe;
use crate::registry::{CreateTimeline, GlobalTimelines};
use crate::remove_wal::ReadHold;
use crate::test_util::{DATADIR, elect, greeting, run};
use crate::timeline::Timeline;
use crate::wal_backup::{Backup, RemoteStorage};

const SEG: u64 = 1 << 20;
const START: Lsn = Lsn(SEG);

fn env_u64(name: &str) -> Option<u64> {
    std::env::var(name).ok().and_then(|v| v.parse().ok())
}

/// The proposer's side of one incarnation of the timeline.
struct Proposer {
    term: u64,
    walgen: WalGenerator,
    /// Every WAL byte sent from [`START`] on.
    sent: Vec<u8>,
    /// Acknowledged (durable) end of WAL.
    acked: Lsn,
}

/// One live timeline and its manager.
struct Live {
    tl: Arc<Timeline>,
    core: ManagerCore,
    /// Actions asked for and not yet performed (in flight).
    pending: Vec<Action>,
    holds: Vec<(Lsn, ReadHold)>,
}

struct Sim {
    seed: u64,
    rng: StdRng,
    sim: Arc<SimFs>,
    fs: Fs,
    rt: tokio::runtime::Runtime,
    backup: Backup,
    /// `None` only while the process is down.
    timelines: Option<GlobalTimelines>,
    ttid: TenantTimelineId,
    /// `None` while the timeline is deleted.
    live: Option<Live>,
    proposer: Proposer,
    store_down: bool,
    now: Duration,
    crashes: u64,
    pulls: PullCounts,
    trace: bool,
    log: Vec<String>,
}

impl Sim {
    fn new(seed: u64) -> Sim {
        let (sim, fs) = SimFs::with_dir(Path::new(DATADIR));
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let store = RemoteStorage::with_store(
            Arc::new(object_store::memory::InMemory::new()),
            "memory://sim",
        );
        let backup = Backup::new(store, 2);
        let timelines = load(&fs);
        timelines.set_remote_storage(true);
        let ttid = greeting(7, SEG).ttid();
        let mut s = Sim {
            seed,
            rng: StdRng::seed_from_u64(seed),
            sim,
            fs,
            rt,
            backup,
            timelines: Some(timelines),
            ttid,
            live: None,
            proposer: Proposer {
                term: 0,
                walgen: WalGenerator::new(42, SEG, START).unwrap(),
                sent: Vec::new(),
                acked: START,
            },
            store_down: false,
            now: Duration::ZERO,
            crashes: 0,
            pulls: PullCounts::default(),
            trace: std::env::var("MANAGER_SIM_TRACE").is_ok(),
            log: Vec::new(),
        };
        s.create();
        s
    }

    fn tls(&self) -> &GlobalTimelines {
        self.timelines.as_ref().expect("the node is up")
    }

    fn note(&mut self, what: String) {
        if self.trace {
            eprintln!("[{}] {what}", self.log.len());
        }
        self.log.push(what);
    }

    /// Creates the timeline (explicitly, as an operator does) and elects term 1 at [`START`].
    fn create(&mut self) {
        let g = greeting(7, SEG);
        let tl = crate::blocking::section(|| {
            self.tls().create_explicit(&CreateTimeline {
                ttid: self.ttid,
                server: ServerInfo {
                    pg_version: g.pg_version,
                    system_id: g.system_id,
                    wal_seg_size: g.wal_seg_size,
                },
                start_lsn: START,
                mconf: Configuration::default(),
            })
        })
        .expect("the timeline is created");
        run(&tl, ProposerAcceptorMessage::Greeting(g));
        elect(&tl, 1, &[(1, START)]);
        self.proposer = Proposer {
            term: 1,
            walgen: WalGenerator::new(42, SEG, START).unwrap(),
            sent: Vec::new(),
            acked: START,
        };
        self.attach(tl);
    }

    /// Starts a manager for `tl`, as the supervisor does.
    fn attach(&mut self, tl: Arc<Timeline>) {
        tl.set_remote(self.backup.storage.clone());
        let mut core = ManagerCore::new(cfg(), observe(&tl), tl.removed_below());
        let pending = core.step(Event::Tick(self.now));
        self.live = Some(Live {
            tl,
            core,
            pending,
            holds: Vec::new(),
        });
    }

    /// Feeds `event` and then what the timeline looks like now.
    fn feed(&mut self, event: Event) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        let mut out = live.core.step(event);
        out.extend(live.core.step(Event::Observed(observe(&live.tl))));
        out.extend(live.core.step(Event::Tick(self.now)));
        for a in out {
            match a {
                Action::Missing { segno } => panic!(
                    "seed {}: segment {segno} reported missing: nothing in this schedule removes \
                     a segment that is not stored",
                    self.seed
                ),
                Action::Finished => {}
                a => live.pending.push(a),
            }
        }
    }

    /// The proposer appends a chunk of WAL and commits what it had sent before, with the
    /// peers' horizon at the commit.
    fn append(&mut self) {
        let Some(live) = &self.live else { return };
        let tl = live.tl.clone();
        let size = self.rng.random_range(20_000..500_000);
        let mut wal = Vec::new();
        let begin = self.proposer.walgen.lsn();
        self.proposer.walgen.fill(&mut wal, size, &[5; 700]);
        let end = self.proposer.walgen.lsn();
        let commit = self.proposer.acked;
        for (i, piece) in wal.chunks(sk_core::protocol::MAX_SEND_SIZE).enumerate() {
            let b = Lsn(begin.0 + (i * sk_core::protocol::MAX_SEND_SIZE) as u64);
            run(
                &tl,
                ProposerAcceptorMessage::AppendRequest(AppendRequest {
                    h: AppendRequestHeader {
                        generation: Generation(0),
                        term: Term(self.proposer.term),
                        begin_lsn: b,
                        end_lsn: Lsn(b.0 + piece.len() as u64),
                        commit_lsn: commit,
                        truncate_lsn: commit,
                    },
                    wal_data: Bytes::copy_from_slice(piece),
                }),
            );
        }
        assert_eq!(tl.positions().flush_lsn, end, "seed {}: flushed", self.seed);
        self.proposer.sent.extend_from_slice(&wal);
        self.proposer.acked = end;
        self.note(format!("append {begin}..{end}, commit {commit}"));
        self.feed(Event::Observed(observe(&tl)));
    }

    /// Performs one action in flight, chosen at random (they finish in any order).
    fn perform(&mut self) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        if live.pending.is_empty() {
            return;
        }
        let i = self.rng.random_range(0..live.pending.len());
        let action = live.pending.swap_remove(i);
        let tl = live.tl.clone();
        let event = match action.clone() {
            Action::List => Event::Listed(if self.store_down {
                None
            } else {
                let l = self
                    .rt
                    .block_on(self.backup.storage.list_segments(&tl.ttid, SEG))
                    .expect("listing the in-memory store");
                Some(l.into_iter().map(|(n, _)| n).collect())
            }),
            Action::Upload {
                segno,
                valid_from,
                known_stored,
            } => {
                let ok = !self.store_down
                    && self
                        .rt
                        .block_on(self.backup.upload(&tl, segno, valid_from, known_stored))
                        .is_ok();
                Event::Uploaded { segno, ok }
            }
            Action::SetBackupLsn(lsn) => {
                crate::blocking::section(|| tl.set_backup_lsn(lsn));
                Event::Observed(observe(&tl))
            }
            Action::Save => {
                let ok = crate::blocking::section(|| tl.maybe_persist(true)).is_ok();
                Event::Saved { ok }
            }
            Action::Remove { horizon } => {
                crate::blocking::section(|| tl.remove_segments_below(horizon))
                    .expect("removing segments");
                Event::Removed {
                    first_local: tl.removed_below(),
                }
            }
            a => panic!("seed {}: {a:?} is not performed by the driver", self.seed),
        };
        self.note(format!("perform {action:?} -> {event:?}"));
        let removed = matches!(action, Action::Remove { .. });
        drop(tl);
        self.feed(event);
        // The moment the review found (issue 26): a kill right after a removal.
        if removed && self.rng.random_bool(0.3) {
            self.crash();
        }
    }

    /// The process dies (or the machine loses power), and the node starts again.
    fn crash(&mut self) {
        let pending_before = self.tls().pending_remote_deletions();
        // The process is gone: no thread of it (a segment preparation) touches the disk after.
        self.live = None;
        self.timelines = None;
        let power = self.rng.random_bool(0.5);
        if power {
            let mut rng = StdRng::seed_from_u64(self.rng.random());
            self.sim.power_loss(&mut |n| rng.random_range(0..=n));
        } else {
            self.sim.process_crash();
        }
        self.note(format!("crash (power loss: {power})"));
        self.crashes += 1;
        let timelines = self.restart(&self.fs, "the node");
        self.timelines = Some(timelines);
        assert_eq!(
            self.tls().pending_remote_deletions(),
            pending_before,
            "seed {}: a pending remote deletion survives a restart",
            self.seed
        );
        if let Some(tl) = self.tls().get(&self.ttid) {
            // A new term, as the proposer would after the restart.
            let flush = tl.positions().flush_lsn;
            assert!(
                flush >= self.proposer.acked,
                "seed {}: acknowledged WAL lost: flush {flush} < acked {}",
                self.seed,
                self.proposer.acked
            );
            self.reelect(&tl);
            self.attach(tl);
            // Where a loss would show: right after the restart.
            self.check_content();
        }
    }

    /// Starts the node on `fs` again after a crash (`who`: which node, for the failure), with
    /// remote storage on; a node that does not start fails the seed.
    fn restart(&self, fs: &Fs, who: &str) -> GlobalTimelines {
        match GlobalTimelines::load_in(fs.clone(), Path::new(DATADIR), NodeId(1), false) {
            Ok(t) => {
                t.set_remote_storage(true);
                t
            }
            Err(e) => panic!(
                "seed {}: {who} does not start after a crash: {e}\n{}",
                self.seed,
                self.replay_hint()
            ),
        }
    }

    /// A new proposer is elected in the next term at the end of `tl`'s WAL.
    fn reelect(&mut self, tl: &Timeline) {
        let flush = tl.positions().flush_lsn;
        self.proposer.term += 1;
        let mut history: Vec<(u64, Lsn)> = tl
            .status()
            .term_history
            .0
            .iter()
            .map(|e| (e.term.0, e.lsn))
            .collect();
        history.push((self.proposer.term, flush));
        run(tl, ProposerAcceptorMessage::Greeting(greeting(7, SEG)));
        elect(tl, self.proposer.term, &history);
        self.note(format!("term {} elected at {flush}", self.proposer.term));
    }

    /// A new node pulls the timeline (issue 26): the snapshot is produced frame by frame while
    /// the donor goes on (appends, its manager's actions, a new term), and the puller, on a
    /// disk of its own and with the same store, may lose power at any point of the pull. The
    /// pull yields a verified copy of every acknowledged byte below the snapshot's end (the
    /// WAL below its start served from the store), or a clear refusal; a crashed puller
    /// restarts with the whole copy or none of it.
    fn pull(&mut self) {
        let Some(live) = &self.live else { return };
        let tl = live.tl.clone();
        // What the puller's status request saw.
        let best = (tl.status().last_log_term, tl.positions().flush_lsn);
        let mut snap = match crate::pull::Snapshot::begin(tl.clone(), true) {
            Ok(s) => s,
            Err(e) => panic!("seed {}: no snapshot point: {e}", self.seed),
        };
        let (start, flush) = snap.range();
        let mut bytes = Vec::new();
        let mut aborted = None;
        loop {
            match snap.next_frame() {
                Ok(Some(f)) => bytes.extend_from_slice(&f),
                Ok(None) => break,
                Err(e) => {
                    aborted = Some(e);
                    break;
                }
            }
            // The donor goes on meanwhile.
            match self.rng.random_range(0..12) {
                0..3 => self.append(),
                3..7 => self.perform(),
                7 => self.reelect(&tl),
                _ => {}
            }
            if !self.live.as_ref().is_some_and(|l| Arc::ptr_eq(&l.tl, &tl)) {
                // The donor crashed (right after a removal): its stream ends here, whole if
                // its END frame was sent.
                if !snap.ended() {
                    aborted = Some("the donor crashed".to_string());
                }
                break;
            }
        }
        drop(snap);
        self.note(format!(
            "snapshot [{start}, {flush}) of {} bytes, aborted: {aborted:?}",
            bytes.len()
        ));
        let (psim, pfs) = SimFs::with_dir(Path::new(DATADIR));
        let puller = load(&pfs);
        puller.set_remote_storage(true);
        let (tmp, guard) = crate::blocking::section(|| puller.begin_pull(&self.ttid))
            .expect("the first pull on a new node begins");
        let crash_at = self.rng.random_range(0..80);
        let crash = self.rng.random_bool(0.3);
        if crash {
            psim.arm_crash_after(crash_at);
        }
        let r = crate::blocking::section(|| {
            crate::pull::pull_from(&puller, self.ttid, &tmp, &mut &bytes[..], "donor", best)
        });
        drop(guard);
        let crashed = crash && psim.crash_point_reached();
        if r.is_ok() {
            self.pulls.installed += 1;
        } else {
            self.pulls.refused += 1;
        }
        self.pulls.puller_crashes += u64::from(crashed);
        self.note(format!(
            "pull -> {:?}, puller crashed: {crashed}",
            r.as_ref().map(|p| p.flush_lsn).map_err(|e| e.to_string())
        ));
        let puller = if crashed || self.rng.random_bool(0.3) {
            // The puller loses power (at its crash point, or after the pull) and restarts.
            drop(puller);
            let mut rng = StdRng::seed_from_u64(self.rng.random());
            psim.power_loss(&mut |n| rng.random_range(0..=n));
            self.restart(&pfs, "the puller")
        } else {
            psim.disarm();
            puller
        };
        match (&r, aborted) {
            (Err(e), Some(why)) => assert!(
                e.to_string().contains("ended early"),
                "seed {}: an aborted snapshot ({why}) is refused as such, not: {e}",
                self.seed
            ),
            (Ok(_), Some(why)) => panic!(
                "seed {}: a snapshot aborted by {why} was installed\n{}",
                self.seed,
                self.replay_hint()
            ),
            (Err(e), None) if !crashed => panic!(
                "seed {}: a whole snapshot [{start}, {flush}) was refused: {e}\n{}",
                self.seed,
                self.replay_hint()
            ),
            _ => {}
        }
        let Some(pulled) = puller.get(&self.ttid) else {
            assert!(
                crashed || r.is_err(),
                "seed {}: a pull that succeeded is gone after a power loss",
                self.seed
            );
            return;
        };
        // Installed (before or despite the crash): the whole, verified copy.
        assert_eq!(
            pulled.positions().flush_lsn,
            flush,
            "seed {}: the pulled timeline ends elsewhere than its snapshot",
            self.seed
        );
        self.check_content_of(&pulled, &pfs, flush);
    }

    /// The operator deletes the timeline: the manager stops, its work in flight is dropped.
    fn delete(&mut self) {
        let Some(mut live) = self.live.take() else {
            return;
        };
        live.holds.clear();
        crate::blocking::section(|| {
            self.tls()
                .delete_timeline(&self.ttid, crate::manager::DeleteScope::Everywhere)
        })
        .expect("deleting the timeline");
        assert_eq!(live.core.step(Event::Deleted), vec![Action::Stop]);
        assert_eq!(live.core.step(Event::Stopped), vec![Action::Finished]);
        self.note("delete".into());
        assert!(
            !self.tls().pending_remote_deletions().is_empty(),
            "seed {}: a delete with remote storage leaves its objects to delete",
            self.seed
        );
    }

    /// The node deletes the remote objects of a deletion (as the supervisor does), or
    /// creates the timeline again once they are gone.
    fn after_delete(&mut self) {
        let pending = self.tls().pending_remote_deletions();
        if let Some(d) = pending.first() {
            // Creating it again is refused meanwhile.
            let refused = crate::blocking::section(|| {
                self.tls().create_explicit(&CreateTimeline {
                    ttid: self.ttid,
                    server: ServerInfo {
                        pg_version: 150000,
                        system_id: 42,
                        wal_seg_size: SEG as u32,
                    },
                    start_lsn: START,
                    mconf: Configuration::default(),
                })
            });
            assert!(
                matches!(
                    refused,
                    Err(crate::timeline::TimelineError::BeingDeleted(_))
                ),
                "seed {}: created while its remote deletion was pending: {:?}",
                self.seed,
                refused.map(|_| ())
            );
            if self.store_down {
                return;
            }
            self.rt
                .block_on(
                    self.backup
                        .storage
                        .delete_objects(&d.tenant_id, d.timeline_id.as_ref()),
                )
                .expect("deleting objects");
            crate::blocking::section(|| self.tls().remote_deletion_done(&d.name))
                .expect("recording the remote deletion");
            self.note("remote objects deleted".into());
            return;
        }
        self.create();
        self.note("created again".into());
        let listed = self
            .rt
            .block_on(self.backup.storage.list_segments(&self.ttid, SEG))
            .unwrap();
        assert!(
            listed.is_empty(),
            "seed {}: the recreated timeline sees the old one's objects: {listed:?}",
            self.seed
        );
    }

    fn hold_or_release(&mut self) {
        let Some(live) = self.live.as_mut() else {
            return;
        };
        if !live.holds.is_empty() && self.rng.random_bool(0.5) {
            let i = self.rng.random_range(0..live.holds.len());
            live.holds.swap_remove(i);
            return;
        }
        let flush = live.tl.positions().flush_lsn;
        let lsn = Lsn(self.rng.random_range(START.0..=flush.0));
        if let Some(h) = live.tl.hold_wal(lsn) {
            live.holds.push((lsn, h));
        }
    }

    fn step(&mut self) {
        match self.rng.random_range(0..100) {
            0..30 => self.append(),
            30..70 => self.perform(),
            70..78 => {
                self.now += Duration::from_millis(self.rng.random_range(20..2500));
                self.feed(Event::Tick(self.now));
            }
            78..84 => self.hold_or_release(),
            84..88 => {
                self.store_down = !self.store_down;
                let down = self.store_down;
                self.note(format!("store down: {down}"));
            }
            88..92 => self.crash(),
            92..94 if self.live.is_some() && self.rng.random_bool(0.3) => self.delete(),
            94 if self.live.is_some() => self.pull(),
            _ if self.live.is_none() => self.after_delete(),
            _ => self.perform(),
        }
        if std::env::var("MANAGER_SIM_NO_CHECK").is_err() {
            self.check();
        }
    }

    /// The invariants (module docs).
    fn check(&mut self) {
        let Some(live) = &self.live else { return };
        let tl = &live.tl;
        let first_local = crate::wal_store::first_local_segment(&self.fs, &tl.dir, SEG)
            .unwrap()
            .unwrap_or(u64::MAX);
        let start_seg = START.segment_number(SEG);
        if first_local > start_seg && first_local != u64::MAX {
            let (_, persisted) = tl.lsns();
            let needed = [
                ("persisted commit LSN", persisted.commit_lsn),
                ("persisted backup LSN", persisted.backup_lsn),
                (
                    "persisted peers' horizon (less a page)",
                    Lsn(persisted.peer_horizon_lsn.0.saturating_sub(8192)),
                ),
            ];
            for (what, lsn) in needed {
                assert!(
                    first_local <= lsn.segment_number(SEG),
                    "seed {}: segments below {first_local} removed, but the {what} {lsn} needs \
                     segment {}\n{}",
                    self.seed,
                    lsn.segment_number(SEG),
                    self.replay_hint()
                );
            }
        }
        for (lsn, _) in &live.holds {
            assert!(
                lsn.segment_number(SEG) >= first_local.min(tl.removed_below()),
                "seed {}: a reader holds {lsn} but segments below {first_local} are gone",
                self.seed
            );
        }
    }

    /// Every acknowledged byte is local or stored, identical to what was sent.
    fn check_content(&mut self) {
        let Some(live) = &self.live else { return };
        let tl = live.tl.clone();
        let (fs, acked) = (self.fs.clone(), self.proposer.acked);
        self.check_content_of(&tl, &fs, acked);
    }

    /// `tl`'s WAL below `acked` (on `fs`, or in the store where `fs` has no segment) is the
    /// WAL the proposer sent.
    fn check_content_of(&self, tl: &Timeline, fs: &Fs, acked: Lsn) {
        let mut segno = START.segment_number(SEG);
        while Lsn(segno * SEG) < acked {
            let from = Lsn((segno * SEG).max(START.0));
            let to = Lsn(((segno + 1) * SEG).min(acked.0));
            let want = &self.proposer.sent[(from.0 - START.0) as usize..(to.0 - START.0) as usize];
            let mut got = Vec::new();
            if tl.has_segment_at(from) {
                // The file as the disk holds it (WalReader's reads are tested on their own;
                // a zero-filled read buffer is slow in unoptimized builds).
                let names =
                    [false, true].map(|p| crate::wal_store::segment_path(&tl.dir, segno, SEG, p));
                let f = names
                    .iter()
                    .find_map(|p| fs.open(p, sk_core::storage::fs::OpenMode::Read).ok())
                    .expect("the local segment opens");
                let mut buf = vec![0u8; (to.0 - from.0) as usize];
                sk_core::storage::fs::read_full_at(&*f, &mut buf, from.segment_offset(SEG))
                    .unwrap();
                got = buf;
            } else {
                let stored = self
                    .rt
                    .block_on(self.backup.storage.read_segment(&tl.ttid, segno, SEG))
                    .unwrap()
                    .unwrap_or_else(|| {
                        panic!(
                            "seed {}: segment {segno} is neither local nor stored\n{}",
                            self.seed,
                            self.replay_hint()
                        )
                    });
                got.extend_from_slice(
                    &stored[from.segment_offset(SEG) as usize..(to.0 - segno * SEG) as usize],
                );
            }
            assert!(
                got == want,
                "seed {}: WAL {from}..{to} differs from what was acknowledged\n{}",
                self.seed,
                self.replay_hint()
            );
            segno += 1;
        }
    }

    fn replay_hint(&self) -> String {
        format!(
            "replay: MANAGER_SIM_SEED={} MANAGER_SIM_STEPS={} MANAGER_SIM_TRACE=1 cargo test -p \
             safekeeper --lib manager_sim_replay_one_seed -- --ignored --nocapture\nlast steps: {:#?}",
            self.seed,
            steps(),
            &self.log[self.log.len().saturating_sub(12)..]
        )
    }
}

/// What the simulation's pulls did.
#[derive(Clone, Copy, Debug, Default)]
struct PullCounts {
    installed: u64,
    /// Refused (their snapshots were aborted).
    refused: u64,
    /// Pullers that lost power in their pull (among the two above).
    puller_crashes: u64,
}

impl std::ops::AddAssign for PullCounts {
    fn add_assign(&mut self, o: PullCounts) {
        self.installed += o.installed;
        self.refused += o.refused;
        self.puller_crashes += o.puller_crashes;
    }
}

fn load(fs: &Fs) -> GlobalTimelines {
    GlobalTimelines::load_in(fs.clone(), Path::new(DATADIR), NodeId(1), false).expect("loads")
}

fn steps() -> u64 {
    env_u64("MANAGER_SIM_STEPS").unwrap_or(200)
}

/// Runs one seed; returns how many segments were removed, crashes survived, and what its
/// pulls did.
fn run_seed(seed: u64) -> (u64, u64, PullCounts) {
    let mut s = Sim::new(seed);
    let mut removed = 0;
    for i in 0..steps() {
        let before = s.live.as_ref().map(|l| l.tl.removed_below());
        s.step();
        if let (Some(b), Some(l)) = (before, &s.live) {
            removed += l.tl.removed_below().saturating_sub(b);
        }
        let _ = i;
    }
    s.check_content();
    (removed, s.crashes, s.pulls)
}

#[test]
fn manager_sim_seeds() {
    let seeds = env_u64("MANAGER_SIM_SEEDS").unwrap_or(1000);
    let base = env_u64("MANAGER_SIM_BASE").unwrap_or(0);
    let (mut removed, mut crashes, mut pulls) = (0, 0, PullCounts::default());
    for seed in base..base + seeds {
        let (r, c, p) = run_seed(seed);
        removed += r;
        crashes += c;
        pulls += p;
    }
    eprintln!(
        "{seeds} seeds: {removed} segments removed, {crashes} crashes survived; pulls: {} \
         installed, {} refused, {} puller power losses mid-pull",
        pulls.installed, pulls.refused, pulls.puller_crashes
    );
    // The schedule does exercise removal and crashes (a simulation that never removes proves
    // nothing about removal).
    assert!(removed > seeds, "removal ran too rarely: {removed}");
    assert!(crashes > seeds, "crashes ran too rarely: {crashes}");
    assert!(
        pulls.installed > seeds / 2 && pulls.refused > 0 && pulls.puller_crashes > 0,
        "pulls ran too rarely: {pulls:?}"
    );
}

#[test]
#[ignore = "replays MANAGER_SIM_SEED"]
fn manager_sim_replay_one_seed() {
    let seed = env_u64("MANAGER_SIM_SEED").expect("set MANAGER_SIM_SEED=<seed>");
    let (removed, crashes, pulls) = run_seed(seed);
    eprintln!("seed {seed}: {removed} segments removed, {crashes} crashes, pulls {pulls:?}");
}
