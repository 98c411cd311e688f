//! `GET /profile/heap`: jemalloc's sampled heap profile.
//!
//! jemalloc records a stack for one allocation per 2 MiB allocated (on average) and keeps it
//! while the allocation is live, so a dump shows in-use memory by allocation site, scaled up to
//! estimate the whole heap. Dumping and symbolizing are blocking work and run on the blocking
//! pool; `jemalloc_pprof`'s mutex serializes concurrent dumps.

use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::time::Duration;

use anyhow::Context;
use axum::extract::Query;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use pprof::protos::Message;

use crate::cpu::gzip;
use crate::error::{ProfileError, parse_bounded, parse_choice, reject_unknown};
use crate::jeheap::{self, ALLOC_SPACE, HeapProfile, INUSE_SPACE};
use crate::metrics::{Outcome, record};
use crate::{svg, symbolize};

/// Which view of the heap a route serves by default.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    /// What is live now (`inuse_space`): `/profile/heap`, `/debug/pprof/heap`.
    Inuse,
    /// Everything allocated since start-up, freed or not (`alloc_space`): `/debug/pprof/allocs`.
    Allocs,
}

impl Kind {
    fn default_type(self) -> &'static str {
        match self {
            Kind::Inuse => "inuse_space",
            Kind::Allocs => "alloc_space",
        }
    }

    fn value(self) -> usize {
        match self {
            Kind::Inuse => INUSE_SPACE,
            Kind::Allocs => ALLOC_SPACE,
        }
    }
}

pub(crate) async fn handler(Query(params): Query<HashMap<String, String>>) -> Response {
    respond(
        "heap",
        profile(params, Kind::Inuse, &["format", "seconds"]).await,
    )
}

/// `GET /debug/pprof/heap`, Go's path: the same profile; `gc` is accepted and ignored (Go's
/// `gc=1` runs a collection first; jemalloc has none to run).
pub(crate) async fn go_heap_handler(Query(params): Query<HashMap<String, String>>) -> Response {
    respond(
        "heap",
        profile(params, Kind::Inuse, &["format", "seconds", "gc"]).await,
    )
}

/// `GET /debug/pprof/allocs`, Go's path: the heap profile with `alloc_space` as its default
/// type (every sampled allocation since start-up, freed or not).
pub(crate) async fn go_allocs_handler(Query(params): Query<HashMap<String, String>>) -> Response {
    respond(
        "allocs",
        profile(params, Kind::Allocs, &["format", "seconds", "gc"]).await,
    )
}

fn respond(kind: &str, result: Result<Response, ProfileError>) -> Response {
    record(kind, Outcome::of(&result));
    match result {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn profile(
    params: HashMap<String, String>,
    kind: Kind,
    known: &[&str],
) -> Result<Response, ProfileError> {
    reject_unknown(&params, known)?;
    let format = parse_choice(
        "format",
        params.get("format"),
        &["pprof", "jemalloc", "svg"],
    )?;
    let seconds = match params.get("seconds") {
        None => None,
        some => Some(parse_bounded("seconds", some, 0, 1..=300)?),
    };
    if format == "jemalloc" && seconds.is_some() {
        return Err(ProfileError::BadRequest(
            "seconds=N (a delta profile) is available with format=pprof or format=svg; the raw \
             jemalloc dump always holds everything live"
                .into(),
        ));
    }
    let ctl = jemalloc_pprof::PROF_CTL.as_ref().ok_or_else(|| {
        ProfileError::Unavailable(
            "heap profiling is not active: this process did not start jemalloc with prof:true \
             (binaries opt in with profiling::global_allocator!(); MALLOC_CONF may override it)"
                .into(),
        )
    })?;
    if kind == Kind::Allocs && !jeheap::accum_enabled() {
        return Err(ProfileError::Unavailable(
            "cumulative allocation counts are off: this process's jemalloc runs without \
             prof_accum:true (profiling::MALLOC_CONF sets it; MALLOC_CONF may override it); \
             /debug/pprof/heap has what is live"
                .into(),
        ));
    }
    let dump = || {
        let ctl = ctl.clone();
        blocking(move || {
            let mut ctl = ctl.blocking_lock();
            check_active(&ctl)?;
            let f = ctl.dump().context("jemalloc heap dump")?;
            drop(ctl);
            let mappings = mappings::MAPPINGS.as_deref().unwrap_or(&[]);
            Ok(jeheap::parse(
                BufReader::new(f),
                jeheap::accum_enabled(),
                mappings,
            )?)
        })
    };

    let body = match seconds {
        None if format == "jemalloc" => {
            let ctl = ctl.clone();
            blocking(move || {
                let mut ctl = ctl.blocking_lock();
                check_active(&ctl)?;
                let mut f = ctl.dump().context("jemalloc heap dump")?;
                let mut raw = Vec::new();
                f.read_to_end(&mut raw).context("reading the heap dump")?;
                Ok(raw)
            })
            .await?
        }
        None => {
            let profile = dump().await?;
            let title = match kind {
                Kind::Inuse => "inuse_space: live heap by allocation site".to_string(),
                Kind::Allocs => "alloc_space: allocated since start-up, by site".to_string(),
            };
            blocking(move || render(&profile, format, kind, &title, "no sampled allocations"))
                .await?
        }
        Some(secs) => {
            let before = dump().await?;
            tokio::time::sleep(Duration::from_secs(secs)).await;
            let after = dump().await?;
            blocking(move || {
                let delta = jeheap::growth(&before, after);
                let (title, empty) = match kind {
                    Kind::Inuse => (
                        format!("inuse_space growth over {secs} s"),
                        format!("no live allocations grew in {secs} s"),
                    ),
                    Kind::Allocs => (
                        format!("alloc_space: allocated in {secs} s"),
                        format!("no sampled allocations in {secs} s"),
                    ),
                };
                render(&delta, format, kind, &title, &empty)
            })
            .await?
        }
    };

    let (content_type, disposition) = match format {
        "svg" => ("image/svg+xml", "inline; filename=\"heap.svg\""),
        "jemalloc" => (
            "application/octet-stream",
            "attachment; filename=\"heap.dump\"",
        ),
        _ => (
            "application/octet-stream",
            "attachment; filename=\"heap.pb.gz\"",
        ),
    };
    let mut resp = (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_DISPOSITION, disposition),
        ],
        body,
    )
        .into_response();
    if let Some(secs) = seconds {
        resp.headers_mut().insert(
            "x-profile-delta-seconds",
            secs.to_string().parse().expect("digits are a valid header"),
        );
    }
    Ok(resp)
}

/// Symbolizes a heap profile and renders it as gzipped pprof or an SVG flamegraph (of the
/// route's sample type). Nothing to draw gives an SVG that says so (`empty`).
fn render(
    profile: &HeapProfile,
    format: &str,
    kind: Kind,
    title: &str,
    empty: &str,
) -> Result<Vec<u8>, ProfileError> {
    let body = match format {
        "svg" => {
            let lines = symbolize::to_folded(profile, kind.value());
            if lines.is_empty() {
                return Ok(svg::message(title, empty));
            }
            let mut opts = pprof::flamegraph::Options::default();
            opts.title = title.to_string();
            opts.count_name = "bytes".to_string();
            let mut svg = Vec::new();
            pprof::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut svg)
                .context("rendering the heap flamegraph")?;
            Ok(svg)
        }
        _ => {
            let proto = symbolize::to_pprof(profile, kind.default_type());
            Ok(gzip(&proto.encode_to_vec())?)
        }
    };
    symbolize::purge();
    body
}

fn check_active(ctl: &jemalloc_pprof::JemallocProfCtl) -> Result<(), ProfileError> {
    if ctl.activated() {
        Ok(())
    } else {
        Err(ProfileError::Unavailable(
            "heap profiling is compiled in but not active (prof_active is false)".into(),
        ))
    }
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ProfileError> + Send + 'static,
) -> Result<T, ProfileError> {
    tokio::task::spawn_blocking(f)
        .await
        .context("heap profile task")?
}
