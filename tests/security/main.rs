//! Authentication, authorization, TLS, limits and audit, end to end: a real
//! store served by the real router over HTTPS (rustls, a certificate minted
//! by rcgen) on 127.0.0.1:0, driven by a real reqwest client; and real
//! `palisade serve` processes for the start-up policy. See README.md.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    missing_debug_implementations
)]

#[path = "../support.rs"]
mod support;

#[path = "01_table.rs"]
mod table;

#[path = "02_stolen.rs"]
mod stolen;

#[path = "03_startup.rs"]
mod startup;

#[path = "04_limits.rs"]
mod limits;

#[path = "05_audit.rs"]
mod audit;

#[path = "06_kafka.rs"]
mod kafka;

#[path = "07_overhead.rs"]
mod overhead;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use palisade::http::{HttpConfig, Security, SecurityFile};
use palisade::log::{Store, StoreConfig};
use serde_json::{json, Value};
use tempfile::TempDir;
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// Roles used by the tests (a security file's `[roles]`).
pub const ROLES: &str = r#"
[roles.device-worker]
grants = [
  { actions = ["lease", "write", "read"], scopes = ["twin/device-*"] },
]
[roles.partition-worker]
grants = [
  { actions = ["lease", "write"], scopes = ["partition/*"] },
]
[roles.reader]
grants = [
  { actions = ["read"], scopes = ["twin/*", "partition/*", "admin/*"] },
]
[roles.ops]
grants = [
  { actions = ["admin"], scopes = ["*"] },
]
"#;

/// Principals and their roles; each gets a fresh key per test.
pub const PRINCIPALS: &[(&str, &[&str])] = &[
    ("worker-a", &["device-worker"]),
    ("worker-b", &["device-worker"]),
    ("pworker", &["partition-worker"]),
    ("reader", &["reader"]),
    ("ops", &["ops"]),
    ("nobody", &[]),
];

pub use support::{mint_cert, Cert};

/// The security file text for `PRINCIPALS` with these keys, plus `extra`
/// (top-level settings and tables such as `[limits]`, written first).
pub fn security_toml(keys: &BTreeMap<String, String>, extra: &str) -> String {
    let mut t = format!("{extra}\n{ROLES}\n");
    for (name, roles) in PRINCIPALS {
        let hash = palisade::http::auth::hash_key(&keys[*name]);
        let roles: Vec<String> = roles.iter().map(|r| format!("{r:?}")).collect();
        t.push_str(&format!(
            "[[principals]]\nname = {name:?}\nkey_sha256 = \"{hash}\"\nroles = [{}]\n",
            roles.join(", ")
        ));
    }
    t
}

pub fn fresh_keys() -> BTreeMap<String, String> {
    PRINCIPALS
        .iter()
        .map(|(n, _)| ((*n).to_owned(), palisade::http::auth::mint_key().unwrap().0))
        .collect()
}

/// A store served over HTTPS in-process, with its principals' keys.
pub struct Secure {
    pub dir: TempDir,
    pub base: String,
    pub store: Arc<Store>,
    pub keys: BTreeMap<String, String>,
    pub http: reqwest::Client,
    pub security: Security,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

/// Start with authentication on (every principal of `PRINCIPALS`) and the
/// settings in `extra` (e.g. a `[limits]` table).
pub async fn start(extra: &str) -> Secure {
    start_with(extra, HttpConfig::default()).await
}

pub async fn start_with(extra: &str, mut http: HttpConfig) -> Secure {
    let keys = fresh_keys();
    let text = security_toml(&keys, extra);
    let file: SecurityFile = toml::from_str(&text).unwrap();
    http.security = Security::from_file(&file).unwrap();
    assert!(http.security.auth_enabled());
    serve(keys, http).await
}

/// Start with authentication off (limits from `extra` still apply).
pub async fn start_open(extra: &str) -> Secure {
    let file: SecurityFile = toml::from_str(extra).unwrap();
    let http = HttpConfig {
        security: Security::from_file(&file).unwrap(),
        ..HttpConfig::default()
    };
    assert!(!http.security.auth_enabled());
    serve(BTreeMap::new(), http).await
}

async fn serve(keys: BTreeMap<String, String>, http: HttpConfig) -> Secure {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let cert = mint_cert(dir.path());
    let acceptor = palisade::http::tls::acceptor(&cert.cert, &cert.key).unwrap();
    let store = Arc::new(Store::open(&data, StoreConfig::default()).unwrap());
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("https://{}", listener.local_addr().unwrap());
    let (tx, rx) = oneshot::channel::<()>();
    let security = http.security.clone();
    let task = tokio::spawn(palisade::http::run_tls(
        listener,
        acceptor,
        store.clone(),
        http,
        async {
            let _ = rx.await;
        },
    ));
    Secure {
        dir,
        base,
        store,
        keys,
        http: https_client(&cert.cert_pem),
        security,
        stop: Some(tx),
        task: Some(task),
    }
}

/// A reqwest client that trusts only `cert_pem`.
pub fn https_client(cert_pem: &str) -> reqwest::Client {
    reqwest::Client::builder()
        .add_root_certificate(reqwest::Certificate::from_pem(cert_pem.as_bytes()).unwrap())
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// A response: status, headers and JSON body (Null if none).
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub body: Value,
    pub text: String,
    pub headers: reqwest::header::HeaderMap,
}

impl Secure {
    pub fn key(&self, principal: &str) -> &str {
        &self.keys[principal]
    }

    /// The principals this server checks keys against.
    pub fn http_security_auth(&self) -> Arc<palisade::http::auth::Auth> {
        self.security.auth.clone().expect("authentication is on")
    }

    /// Send a request as `who` (a principal name, `None` for no key, or
    /// `Some("!bad")` for a wrong key).
    pub async fn call(
        &self,
        who: Option<&str>,
        method: reqwest::Method,
        path: &str,
        body: Option<&Value>,
        headers: &[(&str, &str)],
    ) -> Resp {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        match who {
            Some("!bad") => req = req.bearer_auth("psk_not-a-key"),
            Some(p) if self.keys.contains_key(p) => req = req.bearer_auth(self.key(p)),
            _ => {}
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let r = req.send().await.unwrap();
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let text = r.text().await.unwrap();
        Resp {
            status,
            body: serde_json::from_str(&text).unwrap_or(Value::Null),
            text,
            headers,
        }
    }

    pub async fn get(&self, who: &str, path: &str) -> Resp {
        self.call(Some(who), reqwest::Method::GET, path, None, &[])
            .await
    }

    pub async fn acquire(&self, who: &str, scope: &str) -> Resp {
        self.call(
            Some(who),
            reqwest::Method::POST,
            "/v1/leases",
            Some(&json!({"scope": scope, "holder": who, "ttl_ms": 600_000})),
            &[],
        )
        .await
    }

    pub async fn append(&self, who: &str, twin: &str, token: u64, body: &Value) -> Resp {
        let t = token.to_string();
        self.call(
            Some(who),
            reqwest::Method::POST,
            &format!("/v1/twins/{twin}/events"),
            Some(body),
            &[("fencing-token", t.as_str())],
        )
        .await
    }

    pub async fn put(&self, who: &str, twin: &str, token: u64, patch: Value) -> Resp {
        self.append(who, twin, token, &json!({"type": "u", "patch": patch}))
            .await
    }

    /// Everything the store would show about itself, read as `ops`/`reader`
    /// (or anonymously with authentication off): for "changes nothing".
    pub async fn snapshot(&self, twins: &[&str]) -> Value {
        let who = if self.keys.is_empty() {
            "anon"
        } else {
            "reader"
        };
        let mut out = json!({
            "partitions": self.get(who, "/v1/partitions").await.body,
            "last_token": self.store.last_token().0,
        });
        for t in twins {
            out[*t] = json!({
                "state": self.get(who, &format!("/v1/twins/{t}")).await.body,
                "events": self.get(who, &format!("/v1/twins/{t}/events?limit=1000")).await.body,
            });
        }
        out
    }

    /// Stop serving and close the store; the folder lives on in the result.
    pub async fn stop(mut self) -> TempDir {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap().unwrap();
        }
        self.store.close().await;
        self.dir
    }
}

pub fn token_of(v: &Value) -> u64 {
    v["token"]
        .as_u64()
        .unwrap_or_else(|| panic!("no token in {v}"))
}

/// Assert an error response: status and stable `error` name, with a message.
#[track_caller]
pub fn assert_error(r: &Resp, status: u16, error: &str) {
    assert_eq!(
        r.status, status,
        "want {status} {error}, got {} {}",
        r.status, r.text
    );
    assert_eq!(r.body["error"], error, "body: {}", r.text);
    assert!(
        r.body["message"].as_str().is_some_and(|m| !m.is_empty()),
        "error body without a message: {}",
        r.text
    );
}
