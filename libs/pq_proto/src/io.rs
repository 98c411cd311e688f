//! Buffered frame reading and writing shared by [`crate::server`] and [`crate::client`].

use bytes::BytesMut;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::backend::{BackendMessage, decode_backend};
use crate::frontend::{FrontendMessage, decode_frontend};
use crate::{PqError, ProtocolError};

/// How much free room to keep in a read buffer before each read.
const READ_CHUNK: usize = 8192;

/// Reads until `decode` yields a message. `Ok(None)`: clean EOF at a message boundary.
///
/// Cancellation-safe: the only await is `read_buf`, which either appends bytes to `buf` or
/// does nothing; whatever arrived stays in `buf` for the next call.
pub(crate) async fn read_frame<R, T>(
    r: &mut R,
    buf: &mut BytesMut,
    max: usize,
    decode: impl Fn(&mut BytesMut, usize) -> Result<Option<T>, ProtocolError>,
) -> Result<Option<T>, PqError>
where
    R: AsyncRead + Unpin,
{
    loop {
        if let Some(m) = decode(buf, max)? {
            return Ok(Some(m));
        }
        if buf.capacity() - buf.len() < READ_CHUNK / 2 {
            buf.reserve(READ_CHUNK);
        }
        if r.read_buf(buf).await? == 0 {
            return if buf.is_empty() {
                Ok(None)
            } else {
                Err(PqError::ConnectionClosed)
            };
        }
    }
}

/// Reads the next frontend message (server side). `Ok(None)`: clean EOF between messages.
/// Cancellation-safe, as [`read_frame`].
pub(crate) async fn read_frontend<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
    max: usize,
) -> Result<Option<FrontendMessage>, PqError> {
    read_frame(r, buf, max, decode_frontend).await
}

/// Reads the next backend message (client side); EOF is [`PqError::ConnectionClosed`].
/// Cancellation-safe, as [`read_frame`].
pub(crate) async fn read_backend<R: AsyncRead + Unpin>(
    r: &mut R,
    buf: &mut BytesMut,
    max: usize,
) -> Result<BackendMessage, PqError> {
    read_frame(r, buf, max, decode_backend)
        .await?
        .ok_or(PqError::ConnectionClosed)
}

/// Writes all of `buf`, flushes, then shuts down the write direction (the peer sees EOF).
pub(crate) async fn shutdown_after_flush<W>(w: &mut W, buf: &mut BytesMut) -> Result<(), PqError>
where
    W: AsyncWrite + Unpin,
{
    flush_buf(w, buf).await?;
    w.shutdown().await?;
    Ok(())
}

/// Writes all of `buf` and flushes the stream.
///
/// Cancellation-safe: `write_all_buf` advances `buf` past what was written, so a later call
/// continues where a cancelled one stopped.
pub(crate) async fn flush_buf<W>(w: &mut W, buf: &mut BytesMut) -> Result<(), PqError>
where
    W: AsyncWrite + Unpin,
{
    if !buf.is_empty() {
        w.write_all_buf(buf).await?;
    }
    w.flush().await?;
    Ok(())
}
