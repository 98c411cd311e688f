//! PostgreSQL WAL format.
