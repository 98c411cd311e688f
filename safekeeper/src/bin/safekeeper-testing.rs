//! The safekeeper daemon with its test hooks on (`PUT /v1/failpoints`, `/v1/debug/*`): what
//! the pytest suite runs. Built only with the `testing` feature, under its own name, so
//! `target/release/safekeeper` is always the real daemon.

profiling::global_allocator!();

fn main() {
    safekeeper::daemon::main(safekeeper::daemon::TestHooks::On)
}
