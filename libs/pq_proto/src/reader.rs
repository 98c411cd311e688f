//! The one bounded big-endian reader every decoder of the workspace uses: the PostgreSQL message
//! bodies ([`crate::frontend`], [`crate::backend`]), the replication sub-protocol
//! ([`crate::replication`]) and neon's protocol v3 (`sk_core::protocol`).
//!
//! A [`Reader`] walks one complete frame that is already in memory. Every read is checked
//! against the bytes that remain and fails with a [`ReadError`] naming the field; nothing
//! panics on input bytes. Strings and counts are checked against a caller's limit *and* the
//! remaining bytes before anything is allocated for them, so a lying length can never make a
//! decoder allocate more than the frame it was given. Slices ([`Reader::bytes`],
//! [`Reader::rest`]) share the frame's memory.
//!
//! Not here: framing (how much of a socket's bytes make one frame: [`crate::framing`]) and what
//! the fields mean (each decoder maps a [`ReadError`] into its own error type).

use bytes::{Buf, Bytes};
use pg_wal::Lsn;

/// Why a read failed. `field` names what was being read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// The frame ends before the field does.
    #[error("message truncated: {field} needs {needed} bytes, {remaining} remain")]
    Truncated {
        /// What was being read.
        field: &'static str,
        /// Bytes the field needs.
        needed: usize,
        /// Bytes left in the frame.
        remaining: usize,
    },
    /// Bytes remain after the last field of a message.
    #[error("{0} trailing bytes after the message")]
    TrailingBytes(usize),
    /// A NUL-terminated string has no NUL within its limit (and the frame goes on).
    #[error("{field}: no NUL terminator within {max} bytes")]
    UnterminatedString {
        /// What was being read.
        field: &'static str,
        /// The longest string accepted, NUL excluded.
        max: usize,
    },
    /// A string is not UTF-8.
    #[error("{field}: not UTF-8")]
    InvalidUtf8 {
        /// What was being read.
        field: &'static str,
    },
    /// A count exceeds its limit, or more entries than the remaining bytes can hold.
    #[error("{field}: {count} entries exceed the limit of {max} (or the bytes that remain)")]
    TooMany {
        /// What was being counted.
        field: &'static str,
        /// The count read.
        count: u64,
        /// The caller's limit.
        max: usize,
    },
}

/// A checked big-endian cursor over one frame.
#[derive(Clone, Debug)]
pub struct Reader {
    buf: Bytes,
}

impl Reader {
    /// A reader of all of `frame`.
    pub fn new(frame: Bytes) -> Reader {
        Reader { buf: frame }
    }

    /// Bytes not read yet.
    pub fn remaining(&self) -> usize {
        self.buf.remaining()
    }

    /// Whether any byte is left.
    pub fn has_remaining(&self) -> bool {
        self.buf.has_remaining()
    }

    /// Checks that `needed` more bytes are there for `field`.
    pub fn need(&self, field: &'static str, needed: usize) -> Result<(), ReadError> {
        if self.buf.remaining() < needed {
            return Err(ReadError::Truncated {
                field,
                needed,
                remaining: self.buf.remaining(),
            });
        }
        Ok(())
    }

    /// One byte.
    pub fn u8(&mut self, field: &'static str) -> Result<u8, ReadError> {
        self.need(field, 1)?;
        Ok(self.buf.get_u8())
    }

    /// A big-endian `u16`.
    pub fn u16(&mut self, field: &'static str) -> Result<u16, ReadError> {
        self.need(field, 2)?;
        Ok(self.buf.get_u16())
    }

    /// A big-endian `i16`.
    pub fn i16(&mut self, field: &'static str) -> Result<i16, ReadError> {
        self.need(field, 2)?;
        Ok(self.buf.get_i16())
    }

    /// A big-endian `u32`.
    pub fn u32(&mut self, field: &'static str) -> Result<u32, ReadError> {
        self.need(field, 4)?;
        Ok(self.buf.get_u32())
    }

    /// A big-endian `i32`.
    pub fn i32(&mut self, field: &'static str) -> Result<i32, ReadError> {
        self.need(field, 4)?;
        Ok(self.buf.get_i32())
    }

    /// A big-endian `u64`.
    pub fn u64(&mut self, field: &'static str) -> Result<u64, ReadError> {
        self.need(field, 8)?;
        Ok(self.buf.get_u64())
    }

    /// A big-endian `i64`.
    pub fn i64(&mut self, field: &'static str) -> Result<i64, ReadError> {
        self.need(field, 8)?;
        Ok(self.buf.get_i64())
    }

    /// An LSN (a big-endian `u64`).
    pub fn lsn(&mut self, field: &'static str) -> Result<Lsn, ReadError> {
        self.u64(field).map(Lsn)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], ReadError> {
        self.need(field, N)?;
        let mut a = [0u8; N];
        self.buf.copy_to_slice(&mut a);
        Ok(a)
    }

    /// Zero-copy slice of the next `n` bytes.
    pub fn bytes(&mut self, field: &'static str, n: usize) -> Result<Bytes, ReadError> {
        self.need(field, n)?;
        Ok(self.buf.split_to(n))
    }

    /// Skips `n` bytes.
    pub fn skip(&mut self, field: &'static str, n: usize) -> Result<(), ReadError> {
        self.need(field, n)?;
        self.buf.advance(n);
        Ok(())
    }

    /// Zero-copy slice of everything left.
    pub fn rest(&mut self) -> Bytes {
        self.buf.split_off(0)
    }

    /// A NUL-terminated UTF-8 string of at most `max` bytes, NUL excluded. Without a NUL within
    /// `max + 1` bytes: [`ReadError::Truncated`] if the frame ends first, else
    /// [`ReadError::UnterminatedString`]. `usize::MAX` bounds the string by the frame only.
    pub fn cstr(&mut self, field: &'static str, max: usize) -> Result<String, ReadError> {
        let window = &self.buf[..self.buf.len().min(max.saturating_add(1))];
        let Some(nul) = window.iter().position(|&b| b == 0) else {
            if self.buf.len() <= max {
                return Err(ReadError::Truncated {
                    field,
                    needed: self.buf.len() + 1,
                    remaining: self.buf.len(),
                });
            }
            return Err(ReadError::UnterminatedString { field, max });
        };
        let s = std::str::from_utf8(&window[..nul])
            .map_err(|_| ReadError::InvalidUtf8 { field })?
            .to_owned();
        self.buf.advance(nul + 1);
        Ok(s)
    }

    /// A `u32` count of entries at least `min_entry_bytes` long each, checked against `max` and
    /// the bytes that remain, so a caller may allocate `count` entries.
    pub fn count(
        &mut self,
        field: &'static str,
        max: usize,
        min_entry_bytes: usize,
    ) -> Result<usize, ReadError> {
        let n = self.u32(field)?;
        let n_usize = n as usize;
        let fits = n_usize
            .checked_mul(min_entry_bytes)
            .is_some_and(|b| b <= self.buf.remaining());
        if n_usize > max || !fits {
            return Err(ReadError::TooMany {
                field,
                count: n as u64,
                max,
            });
        }
        Ok(n_usize)
    }

    /// Ends the frame: an error if bytes remain.
    pub fn finish(self) -> Result<(), ReadError> {
        if self.buf.has_remaining() {
            return Err(ReadError::TrailingBytes(self.buf.remaining()));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_are_big_endian_and_checked() {
        let mut r = Reader::new(Bytes::from_static(&[1, 2, 0, 0, 0, 3, 0xff, 9]));
        assert_eq!(r.u16("a"), Ok(0x0102));
        assert_eq!(r.u32("b"), Ok(3));
        assert_eq!(r.i16("c"), Ok(-247));
        assert_eq!(
            r.u8("d"),
            Err(ReadError::Truncated {
                field: "d",
                needed: 1,
                remaining: 0
            })
        );
        r.finish().expect("all read");
    }

    #[test]
    fn strings_are_bounded_by_the_limit_and_the_frame() {
        let mut r = Reader::new(Bytes::from_static(b"abc\0def"));
        assert_eq!(r.cstr("s", 3).as_deref(), Ok("abc"));
        assert!(matches!(
            r.clone().cstr("s", 10),
            Err(ReadError::Truncated { needed: 4, .. })
        ));
        assert_eq!(
            r.cstr("s", 2),
            Err(ReadError::UnterminatedString { field: "s", max: 2 })
        );
        let mut r = Reader::new(Bytes::from_static(b"\xff\0"));
        assert_eq!(r.cstr("s", 9), Err(ReadError::InvalidUtf8 { field: "s" }));
    }

    #[test]
    fn lying_counts_are_refused_before_allocating() {
        let mut r = Reader::new(Bytes::from_static(&[0xff, 0xff, 0xff, 0xff, 0, 0]));
        assert!(matches!(
            r.count("n", usize::MAX, 1),
            Err(ReadError::TooMany {
                count: 0xffff_ffff,
                ..
            })
        ));
        let mut r = Reader::new(Bytes::from_static(&[0, 0, 0, 2, 0, 0]));
        assert_eq!(r.count("n", 2, 1), Ok(2));
        let mut r = Reader::new(Bytes::from_static(&[0, 0, 0, 2, 0, 0]));
        assert!(r.count("n", 1, 1).is_err());
    }

    #[test]
    fn trailing_bytes_are_an_error() {
        assert_eq!(
            Reader::new(Bytes::from_static(b"xy")).finish(),
            Err(ReadError::TrailingBytes(2))
        );
    }
}
