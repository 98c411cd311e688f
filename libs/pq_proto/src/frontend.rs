//! Messages a client sends (frontend → backend): the untyped startup-phase packets
//! ([`StartupPacket`]: SSLRequest, GSSENCRequest, CancelRequest, StartupMessage) and the typed
//! messages of the simple query and COPY subset ([`FrontendMessage`]).
//!
//! The server decodes them ([`decode_startup`], [`decode_frontend`]); the client encodes them
//! ([`StartupPacket::encode`], [`FrontendMessage::encode`]). Decoders follow the conventions of
//! [`crate::framing`]: `Ok(None)` means "read more", an error means "close the connection".
//! Messages of the extended query protocol are recognized only to be refused by name.
//!
//! Not here: what the server sends ([`crate::backend`]), sockets ([`crate::server`],
//! [`crate::client`]) and what a query's text means (the safekeeper's command parser).

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::error::ProtocolError;
use crate::framing::{
    OrMalformed, expect_end, get_cstr, patch_len, put_cstr, typed, typed_frame_len,
};
use crate::reader::Reader;

/// Limit on a startup packet, the same as PostgreSQL's `MAX_STARTUP_PACKET_LENGTH`.
pub const MAX_STARTUP_PACKET_LENGTH: usize = 10_000;

/// StartupMessage protocol version 3.0.
pub const PROTOCOL_VERSION_3_0: u32 = 196_608;
/// Magic "protocol version" of an SSLRequest.
pub const SSL_REQUEST_CODE: u32 = 80_877_103;
/// Magic "protocol version" of a GSSENCRequest.
pub const GSSENC_REQUEST_CODE: u32 = 80_877_104;
/// Magic "protocol version" of a CancelRequest.
pub const CANCEL_REQUEST_CODE: u32 = 80_877_102;

/// Parameters of a StartupMessage, in the order the client sent them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StartupParams(pub Vec<(String, String)>);

impl StartupParams {
    /// The value of the first parameter called `name`.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    /// The `user` parameter (PostgreSQL requires it).
    pub fn user(&self) -> Option<&str> {
        self.get("user")
    }

    /// The `application_name` parameter.
    pub fn application_name(&self) -> Option<&str> {
        self.get("application_name")
    }

    /// The raw `options` parameter (the safekeeper parses neon's options from it).
    pub fn options(&self) -> Option<&str> {
        self.get("options")
    }
}

/// The untyped packets a client may send first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StartupPacket {
    /// Asks for TLS; we answer `N` (no).
    SslRequest,
    /// Asks for GSSAPI encryption; we answer `N` (no).
    GssEncRequest,
    /// Asks to cancel the query running in another connection.
    CancelRequest {
        /// The target backend's process id (from its BackendKeyData).
        process_id: i32,
        /// The target backend's secret key (from its BackendKeyData).
        secret_key: i32,
    },
    /// A StartupMessage.
    Startup {
        /// The requested 3.x minor version.
        minor_version: u16,
        /// The parameters, in the order sent.
        params: StartupParams,
    },
}

/// Typed messages a client sends after startup (the simple query and COPY subset).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrontendMessage {
    /// 'Q': one or more SQL/replication commands.
    Query(String),
    /// 'd': a chunk of COPY data.
    CopyData(Bytes),
    /// 'c': the client's COPY data is complete.
    CopyDone,
    /// 'f': the client aborts a COPY, with a reason.
    CopyFail(String),
    /// 'X': the client closes the connection.
    Terminate,
    /// 'p': a password (or, for other auth methods, a response); the trailing NUL is removed.
    Password(Bytes),
}

/// Decodes one untyped startup-phase packet (SSLRequest, GSSENCRequest, CancelRequest,
/// StartupMessage). Packets are limited to [`MAX_STARTUP_PACKET_LENGTH`].
pub fn decode_startup(buf: &mut BytesMut) -> Result<Option<StartupPacket>, ProtocolError> {
    if buf.len() < 4 {
        return Ok(None);
    }
    let len = i32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if len < 8 {
        return Err(ProtocolError::BadLength(len.into()));
    }
    let len = len as usize;
    if len > MAX_STARTUP_PACKET_LENGTH {
        return Err(ProtocolError::TooLarge {
            len,
            max: MAX_STARTUP_PACKET_LENGTH,
        });
    }
    if buf.len() < len {
        buf.reserve(len - buf.len());
        return Ok(None);
    }
    let m = "StartupMessage";
    let mut pkt = Reader::new(buf.split_to(len).freeze());
    pkt.skip(m, 4).or_malformed(m)?;
    let code = pkt.u32(m).or_malformed(m)?;
    match code {
        SSL_REQUEST_CODE | GSSENC_REQUEST_CODE => {
            if pkt.has_remaining() {
                return Err(ProtocolError::malformed("SSLRequest", "trailing bytes"));
            }
            Ok(Some(if code == SSL_REQUEST_CODE {
                StartupPacket::SslRequest
            } else {
                StartupPacket::GssEncRequest
            }))
        }
        CANCEL_REQUEST_CODE => {
            let m = "CancelRequest";
            if pkt.remaining() != 8 {
                return Err(ProtocolError::malformed(m, "length must be 16"));
            }
            Ok(Some(StartupPacket::CancelRequest {
                process_id: pkt.i32(m).or_malformed(m)?,
                secret_key: pkt.i32(m).or_malformed(m)?,
            }))
        }
        _ => {
            let major = (code >> 16) as u16;
            let minor = (code & 0xffff) as u16;
            if major != 3 {
                return Err(ProtocolError::UnsupportedProtocolVersion { major, minor });
            }
            let mut params = Vec::new();
            loop {
                let key = get_cstr(&mut pkt, m)?;
                if key.is_empty() {
                    break;
                }
                let value = get_cstr(&mut pkt, m)?;
                params.push((key, value));
            }
            if pkt.has_remaining() {
                return Err(ProtocolError::malformed(m, "bytes after the terminator"));
            }
            Ok(Some(StartupPacket::Startup {
                minor_version: minor,
                params: StartupParams(params),
            }))
        }
    }
}

/// Decodes one typed frontend message whose body is at most `max` bytes.
pub fn decode_frontend(
    buf: &mut BytesMut,
    max: usize,
) -> Result<Option<FrontendMessage>, ProtocolError> {
    let Some(body_len) = typed_frame_len(buf, max)? else {
        return Ok(None);
    };
    let tag = buf[0];
    let unsupported = |name| Err(ProtocolError::UnsupportedMessage { tag, name });
    // Refuse unknown tags before copying anything out.
    match tag {
        b'Q' | b'd' | b'c' | b'f' | b'X' | b'p' => {}
        b'S' => return unsupported("Sync"),
        b'H' => return unsupported("Flush"),
        b'P' => return unsupported("Parse"),
        b'B' => return unsupported("Bind"),
        b'E' => return unsupported("Execute"),
        b'D' => return unsupported("Describe"),
        b'C' => return unsupported("Close"),
        b'F' => return unsupported("FunctionCall"),
        _ => return Err(ProtocolError::UnknownTag { tag }),
    }
    buf.advance(5);
    let mut body = buf.split_to(body_len).freeze();
    let mut r = Reader::new(body.clone());
    let msg = match tag {
        b'Q' => {
            let q = get_cstr(&mut r, "Query")?;
            expect_end(r, "Query")?;
            FrontendMessage::Query(q)
        }
        b'd' => FrontendMessage::CopyData(body),
        b'c' => {
            expect_end(r, "CopyDone")?;
            FrontendMessage::CopyDone
        }
        b'f' => {
            let reason = get_cstr(&mut r, "CopyFail")?;
            expect_end(r, "CopyFail")?;
            FrontendMessage::CopyFail(reason)
        }
        b'X' => {
            expect_end(r, "Terminate")?;
            FrontendMessage::Terminate
        }
        b'p' => {
            // A cleartext password is a C string; tolerate a missing terminator.
            if body.last() == Some(&0) {
                body.truncate(body.len() - 1);
            }
            FrontendMessage::Password(body)
        }
        _ => unreachable!("tag filtered above"),
    };
    Ok(Some(msg))
}

impl StartupPacket {
    /// Appends the packet's wire form to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) {
        let start = buf.len();
        buf.put_i32(0); // length, patched below
        match self {
            StartupPacket::SslRequest => buf.put_u32(SSL_REQUEST_CODE),
            StartupPacket::GssEncRequest => buf.put_u32(GSSENC_REQUEST_CODE),
            StartupPacket::CancelRequest {
                process_id,
                secret_key,
            } => {
                buf.put_u32(CANCEL_REQUEST_CODE);
                buf.put_i32(*process_id);
                buf.put_i32(*secret_key);
            }
            StartupPacket::Startup {
                minor_version,
                params,
            } => {
                buf.put_u32(PROTOCOL_VERSION_3_0 | u32::from(*minor_version));
                for (k, v) in &params.0 {
                    put_cstr(buf, k);
                    put_cstr(buf, v);
                }
                buf.put_u8(0);
            }
        }
        patch_len(buf, start, start);
    }
}

impl FrontendMessage {
    /// Appends the message's wire form to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) {
        match self {
            FrontendMessage::Query(q) => typed(buf, b'Q', |b| put_cstr(b, q)),
            FrontendMessage::CopyData(d) => typed(buf, b'd', |b| b.put_slice(d)),
            FrontendMessage::CopyDone => typed(buf, b'c', |_| {}),
            FrontendMessage::CopyFail(r) => typed(buf, b'f', |b| put_cstr(b, r)),
            FrontendMessage::Terminate => typed(buf, b'X', |_| {}),
            FrontendMessage::Password(p) => typed(buf, b'p', |b| {
                b.put_slice(p);
                b.put_u8(0);
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn enc_f(m: &FrontendMessage) -> Vec<u8> {
        let mut b = BytesMut::new();
        m.encode(&mut b);
        b.to_vec()
    }

    fn frontend_fixture(m: FrontendMessage, bytes: &[u8]) {
        assert_eq!(enc_f(&m), bytes, "encoding of {m:?}");
        for cut in 0..bytes.len() {
            let mut buf = BytesMut::from(&bytes[..cut]);
            assert_eq!(decode_frontend(&mut buf, 1000), Ok(None));
        }
        let mut buf = BytesMut::from(bytes);
        assert_eq!(decode_frontend(&mut buf, 1000), Ok(Some(m)));
        assert!(buf.is_empty());
    }

    #[test]
    fn ssl_gss_and_cancel_requests_fixture() {
        let ssl = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x2f];
        let gss = [0, 0, 0, 8, 0x04, 0xd2, 0x16, 0x30];
        let cancel = [0, 0, 0, 16, 0x04, 0xd2, 0x16, 0x2e, 0, 0, 0, 7, 0, 0, 0, 9];
        for (pkt, bytes) in [
            (StartupPacket::SslRequest, &ssl[..]),
            (StartupPacket::GssEncRequest, &gss[..]),
            (
                StartupPacket::CancelRequest {
                    process_id: 7,
                    secret_key: 9,
                },
                &cancel[..],
            ),
        ] {
            let mut b = BytesMut::new();
            pkt.encode(&mut b);
            assert_eq!(&b[..], bytes);
            for cut in 0..bytes.len() {
                assert_eq!(decode_startup(&mut BytesMut::from(&bytes[..cut])), Ok(None));
            }
            assert_eq!(decode_startup(&mut b), Ok(Some(pkt)));
        }
    }

    #[test]
    fn startup_message_fixture() {
        let mut bytes = vec![0, 0, 0, 0, 0, 3, 0, 0];
        bytes.extend_from_slice(b"user\0postgres\0replication\0true\0\0");
        let n = bytes.len() as u8;
        bytes[3] = n;
        let pkt = StartupPacket::Startup {
            minor_version: 0,
            params: StartupParams(vec![
                ("user".into(), "postgres".into()),
                ("replication".into(), "true".into()),
            ]),
        };
        let mut b = BytesMut::new();
        pkt.encode(&mut b);
        assert_eq!(&b[..], &bytes[..]);
        let got = decode_startup(&mut b).unwrap().unwrap();
        assert_eq!(got, pkt);
        let StartupPacket::Startup { params, .. } = got else {
            unreachable!()
        };
        assert_eq!(params.user(), Some("postgres"));
        assert_eq!(params.get("replication"), Some("true"));
        assert_eq!(params.options(), None);
    }

    #[test]
    fn startup_rejects_protocol_2_bad_and_huge_lengths() {
        let v2 = [0, 0, 0, 9, 0, 2, 0, 0, 0];
        assert_eq!(
            decode_startup(&mut BytesMut::from(&v2[..])),
            Err(ProtocolError::UnsupportedProtocolVersion { major: 2, minor: 0 })
        );
        assert_eq!(
            decode_startup(&mut BytesMut::from(&[0, 0, 0, 3][..])),
            Err(ProtocolError::BadLength(3))
        );
        assert!(matches!(
            decode_startup(&mut BytesMut::from(&[0x7f, 0xff, 0xff, 0xff][..])),
            Err(ProtocolError::TooLarge { .. })
        ));
        // Missing the final terminator.
        let mut bad = vec![0, 0, 0, 0, 0, 3, 0, 0];
        bad.extend_from_slice(b"user\0x\0");
        bad[3] = bad.len() as u8;
        assert!(matches!(
            decode_startup(&mut BytesMut::from(&bad[..])),
            Err(ProtocolError::Malformed { .. })
        ));
    }

    #[test]
    fn frontend_message_fixtures() {
        frontend_fixture(
            FrontendMessage::Query("IDENTIFY_SYSTEM".into()),
            b"Q\0\0\0\x14IDENTIFY_SYSTEM\0",
        );
        frontend_fixture(
            FrontendMessage::CopyData(Bytes::from_static(b"abc")),
            b"d\0\0\0\x07abc",
        );
        frontend_fixture(FrontendMessage::CopyDone, b"c\0\0\0\x04");
        frontend_fixture(FrontendMessage::CopyFail("no".into()), b"f\0\0\0\x07no\0");
        frontend_fixture(FrontendMessage::Terminate, b"X\0\0\0\x04");
        frontend_fixture(
            FrontendMessage::Password(Bytes::from_static(b"secret")),
            b"p\0\0\0\x0bsecret\0",
        );
    }

    #[test]
    fn extended_protocol_messages_are_unsupported() {
        for (tag, name) in [
            (b'S', "Sync"),
            (b'H', "Flush"),
            (b'P', "Parse"),
            (b'B', "Bind"),
        ] {
            let mut b = BytesMut::from(&[tag, 0, 0, 0, 4][..]);
            assert_eq!(
                decode_frontend(&mut b, 100),
                Err(ProtocolError::UnsupportedMessage { tag, name })
            );
        }
        let e = ProtocolError::UnsupportedMessage {
            tag: b'P',
            name: "Parse",
        };
        assert!(e.to_string().contains("Parse"));
        assert_eq!(
            decode_frontend(&mut BytesMut::from(&b"?\0\0\0\x04"[..]), 100),
            Err(ProtocolError::UnknownTag { tag: b'?' })
        );
    }

    proptest! {
        #[test]
        fn query_round_trips(q in "[^\u{0}]{0,64}") {
            let m = FrontendMessage::Query(q);
            let mut b = BytesMut::new();
            m.encode(&mut b);
            prop_assert_eq!(decode_frontend(&mut b, 1024), Ok(Some(m)));
        }
    }
}
