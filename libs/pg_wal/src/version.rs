//! The PostgreSQL major versions whose WAL this crate reads and writes, and what differs
//! between them at the page and record level.
//!
//! Found from each version's real WAL (servers 14.23, 15.18, 16.14, 17.10 and 18.4: `initdb`, a
//! table load, `pg_switch_wal()`, every record decoded with its CRC checked) and the versions'
//! `access/xlog_internal.h` and `access/rmgrlist.h`:
//!
//! | major | `XLOG_PAGE_MAGIC` | built-in rmgrs | custom rmgrs (128..=255) |
//! | ----- | ----------------- | -------------- | ------------------------ |
//! | 14    | `0xD10D`          | 0..=21         | no (added in 15)         |
//! | 15    | `0xD110`          | 0..=21         | yes                      |
//! | 16    | `0xD113`          | 0..=21         | yes                      |
//! | 17    | `0xD116`          | 0..=21         | yes                      |
//! | 18    | `0xD118`          | 0..=21         | yes                      |
//!
//! Everything else this crate touches is the same in all five: the short and long page headers
//! and their flags, the 24-byte `XLogRecord` header and its CRC-32C, `XLOG_SWITCH` (info `0x40`
//! of rmgr 0) and its zero padding to the segment end, the block-id bytes of main data, segment
//! sizes and file names. The magic is what changes with every major release (the WAL of one
//! major version cannot be replayed by another), so it is checked on every page.

use std::fmt;

/// A PostgreSQL major version whose WAL is supported. The default, 15, is what generated WAL
/// and options without a timeline behind them use; a timeline's comes from its control file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PgMajor {
    /// PostgreSQL 14.
    V14,
    /// PostgreSQL 15.
    #[default]
    V15,
    /// PostgreSQL 16.
    V16,
    /// PostgreSQL 17.
    V17,
    /// PostgreSQL 18.
    V18,
}

/// A server version outside the supported range (the greeting's or `server_version_num`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error(
    "PostgreSQL version {0} is not supported: supported are major versions 14 to 18 \
     (server_version_num 140000..=189999)"
)]
pub struct UnsupportedVersion(pub u32);

impl PgMajor {
    /// Every supported version, oldest first.
    pub const ALL: [PgMajor; 5] = [
        PgMajor::V14,
        PgMajor::V15,
        PgMajor::V16,
        PgMajor::V17,
        PgMajor::V18,
    ];

    /// The major version of a `server_version_num` (e.g. 170010 → 17).
    pub fn from_server_version(num: u32) -> Result<PgMajor, UnsupportedVersion> {
        PgMajor::from_number(num / 10000).ok_or(UnsupportedVersion(num))
    }

    /// The version of a major number (14..=18).
    pub fn from_number(major: u32) -> Option<PgMajor> {
        PgMajor::ALL.into_iter().find(|m| m.number() == major)
    }

    /// The major number: 14..=18.
    pub fn number(self) -> u32 {
        match self {
            PgMajor::V14 => 14,
            PgMajor::V15 => 15,
            PgMajor::V16 => 16,
            PgMajor::V17 => 17,
            PgMajor::V18 => 18,
        }
    }

    /// `XLOG_PAGE_MAGIC`: the first two bytes of every WAL page this version writes.
    pub fn page_magic(self) -> u16 {
        match self {
            PgMajor::V14 => 0xD10D,
            PgMajor::V15 => 0xD110,
            PgMajor::V16 => 0xD113,
            PgMajor::V17 => 0xD116,
            PgMajor::V18 => 0xD118,
        }
    }

    /// The version whose pages carry `magic`, if any.
    pub fn from_page_magic(magic: u16) -> Option<PgMajor> {
        PgMajor::ALL.into_iter().find(|m| m.page_magic() == magic)
    }

    /// `RM_MAX_BUILTIN_ID`: the last built-in resource manager (`RM_LOGICALMSG_ID` in 14..=18).
    pub fn max_builtin_rmid(self) -> u8 {
        21
    }

    /// Whether this version has custom resource managers (ids 128..=255, since 15).
    pub fn has_custom_rmgrs(self) -> bool {
        self >= PgMajor::V15
    }

    /// Whether a record of this version can carry resource manager `rmid` (`RmgrIdIsValid`).
    pub fn is_valid_rmid(self, rmid: u8) -> bool {
        rmid <= self.max_builtin_rmid()
            || (self.has_custom_rmgrs() && rmid >= crate::format::RM_MIN_CUSTOM_ID)
    }
}

impl fmt::Display for PgMajor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PostgreSQL {}", self.number())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_versions_map_to_their_major_and_others_are_refused() {
        assert_eq!(PgMajor::from_server_version(140023), Ok(PgMajor::V14));
        assert_eq!(PgMajor::from_server_version(150018), Ok(PgMajor::V15));
        assert_eq!(PgMajor::from_server_version(160000), Ok(PgMajor::V16));
        assert_eq!(PgMajor::from_server_version(170010), Ok(PgMajor::V17));
        assert_eq!(PgMajor::from_server_version(189999), Ok(PgMajor::V18));
        for bad in [0, 1, 130020, 139999, 190000, 90624, u32::MAX] {
            let e = PgMajor::from_server_version(bad).unwrap_err();
            assert!(e.to_string().contains("14 to 18"), "{e}");
        }
    }

    #[test]
    fn each_major_has_its_own_magic() {
        let mut magics: Vec<u16> = PgMajor::ALL.iter().map(|m| m.page_magic()).collect();
        magics.dedup();
        assert_eq!(magics.len(), PgMajor::ALL.len());
        for m in PgMajor::ALL {
            assert_eq!(PgMajor::from_page_magic(m.page_magic()), Some(m));
        }
        assert_eq!(PgMajor::from_page_magic(0xD10E), None);
    }

    #[test]
    fn custom_resource_managers_exist_from_15_on() {
        assert!(PgMajor::V14.is_valid_rmid(21));
        assert!(!PgMajor::V14.is_valid_rmid(22));
        assert!(!PgMajor::V14.is_valid_rmid(128));
        for m in [PgMajor::V15, PgMajor::V16, PgMajor::V17, PgMajor::V18] {
            assert!(m.is_valid_rmid(21) && m.is_valid_rmid(128) && m.is_valid_rmid(255));
            assert!(!m.is_valid_rmid(22) && !m.is_valid_rmid(127));
        }
    }
}
