//! Workload identity end to end: the real agent with its built-in CA
//! (`--identity builtin`, the default) gives two pods in real network namespaces
//! SPIFFE SVIDs, delivered to a real Envoy over SDS; pod A's request to service `web`
//! goes A's outbound listener → mTLS cluster (A's SVID, B's SPIFFE ID verified) →
//! B's inbound listener (client certificate required) → B's app. A client without a
//! certificate is refused. With a 20 s SVID lifetime the certificates rotate every
//! 10 s during continuous traffic, with zero failed requests. No private key ever
//! appears in the agent's log or admin output.
//!
//! Needs what `mesh.rs` needs (root, Envoy, libcni, sibling binaries).

mod common;

use common::*;
use serde_json::{Value, json};
use std::time::{Duration, Instant};

const BODY: &str = "hello over mtls";

fn curl(ns: &NetNs, args: &[&str]) -> (u16, String) {
    let out = ns
        .command("curl")
        .args(["-sS", "-m", "5", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl is needed (apt-get install curl)");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

fn to_web(ns: &NetNs) -> (u16, String) {
    curl(ns, &["-H", "Host: web", "http://127.0.0.1:15001/"])
}

/// Pod A (`client`, service account `client`) and pod B (`web` on 8080, service
/// account `web`, an HTTP server answering [`BODY`]) in real network namespaces, added
/// through libcni and flock-cni to `agent`.
struct TwoPods {
    ns_a: NetNs,
    ip_b: String,
    // Torn down in this order: the server and namespaces before the CNI setup.
    _server: ChildGuard,
    _ns_b: NetNs,
    _net: ChainedNetwork,
    _work: tempfile::TempDir,
}

impl TwoPods {
    fn start(agent: &Agent) -> Self {
        let work = tempfile::Builder::new()
            .prefix("flock-mtls-")
            .tempdir()
            .unwrap();
        let net = ChainedNetwork::start(work.path(), agent, "mtls", 5000);
        let cni = &net.cni;

        let ns_a = NetNs::new("ma");
        let ns_b = NetNs::new("mb");
        let _server = http_server_in(&ns_b, 8080, BODY, work.path().join("web.log"));
        let pod_a = PodSpec {
            namespace: "default",
            name: "client-0",
            uid: "uid-a",
            annotations: json!({"flock.io/service": "client", "flock.io/service-account": "client"}),
        };
        let pod_b = PodSpec {
            namespace: "default",
            name: "web-0",
            uid: "uid-b",
            annotations: json!({"flock.io/service": "web", "flock.io/ports": "8080/http", "flock.io/service-account": "web"}),
        };
        cni.ok("add", &ns_a, "ctr-a", &pod_a);
        let added: Value = serde_json::from_str(&cni.ok("add", &ns_b, "ctr-b", &pod_b)).unwrap();
        let ip_b = added["ips"][0]["address"]
            .as_str()
            .unwrap()
            .split('/')
            .next()
            .unwrap()
            .to_owned();
        Self {
            ns_a,
            ip_b,
            _server,
            _ns_b: ns_b,
            _net: net,
            _work: work,
        }
    }
}

#[test]
fn pods_talk_mtls_with_rotating_svids_and_plaintext_is_refused() {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let agent = Agent::start(&["--svid-ttl", "20", "--trust-domain", "mesh.test"]);
    let envoy = SupervisedEnvoy::start(&agent);

    let pods = TwoPods::start(&agent);
    let (ns_a, ip_b) = (&pods.ns_a, &pods.ip_b);

    // A → web over mTLS: the request succeeds through the identity's cluster.
    let client_id = "spiffe://mesh.test/ns/default/sa/client";
    let web_id = "spiffe://mesh.test/ns/default/sa/web";
    let (status, body) = wait_for("A's request to web over mTLS", WAIT, || {
        let r = to_web(ns_a);
        (r.0 == 200).then_some(r)
    });
    assert_eq!((status, body.as_str()), (200, BODY));
    let dump = envoy.config_dump();
    assert!(
        dump.contains(&format!("outbound|8080|web.default|{client_id}")),
        "no mTLS cluster for A"
    );
    assert!(
        dump.contains(web_id) && dump.contains("mesh.test"),
        "SDS secrets missing"
    );

    // No certificate, no entry: plaintext and TLS-without-a-client-certificate are
    // both refused by B's inbound listener.
    let inbound = format!("{ip_b}:15006");
    let (plain, _) = curl(ns_a, &[&format!("http://{inbound}/")]);
    assert_ne!(
        plain, 200,
        "plaintext reached B's app past its mTLS listener"
    );
    let (anon, _) = curl(ns_a, &["-k", &format!("https://{inbound}/")]);
    assert_ne!(
        anon, 200,
        "a TLS client without a certificate reached B's app"
    );

    // Rotation under continuous traffic: 25 s (two or more renewals at half of 20 s).
    let rotations_before = agent.proc.log_text().matches("rotated SVID").count();
    let start = Instant::now();
    let (mut ok, mut failed) = (0u32, Vec::new());
    while start.elapsed() < Duration::from_secs(25) {
        match to_web(ns_a) {
            (200, b) if b == BODY => ok += 1,
            other => failed.push(other),
        }
    }
    let rotations = agent.proc.log_text().matches("rotated SVID").count() - rotations_before;
    println!(
        "mTLS under rotation: {ok} requests, {} failed, {rotations} SVID rotations",
        failed.len()
    );
    assert!(
        rotations >= 2,
        "expected at least 2 rotations in 25 s with a 20 s TTL, saw {rotations}"
    );
    assert!(
        failed.is_empty(),
        "{} of {} requests failed during rotation: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(ok > 50, "too little traffic to mean anything: {ok}");

    // Secrets never leak: not in the agent's log, nor in any admin output.
    let mut exposed = agent.proc.log_text();
    for path in [
        "/debug/pods",
        "/debug/snapshot",
        "/debug/registry",
        "/metrics",
    ] {
        exposed.push_str(&agent.get(path).1);
    }
    assert!(
        !exposed.contains("PRIVATE KEY"),
        "key material in the agent's log or admin output"
    );
    drop(envoy);
}

/// Runs `flock-agent ca ARGS` (the real binary), panicking with its stderr on failure.
fn ca(args: &[&str]) {
    let out = std::process::Command::new(AGENT_BIN)
        .arg("ca")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "flock-agent ca {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The same path under a shared trust root: the agent signs with an issuer from
/// `--ca-dir` (made by `flock-agent ca init` / `ca issue`), Envoy gets leaf + issuer
/// chains and the root as its validation context, and A's request to web succeeds over
/// mTLS. Then the issuer is replaced under continuous traffic (`ca issue --force`:
/// atomic renames in the directory): the agent re-issues every SVID under the new
/// issuer, and no request fails.
#[test]
fn pods_talk_mtls_under_a_shared_root_and_survive_an_issuer_change() {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let keys = tempfile::Builder::new()
        .prefix("flock-ca-")
        .tempdir()
        .unwrap();
    let root = keys.path().join("root");
    let ca_dir = keys.path().join("n1");
    let (root_s, ca_dir_s) = (root.to_str().unwrap(), ca_dir.to_str().unwrap());
    ca(&["init", "--out", root_s, "--trust-domain", "mesh.test"]);
    ca(&["issue", "--root", root_s, "--out", ca_dir_s, "--name", "n1"]);
    let agent = Agent::start(&["--trust-domain", "mesh.test", "--ca-dir", ca_dir_s]);
    let envoy = SupervisedEnvoy::start(&agent);
    let pods = TwoPods::start(&agent);

    let (status, body) = wait_for("A's request to web over mTLS", WAIT, || {
        let r = to_web(&pods.ns_a);
        (r.0 == 200).then_some(r)
    });
    assert_eq!((status, body.as_str()), (200, BODY));
    assert!(
        agent.proc.log_text().contains("flock issuer n1 "),
        "the agent did not sign with the --ca-dir issuer"
    );

    // The issuer changes under traffic.
    let start = Instant::now();
    let (mut ok, mut failed) = (0u32, Vec::new());
    let mut changed_at = None;
    let mut issued = false;
    while changed_at.is_none_or(|t: Instant| t.elapsed() < Duration::from_secs(5)) {
        assert!(
            start.elapsed() < Duration::from_secs(40),
            "the agent never reported the new issuer"
        );
        if ok == 20 && !issued {
            issued = true;
            ca(&[
                "issue", "--root", root_s, "--out", ca_dir_s, "--name", "n1-next", "--force",
            ]);
        }
        if changed_at.is_none() && agent.proc.log_text().contains("CA directory changed") {
            changed_at = Some(Instant::now());
        }
        match to_web(&pods.ns_a) {
            (200, b) if b == BODY => ok += 1,
            other => failed.push(other),
        }
    }
    let log = agent.proc.log_text();
    let reissued = log.matches("re-issued SVID under the new issuer").count();
    println!(
        "mTLS across an issuer change: {ok} requests, {} failed, {reissued} SVIDs re-issued",
        failed.len()
    );
    assert!(
        log.contains("flock issuer n1-next"),
        "new issuer not in use"
    );
    assert!(reissued >= 2, "client and web SVIDs re-issued: {reissued}");
    assert!(
        failed.is_empty(),
        "{} of {} requests failed across the issuer change: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(!log.contains("PRIVATE KEY"));
    drop(pods);
    drop(envoy);
}
