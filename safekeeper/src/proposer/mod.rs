//! The proposer side of neon's protocol: connections to safekeepers ([`conn`]).
//!
//! The election and quorum-commit logic of the `walproposer` binary builds on these.

pub mod conn;
