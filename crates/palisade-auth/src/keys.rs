//! Principals and their API keys: the security file's principals and
//! roles, resolved into identities; key hashing and minting.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::{Action, AuthError};

/// One grant of a role, as written in the security file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantFile {
    pub actions: Vec<Action>,
    pub scopes: Vec<String>,
}

/// A role, as written in the security file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RoleFile {
    pub grants: Vec<GrantFile>,
}

/// A principal, as written in the security file.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PrincipalFile {
    /// The principal's name: the lease holder of every lease it takes.
    pub name: String,
    /// SHA-256 of its API key, 64 hex characters (`palisade auth mint-key`).
    pub key_sha256: String,
    pub roles: Vec<String>,
}

/// A principal with its grants resolved.
#[derive(Clone)]
pub struct Identity {
    name: String,
    key_hash: [u8; 32],
    grants: Vec<(Vec<Action>, Vec<String>)>,
}

impl fmt::Debug for Identity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The key hash stays out of logs.
        f.debug_struct("Identity")
            .field("name", &self.name)
            .field("grants", &self.grants)
            .finish_non_exhaustive()
    }
}

impl Identity {
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The SHA-256 of the principal's API key: also its Kafka record
    /// signing key (`palisade_kafka::sign`).
    pub fn key_sha256(&self) -> [u8; 32] {
        self.key_hash
    }

    /// Whether a grant allows `action` on the concrete scope `scope`.
    pub fn allows(&self, action: Action, scope: &str) -> bool {
        self.grants.iter().any(|(actions, patterns)| {
            actions.contains(&action) && patterns.iter().any(|p| glob(p, scope))
        })
    }
}

/// The principals of a store with authentication on.
#[derive(Debug, Clone)]
pub struct Auth {
    principals: Vec<Identity>,
}

/// Longest principal name (the lease holder name has the same bound).
const MAX_NAME: usize = 256;

impl Auth {
    /// Resolve roles and check the file: every role named exists, names are
    /// unique and valid holder names, hashes are 64 hex characters and
    /// distinct, patterns are non-empty.
    pub fn new(
        roles: &BTreeMap<String, RoleFile>,
        principals: &[PrincipalFile],
    ) -> Result<Self, AuthError> {
        for (name, role) in roles {
            for g in &role.grants {
                if g.actions.is_empty() || g.scopes.is_empty() {
                    return Err(AuthError::EmptyGrant { role: name.clone() });
                }
                if let Some(p) = g.scopes.iter().find(|p| p.is_empty()) {
                    return Err(AuthError::EmptyPattern {
                        role: name.clone(),
                        pattern: p.clone(),
                    });
                }
            }
        }
        let mut out: Vec<Identity> = Vec::with_capacity(principals.len());
        for p in principals {
            if p.name.is_empty() || p.name.len() > MAX_NAME || p.name.chars().any(char::is_control)
            {
                return Err(AuthError::BadName {
                    name: p.name.clone(),
                    max: MAX_NAME,
                });
            }
            if out.iter().any(|o| o.name == p.name) {
                return Err(AuthError::DuplicateName {
                    name: p.name.clone(),
                });
            }
            let key_hash = parse_hash(&p.key_sha256).ok_or_else(|| AuthError::BadKeyHash {
                name: p.name.clone(),
            })?;
            if let Some(o) = out.iter().find(|o| o.key_hash == key_hash) {
                return Err(AuthError::SameKey {
                    first: o.name.clone(),
                    second: p.name.clone(),
                });
            }
            let mut grants = Vec::new();
            for r in &p.roles {
                let role = roles.get(r).ok_or_else(|| AuthError::NoSuchRole {
                    principal: p.name.clone(),
                    role: r.clone(),
                })?;
                grants.extend(
                    role.grants
                        .iter()
                        .map(|g| (g.actions.clone(), g.scopes.clone())),
                );
            }
            out.push(Identity {
                name: p.name.clone(),
                key_hash,
                grants,
            });
        }
        if out.is_empty() {
            return Err(AuthError::NoPrincipals);
        }
        Ok(Self { principals: out })
    }

    /// The principal whose key this is. Every stored hash is compared, in
    /// constant time, whatever matches: the time taken does not depend on
    /// which principal (if any) the key belongs to.
    pub fn authenticate(&self, key: &str) -> Option<&Identity> {
        let h = sha256(key.as_bytes());
        let mut found = None;
        for p in &self.principals {
            if bool::from(p.key_hash.ct_eq(&h)) {
                found = Some(p);
            }
        }
        found
    }

    /// The principal named `name`.
    pub fn identity(&self, name: &str) -> Option<&Identity> {
        self.principals.iter().find(|p| p.name == name)
    }

    pub fn principals(&self) -> impl Iterator<Item = &Identity> {
        self.principals.iter()
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let d = Sha256::digest(bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(d.as_slice());
    out
}

fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        s.push(DIGITS[usize::from(b >> 4)] as char);
        s.push(DIGITS[usize::from(b & 0xf)] as char);
    }
    s
}

fn parse_hash(text: &str) -> Option<[u8; 32]> {
    let t = text.trim().as_bytes();
    if t.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, pair) in t.chunks(2).enumerate() {
        let s = std::str::from_utf8(pair).ok()?;
        out[i] = u8::from_str_radix(s, 16).ok()?;
    }
    Some(out)
}

/// The SHA-256 of an API key, as the security file stores it (hex).
pub fn hash_key(key: &str) -> String {
    hex(&sha256(key.as_bytes()))
}

/// A new API key (`psk_` and 64 hex characters: 256 random bits from the
/// operating system) and its hash.
pub fn mint_key() -> Result<(String, String), AuthError> {
    let mut raw = [0u8; 32];
    getrandom::getrandom(&mut raw).map_err(|e| AuthError::NoRandomness(e.to_string()))?;
    let key = format!("psk_{}", hex(&raw));
    let hash = hash_key(&key);
    Ok((key, hash))
}

/// `*` matches any run of characters (also `/`); everything else itself.
pub fn glob(pattern: &str, text: &str) -> bool {
    let (p, t) = (pattern.as_bytes(), text.as_bytes());
    // Iterative matching with one backtrack point: linear in practice, no
    // recursion on hostile input.
    let (mut pi, mut ti) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while ti < t.len() {
        if pi < p.len() && p[pi] == b'*' {
            star = Some((pi, ti));
            pi += 1;
        } else if pi < p.len() && p[pi] == t[ti] {
            pi += 1;
            ti += 1;
        } else if let Some((sp, st)) = star {
            pi = sp + 1;
            ti = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    p[pi..].iter().all(|&c| c == b'*')
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    fn auth(key_a: &str, key_b: &str) -> Auth {
        let roles: BTreeMap<String, RoleFile> = [
            (
                "device-writer".to_owned(),
                RoleFile {
                    grants: vec![GrantFile {
                        actions: vec![Action::Lease, Action::Write],
                        scopes: vec!["twin/device-*".into()],
                    }],
                },
            ),
            (
                "ops".to_owned(),
                RoleFile {
                    grants: vec![GrantFile {
                        actions: vec![Action::Admin, Action::Read],
                        scopes: vec!["*".into()],
                    }],
                },
            ),
        ]
        .into();
        let principals = [
            PrincipalFile {
                name: "a".into(),
                key_sha256: hash_key(key_a),
                roles: vec!["device-writer".into()],
            },
            PrincipalFile {
                name: "b".into(),
                key_sha256: hash_key(key_b).to_uppercase(),
                roles: vec!["ops".into()],
            },
        ];
        Auth::new(&roles, &principals).unwrap()
    }

    #[test]
    fn keys_authenticate_their_principal_only() {
        let a = auth("key-a", "key-b");
        assert_eq!(a.authenticate("key-a").unwrap().name(), "a");
        assert_eq!(a.authenticate("key-b").unwrap().name(), "b");
        assert!(a.authenticate("key-c").is_none());
        assert!(a.authenticate("").is_none());
    }

    #[test]
    fn grants_cover_their_actions_and_scopes_only() {
        let a = auth("key-a", "key-b");
        let w = a.authenticate("key-a").unwrap();
        assert!(w.allows(Action::Write, "twin/device-1"));
        assert!(w.allows(Action::Lease, "twin/device-1"));
        assert!(!w.allows(Action::Read, "twin/device-1"));
        assert!(!w.allows(Action::Write, "twin/pump-1"));
        assert!(!w.allows(Action::Lease, "partition/3"));
        let o = a.authenticate("key-b").unwrap();
        assert!(o.allows(Action::Admin, "admin/audit"));
        assert!(!o.allows(Action::Write, "twin/device-1"));
    }

    #[test]
    fn globs() {
        assert!(glob("*", ""));
        assert!(glob("partition/*", "partition/12"));
        assert!(!glob("partition/*", "twin/12"));
        assert!(glob("twin/device-*", "twin/device-"));
        assert!(glob("twin/*-7", "twin/pump-7"));
        assert!(!glob("twin/*-7", "twin/pump-71"));
        assert!(glob("a*b*c", "aXXbYYbc"));
        assert!(!glob("twin/x", "twin/xy"));
        assert!(glob(&"*".repeat(50), &"a".repeat(500)));
    }

    #[test]
    fn bad_files_are_refused_with_the_name() {
        let roles = BTreeMap::new();
        let p = |name: &str, hash: &str, role: &str| PrincipalFile {
            name: name.into(),
            key_sha256: hash.into(),
            roles: vec![role.into()],
        };
        let e = Auth::new(&roles, &[p("a", "zz", "x")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("64 hex"), "{e}");
        let e = Auth::new(&roles, &[p("a", &hash_key("k"), "x")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("no role named \"x\""), "{e}");
        assert!(Auth::new(&roles, &[]).is_err());
    }

    #[test]
    fn minted_keys_hash_to_the_printed_hash() {
        let (k, h) = mint_key().unwrap();
        assert!(k.starts_with("psk_") && k.len() == 68, "{k}");
        assert_eq!(hash_key(&k), h);
        assert_ne!(mint_key().unwrap().0, k);
    }
}
