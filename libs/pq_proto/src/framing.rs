//! Framing shared by both directions: the typed frame header (1-byte tag, big-endian `i32`
//! length that counts itself), the bound on a frame's body, and the encoding helpers the message
//! encoders share.
//!
//! Decoders take a [`BytesMut`] that holds whatever has arrived so far and return
//! - `Ok(Some(msg))`: one whole message, consumed from the buffer;
//! - `Ok(None)`: the message is not complete yet, read more bytes (the buffer is untouched
//!   but may have grown its capacity for the frame);
//! - `Err(_)`: the bytes are invalid, close the connection (the buffer state is then
//!   unspecified).
//!
//! A length prefix is checked against a limit before anything is allocated for it, and only
//! then is the buffer grown to hold the frame.
//!
//! Not here: the messages of each direction ([`crate::frontend`], [`crate::backend`]) and
//! reading a body's fields ([`crate::reader`]).

use bytes::{BufMut, BytesMut};

use crate::error::ProtocolError;
use crate::reader::{ReadError, Reader};

/// Default limit on one message's body (the bytes after the 5-byte tag+length header): 1 MiB
/// plus room for message headers. An AppendRequest carries at most 128 KiB of WAL.
pub const DEFAULT_MAX_MESSAGE_SIZE: usize = (1 << 20) + 1024;

/// Reads a frame header (tag + length) from the start of `buf`. Returns the body length if the
/// whole frame (tag, length, body) is in `buf`; `Ok(None)` otherwise, after reserving room for it.
pub(crate) fn typed_frame_len(
    buf: &mut BytesMut,
    max: usize,
) -> Result<Option<usize>, ProtocolError> {
    if buf.len() < 5 {
        return Ok(None);
    }
    let len = i32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]);
    if len < 4 {
        return Err(ProtocolError::BadLength(len.into()));
    }
    let body = (len - 4) as usize;
    if body > max {
        return Err(ProtocolError::TooLarge { len: body, max });
    }
    let total = 5 + body;
    if buf.len() < total {
        // The length is bounded by `max` above, so this reservation is bounded too.
        buf.reserve(total - buf.len());
        return Ok(None);
    }
    Ok(Some(body))
}

/// Writes a typed message: tag, length placeholder, body, then patches the length.
pub(crate) fn typed(buf: &mut BytesMut, tag: u8, body: impl FnOnce(&mut BytesMut)) {
    buf.put_u8(tag);
    let len_at = buf.len();
    buf.put_i32(0);
    body(buf);
    patch_len(buf, len_at, len_at);
}

/// Writes `buf.len() - from` as a BE i32 at `at`.
pub(crate) fn patch_len(buf: &mut BytesMut, at: usize, from: usize) {
    let len = i32::try_from(buf.len() - from).expect("encoded messages are far below 2 GiB");
    buf[at..at + 4].copy_from_slice(&len.to_be_bytes());
}

/// Writes `s` and its NUL terminator.
pub(crate) fn put_cstr(buf: &mut BytesMut, s: &str) {
    buf.put_slice(s.as_bytes());
    buf.put_u8(0);
}

/// A failed read of a message body is a malformed message.
pub(crate) trait OrMalformed<T> {
    /// The value, or [`ProtocolError::Malformed`] of message `m`.
    fn or_malformed(self, m: &'static str) -> Result<T, ProtocolError>;
}

impl<T> OrMalformed<T> for Result<T, ReadError> {
    fn or_malformed(self, m: &'static str) -> Result<T, ProtocolError> {
        self.map_err(|e| ProtocolError::from_read(m, e))
    }
}

/// A NUL-terminated UTF-8 string of message `m`'s body, bounded by the body only.
pub(crate) fn get_cstr(r: &mut Reader, m: &'static str) -> Result<String, ProtocolError> {
    r.cstr(m, usize::MAX).map_err(|e| match e {
        ReadError::Truncated { .. } => ProtocolError::malformed(m, "missing string terminator"),
        e => ProtocolError::from_read(m, e),
    })
}

/// Ends message `m`'s body: an error if bytes remain.
pub(crate) fn expect_end(r: Reader, m: &'static str) -> Result<(), ProtocolError> {
    r.finish().or_malformed(m)
}

#[cfg(test)]
mod tests {
    use bytes::BufMut;
    use proptest::prelude::*;

    use super::*;
    use crate::backend::decode_backend;
    use crate::frontend::{decode_frontend, decode_startup};

    #[test]
    fn oversized_and_negative_lengths_are_rejected_before_buffering() {
        let mut b = BytesMut::from(&b"d\x00\x10\x00\x05"[..]);
        let cap = b.capacity();
        assert_eq!(
            decode_frontend(&mut b, 1 << 20),
            Err(ProtocolError::TooLarge {
                len: (1 << 20) + 1,
                max: 1 << 20
            })
        );
        assert_eq!(b.capacity(), cap, "nothing reserved for a rejected frame");
        assert_eq!(
            decode_backend(&mut BytesMut::from(&b"d\xff\xff\xff\xff"[..]), 100),
            Err(ProtocolError::BadLength(-1))
        );
        assert_eq!(
            decode_backend(&mut BytesMut::from(&b"d\0\0\0\x03"[..]), 100),
            Err(ProtocolError::BadLength(3))
        );
        // Exactly at the limit is fine.
        let mut b = BytesMut::from(&b"d\0\0\0\x0e"[..]);
        b.extend_from_slice(&[1; 10]);
        assert!(matches!(decode_frontend(&mut b, 10), Ok(Some(_))));
    }

    proptest! {
        #[test]
        fn random_bytes_never_panic_decoders(data in proptest::collection::vec(any::<u8>(), 0..512)) {
            let mut b = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = decode_startup(&mut b) {}
            let mut b = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = decode_frontend(&mut b, 256) {}
            let mut b = BytesMut::from(&data[..]);
            while let Ok(Some(_)) = decode_backend(&mut b, 256) {}
        }

        #[test]
        fn random_bodies_with_valid_tags_never_panic(
            tag in proptest::sample::select(b"RSKvZTDCIENGHWdcQfXp".to_vec()),
            body in proptest::collection::vec(any::<u8>(), 0..128),
        ) {
            let mut b = BytesMut::new();
            b.put_u8(tag);
            b.put_i32(body.len() as i32 + 4);
            b.put_slice(&body);
            let _ = decode_backend(&mut b.clone(), 256);
            let _ = decode_frontend(&mut b, 256);
        }

        #[test]
        fn oversized_length_prefix_is_rejected_without_allocating(
            tag in any::<u8>(),
            len in (1_000_005i64..=i32::MAX as i64),
        ) {
            let mut b = BytesMut::with_capacity(8);
            b.put_u8(tag);
            b.put_i32(len as i32);
            let cap = b.capacity();
            let r = decode_frontend(&mut b, 1_000_000);
            prop_assert!(r.is_err());
            prop_assert_eq!(b.capacity(), cap);
            let r = decode_backend(&mut b, 1_000_000);
            prop_assert!(r.is_err());
            prop_assert_eq!(b.capacity(), cap);
            let mut s = BytesMut::with_capacity(8);
            s.put_i32(len as i32);
            let cap = s.capacity();
            prop_assert!(decode_startup(&mut s).is_err());
            prop_assert_eq!(s.capacity(), cap);
        }
    }
}
