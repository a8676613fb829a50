//! The policy: which principal may do which action on which resource.

use std::fmt;

use palisade_core::{PartitionId, Scope, TwinId};
use serde::Deserialize;

use crate::{AuthError, Identity};

/// The principal of every request when authentication is off.
pub const ANONYMOUS: &str = "anonymous";

/// What a grant allows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Action {
    /// Acquire, renew and release leases on the scope.
    Lease,
    /// Append events to twins in the scope (with a token of one's own lease).
    Write,
    /// Read twins, histories and change streams; list admin data.
    Read,
    /// Everything on `admin/...` resources (audit log, dead letters ...).
    Admin,
}

impl Action {
    pub fn name(self) -> &'static str {
        match self {
            Self::Lease => "lease",
            Self::Write => "write",
            Self::Read => "read",
            Self::Admin => "admin",
        }
    }
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Who is asking.
#[derive(Debug, Clone, Copy)]
pub enum Principal<'a> {
    /// Authentication is off: every request is [`ANONYMOUS`] and may do
    /// everything (the bind policy keeps such a store on loopback).
    Anonymous,
    /// A principal of the security file, authenticated by its key.
    Known(&'a Identity),
}

impl<'a> Principal<'a> {
    pub fn name(&self) -> &'a str {
        match self {
            Self::Anonymous => ANONYMOUS,
            Self::Known(id) => id.name(),
        }
    }
}

/// What a request acts on, typed: the policy, not each caller, decides
/// which scope names cover it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Resource {
    /// A twin, with the partition it lives in: a grant on the partition
    /// covers its twins' reads and writes.
    Twin {
        twin: TwinId,
        partition: PartitionId,
    },
    /// A partition's events or change stream.
    Partition(PartitionId),
    /// A lease's scope. Leasing is on the scope named, exactly: a grant to
    /// lease a partition does not lease its twins one by one (they would
    /// be fenced separately from the partition's writer).
    Lease(Scope),
    /// Operations data under `admin/<name>` (`audit`, `metrics`,
    /// `partitions`, ...). A resource this crate has no better name for is
    /// one of these, so it needs an admin grant.
    Admin(String),
}

impl Resource {
    /// The canonical scope name: what grants are matched against first,
    /// and what the audit log records.
    pub fn scope(&self) -> String {
        match self {
            Self::Twin { twin, .. } => format!("twin/{}", twin.as_str()),
            Self::Partition(p) => format!("partition/{}", p.0),
            Self::Lease(s) => s.to_string(),
            Self::Admin(name) => format!("admin/{name}"),
        }
    }
}

/// Whether `principal` may do `action` on `resource`; the refusal names
/// the principal, the action and the scope.
///
/// - twins: a grant on `twin/<id>` or on the twin's `partition/<p>`;
/// - leases: a `lease` grant on the scope itself;
/// - admin data: `admin` on `admin/<name>` does everything `read` does.
pub fn authorize(
    principal: Principal<'_>,
    action: Action,
    resource: &Resource,
) -> Result<(), AuthError> {
    let Principal::Known(id) = principal else {
        return Ok(());
    };
    let scope = resource.scope();
    let allowed = id.allows(action, &scope)
        || match resource {
            Resource::Twin { partition, .. } if action != Action::Lease => {
                id.allows(action, &format!("partition/{}", partition.0))
            }
            Resource::Admin(_) if action == Action::Read => id.allows(Action::Admin, &scope),
            _ => false,
        };
    if allowed {
        Ok(())
    } else {
        Err(AuthError::Forbidden {
            principal: id.name().to_owned(),
            action,
            scope,
        })
    }
}

/// Whether what was bound to `owner` (a fencing token, a lease) is
/// `principal`'s. With authentication on, something bound to nobody (taken
/// before authentication was on, or unknown) is nobody's; with it off,
/// everything is everyone's.
pub fn owns(principal: Principal<'_>, owner: Option<&str>) -> bool {
    match principal {
        Principal::Anonymous => true,
        Principal::Known(id) => owner == Some(id.name()),
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::{hash_key, Auth, GrantFile, PrincipalFile, RoleFile};

    /// The roles of docs/security.md's example: device writers, partition
    /// workers, readers, operators.
    fn auth() -> Auth {
        let role = |grants: &[(&[Action], &[&str])]| RoleFile {
            grants: grants
                .iter()
                .map(|(a, s)| GrantFile {
                    actions: a.to_vec(),
                    scopes: s.iter().map(|s| (*s).to_owned()).collect(),
                })
                .collect(),
        };
        let roles: BTreeMap<String, RoleFile> = [
            (
                "device".to_owned(),
                role(&[(
                    &[Action::Lease, Action::Write, Action::Read],
                    &["twin/device-*"],
                )]),
            ),
            (
                "pworker".to_owned(),
                role(&[(&[Action::Lease, Action::Write], &["partition/*"])]),
            ),
            (
                "reader".to_owned(),
                role(&[(&[Action::Read], &["twin/*", "partition/*", "admin/*"])]),
            ),
            ("ops".to_owned(), role(&[(&[Action::Admin], &["*"])])),
        ]
        .into();
        let principals: Vec<PrincipalFile> = ["device", "pworker", "reader", "ops"]
            .iter()
            .map(|n| PrincipalFile {
                name: (*n).to_owned(),
                key_sha256: hash_key(&format!("key-{n}")),
                roles: vec![(*n).to_owned()],
            })
            .collect();
        Auth::new(&roles, &principals).unwrap()
    }

    fn twin(id: &str, p: u32) -> Resource {
        Resource::Twin {
            twin: TwinId::new(id).unwrap(),
            partition: PartitionId(p),
        }
    }

    fn ok(a: &Auth, who: &str, action: Action, r: &Resource) -> bool {
        authorize(Principal::Known(a.identity(who).unwrap()), action, r).is_ok()
    }

    #[test]
    fn grants_match_their_actions_and_wildcard_scopes_only() {
        let a = auth();
        assert!(ok(&a, "device", Action::Write, &twin("device-1", 3)));
        assert!(ok(&a, "device", Action::Read, &twin("device-", 3)));
        assert!(!ok(&a, "device", Action::Write, &twin("pump-1", 3)));
        assert!(!ok(&a, "device", Action::Admin, &twin("device-1", 3)));
        assert!(!ok(
            &a,
            "device",
            Action::Read,
            &Resource::Partition(PartitionId(3))
        ));
        assert!(!ok(&a, "reader", Action::Write, &twin("device-1", 3)));
    }

    #[test]
    fn a_partition_grant_covers_its_twins_reads_and_writes() {
        let a = auth();
        assert!(ok(&a, "pworker", Action::Write, &twin("pump-1", 3)));
        assert!(ok(
            &a,
            "pworker",
            Action::Write,
            &Resource::Partition(PartitionId(3))
        ));
        assert!(!ok(&a, "pworker", Action::Read, &twin("pump-1", 3)));
    }

    #[test]
    fn leases_are_on_the_scope_named_exactly() {
        let a = auth();
        let lease = |s: &str| Resource::Lease(s.parse().unwrap());
        assert!(ok(&a, "device", Action::Lease, &lease("twin/device-9")));
        assert!(ok(&a, "pworker", Action::Lease, &lease("partition/3")));
        // A partition grant does not lease the partition's twins.
        assert!(!ok(&a, "pworker", Action::Lease, &lease("twin/device-9")));
        assert!(!ok(&a, "pworker", Action::Lease, &twin("device-9", 3)));
        assert!(!ok(&a, "device", Action::Lease, &lease("partition/3")));
        assert!(!ok(&a, "ops", Action::Lease, &lease("twin/device-9")));
    }

    #[test]
    fn admin_data_needs_read_or_admin_and_unknown_routes_need_admin() {
        let a = auth();
        let audit = Resource::Admin("audit".into());
        let metrics = Resource::Admin("metrics".into());
        assert!(ok(&a, "reader", Action::Read, &metrics));
        assert!(ok(&a, "ops", Action::Read, &metrics));
        assert!(ok(&a, "ops", Action::Admin, &audit));
        assert!(!ok(&a, "reader", Action::Admin, &audit));
        assert!(!ok(&a, "device", Action::Read, &metrics));
        // A route nobody named a resource for is admin data: admin only.
        let unknown = Resource::Admin("v1/new-route".into());
        assert!(ok(&a, "ops", Action::Admin, &unknown));
        assert!(!ok(&a, "reader", Action::Admin, &unknown));
        assert!(!ok(&a, "device", Action::Admin, &unknown));
    }

    #[test]
    fn refusals_name_principal_action_and_scope() {
        let a = auth();
        let e = authorize(
            Principal::Known(a.identity("device").unwrap()),
            Action::Write,
            &twin("pump-1", 3),
        )
        .unwrap_err();
        assert_eq!(
            e,
            AuthError::Forbidden {
                principal: "device".into(),
                action: Action::Write,
                scope: "twin/pump-1".into()
            }
        );
        assert_eq!(
            e.to_string(),
            "principal \"device\" may not write on twin/pump-1"
        );
    }

    #[test]
    fn anonymous_may_do_everything_and_owns_everything() {
        for r in [twin("x", 0), Resource::Admin("audit".into())] {
            for act in [Action::Lease, Action::Write, Action::Read, Action::Admin] {
                assert!(authorize(Principal::Anonymous, act, &r).is_ok());
            }
        }
        assert!(owns(Principal::Anonymous, None));
        assert_eq!(Principal::Anonymous.name(), ANONYMOUS);
    }

    #[test]
    fn only_the_bound_principal_owns() {
        let a = auth();
        let d = Principal::Known(a.identity("device").unwrap());
        assert!(owns(d, Some("device")));
        assert!(!owns(d, Some("ops")));
        // Bound to nobody (before authentication was on): nobody's.
        assert!(!owns(d, None));
    }
}
