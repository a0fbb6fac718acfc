//! Authorization end to end: two nodes (network namespaces on an underlay), one real
//! etcd, per node the real agent with `--capture strict --authz-dir <dir>` and a real
//! Envoy under `flock-supervisor`, pods added through libcni. Both agents watch the
//! same policy directory (as every node mounts one ConfigMap). The apps are
//! unmodified: curl and a Python TCP client as callers, a Python HTTP server and a TCP
//! echo server as the callee, none of them aware of Envoy.
//!
//! Pods: `web` (n1, account web, 8080/http and 9000/tcp; its own `flock.io/authz`
//! annotation denies `/api/secret`), `b` (n1, account b: the same node as web), `a`
//! and `c` (n2, accounts a and c: across nodes). The policy is the namespace's
//! `deny` default plus web's "allow sa/a GET /api/*".
//!
//! `policy_by_identity_live_edits_and_fail_closed` asserts, in order:
//! * without a policy every caller reaches web (HTTP and TCP);
//! * under the policy, `a` gets 200 on `/api/x` and 403 on `/admin`, `b` (same node)
//!   and `c` (across nodes) get 403, `b`'s TCP connection to 9000 is reset without a
//!   byte of the echo, web's annotation denies `a` `/api/secret`, and n1's Envoy's
//!   RBAC `denied` counters rise, and so does n1's agent's
//!   `flock_authz_denied_total{policy="default/web"}` (HTTP and TCP, from Envoy's
//!   access log stream), with one log line for `b` however often it was denied;
//! * `flockctl policy check` answers allow with the rule, and deny with the default;
//! * edits under a constant load from `a` (allowing `b`, then not, five times) fail
//!   none of `a`'s requests, and each reaches Envoy (the time from the file's rename
//!   to `b`'s answer changing is printed);
//! * a malformed policy denies `a` (fail closed), `/debug/status` and `/readyz` name
//!   it, and fixing it restores `a`'s 200.
//!
//! Needs root, nft, etcd, `FLOCK_ENVOY_BIN`, `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL`.

mod common;
mod multinode;

use common::*;
use multinode::*;
use serde_json::json;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const TCP_PORT: u16 = 9000;

const WEB_POLICY: &str = r#"{"rules":[{"action":"allow","from":{"serviceAccounts":["default/a"]},
  "to":{"methods":["GET"],"paths":["/api/*"]}}]}"#;
const WEB_POLICY_WITH_B: &str = r#"{"rules":[
  {"action":"allow","from":{"serviceAccounts":["default/a"]},"to":{"methods":["GET"],"paths":["/api/*"]}},
  {"action":"allow","from":{"serviceAccounts":["default/b"]},"to":{"methods":["GET"],"paths":["/api/*"]}}]}"#;
/// `frm` is no field of a rule: the policy must be refused, not read as "no callers".
const WEB_POLICY_MALFORMED: &str = r#"{"rules":[{"action":"allow","frm":{"serviceAccounts":["default/a"]},
  "to":{"methods":["GET"],"paths":["/api/*"]}}]}"#;

/// Writes `name` in `dir` atomically (a temporary dot-file renamed over it), as a
/// ConfigMap update or `kubectl cp` + `mv` does; returns when the rename is done.
fn write_policy(dir: &Path, name: &str, body: &str) -> Instant {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, body).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
    Instant::now()
}

/// The status of `GET url` from inside `pod` (curl; 0 when it got no answer).
fn status_from(pod: &Pod, url: &str) -> u16 {
    let out = pod
        .command("curl")
        .args([
            "-s",
            "-m",
            "5",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
            url,
        ])
        .output()
        .expect("curl is needed");
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or(0)
}

/// A plain TCP client in `pod`: sends a line to `addr` and returns what came back
/// (`Ok`, possibly empty: the peer closed) or the error (`Err`: a reset).
fn tcp_from(pod: &Pod, addr: &str) -> Result<String, String> {
    let (host, port) = addr.rsplit_once(':').unwrap();
    let src = format!(
        "import socket,sys\n\
         s=socket.create_connection(('{host}',{port}),timeout=5)\n\
         try:\n\
         \x20   s.sendall(b'ping\\n')\n\
         \x20   d=s.recv(100)\n\
         \x20   print('OK '+d.decode(errors='replace').strip())\n\
         except Exception as e:\n\
         \x20   print('ERR '+type(e).__name__)\n"
    );
    let out = pod.command("python3").args(["-c", &src]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
    match text.split_once(' ').map(|(k, v)| (k, v.to_string())) {
        Some(("OK", v)) => Ok(v),
        _ if text == "OK" => Ok(String::new()),
        _ => Err(format!(
            "{text} {}",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// A TCP echo server on `port` in `pod` (every address), answering `echo <line>`.
fn tcp_echo_server(pod: &Pod, port: u16, log: &Path) -> ChildGuard {
    let src = format!(
        "import socketserver\n\
         class H(socketserver.StreamRequestHandler):\n\
         \x20   def handle(self):\n\
         \x20       for line in self.rfile:\n\
         \x20           self.wfile.write(b'echo '+line)\n\
         socketserver.ThreadingTCPServer.allow_reuse_address = True\n\
         socketserver.ThreadingTCPServer.daemon_threads = True\n\
         socketserver.ThreadingTCPServer(('0.0.0.0', {port}), H).serve_forever()\n"
    );
    let mut cmd = pod.command("python3");
    cmd.args(["-c", &src]);
    let mut server = ChildGuard::spawn(cmd, log.to_owned());
    wait_for("the pod's TCP echo server", WAIT, || {
        assert!(server.running(), "server exited: {}", server.log_text());
        tcp_from(pod, &format!("127.0.0.1:{port}")).is_ok_and(|r| r == "echo ping")
    });
    server
}

/// Polls until `cond` holds (every 10 ms); the time it took.
fn until(what: &str, cond: impl Fn() -> bool) -> Duration {
    let t0 = Instant::now();
    wait_for(what, WAIT, || cond().then_some(()));
    t0.elapsed()
}

#[test]
fn policy_by_identity_live_edits_and_fail_closed() {
    let policies = tempfile::Builder::new()
        .prefix("flock-authz-policies-")
        .tempdir()
        .unwrap();
    let dir = policies.path().to_owned();
    let mut c = Cluster::start(ClusterOptions {
        tag: 5,
        zones: vec!["zone-a", "zone-a"],
        shared_root: true,
        registry_ttl: 10,
        agent_args: vec![
            "--capture".into(),
            "strict".into(),
            "--authz-dir".into(),
            dir.to_str().unwrap().into(),
        ],
        kube: false,
    });
    let web = c.add_pod_with(
        0,
        "web",
        json!({
            "flock.io/service": "web",
            "flock.io/service-account": "web",
            "flock.io/ports": format!("{APP_PORT}/http,{TCP_PORT}/tcp"),
            // On its HTTP port only: a deny rule with HTTP conditions denies every
            // connection of a TCP port (it cannot check them there).
            "flock.io/authz": r#"{"rules":[{"action":"deny","from":{"ids":["*"]},"to":{"ports":[8080],"paths":["/api/secret"]}}]}"#,
        }),
        true,
    );
    let _echo = tcp_echo_server(&c.pods[web], TCP_PORT, &c.dir.path().join("web-tcp.log"));
    let b = c.add_pod(0, "b", "b", false);
    let a = c.add_pod(1, "a", "a", false);
    let cc = c.add_pod(1, "c", "c", false);
    let web_ip = c.pods[web].ip.clone().unwrap();
    let url = |path: &str| format!("http://{web_ip}:{APP_PORT}{path}");
    let tcp = format!("{web_ip}:{TCP_PORT}");
    let logs = |c: &Cluster| c.logs();

    // No policy: everyone reaches web, over HTTP and TCP; the annotation alone
    // already denies /api/secret.
    until("a's 200 from web across nodes (no policy)", || {
        status_from(&c.pods[a], &url("/api/x")) == 200
    });
    for (who, p) in [("b", b), ("c", cc)] {
        assert_eq!(
            status_from(&c.pods[p], &url("/admin")),
            200,
            "{who} without a policy\n{}",
            logs(&c)
        );
    }
    until("b's TCP echo through the mesh (no policy)", || {
        tcp_from(&c.pods[b], &tcp) == Ok("echo ping".to_string())
    });
    assert_eq!(status_from(&c.pods[a], &url("/api/secret")), 403);

    // The policy: the namespace denies by default, web allows sa/a GET /api/*.
    let denied_before = c.nodes[0].envoy_counter(&["rbac", "denied"]);
    write_policy(&dir, "default.json", r#"{"default":"deny"}"#);
    let written = write_policy(&dir, "default.web.json", WEB_POLICY);
    let took = until("b is denied once the policy is in force", || {
        status_from(&c.pods[b], &url("/api/x")) == 403
    });
    println!(
        "policy written → Envoy enforcing it: {took:?} (since the second file: {:?})",
        written.elapsed()
    );
    assert_eq!(status_from(&c.pods[a], &url("/api/x")), 200, "{}", logs(&c));
    assert_eq!(status_from(&c.pods[a], &url("/admin")), 403);
    assert_eq!(
        status_from(&c.pods[a], &url("/api/secret")),
        403,
        "web's own annotation narrows what its service allows"
    );
    assert_eq!(
        status_from(&c.pods[b], &url("/admin")),
        403,
        "same node, no rule"
    );
    // c's Envoy holds a pooled connection to web's, opened under no policy: the
    // update drains it at once (`--drain-strategy immediate`), and at most the one
    // request already on its way over it is served under the old filter chain.
    let served_after = std::cell::Cell::new(0u32);
    until("c (across nodes, no rule) denied", || {
        let code = status_from(&c.pods[cc], &url("/api/x"));
        served_after.set(served_after.get() + u32::from(code == 200));
        code == 403
    });
    assert!(
        served_after.get() <= 1,
        "c's old connection served {} requests after the update",
        served_after.get()
    );
    assert_eq!(
        status_from(&c.pods[cc], &url("/api/x")),
        403,
        "across nodes, no rule"
    );
    let tcp_b = tcp_from(&c.pods[b], &tcp);
    assert!(
        tcp_b.is_err() || tcp_b == Ok(String::new()),
        "b's TCP connection must be cut without the echo: {tcp_b:?}"
    );
    let denied = c.nodes[0].envoy_counter(&["rbac", "denied"]);
    assert!(
        denied >= denied_before + 5,
        "n1's Envoy counts the denials: {denied_before} → {denied}"
    );
    println!("n1's Envoy rbac denied: {denied_before} → {denied}");

    // Envoy streams the denials to n1's agent (gRPC access log service on its xDS
    // socket): counted under the policy that governs web, over HTTP and TCP, and b,
    // denied many times on both, logged once.
    let agent_count = |protocol: &str| -> u64 {
        let (_, metrics) = http_get(&c.nodes[0].agent_admin(), "/metrics").unwrap();
        let series =
            format!("flock_authz_denied_total{{policy=\"default/web\",protocol=\"{protocol}\"}} ");
        metrics
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    until("n1's agent counts web's HTTP and TCP denials", || {
        agent_count("http") >= 3 && agent_count("tcp") >= 1
    });
    let b_id = format!("spiffe://{TRUST_DOMAIN}/ns/default/sa/b");
    let agent_log = c.nodes[0].agent.as_ref().unwrap().log_text();
    let b_lines: Vec<&str> = agent_log
        .lines()
        .filter(|l| l.contains("authorization policy denied a caller") && l.contains(&b_id))
        .collect();
    assert_eq!(
        b_lines.len(),
        1,
        "b's denials are logged once: {b_lines:#?}"
    );
    assert!(
        // Whichever of b's denials Envoy flushed first: HTTP and TCP entries travel
        // on separate access log streams.
        b_lines[0].contains(r#"policy="default/web""#)
            && (b_lines[0].contains("port=8080") || b_lines[0].contains("port=9000")),
        "the line names the policy and the port: {}",
        b_lines[0]
    );
    println!("n1's agent logged b once: {}", b_lines[0]);
    println!(
        "n1's agent: {} HTTP and {} TCP denials under default/web",
        agent_count("http"),
        agent_count("tcp")
    );

    // flockctl answers from the agent's policies.
    let flockctl = |args: &[&str]| {
        let out = std::process::Command::new(sibling_bin("flockctl"))
            .args(["--admin", &c.nodes[0].agent_admin(), "policy", "check"])
            .args(args)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let id = |sa: &str| format!("spiffe://{TRUST_DOMAIN}/ns/default/sa/{sa}");
    let (code, text) = flockctl(&[
        "--from",
        &id("a"),
        "--to",
        "default/web",
        "--port",
        "8080",
        "--method",
        "GET",
        "--path",
        "/api/x",
    ]);
    assert_eq!(code, Some(0), "{text}");
    assert!(
        text.starts_with("allow: allow rule: rules[0] of the policy of default/web"),
        "{text}"
    );
    let (code, text) = flockctl(&[
        "--from",
        &id("b"),
        "--to",
        "web.default",
        "--method",
        "GET",
        "--path",
        "/api/x",
    ]);
    assert_eq!(code, Some(1), "{text}");
    assert!(text.starts_with("deny: the default (deny)"), "{text}");

    // Edits under load: a's requests never fail while b is allowed and denied again.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let stop = Arc::clone(&stop);
        let a_ns = c.pods[a].netns.clone();
        let target = url("/api/x");
        std::thread::spawn(move || {
            let mut codes: std::collections::BTreeMap<String, u64> = Default::default();
            while !stop.load(Ordering::Relaxed) {
                // One curl, 20 requests on one keep-alive connection to a's Envoy.
                let mut cmd = std::process::Command::new("ip");
                cmd.args([
                    "netns",
                    "exec",
                    &a_ns,
                    "curl",
                    "-s",
                    "-m",
                    "5",
                    "-w",
                    "%{http_code}\n",
                ]);
                for _ in 0..20 {
                    cmd.args(["-o", "/dev/null", &target]);
                }
                let out = cmd.output().unwrap();
                for line in String::from_utf8_lossy(&out.stdout).lines() {
                    *codes.entry(line.to_string()).or_default() += 1;
                }
            }
            codes
        })
    };
    let mut latencies = Vec::new();
    for round in 0..5 {
        let t = write_policy(&dir, "default.web.json", WEB_POLICY_WITH_B);
        until(&format!("round {round}: b allowed"), || {
            status_from(&c.pods[b], &url("/api/x")) == 200
        });
        latencies.push(t.elapsed());
        // Some of a's load under each state, not only across the flips.
        std::thread::sleep(Duration::from_millis(150));
        let t = write_policy(&dir, "default.web.json", WEB_POLICY);
        until(&format!("round {round}: b denied again"), || {
            status_from(&c.pods[b], &url("/api/x")) == 403
        });
        latencies.push(t.elapsed());
        std::thread::sleep(Duration::from_millis(150));
    }
    stop.store(true, Ordering::Relaxed);
    let codes = load.join().unwrap();
    let total: u64 = codes.values().sum();
    println!("edit → enforced, per edit: {latencies:?}; a's load during the edits: {codes:?}");
    assert!(total >= 20, "the load ran: {codes:?}");
    assert_eq!(
        codes.keys().collect::<Vec<_>>(),
        ["200"],
        "no allowed request of a fails while the policy is edited: {codes:?}\n{}",
        logs(&c)
    );

    // A malformed policy fails closed for web, and the agent names it.
    write_policy(&dir, "default.web.json", WEB_POLICY_MALFORMED);
    let took = until("a denied by the refused policy", || {
        status_from(&c.pods[a], &url("/api/x")) == 403
    });
    println!("malformed policy → a denied in {took:?}");
    let (code, body) = http_get(&c.nodes[0].agent_admin(), "/debug/status").unwrap();
    assert_eq!(code, 200);
    let status: serde_json::Value = serde_json::from_str(&body).unwrap();
    let refused = status["policies_refused"].to_string();
    assert!(
        refused.contains("default/web") && refused.contains("frm"),
        "/debug/status names the bad policy and its field: {status}"
    );
    let (_, ready) = http_get(&c.nodes[0].agent_admin(), "/readyz").unwrap();
    assert!(
        ready.contains("authorization policy refused: default/web"),
        "{ready}"
    );
    write_policy(&dir, "default.web.json", WEB_POLICY);
    let took = until("a allowed again once the policy is fixed", || {
        status_from(&c.pods[a], &url("/api/x")) == 200
    });
    println!("fixed policy → a allowed in {took:?}");
    let (_, ready) = http_get(&c.nodes[0].agent_admin(), "/readyz").unwrap();
    assert!(!ready.contains("policy refused"), "{ready}");
    drop(c);
}
