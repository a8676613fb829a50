//! `https://` effects (decision 0036): the dispatcher trusts exactly the
//! roots of `--outbox-ca-file`. A real HTTPS receiver (rustls, a
//! certificate made by rcgen for 127.0.0.1): with its certificate in the
//! CA file the effect is delivered; without the file the same effect ends
//! dead with a certificate error and never reaches the receiver; a CA file
//! that cannot be used stops `palisade serve` before it creates anything.

use std::process::Command;

use serde_json::json;

use crate::support::{token_of, ServeProcess};
use crate::{hook, settled, Receiver, FAST};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_effects_are_delivered_to_receivers_the_ca_file_vouches_for() {
    let ck = rcgen::generate_simple_self_signed(vec!["127.0.0.1".into()]).unwrap();
    let rx = Receiver::start_https(ck.cert.der().to_vec(), ck.key_pair.serialize_der()).await;
    assert!(rx.url.starts_with("https://"));
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("ca.pem");
    std::fs::write(&ca, ck.cert.pem()).unwrap();
    let url = format!("{}/ok/tls", rx.url);
    let batch = |id: &str| {
        json!([{"type": "t", "patch": {}, "event_id": id,
            "effects": [hook(&url, json!({"over": "tls"}))]}])
    };

    // Trusted: delivered over TLS, with the documented headers.
    let data = dir.path().join("trusted");
    let mut args = FAST.to_vec();
    args.extend(["--outbox-ca-file", ca.to_str().unwrap()]);
    let server = ServeProcess::start(&data, &args);
    let c = server.client();
    let t = token_of(&c.acquire("twin/gate-1", "w", 60_000).await);
    let r = c.append("gate-1", t, &batch("tls-1")).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let all = settled(&c, 1).await;
    assert_eq!(all[0]["state"], "delivered", "{all:#?}");
    let seen = rx.seen();
    assert_eq!(seen.len(), 1, "{seen:#?}");
    assert_eq!(seen[0].key, "tls-1:0");
    assert_eq!(seen[0].token, t.to_string());
    assert_eq!(seen[0].body, json!({"over": "tls"}));
    server.terminate();

    // No CA file: no root is trusted; every try fails the handshake, the
    // effect ends dead with the client's certificate error.
    let server = ServeProcess::start(&dir.path().join("untrusted"), FAST);
    let c = server.client();
    let t = token_of(&c.acquire("twin/gate-1", "w", 60_000).await);
    let r = c.append("gate-1", t, &batch("tls-2")).await;
    assert_eq!(r.status, 201, "{:?}", r.body);
    let all = settled(&c, 1).await;
    assert_eq!(all[0]["state"], "dead", "{all:#?}");
    let error = all[0]["last_error"].as_str().unwrap().to_ascii_lowercase();
    assert!(error.contains("certificate"), "{error}");
    assert_eq!(rx.seen().len(), 1, "an untrusted receiver got a request");
    server.terminate();

    // A file that holds no certificate, or none at all: refused at start,
    // with the flag named, and the data folder is not created.
    std::fs::write(dir.path().join("junk.pem"), "not a certificate\n").unwrap();
    for (file, says) in [("junk.pem", "no PEM certificate"), ("missing.pem", "")] {
        let data = dir.path().join(format!("refused-{file}"));
        let out = Command::new(env!("CARGO_BIN_EXE_palisade"))
            .arg("serve")
            .arg("--data")
            .arg(&data)
            .args(["--listen", "127.0.0.1:0", "--outbox-ca-file"])
            .arg(dir.path().join(file))
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{stderr}");
        assert!(
            stderr.contains("--outbox-ca-file") && stderr.contains(says),
            "{stderr}"
        );
        assert!(!data.exists(), "a refused start created {}", data.display());
    }
}
