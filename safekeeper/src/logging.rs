//! Log output: `--log-format text|json` on stderr, colours only for a terminal.
//!
//! Log files and collectors get plain lines: ANSI colour codes are written only when stderr is
//! a terminal. Every line about a timeline is emitted inside [`crate::timeline::span`], so it
//! carries `tenant_id` and `timeline_id` as fields (text: `timeline{tenant_id=… timeline_id=…}:`
//! before the message; JSON: under `span`).

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

use crate::config::LogFormat;

/// Installs the global subscriber: `RUST_LOG` filters (default `info`), lines go to stderr.
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(true)
            .with_span_list(false)
            .init(),
    }
}
