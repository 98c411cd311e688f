//! `GET /profile/heap`: jemalloc's sampled heap profile.
//!
//! jemalloc records a stack for one allocation per 2 MiB allocated (on average) and keeps it
//! while the allocation is live, so a dump shows in-use memory by allocation site, scaled up to
//! estimate the whole heap. Dumping and symbolizing are blocking work and run on the blocking
//! pool; `jemalloc_pprof`'s mutex serializes concurrent dumps.

use std::collections::HashMap;
use std::io::Read;
use std::time::Duration;

use anyhow::Context;
use axum::extract::Query;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use jemalloc_pprof::{StackProfile, WeightedStack};
use pprof::protos::Message;

use crate::cpu::gzip;
use crate::error::{ProfileError, parse_bounded, parse_choice, reject_unknown};
use crate::metrics::{Outcome, record};
use crate::symbolize;

pub(crate) async fn handler(Query(params): Query<HashMap<String, String>>) -> Response {
    let result = profile(params).await;
    record("heap", Outcome::of(&result));
    match result {
        Ok(resp) => resp,
        Err(e) => e.into_response(),
    }
}

async fn profile(params: HashMap<String, String>) -> Result<Response, ProfileError> {
    reject_unknown(&params, &["format", "seconds"])?;
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

    let (body, title) = match seconds {
        None => {
            let ctl = ctl.clone();
            let body = blocking(move || {
                let mut ctl = ctl.blocking_lock();
                check_active(&ctl)?;
                if format == "jemalloc" {
                    let mut f = ctl.dump().context("jemalloc heap dump")?;
                    let mut raw = Vec::new();
                    f.read_to_end(&mut raw).context("reading the heap dump")?;
                    return Ok(raw);
                }
                let profile = ctl.dump_profile().context("heap dump")?;
                drop(ctl);
                render(&profile, format, "inuse_space")
            })
            .await?;
            (body, None)
        }
        Some(secs) => {
            let dump = || {
                let ctl = ctl.clone();
                blocking(move || {
                    let mut ctl = ctl.blocking_lock();
                    check_active(&ctl)?;
                    Ok(ctl.dump_profile().context("heap dump")?)
                })
            };
            let before = dump().await?;
            tokio::time::sleep(Duration::from_secs(secs)).await;
            let after = dump().await?;
            let body = blocking(move || {
                let delta = growth(&before, after);
                render(&delta, format, &format!("inuse_space growth over {secs} s"))
            })
            .await?;
            (body, Some(secs))
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
    if let Some(secs) = title {
        resp.headers_mut().insert(
            "x-profile-delta-seconds",
            secs.to_string().parse().expect("digits are a valid header"),
        );
    }
    Ok(resp)
}

/// Symbolizes a stack profile and renders it as gzipped pprof or an SVG flamegraph.
fn render(profile: &StackProfile, format: &str, title: &str) -> Result<Vec<u8>, ProfileError> {
    match format {
        "svg" => {
            let lines = symbolize::to_folded(profile);
            let mut opts = pprof::flamegraph::Options::default();
            opts.title = title.to_string();
            opts.count_name = "bytes".to_string();
            let mut svg = Vec::new();
            pprof::flamegraph::from_lines(&mut opts, lines.iter().map(String::as_str), &mut svg)
                .context("rendering the heap flamegraph")?;
            Ok(svg)
        }
        _ => {
            let proto = symbolize::to_pprof(profile, ("inuse_space", "bytes"));
            Ok(gzip(&proto.encode_to_vec())?)
        }
    }
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

/// What is live in `after` and was not in `before`, per allocation stack: the memory allocated
/// during the interval that is still held at its end. Stacks that shrank are left out.
fn growth(before: &StackProfile, after: StackProfile) -> StackProfile {
    let mut base: HashMap<&[usize], f64> = HashMap::new();
    for (stack, _) in before.iter() {
        *base.entry(stack.addrs.as_slice()).or_default() += stack.weight;
    }
    let mut now: HashMap<Vec<usize>, f64> = HashMap::new();
    for (stack, _) in after.stacks {
        *now.entry(stack.addrs).or_default() += stack.weight;
    }
    let mut delta = StackProfile::default();
    for mapping in after.mappings {
        delta.push_mapping(mapping);
    }
    let mut grown: Vec<(Vec<usize>, f64)> = now
        .into_iter()
        .filter_map(|(addrs, weight)| {
            let d = weight - base.get(addrs.as_slice()).copied().unwrap_or(0.0);
            (d > 0.0).then_some((addrs, d))
        })
        .collect();
    grown.sort_by(|a, b| a.0.cmp(&b.0));
    for (addrs, weight) in grown {
        delta.push_stack(WeightedStack { addrs, weight }, None);
    }
    delta
}

#[cfg(test)]
mod tests {
    use super::*;

    fn profile(stacks: &[(&[usize], f64)]) -> StackProfile {
        let mut p = StackProfile::default();
        for (addrs, weight) in stacks {
            p.push_stack(
                WeightedStack {
                    addrs: addrs.to_vec(),
                    weight: *weight,
                },
                None,
            );
        }
        p
    }

    #[test]
    fn growth_keeps_only_stacks_that_grew() {
        let before = profile(&[(&[1, 2], 100.0), (&[3], 50.0), (&[4], 10.0)]);
        let after = profile(&[(&[1, 2], 300.0), (&[3], 20.0), (&[5, 6], 7.0), (&[4], 10.0)]);
        let d = growth(&before, after);
        let got: Vec<(Vec<usize>, f64)> =
            d.iter().map(|(s, _)| (s.addrs.clone(), s.weight)).collect();
        assert_eq!(got, vec![(vec![1, 2], 200.0), (vec![5, 6], 7.0)]);
    }
}
