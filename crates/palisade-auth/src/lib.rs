//! Who a request is and what it may do: principals, API keys, roles and
//! grants, and the one policy, [`authorize`], that the HTTP API and the
//! Kafka ingester both ask.
//!
//! A principal authenticates with a bearer API key (HTTP) or signs its
//! records with the key's hash (Kafka). The store keeps only the key's
//! SHA-256 (hex), compared in constant time, so the security file is not a
//! secret that lets its reader in. A principal has roles; a role grants
//! [`Action`]s on scope patterns (`partition/*`, `twin/device-*`,
//! `admin/*`, `*`), where `*` matches any run of characters. A request asks
//! for an action on a typed [`Resource`]; [`authorize`] says yes or names
//! what was refused. Everything here is pure: no I/O, no clock, no axum,
//! no sled. See `docs/security.md` and `docs/decisions/0022-auth-crate.md`.
//!
//! ```
//! use std::collections::BTreeMap;
//! use palisade_auth::{authorize, hash_key, Action, Auth, GrantFile, Principal, PrincipalFile, Resource, RoleFile};
//! use palisade_core::{PartitionId, TwinId};
//!
//! let roles = BTreeMap::from([(
//!     "writer".to_owned(),
//!     RoleFile { grants: vec![GrantFile { actions: vec![Action::Write], scopes: vec!["twin/pump-*".into()] }] },
//! )]);
//! let auth = Auth::new(&roles, &[PrincipalFile {
//!     name: "w".into(),
//!     key_sha256: hash_key("psk_secret"),
//!     roles: vec!["writer".into()],
//! }])?;
//! let w = Principal::Known(auth.authenticate("psk_secret").expect("a known key"));
//! let pump = Resource::Twin { twin: TwinId::new("pump-1")?, partition: PartitionId(3) };
//! assert!(authorize(w, Action::Write, &pump).is_ok());
//! assert!(authorize(w, Action::Read, &pump).is_err());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod keys;
mod policy;

pub use keys::{glob, hash_key, mint_key, Auth, GrantFile, Identity, PrincipalFile, RoleFile};
pub use policy::{authorize, owns, Action, Principal, Resource, ANONYMOUS};

/// Everything this crate refuses: a security file it cannot use, or a
/// request the policy does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// A grant without actions or without scopes allows nothing: a typo.
    #[error("role {role:?}: a grant needs at least one action and one scope")]
    EmptyGrant { role: String },
    #[error("role {role:?}: empty scope pattern {pattern:?}")]
    EmptyPattern { role: String, pattern: String },
    /// Names are lease holder names, with the same bounds.
    #[error("principal {name:?}: a name is 1..={max} bytes without control characters")]
    BadName { name: String, max: usize },
    #[error("principal {name:?} is listed twice")]
    DuplicateName { name: String },
    #[error(
        "principal {name:?}: key_sha256 must be 64 hex characters (see `palisade auth mint-key`)"
    )]
    BadKeyHash { name: String },
    /// Two principals with one key: a key would not say who is asking.
    #[error("principals {first:?} and {second:?} have the same key")]
    SameKey { first: String, second: String },
    #[error("principal {principal:?}: no role named {role:?}")]
    NoSuchRole { principal: String, role: String },
    #[error("authentication needs at least one principal")]
    NoPrincipals,
    #[error("no randomness from the OS: {0}")]
    NoRandomness(String),
    /// No grant of `action` covers the resource (`scope` is its canonical
    /// name, as audited).
    #[error("principal {principal:?} may not {action} on {scope}")]
    Forbidden {
        principal: String,
        action: Action,
        scope: String,
    },
}
