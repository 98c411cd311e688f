//! The safekeeper daemon: the allocator, then `safekeeper::daemon::main` (flags, tracing,
//! runtime, `daemon::run`). This binary never serves test-only routes, whatever features it was
//! built with.

profiling::global_allocator!();

fn main() {
    safekeeper::daemon::main(safekeeper::daemon::TestHooks::Off)
}
