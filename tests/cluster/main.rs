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

#[allow(dead_code)]
#[path = "../kafka/broker.rs"]
mod broker;

#[path = "01_etcd_leases.rs"]
mod etcd_leases;

#[path = "02_etcd_store.rs"]
mod etcd_store;

#[path = "03_three_nodes.rs"]
mod three_nodes;

#[path = "04_scaling.rs"]
mod scaling;

#[path = "05_forwarding.rs"]
mod forwarding;

#[path = "../lease_suite.rs"]
mod lease_suite;

#[path = "06_lease_suite.rs"]
mod backend_suite;

#[path = "07_if_match.rs"]
mod if_match;

#[path = "08_views.rs"]
mod views;

#[path = "09_rebalance.rs"]
mod rebalance;

#[path = "10_auth.rs"]
mod auth;

#[allow(dead_code)]
#[path = "../outbox/receiver.rs"]
mod receiver;

#[path = "11_outbox.rs"]
mod outbox;

#[path = "12_snapshot.rs"]
mod snapshot;

#[path = "13_handoff_time.rs"]
mod handoff_time;
