//! Palisade's lease authority.
//!
//! A lease is a grant on a [`Scope`](palisade_core::Scope) to a named holder
//! for a TTL, identified by a random [`LeaseId`](palisade_core::LeaseId) and
//! carrying a [`FencingToken`](palisade_core::FencingToken) drawn from one
//! durable counter. Two layers:
//!
//! - [`LeaseTable`]: the decisions, a pure state machine. Every call takes the
//!   current monotonic time as [`Millis`]; no disk, no clock, no sleeps.
//! - [`LeaseAuthority`]: the thin durable shell. It asks the table and
//!   returns each outcome with the writes that make it durable (token
//!   counter, lease record, token index, deadline: [`LeaseWrites`]); the
//!   store commits them in the same synced round as the fence they raise,
//!   and answers only after that. Its time comes from a [`Clock`] the store
//!   passes in (`palisade_log::SystemClock`; tests move a [`ManualClock`] instead of
//!   sleeping past a TTL).
//!
//! - [`RenewalTails`]: renewal gaps and answer latencies per scope and
//!   holder, and the TTL they call for ([`Advice`]); pure as well.
//! - [`RemoteAuthority`]: the seam for an authority outside the store (etcd,
//!   in `palisade-etcd`), chosen by configuration; the embedded one stays the
//!   default.
//!
//! Leases only decide *liveness* (who should be writing). Safety comes from
//! the fence the log checks on every append: a lease holder that was paused
//! past its TTL still holds a token, and the log refuses it once a later
//! grant has been seen.
//!
//! ```
//! use palisade_core::{LeaseId, Scope};
//! use palisade_lease::{AcquireRequest, LeaseTable, Millis};
//!
//! let mut table = LeaseTable::default();
//! let req = |holder: &str| AcquireRequest {
//!     scope: "twin/device-7".parse::<Scope>().unwrap(),
//!     holder: holder.into(),
//!     ttl_ms: 1_000,
//!     purpose: Default::default(),
//! };
//! let a = table.acquire(req("A"), LeaseId(1), Millis(0)).unwrap();
//! assert!(table.acquire(req("B"), LeaseId(2), Millis(500)).is_err()); // still held
//! let b = table.acquire(req("B"), LeaseId(2), Millis(1_000)).unwrap(); // A expired
//! assert!(b.lease.token > a.lease.token);
//! assert!(table.renew(LeaseId(1), Millis(1_001)).is_err()); // scenario 6
//! ```

mod advice;
mod authority;
mod clock;
mod remote;
mod table;

pub use advice::{
    Advice, RenewalTails, Tails, TtlCheck, ADVICE_FLOOR_MS, MIN_SAMPLES, WARN_EVERY_MS,
};
pub use authority::{AuthorityError, LeaseAuthority, LeaseWrites};
pub use clock::{Clock, ManualClock};
pub use remote::{RemoteAuthority, RemoteError};
pub use table::{
    AcquireRequest, Grant, Lease, LeaseError, LeaseTable, Millis, MAX_HOLDER_LEN, MAX_TTL_MS,
    MIN_TTL_MS,
};
