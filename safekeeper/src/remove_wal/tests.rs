use std::sync::Arc;

use super::*;

const SEG: u64 = 1 << 20;

fn inputs() -> HorizonInputs {
    HorizonInputs {
        flush_lsn: Lsn(10 * SEG + 500),
        commit_lsn: Lsn(9 * SEG + 100),
        peer_horizon_lsn: Lsn(8 * SEG + 7),
        backup_lsn: Some(Lsn(7 * SEG)),
        oldest_reader: None,
        wal_keep_size: 0,
    }
}

#[test]
fn the_horizon_is_the_minimum_of_its_inputs() {
    let i = inputs();
    assert_eq!(removal_horizon(&i), Lsn(7 * SEG), "backup_lsn bounds it");
    let i = HorizonInputs {
        backup_lsn: Some(Lsn(10 * SEG)),
        ..inputs()
    };
    assert_eq!(
        removal_horizon(&i),
        Lsn(8 * SEG + 7 - 8192),
        "the peers' horizon bounds it, with the page before it"
    );
    let i = HorizonInputs {
        backup_lsn: Some(Lsn(10 * SEG)),
        peer_horizon_lsn: Lsn(9 * SEG),
        ..inputs()
    };
    assert_eq!(
        removal_horizon(&i).segment_number(SEG),
        8,
        "a horizon at a segment start keeps the segment before it (its last page)"
    );
    let i = HorizonInputs {
        backup_lsn: Some(Lsn(10 * SEG)),
        peer_horizon_lsn: Lsn(10 * SEG),
        ..inputs()
    };
    assert_eq!(
        removal_horizon(&i),
        Lsn(9 * SEG + 100),
        "the commit LSN bounds it"
    );
    let i = HorizonInputs {
        oldest_reader: Some(Lsn(3 * SEG + 1)),
        ..inputs()
    };
    assert_eq!(removal_horizon(&i), Lsn(3 * SEG + 1), "a reader bounds it");
    let i = HorizonInputs {
        wal_keep_size: 5 * SEG,
        ..inputs()
    };
    assert_eq!(
        removal_horizon(&i),
        Lsn(5 * SEG + 500),
        "wal_keep_size bounds it"
    );
    let i = HorizonInputs {
        wal_keep_size: 100 * SEG,
        ..inputs()
    };
    assert_eq!(removal_horizon(&i), Lsn(0));
    // An unknown peer horizon (0) removes nothing.
    let i = HorizonInputs {
        peer_horizon_lsn: Lsn::INVALID,
        ..inputs()
    };
    assert_eq!(removal_horizon(&i), Lsn::INVALID);
}

#[test]
fn without_remote_storage_nothing_is_removed() {
    let i = HorizonInputs {
        backup_lsn: None,
        ..inputs()
    };
    assert_eq!(removal_horizon(&i), Lsn::INVALID);
}

#[test]
fn removal_stops_below_the_oldest_hold_and_holds_below_removed_wal_are_refused() {
    let holds = Arc::new(ReadHolds::new(2));
    assert!(holds.hold(Lsn(SEG + 5), SEG).is_none(), "segment 1 is gone");
    let hold = holds
        .hold(Lsn(4 * SEG + 5), SEG)
        .expect("segment 4 is local");
    let mut asked = Vec::new();
    let n = holds
        .remove_below::<()>(
            SEG,
            |oldest| {
                assert_eq!(oldest, Some(Lsn(4 * SEG + 5)));
                oldest.unwrap().min(Lsn(9 * SEG))
            },
            |below| {
                asked.push(below);
                Ok(2)
            },
        )
        .unwrap();
    assert_eq!((n, asked.as_slice()), (2, &[4][..]));
    assert_eq!(holds.removed_below(), 4);
    // Nothing more while the hold stays at segment 4.
    let n = holds
        .remove_below::<()>(SEG, |o| o.unwrap(), |_| panic!("nothing to remove"))
        .unwrap();
    assert_eq!(n, 0);
    hold.advance(Lsn(6 * SEG));
    let n = holds
        .remove_below::<()>(SEG, |o| o.unwrap(), |below| Ok(below as usize))
        .unwrap();
    assert_eq!((n, holds.removed_below()), (6, 6));
    drop(hold);
    let n = holds
        .remove_below::<()>(
            SEG,
            |o| {
                assert_eq!(o, None, "a dropped hold holds nothing");
                Lsn(7 * SEG)
            },
            |_| Ok(1),
        )
        .unwrap();
    assert_eq!(n, 1);
    // A failed removal keeps its claim: some of its segments may be gone, so no hold is
    // granted there (those readers are served from the store).
    assert!(
        holds
            .remove_below(SEG, |_| Lsn(9 * SEG), |_| Err("io"))
            .is_err()
    );
    assert_eq!(holds.removed_below(), 9);
    assert!(holds.hold(Lsn(8 * SEG), SEG).is_none());
}
