//! The JSON shapes the client sends and receives: the wire types of
//! `palisade-api`, the same definitions the server writes (decision 0020),
//! under the names this SDK has always exported.

/// An event to append: `{"type", "patch", "hlc"?, "event_id"?}`.
///
/// Give every event an `event_id` when you can: the store acknowledges a
/// repeated id for the same twin with its original sequence number instead of
/// appending it twice, which is what makes [`Client::append`](crate::Client::append)
/// safe to retry.
pub use palisade_api::EventIn as Event;

/// The store's answer to an accepted append (`201`).
pub use palisade_api::AppendResponse as Appended;

/// A lease as granted (or renewed) by `POST /v1/leases`.
pub use palisade_api::LeaseOut as LeaseGrant;

/// `GET /v1/leases/advice`: a scope's measured renewal tails and the TTL
/// they call for.
pub use palisade_api::LeaseAdviceOut as LeaseAdvice;

/// The live lease on a partition, as `GET /v1/partitions` shows it.
pub use palisade_api::LeaseOut as PartitionOwner;

/// One partition's fence, head and owner.
pub use palisade_api::PartitionOut as PartitionInfo;

/// `GET /v1/partitions`: every partition of the store.
pub use palisade_api::PartitionsResponse as Partitions;

/// An event as stored (`GET /v1/twins/{id}/events`, change streams).
pub use palisade_api::EventOut as StoredEvent;

/// A twin's current state (`GET /v1/twins/{id}`), with its device-shadow
/// `delta`: when `state` has a `desired` object, the desired leaves whose
/// value differs from (or is missing in) `reported`.
pub use palisade_api::TwinResponse as TwinState;

/// A refused write from the store's durable refusal journal
/// (`GET /v1/twins/{id}/refusals`, `GET /v1/partitions/{p}/refusals`).
pub use palisade_api::RefusalOut as Refusal;

/// A side effect to declare with an event (the fenced outbox,
/// `docs/outbox.md`): `Event::new(..).with_effect(Effect::webhook(url, body))`.
pub use palisade_api::EffectIn as Effect;

/// One effect of an admitted event and its delivery state (`GET /v1/outbox`).
pub use palisade_api::OutboxEntryOut as OutboxEntry;

pub(crate) use palisade_api::OutboxResponse;

pub(crate) use palisade_api::EventsPage;
pub(crate) use palisade_api::RefusalsResponse;
