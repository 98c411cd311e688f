//! The physical streaming replication sub-protocol carried inside CopyData once
//! `START_REPLICATION` has answered CopyBothResponse.
//!
//! Server → client ([`ReplicationMessage`]): XLogData `w` and primary keepalive `k`.
//! Client → server ([`StandbyMessage`]): standby status update `r`, hot-standby feedback `h`
//! (and neon's pageserver feedback `z`, passed through undecoded).
//! All integers are big-endian; LSNs are u64; timestamps are i64 microseconds since
//! 2000-01-01 00:00:00 UTC ([`to_pg_timestamp`], [`from_pg_timestamp`]).
//!
//! Pure code: no I/O and no clock (callers pass `SystemTime::now()` in); fields are read with the
//! bounded [`Reader`]. What to stream and when is left to the walsender; framing of the CopyData
//! itself is in [`crate::backend`] and [`crate::frontend`].

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::{BufMut, Bytes, BytesMut};
use pg_wal::Lsn;

use crate::reader::{ReadError, Reader};

/// Seconds from the Unix epoch to the PostgreSQL epoch (2000-01-01 00:00:00 UTC).
pub const PG_EPOCH_UNIX_SECS: u64 = 946_684_800;

/// Size of the XLogData header inside the CopyData payload: tag + 3 × 8 bytes.
pub const XLOG_DATA_HEADER_LEN: usize = 25;

/// Microseconds since the PostgreSQL epoch (negative before 2000). Saturates far outside the
/// representable range.
pub fn to_pg_timestamp(t: SystemTime) -> i64 {
    let pg_epoch = UNIX_EPOCH + Duration::from_secs(PG_EPOCH_UNIX_SECS);
    match t.duration_since(pg_epoch) {
        Ok(d) => i64::try_from(d.as_micros()).unwrap_or(i64::MAX),
        Err(e) => i64::try_from(e.duration().as_micros())
            .map(|v| -v)
            .unwrap_or(i64::MIN),
    }
}

/// The `SystemTime` of a PostgreSQL timestamp (µs since 2000-01-01 UTC).
pub fn from_pg_timestamp(ts: i64) -> SystemTime {
    let pg_epoch = UNIX_EPOCH + Duration::from_secs(PG_EPOCH_UNIX_SECS);
    if ts >= 0 {
        pg_epoch + Duration::from_micros(ts as u64)
    } else {
        pg_epoch - Duration::from_micros(ts.unsigned_abs())
    }
}

/// Why a CopyData payload is not a valid replication message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReplicationError {
    /// A CopyData with no payload.
    #[error("empty replication message")]
    Empty,
    /// A type byte no replication message has.
    #[error("unknown replication message type {tag:#04x}")]
    UnknownTag {
        /// The type byte.
        tag: u8,
    },
    /// A message whose length does not match its type.
    #[error("replication message '{}' has length {len}, expected {expected}", char::from(*tag))]
    BadLength {
        /// The type byte.
        tag: u8,
        /// The payload length, type byte included.
        len: usize,
        /// The length the type requires.
        expected: &'static str,
    },
    /// A field could not be read (cannot happen once the length is checked; kept typed).
    #[error(transparent)]
    Read(#[from] ReadError),
}

/// Server → client messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicationMessage {
    /// `w`: WAL bytes starting at `wal_start`; `wal_end` is the server's current end of WAL.
    XLogData {
        /// LSN of `data`'s first byte.
        wal_start: Lsn,
        /// The server's end of WAL when it sent this.
        wal_end: Lsn,
        /// When it was sent (µs since 2000-01-01 UTC).
        send_time: i64,
        /// The WAL bytes.
        data: Bytes,
    },
    /// `k`: the server's end of WAL; `reply_requested` asks for an immediate `r`.
    Keepalive {
        /// The server's end of WAL.
        wal_end: Lsn,
        /// When it was sent (µs since 2000-01-01 UTC).
        send_time: i64,
        /// Whether the client must answer with a status update at once.
        reply_requested: bool,
    },
}

/// Client → server messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StandbyMessage {
    /// `r`: positions written, flushed and applied by the standby.
    StatusUpdate {
        /// End of the WAL the standby has written.
        write: Lsn,
        /// End of the WAL the standby has flushed.
        flush: Lsn,
        /// End of the WAL the standby has applied.
        apply: Lsn,
        /// When it was sent (µs since 2000-01-01 UTC).
        send_time: i64,
        /// Whether the server must answer with a keepalive at once.
        reply_requested: bool,
    },
    /// `h`: the standby's xmin (0 = none) and catalog xmin, each with its epoch.
    HotStandbyFeedback {
        /// When it was sent (µs since 2000-01-01 UTC).
        send_time: i64,
        /// The standby's oldest running xmin (0 = none).
        xmin: u32,
        /// The epoch of `xmin`.
        epoch: u32,
        /// The standby's catalog xmin (0 = none).
        catalog_xmin: u32,
        /// The epoch of `catalog_xmin`.
        catalog_epoch: u32,
    },
    /// `z`: neon pageserver feedback; the bytes after the tag, not decoded here.
    NeonFeedback(Bytes),
}

/// Encodes the 25-byte XLogData header; the WAL bytes follow it in the same CopyData
/// (see [`crate::backend::put_copy_data`]).
pub fn xlog_data_header(wal_start: Lsn, wal_end: Lsn, send_time: i64) -> [u8; 25] {
    let mut h = [0u8; XLOG_DATA_HEADER_LEN];
    h[0] = b'w';
    h[1..9].copy_from_slice(&wal_start.0.to_be_bytes());
    h[9..17].copy_from_slice(&wal_end.0.to_be_bytes());
    h[17..25].copy_from_slice(&send_time.to_be_bytes());
    h
}

/// The tag and the bytes after it.
fn split_tag(payload: Bytes) -> Result<(u8, Bytes), ReplicationError> {
    let mut r = Reader::new(payload);
    let tag = r.u8("tag").map_err(|_| ReplicationError::Empty)?;
    Ok((tag, r.rest()))
}

/// A reader of `body` (the payload after the tag) if it is exactly `want` bytes long.
fn fixed_len(
    tag: u8,
    body: Bytes,
    want: usize,
    expected: &'static str,
) -> Result<Reader, ReplicationError> {
    if body.len() == want {
        Ok(Reader::new(body))
    } else {
        Err(ReplicationError::BadLength {
            tag,
            len: body.len() + 1,
            expected,
        })
    }
}

impl ReplicationMessage {
    /// Appends the CopyData payload (not the CopyData frame) to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) {
        match self {
            ReplicationMessage::XLogData {
                wal_start,
                wal_end,
                send_time,
                data,
            } => {
                buf.put_slice(&xlog_data_header(*wal_start, *wal_end, *send_time));
                buf.put_slice(data);
            }
            ReplicationMessage::Keepalive {
                wal_end,
                send_time,
                reply_requested,
            } => {
                buf.put_u8(b'k');
                buf.put_u64(wal_end.0);
                buf.put_i64(*send_time);
                buf.put_u8(u8::from(*reply_requested));
            }
        }
    }

    /// Decodes a CopyData payload. XLogData's `data` shares `payload`'s memory.
    pub fn decode(payload: Bytes) -> Result<Self, ReplicationError> {
        let (tag, payload) = split_tag(payload)?;
        match tag {
            b'w' => {
                if payload.len() < 24 {
                    return Err(ReplicationError::BadLength {
                        tag,
                        len: payload.len() + 1,
                        expected: "at least 25",
                    });
                }
                let mut r = Reader::new(payload);
                Ok(ReplicationMessage::XLogData {
                    wal_start: r.lsn("wal_start")?,
                    wal_end: r.lsn("wal_end")?,
                    send_time: r.i64("send_time")?,
                    data: r.rest(),
                })
            }
            b'k' => {
                let mut r = fixed_len(tag, payload, 17, "18")?;
                Ok(ReplicationMessage::Keepalive {
                    wal_end: r.lsn("wal_end")?,
                    send_time: r.i64("send_time")?,
                    reply_requested: r.u8("reply_requested")? != 0,
                })
            }
            tag => Err(ReplicationError::UnknownTag { tag }),
        }
    }
}

impl StandbyMessage {
    /// Appends the CopyData payload to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) {
        match self {
            StandbyMessage::StatusUpdate {
                write,
                flush,
                apply,
                send_time,
                reply_requested,
            } => {
                buf.put_u8(b'r');
                buf.put_u64(write.0);
                buf.put_u64(flush.0);
                buf.put_u64(apply.0);
                buf.put_i64(*send_time);
                buf.put_u8(u8::from(*reply_requested));
            }
            StandbyMessage::HotStandbyFeedback {
                send_time,
                xmin,
                epoch,
                catalog_xmin,
                catalog_epoch,
            } => {
                buf.put_u8(b'h');
                buf.put_i64(*send_time);
                buf.put_u32(*xmin);
                buf.put_u32(*epoch);
                buf.put_u32(*catalog_xmin);
                buf.put_u32(*catalog_epoch);
            }
            StandbyMessage::NeonFeedback(b) => {
                buf.put_u8(b'z');
                buf.put_slice(b);
            }
        }
    }

    /// Decodes a CopyData payload.
    pub fn decode(payload: Bytes) -> Result<Self, ReplicationError> {
        let (tag, payload) = split_tag(payload)?;
        match tag {
            b'r' => {
                let mut r = fixed_len(tag, payload, 33, "34")?;
                Ok(StandbyMessage::StatusUpdate {
                    write: r.lsn("write")?,
                    flush: r.lsn("flush")?,
                    apply: r.lsn("apply")?,
                    send_time: r.i64("send_time")?,
                    reply_requested: r.u8("reply_requested")? != 0,
                })
            }
            b'h' => {
                let mut r = fixed_len(tag, payload, 24, "25")?;
                Ok(StandbyMessage::HotStandbyFeedback {
                    send_time: r.i64("send_time")?,
                    xmin: r.u32("xmin")?,
                    epoch: r.u32("epoch")?,
                    catalog_xmin: r.u32("catalog_xmin")?,
                    catalog_epoch: r.u32("catalog_epoch")?,
                })
            }
            b'z' => Ok(StandbyMessage::NeonFeedback(payload)),
            tag => Err(ReplicationError::UnknownTag { tag }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn round_trip_r(m: ReplicationMessage, bytes: &[u8]) {
        let mut b = BytesMut::new();
        m.encode(&mut b);
        assert_eq!(&b[..], bytes);
        assert_eq!(ReplicationMessage::decode(b.freeze()), Ok(m));
    }

    fn round_trip_s(m: StandbyMessage, bytes: &[u8]) {
        let mut b = BytesMut::new();
        m.encode(&mut b);
        assert_eq!(&b[..], bytes);
        assert_eq!(StandbyMessage::decode(b.freeze()), Ok(m));
    }

    #[test]
    fn xlog_data_fixture() {
        round_trip_r(
            ReplicationMessage::XLogData {
                wal_start: Lsn(0x0000_0001_0000_0000),
                wal_end: Lsn(0x0102),
                send_time: -1,
                data: Bytes::from_static(b"\xd1\x10"),
            },
            b"w\0\0\0\x01\0\0\0\0\0\0\0\0\0\0\x01\x02\xff\xff\xff\xff\xff\xff\xff\xff\xd1\x10",
        );
        // Empty data is valid.
        let h = xlog_data_header(Lsn(1), Lsn(2), 3);
        assert_eq!(
            ReplicationMessage::decode(Bytes::copy_from_slice(&h)),
            Ok(ReplicationMessage::XLogData {
                wal_start: Lsn(1),
                wal_end: Lsn(2),
                send_time: 3,
                data: Bytes::new()
            })
        );
    }

    #[test]
    fn keepalive_fixture() {
        round_trip_r(
            ReplicationMessage::Keepalive {
                wal_end: Lsn(0x0300_0000),
                send_time: 0x10,
                reply_requested: true,
            },
            b"k\0\0\0\0\x03\0\0\0\0\0\0\0\0\0\0\x10\x01",
        );
    }

    #[test]
    fn status_update_fixture() {
        round_trip_s(
            StandbyMessage::StatusUpdate {
                write: Lsn(1),
                flush: Lsn(2),
                apply: Lsn(3),
                send_time: 4,
                reply_requested: false,
            },
            b"r\0\0\0\0\0\0\0\x01\0\0\0\0\0\0\0\x02\0\0\0\0\0\0\0\x03\0\0\0\0\0\0\0\x04\0",
        );
    }

    #[test]
    fn hot_standby_feedback_fixture() {
        round_trip_s(
            StandbyMessage::HotStandbyFeedback {
                send_time: 1,
                xmin: 0x0203,
                epoch: 4,
                catalog_xmin: 5,
                catalog_epoch: 6,
            },
            b"h\0\0\0\0\0\0\0\x01\0\0\x02\x03\0\0\0\x04\0\0\0\x05\0\0\0\x06",
        );
        round_trip_s(
            StandbyMessage::NeonFeedback(Bytes::from_static(b"\0\x01")),
            b"z\0\x01",
        );
    }

    #[test]
    fn wrong_lengths_and_tags_are_errors() {
        assert_eq!(
            ReplicationMessage::decode(Bytes::new()),
            Err(ReplicationError::Empty)
        );
        assert!(matches!(
            ReplicationMessage::decode(Bytes::from_static(b"k\0\0")),
            Err(ReplicationError::BadLength {
                tag: b'k',
                len: 3,
                ..
            })
        ));
        assert!(matches!(
            ReplicationMessage::decode(Bytes::from_static(b"w\0")),
            Err(ReplicationError::BadLength { tag: b'w', .. })
        ));
        assert!(matches!(
            StandbyMessage::decode(Bytes::from_static(&[b'r'; 35])),
            Err(ReplicationError::BadLength {
                tag: b'r',
                len: 35,
                ..
            })
        ));
        assert_eq!(
            StandbyMessage::decode(Bytes::from_static(b"q")),
            Err(ReplicationError::UnknownTag { tag: b'q' })
        );
    }

    #[test]
    fn pg_timestamps_count_from_2000() {
        let y2000 = UNIX_EPOCH + Duration::from_secs(PG_EPOCH_UNIX_SECS);
        assert_eq!(to_pg_timestamp(y2000), 0);
        assert_eq!(
            to_pg_timestamp(y2000 + Duration::from_micros(1_500_001)),
            1_500_001
        );
        assert_eq!(to_pg_timestamp(UNIX_EPOCH), -946_684_800_000_000);
        for ts in [0, 1, -1, 789_000_000_123_456, -946_684_800_000_000] {
            assert_eq!(to_pg_timestamp(from_pg_timestamp(ts)), ts);
        }
    }

    proptest! {
        #[test]
        fn random_payloads_never_panic(data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = ReplicationMessage::decode(Bytes::from(data.clone()));
            let _ = StandbyMessage::decode(Bytes::from(data));
        }
    }
}
