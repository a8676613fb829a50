//! The audit log: grants, renewals, releases and refusals (stale,
//! forbidden, limited, unauthenticated) with principal, scope, token and
//! time; over HTTP for admins, as metrics, and on disk across a restart.

use palisade::log::{AuditAction, AuditOutcome, StoreConfig};
use reqwest::Method;
use serde_json::{json, Value};

use crate::{start, token_of};

fn find<'a>(records: &'a [Value], action: &str, outcome: &str) -> Vec<&'a Value> {
    records
        .iter()
        .filter(|r| r["action"] == action && r["outcome"] == outcome)
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_operations_and_refusals_are_audited() {
    let s = start("[limits]\nmax_leases_per_principal = 1\n").await;
    let a = s.acquire("worker-a", "twin/device-1").await.body;
    let (ta, id) = (token_of(&a), a["lease_id"].as_str().unwrap().to_owned());
    let renew = format!("/v1/leases/{id}/renew");
    assert_eq!(
        s.call(
            Some("worker-a"),
            Method::POST,
            &renew,
            Some(&json!({})),
            &[]
        )
        .await
        .status,
        200
    );
    assert_eq!(
        s.call(
            Some("worker-b"),
            Method::POST,
            &renew,
            Some(&json!({})),
            &[]
        )
        .await
        .status,
        403
    );
    assert_eq!(s.acquire("worker-a", "twin/device-2").await.status, 429);
    assert_eq!(s.acquire("reader", "twin/device-2").await.status, 403);
    assert_eq!(
        s.call(None, Method::GET, "/v1/twins/device-1", None, &[])
            .await
            .status,
        401
    );
    assert_eq!(
        s.put("worker-b", "device-1", ta, json!({"v": 1}))
            .await
            .status,
        403
    );
    let release = format!("/v1/leases/{id}");
    assert_eq!(
        s.call(Some("worker-a"), Method::DELETE, &release, None, &[])
            .await
            .status,
        204
    );
    let tb = token_of(&s.acquire("worker-b", "twin/device-1").await.body);
    assert_eq!(
        s.put("worker-a", "device-1", ta, json!({"v": 1}))
            .await
            .status,
        409
    );

    let r = s.get("ops", "/v1/audit?limit=1000").await;
    assert_eq!(r.status, 200, "{}", r.text);
    let records = r.body["records"].as_array().unwrap().clone();
    let seqs: Vec<u64> = records.iter().map(|r| r["seq"].as_u64().unwrap()).collect();
    assert!(seqs.windows(2).all(|w| w[0] < w[1]), "{seqs:?}");

    let grants = find(&records, "grant", "ok");
    assert_eq!(grants.len(), 2, "{records:#?}");
    assert_eq!(grants[0]["principal"], "worker-a");
    assert_eq!(grants[0]["scope"], "twin/device-1");
    assert_eq!(grants[0]["token"], ta);
    assert_eq!(grants[0]["lease_id"], id.as_str());
    assert!(grants[0]["at_ms"].as_u64().unwrap() > 1_600_000_000_000);
    assert_eq!(grants[1]["principal"], "worker-b");
    assert_eq!(grants[1]["token"], tb);
    let renewals = find(&records, "renew", "ok");
    assert_eq!(
        (renewals.len(), &renewals[0]["principal"]),
        (1, &json!("worker-a"))
    );
    let stolen = find(&records, "renew", "forbidden");
    assert_eq!(stolen.len(), 1);
    assert_eq!(stolen[0]["principal"], "worker-b");
    assert_eq!(stolen[0]["detail"], "lease_not_yours");
    assert_eq!(stolen[0]["token"], ta);
    let limited = find(&records, "grant", "limited");
    assert_eq!(
        (limited.len(), &limited[0]["detail"]),
        (1, &json!("too_many_leases"))
    );
    let forbidden = find(&records, "grant", "forbidden");
    assert_eq!(
        (forbidden.len(), &forbidden[0]["principal"]),
        (1, &json!("reader"))
    );
    let unauth = find(&records, "read", "unauthenticated");
    assert_eq!((unauth.len(), &unauth[0]["principal"]), (1, &json!("")));
    let wrong_token = find(&records, "write", "forbidden");
    assert_eq!(wrong_token.len(), 1);
    assert_eq!(wrong_token[0]["detail"], "token_not_yours");
    assert_eq!(wrong_token[0]["scope"], "twin/device-1");
    let releases = find(&records, "release", "ok");
    assert_eq!(releases.len(), 1);
    let stale = find(&records, "write", "stale");
    assert_eq!(stale.len(), 1, "{records:#?}");
    assert_eq!(stale[0]["principal"], "worker-a");
    assert_eq!(stale[0]["token"], ta);
    assert_eq!(stale[0]["detail"], "stale_token");

    // Paging.
    let first = seqs[0];
    let page = s
        .get("ops", &format!("/v1/audit?after={first}&limit=2"))
        .await
        .body;
    assert_eq!(page["records"].as_array().unwrap().len(), 2);
    assert_eq!(page["records"][0]["seq"], seqs[1]);
    assert_eq!(page["next_after"], seqs[2]);

    // As metrics.
    let m = s.get("reader", "/metrics").await.text;
    assert!(
        m.contains("palisade_audit_records_total{action=\"grant\",outcome=\"ok\"} 2"),
        "{m}"
    );
    assert!(
        m.contains("palisade_audit_records_total{action=\"write\",outcome=\"stale\"} 1"),
        "{m}"
    );

    // On disk: the same records after a restart.
    let data = s.dir.path().join("data");
    let _dir = s.stop().await;
    let store = crate::support::open_store(&data, StoreConfig::default());
    let kept = store.audit().list(0, 1000).await.unwrap();
    store.close().await;
    assert_eq!(kept.len(), records.len());
    assert_eq!(kept[0].action, AuditAction::Grant);
    assert_eq!(kept[0].outcome, AuditOutcome::Ok);
    assert_eq!(kept[0].principal, "worker-a");
    assert_eq!(kept[0].token, ta);
}
