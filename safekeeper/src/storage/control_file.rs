//! See storage/mod.rs.
