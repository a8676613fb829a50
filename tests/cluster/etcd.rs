//! A real etcd for the tests: `etcd` (Debian's `etcd-server`) started by the
//! test on loopback, with a temporary data folder and free ports, killed on
//! drop.
//!
//! Missing etcd: in CI (`CI` set) the test panics (CI must prove this with a
//! real etcd); elsewhere the test prints SKIPPED and returns, following the
//! repo's `*_when_installed` convention.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use palisade_etcd::{EtcdAuthority, EtcdConfig};

pub struct Etcd {
    child: Child,
    pub endpoint: String,
    dir: tempfile::TempDir,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn etcd_binary() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("PALISADE_ETCD_BIN") {
        return Some(PathBuf::from(p));
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("etcd"))
            .find(|p| p.is_file())
    })
}

impl Etcd {
    /// Start etcd, or `None` (after printing SKIPPED) when it is not
    /// installed outside CI.
    pub async fn start(test: &str) -> Option<Self> {
        let Some(bin) = etcd_binary() else {
            assert!(
                std::env::var_os("CI").is_none(),
                "{test}: etcd is not installed, and CI must run this test (apt-get install etcd-server)"
            );
            eprintln!("\n******** SKIPPED {test}: etcd not installed (apt-get install etcd-server)\n******** (this fails when CI is set)\n");
            return None;
        };
        let mut dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("etcd.log");
        // A few tries: a free port can be taken between probe and bind.
        for attempt in 0..5 {
            let (client, peer) = (free_port(), free_port());
            let endpoint = format!("http://127.0.0.1:{client}");
            let peer_url = format!("http://127.0.0.1:{peer}");
            let _ = std::fs::remove_dir_all(dir.path().join("data"));
            let child = Command::new(&bin)
                .args(["--name", "palisade-test"])
                .arg("--data-dir")
                .arg(dir.path().join("data"))
                .args(["--listen-client-urls", &endpoint])
                .args(["--advertise-client-urls", &endpoint])
                .args(["--listen-peer-urls", &peer_url])
                .args(["--initial-advertise-peer-urls", &peer_url])
                .args(["--initial-cluster", &format!("palisade-test={peer_url}")])
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log).unwrap())
                .spawn()
                .expect("spawn etcd");
            let mut etcd = Self {
                child,
                endpoint,
                dir,
            };
            if etcd.wait_ready().await {
                return Some(etcd);
            }
            eprintln!(
                "etcd attempt {attempt} failed; its log:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
            let _ = etcd.child.kill();
            let _ = etcd.child.wait();
            dir = etcd.take_dir();
        }
        panic!("etcd did not start on loopback in 5 attempts");
    }

    fn take_dir(mut self) -> tempfile::TempDir {
        let _ = self.child.kill();
        let _ = self.child.wait();
        std::mem::replace(&mut self.dir, tempfile::tempdir().unwrap())
    }

    async fn wait_ready(&mut self) -> bool {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(30) {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if EtcdAuthority::connect(self.config()).await.is_ok() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    pub fn config(&self) -> EtcdConfig {
        let mut c = EtcdConfig::new(vec![self.endpoint.clone()]);
        c.timeout = Duration::from_secs(5);
        c
    }

    /// A fresh authority on its own key prefix (tests may share an etcd).
    pub async fn authority(&self, prefix: &str) -> EtcdAuthority {
        let mut c = self.config();
        c.prefix = format!("/{prefix}/");
        EtcdAuthority::connect(c).await.expect("connect to etcd")
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The create revision of `scope`'s lock key, read straight from etcd.
pub async fn create_revision(auth: &EtcdAuthority, scope: &str) -> Option<u64> {
    let scope: palisade::core::Scope = scope.parse().unwrap();
    auth.lock_revision(&scope).await.unwrap().map(|t| t.0)
}
