//! Every route of the API description but the public three (`/`,
//! `/healthz`, `/v1/openapi.json`) refuses a request without a key when
//! authentication is on, before its handler does anything.
//!
//! What a route needs is stated in its handler (a `Caller`, admitted and
//! authorized), not in a table of paths beside the router; this test is
//! the net under that: a route added without a `Caller` answers here
//! instead of saying 401, and the test names it.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::sync::Arc;

use palisade_http::auth::{hash_key, Action, GrantFile, PrincipalFile, RoleFile};
use palisade_http::{HttpConfig, Security, SecurityFile};
use palisade_log::{Store, StoreConfig};
use serde_json::Value;
use tokio::net::TcpListener;

const PUBLIC: &[&str] = &["/", "/healthz", "/v1/openapi.json"];

#[tokio::test]
async fn every_route_but_the_public_ones_needs_a_key() {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(dir.path(), StoreConfig::default()).unwrap());
    let file = SecurityFile {
        roles: BTreeMap::from([(
            "ops".to_owned(),
            RoleFile {
                grants: vec![GrantFile {
                    actions: vec![Action::Admin],
                    scopes: vec!["*".into()],
                }],
            },
        )]),
        principals: vec![PrincipalFile {
            name: "ops".into(),
            key_sha256: hash_key("psk_ops"),
            roles: vec!["ops".into()],
        }],
        ..SecurityFile::default()
    };
    let config = HttpConfig {
        security: Security::from_file(&file).unwrap(),
        ..HttpConfig::default()
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(palisade_http::run(
        listener,
        store.clone(),
        config,
        std::future::pending(),
    ));
    let http = reqwest::Client::new();
    let doc: Value = http
        .get(format!("{base}/v1/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let paths = doc["paths"].as_object().expect("paths");
    let mut checked = 0;
    for (template, item) in paths {
        // Concrete values that decode, so only the key decides.
        let path = template
            .replace("{twin_id}", "t")
            .replace("{partition}", "0")
            .replace("{lease_id}", &"0".repeat(32));
        for method in item.as_object().unwrap().keys() {
            let Ok(m) = method.to_uppercase().parse::<reqwest::Method>() else {
                continue;
            };
            if !["GET", "POST", "DELETE", "PUT", "PATCH"].contains(&m.as_str()) {
                continue;
            }
            let r = http
                .request(m.clone(), format!("{base}{path}"))
                .send()
                .await
                .unwrap();
            let want = if PUBLIC.contains(&template.as_str()) {
                200
            } else {
                401
            };
            assert_eq!(r.status().as_u16(), want, "{m} {template} without a key");
            checked += 1;
        }
    }
    assert!(checked >= 17, "only {checked} routes in the document");
    // Each refusal was audited, none had an effect.
    assert_eq!(store.last_token().0, 0);
}
