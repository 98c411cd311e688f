//! The safekeeper's consensus core: what an acceptor does with each proposer message, and the
//! storage seams it does that over.
//!
//! - [`types`]: protocol quantities as newtypes ([`types::Term`], [`types::Generation`], ids,
//!   [`types::TermHistory`]; [`types::Lsn`] comes from `pg_wal`);
//! - [`protocol`]: neon's proposer ↔ acceptor protocol v3, messages and a byte-exact codec
//!   over `pq_proto`'s bounded reader;
//! - [`state`]: the persistent state of one timeline;
//! - [`safekeeper`]: [`safekeeper::SafeKeeper::process_msg`], the sans-IO acceptor;
//! - [`storage`]: the [`storage::ControlStore`] and [`storage::WalStore`] traits, in-memory fakes
//!   that lose un-synced data on a simulated power loss ([`storage::mem`]), the file-system seam
//!   under the file stores with a simulated file system ([`storage::fs`]), and the one
//!   fsync-or-abort helper ([`storage::durable`]);
//! - [`failpoint`]: named fault switches (only active with the `testing` feature).
//!
//! Layer rule: depends on `pg_wal` and on `pq_proto` without its `tokio` feature; no tokio, no
//! sockets, no clock (callers pass times in). Storage goes through the traits, so the same core
//! runs over files in the daemon and over fakes in tests and the model.
//!
//! Not here: the file stores, timelines and network services (the `safekeeper` crate) and the
//! proposer (the `walproposer` crate).

// No `unwrap()` outside tests: bytes from the network or the disk are handled as errors, local
// invariants are stated with `expect("why it cannot fail")`.
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod failpoint;
pub mod protocol;
pub mod safekeeper;
pub mod state;
pub mod storage;
pub mod types;
