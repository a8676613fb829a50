//! Shared test support: a store served over real HTTP on a loopback port
//! (in-process, or as a real `palisade serve` process), and a small client.
//! Included by each test binary with `#[path = "../support.rs"] mod support;`.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use palisade::http::HttpConfig;
use palisade::log::{Store, StoreConfig};
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// Open the store in `path`, in this process. sled writes its last buffers
/// from its own thread pool, which can hold the folder's file lock for a
/// moment after the previous `Store` in this process was closed and
/// dropped; an in-process reopen waits for that (a process restart never
/// sees it: the lock dies with the process). Any other error, or a lock
/// still held after 10 s, panics.
pub fn open_store(path: &Path, cfg: StoreConfig) -> Store {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match Store::open(path, cfg.clone()) {
            Ok(store) => return store,
            Err(e) if e.to_string().contains("lock") && std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => panic!("cannot open the store in {}: {e}", path.display()),
        }
    }
}

/// A store in a folder, served by the real axum router on 127.0.0.1:0.
pub struct TestServer {
    pub base: String,
    pub store: Arc<Store>,
    pub path: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
}

impl TestServer {
    pub async fn start(path: &Path) -> Self {
        Self::start_with(path, StoreConfig::default(), HttpConfig::default()).await
    }

    pub async fn start_with(path: &Path, store_cfg: StoreConfig, http: HttpConfig) -> Self {
        let store = Arc::new(open_store(path, store_cfg));
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let base = format!("http://{}", listener.local_addr().unwrap());
        let (tx, rx) = oneshot::channel::<()>();
        let task = tokio::spawn(palisade::http::run(listener, store.clone(), http, async {
            let _ = rx.await;
        }));
        Self {
            base,
            store,
            path: path.to_owned(),
            stop: Some(tx),
            task: Some(task),
        }
    }

    /// Graceful stop: finish requests, close the store (flushing it).
    pub async fn stop(mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.task.take() {
            t.await.unwrap().unwrap();
        }
        self.store.close().await;
    }

    pub fn client(&self) -> Client {
        Client::new(&self.base)
    }
}

/// A real `palisade serve` process on a loopback port.
pub struct ServeProcess {
    pub child: Child,
    pub base: String,
}

impl ServeProcess {
    pub fn start(data: &Path, extra: &[&str]) -> Self {
        let child = Command::new(env!("CARGO_BIN_EXE_palisade"))
            .arg("serve")
            .arg("--data")
            .arg(data)
            .args(["--listen", "127.0.0.1:0"])
            .args(extra)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn palisade serve");
        Self::ready(child)
    }

    /// Wait for a spawned `palisade serve` (stdout piped) to print its
    /// listening line; for processes started otherwise than by [`Self::start`].
    pub fn ready(mut child: Child) -> Self {
        let stdout = child.stdout.take().unwrap();
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .expect("read ready line");
        let base = line
            .trim()
            .strip_prefix("palisade listening on ")
            .unwrap_or_else(|| panic!("unexpected first line from palisade serve: {line:?}"))
            .to_owned();
        Self { child, base }
    }

    pub fn client(&self) -> Client {
        Client::new(&self.base)
    }

    pub fn signal(&self, sig: &str) {
        let status = Command::new("kill")
            .arg(format!("-{sig}"))
            .arg(self.child.id().to_string())
            .status()
            .unwrap();
        assert!(status.success(), "kill -{sig} failed");
    }

    /// SIGTERM and wait for a clean exit.
    pub fn terminate(mut self) {
        self.signal("TERM");
        let status = self.child.wait().unwrap();
        assert!(status.success(), "palisade serve exited with {status}");
    }

    /// SIGKILL: a crash, no chance to flush.
    pub fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for ServeProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A thin JSON client over reqwest.
#[derive(Clone)]
pub struct Client {
    pub base: String,
    pub http: reqwest::Client,
}

/// A response: status and JSON body (Null if the body was empty or not JSON).
#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub body: Value,
    pub headers: reqwest::header::HeaderMap,
}

impl Client {
    pub fn new(base: &str) -> Self {
        Self {
            base: base.to_owned(),
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(30))
                .build()
                .unwrap(),
        }
    }

    async fn finish(r: reqwest::Response) -> Resp {
        let status = r.status().as_u16();
        let headers = r.headers().clone();
        let bytes = r.bytes().await.unwrap();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Resp {
            status,
            body,
            headers,
        }
    }

    pub async fn get(&self, path: &str) -> Resp {
        Self::finish(
            self.http
                .get(format!("{}{path}", self.base))
                .send()
                .await
                .unwrap(),
        )
        .await
    }

    /// `/metrics` as text (Prometheus exposition format).
    pub async fn metrics_text(&self) -> String {
        self.http
            .get(format!("{}/metrics", self.base))
            .send()
            .await
            .unwrap()
            .text()
            .await
            .unwrap()
    }

    pub async fn post_json(&self, path: &str, body: &Value) -> Resp {
        Self::finish(
            self.http
                .post(format!("{}{path}", self.base))
                .json(body)
                .send()
                .await
                .unwrap(),
        )
        .await
    }

    pub async fn delete(&self, path: &str) -> Resp {
        Self::finish(
            self.http
                .delete(format!("{}{path}", self.base))
                .send()
                .await
                .unwrap(),
        )
        .await
    }

    /// POST /v1/leases; panics unless 201.
    pub async fn acquire(&self, scope: &str, holder: &str, ttl_ms: u64) -> Value {
        let r = self.try_acquire(scope, holder, ttl_ms).await;
        assert_eq!(r.status, 201, "acquire {scope} by {holder}: {:?}", r.body);
        r.body
    }

    pub async fn try_acquire(&self, scope: &str, holder: &str, ttl_ms: u64) -> Resp {
        self.post_json(
            "/v1/leases",
            &json!({ "scope": scope, "holder": holder, "ttl_ms": ttl_ms }),
        )
        .await
    }

    /// POST /v1/twins/{twin}/events with a Fencing-Token header and a raw body.
    pub async fn append_raw(&self, twin: &str, token: Option<&str>, body: Vec<u8>) -> Resp {
        let mut req = self
            .http
            .post(format!("{}/v1/twins/{twin}/events", self.base))
            .header("content-type", "application/json")
            .body(body);
        if let Some(t) = token {
            req = req.header("fencing-token", t);
        }
        Self::finish(req.send().await.unwrap()).await
    }

    pub async fn append(&self, twin: &str, token: u64, body: &Value) -> Resp {
        self.append_raw(
            twin,
            Some(&token.to_string()),
            serde_json::to_vec(body).unwrap(),
        )
        .await
    }

    /// Append one event `{type, patch, event_id}`.
    pub async fn put(&self, twin: &str, token: u64, event_id: &str, patch: Value) -> Resp {
        self.append(
            twin,
            token,
            &json!({ "type": "update", "patch": patch, "event_id": event_id }),
        )
        .await
    }

    pub async fn twin(&self, twin: &str) -> Resp {
        self.get(&format!("/v1/twins/{twin}")).await
    }
}

pub fn token_of(lease: &Value) -> u64 {
    lease["token"].as_u64().expect("lease has a token")
}

pub fn lease_id_of(lease: &Value) -> String {
    lease["lease_id"]
        .as_str()
        .expect("lease has an id")
        .to_owned()
}

/// A self-signed certificate for 127.0.0.1 and localhost, as PEM files.
pub struct Cert {
    pub cert_pem: String,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// [`Cert`] written to `dir` (`cert.pem`, `key.pem`).
pub fn mint_cert(dir: &Path) -> Cert {
    let ck =
        rcgen::generate_simple_self_signed(vec!["127.0.0.1".into(), "localhost".into()]).unwrap();
    let cert = dir.join("cert.pem");
    let key = dir.join("key.pem");
    std::fs::write(&cert, ck.cert.pem()).unwrap();
    std::fs::write(&key, ck.key_pair.serialize_pem()).unwrap();
    Cert {
        cert_pem: ck.cert.pem(),
        cert,
        key,
    }
}

/// A security file `security.toml` in `dir`: the `roles` tables (TOML) and
/// one principal per `(name, role)` with a fresh API key. Its path, and the
/// keys by principal name.
pub fn security_file(
    dir: &Path,
    roles: &str,
    principals: &[(&str, &str)],
) -> (PathBuf, std::collections::HashMap<String, String>) {
    let mut file = roles.to_owned();
    let mut keys = std::collections::HashMap::new();
    for (name, role) in principals {
        let key = palisade::http::auth::mint_key().unwrap().0;
        file.push_str(&format!(
            "\n[[principals]]\nname = \"{name}\"\nkey_sha256 = \"{}\"\nroles = [\"{role}\"]\n",
            palisade::http::auth::hash_key(&key)
        ));
        keys.insert((*name).to_owned(), key);
    }
    let path = dir.join("security.toml");
    std::fs::write(&path, file).unwrap();
    (path, keys)
}
