//! `palisade serve`'s security at start-up: the `--security` file
//! (principals, roles, limits), TLS (`--tls-cert`/`--tls-key`), and the bind
//! policy: without authentication the store serves loopback only, unless
//! `--insecure` says otherwise, loudly. See docs/security.md.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;

use anyhow::bail;
use palisade_http::{HttpConfig, Security};
use palisade_log::Store;
use tokio::net::TcpListener;

use crate::config::ServeConfig;

/// The security `palisade serve` runs with.
pub struct ServeSecurity {
    pub http: Security,
    pub tls: Option<palisade_http::tls::TlsAcceptor>,
    listen: SocketAddr,
    insecure: bool,
}

/// The root certificates in the PEM file `path`, for a client that trusts
/// only them (`flag` names the setting in errors): an unreadable file or one
/// without a certificate is an error.
pub fn pem_roots(path: &std::path::Path, flag: &str) -> anyhow::Result<Vec<reqwest::Certificate>> {
    use anyhow::Context;
    let what = || format!("{flag} {}", path.display());
    let pem = std::fs::read(path).with_context(what)?;
    let roots = reqwest::Certificate::from_pem_bundle(&pem).with_context(what)?;
    if roots.is_empty() {
        bail!(
            "{}: no PEM certificate (-----BEGIN CERTIFICATE-----) in it",
            what()
        );
    }
    Ok(roots)
}

/// Load the settings and apply the bind policy. Runs before the store is
/// opened or a socket bound, so a refused start changes nothing.
pub fn prepare(config: &ServeConfig) -> anyhow::Result<ServeSecurity> {
    let http = match &config.security {
        Some(path) => Security::load(path).map_err(anyhow::Error::msg)?,
        None => Security::default(),
    };
    let tls = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Some(palisade_http::tls::acceptor(cert, key)?),
        (None, None) => None,
        _ => bail!("--tls-cert and --tls-key go together: give both or neither"),
    };
    let listen = config.listen;
    if !listen.ip().is_loopback() && !config.insecure {
        if !http.auth_enabled() {
            bail!(
                "refusing to listen on {listen}: authentication is off, so anyone who can reach \
                 that address could take any lease and write any twin. Configure principals \
                 (--security FILE, see docs/security.md), or listen on 127.0.0.1, or pass \
                 --insecure to do it anyway"
            );
        }
        if tls.is_none() {
            bail!(
                "refusing to listen on {listen} without TLS: API keys would cross the network \
                 in clear text. Give --tls-cert and --tls-key (see docs/security.md), or pass \
                 --insecure (e.g. behind a TLS-terminating proxy)"
            );
        }
    }
    Ok(ServeSecurity {
        http,
        tls,
        listen,
        insecure: config.insecure,
    })
}

impl std::fmt::Debug for ServeSecurity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServeSecurity")
            .field("http", &self.http)
            .field("tls", &self.tls.is_some())
            .field("listen", &self.listen)
            .field("insecure", &self.insecure)
            .finish()
    }
}

impl ServeSecurity {
    pub fn scheme(&self) -> &'static str {
        if self.tls.is_some() {
            "https"
        } else {
            "http"
        }
    }

    /// Say on stderr how the store is exposed (stdout's first line is the
    /// address, for scripts).
    pub fn announce(&self, addr: SocketAddr) {
        let auth = self.http.auth_enabled();
        if self.insecure && !self.listen.ip().is_loopback() && (!auth || self.tls.is_none()) {
            let what = if auth {
                "API keys travel in clear text"
            } else {
                "authentication is OFF: anyone who can reach it can take any lease and write any twin"
            };
            let banner = "!".repeat(78);
            eprintln!("{banner}\npalisade: --insecure: serving {addr}; {what}.\n{banner}");
            tracing::warn!(%addr, auth, tls = self.tls.is_some(), "serving a network address insecurely");
        } else if !auth {
            eprintln!(
                "palisade: authentication is off; listening on loopback only ({addr}). \
                 See docs/security.md to serve a network."
            );
        } else {
            let n = self
                .http
                .auth
                .as_ref()
                .map_or(0, |a| a.principals().count());
            tracing::info!(%addr, principals = n, tls = self.tls.is_some(), "authentication on");
        }
    }

    /// Serve HTTP or HTTPS on `listener` with these settings.
    pub async fn run(
        &self,
        listener: TcpListener,
        store: Arc<Store>,
        mut http: HttpConfig,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        http.security = self.http.clone();
        match &self.tls {
            Some(acceptor) => {
                palisade_http::run_tls(listener, acceptor.clone(), store, http, shutdown).await
            }
            None => palisade_http::run(listener, store, http, shutdown).await,
        }
    }
}

/// The Kafka path with authentication on: a record is applied only if it
/// is signed by a known principal (`palisade_kafka::sign`), that principal
/// may `write` the twin (or its partition), and the record's fencing token
/// was granted to it. Anything else is dead-lettered and audited.
#[derive(Debug)]
pub struct KafkaAuth {
    auth: Arc<palisade_auth::Auth>,
    store: Arc<Store>,
}

impl KafkaAuth {
    pub fn new(auth: Arc<palisade_auth::Auth>, store: Arc<Store>) -> Self {
        Self { auth, store }
    }

    fn refuse(
        &self,
        principal: &str,
        decoded: &palisade_kafka::Decoded,
        outcome: palisade_log::AuditOutcome,
        reason: &'static str,
        detail: String,
    ) -> palisade_kafka::Refusal {
        self.store.audit().record(palisade_log::AuditRecord {
            seq: 0,
            at_ms: 0,
            action: palisade_log::AuditAction::Write,
            outcome,
            principal: principal.to_owned(),
            scope: format!("twin/{}", decoded.twin.as_str()),
            token: decoded.token.0,
            lease_id: 0,
            detail: format!("kafka {reason}"),
        });
        palisade_kafka::Refusal { reason, detail }
    }
}

impl palisade_kafka::RecordAuth for KafkaAuth {
    fn check(
        &self,
        raw: &palisade_kafka::RawRecord<'_>,
        decoded: &palisade_kafka::Decoded,
    ) -> Result<(), palisade_kafka::Refusal> {
        use palisade_auth::{authorize, owns, Action, Principal, Resource};
        use palisade_kafka::sign;
        use palisade_log::AuditOutcome as O;
        let claimed = sign::claimed_principal(raw)
            .map_err(|r| self.refuse("", decoded, O::Unauthenticated, r.reason, r.detail))?;
        let Some(id) = self.auth.identity(claimed) else {
            return Err(self.refuse(
                "",
                decoded,
                O::Unauthenticated,
                "unauthenticated",
                format!("no principal named {claimed:?}"),
            ));
        };
        sign::verify(raw, claimed, &id.key_sha256())
            .map_err(|r| self.refuse("", decoded, O::Unauthenticated, r.reason, r.detail))?;
        // The same policy as the HTTP path's appends (palisade-auth): write
        // on the twin or its partition, with a token bound to the signer.
        let principal = Principal::Known(id);
        let twin = Resource::Twin {
            twin: decoded.twin.clone(),
            partition: self.store.partition_of(&decoded.twin),
        };
        if let Err(e) = authorize(principal, Action::Write, &twin) {
            return Err(self.refuse(claimed, decoded, O::Forbidden, "forbidden", e.to_string()));
        }
        match self.store.audit().token_owner(decoded.token) {
            Ok(owner) if owns(principal, owner.as_deref()) => Ok(()),
            Ok(_) => Err(self.refuse(
                claimed,
                decoded,
                O::Forbidden,
                "token_not_yours",
                format!(
                    "fencing token {} was not granted to {claimed:?}",
                    decoded.token.0
                ),
            )),
            Err(e) => Err(self.refuse(
                claimed,
                decoded,
                O::Refused,
                "storage",
                format!("token owners could not be read: {e}"),
            )),
        }
    }
}

impl ServeSecurity {
    /// The Kafka ingester's settings with this security: with
    /// authentication on, records must be signed (see [`KafkaAuth`]).
    pub fn kafka(
        &self,
        mut cfg: palisade_kafka::IngestConfig,
        store: &Arc<Store>,
    ) -> palisade_kafka::IngestConfig {
        if let Some(auth) = &self.http.auth {
            cfg.auth = Some(Arc::new(KafkaAuth {
                auth: auth.clone(),
                store: store.clone(),
            }));
        }
        cfg
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;
    use palisade_http::SecurityFile;

    #[test]
    fn the_example_security_file_parses_and_turns_authentication_on() {
        let f: SecurityFile =
            toml::from_str(include_str!("../../../palisade.security.example.toml")).unwrap();
        let s = Security::from_file(&f).unwrap();
        let auth = s.auth.unwrap();
        assert_eq!(auth.principals().count(), 2);
        let ops = auth.identity("ops").unwrap();
        assert!(ops.allows(palisade_auth::Action::Admin, "admin/audit"));
        assert!(ops.allows(palisade_auth::Action::Read, "twin/x"));
        assert!(!ops.allows(palisade_auth::Action::Write, "twin/x"));
    }
}
