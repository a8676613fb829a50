//! Principals x actions x scopes, with the expected outcome of each, over
//! HTTPS with authentication on.

use palisade::core::{partition_for, TwinId};
use reqwest::Method;
use serde_json::json;

use crate::{start, token_of, Resp};

/// The first twin id `<prefix>-<n>` in partition `p` of a 16-partition store.
pub fn twin_in(p: u32, prefix: &str) -> String {
    (0..)
        .map(|i| format!("{prefix}-{i}"))
        .find(|t| partition_for(&TwinId::new(t.as_str()).unwrap(), 16).0 == p)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_principal_can_do_what_its_roles_grant_and_nothing_else() {
    let s = start("").await;
    let pump = twin_in(3, "pump");
    let pump_scope = format!("twin/{pump}");
    let mut rows: Vec<(String, Resp, u16, &str)> = Vec::new();
    macro_rules! row {
        ($label:expr, $resp:expr, $status:expr, $error:expr) => {{
            let r = $resp;
            rows.push(($label.to_string(), r, $status, $error));
            rows.last().map(|(_, r, _, _)| r).unwrap()
        }};
    }

    // Leases: `lease` on the scope.
    let ta = token_of(
        &row!(
            "worker-a lease twin/device-1",
            s.acquire("worker-a", "twin/device-1").await,
            201,
            ""
        )
        .body,
    );
    row!(
        "worker-b lease twin/device-2",
        s.acquire("worker-b", "twin/device-2").await,
        201,
        ""
    );
    let tp = token_of(
        &row!(
            "pworker lease partition/3",
            s.acquire("pworker", "partition/3").await,
            201,
            ""
        )
        .body,
    );
    row!(
        "worker-a lease twin/pump",
        s.acquire("worker-a", &pump_scope).await,
        403,
        "forbidden"
    );
    row!(
        "worker-a lease partition/4",
        s.acquire("worker-a", "partition/4").await,
        403,
        "forbidden"
    );
    row!(
        "pworker lease twin/device-9",
        s.acquire("pworker", "twin/device-9").await,
        403,
        "forbidden"
    );
    row!(
        "reader lease twin/device-3",
        s.acquire("reader", "twin/device-3").await,
        403,
        "forbidden"
    );
    row!(
        "ops lease twin/device-3",
        s.acquire("ops", "twin/device-3").await,
        403,
        "forbidden"
    );
    row!(
        "nobody lease twin/device-3",
        s.acquire("nobody", "twin/device-3").await,
        403,
        "forbidden"
    );
    let lease_body = json!({"scope": "twin/device-3", "holder": "x", "ttl_ms": 1000});
    row!(
        "no key: lease",
        s.call(None, Method::POST, "/v1/leases", Some(&lease_body), &[])
            .await,
        401,
        "unauthenticated"
    );
    row!(
        "wrong key: lease",
        s.call(
            Some("!bad"),
            Method::POST,
            "/v1/leases",
            Some(&lease_body),
            &[]
        )
        .await,
        401,
        "unauthenticated"
    );

    // Writes: `write` on the twin (or its partition), with one's own token.
    row!(
        "worker-a write device-1",
        s.put("worker-a", "device-1", ta, json!({"v": 1})).await,
        201,
        ""
    );
    row!(
        "pworker write pump (its partition)",
        s.put("pworker", &pump, tp, json!({"v": 1})).await,
        201,
        ""
    );
    row!(
        "worker-a write pump",
        s.put("worker-a", &pump, tp, json!({"v": 2})).await,
        403,
        "forbidden"
    );
    row!(
        "reader write device-1",
        s.put("reader", "device-1", ta, json!({"v": 2})).await,
        403,
        "forbidden"
    );
    row!(
        "ops write device-1",
        s.put("ops", "device-1", ta, json!({"v": 2})).await,
        403,
        "forbidden"
    );
    row!(
        "nobody write device-1",
        s.put("nobody", "device-1", ta, json!({"v": 2})).await,
        403,
        "forbidden"
    );
    let ev = json!({"type": "u", "patch": {"v": 3}});
    row!(
        "no key: write",
        s.call(
            None,
            Method::POST,
            "/v1/twins/device-1/events",
            Some(&ev),
            &[("fencing-token", &ta.to_string())]
        )
        .await,
        401,
        "unauthenticated"
    );

    // Reads: `read` on the twin or its partition.
    row!(
        "reader read device-1",
        s.get("reader", "/v1/twins/device-1").await,
        200,
        ""
    );
    row!(
        "worker-a read device-1",
        s.get("worker-a", "/v1/twins/device-1").await,
        200,
        ""
    );
    row!(
        "worker-a read device-1 history",
        s.get("worker-a", "/v1/twins/device-1/events").await,
        200,
        ""
    );
    row!(
        "worker-a read pump",
        s.get("worker-a", &format!("/v1/twins/{pump}")).await,
        403,
        "forbidden"
    );
    row!(
        "pworker read device-1",
        s.get("pworker", "/v1/twins/device-1").await,
        403,
        "forbidden"
    );
    row!(
        "nobody read device-1",
        s.get("nobody", "/v1/twins/device-1").await,
        403,
        "forbidden"
    );
    row!(
        "reader read partition 3",
        s.get("reader", "/v1/partitions/3/events").await,
        200,
        ""
    );
    row!(
        "worker-a read partition 3",
        s.get("worker-a", "/v1/partitions/3/events").await,
        403,
        "forbidden"
    );
    row!(
        "no key: read",
        s.call(None, Method::GET, "/v1/twins/device-1", None, &[])
            .await,
        401,
        "unauthenticated"
    );
    // The refusal journal (issue 14) is read like the events.
    row!(
        "worker-a read device-1 refusals",
        s.get("worker-a", "/v1/twins/device-1/refusals").await,
        200,
        ""
    );
    row!(
        "worker-a read pump refusals",
        s.get("worker-a", &format!("/v1/twins/{pump}/refusals"))
            .await,
        403,
        "forbidden"
    );
    row!(
        "reader read partition 3 refusals",
        s.get("reader", "/v1/partitions/3/refusals").await,
        200,
        ""
    );
    row!(
        "worker-a read partition 3 refusals",
        s.get("worker-a", "/v1/partitions/3/refusals").await,
        403,
        "forbidden"
    );
    row!(
        "no key: refusals",
        s.call(None, Method::GET, "/v1/twins/device-1/refusals", None, &[])
            .await,
        401,
        "unauthenticated"
    );
    // TTL advice (decision 0026): whoever may lease the scope.
    row!(
        "worker-a advice twin/device-1",
        s.get("worker-a", "/v1/leases/advice?scope=twin/device-1")
            .await,
        200,
        ""
    );
    row!(
        "worker-a advice twin/pump",
        s.get("worker-a", &format!("/v1/leases/advice?scope={pump_scope}"))
            .await,
        403,
        "forbidden"
    );

    // Admin data: `read` or `admin` on admin/<name>; the audit log: `admin`.
    for path in [
        "/v1/partitions",
        "/v1/rejections",
        "/v1/dead-letters",
        "/metrics",
    ] {
        row!(
            format!("reader GET {path}"),
            s.get("reader", path).await,
            200,
            ""
        );
        row!(format!("ops GET {path}"), s.get("ops", path).await, 200, "");
        row!(
            format!("worker-a GET {path}"),
            s.get("worker-a", path).await,
            403,
            "forbidden"
        );
        row!(
            format!("nobody GET {path}"),
            s.get("nobody", path).await,
            403,
            "forbidden"
        );
    }
    row!(
        "ops GET /v1/audit",
        s.get("ops", "/v1/audit").await,
        200,
        ""
    );
    row!(
        "reader GET /v1/audit",
        s.get("reader", "/v1/audit").await,
        403,
        "forbidden"
    );
    row!(
        "worker-a GET /v1/audit",
        s.get("worker-a", "/v1/audit").await,
        403,
        "forbidden"
    );
    row!(
        "no key: GET /v1/audit",
        s.call(None, Method::GET, "/v1/audit", None, &[]).await,
        401,
        "unauthenticated"
    );
    // Every node's audit log (one node here: `local`): the same rule.
    row!(
        "ops GET /v1/cluster/audit",
        s.get("ops", "/v1/cluster/audit").await,
        200,
        ""
    );
    row!(
        "reader GET /v1/cluster/audit",
        s.get("reader", "/v1/cluster/audit").await,
        403,
        "forbidden"
    );
    row!(
        "no key: GET /v1/cluster/audit",
        s.call(None, Method::GET, "/v1/cluster/audit", None, &[])
            .await,
        401,
        "unauthenticated"
    );

    // The outbox (effect URLs and bodies): `admin` on admin/outbox only.
    for (who, status, error) in [
        ("ops", 200, ""),
        ("reader", 403, "forbidden"),
        ("worker-a", 403, "forbidden"),
        ("nobody", 403, "forbidden"),
    ] {
        row!(
            format!("{who} GET /v1/outbox"),
            s.get(who, "/v1/outbox").await,
            status,
            error
        );
    }
    row!(
        "no key: GET /v1/outbox",
        s.call(None, Method::GET, "/v1/outbox", None, &[]).await,
        401,
        "unauthenticated"
    );
    // Removing a dead effect: `admin` on admin/outbox too (ops reaches the
    // store: there is no such effect).
    for (who, status, error) in [
        ("ops", 404, "outbox_effect_not_found"),
        ("reader", 403, "forbidden"),
        ("worker-a", 403, "forbidden"),
    ] {
        row!(
            format!("{who} DELETE /v1/outbox/0/1/0"),
            s.call(Some(who), Method::DELETE, "/v1/outbox/0/1/0", None, &[])
                .await,
            status,
            error
        );
    }

    // A backup (the whole store, streamed): `admin` on admin/backup only.
    for (who, status, error) in [
        ("ops", 200, ""),
        ("reader", 403, "forbidden"),
        ("worker-a", 403, "forbidden"),
    ] {
        row!(
            format!("{who} POST /v1/admin/backup"),
            s.call(Some(who), Method::POST, "/v1/admin/backup", None, &[])
                .await,
            status,
            error
        );
    }
    row!(
        "no key: POST /v1/admin/backup",
        s.call(None, Method::POST, "/v1/admin/backup", None, &[])
            .await,
        401,
        "unauthenticated"
    );

    // Public: health, the API document, the operator page (it reads the API
    // with the same rules).
    for path in ["/healthz", "/v1/openapi.json", "/"] {
        row!(
            format!("no key: GET {path}"),
            s.call(None, Method::GET, path, None, &[]).await,
            200,
            ""
        );
    }

    let mut failures = Vec::new();
    for (label, r, status, error) in &rows {
        let ok = r.status == *status
            && (error.is_empty() || r.body["error"] == *error)
            && (r.status < 400 || r.body["message"].as_str().is_some_and(|m| !m.is_empty()));
        if !ok {
            failures.push(format!(
                "{label}: want {status} {error}, got {} {}",
                r.status, r.text
            ));
        }
        if r.status == 401 {
            assert_eq!(
                r.headers
                    .get("www-authenticate")
                    .and_then(|v| v.to_str().ok()),
                Some("Bearer realm=\"palisade\""),
                "{label}"
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} rows differ:\n{}",
        failures.len(),
        rows.len(),
        failures.join("\n")
    );

    // What the allowed writes did, and only that.
    let events = s.get("reader", "/v1/twins/device-1/events").await.body;
    assert_eq!(events["events"].as_array().unwrap().len(), 1, "{events}");
    assert_eq!(events["events"][0]["writer"], "worker-a");
    let events = s
        .get("reader", &format!("/v1/twins/{pump}/events"))
        .await
        .body;
    assert_eq!(events["events"].as_array().unwrap().len(), 1, "{events}");
    s.stop().await;
}
