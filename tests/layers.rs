#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The crates' dependencies point one way (docs/architecture.md, "Crates"):
//! every dependency between the workspace's crates is in the table below,
//! and the production server (`palisade-server`) pulls in no benchmark,
//! client-command or dev-tool crate, and no PostgreSQL, plotting or
//! histogram crate; the SDK (`palisade-client`) compiles no OpenAPI or
//! server crate. Read from `cargo metadata` and `cargo tree`, so a new
//! `[dependencies]` line that breaks the picture fails here.
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
    // The wire types (decision 0020): serde and the core vocabulary only.
    ("palisade-api", &["palisade-core"]),
    ("palisade-auth", &["palisade-core"]),
    ("palisade-lease", &["palisade-core"]),
    ("palisade-twin", &["palisade-core"]),
    (
        "palisade-log",
        &["palisade-core", "palisade-lease", "palisade-twin"],
    ),
    ("palisade-cluster", &["palisade-core"]),
    (
        "palisade-etcd",
        &["palisade-cluster", "palisade-core", "palisade-lease"],
    ),
    (
        "palisade-kafka",
        &["palisade-cluster", "palisade-core", "palisade-log"],
    ),
    (
        "palisade-http",
        &[
            "palisade-api",
            "palisade-auth",
            "palisade-core",
            "palisade-lease",
            "palisade-log",
            "palisade-twin",
        ],
    ),
    ("palisade-client", &["palisade-api", "palisade-core"]),
    (
        "palisade-server",
        &[
            "palisade-auth",
            "palisade-cluster",
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
            "palisade-auth",
            "palisade-client",
            "palisade-core",
            "palisade-kafka",
            "palisade-log",
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
    // `palisade proxy` (docs/proxy.md): the store's fence through its
    // embedded log or a remote store's HTTP API; the store's error bodies.
    (
        "palisade-proxy",
        &["palisade-core", "palisade-http", "palisade-log"],
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
            "palisade-proxy",
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

/// Crates that must not be in the SDK's dependency tree: the OpenAPI
/// derive stays behind palisade-api's `openapi` feature, which only the
/// server turns on (decision 0020).
const NOT_IN_SDK: &[&str] = &["utoipa", "axum", "sled", "palisade-http", "palisade-log"];

fn cargo(args: &[&str]) -> Vec<u8> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let out = Command::new(cargo)
        .args(args)
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo");
    assert!(
        out.status.success(),
        "cargo {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

/// Each workspace crate's normal (non-dev, non-build) dependencies on other
/// workspace crates, as declared in its `Cargo.toml`.
fn workspace_edges() -> BTreeMap<String, BTreeSet<String>> {
    let m: Value = serde_json::from_slice(&cargo(&[
        "metadata",
        "--format-version",
        "1",
        "--no-deps",
        "--offline",
    ]))
    .expect("cargo metadata JSON");
    let packages = m["packages"].as_array().unwrap();
    let names: BTreeSet<&str> = packages
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|d| d["kind"].is_null())
                .map(|d| d["name"].as_str().unwrap())
                .filter(|n| names.contains(n))
                .map(str::to_owned)
                .collect();
            (p["name"].as_str().unwrap().to_owned(), deps)
        })
        .collect()
}

#[test]
fn dependencies_between_crates_point_one_way() {
    let allowed: BTreeMap<&str, BTreeSet<&str>> = ALLOWED
        .iter()
        .map(|(c, d)| (*c, d.iter().copied().collect()))
        .collect();
    let mut wrong = Vec::new();
    for (name, deps) in workspace_edges() {
        let Some(ok) = allowed.get(name.as_str()) else {
            wrong.push(format!("{name}: a crate the table does not list"));
            continue;
        };
        for dep in deps {
            if !ok.contains(dep.as_str()) {
                wrong.push(format!("{name} -> {dep}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "dependencies outside docs/architecture.md's picture (update both, or move the code): {wrong:?}"
    );
}

/// The crate names in `package`'s normal dependency tree. `cargo tree`
/// resolves for this platform, with the features this package alone turns
/// on (not the whole workspace's).
fn normal_tree(package: &str) -> BTreeSet<String> {
    let out = cargo(&[
        "tree",
        "-p",
        package,
        "-e",
        "normal",
        "--prefix",
        "none",
        "--offline",
    ]);
    String::from_utf8_lossy(&out)
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_server_has_no_benchmark_client_or_postgres_crates() {
    let tree = normal_tree("palisade-server");
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

#[test]
fn the_sdk_compiles_no_openapi_or_server_crates() {
    let tree = normal_tree("palisade-client");
    assert!(
        tree.contains("palisade-api") && tree.contains("reqwest"),
        "{tree:?}"
    );
    let found: Vec<&&str> = NOT_IN_SDK.iter().filter(|c| tree.contains(**c)).collect();
    assert!(
        found.is_empty(),
        "palisade-client's dependency tree holds {found:?}"
    );
}
