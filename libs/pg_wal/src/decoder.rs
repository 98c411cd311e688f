//! Finding record boundaries in a PostgreSQL WAL byte stream of one major version (14 to 18).
//!
//! [`WalStreamDecoder`] is fed the stream in chunks split anywhere (as appends arrive) and reports
//! the end LSN of every complete, valid record. It validates what PostgreSQL's `xlogreader`
//! validates to find the end of WAL: page headers (the version's magic, flags, `xlp_pageaddr`, segment and
//! block size, continuation flag and `xlp_rem_len`), record headers (`xl_tot_len` bounds, resource
//! manager valid in the version, `xl_prev` chain once known) and each record's CRC-32C. It keeps no record bytes: the
//! CRC is computed incrementally, so decoding never allocates and is bounded whatever it is fed.
//! Errors are values, sticky once returned; nothing here panics on input bytes.
//!
//! Not here: reading segment files (the safekeeper's WAL store recovery, `find_end_of_wal`) and
//! interpreting record contents.

use crate::format::{
    LongPageHeader, MAX_RECORD_LEN, PageHeader, RM_XLOG_ID, SIZE_OF_XLOG_LONG_PHD,
    SIZE_OF_XLOG_RECORD, XLOG_RECORD_CRC_OFFS, XLOG_SWITCH, XLP_ALL_FLAGS, XLP_FIRST_IS_CONTRECORD,
    XLP_FIRST_IS_OVERWRITE_CONTRECORD, XLP_LONG_HEADER, XLR_RMGR_INFO_MASK, XLogRecordHeader,
    page_header_size,
};
use crate::lsn::{Lsn, XLOG_BLCKSZ};
use crate::version::PgMajor;

/// Why decoding stopped. The WAL ends before `lsn` (a record or page start).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid WAL at {lsn}: {kind}")]
pub struct DecodeError {
    /// Where the invalid page or record starts: the valid WAL ends at or before it.
    pub lsn: Lsn,
    /// What was wrong there.
    pub kind: DecodeErrorKind,
}

/// " (PostgreSQL 16's WAL)" when `magic` is a known version's, else nothing.
fn written_by(magic: u16) -> String {
    PgMajor::from_page_magic(magic)
        .map(|m| format!(" ({m}'s WAL)"))
        .unwrap_or_default()
}

/// What was wrong.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeErrorKind {
    /// The decoder was asked to start where no record can begin.
    #[error("decoding cannot start inside a page header or at an unaligned position")]
    BadStart,
    /// A page header whose `xlp_magic` is not the decoder's version's (another version's WAL,
    /// or not WAL at all).
    #[error(
        "bad page magic {got:#06X}{by}, expected {want:#06X} of {expected}",
        by = written_by(*.got),
        want = .expected.page_magic()
    )]
    BadMagic {
        /// The `xlp_magic` found.
        got: u16,
        /// The version the decoder reads.
        expected: PgMajor,
    },
    /// A page header with unknown `xlp_info` bits, or a long header where a short one belongs
    /// (or the reverse).
    #[error("bad page info bits {0:#06X}")]
    BadPageInfo(u16),
    /// A page header whose `xlp_pageaddr` is not the page's own LSN (an old, recycled page).
    #[error("page address {got} differs from its position")]
    BadPageAddr {
        /// The `xlp_pageaddr` found.
        got: Lsn,
    },
    /// A segment's long header that disagrees with the segment or block size.
    #[error("long page header gives segment size {seg_size} and block size {blcksz}")]
    BadLongHeader {
        /// `xlp_seg_size` found.
        seg_size: u32,
        /// `xlp_xlog_blcksz` found.
        blcksz: u32,
    },
    /// `XLP_FIRST_IS_CONTRECORD` on a page where no record continues.
    #[error("page claims a continuation record but none is in progress")]
    UnexpectedContrecord,
    /// A record spills onto a page that does not say it continues one.
    #[error("page lacks the continuation flag of the record in progress")]
    MissingContrecord,
    /// `xlp_rem_len` disagrees with the bytes the record in progress still needs.
    #[error("continuation length {got}, expected {expected}")]
    BadRemLen {
        /// `xlp_rem_len` found.
        got: u32,
        /// Bytes the record still needs.
        expected: u32,
    },
    /// `xl_tot_len` below the record header: zeroes or a torn tail, the usual end of WAL.
    #[error("record length {0} is below the 24-byte header (zeroed or torn tail)")]
    RecordTooShort(u32),
    /// `xl_tot_len` above [`crate::format::MAX_RECORD_LEN`].
    #[error("record length {0} exceeds the maximum")]
    RecordTooLong(u32),
    /// A resource manager id PostgreSQL 15 does not know.
    #[error("invalid resource manager id {0}")]
    BadRmgr(u8),
    /// `xl_prev` does not point at the previous record.
    #[error("record's previous link {got} differs from the previous record {expected}")]
    BadPrevLink {
        /// `xl_prev` found.
        got: Lsn,
        /// Start of the previous record.
        expected: Lsn,
    },
    /// The record's CRC-32C does not match its bytes.
    #[error("record CRC {got:#010X} differs from computed {computed:#010X}")]
    BadCrc {
        /// `xl_crc` found.
        got: u32,
        /// CRC-32C of the record's bytes.
        computed: u32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    /// Collecting the 24-byte record header (`rec_hdr_got` bytes so far).
    RecordHeader,
    /// Checksumming `body_remaining` more body bytes.
    RecordBody,
    /// The record is valid; skipping alignment padding up to its end.
    Padding { until: u64 },
    /// After `XLOG_SWITCH`: the rest of the segment is unused and skipped unread.
    Skip { until: u64 },
}

/// Streaming WAL decoder: feed it bytes in order, learn where records end.
///
/// Invariants: `lsn` is the position of the next byte to be fed; while `lsn` is at a page
/// boundary (outside `Skip`) the next bytes are that page's header, collected in `page_hdr`.
/// Cloning is cheap (no heap): the WAL store clones it to decode a write before committing it.
#[derive(Clone, Debug)]
pub struct WalStreamDecoder {
    major: PgMajor,
    seg_size: u64,
    lsn: u64,
    state: State,
    page_hdr: [u8; SIZE_OF_XLOG_LONG_PHD],
    page_hdr_got: usize,
    rec_hdr: [u8; SIZE_OF_XLOG_RECORD],
    rec_hdr_got: usize,
    /// Start of the record being decoded.
    rec_start: u64,
    /// `xl_tot_len` of the record being decoded, once its first 4 bytes are in.
    tot_len: u32,
    body_remaining: u32,
    /// Running CRC-32C of the body bytes seen so far.
    crc: u32,
    /// Start of the last valid record, if this decoder has seen one (checks `xl_prev`).
    prev_rec: Option<u64>,
    /// End of the last valid record reported (or the start position).
    last_end: u64,
    /// Once set, every further feed returns it.
    error: Option<DecodeError>,
    /// Where this decoder started. A decoder started at a page start may find that page
    /// continuing a record begun before it (a stream that starts at a segment boundary, as a
    /// real primary's WAL relayed from a segment start does): it skips that record's tail, as
    /// PostgreSQL's `XLogFindNextRecord` does.
    start: u64,
    /// The body bytes being consumed are such a tail: no header, no CRC to check.
    skipping_tail: bool,
    /// Start and `xl_prev` of the first record whose CRC this decoder checked.
    first_checked: Option<(u64, u64)>,
}

impl WalStreamDecoder {
    /// A decoder whose next byte is at `start`, which must be a record boundary (8-byte aligned,
    /// not inside a page header; a page-boundary start expects that page's header first).
    /// `seg_size` must be a valid segment size (callers check it). Pages must carry `major`'s
    /// magic and records only its resource managers.
    pub fn new(start: Lsn, seg_size: u64, major: PgMajor) -> WalStreamDecoder {
        let page_off = start.page_offset() as usize;
        let hdr = page_header_size(start.page_start(), seg_size);
        let error = (!start.0.is_multiple_of(8) || (page_off != 0 && page_off < hdr)).then_some(
            DecodeError {
                lsn: start,
                kind: DecodeErrorKind::BadStart,
            },
        );
        WalStreamDecoder {
            major,
            seg_size,
            lsn: start.0,
            state: State::RecordHeader,
            page_hdr: [0; SIZE_OF_XLOG_LONG_PHD],
            page_hdr_got: 0,
            rec_hdr: [0; SIZE_OF_XLOG_RECORD],
            rec_hdr_got: 0,
            rec_start: start.0,
            tot_len: 0,
            body_remaining: 0,
            crc: 0,
            prev_rec: None,
            last_end: start.0,
            error,
            start: start.0,
            skipping_tail: false,
            first_checked: None,
        }
    }

    /// Also checks the first record's `xl_prev` against `prev`.
    pub fn with_prev(mut self, prev: Lsn) -> WalStreamDecoder {
        self.prev_rec = Some(prev.0);
        self
    }

    /// Position of the next byte to feed.
    pub fn lsn(&self) -> Lsn {
        Lsn(self.lsn)
    }

    /// End of the last complete valid record (the start position if none yet).
    pub fn last_record_end(&self) -> Lsn {
        Lsn(self.last_end)
    }

    /// The error decoding stopped at, if any.
    pub fn error(&self) -> Option<&DecodeError> {
        self.error.as_ref()
    }

    /// After a valid `XLOG_SWITCH` record whose padding is not all fed yet: the segment end
    /// the decoder skips to (where the record ends, as PostgreSQL's `EndRecPtr` does).
    pub fn switch_end(&self) -> Option<Lsn> {
        match self.state {
            State::Skip { until } if self.error.is_none() => Some(Lsn(until)),
            _ => None,
        }
    }

    /// Start of the last record whose CRC checked out, if this decoder has seen one (or was
    /// told one with [`WalStreamDecoder::with_prev`]): what the next record's `xl_prev` must be.
    pub fn last_valid_record_start(&self) -> Option<Lsn> {
        self.prev_rec.map(Lsn)
    }

    /// `(start, xl_prev)` of the first record this decoder checked completely (CRC included),
    /// if any. A record tail skipped at a page that continues a record from before the start
    /// does not count: it has no header or CRC to check.
    pub fn first_checked_record(&self) -> Option<(Lsn, Lsn)> {
        self.first_checked
            .map(|(start, prev)| (Lsn(start), Lsn(prev)))
    }

    /// Feeds the next bytes of the stream and returns the end of the last complete record in
    /// them (`None` if none completed). On an error the decoder stops for good; the records
    /// completed before it still count in [`WalStreamDecoder::last_record_end`].
    pub fn feed(&mut self, buf: &[u8]) -> Result<Option<Lsn>, DecodeError> {
        let mut last = None;
        self.feed_with(buf, |end| last = Some(end))?;
        Ok(last)
    }

    /// Like [`WalStreamDecoder::feed`], calling `on_record(end)` for every completed record.
    pub fn feed_with(
        &mut self,
        mut buf: &[u8],
        mut on_record: impl FnMut(Lsn),
    ) -> Result<(), DecodeError> {
        if let Some(e) = &self.error {
            return Err(e.clone());
        }
        while !buf.is_empty() {
            if let Err(e) = self.step(&mut buf, &mut on_record) {
                self.error = Some(e.clone());
                return Err(e);
            }
        }
        Ok(())
    }

    fn err(&self, lsn: u64, kind: DecodeErrorKind) -> DecodeError {
        DecodeError {
            lsn: Lsn(lsn),
            kind,
        }
    }

    /// Consumes at least one byte of `buf` (which is non-empty).
    fn step(
        &mut self,
        buf: &mut &[u8],
        on_record: &mut impl FnMut(Lsn),
    ) -> Result<(), DecodeError> {
        match self.state {
            State::Padding { until } | State::Skip { until } => {
                let n = ((until - self.lsn) as usize).min(buf.len());
                *buf = &buf[n..];
                self.lsn += n as u64;
                if self.lsn == until {
                    self.record_done(on_record);
                }
                return Ok(());
            }
            State::RecordHeader | State::RecordBody => {}
        }
        let page_off = self.lsn % XLOG_BLCKSZ;
        if page_off == 0 {
            return self.page_header_step(buf);
        }
        let room = (XLOG_BLCKSZ - page_off) as usize;
        if self.state == State::RecordHeader {
            if self.rec_hdr_got == 0 {
                self.rec_start = self.lsn;
                self.tot_len = 0;
            }
            let n = room
                .min(buf.len())
                .min(SIZE_OF_XLOG_RECORD - self.rec_hdr_got);
            let had = self.rec_hdr_got;
            self.rec_hdr[had..had + n].copy_from_slice(&buf[..n]);
            *buf = &buf[n..];
            self.rec_hdr_got += n;
            self.lsn += n as u64;
            if had < 4 && self.rec_hdr_got >= 4 {
                // Check the length as soon as it is known: a zeroed tail stops here.
                let tot_len = u32::from_le_bytes([
                    self.rec_hdr[0],
                    self.rec_hdr[1],
                    self.rec_hdr[2],
                    self.rec_hdr[3],
                ]);
                if tot_len < SIZE_OF_XLOG_RECORD as u32 {
                    return Err(self.err(self.rec_start, DecodeErrorKind::RecordTooShort(tot_len)));
                }
                if tot_len > MAX_RECORD_LEN {
                    return Err(self.err(self.rec_start, DecodeErrorKind::RecordTooLong(tot_len)));
                }
                self.tot_len = tot_len;
            }
            if self.rec_hdr_got == SIZE_OF_XLOG_RECORD {
                let h = XLogRecordHeader::decode(&self.rec_hdr);
                if !self.major.is_valid_rmid(h.rmid) {
                    return Err(self.err(self.rec_start, DecodeErrorKind::BadRmgr(h.rmid)));
                }
                if let Some(prev) = self.prev_rec
                    && h.prev.0 != prev
                {
                    return Err(self.err(
                        self.rec_start,
                        DecodeErrorKind::BadPrevLink {
                            got: h.prev,
                            expected: Lsn(prev),
                        },
                    ));
                }
                self.state = State::RecordBody;
                self.body_remaining = self.tot_len - SIZE_OF_XLOG_RECORD as u32;
                self.crc = 0;
                if self.body_remaining == 0 {
                    return self.record_complete(on_record);
                }
            }
            return Ok(());
        }
        // RecordBody
        let n = room.min(buf.len()).min(self.body_remaining as usize);
        self.crc = crc32c::crc32c_append(self.crc, &buf[..n]);
        *buf = &buf[n..];
        self.lsn += n as u64;
        self.body_remaining -= n as u32;
        if self.body_remaining == 0 {
            return self.record_complete(on_record);
        }
        Ok(())
    }

    /// Collects and validates the header of the page starting at `self.lsn`.
    fn page_header_step(&mut self, buf: &mut &[u8]) -> Result<(), DecodeError> {
        let page = self.lsn;
        let hdr_size = page_header_size(Lsn(page), self.seg_size);
        let n = (hdr_size - self.page_hdr_got).min(buf.len());
        let had = self.page_hdr_got;
        self.page_hdr[had..had + n].copy_from_slice(&buf[..n]);
        *buf = &buf[n..];
        self.page_hdr_got += n;
        if self.page_hdr_got < hdr_size {
            return Ok(());
        }
        self.page_hdr_got = 0;
        let hdr = PageHeader::decode(&self.page_hdr).expect("page_hdr holds a full header");
        if hdr.magic != self.major.page_magic() {
            let kind = DecodeErrorKind::BadMagic {
                got: hdr.magic,
                expected: self.major,
            };
            return Err(self.err(page, kind));
        }
        let is_seg_start = page.is_multiple_of(self.seg_size);
        if hdr.info & !XLP_ALL_FLAGS != 0 || (hdr.info & XLP_LONG_HEADER != 0) != is_seg_start {
            return Err(self.err(page, DecodeErrorKind::BadPageInfo(hdr.info)));
        }
        if hdr.pageaddr.0 != page {
            return Err(self.err(page, DecodeErrorKind::BadPageAddr { got: hdr.pageaddr }));
        }
        if is_seg_start {
            let long = LongPageHeader::decode(&self.page_hdr).expect("page_hdr holds 40 bytes");
            if long.seg_size as u64 != self.seg_size || long.xlog_blcksz as u64 != XLOG_BLCKSZ {
                return Err(self.err(
                    page,
                    DecodeErrorKind::BadLongHeader {
                        seg_size: long.seg_size,
                        blcksz: long.xlog_blcksz,
                    },
                ));
            }
        }
        let in_record = match self.state {
            State::RecordHeader => self.rec_hdr_got > 0,
            State::RecordBody => true,
            State::Padding { .. } | State::Skip { .. } => false,
        };
        let contrecord = hdr.info & XLP_FIRST_IS_CONTRECORD != 0;
        if in_record && hdr.info & XLP_FIRST_IS_OVERWRITE_CONTRECORD != 0 {
            // The record in progress was abandoned by a primary that crashed while writing it
            // (PostgreSQL's xlogreader restarts at this page the same way): it never counted,
            // and the next record, this page's first, links back to the last valid one.
            self.state = State::RecordHeader;
            self.rec_hdr_got = 0;
            self.skipping_tail = false;
        } else if in_record {
            if !contrecord {
                return Err(self.err(page, DecodeErrorKind::MissingContrecord));
            }
            let expected = match self.state {
                State::RecordBody => self.body_remaining,
                // At a page boundary the header has at least 8 bytes in, so tot_len is known.
                _ => self.tot_len.saturating_sub(self.rec_hdr_got as u32),
            };
            if hdr.rem_len != expected {
                return Err(self.err(
                    page,
                    DecodeErrorKind::BadRemLen {
                        got: hdr.rem_len,
                        expected,
                    },
                ));
            }
        } else if contrecord {
            if page != self.start || hdr.rem_len == 0 {
                return Err(self.err(page, DecodeErrorKind::UnexpectedContrecord));
            }
            // The tail of a record that began before our start: consume it as a body (later
            // pages' continuation lengths are checked), then the first record starts.
            self.state = State::RecordBody;
            self.body_remaining = hdr.rem_len;
            self.skipping_tail = true;
        }
        self.lsn += hdr_size as u64;
        Ok(())
    }

    /// All body bytes are in: verify the CRC and move on to padding (or the segment skip).
    fn record_complete(&mut self, on_record: &mut impl FnMut(Lsn)) -> Result<(), DecodeError> {
        if self.skipping_tail {
            self.skipping_tail = false;
            let until = (self.lsn + 7) & !7;
            self.state = State::Padding { until };
            if self.lsn == until {
                self.record_done(on_record);
            }
            return Ok(());
        }
        let computed = crc32c::crc32c_append(self.crc, &self.rec_hdr[..XLOG_RECORD_CRC_OFFS]);
        let h = XLogRecordHeader::decode(&self.rec_hdr);
        if computed != h.crc {
            return Err(self.err(
                self.rec_start,
                DecodeErrorKind::BadCrc {
                    got: h.crc,
                    computed,
                },
            ));
        }
        self.prev_rec = Some(self.rec_start);
        self.first_checked.get_or_insert((self.rec_start, h.prev.0));
        self.rec_hdr_got = 0;
        let until = if h.rmid == RM_XLOG_ID && h.info & XLR_RMGR_INFO_MASK == XLOG_SWITCH {
            let until = self.lsn.div_ceil(self.seg_size) * self.seg_size;
            self.state = State::Skip { until };
            until
        } else {
            // Page boundaries are 8-aligned: padding never crosses one.
            let until = (self.lsn + 7) & !7;
            self.state = State::Padding { until };
            until
        };
        if self.lsn == until {
            self.record_done(on_record);
        }
        Ok(())
    }

    fn record_done(&mut self, on_record: &mut impl FnMut(Lsn)) {
        self.state = State::RecordHeader;
        self.last_end = self.lsn;
        on_record(Lsn(self.lsn));
    }
}

/// Decodes `bytes` (the WAL starting at the record boundary `start`) and returns the end of the
/// last valid record, with the error that stopped decoding if it did not run out of bytes.
pub fn find_end_of_wal_in(
    bytes: &[u8],
    start: Lsn,
    seg_size: u64,
    major: PgMajor,
) -> (Lsn, Option<DecodeError>) {
    let mut dec = WalStreamDecoder::new(start, seg_size, major);
    let err = dec.feed(bytes).err();
    (dec.last_record_end(), err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::format::{SIZE_OF_XLOG_SHORT_PHD, first_segment_image};
    use crate::generator::{RecordPos, WalGenerator};
    use proptest::prelude::*;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    const SEG: u64 = 1 << 20;
    const V15: PgMajor = PgMajor::V15;

    /// WAL from `start` with records of the given message sizes.
    fn wal(start: Lsn, sizes: &[usize]) -> (Vec<u8>, Vec<RecordPos>) {
        let mut g = WalGenerator::new(7, SEG, start).unwrap();
        let mut out = Vec::new();
        let msg = vec![0x5Au8; sizes.iter().copied().max().unwrap_or(0)];
        let pos = sizes
            .iter()
            .map(|&n| g.append_logical_message(&mut out, &msg[..n]))
            .collect();
        (out, pos)
    }

    fn mixed_sizes(rng: &mut SmallRng, n: usize) -> Vec<usize> {
        (0..n)
            .map(|_| match rng.random_range(0..10) {
                0 => rng.random_range(8_000..70_000),
                1..=3 => rng.random_range(200..3000),
                _ => rng.random_range(0..200),
            })
            .collect()
    }

    #[test]
    fn each_version_reads_its_own_pages_and_refuses_another_versions() {
        let start = Lsn(SEG);
        for major in PgMajor::ALL {
            let mut g = WalGenerator::new(7, SEG, start).unwrap().with_major(major);
            let mut bytes = Vec::new();
            let last = (0..40)
                .map(|_| g.append_logical_message(&mut bytes, &[1u8; 700]))
                .last()
                .unwrap();
            let (end, err) = find_end_of_wal_in(&bytes, start, SEG, major);
            assert_eq!((end, err), (last.end, None), "{major}");
            for other in PgMajor::ALL.into_iter().filter(|&o| o != major) {
                let (end, err) = find_end_of_wal_in(&bytes, start, SEG, other);
                assert_eq!(end, start, "{major} WAL read as {other}");
                let err = err.expect("refused");
                assert_eq!(
                    err.kind,
                    DecodeErrorKind::BadMagic {
                        got: major.page_magic(),
                        expected: other
                    }
                );
                let text = err.to_string();
                assert!(
                    text.contains(&format!("({major}'s WAL)")) && text.contains(&other.to_string()),
                    "{text}"
                );
            }
        }
    }

    /// WAL of a primary that crashed while writing record B: B's first two pages, then the page
    /// where B would have continued, started over with `XLP_FIRST_IS_OVERWRITE_CONTRECORD` and
    /// record C, whose `xl_prev` is A (the last valid record).
    fn overwritten_contrecord(flag: u16) -> (Vec<u8>, Lsn, Vec<Lsn>) {
        let start = Lsn(SEG);
        let mut g = WalGenerator::new(7, SEG, start).unwrap();
        let mut bytes = Vec::new();
        let a = g.append_logical_message(&mut bytes, b"a");
        let b = g.append_logical_message(&mut bytes, &[7u8; 3 * 8192]);
        let cut = b.start.page_start().0 + 2 * 8192;
        assert!(cut < b.end.0);
        bytes.truncate((cut - start.0) as usize);
        let mut g2 = WalGenerator::new(7, SEG, Lsn(cut))
            .unwrap()
            .with_prev(a.start);
        let c = g2.append_logical_message(&mut bytes, b"c");
        let at = (cut - start.0) as usize;
        bytes[at + 2..at + 4].copy_from_slice(&flag.to_le_bytes());
        (bytes, start, vec![a.end, c.end])
    }

    #[test]
    fn a_record_abandoned_by_a_crashed_primary_is_skipped_at_the_overwrite_page() {
        let (bytes, start, want) = overwritten_contrecord(XLP_FIRST_IS_OVERWRITE_CONTRECORD);
        for chunk in [1, 7, 100, 8192, bytes.len()] {
            let mut dec = WalStreamDecoder::new(start, SEG, V15);
            let mut got = Vec::new();
            for piece in bytes.chunks(chunk) {
                dec.feed_with(piece, |end| got.push(end)).unwrap();
            }
            assert_eq!(got, want, "chunks of {chunk}");
        }
        // Without the flag the same page is a missing continuation: the WAL ends at A.
        let (bytes, start, want) = overwritten_contrecord(0);
        let (end, err) = find_end_of_wal_in(&bytes, start, SEG, V15);
        assert_eq!(end, want[0]);
        assert_eq!(err.unwrap().kind, DecodeErrorKind::MissingContrecord);
    }

    #[test]
    fn custom_resource_managers_are_refused_before_15() {
        let start = Lsn(SEG + 8192);
        let mut g = WalGenerator::new(7, SEG, start)
            .unwrap()
            .with_major(PgMajor::V14);
        let mut bytes = Vec::new();
        g.append_logical_message(&mut bytes, b"x");
        bytes[SIZE_OF_XLOG_SHORT_PHD + 17] = 130;
        let (_, err) = find_end_of_wal_in(&bytes, start, SEG, PgMajor::V14);
        assert_eq!(err.unwrap().kind, DecodeErrorKind::BadRmgr(130));
        // PostgreSQL 15 knows rmgr 130: the record gets as far as its CRC (the patched byte).
        let mut g = WalGenerator::new(7, SEG, start).unwrap();
        let mut bytes = Vec::new();
        g.append_logical_message(&mut bytes, b"x");
        bytes[SIZE_OF_XLOG_SHORT_PHD + 17] = 130;
        let (_, err) = find_end_of_wal_in(&bytes, start, SEG, V15);
        assert!(matches!(err.unwrap().kind, DecodeErrorKind::BadCrc { .. }));
    }

    #[test]
    fn generated_wal_round_trips_through_the_decoder_in_any_chunking() {
        let seed = 0x5eed_u64;
        println!("seed {seed}");
        let mut rng = SmallRng::seed_from_u64(seed);
        for start in [Lsn(SEG), Lsn(3 * SEG - 8192), Lsn(2 * SEG + 8192 * 3 + 120)] {
            let sizes = mixed_sizes(&mut rng, 200);
            let (bytes, pos) = wal(start, &sizes);
            let want: Vec<Lsn> = pos.iter().map(|p| p.end).collect();
            for _ in 0..5 {
                let mut dec = WalStreamDecoder::new(start, SEG, V15);
                let mut got = Vec::new();
                let mut rest = &bytes[..];
                while !rest.is_empty() {
                    let n = rng.random_range(1..=rest.len().min(20_000));
                    dec.feed_with(&rest[..n], |end| got.push(end)).unwrap();
                    rest = &rest[n..];
                }
                assert_eq!(got, want);
                assert_eq!(dec.last_record_end(), *want.last().unwrap());
            }
        }
    }

    #[test]
    fn crosses_segment_boundaries_and_checks_prev_links() {
        let start = Lsn(SEG);
        let (bytes, pos) = wal(start, &[300_000, 300_000, 300_000, 300_000, 10]);
        assert!(pos.last().unwrap().end.0 > 2 * SEG);
        let (end, err) = find_end_of_wal_in(&bytes, start, SEG, V15);
        assert_eq!((end, err), (pos.last().unwrap().end, None));
        // A decoder told the wrong previous record refuses the first record.
        let mut dec = WalStreamDecoder::new(start, SEG, V15).with_prev(Lsn(8));
        let e = dec.feed(&bytes).unwrap_err();
        assert!(matches!(e.kind, DecodeErrorKind::BadPrevLink { .. }), "{e}");
    }

    #[test]
    fn decoding_stops_at_a_corrupt_record() {
        let start = Lsn(SEG + 8192 * 2 + 24);
        let (mut bytes, pos) = wal(start, &[100, 5000, 100, 100, 20_000, 100]);
        // Flip a body byte of record 4 (the 20 KB one).
        let victim = pos[4];
        let at = (victim.start.0 + 100 - start.0) as usize;
        bytes[at] ^= 0x01;
        let (end, err) = find_end_of_wal_in(&bytes, start, SEG, V15);
        assert_eq!(end, pos[3].end);
        let err = err.unwrap();
        assert_eq!(err.lsn, victim.start);
        assert!(matches!(err.kind, DecodeErrorKind::BadCrc { .. }), "{err}");
    }

    #[test]
    fn decoding_stops_at_a_zeroed_tail() {
        let start = Lsn(SEG);
        let (mut bytes, pos) = wal(start, &[100, 200]);
        bytes.resize(bytes.len() + 8192 * 3, 0);
        let (end, err) = find_end_of_wal_in(&bytes, start, SEG, V15);
        assert_eq!(end, pos[1].end);
        assert_eq!(err.unwrap().kind, DecodeErrorKind::RecordTooShort(0));
    }

    #[test]
    fn decoding_stops_at_bad_page_headers() {
        let start = Lsn(SEG);
        let (bytes, pos) = wal(start, &[3000, 3000, 3000, 3000, 3000]);
        // Second page header starts at 8192 from the segment start.
        let page = 8192usize;
        let last_before = pos.iter().rfind(|p| p.end.0 <= SEG + 8192).unwrap().end;
        for (off, val, kind_ok) in [
            (0usize, 0x11u8, "magic"),
            (2, 0x10, "info"),
            (8, 0x01, "pageaddr"),
            (16, 0x01, "rem_len"),
            (2, 0x00, "contrecord flag cleared"),
        ] {
            let mut b = bytes.clone();
            if kind_ok == "contrecord flag cleared" {
                b[page + off] = val;
            } else {
                b[page + off] ^= val;
            }
            let (end, err) = find_end_of_wal_in(&b, start, SEG, V15);
            assert_eq!(end, last_before, "{kind_ok}");
            assert_eq!(err.unwrap().lsn, Lsn(SEG + 8192), "{kind_ok}");
        }
        // The long header must carry the real segment size.
        let mut b = bytes.clone();
        b[32] ^= 0x01;
        let (end, err) = find_end_of_wal_in(&b, start, SEG, V15);
        assert_eq!(end, start);
        assert!(matches!(
            err.unwrap().kind,
            DecodeErrorKind::BadLongHeader { .. }
        ));
    }

    #[test]
    fn start_at_a_page_continuing_an_earlier_record_skips_its_tail() {
        // Records large enough that one spans from the first segment into the second.
        let start = Lsn(SEG);
        let mut g = WalGenerator::new(1, SEG, start).unwrap();
        let mut bytes = Vec::new();
        let mut ends = Vec::new();
        while g.lsn().0 < 2 * SEG + 3 * 8192 {
            let pos = g.append_logical_message(&mut bytes, &[7; 20_000]);
            ends.push(pos.end);
        }
        let seg2 = SEG as usize;
        let hdr = PageHeader::decode(&bytes[seg2..]).unwrap();
        assert!(
            hdr.info & XLP_FIRST_IS_CONTRECORD != 0,
            "the test needs a spanning record"
        );
        let first_end = *ends.iter().find(|e| e.0 > 2 * SEG).unwrap();
        let mut seen = Vec::new();
        let mut dec = WalStreamDecoder::new(Lsn(2 * SEG), SEG, V15);
        dec.feed_with(&bytes[seg2..], |e| seen.push(e)).unwrap();
        // The first boundary reported is the end of the record that was in progress (aligned),
        // then every later record's end.
        let later: Vec<Lsn> = ends.iter().copied().filter(|e| *e >= first_end).collect();
        assert_eq!(seen, later);
        assert_eq!(dec.last_record_end(), *ends.last().unwrap());
    }

    #[test]
    fn toggled_continuation_flag_is_refused() {
        let start = Lsn(SEG);
        let mut g = WalGenerator::new(1, SEG, start).unwrap();
        let mut bytes = Vec::new();
        while g.lsn().0 < SEG + 8192 + 100 {
            g.append_logical_message(&mut bytes, &[1; 100]);
        }
        let page = 8192usize;
        let hdr = PageHeader::decode(&bytes[page..]).unwrap();
        let mut b = bytes.clone();
        b[page + 2] = (hdr.info ^ XLP_FIRST_IS_CONTRECORD) as u8;
        let (_, err) = find_end_of_wal_in(&b, start, SEG, V15);
        let kind = err.unwrap().kind;
        assert!(
            matches!(
                kind,
                DecodeErrorKind::UnexpectedContrecord | DecodeErrorKind::MissingContrecord
            ),
            "{kind}"
        );
    }

    #[test]
    fn xlog_switch_skips_to_the_next_segment() {
        // The switch on an ordinary page, on the first page of a segment, on a page a long
        // record continues onto, and with its header split across two pages.
        for before in [vec![100], vec![], vec![30_000], vec![8075]] {
            let start = Lsn(SEG);
            let mut g = WalGenerator::new(7, SEG, start).unwrap();
            let mut bytes = Vec::new();
            let mut want: Vec<Lsn> = before
                .iter()
                .map(|&n| g.append_logical_message(&mut bytes, &vec![1; n]).end)
                .collect();
            let sw = g.append_switch(&mut bytes);
            if before == [8075] {
                assert_eq!(sw.start, Lsn(SEG + 8192 - 8), "the header is split");
            }
            assert_eq!((sw.end, g.lsn()), (Lsn(2 * SEG), Lsn(2 * SEG)));
            assert_eq!(bytes.len() as u64, SEG);
            let next = g.append_logical_message(&mut bytes, b"after switch");
            want.extend([Lsn(2 * SEG), next.end]);
            let mut dec = WalStreamDecoder::new(start, SEG, V15);
            let mut ends = Vec::new();
            dec.feed_with(&bytes, |e| ends.push(e)).unwrap();
            assert_eq!(ends, want, "records before the switch: {before:?}");
        }
    }

    #[test]
    fn starts_after_a_first_segment_image() {
        let init = Lsn(SEG + 8192 * 4 + 200);
        let mut bytes = first_segment_image(V15, 1, SEG, Lsn(init.0)).unwrap();
        let (wal_bytes, pos) = wal(init, &[10, 10_000, 10]);
        bytes.extend_from_slice(&wal_bytes);
        let (end, err) = find_end_of_wal_in(&bytes[(init.0 - SEG) as usize..], init, SEG, V15);
        assert_eq!((end, err), (pos[2].end, None));
    }

    #[test]
    fn bad_start_is_an_error_not_a_panic() {
        let mut dec = WalStreamDecoder::new(Lsn(SEG + 4), SEG, V15);
        assert_eq!(
            dec.feed(&[0; 64]).unwrap_err().kind,
            DecodeErrorKind::BadStart
        );
        let mut dec = WalStreamDecoder::new(Lsn(SEG + 8), SEG, V15);
        assert_eq!(
            dec.feed(&[0; 64]).unwrap_err().kind,
            DecodeErrorKind::BadStart
        );
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic_the_decoder(
            bytes in proptest::collection::vec(any::<u8>(), 0..40_000),
            start_page in 0u64..300,
            start_off in 0u64..1024,
            chunk in 1usize..5000,
        ) {
            let start = Lsn(start_page * 8192 + start_off * 8);
            let mut dec = WalStreamDecoder::new(start, SEG, V15);
            for c in bytes.chunks(chunk) {
                if dec.feed(c).is_err() {
                    break;
                }
            }
            prop_assert!(dec.last_record_end() >= start);
        }

        #[test]
        fn corrupted_generated_wal_never_panics_and_ends_at_a_record_boundary(
            sizes in proptest::collection::vec(0usize..20_000, 1..20),
            flips in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..4),
        ) {
            let start = Lsn(SEG + 8192 - 48);
            let (mut bytes, pos) = wal(start, &sizes);
            for (i, x) in flips {
                let at = i.index(bytes.len());
                bytes[at] ^= x;
            }
            let (end, _) = find_end_of_wal_in(&bytes, start, SEG, V15);
            prop_assert!(end == start || pos.iter().any(|p| p.end == end));
        }
    }
}
