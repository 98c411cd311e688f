//! mini-safekeeper: a durable, replicated front of a PostgreSQL write-ahead log.
//!
//! Layers, each depending only on those above it:
//! 1. formats (pure): [`types`], [`wal`] (PostgreSQL WAL pages, records, CRC-32C, a generator and
//!    a decoder), [`protocol`] (neon's proposer/acceptor protocol v3);
//! 2. consensus core (pure): [`safekeeper`] (`SafeKeeper::process_msg`), over [`state`], and
//!    [`registry`] (timelines by id);
//! 3. storage: [`storage`] (control file, WAL segments, in-memory fakes);
//! 4. network and tasks (tokio): [`pq`] (our PostgreSQL wire protocol, server and client);
//! 5. HTTP: [`http`].

pub mod config;
pub mod daemon;
pub mod http;
pub mod pq;
pub mod protocol;
pub mod registry;
pub mod safekeeper;
pub mod state;
pub mod storage;
pub mod types;
pub mod wal;
