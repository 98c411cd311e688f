//! PostgreSQL WAL on-disk layout (the same in 14 to 18 but for the page magic, see
//! [`crate::version`]): page headers, the `XLogRecord` header, the record CRC-32C,
//! segment sizes and segment file names. All integers are little-endian, as PostgreSQL writes them
//! on the platforms it supports here.
//!
//! Pure encoding and decoding of fixed-size structures, and [`first_segment_image`]: the page
//! headers of a segment before a (possibly mid-segment) start of WAL, which a new timeline's
//! first segment is written with. Walking a byte stream is the job of [`crate::decoder`];
//! producing records is [`crate::generator`]'s.
//!
//! Layouts (PostgreSQL 14 to 18, `access/xlog_internal.h`, `access/xlogrecord.h`):
//! - `XLogPageHeaderData` (24 bytes): `u16 xlp_magic`, `u16 xlp_info`, `u32 xlp_tli`,
//!   `u64 xlp_pageaddr`, `u32 xlp_rem_len`, 4 bytes of padding.
//! - `XLogLongPageHeaderData` (40 bytes, first page of a segment): the short header, then
//!   `u64 xlp_sysid`, `u32 xlp_seg_size`, `u32 xlp_xlog_blcksz`.
//! - `XLogRecord` (24 bytes): `u32 xl_tot_len`, `u32 xl_xid`, `u64 xl_prev`, `u8 xl_info`,
//!   `u8 xl_rmid`, 2 bytes of padding, `u32 xl_crc`.

use crate::lsn::{Lsn, XLOG_BLCKSZ};
use crate::version::PgMajor;
/// [`XLOG_BLCKSZ`] as a `usize`.
pub const XLOG_BLCKSZ_USIZE: usize = XLOG_BLCKSZ as usize;

/// The page starts with the continuation of a record begun on an earlier page.
pub const XLP_FIRST_IS_CONTRECORD: u16 = 0x0001;
/// The page header is the long form (first page of a segment).
pub const XLP_LONG_HEADER: u16 = 0x0002;
/// Backup blocks on this page may be removed (set on the pages `initdb` writes).
pub const XLP_BKP_REMOVABLE: u16 = 0x0004;
/// The record continued from an earlier page was abandoned: a primary that crashed half-way
/// through writing a record starts the page where its continuation would have been with this
/// flag (and an `XLOG_OVERWRITE_CONTRECORD` record) instead of the rest of the record.
pub const XLP_FIRST_IS_OVERWRITE_CONTRECORD: u16 = 0x0008;
/// All flags PostgreSQL 14 to 18 know; others make a page header invalid.
pub const XLP_ALL_FLAGS: u16 = 0x000F;

/// `SizeOfXLogShortPHD`.
pub const SIZE_OF_XLOG_SHORT_PHD: usize = 24;
/// `SizeOfXLogLongPHD`.
pub const SIZE_OF_XLOG_LONG_PHD: usize = 40;
/// `SizeOfXLogRecord`.
pub const SIZE_OF_XLOG_RECORD: usize = 24;
/// Offset of `xl_crc` inside `XLogRecord`; the CRC covers the header bytes before it.
pub const XLOG_RECORD_CRC_OFFS: usize = 20;

/// The PostgreSQL timeline id neon (and we) always use.
pub const PG_TLI: u32 = 1;

/// Block id announcing main data of at most 255 bytes (`u8` length follows).
pub const XLR_BLOCK_ID_DATA_SHORT: u8 = 255;
/// Block id announcing main data longer than 255 bytes (`u32` length follows, unaligned).
pub const XLR_BLOCK_ID_DATA_LONG: u8 = 254;

/// Resource manager of XLOG records (`RM_XLOG_ID`).
pub const RM_XLOG_ID: u8 = 0;
/// `XLOG_SWITCH` (info of an `RM_XLOG_ID` record): the rest of the segment is unused.
pub const XLOG_SWITCH: u8 = 0x40;
/// The bits of `xl_info` that belong to the resource manager.
pub const XLR_RMGR_INFO_MASK: u8 = 0xF0;
/// Resource manager of logical messages (`RM_LOGICALMSG_ID`), the last built-in one in 14..=18.
pub const RM_LOGICALMSG_ID: u8 = 21;
/// `RM_MIN_CUSTOM_ID`: ids 128..=255 are custom resource managers (since PostgreSQL 15).
pub const RM_MIN_CUSTOM_ID: u8 = 128;
/// `XLOG_LOGICAL_MESSAGE` (info of an `RM_LOGICALMSG_ID` record).
pub const XLOG_LOGICAL_MESSAGE: u8 = 0x00;
/// `SizeOfLogicalMessage`: `Oid dbId`, `bool transactional`, 3 bytes pad, `Size prefix_size`,
/// `Size message_size` (`message/logical.h`, 64-bit `Size`).
pub const SIZE_OF_LOGICAL_MESSAGE: usize = 24;

/// Largest `xl_tot_len` accepted: PostgreSQL cannot allocate a larger record buffer
/// (`MaxAllocSize - 1`).
pub const MAX_RECORD_LEN: u32 = 0x3fff_ffff;

/// Default WAL segment size (16 MiB).
pub const DEFAULT_WAL_SEG_SIZE: u64 = 16 << 20;
/// Smallest WAL segment size PostgreSQL accepts (1 MiB).
pub const MIN_WAL_SEG_SIZE: u64 = 1 << 20;
/// Largest WAL segment size PostgreSQL accepts (1 GiB).
pub const MAX_WAL_SEG_SIZE: u64 = 1 << 30;

/// Whether `seg_size` is a power of two in 1 MiB..=1 GiB (`IsValidWalSegSize`).
pub fn is_valid_seg_size(seg_size: u64) -> bool {
    seg_size.is_power_of_two() && (MIN_WAL_SEG_SIZE..=MAX_WAL_SEG_SIZE).contains(&seg_size)
}

/// Size of the page header of the page starting at `page_start` (long at a segment start).
pub fn page_header_size(page_start: Lsn, seg_size: u64) -> usize {
    if page_start.0.is_multiple_of(seg_size) {
        SIZE_OF_XLOG_LONG_PHD
    } else {
        SIZE_OF_XLOG_SHORT_PHD
    }
}

/// PostgreSQL's `XLogFileName`: `%08X%08X%08X` of the timeline, the "xlog id" and the segment
/// within it.
pub fn xlog_file_name(tli: u32, segno: u64, seg_size: u64) -> String {
    let per_id = 0x1_0000_0000 / seg_size;
    format!("{tli:08X}{:08X}{:08X}", segno / per_id, segno % per_id)
}

/// Parses a segment file name of timeline [`PG_TLI`] (`<24 hex>` or `<24 hex>.partial`) into
/// `(segno, is_partial)`. Anything else is `None`.
pub fn parse_xlog_file_name(name: &str, seg_size: u64) -> Option<(u64, bool)> {
    let (base, partial) = match name.strip_suffix(".partial") {
        Some(base) => (base, true),
        None => (name, false),
    };
    if base.len() != 24 || !base.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    let tli = u32::from_str_radix(base.get(0..8)?, 16).ok()?;
    let log = u64::from_str_radix(base.get(8..16)?, 16).ok()?;
    let seg = u64::from_str_radix(base.get(16..24)?, 16).ok()?;
    let per_id = 0x1_0000_0000 / seg_size;
    if tli != PG_TLI || seg >= per_id {
        return None;
    }
    Some((log.checked_mul(per_id)?.checked_add(seg)?, partial))
}

/// The CRC-32C of a record exactly as PostgreSQL computes it: over the record body (everything
/// after the 24-byte header) first, then over the header bytes before `xl_crc`.
pub fn record_crc(header: &[u8; SIZE_OF_XLOG_RECORD], body: &[u8]) -> u32 {
    crc32c::crc32c_append(crc32c::crc32c(body), &header[..XLOG_RECORD_CRC_OFFS])
}

fn u16_at(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(at..at + 2)?.try_into().ok()?))
}

fn u32_at(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// `XLogPageHeaderData`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PageHeader {
    /// The version's [`PgMajor::page_magic`] on a valid page.
    pub magic: u16,
    /// `XLP_*` flags.
    pub info: u16,
    /// PostgreSQL timeline id ([`PG_TLI`]).
    pub tli: u32,
    /// LSN of the first byte of the page.
    pub pageaddr: Lsn,
    /// Bytes of the continued record still to come, if [`XLP_FIRST_IS_CONTRECORD`] is set.
    pub rem_len: u32,
}

impl PageHeader {
    /// Encodes into the first 24 bytes of `out` (padding zeroed).
    pub fn encode(&self) -> [u8; SIZE_OF_XLOG_SHORT_PHD] {
        let mut out = [0u8; SIZE_OF_XLOG_SHORT_PHD];
        out[0..2].copy_from_slice(&self.magic.to_le_bytes());
        out[2..4].copy_from_slice(&self.info.to_le_bytes());
        out[4..8].copy_from_slice(&self.tli.to_le_bytes());
        out[8..16].copy_from_slice(&self.pageaddr.0.to_le_bytes());
        out[16..20].copy_from_slice(&self.rem_len.to_le_bytes());
        out
    }

    /// Decodes the first 24 bytes of `b`; `None` if `b` is shorter.
    pub fn decode(b: &[u8]) -> Option<PageHeader> {
        Some(PageHeader {
            magic: u16_at(b, 0)?,
            info: u16_at(b, 2)?,
            tli: u32_at(b, 4)?,
            pageaddr: Lsn(u64_at(b, 8)?),
            rem_len: u32_at(b, 16)?,
        })
    }
}

/// `XLogLongPageHeaderData`: the header of the first page of each segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LongPageHeader {
    /// The short header every page has (with [`XLP_LONG_HEADER`] set).
    pub std: PageHeader,
    /// PostgreSQL system identifier (0 when unknown).
    pub sysid: u64,
    /// WAL segment size in bytes.
    pub seg_size: u32,
    /// WAL page size ([`XLOG_BLCKSZ`]).
    pub xlog_blcksz: u32,
}

impl LongPageHeader {
    /// The 40-byte little-endian encoding.
    pub fn encode(&self) -> [u8; SIZE_OF_XLOG_LONG_PHD] {
        let mut out = [0u8; SIZE_OF_XLOG_LONG_PHD];
        out[..SIZE_OF_XLOG_SHORT_PHD].copy_from_slice(&self.std.encode());
        out[24..32].copy_from_slice(&self.sysid.to_le_bytes());
        out[32..36].copy_from_slice(&self.seg_size.to_le_bytes());
        out[36..40].copy_from_slice(&self.xlog_blcksz.to_le_bytes());
        out
    }

    /// Decodes the first 40 bytes of `b`; `None` if `b` is shorter.
    pub fn decode(b: &[u8]) -> Option<LongPageHeader> {
        Some(LongPageHeader {
            std: PageHeader::decode(b)?,
            sysid: u64_at(b, 24)?,
            seg_size: u32_at(b, 32)?,
            xlog_blcksz: u32_at(b, 36)?,
        })
    }
}

/// `XLogRecord`: the fixed header of every WAL record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct XLogRecordHeader {
    /// Total record length including this header.
    pub tot_len: u32,
    /// Transaction id (0 outside a transaction).
    pub xid: u32,
    /// Start LSN of the previous record.
    pub prev: Lsn,
    /// Flags; the high 4 bits belong to the resource manager ([`XLR_RMGR_INFO_MASK`]).
    pub info: u8,
    /// Resource manager id.
    pub rmid: u8,
    /// CRC-32C of the body, then of the header bytes before this field ([`record_crc`]).
    pub crc: u32,
}

impl XLogRecordHeader {
    /// The 24-byte little-endian encoding (padding zeroed).
    pub fn encode(&self) -> [u8; SIZE_OF_XLOG_RECORD] {
        let mut out = [0u8; SIZE_OF_XLOG_RECORD];
        out[0..4].copy_from_slice(&self.tot_len.to_le_bytes());
        out[4..8].copy_from_slice(&self.xid.to_le_bytes());
        out[8..16].copy_from_slice(&self.prev.0.to_le_bytes());
        out[16] = self.info;
        out[17] = self.rmid;
        out[20..24].copy_from_slice(&self.crc.to_le_bytes());
        out
    }

    /// Decodes a 24-byte header (total: every bit pattern is a header; validity is the
    /// decoder's business).
    pub fn decode(b: &[u8; SIZE_OF_XLOG_RECORD]) -> XLogRecordHeader {
        let u32_at = |at: usize| u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]]);
        let mut prev = [0u8; 8];
        prev.copy_from_slice(&b[8..16]);
        XLogRecordHeader {
            tot_len: u32_at(0),
            xid: u32_at(4),
            prev: Lsn(u64::from_le_bytes(prev)),
            info: b[16],
            rmid: b[17],
            crc: u32_at(20),
        }
    }
}

/// Why WAL (generated, decoded or a first-segment image) cannot start where asked.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WalStartError {
    /// The segment size is not one PostgreSQL accepts ([`is_valid_seg_size`]).
    #[error("invalid WAL segment size {0}: must be a power of two in 1 MiB..=1 GiB")]
    SegSize(u64),
    /// The position cannot be a record boundary ([`check_record_boundary`]).
    #[error("start {0} is not a record boundary: not 8-byte aligned or inside a page header")]
    Start(Lsn),
}

/// Checks that `lsn` can be a record boundary (and so a place to start writing or decoding).
pub fn check_record_boundary(lsn: Lsn, seg_size: u64) -> Result<(), WalStartError> {
    let page_off = lsn.page_offset() as usize;
    let hdr = page_header_size(lsn.page_start(), seg_size);
    if !lsn.0.is_multiple_of(8) || (page_off != 0 && page_off < hdr) {
        return Err(WalStartError::Start(lsn));
    }
    Ok(())
}

/// The bytes `[segment start, init_lsn)` of the segment holding `init_lsn`, for WAL that begins
/// at `init_lsn` (which may be mid-segment and mid-page): a long page header at the segment start
/// and, on the page holding `init_lsn`, a header claiming a continuation record that ends exactly
/// at `init_lsn` (`XLP_FIRST_IS_CONTRECORD`, `xlp_rem_len`), so `pg_waldump` and PostgreSQL's
/// `XLogFindNextRecord` find the first record at `init_lsn`. Everything else is zero.
pub fn first_segment_image(
    major: PgMajor,
    sysid: u64,
    seg_size: u64,
    init_lsn: Lsn,
) -> Result<Vec<u8>, WalStartError> {
    if !is_valid_seg_size(seg_size) {
        return Err(WalStartError::SegSize(seg_size));
    }
    check_record_boundary(init_lsn, seg_size)?;
    let seg_off = init_lsn.segment_offset(seg_size) as usize;
    let mut image = vec![0u8; seg_off];
    if seg_off == 0 {
        return Ok(image);
    }
    let seg_start = init_lsn.segment_start(seg_size);
    let page_off = init_lsn.page_offset() as usize;
    let first_page = seg_off < XLOG_BLCKSZ_USIZE;
    // Continuation data on init_lsn's page, if init_lsn is past that page's header.
    let cont = |hdr: usize| -> (u16, u32) {
        if page_off > hdr {
            (XLP_FIRST_IS_CONTRECORD, (page_off - hdr) as u32)
        } else {
            (0, 0)
        }
    };
    let (info, rem_len) = if first_page {
        cont(SIZE_OF_XLOG_LONG_PHD)
    } else {
        (0, 0)
    };
    let long = LongPageHeader {
        std: PageHeader {
            magic: major.page_magic(),
            info: XLP_LONG_HEADER | info,
            tli: PG_TLI,
            pageaddr: seg_start,
            rem_len,
        },
        sysid,
        seg_size: seg_size as u32,
        xlog_blcksz: XLOG_BLCKSZ as u32,
    };
    image[..SIZE_OF_XLOG_LONG_PHD].copy_from_slice(&long.encode());
    if !first_page && page_off != 0 {
        let (info, rem_len) = cont(SIZE_OF_XLOG_SHORT_PHD);
        let short = PageHeader {
            magic: major.page_magic(),
            info,
            tli: PG_TLI,
            pageaddr: init_lsn.page_start(),
            rem_len,
        };
        let at = seg_off - page_off;
        image[at..at + SIZE_OF_XLOG_SHORT_PHD].copy_from_slice(&short.encode());
    }
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn page_headers_round_trip() {
        let short = PageHeader {
            magic: PgMajor::V15.page_magic(),
            info: XLP_FIRST_IS_CONTRECORD,
            tli: PG_TLI,
            pageaddr: Lsn(0x1_2345_6000),
            rem_len: 777,
        };
        assert_eq!(PageHeader::decode(&short.encode()), Some(short));
        let long = LongPageHeader {
            std: PageHeader {
                info: XLP_LONG_HEADER,
                ..short
            },
            sysid: 0x7123_4567_89ab_cdef,
            seg_size: 16 << 20,
            xlog_blcksz: 8192,
        };
        let bytes = long.encode();
        assert_eq!(LongPageHeader::decode(&bytes), Some(long));
        assert_eq!(&bytes[0..2], &[0x10, 0xD1], "magic is little-endian");
        assert_eq!(PageHeader::decode(&bytes[..19]), None);
        assert_eq!(LongPageHeader::decode(&bytes[..35]), None);
    }

    #[test]
    fn record_header_round_trips() {
        let h = XLogRecordHeader {
            tot_len: 1234,
            xid: 99,
            prev: Lsn(0x1_0000_0028),
            info: 0x10,
            rmid: RM_LOGICALMSG_ID,
            crc: 0xdead_beef,
        };
        assert_eq!(XLogRecordHeader::decode(&h.encode()), h);
    }

    #[test]
    fn crc_covers_body_then_header_prefix() {
        let mut header = [0u8; SIZE_OF_XLOG_RECORD];
        header[0] = 30;
        header[20..24].copy_from_slice(&[0xff; 4]);
        let body = [1u8, 2, 3, 4, 5, 6];
        let mut whole = body.to_vec();
        whole.extend_from_slice(&header[..20]);
        assert_eq!(record_crc(&header, &body), crc32c::crc32c(&whole));
    }

    #[test]
    fn file_names_match_postgres() {
        let seg = 16 << 20;
        assert_eq!(xlog_file_name(1, 1, seg), "000000010000000000000001");
        // 256 segments of 16 MiB per 4 GiB "xlog id".
        assert_eq!(xlog_file_name(1, 0x1FF, seg), "0000000100000001000000FF");
        assert_eq!(
            xlog_file_name(1, 0x1FF, 1 << 20),
            "0000000100000000000001FF"
        );
        assert_eq!(
            parse_xlog_file_name("0000000100000001000000FF.partial", seg),
            Some((0x1FF, true))
        );
        assert_eq!(
            parse_xlog_file_name("0000000100000001000000FF", seg),
            Some((0x1FF, false))
        );
        assert_eq!(parse_xlog_file_name("000000010000000100000100", seg), None);
        assert_eq!(parse_xlog_file_name("000000020000000000000001", seg), None);
        assert_eq!(parse_xlog_file_name("waltmp", seg), None);
    }

    #[test]
    fn seg_sizes_are_powers_of_two_between_1mib_and_1gib() {
        assert!(is_valid_seg_size(1 << 20));
        assert!(is_valid_seg_size(16 << 20));
        assert!(is_valid_seg_size(1 << 30));
        assert!(!is_valid_seg_size(1 << 19));
        assert!(!is_valid_seg_size(2 << 30));
        assert!(!is_valid_seg_size(3 << 20));
    }

    #[test]
    fn first_segment_image_claims_continuation_up_to_init_lsn() {
        const SEG: u64 = 1 << 20;
        let init = Lsn(3 * SEG + 5 * 8192 + 1000);
        let img = first_segment_image(PgMajor::V15, 9, SEG, init).unwrap();
        assert_eq!(img.len() as u64, init.segment_offset(SEG));
        let long = LongPageHeader::decode(&img).unwrap();
        assert_eq!(long.std.pageaddr, Lsn(3 * SEG));
        assert_eq!(long.std.info, XLP_LONG_HEADER);
        let short = PageHeader::decode(&img[5 * 8192..]).unwrap();
        assert_eq!(short.info, XLP_FIRST_IS_CONTRECORD);
        assert_eq!(short.rem_len, 1000 - 24);
        let first = first_segment_image(PgMajor::V15, 9, SEG, Lsn(SEG + 48)).unwrap();
        let long = LongPageHeader::decode(&first).unwrap();
        assert_eq!(long.std.info, XLP_LONG_HEADER | XLP_FIRST_IS_CONTRECORD);
        assert_eq!(long.std.rem_len, 8);
        assert!(
            first_segment_image(PgMajor::V15, 9, SEG, Lsn(SEG))
                .unwrap()
                .is_empty()
        );
    }
}
