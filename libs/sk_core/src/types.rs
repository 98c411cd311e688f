//! Protocol quantities as newtypes: [`Lsn`], [`Term`], [`Generation`], [`NodeId`], the 16-byte
//! tenant and timeline ids, and [`TermHistory`] with the highest-common-point search the election
//! uses.
//!
//! Pure code: no I/O, no clock. Everything here is shared by the consensus core, storage and the
//! network layers. [`Lsn`] itself lives in `pg_wal` (the WAL format needs it first) and is
//! re-exported here.

use std::fmt;
use std::str::FromStr;

pub use pg_wal::{Lsn, LsnParseError};

/// A consensus term (Raft term, Paxos ballot). Terms only grow.
#[derive(
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Debug,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct Term(pub u64);

impl Term {
    /// The term of a timeline's initial history entry, before any election.
    pub const INITIAL: Term = Term(0);
}

impl fmt::Display for Term {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Membership configuration generation. 0 means "no membership configuration" (legacy mode).
#[derive(
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Debug,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct Generation(pub u32);

impl Generation {
    /// 0: no membership configuration.
    pub const INVALID: Generation = Generation(0);
}

impl fmt::Display for Generation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// A safekeeper's node id.
#[derive(
    Clone,
    Copy,
    Default,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Debug,
    serde::Serialize,
    serde::Deserialize,
)]
pub struct NodeId(pub u64);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// Error parsing a 16-byte id from 32 hex characters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid id {0:?}: expected 32 hexadecimal characters")]
pub struct IdParseError(String);

macro_rules! hex_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
        pub struct $name(pub [u8; 16]);

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                for b in self.0 {
                    write!(f, "{b:02x}")?;
                }
                Ok(())
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(self, f)
            }
        }

        impl FromStr for $name {
            type Err = IdParseError;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                let mut out = [0u8; 16];
                hex::decode_to_slice(s, &mut out).map_err(|_| IdParseError(s.to_string()))?;
                Ok($name(out))
            }
        }

        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
                s.collect_str(self)
            }
        }
    };
}

hex_id!(
    /// A tenant id (16 bytes, shown as 32 lowercase hex characters).
    TenantId
);
hex_id!(
    /// A timeline id (16 bytes, shown as 32 lowercase hex characters).
    TimelineId
);

/// Identifies one consensus instance: a timeline of a tenant.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Debug)]
pub struct TenantTimelineId {
    /// The tenant.
    pub tenant_id: TenantId,
    /// The timeline of that tenant.
    pub timeline_id: TimelineId,
}

impl fmt::Display for TenantTimelineId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.tenant_id, self.timeline_id)
    }
}

/// One entry of a term history: `term` began writing WAL at `lsn`.
#[derive(Clone, Copy, PartialEq, Eq, Debug, serde::Serialize)]
pub struct TermLsn {
    /// The term.
    pub term: Term,
    /// Where its WAL begins.
    pub lsn: Lsn,
}

/// Which term wrote which part of the WAL.
///
/// Invariant: terms strictly increase and LSNs never decrease along the vector. A term's WAL is
/// `[entry.lsn, next.lsn)`; the last entry's WAL ends at the holder's flush LSN (an acceptor) or is
/// open-ended (a proposer).
#[derive(Clone, Default, PartialEq, Eq, Debug, serde::Serialize)]
pub struct TermHistory(pub Vec<TermLsn>);

/// Error for a term history that breaks its ordering invariant.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid term history: {0}")]
pub struct TermHistoryError(pub String);

impl TermHistory {
    /// A history with no entry (a timeline nobody was elected for).
    pub fn empty() -> TermHistory {
        TermHistory(Vec::new())
    }

    /// A history of `(term, lsn)` pairs, as written in tests and tools (not validated).
    pub fn from_pairs(entries: &[(u64, u64)]) -> TermHistory {
        TermHistory(
            entries
                .iter()
                .map(|&(t, l)| TermLsn {
                    term: Term(t),
                    lsn: Lsn(l),
                })
                .collect(),
        )
    }

    /// Checks the ordering invariant (terms strictly increase, LSNs do not decrease).
    pub fn validate(&self) -> Result<(), TermHistoryError> {
        for w in self.0.windows(2) {
            if w[1].term <= w[0].term {
                return Err(TermHistoryError(format!(
                    "term {} follows term {}",
                    w[1].term, w[0].term
                )));
            }
            if w[1].lsn < w[0].lsn {
                return Err(TermHistoryError(format!(
                    "term {} starts at {} before term {} at {}",
                    w[1].term, w[1].lsn, w[0].term, w[0].lsn
                )));
            }
        }
        Ok(())
    }

    /// The term of the last entry (0 if empty): the term that wrote the newest WAL.
    pub fn last_log_term(&self) -> Term {
        self.0.last().map(|e| e.term).unwrap_or(Term::INITIAL)
    }

    /// The history limited to entries that start at or below `up_to` (what an acceptor whose WAL
    /// ends at `up_to` actually holds).
    pub fn up_to(&self, up_to: Lsn) -> TermHistory {
        TermHistory(
            self.0
                .iter()
                .copied()
                .take_while(|e| e.lsn <= up_to)
                .collect(),
        )
    }

    /// The highest point where the proposer's history `prop` and an acceptor's history `sk`
    /// (whose WAL ends at `sk_end`) agree: everything below the returned LSN was written by the
    /// same terms on both. Returns `None` if they share no entry.
    ///
    /// Walks both histories while the terms match; equal terms must start at equal LSNs (one
    /// proposer per term), otherwise the histories are inconsistent and an error is returned.
    pub fn find_highest_common_point(
        prop: &TermHistory,
        sk: &TermHistory,
        sk_end: Lsn,
    ) -> Result<Option<TermLsn>, TermHistoryError> {
        if let Some(last) = sk.0.last()
            && last.lsn > sk_end
        {
            return Err(TermHistoryError(format!(
                "acceptor history's last entry starts at {} above its WAL end {}",
                last.lsn, sk_end
            )));
        }
        let mut last_common = None;
        for (i, (p, s)) in prop.0.iter().zip(sk.0.iter()).enumerate() {
            if p.term != s.term {
                break;
            }
            if p.lsn != s.lsn {
                return Err(TermHistoryError(format!(
                    "term {} starts at {} for the proposer but at {} for the acceptor",
                    p.term, p.lsn, s.lsn
                )));
            }
            last_common = Some(i);
        }
        let Some(i) = last_common else {
            return Ok(None);
        };
        let term = prop.0[i].term;
        if i + 1 == prop.0.len() {
            // The proposer's last term is common: the acceptor's WAL of that term is all good.
            return Ok(Some(TermLsn { term, lsn: sk_end }));
        }
        let prop_next = prop.0[i + 1].lsn;
        let sk_next = sk.0.get(i + 1).map(|e| e.lsn).unwrap_or(sk_end);
        Ok(Some(TermLsn {
            term,
            lsn: prop_next.min(sk_next),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(entries: &[(u64, u64)]) -> TermHistory {
        TermHistory::from_pairs(entries)
    }

    #[test]
    fn ids_round_trip_through_hex() {
        let s = "de200bd42b49cc1814412c7e592dd6e9";
        let id: TenantId = s.parse().unwrap();
        assert_eq!(id.to_string(), s);
        assert!(
            "de200bd42b49cc1814412c7e592dd6e"
                .parse::<TimelineId>()
                .is_err()
        );
        assert!(
            "zz200bd42b49cc1814412c7e592dd6e9"
                .parse::<TimelineId>()
                .is_err()
        );
    }

    #[test]
    fn history_validation_rejects_disorder() {
        assert!(h(&[(1, 10), (2, 10), (5, 20)]).validate().is_ok());
        assert!(h(&[(2, 10), (2, 20)]).validate().is_err());
        assert!(h(&[(1, 20), (2, 10)]).validate().is_err());
    }

    #[test]
    fn highest_common_point_none_when_first_terms_differ() {
        let prop = h(&[(2, 10)]);
        let sk = h(&[(1, 10)]);
        assert_eq!(
            TermHistory::find_highest_common_point(&prop, &sk, Lsn(50)),
            Ok(None)
        );
        assert_eq!(
            TermHistory::find_highest_common_point(&prop, &TermHistory::empty(), Lsn(0)),
            Ok(None)
        );
    }

    #[test]
    fn highest_common_point_in_the_middle() {
        // Proposer moved on from term 1 at 30; the acceptor kept writing term 1 past it and then
        // joined term 2 at 40: only WAL below 30 is common.
        let prop = h(&[(1, 10), (3, 30)]);
        let sk = h(&[(1, 10), (2, 40)]);
        assert_eq!(
            TermHistory::find_highest_common_point(&prop, &sk, Lsn(60)),
            Ok(Some(TermLsn {
                term: Term(1),
                lsn: Lsn(30)
            }))
        );
    }

    #[test]
    fn highest_common_point_at_acceptor_end() {
        // The acceptor stopped in term 1 before the proposer's term 3 began.
        let prop = h(&[(1, 10), (3, 30)]);
        let sk = h(&[(1, 10)]);
        assert_eq!(
            TermHistory::find_highest_common_point(&prop, &sk, Lsn(20)),
            Ok(Some(TermLsn {
                term: Term(1),
                lsn: Lsn(20)
            }))
        );
    }

    #[test]
    fn highest_common_point_is_acceptor_end_when_proposer_last_term_is_common() {
        let prop = h(&[(1, 10), (3, 30)]);
        let sk = h(&[(1, 10), (3, 30)]);
        assert_eq!(
            TermHistory::find_highest_common_point(&prop, &sk, Lsn(55)),
            Ok(Some(TermLsn {
                term: Term(3),
                lsn: Lsn(55)
            }))
        );
    }

    #[test]
    fn highest_common_point_rejects_inconsistent_histories() {
        let prop = h(&[(1, 10)]);
        let sk = h(&[(1, 12)]);
        assert!(TermHistory::find_highest_common_point(&prop, &sk, Lsn(20)).is_err());
        // The acceptor history claims a term that starts past its WAL end.
        let sk = h(&[(1, 10), (2, 30)]);
        assert!(TermHistory::find_highest_common_point(&prop, &sk, Lsn(20)).is_err());
    }

    #[test]
    fn up_to_drops_entries_beyond_the_end() {
        let hist = h(&[(1, 10), (2, 20), (3, 30)]);
        assert_eq!(hist.up_to(Lsn(25)), h(&[(1, 10), (2, 20)]));
        assert_eq!(hist.up_to(Lsn(30)).last_log_term(), Term(3));
        assert_eq!(TermHistory::empty().last_log_term(), Term(0));
    }
}
