//! Messages a server sends (backend → frontend): authentication requests, parameter status,
//! result sets, errors and notices, COPY responses and CopyData ([`BackendMessage`]).
//!
//! The server encodes them ([`BackendMessage::encode`], [`put_copy_data`] for a CopyData whose
//! payload comes in pieces); the client decodes them ([`decode_backend`]), following the
//! conventions of [`crate::framing`]. Every count in a body is checked against the bytes that
//! remain before anything is allocated for it.
//!
//! Not here: what the client sends ([`crate::frontend`]), the error types
//! ([`crate::error`]) and the replication messages inside CopyData ([`crate::replication`]).

use bytes::{Buf, BufMut, Bytes, BytesMut};

use crate::error::{ErrorFields, ProtocolError};
use crate::framing::{OrMalformed, get_cstr, put_cstr, typed, typed_frame_len};
use crate::reader::Reader;

/// Type OIDs used in RowDescription (PostgreSQL's `pg_type.oid`).
pub mod oid {
    /// `bool`.
    pub const BOOL: u32 = 16;
    /// `int8`.
    pub const INT8: u32 = 20;
    /// `int4`.
    pub const INT4: u32 = 23;
    /// `text`.
    pub const TEXT: u32 = 25;
}

/// Authentication request ('R') variants.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Authentication {
    /// code 0: authenticated.
    Ok,
    /// code 3: send the password in clear text.
    CleartextPassword,
    /// code 5: send an MD5 hash of the password with this salt.
    Md5Password {
        /// The 4-byte salt.
        salt: [u8; 4],
    },
    /// code 10: authenticate with one of these SASL mechanisms.
    Sasl {
        /// The offered mechanisms, e.g. `SCRAM-SHA-256`.
        mechanisms: Vec<String>,
    },
    /// code 11, with the SASL challenge.
    SaslContinue(Bytes),
    /// code 12, with the SASL outcome.
    SaslFinal(Bytes),
    /// Any other code (Kerberos, GSS, SSPI...), with its body.
    Other {
        /// The authentication code.
        code: i32,
        /// The rest of the message.
        body: Bytes,
    },
}

/// Transaction status in ReadyForQuery ('Z').
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TransactionStatus {
    /// 'I': not in a transaction block.
    Idle,
    /// 'T': in a transaction block.
    InTransaction,
    /// 'E': in a failed transaction block.
    Failed,
}

impl TransactionStatus {
    fn byte(self) -> u8 {
        match self {
            TransactionStatus::Idle => b'I',
            TransactionStatus::InTransaction => b'T',
            TransactionStatus::Failed => b'E',
        }
    }
}

/// One column of a RowDescription.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldDescription {
    /// Column name.
    pub name: String,
    /// OID of the table the column comes from, 0 if none.
    pub table_oid: u32,
    /// Attribute number of the column in that table, 0 if none.
    pub column_attr: i16,
    /// OID of the column's type (see [`oid`]).
    pub type_oid: u32,
    /// `pg_type.typlen`: the type's size, -1 for variable length.
    pub type_size: i16,
    /// `pg_attribute.atttypmod`, -1 for none.
    pub type_modifier: i32,
    /// 0 = text, 1 = binary.
    pub format: i16,
}

impl FieldDescription {
    /// A text-format column of type `type_oid` whose size is `type_size` (-1 = variable).
    pub fn new(name: &str, type_oid: u32, type_size: i16) -> Self {
        FieldDescription {
            name: name.to_string(),
            table_oid: 0,
            column_attr: 0,
            type_oid,
            type_size,
            type_modifier: -1,
            format: 0,
        }
    }

    /// A `text` column.
    pub fn text(name: &str) -> Self {
        Self::new(name, oid::TEXT, -1)
    }

    /// An `int4` column.
    pub fn int4(name: &str) -> Self {
        Self::new(name, oid::INT4, 4)
    }

    /// An `int8` column.
    pub fn int8(name: &str) -> Self {
        Self::new(name, oid::INT8, 8)
    }
}

/// The response to a COPY: 'G' CopyIn, 'H' CopyOut or 'W' CopyBoth.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyResponse {
    /// 0 = textual, 1 = binary.
    pub format: u8,
    /// The format of each column (0 = text, 1 = binary).
    pub column_formats: Vec<i16>,
}

impl CopyResponse {
    /// What a walsender sends: format 0, no columns.
    pub fn replication() -> Self {
        CopyResponse {
            format: 0,
            column_formats: Vec::new(),
        }
    }
}

/// Messages a server sends (encoded by the server, decoded by the client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendMessage {
    /// 'R': an authentication request (or its success).
    Authentication(Authentication),
    /// 'S': a run-time parameter's value.
    ParameterStatus {
        /// Parameter name.
        name: String,
        /// Its value.
        value: String,
    },
    /// 'K': what a CancelRequest for this connection must carry.
    BackendKeyData {
        /// The connection's process id.
        process_id: i32,
        /// The connection's secret key.
        secret_key: i32,
    },
    /// 'v': the newest minor version we support and the `_pq_.` options we did not recognize.
    NegotiateProtocolVersion {
        /// The newest 3.x minor version the server supports.
        newest_minor: i32,
        /// The protocol options it did not recognize.
        unrecognized: Vec<String>,
    },
    /// 'Z': ready for the next query.
    ReadyForQuery(TransactionStatus),
    /// 'T': the columns of the rows that follow.
    RowDescription(Vec<FieldDescription>),
    /// 'D': one value per column, `None` = SQL NULL.
    DataRow(Vec<Option<Bytes>>),
    /// 'C': the command tag, e.g. `SELECT 1`.
    CommandComplete(String),
    /// 'I': the query string was empty.
    EmptyQueryResponse,
    /// 'E': the command (or, if FATAL, the connection) failed.
    ErrorResponse(ErrorFields),
    /// 'N': a warning or notice; the command goes on.
    NoticeResponse(ErrorFields),
    /// 'G': the server is ready to receive COPY data.
    CopyInResponse(CopyResponse),
    /// 'H': the server starts sending COPY data.
    CopyOutResponse(CopyResponse),
    /// 'W': COPY data flows both ways (replication).
    CopyBothResponse(CopyResponse),
    /// 'd': a chunk of COPY data.
    CopyData(Bytes),
    /// 'c': the server's COPY data is complete.
    CopyDone,
}

impl BackendMessage {
    /// A DataRow from text values.
    pub fn data_row<S: AsRef<str>>(values: &[Option<S>]) -> Self {
        BackendMessage::DataRow(
            values
                .iter()
                .map(|v| {
                    v.as_ref()
                        .map(|s| Bytes::copy_from_slice(s.as_ref().as_bytes()))
                })
                .collect(),
        )
    }

    /// Appends the message's wire form to `buf`.
    pub fn encode(&self, buf: &mut BytesMut) {
        match self {
            BackendMessage::Authentication(a) => typed(buf, b'R', |b| match a {
                Authentication::Ok => b.put_i32(0),
                Authentication::CleartextPassword => b.put_i32(3),
                Authentication::Md5Password { salt } => {
                    b.put_i32(5);
                    b.put_slice(salt);
                }
                Authentication::Sasl { mechanisms } => {
                    b.put_i32(10);
                    for m in mechanisms {
                        put_cstr(b, m);
                    }
                    b.put_u8(0);
                }
                Authentication::SaslContinue(d) => {
                    b.put_i32(11);
                    b.put_slice(d);
                }
                Authentication::SaslFinal(d) => {
                    b.put_i32(12);
                    b.put_slice(d);
                }
                Authentication::Other { code, body } => {
                    b.put_i32(*code);
                    b.put_slice(body);
                }
            }),
            BackendMessage::ParameterStatus { name, value } => typed(buf, b'S', |b| {
                put_cstr(b, name);
                put_cstr(b, value);
            }),
            BackendMessage::BackendKeyData {
                process_id,
                secret_key,
            } => typed(buf, b'K', |b| {
                b.put_i32(*process_id);
                b.put_i32(*secret_key);
            }),
            BackendMessage::NegotiateProtocolVersion {
                newest_minor,
                unrecognized,
            } => typed(buf, b'v', |b| {
                b.put_i32(*newest_minor);
                b.put_i32(unrecognized.len() as i32);
                for o in unrecognized {
                    put_cstr(b, o);
                }
            }),
            BackendMessage::ReadyForQuery(s) => typed(buf, b'Z', |b| b.put_u8(s.byte())),
            BackendMessage::RowDescription(fields) => typed(buf, b'T', |b| {
                b.put_i16(fields.len() as i16);
                for f in fields {
                    put_cstr(b, &f.name);
                    b.put_u32(f.table_oid);
                    b.put_i16(f.column_attr);
                    b.put_u32(f.type_oid);
                    b.put_i16(f.type_size);
                    b.put_i32(f.type_modifier);
                    b.put_i16(f.format);
                }
            }),
            BackendMessage::DataRow(values) => typed(buf, b'D', |b| {
                b.put_i16(values.len() as i16);
                for v in values {
                    match v {
                        None => b.put_i32(-1),
                        Some(v) => {
                            b.put_i32(v.len() as i32);
                            b.put_slice(v);
                        }
                    }
                }
            }),
            BackendMessage::CommandComplete(tag) => typed(buf, b'C', |b| put_cstr(b, tag)),
            BackendMessage::EmptyQueryResponse => typed(buf, b'I', |_| {}),
            BackendMessage::ErrorResponse(e) => typed(buf, b'E', |b| put_error_fields(b, e)),
            BackendMessage::NoticeResponse(e) => typed(buf, b'N', |b| put_error_fields(b, e)),
            BackendMessage::CopyInResponse(c) => typed(buf, b'G', |b| put_copy_response(b, c)),
            BackendMessage::CopyOutResponse(c) => typed(buf, b'H', |b| put_copy_response(b, c)),
            BackendMessage::CopyBothResponse(c) => typed(buf, b'W', |b| put_copy_response(b, c)),
            BackendMessage::CopyData(d) => put_copy_data(buf, &[d]),
            BackendMessage::CopyDone => typed(buf, b'c', |_| {}),
        }
    }
}

/// Appends one CopyData message whose payload is the concatenation of `parts` (so a header and
/// a WAL slice need not be copied together first).
pub fn put_copy_data(buf: &mut BytesMut, parts: &[&[u8]]) {
    typed(buf, b'd', |b| {
        for p in parts {
            b.put_slice(p);
        }
    })
}

/// Decodes one backend message whose body is at most `max` bytes.
pub fn decode_backend(
    buf: &mut BytesMut,
    max: usize,
) -> Result<Option<BackendMessage>, ProtocolError> {
    let Some(body_len) = typed_frame_len(buf, max)? else {
        return Ok(None);
    };
    let tag = buf[0];
    if !matches!(
        tag,
        b'R' | b'S'
            | b'K'
            | b'v'
            | b'Z'
            | b'T'
            | b'D'
            | b'C'
            | b'I'
            | b'E'
            | b'N'
            | b'G'
            | b'H'
            | b'W'
            | b'd'
            | b'c'
    ) {
        return Err(ProtocolError::UnknownTag { tag });
    }
    buf.advance(5);
    let mut b = Reader::new(buf.split_to(body_len).freeze());
    let msg = match tag {
        b'R' => {
            let code = b.i32("Authentication").or_malformed("Authentication")?;
            let a = match code {
                0 => Authentication::Ok,
                3 => Authentication::CleartextPassword,
                5 => {
                    let m = "AuthenticationMD5Password";
                    if b.remaining() != 4 {
                        return Err(ProtocolError::malformed(m, "salt must be 4 bytes"));
                    }
                    Authentication::Md5Password {
                        salt: b.array(m).or_malformed(m)?,
                    }
                }
                10 => {
                    let mut mechanisms = Vec::new();
                    loop {
                        let m = get_cstr(&mut b, "AuthenticationSASL")?;
                        if m.is_empty() {
                            break;
                        }
                        mechanisms.push(m);
                    }
                    Authentication::Sasl { mechanisms }
                }
                11 => Authentication::SaslContinue(b.rest()),
                12 => Authentication::SaslFinal(b.rest()),
                code => Authentication::Other {
                    code,
                    body: b.rest(),
                },
            };
            BackendMessage::Authentication(a)
        }
        b'S' => BackendMessage::ParameterStatus {
            name: get_cstr(&mut b, "ParameterStatus")?,
            value: get_cstr(&mut b, "ParameterStatus")?,
        },
        b'K' => {
            let m = "BackendKeyData";
            BackendMessage::BackendKeyData {
                process_id: b.i32(m).or_malformed(m)?,
                secret_key: b.i32(m).or_malformed(m)?,
            }
        }
        b'v' => {
            let m = "NegotiateProtocolVersion";
            let newest_minor = b.i32(m).or_malformed(m)?;
            let n = b.i32(m).or_malformed(m)?;
            if n < 0 {
                return Err(ProtocolError::malformed(m, "negative count"));
            }
            let mut unrecognized = Vec::new();
            for _ in 0..n {
                unrecognized.push(get_cstr(&mut b, m)?);
            }
            BackendMessage::NegotiateProtocolVersion {
                newest_minor,
                unrecognized,
            }
        }
        b'Z' => {
            let m = "ReadyForQuery";
            let s = match b.u8(m).or_malformed(m)? {
                b'I' => TransactionStatus::Idle,
                b'T' => TransactionStatus::InTransaction,
                b'E' => TransactionStatus::Failed,
                _ => return Err(ProtocolError::malformed(m, "unknown transaction status")),
            };
            BackendMessage::ReadyForQuery(s)
        }
        b'T' => {
            let m = "RowDescription";
            let n = b.i16(m).or_malformed(m)?;
            if n < 0 {
                return Err(ProtocolError::malformed(m, "negative field count"));
            }
            // Each field takes at least 19 bytes: bound the count by the body before allocating.
            if n as usize * 19 > b.remaining() {
                return Err(ProtocolError::malformed(m, "field count exceeds message"));
            }
            let mut fields = Vec::with_capacity(n as usize);
            for _ in 0..n {
                fields.push(FieldDescription {
                    name: get_cstr(&mut b, m)?,
                    table_oid: b.u32(m).or_malformed(m)?,
                    column_attr: b.i16(m).or_malformed(m)?,
                    type_oid: b.u32(m).or_malformed(m)?,
                    type_size: b.i16(m).or_malformed(m)?,
                    type_modifier: b.i32(m).or_malformed(m)?,
                    format: b.i16(m).or_malformed(m)?,
                });
            }
            BackendMessage::RowDescription(fields)
        }
        b'D' => {
            let m = "DataRow";
            let n = b.i16(m).or_malformed(m)?;
            if n < 0 {
                return Err(ProtocolError::malformed(m, "negative column count"));
            }
            // Each value takes at least its 4-byte length.
            if n as usize * 4 > b.remaining() {
                return Err(ProtocolError::malformed(m, "column count exceeds message"));
            }
            let mut values = Vec::with_capacity(n as usize);
            for _ in 0..n {
                let len = b.i32(m).or_malformed(m)?;
                if len == -1 {
                    values.push(None);
                } else if len < 0 || len as usize > b.remaining() {
                    return Err(ProtocolError::malformed(m, "value length out of range"));
                } else {
                    values.push(Some(b.bytes(m, len as usize).or_malformed(m)?));
                }
            }
            BackendMessage::DataRow(values)
        }
        b'C' => BackendMessage::CommandComplete(get_cstr(&mut b, "CommandComplete")?),
        b'I' => BackendMessage::EmptyQueryResponse,
        b'E' => BackendMessage::ErrorResponse(get_error_fields(&mut b, "ErrorResponse")?),
        b'N' => BackendMessage::NoticeResponse(get_error_fields(&mut b, "NoticeResponse")?),
        b'G' => BackendMessage::CopyInResponse(get_copy_response(&mut b)?),
        b'H' => BackendMessage::CopyOutResponse(get_copy_response(&mut b)?),
        b'W' => BackendMessage::CopyBothResponse(get_copy_response(&mut b)?),
        b'd' => BackendMessage::CopyData(b.rest()),
        b'c' => BackendMessage::CopyDone,
        _ => unreachable!("tag filtered above"),
    };
    Ok(Some(msg))
}

// ------------------------------------------------------------------------------------------------
// helpers

fn put_error_fields(b: &mut BytesMut, e: &ErrorFields) {
    for (t, v) in [
        (b'S', Some(&e.severity)),
        (b'V', Some(&e.severity)),
        (b'C', Some(&e.code)),
        (b'M', Some(&e.message)),
        (b'D', e.detail.as_ref()),
        (b'H', e.hint.as_ref()),
    ] {
        if let Some(v) = v {
            b.put_u8(t);
            put_cstr(b, v);
        }
    }
    b.put_u8(0);
}

fn put_copy_response(b: &mut BytesMut, c: &CopyResponse) {
    b.put_u8(c.format);
    b.put_i16(c.column_formats.len() as i16);
    for f in &c.column_formats {
        b.put_i16(*f);
    }
}

fn get_copy_response(b: &mut Reader) -> Result<CopyResponse, ProtocolError> {
    let m = "CopyResponse";
    let format = b.u8(m).or_malformed(m)?;
    let n = b.i16(m).or_malformed(m)?;
    if n < 0 || n as usize * 2 != b.remaining() {
        return Err(ProtocolError::malformed(
            m,
            "column count does not match length",
        ));
    }
    let mut column_formats = Vec::with_capacity(n as usize);
    for _ in 0..n {
        column_formats.push(b.i16(m).or_malformed(m)?);
    }
    Ok(CopyResponse {
        format,
        column_formats,
    })
}

fn get_error_fields(b: &mut Reader, m: &'static str) -> Result<ErrorFields, ProtocolError> {
    let mut e = ErrorFields::new("", "", "");
    let mut s = None;
    let mut v = None;
    loop {
        let t = b.u8(m).or_malformed(m)?;
        if t == 0 {
            break;
        }
        let val = get_cstr(b, m)?;
        match t {
            b'S' => s = Some(val),
            b'V' => v = Some(val),
            b'C' => e.code = val,
            b'M' => e.message = val,
            b'D' => e.detail = Some(val),
            b'H' => e.hint = Some(val),
            _ => {}
        }
    }
    // V is never localized; prefer it.
    e.severity = v.or(s).unwrap_or_default();
    Ok(e)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn enc_b(m: &BackendMessage) -> Vec<u8> {
        let mut b = BytesMut::new();
        m.encode(&mut b);
        b.to_vec()
    }

    /// Checks `bytes` encodes `m`, decodes back to `m`, and that every strict prefix is "need more".
    fn backend_fixture(m: BackendMessage, bytes: &[u8]) {
        assert_eq!(enc_b(&m), bytes, "encoding of {m:?}");
        for cut in 0..bytes.len() {
            let mut buf = BytesMut::from(&bytes[..cut]);
            assert_eq!(
                decode_backend(&mut buf, 1000),
                Ok(None),
                "prefix {cut} of {m:?}"
            );
            assert_eq!(buf.len(), cut, "a partial frame is not consumed");
        }
        let mut buf = BytesMut::from(bytes);
        buf.extend_from_slice(b"Z\0\0\0\x05I");
        assert_eq!(decode_backend(&mut buf, 1000), Ok(Some(m)));
        assert_eq!(&buf[..], b"Z\0\0\0\x05I", "exactly one frame consumed");
    }

    #[test]
    fn authentication_fixtures() {
        backend_fixture(
            BackendMessage::Authentication(Authentication::Ok),
            b"R\0\0\0\x08\0\0\0\0",
        );
        backend_fixture(
            BackendMessage::Authentication(Authentication::CleartextPassword),
            b"R\0\0\0\x08\0\0\0\x03",
        );
        backend_fixture(
            BackendMessage::Authentication(Authentication::Md5Password { salt: *b"abcd" }),
            b"R\0\0\0\x0c\0\0\0\x05abcd",
        );
        backend_fixture(
            BackendMessage::Authentication(Authentication::Sasl {
                mechanisms: vec!["SCRAM-SHA-256".into()],
            }),
            b"R\0\0\0\x17\0\0\0\x0aSCRAM-SHA-256\0\0",
        );
    }

    #[test]
    fn startup_reply_fixtures() {
        backend_fixture(
            BackendMessage::ParameterStatus {
                name: "integer_datetimes".into(),
                value: "on".into(),
            },
            b"S\0\0\0\x19integer_datetimes\0on\0",
        );
        backend_fixture(
            BackendMessage::BackendKeyData {
                process_id: 0x0102_0304,
                secret_key: -2,
            },
            b"K\0\0\0\x0c\x01\x02\x03\x04\xff\xff\xff\xfe",
        );
        backend_fixture(
            BackendMessage::ReadyForQuery(TransactionStatus::Idle),
            b"Z\0\0\0\x05I",
        );
        backend_fixture(
            BackendMessage::NegotiateProtocolVersion {
                newest_minor: 0,
                unrecognized: vec!["_pq_.x".into()],
            },
            b"v\0\0\0\x13\0\0\0\0\0\0\0\x01_pq_.x\0",
        );
    }

    #[test]
    fn result_set_fixtures() {
        // RowDescription: 2 fields; "a" text, "tli" int4.
        let mut t = b"T\0\0\0\x30\0\x02".to_vec();
        t.extend_from_slice(b"a\0\0\0\0\0\0\0\0\0\0\x19\xff\xff\xff\xff\xff\xff\0\0");
        t.extend_from_slice(b"tli\0\0\0\0\0\0\0\0\0\0\x17\0\x04\xff\xff\xff\xff\0\0");
        backend_fixture(
            BackendMessage::RowDescription(vec![
                FieldDescription::text("a"),
                FieldDescription::int4("tli"),
            ]),
            &t,
        );
        // DataRow: "0/0", NULL.
        backend_fixture(
            BackendMessage::data_row(&[Some("0/0"), None]),
            b"D\0\0\0\x11\0\x02\0\0\0\x030/0\xff\xff\xff\xff",
        );
        backend_fixture(
            BackendMessage::CommandComplete("SELECT 1".into()),
            b"C\0\0\0\x0dSELECT 1\0",
        );
        backend_fixture(BackendMessage::EmptyQueryResponse, b"I\0\0\0\x04");
    }

    #[test]
    fn error_and_notice_fixtures() {
        let e = ErrorFields::error("42601", "bad");
        backend_fixture(
            BackendMessage::ErrorResponse(e.clone()),
            b"E\0\0\0\x1fSERROR\0VERROR\0C42601\0Mbad\0\0",
        );
        backend_fixture(
            BackendMessage::NoticeResponse(e.with_detail("d").with_hint("h")),
            b"N\0\0\0\x25SERROR\0VERROR\0C42601\0Mbad\0Dd\0Hh\0\0",
        );
        // A localized S without V, and unknown fields, still decode.
        let mut b = BytesMut::from(&b"E\0\0\0\x1cSFEHLER\0C28000\0Mx\0Fa.c\0\0"[..]);
        let Ok(Some(BackendMessage::ErrorResponse(e))) = decode_backend(&mut b, 100) else {
            panic!("error response must decode");
        };
        assert_eq!(
            (e.severity.as_str(), e.code.as_str(), e.message.as_str()),
            ("FEHLER", "28000", "x")
        );
    }

    #[test]
    fn copy_fixtures() {
        backend_fixture(
            BackendMessage::CopyBothResponse(CopyResponse::replication()),
            b"W\0\0\0\x07\0\0\0",
        );
        backend_fixture(
            BackendMessage::CopyOutResponse(CopyResponse {
                format: 0,
                column_formats: vec![0, 1],
            }),
            b"H\0\0\0\x0b\0\0\x02\0\0\0\x01",
        );
        backend_fixture(
            BackendMessage::CopyInResponse(CopyResponse::replication()),
            b"G\0\0\0\x07\0\0\0",
        );
        backend_fixture(
            BackendMessage::CopyData(Bytes::from_static(b"wx")),
            b"d\0\0\0\x06wx",
        );
        backend_fixture(BackendMessage::CopyDone, b"c\0\0\0\x04");
        let mut b = BytesMut::new();
        put_copy_data(&mut b, &[b"ab", b"", b"c"]);
        assert_eq!(&b[..], b"d\0\0\0\x07abc");
    }

    #[test]
    fn backend_decoders_reject_lying_counts() {
        // DataRow claiming 1000 columns in a 2-byte body.
        assert!(matches!(
            decode_backend(&mut BytesMut::from(&b"D\0\0\0\x06\x03\xe8"[..]), 100),
            Err(ProtocolError::Malformed { .. })
        ));
        // DataRow value longer than the message.
        assert!(matches!(
            decode_backend(
                &mut BytesMut::from(&b"D\0\0\0\x0a\0\x01\0\0\0\x09"[..]),
                100
            ),
            Err(ProtocolError::Malformed { .. })
        ));
        // RowDescription claiming many fields.
        assert!(matches!(
            decode_backend(&mut BytesMut::from(&b"T\0\0\0\x06\x7f\xff"[..]), 100),
            Err(ProtocolError::Malformed { .. })
        ));
        assert!(matches!(
            decode_backend(&mut BytesMut::from(&b"Z\0\0\0\x05Q"[..]), 100),
            Err(ProtocolError::Malformed { .. })
        ));
    }
}
