//! The HTTP API: status, Prometheus metrics, and the profiling routes.
//!
//! [`app`] builds the whole router over an [`AppState`] (axum's state pattern: the daemon builds
//! the state, the router only reads it), so tests can call it without a socket.
//!
//! [`serve`] runs it over HTTP or HTTPS.
//!
//! Not here: binding, and when to stop ([`crate::daemon`]).

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use axum::body::Bytes;
use axum::error_handling::HandleErrorLayer;
use axum::extract::rejection::RawPathParamsRejection;
use axum::extract::{Extension, Path, Query, RawPathParams, Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post, put};
use axum::{Json, Router};
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::{Deserialize, Serialize};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::limit::GlobalConcurrencyLimitLayer;
use tower::load_shed::LoadShedLayer;
use tower::{BoxError, ServiceBuilder};

use crate::auth::{AuthError, Claims, JwtAuth, Scope, check_permission};
use crate::config::Conf;
use crate::manager::DeleteScope;
use crate::pull::PullError;
use crate::registry::{CreateTimeline, GlobalTimelines};
use crate::timeline::{Timeline, TimelineError, TimelineStatus};
use crate::tls::TlsConfig;
use sk_core::safekeeper::SafeKeeperError;
use sk_core::state::{Configuration, ServerInfo};
use sk_core::types::{TenantId, TenantTimelineId};

/// The one error type of our handlers: 4xx with the reason for caller mistakes, 500 with a
/// generic body (details in the log) for ours.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// 400: the caller's mistake, with the reason.
    #[error("{0}")]
    BadRequest(String),
    /// 401: no token, or one that is not valid.
    #[error("{0}")]
    Unauthorized(String),
    /// 403: a valid token that does not grant this.
    #[error("{0}")]
    Forbidden(String),
    /// 404: no such object.
    #[error("{0}")]
    NotFound(String),
    /// 409: the request conflicts with the object's state (a membership that is not newer, a
    /// timeline that exists already).
    #[error("{0}")]
    Conflict(String),
    /// 503: a dependency (remote storage) failed; retry later.
    #[error("{0}")]
    Unavailable(String),
    /// 500: our fault; the details go to the log, not to the caller.
    #[error("internal error: {0}")]
    Internal(Box<dyn std::error::Error + Send + Sync>),
}

impl From<TimelineError> for ApiError {
    fn from(e: TimelineError) -> ApiError {
        match e {
            TimelineError::NotFound(ttid) => {
                ApiError::NotFound(format!("timeline {ttid} not found"))
            }
            TimelineError::BadSegmentSize(_)
            | TimelineError::UnsupportedVersion(_)
            | TimelineError::BadRequest(_) => ApiError::BadRequest(e.to_string()),
            TimelineError::Deleted(_) => ApiError::NotFound(e.to_string()),
            TimelineError::RestoreFailed { .. } => ApiError::Unavailable(e.to_string()),
            TimelineError::Exists(_)
            | TimelineError::Evicted(_)
            | TimelineError::BeingDeleted(_)
            | TimelineError::NotAMember { .. } => ApiError::Conflict(e.to_string()),
            TimelineError::Storage(_) | TimelineError::Acceptor { .. } => {
                ApiError::Internal(e.into())
            }
        }
    }
}

impl From<AuthError> for ApiError {
    fn from(e: AuthError) -> ApiError {
        match e {
            AuthError::Unauthenticated(m) => ApiError::Unauthorized(m),
            AuthError::Forbidden(m) => ApiError::Forbidden(m),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        match self {
            ApiError::Unauthorized(m) => (
                StatusCode::UNAUTHORIZED,
                [(header::WWW_AUTHENTICATE, "Bearer")],
                format!("{m}\n"),
            )
                .into_response(),
            ApiError::Forbidden(m) => (StatusCode::FORBIDDEN, format!("{m}\n")).into_response(),
            ApiError::BadRequest(m) => (StatusCode::BAD_REQUEST, format!("{m}\n")).into_response(),
            ApiError::NotFound(m) => (StatusCode::NOT_FOUND, format!("{m}\n")).into_response(),
            ApiError::Conflict(m) => (StatusCode::CONFLICT, format!("{m}\n")).into_response(),
            ApiError::Unavailable(m) => {
                (StatusCode::SERVICE_UNAVAILABLE, format!("{m}\n")).into_response()
            }
            ApiError::Internal(e) => {
                tracing::error!("HTTP request failed: {e}");
                (
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal error (details in the server log)\n",
                )
                    .into_response()
            }
        }
    }
}

/// What the handlers read: built once by the daemon, shared by every request.
pub struct AppState {
    /// The daemon's configuration.
    pub conf: Conf,
    /// When the daemon started (for the uptime).
    pub started: Instant,
    /// The same moment on the wall clock (for `started_at_unix`).
    pub started_at: SystemTime,
    /// The node's timelines.
    pub timelines: Arc<GlobalTimelines>,
    /// JWT keys (`--auth-public-key-path`); `None`: no authentication (loopback only).
    pub auth: Option<Arc<JwtAuth>>,
    /// How this node reaches its peers (`--peer-auth-token-path`, `--peer-ca`).
    pub peer: crate::peer::PeerClient,
    /// The port the PostgreSQL protocol is served on.
    pub pg_port: u16,
}

/// The safekeeper's HTTP router: the data routes and the observability routes, each class
/// with its own concurrent-request limit (`--http-max-concurrent-requests`; excess gets 503)
/// and its authentication.
///
/// A new route goes into the class it belongs to, and being mounted there is all it takes:
/// - [`data_routes`]: anything that reveals or changes timeline state. With
///   `--auth-public-key-path` every request needs `Authorization: Bearer <JWT>`: a route whose
///   path has a `{tenant_id}` parameter accepts scope `safekeeperdata` or a `tenant` token of
///   that tenant; any other needs `safekeeperdata`. Handlers may read the verified claims as
///   `Option<Extension<auth::Claims>>`.
/// - [`ops_routes`]: status, metrics, profiles; open unless `--auth-ops-routes` (then the same
///   check as data routes).
pub fn app(state: Arc<AppState>) -> Router {
    let max = state.conf.http_max_concurrent_requests;
    let auth = state.auth.clone();
    let data = limited(data_routes(&state).with_state(state.clone()), max, "data");
    let data = with_auth(data, auth.clone());
    let ops_auth = if state.conf.auth_ops_routes {
        auth
    } else {
        None
    };
    let ops = ops_routes().with_state(state).merge(profiling::router());
    let ops = with_auth(limited(ops, max, "status, metrics and profile"), ops_auth);
    data.merge(ops)
}

/// Requires a token on every route of `router` when `auth` is set ([`require_token`]). Applied
/// outside the class limit: a request without a valid token takes no slot.
fn with_auth(router: Router, auth: Option<Arc<JwtAuth>>) -> Router {
    match auth {
        Some(auth) => router.route_layer(middleware::from_fn_with_state(auth, require_token)),
        None => router,
    }
}

/// The authentication of a route class: a valid bearer token (401 otherwise) whose scope
/// covers the route's `tenant_id` path parameter, or the whole safekeeper when the route has
/// none (403 otherwise). The claims go into the request's extensions.
async fn require_token(
    State(auth): State<Arc<JwtAuth>>,
    params: Result<RawPathParams, RawPathParamsRejection>,
    mut req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let token = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| {
            v.strip_prefix("Bearer ")
                .or_else(|| v.strip_prefix("bearer "))
        })
        .ok_or_else(|| ApiError::Unauthorized("missing Authorization: Bearer <token>".into()))?;
    let claims = auth.decode(token.trim())?;
    let tenant = match params
        .as_ref()
        .ok()
        .and_then(|p| p.iter().find(|(k, _)| *k == "tenant_id"))
    {
        Some((_, v)) => Some(
            v.parse::<TenantId>()
                .map_err(|e| ApiError::BadRequest(e.to_string()))?,
        ),
        None => None,
    };
    check_permission(&claims, tenant)?;
    req.extensions_mut().insert(claims);
    Ok(next.run(req).await)
}

/// The data routes: timeline state (and, in the test build, the test hooks).
pub fn data_routes(state: &AppState) -> Router<Arc<AppState>> {
    let router = Router::new()
        .route("/v1/timelines", get(timelines))
        .route("/v1/tenant/timeline", get(list_timelines))
        .route("/v1/tenant/{tenant_id}", delete(delete_tenant))
        .route("/v1/tenant/{tenant_id}/timeline", post(create_timeline))
        .route(
            "/v1/tenant/{tenant_id}/timeline/{timeline_id}",
            get(timeline_status).delete(delete_timeline),
        )
        .route(
            "/v1/tenant/{tenant_id}/timeline/{timeline_id}/membership",
            put(set_membership),
        )
        .route(
            "/v1/tenant/{tenant_id}/timeline/{timeline_id}/snapshot",
            get(snapshot),
        )
        .route("/v1/pull_timeline", post(pull_timeline));
    // Only the `safekeeper-testing` binary mounts these (`Conf::test_hooks`); the real binary
    // answers 404 even when built with the feature.
    #[cfg(feature = "testing")]
    let router = if state.conf.test_hooks {
        router.merge(testing::routes())
    } else {
        router
    };
    #[cfg(not(feature = "testing"))]
    let _ = state;
    router
}

/// The observability routes: status and metrics (the profiling crate's routes join them in
/// [`app`]).
pub fn ops_routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/status", get(status))
        .route("/metrics", get(metrics))
}

/// Applies a route class's concurrent-request limit to every route of `router`: one
/// semaphore shared by the class (tower's global concurrency limit); a request beyond it is
/// shed at once with 503 instead of queueing.
fn limited(router: Router, max: usize, class: &'static str) -> Router {
    router.route_layer(
        ServiceBuilder::new()
            .layer(HandleErrorLayer::new(move |_: BoxError| async move {
                (
                    StatusCode::SERVICE_UNAVAILABLE,
                    format!(
                        "too many {class} requests in progress (--http-max-concurrent-requests); \
                         retry later\n"
                    ),
                )
            }))
            .layer(LoadShedLayer::new())
            .layer(GlobalConcurrencyLimitLayer::new(max)),
    )
}

/// Serves `app` on `listener` until `cancel`. Plain HTTP goes through `axum::serve`; with
/// `tls`, HTTPS: each connection's TLS handshake runs on its own task within
/// `handshake_timeout` (the current certificate of a reloadable [`TlsConfig`]), then hyper's
/// HTTP/1.1 with the same limit on reading a request's headers. On `cancel` connections finish
/// their requests (graceful shutdown).
pub async fn serve(
    listener: TcpListener,
    app: Router,
    tls: Option<Arc<TlsConfig>>,
    handshake_timeout: Duration,
    cancel: CancellationToken,
) -> std::io::Result<()> {
    let Some(tls) = tls else {
        return axum::serve(listener, app)
            .with_graceful_shutdown(async move { cancel.cancelled().await })
            .await;
    };
    let tasks = TaskTracker::new();
    loop {
        let (stream, peer) = tokio::select! {
            a = listener.accept() => match a {
                Ok(a) => a,
                Err(e) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!("accepting an HTTPS connection: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
            _ = cancel.cancelled() => break,
        };
        let _ = stream.set_nodelay(true);
        let acceptor = tls.acceptor();
        let app = app.clone();
        let cancel = cancel.clone();
        tasks.spawn(async move {
            let stream =
                match tokio::time::timeout(handshake_timeout, acceptor.accept(stream)).await {
                    Ok(Ok(s)) => s,
                    Ok(Err(e)) => {
                        tracing::debug!(%peer, "TLS handshake failed: {e}");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                };
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(handshake_timeout)
                .serve_connection(TokioIo::new(stream), TowerToHyperService::new(app));
            let mut conn = std::pin::pin!(conn);
            let result = tokio::select! {
                r = conn.as_mut() => r,
                _ = cancel.cancelled() => {
                    conn.as_mut().graceful_shutdown();
                    conn.await
                }
            };
            if let Err(e) = result {
                tracing::debug!(%peer, "HTTPS connection: {e}");
            }
        });
    }
    tasks.close();
    let _ = tokio::time::timeout(Duration::from_secs(4), tasks.wait()).await;
    Ok(())
}

#[derive(Serialize)]
struct Status {
    id: u64,
    version: &'static str,
    uptime_seconds: f64,
    started_at_unix: u64,
    datadir: String,
    /// The PostgreSQL port (peers recovering from this node connect to it).
    pg_port: u16,
}

async fn status(State(state): State<Arc<AppState>>) -> Json<Status> {
    Json(Status {
        id: state.timelines.node_id().0,
        version: env!("CARGO_PKG_VERSION"),
        uptime_seconds: state.started.elapsed().as_secs_f64(),
        started_at_unix: state
            .started_at
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0),
        datadir: std::path::absolute(&state.conf.datadir)
            .unwrap_or_else(|_| state.conf.datadir.clone())
            .display()
            .to_string(),
        pg_port: state.pg_port,
    })
}

async fn timelines(State(state): State<Arc<AppState>>) -> Json<Vec<TimelineStatus>> {
    let tls = &state.timelines;
    let mut all: Vec<TimelineStatus> = tls.all().iter().map(|t| t.status()).collect();
    all.extend(tls.all_evicted().iter().map(|e| evicted_status(tls, e)));
    all.sort_by_key(|s| (s.tenant_id, s.timeline_id));
    Json(all)
}

/// The status of an evicted timeline of this node.
fn evicted_status(
    tls: &crate::registry::GlobalTimelines,
    e: &crate::evicted::EvictedTimeline,
) -> TimelineStatus {
    TimelineStatus::of_evicted(e, tls.node_id(), tls.remote_location(&e.ttid))
}

/// One timeline of [`list_timelines`].
#[derive(serde::Serialize)]
struct TimelineIds {
    tenant_id: String,
    timeline_id: String,
}

/// `GET /v1/tenant/timeline` (as neon's): every timeline's ids and nothing else, without
/// touching any timeline's state (`/v1/timelines` gives each one's whole status).
async fn list_timelines(State(state): State<Arc<AppState>>) -> Json<Vec<TimelineIds>> {
    Json(
        state
            .timelines
            .ids()
            .into_iter()
            .map(|t| TimelineIds {
                tenant_id: t.tenant_id.to_string(),
                timeline_id: t.timeline_id.to_string(),
            })
            .collect(),
    )
}

/// The timeline id of a route's path parameters (400 when malformed).
fn parse_ttid(tenant_id: &str, timeline_id: &str) -> Result<TenantTimelineId, ApiError> {
    let bad = |e: sk_core::types::IdParseError| ApiError::BadRequest(e.to_string());
    Ok(TenantTimelineId {
        tenant_id: tenant_id.parse().map_err(bad)?,
        timeline_id: timeline_id.parse().map_err(bad)?,
    })
}

/// The timeline of a route's path parameters (400 when malformed, 404 when absent).
fn find_timeline(
    state: &AppState,
    tenant_id: &str,
    timeline_id: &str,
) -> Result<Arc<Timeline>, ApiError> {
    let ttid = parse_ttid(tenant_id, timeline_id)?;
    Ok(state
        .timelines
        .get(&ttid)
        .ok_or(TimelineError::NotFound(ttid))?)
}

/// The timeline of a route's path parameters, restored first if it is evicted (400 when
/// malformed, 404 when absent, 503 when the restore failed).
async fn find_or_restore(
    state: &AppState,
    tenant_id: &str,
    timeline_id: &str,
) -> Result<Arc<Timeline>, ApiError> {
    let ttid = parse_ttid(tenant_id, timeline_id)?;
    Ok(crate::evict::restore(&state.timelines, &ttid)
        .await?
        .ok_or(TimelineError::NotFound(ttid))?)
}

/// The operator routes (membership, create, delete, pull) change which nodes serve a timeline:
/// with authentication on they need scope `safekeeperdata`; a `tenant` token is refused (403)
/// even for its own tenant.
fn require_admin(claims: &Option<Extension<Claims>>) -> Result<(), ApiError> {
    match claims {
        Some(Extension(c)) if c.scope != Scope::SafekeeperData => Err(ApiError::Forbidden(
            "this operator route needs a token of scope safekeeperdata".into(),
        )),
        _ => Ok(()),
    }
}

/// A JSON request body as `T`, or 400 with serde's reason.
fn parse_body<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::BadRequest(format!("invalid request body: {e}")))
}

/// Runs blocking work (fsyncs) off the async workers.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    crate::blocking::spawn(f)
        .await
        .map_err(|e| ApiError::Internal(e.into()))
}

async fn timeline_status(
    State(state): State<Arc<AppState>>,
    Path((tenant_id, timeline_id)): Path<(String, String)>,
) -> Result<Json<TimelineStatus>, ApiError> {
    let ttid = parse_ttid(&tenant_id, &timeline_id)?;
    if let Some(e) = state.timelines.get_evicted(&ttid) {
        // Its status is its control file's: no restore.
        return Ok(Json(evicted_status(&state.timelines, &e)));
    }
    Ok(Json(
        find_timeline(&state, &tenant_id, &timeline_id)?.status(),
    ))
}

/// `PUT /v1/tenant/{t}/timeline/{tl}/membership` with a JSON `Configuration`: switches the
/// timeline to it, durably before the answer (the new status). 409 when it is not newer than
/// the one in force, 400 when malformed.
async fn set_membership(
    State(state): State<Arc<AppState>>,
    Path((tenant_id, timeline_id)): Path<(String, String)>,
    claims: Option<Extension<Claims>>,
    body: Bytes,
) -> Result<Json<TimelineStatus>, ApiError> {
    require_admin(&claims)?;
    let tl = find_or_restore(&state, &tenant_id, &timeline_id).await?;
    let mconf: Configuration = parse_body(&body)?;
    let t = tl.clone();
    match blocking(move || t.set_membership(mconf)).await? {
        Ok(changed) => {
            let _span = crate::timeline::span(&tl.ttid).entered();
            tracing::info!(changed, mconf = ?tl.status().mconf, "membership set over HTTP");
            Ok(Json(tl.status()))
        }
        Err(e @ SafeKeeperError::MembershipNotNewer { .. }) => {
            Err(ApiError::Conflict(e.to_string()))
        }
        Err(e @ SafeKeeperError::InvalidMembership(_)) => Err(ApiError::BadRequest(e.to_string())),
        Err(e) => Err(ApiError::Internal(e.into())),
    }
}

/// The body of `POST /v1/tenant/{tenant_id}/timeline`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRequest {
    timeline_id: String,
    system_id: u64,
    pg_version: u32,
    wal_seg_size: u32,
    /// `X/Y`; absent: where the first proposer starts.
    #[serde(default)]
    start_lsn: Option<String>,
    /// Absent: generation 0 (the first proposer's configuration is adopted).
    #[serde(default)]
    mconf: Option<Configuration>,
}

/// `POST /v1/tenant/{tenant_id}/timeline`: creates a timeline durably and clears its
/// tombstone (and its tenant's). 201 with its status; 409 if it exists; 400 when invalid.
async fn create_timeline(
    State(state): State<Arc<AppState>>,
    Path(tenant_id): Path<String>,
    claims: Option<Extension<Claims>>,
    body: Bytes,
) -> Result<(StatusCode, Json<TimelineStatus>), ApiError> {
    require_admin(&claims)?;
    let req: CreateRequest = parse_body(&body)?;
    let ttid = parse_ttid(&tenant_id, &req.timeline_id)?;
    let start_lsn = match &req.start_lsn {
        Some(s) => s
            .parse()
            .map_err(|e| ApiError::BadRequest(format!("start_lsn: {e}")))?,
        None => sk_core::types::Lsn::INVALID,
    };
    if req.system_id == 0 || req.pg_version == 0 {
        return Err(ApiError::BadRequest(
            "system_id and pg_version must be non-zero".into(),
        ));
    }
    let create = CreateTimeline {
        ttid,
        server: ServerInfo {
            pg_version: req.pg_version,
            system_id: req.system_id,
            wal_seg_size: req.wal_seg_size,
        },
        start_lsn,
        mconf: req.mconf.unwrap_or_default(),
    };
    let timelines = state.timelines.clone();
    let tl = blocking(move || timelines.create_explicit(&create)).await??;
    Ok((StatusCode::CREATED, Json(tl.status())))
}

#[derive(Serialize)]
struct Deleted {
    /// Whether there was something to delete (the tombstone is written either way).
    existed: bool,
    /// Timelines removed (tenant deletion).
    timelines: usize,
}

/// `?only_local=true` on a delete: this node's copy only, the store's objects stay (they are
/// the members'); see [`crate::manager::deletes_remote_objects`].
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct DeleteQuery {
    #[serde(default)]
    only_local: bool,
}

impl DeleteQuery {
    fn scope(&self) -> DeleteScope {
        if self.only_local {
            DeleteScope::OnlyLocal
        } else {
            DeleteScope::Everywhere
        }
    }
}

/// `DELETE /v1/tenant/{t}/timeline/{tl}`: a durable tombstone, the connections on it end, its
/// files go durably. 200 also when it did not exist (then only the tombstone is written).
async fn delete_timeline(
    State(state): State<Arc<AppState>>,
    Path((tenant_id, timeline_id)): Path<(String, String)>,
    Query(q): Query<DeleteQuery>,
    claims: Option<Extension<Claims>>,
) -> Result<Json<Deleted>, ApiError> {
    require_admin(&claims)?;
    let ttid = parse_ttid(&tenant_id, &timeline_id)?;
    let timelines = state.timelines.clone();
    let scope = q.scope();
    let existed = blocking(move || timelines.delete_timeline(&ttid, scope)).await??;
    Ok(Json(Deleted {
        existed,
        timelines: usize::from(existed),
    }))
}

/// `DELETE /v1/tenant/{t}`: every timeline of the tenant, with one tombstone for the tenant.
async fn delete_tenant(
    State(state): State<Arc<AppState>>,
    Path(tenant_id): Path<String>,
    Query(q): Query<DeleteQuery>,
    claims: Option<Extension<Claims>>,
) -> Result<Json<Deleted>, ApiError> {
    require_admin(&claims)?;
    let tenant_id: TenantId = tenant_id
        .parse()
        .map_err(|e: sk_core::types::IdParseError| ApiError::BadRequest(e.to_string()))?;
    let timelines = state.timelines.clone();
    let scope = q.scope();
    let n = blocking(move || timelines.delete_tenant(&tenant_id, scope)).await??;
    Ok(Json(Deleted {
        existed: n > 0,
        timelines: n,
    }))
}

/// `GET /v1/tenant/{t}/timeline/{tl}/snapshot`: the timeline's control file and WAL, streamed
/// (format in [`crate::pull`]).
async fn snapshot(
    State(state): State<Arc<AppState>>,
    Path((tenant_id, timeline_id)): Path<(String, String)>,
    Query(q): Query<SnapshotQuery>,
    claims: Option<Extension<Claims>>,
) -> Result<Response, ApiError> {
    require_admin(&claims)?;
    // A pull from an evicted donor restores it first (its WAL below the restored segment is
    // sent from the store, as after any removal).
    let tl = find_or_restore(&state, &tenant_id, &timeline_id).await?;
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream")],
        crate::pull::snapshot_body(tl, q.remote),
    )
        .into_response())
}

/// `GET …/snapshot?remote=true`: the puller has remote storage (the snapshot may start at the
/// backed-up point).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SnapshotQuery {
    #[serde(default)]
    remote: bool,
}

/// The body of `POST /v1/pull_timeline`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PullRequest {
    tenant_id: String,
    timeline_id: String,
    /// The peers' HTTP addresses (`host:port`).
    http_hosts: Vec<String>,
}

/// `POST /v1/pull_timeline`: copies a timeline from the most advanced of a majority of peers
/// and serves it from then on (see [`crate::pull`]). 409 if it exists here; 502 when the peers
/// do not give a valid, current copy.
async fn pull_timeline(
    State(state): State<Arc<AppState>>,
    claims: Option<Extension<Claims>>,
    body: Bytes,
) -> Result<Response, ApiError> {
    require_admin(&claims)?;
    let req: PullRequest = parse_body(&body)?;
    let ttid = parse_ttid(&req.tenant_id, &req.timeline_id)?;
    let timelines = state.timelines.clone();
    let client = state.peer.clone();
    let span = crate::timeline::span(&ttid);
    let pulled = blocking(move || {
        let _span = span.entered();
        crate::pull::pull_timeline(&timelines, &client, ttid, &req.http_hosts)
    })
    .await?;
    match pulled {
        Ok(p) => Ok(Json(p).into_response()),
        Err(PullError::Exists(_)) | Err(PullError::Local(TimelineError::Exists(_))) => Err(
            ApiError::Conflict(format!("timeline {ttid} exists on this safekeeper already")),
        ),
        Err(PullError::BadRequest(m)) => Err(ApiError::BadRequest(m)),
        Err(PullError::Peer(m)) => {
            tracing::warn!("pull_timeline {ttid}: {m}");
            Ok((StatusCode::BAD_GATEWAY, format!("{m}\n")).into_response())
        }
        Err(PullError::Local(e)) => Err(e.into()),
    }
}

async fn metrics() -> Result<Response, ApiError> {
    let families = prometheus::gather();
    let mut out = String::new();
    prometheus::TextEncoder::new()
        .encode_utf8(&families, &mut out)
        .map_err(|e| ApiError::Internal(e.into()))?;
    Ok(([(header::CONTENT_TYPE, prometheus::TEXT_FORMAT)], out).into_response())
}

/// Test hooks, compiled only with the `testing` feature and mounted only by the
/// `safekeeper-testing` binary.
#[cfg(feature = "testing")]
mod testing {
    use std::collections::HashMap;
    use std::sync::{Arc, Mutex};

    use axum::Router;
    use axum::extract::Query;
    use axum::routing::put;

    use super::{ApiError, AppState};

    /// Memory a test asked the daemon to hold, so heap profiles have a known allocation site.
    static RETAINED: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

    pub(super) fn routes() -> Router<Arc<AppState>> {
        Router::new()
            .route(
                "/v1/debug/retain_memory",
                put(retain_memory).delete(release_memory),
            )
            .route("/v1/failpoints", put(set_failpoint))
    }

    /// `PUT /v1/failpoints?name=N&active=true|false`.
    async fn set_failpoint(Query(q): Query<HashMap<String, String>>) -> Result<String, ApiError> {
        let name = q
            .get("name")
            .ok_or_else(|| ApiError::BadRequest("missing name".into()))?;
        let on = match q.get("active").map(String::as_str) {
            Some("true") => true,
            Some("false") => false,
            _ => return Err(ApiError::BadRequest("active must be true or false".into())),
        };
        sk_core::failpoint::set(name, on).map_err(ApiError::BadRequest)?;
        Ok(format!("{name} {}\n", if on { "on" } else { "off" }))
    }

    /// `PUT /v1/debug/retain_memory?mib=N`: allocates N MiB (touched, in 1 MiB chunks) and keeps it.
    async fn retain_memory(Query(q): Query<HashMap<String, String>>) -> Result<String, ApiError> {
        let mib: usize = q
            .get("mib")
            .and_then(|v| v.parse().ok())
            .filter(|v| (1..=4096).contains(v))
            .ok_or_else(|| ApiError::BadRequest("mib must be an integer from 1 to 4096".into()))?;
        let chunks = allocate_chunks(mib);
        let mut held = RETAINED.lock().expect("retained memory lock poisoned");
        held.extend(chunks);
        Ok(format!("retaining {} MiB\n", held.len()))
    }

    #[inline(never)]
    fn allocate_chunks(mib: usize) -> Vec<Vec<u8>> {
        let chunks: Vec<Vec<u8>> = (0..mib)
            .map(|i| vec![(i % 251) as u8 + 1; 1 << 20])
            .collect();
        std::hint::black_box(&chunks);
        chunks
    }

    /// `DELETE /v1/debug/retain_memory`: frees everything retained.
    async fn release_memory() -> String {
        RETAINED
            .lock()
            .expect("retained memory lock poisoned")
            .clear();
        "released\n".into()
    }
}
