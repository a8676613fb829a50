//! Past one machine: the etcd lease authority (and cluster mode) against a
//! real etcd process started by the tests. See README.md for what each
//! file guards against.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

mod etcd;

#[path = "01_etcd_leases.rs"]
mod etcd_leases;

#[path = "02_etcd_store.rs"]
mod etcd_store;
