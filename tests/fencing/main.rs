//! Fencing: the store never lets a write through whose token is below a
//! later grant covering its twin that the store has seen (invariant 2), no
//! matter how grants, releases, restarts and writes interleave.
#![allow(clippy::unwrap_used, clippy::expect_used)]

#[path = "../support.rs"]
mod support;

#[path = "../lease_suite.rs"]
mod lease_suite;

#[path = "03_backends.rs"]
mod backends;
#[path = "02_concurrent.rs"]
mod concurrent;
#[path = "01_model.rs"]
mod model;
