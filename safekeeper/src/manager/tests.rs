//! The manager core's rules, one at a time (the seeded simulation, `sim.rs`, composes them over
//! a real timeline with crashes).

use super::*;

const SEG: u64 = 1 << 20;

/// The configuration of these tests and of the simulation: 1 MiB segments, remote storage,
/// nothing kept below the flush LSN.
pub(super) fn cfg() -> Config {
    Config {
        seg_size: SEG,
        wal_keep_size: 0,
        remote: true,
        parallelism: 2,
        save_interval: Duration::from_secs(5),
        partial_timeout: None,
        evict_after: None,
    }
}

fn lsns(commit: u64, peers: u64, backup: u64) -> Lsns {
    Lsns {
        commit_lsn: Lsn(commit),
        peer_horizon_lsn: Lsn(peers),
        backup_lsn: Lsn(backup),
    }
}

fn obs(inmem: Lsns, persisted: Lsns) -> Observed {
    Observed {
        flush_lsn: Lsn(inmem.commit_lsn.0.max(persisted.commit_lsn.0) + 100),
        wal_start_lsn: Lsn(SEG),
        inmem,
        persisted,
        busy: false,
    }
}

fn uploads(actions: &[Action]) -> Vec<u64> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Upload { segno, .. } => Some(*segno),
            _ => None,
        })
        .collect()
}

/// The first step (the store is listed; removal, which goes by persisted state only, need not
/// wait for it) and the answer to the listing: every action of both.
fn listed(core: &mut ManagerCore, segs: impl IntoIterator<Item = u64>) -> Vec<Action> {
    let mut out = core.step(Event::Tick(Duration::ZERO));
    assert!(out.contains(&Action::List), "{out:?}");
    out.retain(|a| *a != Action::List);
    out.extend(core.step(Event::Listed(Some(segs.into_iter().collect()))));
    out
}

/// Issue 26, defect 1: the in-memory commit LSN is segments ahead of the saved one; removal
/// goes only to the saved one's segment, and asks for a save first to go further.
#[test]
fn removal_goes_by_the_persisted_state_and_saves_first_to_go_further() {
    let persisted = lsns(3 * SEG + 10, 9 * SEG, 9 * SEG);
    let inmem = lsns(8 * SEG + 10, 9 * SEG, 9 * SEG);
    let mut core = ManagerCore::new(cfg(), obs(inmem, persisted), 1);
    let out = listed(&mut core, 1..9);
    assert!(
        out.contains(&Action::Remove {
            horizon: Lsn(3 * SEG + 10)
        }),
        "{out:?}"
    );
    assert!(
        out.contains(&Action::Save),
        "the in-memory state allows more: {out:?}"
    );
    // Nothing more while both are in flight.
    let again = core.step(Event::Tick(Duration::from_millis(1)));
    assert!(
        !again
            .iter()
            .any(|a| matches!(a, Action::Remove { .. } | Action::Save)),
        "{again:?}"
    );
    core.step(Event::Removed { first_local: 3 });
    core.step(Event::Saved { ok: true });
    let out = core.step(Event::Observed(obs(inmem, inmem)));
    assert!(
        out.contains(&Action::Remove {
            horizon: Lsn(8 * SEG + 10)
        }),
        "after the save: {out:?}"
    );
}

#[test]
fn the_backup_lsn_and_the_peers_horizon_bound_removal_as_persisted() {
    // Backed up to 4 in memory but 2 in the control file: removal stops at 2.
    let persisted = lsns(9 * SEG, 9 * SEG, 2 * SEG);
    let inmem = lsns(9 * SEG, 9 * SEG, 4 * SEG);
    let mut core = ManagerCore::new(cfg(), obs(inmem, persisted), 1);
    let out = listed(&mut core, 1..4);
    assert!(
        out.contains(&Action::Remove {
            horizon: Lsn(2 * SEG)
        }),
        "{out:?}"
    );
    // The peers' horizon as persisted, with its page before.
    let persisted = lsns(9 * SEG, 5 * SEG, 9 * SEG);
    let mut core = ManagerCore::new(cfg(), obs(persisted, persisted), 1);
    let out = listed(&mut core, 1..9);
    assert!(
        out.contains(&Action::Remove {
            horizon: Lsn(5 * SEG - 8192)
        }),
        "{out:?}"
    );
    // Without remote storage nothing is ever removed or uploaded.
    let mut core = ManagerCore::new(
        Config {
            remote: false,
            ..cfg()
        },
        obs(persisted, persisted),
        1,
    );
    let out = core.step(Event::Tick(Duration::from_secs(60)));
    assert!(out.is_empty(), "{out:?}");
}

#[test]
fn nothing_is_uploaded_before_the_store_was_listed_and_listed_segments_are_verified() {
    let l = lsns(5 * SEG + 1, 5 * SEG, SEG);
    let mut core = ManagerCore::new(cfg(), obs(l, l), 1);
    assert_eq!(core.step(Event::Tick(Duration::ZERO)), vec![Action::List]);
    assert!(uploads(&core.step(Event::Tick(Duration::from_secs(1)))).is_empty());
    // A failed listing is retried with backoff.
    assert!(core.step(Event::Listed(None)).is_empty());
    assert_eq!(
        core.step(Event::Tick(Duration::from_secs(2))),
        vec![Action::List]
    );
    let out = core.step(Event::Listed(Some([2].into_iter().collect())));
    assert_eq!(
        out,
        vec![
            Action::Upload {
                segno: 1,
                valid_from: 0,
                known_stored: false
            },
            Action::Upload {
                segno: 2,
                valid_from: 0,
                known_stored: true
            },
        ],
        "in order, at most the parallelism, the listed one verified"
    );
    // Out of order completion: the backed-up prefix moves only when it is contiguous.
    let out = core.step(Event::Uploaded { segno: 2, ok: true });
    assert!(
        !out.iter().any(|a| matches!(a, Action::SetBackupLsn(_))),
        "{out:?}"
    );
    assert_eq!(uploads(&out), vec![3]);
    let out = core.step(Event::Uploaded { segno: 1, ok: true });
    assert!(out.contains(&Action::SetBackupLsn(Lsn(3 * SEG))), "{out:?}");
    assert_eq!(uploads(&out), vec![4]);
}

#[test]
fn a_failed_upload_is_retried_with_backoff() {
    let l = lsns(2 * SEG + 1, 2 * SEG, SEG);
    let mut core = ManagerCore::new(cfg(), obs(l, l), 1);
    assert_eq!(uploads(&listed(&mut core, [])), vec![1]);
    let out = core.step(Event::Uploaded {
        segno: 1,
        ok: false,
    });
    assert!(uploads(&out).is_empty(), "not at once: {out:?}");
    assert_eq!(core.next_wakeup(), Some(FIRST_BACKOFF));
    assert_eq!(uploads(&core.step(Event::Tick(FIRST_BACKOFF))), vec![1]);
    core.step(Event::Uploaded {
        segno: 1,
        ok: false,
    });
    assert_eq!(core.next_wakeup(), Some(FIRST_BACKOFF * 3), "doubled");
}

/// A save the file system refuses (its directory gone, a full or read-only disk) is tried
/// again after a backoff that doubles, never at once: the lifecycle loop once logged such an
/// error tens of thousands of times a second, at half a core.
#[test]
fn a_failed_save_is_retried_with_backoff() {
    let cfg = Config {
        remote: false,
        ..cfg()
    };
    let persisted = lsns(500, 0, 0);
    let mut core = ManagerCore::new(cfg, obs(persisted, persisted), 1);
    let far = lsns(2 * SEG + 500, 0, 0);
    assert_eq!(
        core.step(Event::Observed(obs(far, persisted))),
        vec![Action::Save]
    );
    let out = core.step(Event::Saved { ok: false });
    assert!(!out.contains(&Action::Save), "not at once: {out:?}");
    assert!(
        !core
            .step(Event::Observed(obs(far, persisted)))
            .contains(&Action::Save)
    );
    assert_eq!(core.next_wakeup(), Some(FIRST_BACKOFF));
    assert_eq!(core.step(Event::Tick(FIRST_BACKOFF)), vec![Action::Save]);
    core.step(Event::Saved { ok: false });
    assert_eq!(core.next_wakeup(), Some(FIRST_BACKOFF * 3), "doubled");
    // Not before the doubled delay.
    assert!(core.step(Event::Tick(FIRST_BACKOFF * 2)).is_empty());
    assert_eq!(
        core.step(Event::Tick(FIRST_BACKOFF * 3)),
        vec![Action::Save]
    );
    // The save took: what it wrote is the persisted state.
    assert!(core.step(Event::Observed(obs(far, far))).is_empty());
    assert!(core.step(Event::Saved { ok: true }).is_empty());
    // Saved: the next failure starts from the first delay again.
    let further = lsns(4 * SEG + 500, 0, 0);
    assert_eq!(
        core.step(Event::Observed(obs(further, far))),
        vec![Action::Save]
    );
    core.step(Event::Saved { ok: false });
    assert_eq!(core.next_wakeup(), Some(FIRST_BACKOFF * 4));
}

/// Issue 26: after a restart whose control file was older than a removal, the backup LSN is
/// below the first local segment. The store's listing covers those segments; one it does not
/// hold is reported, never retried from a file that is gone.
#[test]
fn a_restarted_node_backs_up_from_what_is_local_or_stored() {
    let l = lsns(8 * SEG + 1, 8 * SEG, 2 * SEG);
    // Segments below 5 were removed before the restart.
    let mut core = ManagerCore::new(cfg(), obs(l, l), 5);
    let out = listed(&mut core, [2, 3, 4]);
    assert!(out.contains(&Action::SetBackupLsn(Lsn(5 * SEG))), "{out:?}");
    assert_eq!(uploads(&out), vec![5, 6]);
    // Segment 3 missing from the store: reported once, nothing uploaded below the local WAL.
    let mut core = ManagerCore::new(cfg(), obs(l, l), 5);
    let out = listed(&mut core, [2, 4]);
    assert_eq!(
        out.iter()
            .filter(|a| **a == Action::Missing { segno: 3 })
            .count(),
        1
    );
    assert!(
        uploads(&out).iter().all(|s| *s >= 5),
        "a removed segment is never uploaded: {out:?}"
    );
    assert!(out.contains(&Action::SetBackupLsn(Lsn(3 * SEG))), "{out:?}");
    let out = core.step(Event::Tick(Duration::from_secs(1)));
    assert!(
        !out.contains(&Action::Missing { segno: 3 }),
        "once: {out:?}"
    );
    // It is looked for again later.
    let out = core.step(Event::Tick(RELIST_MISSING_AFTER + Duration::from_secs(1)));
    assert_eq!(out, vec![Action::List]);
}

#[test]
fn a_deleted_timeline_stops_its_work_and_then_asks_for_nothing() {
    let l = lsns(5 * SEG + 1, 5 * SEG, SEG);
    let mut core = ManagerCore::new(cfg(), obs(l, l), 1);
    assert!(!uploads(&listed(&mut core, [])).is_empty());
    assert_eq!(core.step(Event::Deleted), vec![Action::Stop]);
    // Late answers of aborted work ask for nothing.
    assert!(core.step(Event::Uploaded { segno: 1, ok: true }).is_empty());
    assert!(core.step(Event::Tick(Duration::from_secs(99))).is_empty());
    assert_eq!(core.step(Event::Stopped), vec![Action::Finished]);
    assert!(core.step(Event::Observed(obs(l, l))).is_empty());
    assert_eq!(core.next_wakeup(), None);
}

#[test]
fn saves_come_due_by_time_or_when_the_commit_ran_a_segment_ahead() {
    let persisted = lsns(SEG + 5, 0, 0);
    let cfg = Config {
        remote: false,
        ..cfg()
    };
    let mut core = ManagerCore::new(cfg, obs(persisted, persisted), 1);
    let moved = lsns(SEG + 500, 0, 0);
    assert!(core.step(Event::Observed(obs(moved, persisted))).is_empty());
    assert_eq!(core.next_wakeup(), Some(cfg.save_interval));
    assert_eq!(
        core.step(Event::Tick(cfg.save_interval)),
        vec![Action::Save]
    );
    core.step(Event::Saved { ok: true });
    let far = lsns(2 * SEG + 500, 0, 0);
    assert_eq!(
        core.step(Event::Observed(obs(far, moved))),
        vec![Action::Save],
        "a segment ahead: at once"
    );
}

/// A removal that readers' holds cut short is not retried in a loop, but after a while.
#[test]
fn a_removal_cut_short_by_a_hold_is_tried_again_later() {
    let l = lsns(9 * SEG, 9 * SEG, 9 * SEG);
    let mut core = ManagerCore::new(cfg(), obs(l, l), 1);
    let h = core.removal_horizon();
    assert_eq!(
        h,
        Lsn(9 * SEG - 8192),
        "the page below the peers' horizon stays"
    );
    let out = listed(&mut core, 1..9);
    assert!(out.contains(&Action::Remove { horizon: h }));
    let out = core.step(Event::Removed { first_local: 4 });
    assert!(
        !out.iter().any(|a| matches!(a, Action::Remove { .. })),
        "{out:?}"
    );
    assert_eq!(core.next_wakeup(), Some(REMOVE_AGAIN_AFTER));
    let out = core.step(Event::Tick(REMOVE_AGAIN_AFTER));
    assert!(out.contains(&Action::Remove { horizon: h }), "{out:?}");
}

#[test]
fn a_snapshot_starts_at_the_backed_up_point_with_remote_storage() {
    let i = SnapshotInputs {
        seg_size: SEG,
        wal_start: Lsn(SEG + 40),
        first_local: Lsn(4 * SEG),
        flush: Lsn(9 * SEG + 7),
        horizon: Lsn(6 * SEG + 100),
        remote: true,
    };
    assert_eq!(
        snapshot_start(&i),
        Ok(Lsn(6 * SEG)),
        "the horizon's segment start"
    );
    let nothing_backed = SnapshotInputs {
        horizon: Lsn::INVALID,
        first_local: Lsn(SEG),
        ..i
    };
    assert_eq!(
        snapshot_start(&nothing_backed),
        Ok(Lsn(SEG + 40)),
        "the WAL's start"
    );
    // Never below what is still local.
    let behind = SnapshotInputs {
        horizon: Lsn(2 * SEG),
        ..i
    };
    assert_eq!(snapshot_start(&behind), Ok(Lsn(4 * SEG)));
    // Without remote storage: from the WAL's start, which must be local.
    let local = SnapshotInputs { remote: false, ..i };
    assert!(
        snapshot_start(&local)
            .unwrap_err()
            .contains("--remote-storage")
    );
    let whole = SnapshotInputs {
        remote: false,
        first_local: Lsn(SEG),
        ..i
    };
    assert_eq!(snapshot_start(&whole), Ok(Lsn(SEG + 40)));
}

/// Member `id` of a configuration.
fn member(id: u64) -> sk_core::state::SafekeeperId {
    sk_core::state::SafekeeperId {
        id: sk_core::types::NodeId(id),
        host: format!("sk{id}"),
        pg_port: 5454,
    }
}

#[test]
fn a_pull_needs_a_majority_of_the_members_not_of_the_hosts_asked() {
    use sk_core::state::Configuration;
    use sk_core::types::{Generation, NodeId};
    let mconf = Configuration {
        generation: Generation(3),
        members: vec![member(1), member(2), member(3)],
        new_members: None,
    };
    // Two hosts asked, both answered, but only one is a member: not a majority of members.
    let err = pull_quorum(&[NodeId(1), NodeId(9)], &mconf, 2).unwrap_err();
    assert!(err.contains("members [1, 2, 3]"), "{err}");
    assert!(pull_quorum(&[NodeId(1), NodeId(3)], &mconf, 2).is_ok());
    // Joint: a majority of each half.
    let joint = Configuration {
        new_members: Some(vec![member(3), member(4), member(5)]),
        ..mconf.clone()
    };
    assert!(pull_quorum(&[NodeId(1), NodeId(2)], &joint, 5).is_err());
    assert!(pull_quorum(&[NodeId(1), NodeId(3), NodeId(4)], &joint, 5).is_ok());
    // Generation 0: a majority of the hosts asked.
    let none = Configuration::default();
    assert!(pull_quorum(&[NodeId(1)], &none, 3).is_err());
    assert!(pull_quorum(&[NodeId(1), NodeId(2)], &none, 3).is_ok());
}

#[test]
fn only_a_member_deletes_the_stores_objects() {
    use sk_core::state::Configuration;
    use sk_core::types::{Generation, NodeId};
    let gen1 = |ids: &[u64]| Configuration {
        generation: Generation(1),
        members: ids.iter().map(|&i| member(i)).collect(),
        new_members: None,
    };
    let everywhere = |c: Option<&Configuration>, node: u64| {
        deletes_remote_objects(DeleteScope::Everywhere, true, c, NodeId(node))
    };
    // A member (of either half of a joint configuration), a timeline without a configuration,
    // and a delete of a timeline this node does not have: the objects go.
    assert_eq!(everywhere(Some(&gen1(&[1, 2, 3])), 2), Ok(true));
    let joint = Configuration {
        new_members: Some(vec![member(1), member(3), member(4)]),
        ..gen1(&[1, 2, 3])
    };
    assert_eq!(everywhere(Some(&joint), 2), Ok(true));
    assert_eq!(everywhere(Some(&joint), 4), Ok(true));
    assert_eq!(everywhere(Some(&Configuration::default()), 7), Ok(true));
    assert_eq!(everywhere(None, 7), Ok(true));
    // A node the configuration left out is refused, and told how to delete its own copy.
    let err = everywhere(Some(&gen1(&[1, 3, 4])), 2).unwrap_err();
    assert!(
        err.contains("members 1, 3, 4") && err.contains("only_local"),
        "{err}"
    );
    // Its own copy only; and nothing remote without remote storage.
    let only_local = deletes_remote_objects(
        DeleteScope::OnlyLocal,
        true,
        Some(&gen1(&[1, 3, 4])),
        NodeId(2),
    );
    assert_eq!(only_local, Ok(false));
    assert_eq!(
        deletes_remote_objects(DeleteScope::Everywhere, false, None, NodeId(1)),
        Ok(false)
    );
}

fn partial_uploads(actions: &[Action]) -> Vec<(u64, Lsn)> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::UploadPartial { segno, upto, .. } => Some((*segno, *upto)),
            _ => None,
        })
        .collect()
}

/// Partial-segment backup: committed WAL mid-segment waits the timeout (only while no complete
/// segment is backed up), then its committed and locally durable part is uploaded; a success
/// removes what it supersedes, a failure is retried after a backoff.
#[test]
fn committed_wal_mid_segment_is_uploaded_as_a_partial_segment_after_the_timeout() {
    let timeout = Duration::from_secs(10);
    let config = Config {
        partial_timeout: Some(timeout),
        ..cfg()
    };
    // Commit mid-segment 3; complete segment 1 backed up (2 is stored, being verified); this
    // node flushed less than the commit it was told: only its durable WAL may go.
    let l = lsns(3 * SEG + 5000, 3 * SEG, 2 * SEG);
    let o = Observed {
        flush_lsn: Lsn(3 * SEG + 4000),
        ..obs(l, l)
    };
    let mut core = ManagerCore::new(config, o, 1);
    let out = listed(&mut core, [1, 2]);
    assert!(
        partial_uploads(&out).is_empty(),
        "not before the timeout: {out:?}"
    );
    assert_eq!(
        core.next_wakeup(),
        Some(timeout),
        "it wakes for the timeout"
    );
    // A new complete segment resets the wait.
    let l2 = lsns(3 * SEG + 5000, 3 * SEG, 3 * SEG);
    let moved = Observed {
        inmem: Lsns {
            backup_lsn: Lsn(3 * SEG),
            ..l2
        },
        ..o
    };
    core.step(Event::Tick(Duration::from_secs(6)));
    let out = core.step(Event::Observed(moved));
    assert!(partial_uploads(&out).is_empty(), "{out:?}");
    // The WAL moved: objects an earlier run left are swept once; a failed removal is retried
    // after a backoff, never at once.
    let sweep = Action::RemovePartials {
        below: Lsn(3 * SEG),
    };
    assert!(out.contains(&sweep), "{out:?}");
    let out = core.step(Event::RemovedPartials {
        below: Lsn(3 * SEG),
        ok: false,
    });
    assert!(!out.contains(&sweep), "{out:?}");
    let out = core.step(Event::Tick(Duration::from_secs(6) + FIRST_BACKOFF));
    assert!(out.contains(&sweep), "{out:?}");
    let out = core.step(Event::RemovedPartials {
        below: Lsn(3 * SEG),
        ok: true,
    });
    assert!(
        !out.iter()
            .any(|a| matches!(a, Action::RemovePartials { .. })),
        "{out:?}"
    );
    let out = core.step(Event::Tick(Duration::from_secs(12)));
    assert!(
        partial_uploads(&out).is_empty(),
        "the wait restarted at 6 s: {out:?}"
    );
    let out = core.step(Event::Tick(Duration::from_secs(16)));
    assert_eq!(
        partial_uploads(&out),
        vec![(3, Lsn(3 * SEG + 4000))],
        "min(commit, flush): {out:?}"
    );
    // One at a time.
    let out = core.step(Event::Tick(Duration::from_secs(17)));
    assert!(partial_uploads(&out).is_empty(), "{out:?}");
    // A failure is retried after the backoff.
    let out = core.step(Event::UploadedPartial {
        upto: Lsn(3 * SEG + 4000),
        ok: false,
    });
    assert!(partial_uploads(&out).is_empty(), "{out:?}");
    let out = core.step(Event::Tick(Duration::from_secs(17) + FIRST_BACKOFF));
    assert_eq!(
        partial_uploads(&out),
        vec![(3, Lsn(3 * SEG + 4000))],
        "{out:?}"
    );
    // A success removes the superseded objects and waits for new committed WAL.
    let out = core.step(Event::UploadedPartial {
        upto: Lsn(3 * SEG + 4000),
        ok: true,
    });
    assert!(
        out.contains(&Action::RemovePartials {
            below: Lsn(3 * SEG + 4000)
        }),
        "{out:?}"
    );
    core.step(Event::RemovedPartials {
        below: Lsn(3 * SEG + 4000),
        ok: true,
    });
    assert_eq!(core.next_wakeup(), None, "nothing waits");
    // Later complete segments list nothing more once this node's object is behind them... but
    // the one that passes it removes it.
    // Committed, flushed and backed up into segment `n`.
    let into_segment = |n: u64| Observed {
        inmem: lsns(n * SEG + 10, n * SEG, n * SEG),
        flush_lsn: Lsn(n * SEG + 10),
        ..o
    };
    let out = core.step(Event::Observed(into_segment(4)));
    assert!(
        out.contains(&Action::RemovePartials {
            below: Lsn(4 * SEG)
        }),
        "{out:?}"
    );
    core.step(Event::RemovedPartials {
        below: Lsn(4 * SEG),
        ok: true,
    });
    let out = core.step(Event::Observed(into_segment(5)));
    assert!(
        !out.iter()
            .any(|a| matches!(a, Action::RemovePartials { .. })),
        "no listing per complete segment: {out:?}"
    );
    // Without a timeout (or at a segment boundary) nothing is ever uploaded as partial.
    let mut core = ManagerCore::new(cfg(), o, 1);
    listed(&mut core, [1, 2]);
    let out = core.step(Event::Tick(Duration::from_secs(3600)));
    assert!(partial_uploads(&out).is_empty(), "{out:?}");
}

#[test]
fn partial_object_names_carry_term_and_end_and_are_never_complete_segments() {
    use crate::remote_storage::{parse_partial_name, partial_name};
    let seg = 16 << 20;
    let name = partial_name(5, seg, 7, Lsn(5 * seg + 8192));
    assert_eq!(
        name,
        "000000010000000000000005_0000000000000007_0000000005002000.partial"
    );
    assert_eq!(
        parse_partial_name(&name, seg),
        Some((5, 7, Lsn(5 * seg + 8192)))
    );
    for other in [
        "000000010000000000000005",
        "000000010000000000000005.partial",
        "000000010000000000000005_0000000000000007_0000000005000000.partial",
        "000000010000000000000005_0000000000000007_0000000006002000.partial",
        "000000010000000000000005_7_5002000.partial",
    ] {
        assert_eq!(parse_partial_name(other, seg), None, "{other}");
    }
    assert_eq!(
        pg_wal::format::parse_xlog_file_name(&name, seg),
        None,
        "a complete-segment parser takes no partial object"
    );
}

/// Eviction: only after the idle time with nothing connected, nothing in flight, every LSN
/// saved, and all WAL in the store (complete segments by the persisted backup LSN, the end's
/// segment by a partial object up to the end); a refusal waits the idle time again, a success
/// ends the manager.
#[test]
fn a_timeline_is_evicted_only_idle_with_all_its_wal_in_the_store() {
    let idle = Duration::from_secs(60);
    let timeout = Duration::from_secs(10);
    let config = Config {
        partial_timeout: Some(timeout),
        evict_after: Some(idle),
        ..cfg()
    };
    let end = Lsn(3 * SEG + 5000);
    let l = lsns(end.0, end.0, 3 * SEG);
    let o = Observed {
        flush_lsn: end,
        ..obs(l, l)
    };
    let evicts = |out: &[Action]| out.iter().any(|a| matches!(a, Action::Evict { .. }));
    let mut core = ManagerCore::new(config, o, 1);
    let out = listed(&mut core, [1, 2]);
    assert!(!evicts(&out), "{out:?}");
    // The backed-up segments are removed locally first (nothing while that is in flight).
    assert!(
        out.iter().any(|a| matches!(a, Action::Remove { .. })),
        "{out:?}"
    );
    let mut out = core.step(Event::Tick(idle));
    assert!(!evicts(&out), "a removal in flight: {out:?}");
    out.extend(core.step(Event::Removed { first_local: 3 }));
    assert!(!evicts(&out), "{out:?}");
    // Past the idle time but the end's segment is not stored yet: the partial upload first.
    assert_eq!(partial_uploads(&out), vec![(3, end)], "{out:?}");
    let out = core.step(Event::UploadedPartial {
        upto: end,
        ok: true,
    });
    // Then what it supersedes is removed, and only then is the timeline evicted.
    assert_eq!(out, vec![Action::RemovePartials { below: end }], "{out:?}");
    let out = core.step(Event::RemovedPartials {
        below: end,
        ok: true,
    });
    assert_eq!(
        out,
        vec![Action::Evict { end }],
        "stored up to the end: {out:?}"
    );
    // Refused at the node's check (a proposer arrived): idle again from now.
    let out = core.step(Event::Evicted { ok: false });
    assert!(!evicts(&out), "{out:?}");
    assert_eq!(core.next_wakeup(), Some(idle + idle));
    // A connection keeps it resident however long it lasts.
    let busy = Observed { busy: true, ..o };
    core.step(Event::Tick(idle + idle - Duration::from_secs(1)));
    let mut out = core.step(Event::Observed(busy));
    out.extend(core.step(Event::Tick(idle + idle)));
    assert!(!evicts(&out), "busy: {out:?}");
    core.step(Event::Observed(o));
    let out = core.step(Event::Tick(idle * 3 - Duration::from_secs(2)));
    assert!(!evicts(&out), "idle since the connection left: {out:?}");
    // Unsaved LSNs, or a commit LSN behind the end, keep it too.
    let unsaved = Observed {
        inmem: lsns(end.0, end.0, 3 * SEG),
        persisted: lsns(end.0 - 100, end.0, 3 * SEG),
        ..o
    };
    let mut out = core.step(Event::Observed(unsaved));
    out.extend(core.step(Event::Tick(idle * 4)));
    assert!(!evicts(&out), "unsaved: {out:?}");
    assert!(out.contains(&Action::Save), "{out:?}");
    core.step(Event::Saved { ok: true });
    // A complete segment not backed up (persisted backup LSN) keeps it.
    let behind = Observed {
        inmem: lsns(end.0, end.0, 2 * SEG),
        persisted: lsns(end.0, end.0, 2 * SEG),
        ..o
    };
    let mut c2 = ManagerCore::new(config, behind, 3);
    listed(&mut c2, [1]);
    c2.step(Event::Tick(idle));
    c2.step(Event::UploadedPartial {
        upto: end,
        ok: true,
    });
    c2.step(Event::RemovedPartials {
        below: end,
        ok: true,
    });
    // Its upload failed (retried later): nothing is in flight, but it is not stored.
    c2.step(Event::Uploaded {
        segno: 2,
        ok: false,
    });
    let out = c2.step(Event::Tick(idle * 2));
    assert!(!evicts(&out), "segment 2 not backed up: {out:?}");
    // Back to the evictable state (idle long since): evicted, and the manager is done.
    let out = core.step(Event::Observed(o));
    assert_eq!(out, vec![Action::Evict { end }], "{out:?}");
    assert_eq!(
        core.step(Event::Evicted { ok: true }),
        vec![Action::Finished]
    );
    assert_eq!(core.next_wakeup(), None);
}

/// A timeline whose WAL ends at a segment boundary, all of it in complete segments, needs no
/// partial object to be evicted; one without remote storage is never evicted.
#[test]
fn wal_ending_at_a_segment_boundary_is_evicted_without_a_partial_object() {
    let idle = Duration::from_secs(60);
    let end = Lsn(3 * SEG);
    let l = lsns(end.0, end.0, end.0);
    let o = Observed {
        flush_lsn: end,
        ..obs(l, l)
    };
    let config = Config {
        evict_after: Some(idle),
        ..cfg()
    };
    let mut core = ManagerCore::new(config, o, 3);
    listed(&mut core, [1, 2]);
    let out = core.step(Event::Tick(idle));
    assert_eq!(out, vec![Action::Evict { end }], "{out:?}");
    let mut local = ManagerCore::new(
        Config {
            remote: false,
            ..config
        },
        o,
        1,
    );
    local.step(Event::Tick(Duration::ZERO));
    let out = local.step(Event::Tick(idle * 10));
    assert!(
        !out.iter().any(|a| matches!(a, Action::Evict { .. })),
        "{out:?}"
    );
}

/// A node whose longest partial object is in a later segment than the complete segments stored
/// removes partial objects only below the complete segments: another node's partial object of a
/// segment not yet stored complete is that segment's only copy in the store.
#[test]
fn superseded_partials_are_removed_only_below_the_stored_complete_segments() {
    let timeout = Duration::from_secs(1);
    let config = Config {
        partial_timeout: Some(timeout),
        ..cfg()
    };
    // Committed into segment 4; complete segments stored only below 3 (3's upload failing).
    let end = Lsn(4 * SEG + 3000);
    let l = lsns(end.0, end.0, 3 * SEG);
    let o = Observed {
        flush_lsn: end,
        ..obs(l, l)
    };
    let mut core = ManagerCore::new(config, o, 1);
    listed(&mut core, [1, 2]);
    let mut out = core.step(Event::Tick(timeout));
    out.extend(core.step(Event::Uploaded {
        segno: 3,
        ok: false,
    }));
    assert_eq!(partial_uploads(&out), vec![(4, end)], "{out:?}");
    let out = core.step(Event::UploadedPartial {
        upto: end,
        ok: true,
    });
    let removals: Vec<Lsn> = out
        .iter()
        .filter_map(|a| match a {
            Action::RemovePartials { below } => Some(*below),
            _ => None,
        })
        .collect();
    assert!(
        removals.iter().all(|b| *b <= Lsn(3 * SEG)),
        "segment 3 is not stored complete: its partial objects stay: {out:?}"
    );
}
