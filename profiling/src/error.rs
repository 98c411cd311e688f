//! The one error type of the profiling routes, and how it becomes an HTTP response.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// Why a profile request failed. Caller mistakes carry their reason to the client; our own
/// failures are logged and answered with a generic 500.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    /// A parameter was missing, malformed or out of range. The text lists what is valid.
    #[error("{0}")]
    BadRequest(String),
    /// Another CPU profile is running, or this one was cancelled by a forced request.
    #[error("{0}")]
    Conflict(String),
    /// The process cannot produce this profile (e.g. jemalloc heap profiling is off).
    #[error("{0}")]
    Unavailable(String),
    /// Our fault (profiler or symbolizer failure): 500, details in the log.
    #[error("internal error: {0:#}")]
    Internal(#[from] anyhow::Error),
}

impl ProfileError {
    /// The HTTP status this error answers with.
    pub fn status(&self) -> StatusCode {
        match self {
            ProfileError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ProfileError::Conflict(_) => StatusCode::CONFLICT,
            ProfileError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ProfileError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

impl IntoResponse for ProfileError {
    fn into_response(self) -> Response {
        let status = self.status();
        let body = match &self {
            ProfileError::Internal(e) => {
                tracing::error!("profile request failed: {e:#}");
                "internal error while taking the profile (details in the server log)\n".to_string()
            }
            other => format!("{other}\n"),
        };
        // As Go's net/http/pprof marks its errors: `go tool pprof` then prints the body (our
        // reason) instead of a bare status line.
        (status, [("x-go-pprof", "1")], body).into_response()
    }
}

/// Parses an integer query parameter bounded to `range`, with an error that says what is valid.
pub(crate) fn parse_bounded(
    name: &str,
    value: Option<&String>,
    default: u64,
    range: std::ops::RangeInclusive<u64>,
) -> Result<u64, ProfileError> {
    let Some(raw) = value else {
        return Ok(default);
    };
    match raw.trim().parse::<u64>() {
        Ok(v) if range.contains(&v) => Ok(v),
        _ => Err(ProfileError::BadRequest(format!(
            "invalid {name}={raw:?}: expected an integer from {} to {} (default {default})",
            range.start(),
            range.end()
        ))),
    }
}

/// Parses a `format` parameter against the list of valid values (the first is the default).
pub(crate) fn parse_choice<'a>(
    name: &str,
    value: Option<&String>,
    valid: &[&'a str],
) -> Result<&'a str, ProfileError> {
    let Some(raw) = value else {
        return Ok(valid[0]);
    };
    valid
        .iter()
        .find(|v| v.eq_ignore_ascii_case(raw.trim()))
        .copied()
        .ok_or_else(|| {
            ProfileError::BadRequest(format!(
                "invalid {name}={raw:?}: expected one of {} (default {})",
                valid.join(", "),
                valid[0]
            ))
        })
}

/// Parses a boolean flag (`true/false/1/0/yes/no`, absent = false).
pub(crate) fn parse_flag(name: &str, value: Option<&String>) -> Result<bool, ProfileError> {
    match value.map(|v| v.trim().to_ascii_lowercase()) {
        None => Ok(false),
        Some(v) if matches!(v.as_str(), "" | "true" | "1" | "yes") => Ok(true),
        Some(v) if matches!(v.as_str(), "false" | "0" | "no") => Ok(false),
        Some(v) => Err(ProfileError::BadRequest(format!(
            "invalid {name}={v:?}: expected true or false"
        ))),
    }
}

/// Rejects parameters the route does not know, so a typo is not silently ignored.
pub(crate) fn reject_unknown(
    params: &std::collections::HashMap<String, String>,
    known: &[&str],
) -> Result<(), ProfileError> {
    let mut unknown: Vec<&str> = params
        .keys()
        .map(String::as_str)
        .filter(|k| !known.contains(k))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort_unstable();
    Err(ProfileError::BadRequest(format!(
        "unknown parameter(s) {}: valid parameters are {}",
        unknown.join(", "),
        known.join(", ")
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bounded_parameters_reject_out_of_range_and_garbage() {
        let s = |v: &str| Some(v.to_string());
        assert_eq!(parse_bounded("seconds", None, 5, 1..=60).unwrap(), 5);
        assert_eq!(
            parse_bounded("seconds", s("60").as_ref(), 5, 1..=60).unwrap(),
            60
        );
        for bad in ["0", "61", "abc", "-1", "", "1.5"] {
            let err = parse_bounded("seconds", s(bad).as_ref(), 5, 1..=60).unwrap_err();
            assert!(matches!(err, ProfileError::BadRequest(ref m) if m.contains("1 to 60")));
        }
    }

    #[test]
    fn choice_lists_valid_values() {
        let v = Some("xml".to_string());
        let err = parse_choice("format", v.as_ref(), &["pprof", "svg"]).unwrap_err();
        assert_eq!(err.status(), axum::http::StatusCode::BAD_REQUEST);
        assert!(err.to_string().contains("pprof, svg"));
        let v = Some("SVG".to_string());
        assert_eq!(
            parse_choice("format", v.as_ref(), &["pprof", "svg"]).unwrap(),
            "svg"
        );
    }
}
