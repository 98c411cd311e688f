//! mini-safekeeper: a durable, replicated front of a PostgreSQL write-ahead log.
//!
//! Layers, each depending only on those above it:
//! 1. formats (pure): [`types`], the `pg_wal` crate (PostgreSQL WAL pages, records, CRC-32C, a
//!    generator and a decoder), [`protocol`] (neon's proposer/acceptor protocol v3);
//! 2. consensus core (pure): [`safekeeper`] (`SafeKeeper::process_msg`), over [`state`], and
//!    [`registry`] (timelines by id);
//! 3. storage: [`storage`] (control file, WAL segments, in-memory fakes);
//! 4. network and tasks (tokio): the `pq_proto` crate (our PostgreSQL wire protocol, server and
//!    client) and [`command`] (neon's replication commands),
//!    [`timeline`] (timelines behind locks, the node's registry), [`wal_service`] (the listener),
//!    [`receive_wal`] (the pipelined WAL acceptor), [`send_wal`] (the walsender);
//! 5. HTTP: [`http`], [`metrics`]; [`daemon`] ties everything together.

pub mod command;
pub mod config;
pub mod daemon;
pub mod failpoint;
pub mod http;
pub mod metrics;
pub mod proposer;
pub mod protocol;
pub mod receive_wal;
pub mod registry;
pub mod safekeeper;
pub mod send_wal;
pub mod state;
pub mod storage;
pub mod timeline;
pub mod types;
pub mod wal_service;
