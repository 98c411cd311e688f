//! A generator of valid PostgreSQL 15 WAL made of logical-message records
//! (`pg_logical_emit_message(false, prefix, message)`), for tests and benchmarks.
//!
//! The stream has correct page headers (long at each segment start, continuation flags and
//! `xlp_rem_len` on pages a record spills onto), an `xl_prev` chain, 8-byte record alignment and
//! PostgreSQL's CRC-32C, so `pg_waldump` accepts it. It can start at any record boundary;
//! [`crate::format::first_segment_image`] supplies the bytes of the segment before a mid-segment
//! start.
//!
//! Record layout (`access/xlogrecord.h`, `replication/message.h`): `XLogRecord` (24 bytes), then
//! the main-data block header (`XLR_BLOCK_ID_DATA_SHORT` + `u8` length, or
//! `XLR_BLOCK_ID_DATA_LONG` + unaligned `u32` length when longer than 255 bytes), then the main
//! data: `xl_logical_message { u32 dbId; bool transactional; 3 pad; u64 prefix_size;
//! u64 message_size }`, the prefix with its NUL, and the message.
//!
//! Not here: reading WAL back ([`crate::decoder`]) and writing it to disk (the safekeeper's WAL
//! store).

use crate::format::{
    LongPageHeader, MAX_RECORD_LEN, PG_TLI, PageHeader, RM_LOGICALMSG_ID, RM_XLOG_ID,
    SIZE_OF_LOGICAL_MESSAGE, SIZE_OF_XLOG_LONG_PHD, SIZE_OF_XLOG_RECORD, SIZE_OF_XLOG_SHORT_PHD,
    WalStartError, XLOG_LOGICAL_MESSAGE, XLOG_RECORD_CRC_OFFS, XLOG_SWITCH,
    XLP_FIRST_IS_CONTRECORD, XLP_LONG_HEADER, XLR_BLOCK_ID_DATA_LONG, XLR_BLOCK_ID_DATA_SHORT,
    XLogRecordHeader, check_record_boundary, is_valid_seg_size,
};
use crate::lsn::{Lsn, XLOG_BLCKSZ};
use crate::version::PgMajor;

/// Where one generated record landed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordPos {
    /// Where the bytes produced for this record begin: the previous record's end. May precede
    /// `start` by a page header.
    pub chunk_start: Lsn,
    /// LSN of the record's `XLogRecord` header (what `pg_waldump` prints as `lsn:`).
    pub start: Lsn,
    /// End of the record's last byte, before alignment padding.
    pub data_end: Lsn,
    /// End of the record, 8-byte aligned (PostgreSQL's insert position after it).
    pub end: Lsn,
    /// `xl_tot_len`.
    pub tot_len: u32,
}

/// `xl_tot_len` of a logical message with a `prefix_len`-byte prefix (NUL excluded) and a
/// `message_len`-byte message.
pub fn logical_message_tot_len(prefix_len: usize, message_len: usize) -> usize {
    let main = SIZE_OF_LOGICAL_MESSAGE + prefix_len + 1 + message_len;
    let block_hdr = if main <= 255 { 2 } else { 5 };
    SIZE_OF_XLOG_RECORD + block_hdr + main
}

/// Generates a WAL stream of logical messages.
///
/// Invariant: `lsn` is a record boundary (8-byte aligned, never inside a page header); every
/// byte before `lsn` has been emitted.
#[derive(Clone, Debug)]
pub struct WalGenerator {
    /// The version whose page magic the pages carry (logical messages are the same in all).
    major: PgMajor,
    seg_size: u64,
    sysid: u64,
    /// Position of the next byte to emit.
    lsn: Lsn,
    /// Start of the last record (the next record's `xl_prev`).
    prev: Lsn,
    /// `xl_xid` of the next records (0, as PostgreSQL writes non-transactional messages).
    xid: u32,
    /// Prefix of every message, without its NUL. Invariant: contains no NUL.
    prefix: Vec<u8>,
    /// Reused buffer for the block header, `xl_logical_message` and prefix.
    scratch: Vec<u8>,
}

impl WalGenerator {
    /// A generator whose first record starts at `start` (a record boundary; if `start` is at a
    /// page boundary the page header is generated too) with `xl_prev` = 0, as PostgreSQL 15
    /// writes it ([`WalGenerator::with_major`] for another version).
    pub fn new(sysid: u64, seg_size: u64, start: Lsn) -> Result<WalGenerator, WalStartError> {
        if !is_valid_seg_size(seg_size) {
            return Err(WalStartError::SegSize(seg_size));
        }
        check_record_boundary(start, seg_size)?;
        Ok(WalGenerator {
            major: PgMajor::V15,
            seg_size,
            sysid,
            lsn: start,
            prev: Lsn(0),
            xid: 0,
            prefix: b"mini-safekeeper".to_vec(),
            scratch: Vec::with_capacity(64),
        })
    }

    /// Writes pages as `major` does.
    pub fn with_major(mut self, major: PgMajor) -> WalGenerator {
        self.major = major;
        self
    }

    /// Sets the `xl_prev` of the next record (the start of the record before `start`).
    pub fn with_prev(mut self, prev: Lsn) -> WalGenerator {
        self.prev = prev;
        self
    }

    /// Sets the `xl_xid` of the next records (tests stamp records with it; `pg_waldump` prints
    /// it as `tx:`).
    pub fn set_xid(&mut self, xid: u32) {
        self.xid = xid;
    }

    /// Sets the message prefix. NUL bytes are dropped (PostgreSQL's prefix is a C string).
    pub fn with_prefix(mut self, prefix: &[u8]) -> WalGenerator {
        self.prefix = prefix.iter().copied().filter(|&b| b != 0).collect();
        self
    }

    /// Where the next byte will go (the end of the last record).
    pub fn lsn(&self) -> Lsn {
        self.lsn
    }

    /// Start of the last generated record.
    pub fn prev(&self) -> Lsn {
        self.prev
    }

    /// WAL segment size of the stream.
    pub fn seg_size(&self) -> u64 {
        self.seg_size
    }

    /// Appends to `out` the bytes `[self.lsn(), end)` of one more record carrying `message`.
    ///
    /// Panics if the record would exceed PostgreSQL's maximum record size (1 GiB - 1): a caller
    /// bug, not a data condition.
    pub fn append_logical_message(&mut self, out: &mut Vec<u8>, message: &[u8]) -> RecordPos {
        let tot_len = logical_message_tot_len(self.prefix.len(), message.len());
        assert!(
            tot_len <= MAX_RECORD_LEN as usize,
            "logical message of {} bytes exceeds PostgreSQL's record size limit",
            message.len()
        );
        let tot_len = tot_len as u32;
        let main_len = SIZE_OF_LOGICAL_MESSAGE + self.prefix.len() + 1 + message.len();

        self.scratch.clear();
        if main_len <= 255 {
            self.scratch.push(XLR_BLOCK_ID_DATA_SHORT);
            self.scratch.push(main_len as u8);
        } else {
            self.scratch.push(XLR_BLOCK_ID_DATA_LONG);
            self.scratch
                .extend_from_slice(&(main_len as u32).to_le_bytes());
        }
        // xl_logical_message: dbId 0 (as a non-transactional message outside a database has),
        // transactional = false, padding, prefix_size (with NUL), message_size.
        self.scratch.extend_from_slice(&0u32.to_le_bytes());
        self.scratch.extend_from_slice(&[0, 0, 0, 0]);
        self.scratch
            .extend_from_slice(&(self.prefix.len() as u64 + 1).to_le_bytes());
        self.scratch
            .extend_from_slice(&(message.len() as u64).to_le_bytes());
        self.scratch.extend_from_slice(&self.prefix);
        self.scratch.push(0);

        let mut header = XLogRecordHeader {
            tot_len,
            xid: self.xid,
            prev: self.prev,
            info: XLOG_LOGICAL_MESSAGE,
            rmid: RM_LOGICALMSG_ID,
            crc: 0,
        }
        .encode();
        let crc = crc32c::crc32c_append(crc32c::crc32c(&self.scratch), message);
        let crc = crc32c::crc32c_append(crc, &header[..XLOG_RECORD_CRC_OFFS]);
        header[XLOG_RECORD_CRC_OFFS..].copy_from_slice(&crc.to_le_bytes());

        out.reserve(tot_len as usize + tot_len as usize / 256 + 64);
        let chunk_start = self.lsn;
        if self.lsn.page_offset() == 0 {
            self.page_header(out, 0);
        }
        let start = self.lsn;
        let mut remaining = tot_len;
        let scratch = std::mem::take(&mut self.scratch);
        for piece in [&header[..], &scratch[..], message] {
            self.emit(out, piece, &mut remaining);
        }
        self.scratch = scratch;
        // Pad to the next 8-byte boundary; page boundaries are 8-aligned, so this never
        // crosses a page.
        let end = self.lsn.align8().expect("LSN space exhausted");
        self.end_record(out, chunk_start, start, end, tot_len)
    }

    /// The record that began at `start` (its bytes from `chunk_start`) has all its data out:
    /// pads with zeros up to `end`, which becomes the next record's position, and returns where
    /// it landed.
    fn end_record(
        &mut self,
        out: &mut Vec<u8>,
        chunk_start: Lsn,
        start: Lsn,
        end: Lsn,
        tot_len: u32,
    ) -> RecordPos {
        let data_end = self.lsn;
        out.resize(out.len() + (end.0 - self.lsn.0) as usize, 0);
        self.lsn = end;
        self.prev = start;
        RecordPos {
            chunk_start,
            start,
            data_end,
            end,
            tot_len,
        }
    }

    /// Appends an `XLOG_SWITCH` record (what `pg_switch_wal()` writes: a bare 24-byte header,
    /// rmid 0, info 0x40) and the rest of its segment as PostgreSQL 15 leaves it: zeros, page
    /// headers included (`CopyXLogRecordToWAL` zeroes the padding pages' headers too). The
    /// record's end, like PostgreSQL's `EndRecPtr` after it, is the next segment's start; the
    /// next record goes there, after a long page header, with `xl_prev` = the switch.
    pub fn append_switch(&mut self, out: &mut Vec<u8>) -> RecordPos {
        let mut header = XLogRecordHeader {
            tot_len: SIZE_OF_XLOG_RECORD as u32,
            xid: self.xid,
            prev: self.prev,
            info: XLOG_SWITCH,
            rmid: RM_XLOG_ID,
            crc: 0,
        }
        .encode();
        let crc = crc32c::crc32c(&header[..XLOG_RECORD_CRC_OFFS]);
        header[XLOG_RECORD_CRC_OFFS..].copy_from_slice(&crc.to_le_bytes());
        let chunk_start = self.lsn;
        if self.lsn.page_offset() == 0 {
            self.page_header(out, 0);
        }
        let start = self.lsn;
        let mut remaining = SIZE_OF_XLOG_RECORD as u32;
        self.emit(out, &header, &mut remaining);
        let end = Lsn(self.lsn.0.next_multiple_of(self.seg_size));
        self.end_record(out, chunk_start, start, end, SIZE_OF_XLOG_RECORD as u32)
    }

    /// One record as owned bytes `[pos.chunk_start, pos.end)`.
    pub fn next_record(&mut self, message: &[u8]) -> (RecordPos, Vec<u8>) {
        let mut out = Vec::new();
        let pos = self.append_logical_message(&mut out, message);
        (pos, out)
    }

    /// Appends records carrying `message` until at least `min_bytes` were appended to `out`.
    /// Returns the number of records.
    pub fn fill(&mut self, out: &mut Vec<u8>, min_bytes: usize, message: &[u8]) -> usize {
        let target = out.len() + min_bytes;
        let mut n = 0;
        while out.len() < target {
            self.append_logical_message(out, message);
            n += 1;
        }
        n
    }

    /// Copies `data` out, inserting a continuation page header at each page boundary.
    fn emit(&mut self, out: &mut Vec<u8>, mut data: &[u8], remaining: &mut u32) {
        while !data.is_empty() {
            if self.lsn.page_offset() == 0 {
                // The record has started on an earlier page: this page continues it.
                self.page_header(out, *remaining);
            }
            let room = (XLOG_BLCKSZ - self.lsn.page_offset()) as usize;
            let n = room.min(data.len());
            out.extend_from_slice(&data[..n]);
            data = &data[n..];
            self.lsn = Lsn(self.lsn.0 + n as u64);
            *remaining -= n as u32;
        }
    }

    /// Emits the header of the page starting at `self.lsn`; `rem_len` > 0 marks a continuation.
    fn page_header(&mut self, out: &mut Vec<u8>, rem_len: u32) {
        let info = if rem_len > 0 {
            XLP_FIRST_IS_CONTRECORD
        } else {
            0
        };
        let std = PageHeader {
            magic: self.major.page_magic(),
            info,
            tli: PG_TLI,
            pageaddr: self.lsn,
            rem_len,
        };
        if self.lsn.segment_offset(self.seg_size) == 0 {
            let long = LongPageHeader {
                std: PageHeader {
                    info: info | XLP_LONG_HEADER,
                    ..std
                },
                sysid: self.sysid,
                seg_size: self.seg_size as u32,
                xlog_blcksz: XLOG_BLCKSZ as u32,
            };
            out.extend_from_slice(&long.encode());
            self.lsn = Lsn(self.lsn.0 + SIZE_OF_XLOG_LONG_PHD as u64);
        } else {
            out.extend_from_slice(&std.encode());
            self.lsn = Lsn(self.lsn.0 + SIZE_OF_XLOG_SHORT_PHD as u64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{XLP_FIRST_IS_CONTRECORD, record_crc};

    const SEG: u64 = 1 << 20;

    #[test]
    fn record_is_laid_out_like_postgres() {
        let mut g = WalGenerator::new(42, SEG, Lsn(SEG))
            .unwrap()
            .with_prefix(b"p");
        let (pos, bytes) = g.next_record(b"hello");
        assert_eq!(pos.chunk_start, Lsn(SEG));
        assert_eq!(pos.start, Lsn(SEG + 40));
        // 24 header + 2 block header + 24 xl_logical_message + "p\0" + "hello"
        assert_eq!(pos.tot_len, 24 + 2 + 24 + 2 + 5);
        // 57 bytes padded to 64.
        assert_eq!(pos.end, Lsn(SEG + 40 + 64));
        assert_eq!(bytes.len(), 104);
        let long = LongPageHeader::decode(&bytes).unwrap();
        assert_eq!(long.std.info, XLP_LONG_HEADER);
        assert_eq!(long.sysid, 42);
        assert_eq!(long.seg_size as u64, SEG);
        let rec = &bytes[40..40 + pos.tot_len as usize];
        let hdr: [u8; 24] = rec[..24].try_into().unwrap();
        let h = XLogRecordHeader::decode(&hdr);
        assert_eq!((h.rmid, h.info, h.prev), (21, 0, Lsn(0)));
        assert_eq!(h.crc, record_crc(&hdr, &rec[24..]));
        assert_eq!(&rec[24..26], &[255, 24 + 2 + 5]);
        assert_eq!(&rec[26 + 8..26 + 16], &2u64.to_le_bytes());
        assert_eq!(&rec[26 + 16..26 + 24], &5u64.to_le_bytes());
        assert_eq!(&rec[50..], b"p\0hello");
        let (pos2, _) = g.next_record(&[7; 300]);
        assert_eq!(pos2.start, pos.end);
        assert_eq!(pos2.tot_len, 24 + 5 + 24 + 2 + 300);
    }

    #[test]
    fn spanning_record_gets_continuation_headers() {
        let mut g = WalGenerator::new(1, SEG, Lsn(SEG + 8192 - 16)).unwrap();
        let (pos, bytes) = g.next_record(&[0xAB; 20_000]);
        assert_eq!(pos.start, Lsn(SEG + 8192 - 16));
        let hdr = PageHeader::decode(&bytes[16..]).unwrap();
        assert_eq!(hdr.info, XLP_FIRST_IS_CONTRECORD);
        assert_eq!(hdr.pageaddr, Lsn(SEG + 8192));
        assert_eq!(hdr.rem_len, pos.tot_len - 16);
        let hdr2 = PageHeader::decode(&bytes[16 + 8192..]).unwrap();
        assert_eq!(hdr2.rem_len, pos.tot_len - 16 - (8192 - 24));
    }

    #[test]
    fn rejects_starts_that_are_not_record_boundaries() {
        assert!(WalGenerator::new(1, SEG, Lsn(SEG + 8)).is_err());
        assert!(WalGenerator::new(1, SEG, Lsn(SEG + 8192 + 16)).is_err());
        assert!(WalGenerator::new(1, SEG, Lsn(SEG + 8192 + 24)).is_ok());
        assert!(WalGenerator::new(1, SEG, Lsn(SEG + 44)).is_err());
        assert!(WalGenerator::new(1, 3 << 20, Lsn(0)).is_err());
    }
}
