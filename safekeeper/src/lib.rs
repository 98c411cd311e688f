//! The safekeeper daemon: the file stores under the consensus core, timelines, the WAL service
//! (proposers push WAL in, readers stream it out) and the HTTP API.
//!
//! Layers below it, each a crate (the layer rule is their `Cargo.toml` dependencies):
//! `pg_wal` (WAL formats) → `pq_proto` (PostgreSQL wire protocol) → `sk_core` (protocol v3,
//! `SafeKeeper::process_msg`, storage traits) → this crate. Inside it:
//! 1. storage: [`control_file`] and [`wal_store`], the file implementations of `sk_core`'s
//!    storage traits; [`remote_storage`] (the object store), [`remove_wal`] (the horizon and
//!    the readers' holds), [`disk_usage`] (the disk limits' gauges); [`blocking`] (where a thread
//!    may block, the lock order);
//! 2. the timeline manager's decisions, sans I/O: [`manager`] (backup, removal, control-file
//!    saves, a deleted timeline's end, snapshot points, pull quorums, peer recovery's donor
//!    rules), driven by a seeded simulation;
//! 3. timelines: [`timeline`] (one timeline's acceptor behind a lock, its published view and
//!    typed errors), [`feedback`] (what its readers report back: positions, lags, hot-standby
//!    feedback) and [`registry`] (the node's timelines: loading, lookup, creation, deletion,
//!    metrics);
//! 4. network and tasks (tokio): [`lifecycle`] (the managers' driver), [`command`] (neon's
//!    replication commands), [`wal_service`] (the listener), [`receive_wal`] (the pipelined WAL
//!    acceptor), [`send_wal`] (the walsender), [`wal_backup`] (uploads, remote reads),
//!    [`recovery`], [`pull`];
//! 5. HTTP: [`http`], [`metrics`]; [`auth`] (JWT scopes, both ports); [`limits`] (connection
//!    limits, idle timeouts); [`config`], [`secrets`], [`node_id`], [`logging`] and [`daemon`]
//!    tie everything together.
//!
//! The modules form no import cycle (`tests/module_graph.rs`).

pub mod auth;
pub mod blocking;
pub mod command;
pub mod config;
pub mod control_file;
pub mod daemon;
pub mod disk_usage;
pub mod evict;
pub mod evicted;
pub mod feedback;
pub mod http;
pub mod lifecycle;
pub mod limits;
pub mod logging;
pub mod manager;
pub mod metrics;
pub mod node_id;
pub mod peer;
pub mod pull;
pub mod receive_wal;
pub mod recovery;
pub mod registry;
pub mod remote_storage;
pub mod remove_wal;
pub mod secrets;
pub mod send_wal;
#[cfg(test)]
mod test_util;
pub mod ticker;
pub mod timeline;
pub mod tls;
pub mod wal_backup;
pub mod wal_service;
pub mod wal_store;
