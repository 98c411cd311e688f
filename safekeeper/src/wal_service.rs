//! The PostgreSQL-protocol listener: handshake, then replication commands, one task per
//! connection.
//!
//! The timeline comes from the startup `options` (`-c tenant_id=… timeline_id=…`, neon's
//! convention). A reader that names none is served the node's only timeline when there is
//! exactly one, so a plain `primary_conninfo` works against a single-timeline safekeeper.
//!
//! Each connection takes a slot of `--max-connections` (beyond it: FATAL 53300), runs on a
//! socket with the idle timeout ([`IdleTimeout`]: no byte in or out for `--pg-idle-timeout`
//! ends it, streaming included), and must finish its handshake within `--handshake-timeout`.

use std::sync::Arc;
use std::time::Duration;

use tokio::io::BufReader;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::auth::{AuthError, Claims, JwtAuth, Scope, check_permission};
use crate::command::{ReplicationCommand, parse_command, parse_options};
use crate::feedback::{ReaderInfo, RequiredReaders};
use crate::limits::{ConnectionLimit, HandshakePool, IdleTimeout, Socket};
use crate::metrics;
use crate::receive_wal::handle_wal_push;
use crate::registry::GlobalTimelines;
use crate::send_wal::{StreamEnd, handle_start_replication};
use crate::timeline::Timeline;
use crate::tls::TlsConfig;
use pq_proto::PqError;
use pq_proto::backend::FieldDescription;
use pq_proto::frontend::StartupParams;
use pq_proto::server::{ServerConfig, ServerConn};
use pq_proto::stream::MaybeTls;
use pq_proto::{ErrorFields, FrontendMessage, sqlstate};
use sk_core::types::TenantTimelineId;
use tokio_rustls::server::TlsStream;

/// How the listener serves connections: protocol settings and limits.
#[derive(Clone, Debug)]
pub struct WalServiceConf {
    /// The protocol server's settings (authentication, message size limits).
    pub server: ServerConfig,
    /// Most connections served at once; more are refused with SQLSTATE 53300.
    pub max_connections: usize,
    /// Most connections in their handshake at once (the oldest is closed beyond it).
    pub max_handshaking: usize,
    /// A connection on which no byte arrives (or none is accepted) for this long is closed,
    /// in every phase, streaming included.
    pub idle_timeout: Duration,
    /// Time a client has to finish the startup handshake.
    pub handshake_timeout: Duration,
    /// JWT keys: with them the password must be a token whose scope covers the timelines the
    /// connection touches. `None`: `server.password` or trust.
    pub auth: Option<Arc<JwtAuth>>,
    /// TLS (`--tls-cert`/`--tls-key`): when set, it is required: a client must send an
    /// SSLRequest first (`sslmode=require` or stronger); others are refused with 28000.
    pub tls: Option<Arc<TlsConfig>>,
    /// Readers whose lag slows the proposer (`--backpressure-readers`).
    pub backpressure_readers: RequiredReaders,
}

impl Default for WalServiceConf {
    fn default() -> Self {
        WalServiceConf {
            server: ServerConfig::default(),
            max_connections: 256,
            max_handshaking: 64,
            idle_timeout: Duration::from_secs(600),
            handshake_timeout: Duration::from_secs(10),
            auth: None,
            tls: None,
            backpressure_readers: RequiredReaders::default(),
        }
    }
}

/// Accepts connections until `shutdown` is cancelled; connection tasks are tracked by `tasks`
/// so the caller can wait for them to finish. A connection first waits in the handshake pool
/// (`conf.max_handshaking`, the oldest pushed out when full); once authenticated it takes a
/// slot of `conf.max_connections`, or is refused with PostgreSQL's "too many connections"
/// error. Sockets beyond both (and beyond the refusals in progress) are closed at once.
pub async fn run(
    listener: TcpListener,
    timelines: Arc<GlobalTimelines>,
    conf: WalServiceConf,
    shutdown: CancellationToken,
    tasks: TaskTracker,
) {
    let limit = Arc::new(ConnectionLimit::new(conf.max_connections));
    let pool = HandshakePool::new(conf.max_handshaking);
    let conf = Arc::new(conf);
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = shutdown.cancelled() => return,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!("accepting a connection: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = stream.set_nodelay(true);
        let handshaking = pool.enter();
        let timelines = timelines.clone();
        let conf = conf.clone();
        let shutdown = shutdown.clone();
        let limit = limit.clone();
        tasks.spawn(async move {
            let stream = IdleTimeout::new(Socket::new(stream), conf.idle_timeout);
            let admit = Admission {
                handshaking,
                limit: &limit,
            };
            match handle_connection(stream, peer, timelines, &conf, admit, shutdown).await {
                Ok(()) => metrics::PG_CONNECTIONS.with_label_values(&["ok"]).inc(),
                Err(e) => {
                    metrics::PG_CONNECTIONS.with_label_values(&["error"]).inc();
                    tracing::info!(%peer, "connection ended: {e}");
                }
            }
        });
    }
}

/// A connection's stream: the socket under the idle timeout, plain or TLS.
type ConnStream = MaybeTls<IdleTimeout<Socket>, Box<TlsStream<BufReader<IdleTimeout<Socket>>>>>;

/// Bytes read from the socket at once under TLS. rustls asks its transport for 4 KiB at a time
/// (one syscall per 4 KiB, three for an 8 KiB append); a buffer below it turns those into one
/// read of up to this much (what TLS costs ingest: README, "Security").
const TLS_READ_BUFFER: usize = 64 * 1024;

/// How a connection gets in: its place in the handshake pool, then a slot of the limit.
struct Admission<'a> {
    handshaking: crate::limits::HandshakeGuard,
    limit: &'a ConnectionLimit,
}

async fn handle_connection(
    stream: IdleTimeout<Socket>,
    peer: std::net::SocketAddr,
    timelines: Arc<GlobalTimelines>,
    conf: &WalServiceConf,
    admit: Admission<'_>,
    shutdown: CancellationToken,
) -> Result<(), PqError> {
    // Encryption, startup and authentication, all under the handshake timeout.
    // Authenticated, a connection takes its slot of --max-connections, or is refused in place
    // of AuthenticationOk as PostgreSQL refuses (the message libpq shows).
    let limit = admit.limit;
    let slot = || {
        limit.try_acquire().ok_or_else(|| {
            metrics::PG_CONNECTIONS
                .with_label_values(&["too_many"])
                .inc();
            ErrorFields::fatal(
                sqlstate::TOO_MANY_CONNECTIONS,
                format!(
                    "sorry, too many clients already (--max-connections {})",
                    conf.max_connections
                ),
            )
        })
    };
    let server = ServerConfig {
        version_for: Some(timeline_version(timelines.clone())),
        ..conf.server.clone()
    };
    let handshake = async {
        let mut conn = negotiate_tls(stream, conf, server).await?;
        let (params, claims, slot) = match &conf.auth {
            None => conn.handshake_then(slot).await.map(|(p, s)| (p, None, s))?,
            Some(auth) => conn
                .handshake_with_password_then(|params, pw| authenticate(auth, params, pw), slot)
                .await
                .map(|(p, claims, s)| (p, Some(claims), s))?,
        };
        Ok::<_, PqError>((conn, params, claims, slot))
    };
    let handshake = async {
        tokio::select! {
            r = handshake => Ok(r),
            _ = admit.handshaking.evicted().cancelled() => Err(()),
        }
    };
    let (mut conn, params, claims, _slot) =
        match tokio::time::timeout(conf.handshake_timeout, handshake).await {
            Ok(Ok(r)) => r?,
            Ok(Err(())) => {
                return Err(PqError::Io(std::io::Error::new(
                    std::io::ErrorKind::ConnectionAborted,
                    format!(
                        "closed during its startup handshake: newer connections filled the \
                         handshake pool (--max-handshaking-connections {})",
                        conf.max_handshaking
                    ),
                )));
            }
            Err(_) => {
                return Err(PqError::Io(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the startup handshake took longer than {:?} (--handshake-timeout)",
                        conf.handshake_timeout
                    ),
                )));
            }
        };
    drop(admit.handshaking);
    let appname = params.application_name().unwrap_or("").to_string();
    let options = match parse_options(params.get("options").unwrap_or("")) {
        Ok(o) => o,
        Err(e) => {
            conn.send_fatal(ErrorFields::fatal(
                sqlstate::INVALID_PARAMETER_VALUE,
                e.to_string(),
            ))
            .await?;
            return Ok(());
        }
    };
    let conn_ttid = match (options.tenant_id, options.timeline_id) {
        (Some(tenant_id), Some(timeline_id)) => Some(TenantTimelineId {
            tenant_id,
            timeline_id,
        }),
        (None, None) => None,
        _ => {
            conn.send_fatal(ErrorFields::fatal(
                sqlstate::INVALID_PARAMETER_VALUE,
                "options must name both tenant_id and timeline_id",
            ))
            .await?;
            return Ok(());
        }
    };

    loop {
        // The idle timeout is the stream's (IdleTimeout): a silent client ends with TimedOut.
        let msg = tokio::select! {
            m = conn.read_message() => m?,
            _ = shutdown.cancelled() => {
                conn.send_fatal(ErrorFields::fatal(sqlstate::ADMIN_SHUTDOWN, "the safekeeper is shutting down")).await?;
                return Ok(());
            }
        };
        let query = match msg {
            Some(FrontendMessage::Query(q)) => q,
            Some(FrontendMessage::Terminate) | None => return Ok(()),
            Some(other) => {
                conn.send_fatal(ErrorFields::fatal(
                    sqlstate::PROTOCOL_VIOLATION,
                    format!("unexpected message in query mode: {other:?}"),
                ))
                .await?;
                return Ok(());
            }
        };
        let cmd = match parse_command(&query) {
            Ok(c) => c,
            Err(e) => {
                conn.send_error(e.to_error_fields()).await?;
                continue;
            }
        };
        tracing::debug!(?cmd, %appname, "command");
        match cmd {
            ReplicationCommand::StartWalPush {
                proto_version,
                allow_timeline_creation,
            } => {
                return handle_wal_push(
                    conn,
                    timelines,
                    conn_ttid,
                    claims,
                    proto_version,
                    allow_timeline_creation,
                    shutdown,
                )
                .await;
            }
            ReplicationCommand::StartReplication {
                start_lsn, term, ..
            } => {
                let Some(tl) = resolve(&mut conn, &timelines, conn_ttid, claims.as_ref()).await?
                else {
                    continue;
                };
                let span = crate::timeline::span(&tl.ttid);
                let reader = ReaderInfo {
                    required: conf.backpressure_readers.includes(&appname),
                    application_name: appname.clone(),
                    client_addr: peer.to_string(),
                };
                match handle_start_replication(conn, tl, start_lsn, term, reader, shutdown.clone())
                    .instrument(span)
                    .await?
                {
                    StreamEnd::CopyDone(c) => conn = c,
                    StreamEnd::Closed => return Ok(()),
                }
            }
            ReplicationCommand::IdentifySystem => {
                let Some(tl) = resolve(&mut conn, &timelines, conn_ttid, claims.as_ref()).await?
                else {
                    continue;
                };
                let pos = tl.positions();
                // Proposers and peers recovering WAL see all durable WAL; readers see committed.
                let xlogpos =
                    if appname == "wal_proposer_recovery" || appname.starts_with("safekeeper") {
                        pos.flush_lsn
                    } else {
                        pos.commit_lsn
                    };
                conn.send_result_set(
                    &[
                        FieldDescription::text("systemid"),
                        FieldDescription::int4("timeline"),
                        FieldDescription::text("xlogpos"),
                        FieldDescription::text("dbname"),
                    ],
                    &[vec![
                        Some(tl.system_id().to_string()),
                        Some("1".to_string()),
                        Some(xlogpos.to_string()),
                        None,
                    ]],
                    "IDENTIFY_SYSTEM",
                )
                .await?;
            }
            ReplicationCommand::TimelineStatus => {
                let fields = [
                    FieldDescription::text("flush_lsn"),
                    FieldDescription::text("commit_lsn"),
                ];
                let evicted = conn_ttid.and_then(|t| timelines.get_evicted(&t));
                let rows: Vec<Vec<Option<String>>> = match conn_ttid.and_then(|t| timelines.get(&t))
                {
                    Some(tl) => {
                        let pos = tl.positions();
                        vec![vec![
                            Some(pos.flush_lsn.to_string()),
                            Some(pos.commit_lsn.to_string()),
                        ]]
                    }
                    // Evicted: its WAL ends at its commit LSN (no restore for a status).
                    None => evicted
                        .map(|e| {
                            vec![vec![
                                Some(e.end_lsn().to_string()),
                                Some(e.end_lsn().to_string()),
                            ]]
                        })
                        .unwrap_or_default(),
                };
                conn.send_result_set(&fields, &rows, "TIMELINE_STATUS")
                    .await?;
            }
            ReplicationCommand::Show(name) => {
                let value = match name.as_str() {
                    "data_directory_mode" => Some("0700".to_string()),
                    "wal_segment_size" => {
                        let Some(tl) =
                            resolve(&mut conn, &timelines, conn_ttid, claims.as_ref()).await?
                        else {
                            continue;
                        };
                        Some(format_seg_size(tl.seg_size))
                    }
                    _ => None,
                };
                match value {
                    Some(v) => {
                        conn.send_result_set(
                            &[FieldDescription::text(&name)],
                            &[vec![Some(v)]],
                            "SHOW",
                        )
                        .await?
                    }
                    None => {
                        conn.send_error(ErrorFields::error(
                            sqlstate::UNDEFINED_OBJECT,
                            format!("unrecognized configuration parameter \"{name}\""),
                        ))
                        .await?
                    }
                }
            }
            ReplicationCommand::ReadReplicationSlot(slot) => {
                let Some(tl) = resolve(&mut conn, &timelines, conn_ttid, claims.as_ref()).await?
                else {
                    continue;
                };
                // Slots are not kept here: every slot name maps to the oldest WAL we serve (from
                // remote storage too), so a reader with a slot starts where our WAL starts.
                tracing::debug!(%slot, "READ_REPLICATION_SLOT");
                conn.send_result_set(
                    &[
                        FieldDescription::text("slot_type"),
                        FieldDescription::text("restart_lsn"),
                        FieldDescription::int8("restart_tli"),
                    ],
                    &[vec![
                        Some("physical".to_string()),
                        Some(tl.oldest_servable_lsn().to_string()),
                        Some("1".to_string()),
                    ]],
                    "READ_REPLICATION_SLOT",
                )
                .await?;
            }
            ReplicationCommand::TimelineHistory(tli) => {
                conn.send_error(ErrorFields::error(
                    sqlstate::UNDEFINED_OBJECT,
                    format!("could not send timeline history {tli}: only timeline 1 exists here"),
                ))
                .await?;
            }
            ReplicationCommand::SetDatestyle => conn.send_command_complete("SET").await?,
        }
    }
}

/// The timeline a reader's command is about, or an error sent to it (`None`).
async fn resolve<S>(
    conn: &mut ServerConn<S>,
    timelines: &Arc<GlobalTimelines>,
    conn_ttid: Option<TenantTimelineId>,
    claims: Option<&Claims>,
) -> Result<Option<Arc<Timeline>>, PqError>
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    // The timeline named, or the node's only one (resident or evicted).
    let named = match conn_ttid {
        Some(ttid) => Ok(ttid),
        None => {
            let ids = timelines.ids();
            match ids.len() {
                1 => Ok(ids[0]),
                0 => Err("this safekeeper has no timelines yet".to_string()),
                n => Err(format!(
                    "this safekeeper has {n} timelines: name one with \
                     options='-c tenant_id=<hex> timeline_id=<hex>'"
                )),
            }
        }
    };
    // A tenant token reaches only its tenant's timelines (checked before an evicted one is
    // restored for it).
    if let (Ok(ttid), Some(claims)) = (&named, claims)
        && let Err(e) = check_permission(claims, Some(ttid.tenant_id))
    {
        conn.send_error(ErrorFields::error(
            sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
            e.to_string(),
        ))
        .await?;
        return Ok(None);
    }
    // An evicted timeline is restored for its reader.
    let found = match named {
        Ok(ttid) => match crate::evict::restore(timelines, &ttid).await {
            Ok(Some(tl)) => Ok(tl),
            Ok(None) => Err(format!("timeline {ttid} not found")),
            Err(e) => Err(e.to_string()),
        },
        Err(msg) => Err(msg),
    };
    match found {
        Ok(tl) => Ok(Some(tl)),
        Err(msg) => {
            conn.send_error(ErrorFields::error(sqlstate::UNDEFINED_OBJECT, msg))
                .await?;
            Ok(None)
        }
    }
}

/// With TLS configured: the client's SSLRequest is answered `S` and the TLS handshake run;
/// a client that does not ask (sslmode=disable) is refused with FATAL 28000. Without TLS the
/// stream stays plain (and an SSLRequest is answered `N` by the handshake).
async fn negotiate_tls(
    stream: IdleTimeout<Socket>,
    conf: &WalServiceConf,
    server: ServerConfig,
) -> Result<ServerConn<ConnStream>, PqError> {
    let mut conn = ServerConn::new(stream, server.clone());
    let Some(tls) = &conf.tls else {
        return Ok(conn.map_stream(MaybeTls::Plain));
    };
    if !conn.accept_ssl_request().await? {
        let e = ErrorFields::fatal(
            sqlstate::INVALID_AUTHORIZATION_SPECIFICATION,
            "this safekeeper requires TLS: connect with sslmode=require or verify-full",
        );
        conn.send_fatal(e.clone()).await?;
        return Err(PqError::Rejected(e));
    }
    let transport = BufReader::with_capacity(TLS_READ_BUFFER, conn.into_inner());
    let tls_stream = tls.acceptor().accept(transport).await?;
    Ok(ServerConn::new(MaybeTls::Tls(Box::new(tls_stream)), server))
}

/// The `server_version` a client is told: its timeline's PostgreSQL version (`17.10`), so a
/// reader of a PostgreSQL 17 timeline sees a PostgreSQL 17 server, as from the primary. A
/// connection naming no timeline is served the node's only one (as [`resolve`] does); one whose
/// timeline does not exist (yet), or that names none on a node of several, gets the default.
fn timeline_version(timelines: Arc<GlobalTimelines>) -> pq_proto::server::VersionFor {
    Arc::new(move |params| {
        let o = parse_options(params.get("options").unwrap_or("")).ok()?;
        let v = match (o.tenant_id, o.timeline_id) {
            (Some(tenant_id), Some(timeline_id)) => {
                let ttid = TenantTimelineId {
                    tenant_id,
                    timeline_id,
                };
                match timelines.get(&ttid) {
                    Some(tl) => tl.pg_version(),
                    None => timelines.get_evicted(&ttid)?.state.server.pg_version,
                }
            }
            _ => match timelines.ids().as_slice() {
                [only] => match timelines.get(only) {
                    Some(tl) => tl.pg_version(),
                    None => timelines.get_evicted(only)?.state.server.pg_version,
                },
                _ => return None,
            },
        };
        pg_wal::PgMajor::from_server_version(v).ok()?;
        Some(format!("{}.{} (mini-safekeeper)", v / 10000, v % 10000))
    })
}

/// Checks the password of a connection as a JWT: valid, and, when the startup options name a
/// tenant, granting it (each command checks the timeline it touches, too). Refusals are FATAL
/// 28000 with the reason.
fn authenticate(
    auth: &JwtAuth,
    params: &StartupParams,
    password: &[u8],
) -> Result<Claims, ErrorFields> {
    let denied = |e: AuthError| {
        ErrorFields::fatal(sqlstate::INVALID_AUTHORIZATION_SPECIFICATION, e.to_string())
    };
    let token = std::str::from_utf8(password).map_err(|_| {
        denied(AuthError::Unauthenticated(
            "invalid token: not UTF-8".into(),
        ))
    })?;
    let claims = auth.decode(token.trim()).map_err(denied)?;
    let tenant = parse_options(params.get("options").unwrap_or(""))
        .ok()
        .and_then(|o| o.tenant_id);
    if tenant.is_some() || claims.scope == Scope::Other {
        check_permission(&claims, tenant).map_err(denied)?;
    }
    Ok(claims)
}

/// `SHOW wal_segment_size` the way PostgreSQL prints it: `16MB`, `1GB`.
pub fn format_seg_size(bytes: u64) -> String {
    if bytes >= 1 << 30 && bytes.is_multiple_of(1 << 30) {
        format!("{}GB", bytes >> 30)
    } else {
        format!("{}MB", bytes >> 20)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_sizes_print_like_postgres() {
        assert_eq!(format_seg_size(16 << 20), "16MB");
        assert_eq!(format_seg_size(1 << 20), "1MB");
        assert_eq!(format_seg_size(1 << 30), "1GB");
    }
}
