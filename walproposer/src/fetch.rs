//! Fetching WAL from a safekeeper's walsender: a proposer recovering the donor's WAL after an
//! election (`START_REPLICATION ... (term='N')`, which serves durable but not yet committed WAL
//! while the safekeeper's term is still N).

use crate::conn::{ConnError, SafekeeperAddr};
use pq_proto::client::CopyEvent;
use pq_proto::replication::ReplicationMessage;
use sk_core::types::{Lsn, TenantTimelineId, Term};

/// Upper bound on one recovery fetch: a proposer keeps what it fetched in memory.
pub const MAX_FETCH_BYTES: u64 = 1 << 30;

/// Reads WAL `[from, to)` from `addr` in `term`. Fails if the safekeeper's term moved on or it
/// does not have the range.
pub async fn fetch_wal(
    addr: &SafekeeperAddr,
    ttid: TenantTimelineId,
    term: Term,
    from: Lsn,
    to: Lsn,
) -> Result<Vec<u8>, ConnError> {
    let len = to.checked_sub(from).unwrap_or(0);
    if len == 0 {
        return Ok(Vec::new());
    }
    if len > MAX_FETCH_BYTES {
        return Err(ConnError::Fetch(format!(
            "recovery of {len} bytes [{from}, {to}) exceeds the {MAX_FETCH_BYTES}-byte limit"
        )));
    }
    let conn = addr.connect(ttid, "wal_proposer_recovery").await?;
    let (mut reader, mut writer) = conn
        .start_copy_both(&format!(
            "START_REPLICATION PHYSICAL {from} (term='{}')",
            term.0
        ))
        .await?;
    let mut out = Vec::with_capacity(len as usize);
    let mut pos = from;
    while pos < to {
        let frame = match reader.read().await? {
            CopyEvent::Data(d) => d,
            CopyEvent::Done => return Err(ConnError::Closed),
        };
        match ReplicationMessage::decode(frame) {
            Ok(ReplicationMessage::XLogData {
                wal_start, data, ..
            }) => {
                if wal_start != pos {
                    return Err(ConnError::Fetch(format!(
                        "walsender sent WAL at {wal_start}, expected {pos}"
                    )));
                }
                let take = (to.0 - pos.0).min(data.len() as u64) as usize;
                out.extend_from_slice(&data[..take]);
                pos = Lsn(pos.0 + take as u64);
            }
            Ok(ReplicationMessage::Keepalive { .. }) => {}
            Err(e) => return Err(ConnError::Fetch(format!("invalid walsender message: {e}"))),
        }
    }
    let _ = writer.send_copy_done().await;
    Ok(out)
}
