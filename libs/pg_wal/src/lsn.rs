//! [`Lsn`]: a byte position in the WAL stream, shown and parsed as PostgreSQL's `X/X`, with the
//! segment and page arithmetic every WAL user needs.
//!
//! Not here: the layouts found at those positions ([`crate::format`]).

use std::fmt;
use std::str::FromStr;

/// Size of a PostgreSQL WAL page (`XLOG_BLCKSZ`).
pub const XLOG_BLCKSZ: u64 = 8192;

/// A log sequence number: a byte position in the WAL stream. Shown as `X/X` like PostgreSQL.
#[derive(Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Lsn(pub u64);

impl Lsn {
    /// 0: no position (PostgreSQL's `InvalidXLogRecPtr`).
    pub const INVALID: Lsn = Lsn(0);
    /// The largest position.
    pub const MAX: Lsn = Lsn(u64::MAX);

    /// Whether this is a position (not [`Lsn::INVALID`]).
    pub fn is_valid(self) -> bool {
        self != Lsn::INVALID
    }

    /// Segment number of the segment that holds this LSN.
    pub fn segment_number(self, seg_size: u64) -> u64 {
        self.0 / seg_size
    }

    /// Offset of this LSN inside its segment.
    pub fn segment_offset(self, seg_size: u64) -> u64 {
        self.0 % seg_size
    }

    /// The start of the segment that holds this LSN.
    pub fn segment_start(self, seg_size: u64) -> Lsn {
        Lsn(self.0 - self.0 % seg_size)
    }

    /// Offset of this LSN inside its 8 KiB WAL page.
    pub fn page_offset(self) -> u64 {
        self.0 % XLOG_BLCKSZ
    }

    /// The start of the page that holds this LSN.
    pub fn page_start(self) -> Lsn {
        Lsn(self.0 - self.0 % XLOG_BLCKSZ)
    }

    /// Round up to the next multiple of 8 (PostgreSQL's `MAXALIGN`), or `None` on overflow.
    pub fn align8(self) -> Option<Lsn> {
        self.0.checked_add(7).map(|v| Lsn(v & !7))
    }

    /// `n` bytes further, or `None` on overflow.
    pub fn checked_add(self, n: u64) -> Option<Lsn> {
        self.0.checked_add(n).map(Lsn)
    }

    /// Bytes from `other` to `self`, or `None` if `other` is ahead.
    pub fn checked_sub(self, other: Lsn) -> Option<u64> {
        self.0.checked_sub(other.0)
    }
}

impl fmt::Display for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:X}/{:X}", self.0 >> 32, self.0 & 0xffff_ffff)
    }
}

impl fmt::Debug for Lsn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl From<u64> for Lsn {
    fn from(v: u64) -> Self {
        Lsn(v)
    }
}

/// Error parsing an LSN from `X/X` text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid LSN {0:?}: expected two hexadecimal numbers separated by '/', e.g. 0/16B3748")]
pub struct LsnParseError(String);

impl FromStr for Lsn {
    type Err = LsnParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = || LsnParseError(s.to_string());
        let (hi, lo) = s.split_once('/').ok_or_else(err)?;
        if hi.is_empty() || lo.is_empty() || hi.len() > 8 || lo.len() > 8 {
            return Err(err());
        }
        let hi = u32::from_str_radix(hi, 16).map_err(|_| err())?;
        let lo = u32::from_str_radix(lo, 16).map_err(|_| err())?;
        Ok(Lsn(((hi as u64) << 32) | lo as u64))
    }
}

impl serde::Serialize for Lsn {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lsn_displays_and_parses_like_postgres() {
        let lsn = Lsn(0x116B_3748);
        assert_eq!(lsn.to_string(), "0/116B3748");
        assert_eq!("0/116B3748".parse::<Lsn>(), Ok(lsn));
        assert_eq!(Lsn(0xAB_0000_0010).to_string(), "AB/10");
        assert_eq!("ab/10".parse::<Lsn>(), Ok(Lsn(0xAB_0000_0010)));
        for bad in [
            "",
            "/",
            "0/",
            "/0",
            "0",
            "0/0/0",
            "x/0",
            "123456789/0",
            "0/-1",
        ] {
            assert!(bad.parse::<Lsn>().is_err(), "{bad:?} must not parse");
        }
    }

    #[test]
    fn lsn_segment_and_page_helpers() {
        let seg = 16 << 20;
        let lsn = Lsn(3 * seg + 8192 * 2 + 100);
        assert_eq!(lsn.segment_number(seg), 3);
        assert_eq!(lsn.segment_offset(seg), 8192 * 2 + 100);
        assert_eq!(lsn.segment_start(seg), Lsn(3 * seg));
        assert_eq!(lsn.page_offset(), 100);
        assert_eq!(lsn.page_start(), Lsn(3 * seg + 8192 * 2));
        assert_eq!(Lsn(9).align8(), Some(Lsn(16)));
        assert_eq!(Lsn(16).align8(), Some(Lsn(16)));
        assert_eq!(Lsn(u64::MAX).align8(), None);
        assert_eq!(Lsn(5).checked_sub(Lsn(6)), None);
    }
}
