//! Profiling routes.
