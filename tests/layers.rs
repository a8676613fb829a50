#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The crates' dependencies point one way (docs/architecture.md, "Crates"):
//! every dependency between the workspace's crates is in the table below,
//! and the production server (`palisade-server`) pulls in no benchmark,
//! client-command or dev-tool crate, and no PostgreSQL, plotting or
//! histogram crate. Read from `cargo metadata`, so a new `[dependencies]`
//! line that breaks the picture fails here.
//!
//! Guards against: a layer reaching up (the log depending on HTTP, the SDK
//! on the store), the benchmark harness or its dependencies creeping back
//! into the server, and the picture in the docs going stale (an edge the
//! table does not list fails until both are updated).

use std::collections::{BTreeMap, BTreeSet};
use std::process::Command;

use serde_json::Value;

/// Every allowed normal (non-dev) dependency between workspace crates.
const ALLOWED: &[(&str, &[&str])] = &[
    ("palisade-core", &[]),
    ("palisade-lease", &["palisade-core"]),
    ("palisade-twin", &["palisade-core"]),
    ("palisade-log", &["palisade-core", "palisade-lease", "palisade-twin"]),
    ("palisade-etcd", &["palisade-core", "palisade-lease"]),
    ("palisade-kafka", &["palisade-core", "palisade-log"]),
    (
        "palisade-http",
        &[
            "palisade-core",
            "palisade-lease",
            "palisade-log",
            "palisade-twin",
        ],
    ),
    ("palisade-client", &["palisade-core"]),
    (
        "palisade-server",
        &[
            "palisade-core",
            "palisade-etcd",
            "palisade-http",
            "palisade-kafka",
            "palisade-lease",
            "palisade-log",
        ],
    ),
    (
        "palisade-cli",
        &[
            "palisade-client",
            "palisade-core",
            "palisade-http",
            "palisade-kafka",
            "palisade-server",
        ],
    ),
    (
        "palisade-bench",
        &[
            "palisade-client",
            "palisade-core",
            "palisade-http",
            "palisade-kafka",
            "palisade-lease",
            "palisade-log",
        ],
    ),
    (
        "palisade-devtools",
        &["palisade-client", "palisade-core", "palisade-kafka"],
    ),
    (
        "palisade",
        &[
            "palisade-bench",
            "palisade-cli",
            "palisade-core",
            "palisade-devtools",
            "palisade-http",
            "palisade-lease",
            "palisade-log",
            "palisade-server",
            "palisade-twin",
        ],
    ),
];

/// Crates that must not be in the production server's dependency tree.
const NOT_IN_SERVER: &[&str] = &[
    "palisade-bench",
    "palisade-cli",
    "palisade-devtools",
    "palisade-client",
    "tokio-postgres",
    "postgres-protocol",
    "hdrhistogram",
    "indicatif",
    "criterion",
];

fn metadata() -> Value {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(["metadata", "--format-version", "1", "--offline"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo metadata");
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("cargo metadata JSON")
}

fn workspace_names(m: &Value) -> BTreeMap<String, String> {
    let members: BTreeSet<&str> = m["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    m["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| members.contains(p["id"].as_str().unwrap()))
        .map(|p| {
            (
                p["id"].as_str().unwrap().to_owned(),
                p["name"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// The normal (non-dev, non-build) dependencies of each package, from the
/// resolved graph: package id -> dependency ids.
fn normal_deps(m: &Value) -> BTreeMap<String, Vec<String>> {
    m["resolve"]["nodes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| {
            let deps = n["deps"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| {
                    d["dep_kinds"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .any(|k| k["kind"].is_null())
                })
                .map(|d| d["pkg"].as_str().unwrap().to_owned())
                .collect();
            (n["id"].as_str().unwrap().to_owned(), deps)
        })
        .collect()
}

fn package_name(m: &Value, id: &str) -> String {
    m["packages"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["id"] == id)
        .map(|p| p["name"].as_str().unwrap().to_owned())
        .unwrap_or_else(|| id.to_owned())
}

#[test]
fn dependencies_between_crates_point_one_way() {
    let m = metadata();
    let names = workspace_names(&m);
    let deps = normal_deps(&m);
    let allowed: BTreeMap<&str, BTreeSet<&str>> = ALLOWED
        .iter()
        .map(|(c, d)| (*c, d.iter().copied().collect()))
        .collect();
    let mut wrong = Vec::new();
    for (id, name) in &names {
        let Some(ok) = allowed.get(name.as_str()) else {
            wrong.push(format!("{name}: a crate the table does not list"));
            continue;
        };
        for dep in &deps[id] {
            if let Some(dep_name) = names.get(dep) {
                if !ok.contains(dep_name.as_str()) {
                    wrong.push(format!("{name} -> {dep_name}"));
                }
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "dependencies outside docs/architecture.md's picture (update both, or move the code): {wrong:?}"
    );
}

#[test]
fn the_server_has_no_benchmark_client_or_postgres_crates() {
    let m = metadata();
    let names = workspace_names(&m);
    let deps = normal_deps(&m);
    let server = names
        .iter()
        .find(|(_, n)| n.as_str() == "palisade-server")
        .map(|(id, _)| id.clone())
        .expect("palisade-server is a workspace member");
    let mut seen = BTreeSet::new();
    let mut todo = vec![server];
    while let Some(id) = todo.pop() {
        if seen.insert(id.clone()) {
            todo.extend(deps[&id].iter().cloned());
        }
    }
    let tree: BTreeSet<String> = seen.iter().map(|id| package_name(&m, id)).collect();
    assert!(tree.contains("sled") && tree.contains("axum"), "{tree:?}");
    let found: Vec<&&str> = NOT_IN_SERVER
        .iter()
        .filter(|c| tree.contains(**c))
        .collect();
    assert!(
        found.is_empty(),
        "palisade-server's dependency tree holds {found:?}"
    );
}
