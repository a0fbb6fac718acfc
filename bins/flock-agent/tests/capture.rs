//! Transparent capture end to end: the real agent with `--capture strict`, the real
//! `flock-cni` chained after Debian's `bridge` + `host-local` and run by libcni
//! (`cnitool`), pods in real network namespaces whose nftables table the agent installs
//! (real `nft`), and a real Envoy under `flock-supervisor`. The clients are
//! unmodified: `curl http://<address>:<port>/` inside a pod's netns, no proxy, no
//! `Host` trick, no knowledge of Envoy.
//!
//! Phases, each asserting what it names:
//! * `unmodified_clients_are_meshed_and_nothing_reaches_an_app_around_envoy`:
//!   A's plain request to B's pod address goes through A's captured outbound listener
//!   and A's mTLS cluster to B's inbound listener (Envoy's TLS handshake counters on
//!   both ends move), and B's app sees A's own pod address as the caller (A's mTLS
//!   connection is made from A's netns; B's Envoy connects to the app from the
//!   caller's address); a client outside the mesh dialling B's app port is refused
//!   (strict), while it reaches a permissive pod's app through Envoy's plaintext
//!   chain, and that app sees the outside client's own address; A's
//!   request to a server outside the mesh passes through Envoy's passthrough cluster
//!   and the server sees A's own address; an excluded outbound port bypasses Envoy;
//!   plaintext from the node itself (its gateway address: a hostNetwork process) is
//!   refused like any outside caller's, while a kubelet-style probe (a process in the
//!   `--capture-probe-cgroup` cgroup) reaches B's app directly from the link-local
//!   probe source; Envoy hot-restarted by the supervisor under a stream of captured
//!   requests fails none of them.
//! * `agent_crash_leaves_one_table_and_check_and_restart_repair_drift`: SIGKILL and
//!   restart leave exactly one flock table with the same rules; CNI CHECK (libcni)
//!   fails with a message naming the netns and the missing table after the test
//!   deletes it; the next agent start repairs it and CHECK passes again.
//! * `the_access_log_has_one_line_per_request_with_both_identities`: `--access-log`
//!   on; 100 unmodified requests from A to B's pod address (captured, mTLS) give
//!   exactly 100 lines on B's side, each with A's and B's SPIFFE IDs, both pods, B's
//!   service and port, status 200, a duration and the bytes, and no query string.
//! * `a_service_vip_is_routed_to_the_service_over_mtls`: kube mode (the Service's
//!   ClusterIP is where VIPs come from). The Kubernetes API server is flock-kube's
//!   API-server DOUBLE (`flock_kube::double`, feature `testing`); everything else is
//!   real.
//!
//! Needs root, nft, `FLOCK_ENVOY_BIN`, `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL` and the
//! sibling binaries (see `common`).

mod capturekit;
mod common;

use capturekit::*;
use common::*;
use serde_json::json;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const TRUST_DOMAIN: &str = "mesh.test";

/// Pods of the annotation-mode tests: A (client, captured, outbound port 9091
/// excluded), B (web on 8080, strict: the node's mode), P (lax on 8080, permissive by
/// annotation), N (not meshed: outside the mesh, servers on 9090 and 9091).
struct Mesh {
    // Dropped in this order: the apps, the pods' netns, the CNI setup, the temp dir.
    b_app: ChildGuard,
    _p_app: ChildGuard,
    _n_app: ChildGuard,
    _n_excluded: ChildGuard,
    a: Pod,
    b: Pod,
    p: Pod,
    n: Pod,
    net: ChainedNetwork,
    _work: tempfile::TempDir,
}

impl Mesh {
    fn start(agent: &Agent, tag: &str) -> Self {
        let work = tempfile::Builder::new()
            .prefix(&format!("flock-capture-{tag}-"))
            .tempdir()
            .unwrap();
        let net = ChainedNetwork::start(work.path(), agent, tag, 8000);
        let log = |n: &str| work.path().join(format!("{n}.log"));
        // The apps run before their pods' ADD, as a container's would soon after; they
        // are bound on 0.0.0.0, so anything that reaches the port reaches them.
        let ns_b = NetNs::new("cb");
        let b_app = peer_echo_server_in(&ns_b, 8080, "web-0", &log("web-0"));
        let ns_p = NetNs::new("cp");
        let p_app = peer_echo_server_in(&ns_p, 8080, "lax-0", &log("lax-0"));
        let ns_n = NetNs::new("cn");
        let n_app = peer_echo_server_in(&ns_n, 9090, "outside", &log("outside"));
        let n_excluded = peer_echo_server_in(&ns_n, 9091, "excluded", &log("excluded"));
        let a = Pod::add(
            &net.cni,
            "ca",
            "client-0",
            json!({"flock.io/service": "client", "flock.io/service-account": "client",
                   "flock.io/capture-exclude-outbound-ports": "9091"}),
        );
        let b = Pod::add_in(
            &net.cni,
            ns_b,
            "default",
            "web-0",
            json!({"flock.io/service": "web", "flock.io/ports": "8080/http",
                   "flock.io/service-account": "web"}),
        );
        let p = Pod::add_in(
            &net.cni,
            ns_p,
            "default",
            "lax-0",
            json!({"flock.io/service": "lax", "flock.io/ports": "8080/http",
                   "flock.io/service-account": "lax", "flock.io/capture": "permissive"}),
        );
        let n = Pod::add_in(&net.cni, ns_n, "default", "outside-0", json!({}));
        Self {
            a,
            b,
            p,
            n,
            b_app,
            _p_app: p_app,
            _n_app: n_app,
            _n_excluded: n_excluded,
            net,
            _work: work,
        }
    }
}

fn capture_agent() -> Agent {
    capture_agent_with(&[])
}

fn capture_agent_with(extra: &[&str]) -> Agent {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let _ = envoy_bin();
    let mut args = vec!["--capture", "strict", "--trust-domain", TRUST_DOMAIN];
    args.extend_from_slice(extra);
    Agent::start(&args)
}

/// Waits until A's unmodified request to `url` is answered 200 (Envoy has the routes).
fn until_ok(ns: &NetNs, url: &str) -> String {
    wait_for(&format!("a 200 for {url}"), WAIT, || {
        let (status, body) = curl_in(ns, url);
        (status == 200).then_some(body)
    })
}

#[test]
fn unmodified_clients_are_meshed_and_nothing_reaches_an_app_around_envoy() {
    let probe_cgroup = ProbeCgroup::new("e2e");
    let agent = capture_agent_with(&["--capture-probe-cgroup", &probe_cgroup.name]);
    let envoy = SupervisedEnvoy::start(&agent);
    let mesh = Mesh::start(&agent, "e2e");
    let (a, b, p, n) = (&mesh.a, &mesh.b, &mesh.p, &mesh.n);
    // Every pod on a Kubernetes pod network has a default route via the node (this
    // test's bridge conflist gives none): B answers kubelet's probe source through it.
    for pod in [a, b, p, n] {
        let route = std::process::Command::new("ip")
            .args([
                "-n",
                &pod.ns.name,
                "route",
                "replace",
                "default",
                "via",
                &pod.gateway,
            ])
            .status()
            .unwrap();
        assert!(route.success(), "adding {}'s default route", pod.name);
    }

    // The rules are in every meshed pod's netns once ADD has answered; N has none.
    for pod in [a, b, p] {
        assert_eq!(
            pod.tables(),
            vec![("inet".to_string(), "flock_capture".to_string())],
            "{}",
            pod.name
        );
    }
    assert!(n.tables().is_empty(), "a pod outside the mesh got rules");
    println!("B's ruleset (strict, app port 8080):\n{}", b.ruleset_text());
    println!("P's ruleset (permissive):\n{}", p.ruleset_text());
    println!(
        "A's ruleset (no app ports, 9091 excluded):\n{}",
        a.ruleset_text()
    );

    // ---- A → B's pod address, through Envoy, over mTLS.
    let url_b = format!("http://{}:8080/", b.ip);
    let before = envoy_stats(&envoy.admin);
    let first = until_ok(&a.ns, &url_b);
    const MORE: u64 = 5;
    for _ in 0..MORE {
        let (status, body) = curl_in(&a.ns, &url_b);
        assert_eq!(status, 200, "{body}");
    }
    let after = envoy_stats(&envoy.admin);
    let mtls_cluster = ["outbound|8080|web.default|", "sa/client."];
    let rq = |s| stat(s, &mtls_cluster, ".upstream_rq_total");
    assert!(
        rq(&after) - rq(&before) > MORE,
        "A's requests did not take its mTLS cluster: {} → {}\n{}",
        rq(&before),
        rq(&after),
        stats_about(&after, "upstream_rq_total")
    );
    assert!(
        stat(&after, &mtls_cluster, ".ssl.handshake") >= 1,
        "no TLS handshake on A's mTLS cluster"
    );
    let inbound_b = format!("listener.{}_15006.ssl.handshake", b.ip);
    assert!(
        after.get(&inbound_b).copied().unwrap_or(0) >= 1,
        "no TLS handshake on B's inbound listener ({inbound_b}):\n{}",
        stats_about(&after, "ssl.handshake")
    );
    let hcm_b = "http.inbound_default_web-0_8080.downstream_rq_total";
    assert!(
        after.get(hcm_b).copied().unwrap_or(0) > MORE,
        "B's inbound listener did not see A's requests:\n{}",
        stats_about(&after, "downstream_rq_total")
    );
    // (What the excluded-port and probe checks below count does move with mesh traffic.)
    assert!(mesh_connections(&after) > mesh_connections(&before));
    // B's app saw A's own pod address: A's mTLS connection left from A's netns, and
    // B's Envoy connected to the app from the caller's address (not its loopback, not
    // the node's gateway).
    let from_a = format!("web-0 saw {}:", a.ip);
    assert!(
        first.starts_with(&from_a),
        "B's app did not see A's own pod address {}: {first}",
        a.ip
    );
    // (Its own readiness check came from its loopback, before any of A's requests.)
    let seen = peers_seen(&mesh.b_app);
    let callers: Vec<&String> = seen
        .iter()
        .filter(|s| !s.starts_with("127.0.0.1:"))
        .collect();
    assert!(
        !callers.is_empty() && callers.iter().all(|s| s.starts_with(&format!("{}:", a.ip))),
        "B's app did not see A's own pod address {} on every connection: {seen:?}",
        a.ip
    );

    // ---- A client outside the mesh dials the app port directly. Strict: the
    // redirect lands it on B's inbound listener (a connection there), which wants a
    // client certificate and refuses it.
    let inbound_cx_b = format!("listener.{}_15006.downstream_cx_total", b.ip);
    let before = envoy_stats(&envoy.admin);
    let (status, body) = curl_in(&n.ns, &url_b);
    assert_ne!(
        status, 200,
        "strict: plaintext from outside reached B: {body}"
    );
    let after = envoy_stats(&envoy.admin);
    assert!(
        after.get(&inbound_cx_b).copied().unwrap_or(0)
            > before.get(&inbound_cx_b).copied().unwrap_or(0),
        "strict: the outside client's connection did not land on B's inbound listener \
         ({inbound_cx_b}):\n{}",
        stats_about(&after, "downstream_cx_total")
    );
    let seen = peers_seen(&mesh.b_app);
    assert!(
        !seen.iter().any(|s| s.starts_with(&format!("{}:", n.ip))),
        "strict: B's app saw the outside client: {seen:?}"
    );
    let url_p = format!("http://{}:8080/", p.ip);
    let body = wait_for("permissive: the outside client reaches P", WAIT, || {
        let (status, body) = curl_in(&n.ns, &url_p);
        (status == 200).then_some(body)
    });
    // It came through Envoy's plaintext chain, not around it (the stats below), and
    // P's app sees the outside client's own address.
    assert!(body.starts_with(&format!("lax-0 saw {}:", n.ip)), "{body}");
    let stats = envoy_stats(&envoy.admin);
    assert!(
        stats
            .get("http.inbound_default_lax-0_8080.downstream_rq_total")
            .copied()
            .unwrap_or(0)
            >= 1,
        "P's inbound listener did not see the plaintext request"
    );

    // ---- A → a server outside the mesh, through the passthrough.
    let passthrough = ["passthrough|default/client-0"];
    let pt = |s| stat(s, &passthrough, ".upstream_cx_total");
    let before = envoy_stats(&envoy.admin);
    let body = until_ok(&a.ns, &format!("http://{}:9090/", n.ip));
    assert!(
        body.starts_with(&format!("outside saw {}:", a.ip)),
        "the outside server should see A's own address: {body}"
    );
    let after = envoy_stats(&envoy.admin);
    assert!(
        pt(&after) > pt(&before),
        "A's connection to a non-mesh server did not go through Envoy's passthrough"
    );

    // ---- An excluded outbound port (9091 by A's annotation) bypasses Envoy: no
    // listener of Envoy accepts a connection for it.
    let before = envoy_stats(&envoy.admin);
    let (status, body) = curl_in(&a.ns, &format!("http://{}:9091/", n.ip));
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with(&format!("excluded saw {}:", a.ip)),
        "{body}"
    );
    let after = envoy_stats(&envoy.admin);
    assert_eq!(
        pt(&after),
        pt(&before),
        "the excluded port went through Envoy's passthrough"
    );
    assert_eq!(
        mesh_connections(&after),
        mesh_connections(&before),
        "the excluded port's connection reached an Envoy listener"
    );

    // ---- The node's own processes are callers like any other: plaintext from the
    // node (a hostNetwork process, whose source is the node's address on the pod
    // network, the gateway — where kube-proxy-SNATed traffic comes from too) lands on
    // B's inbound listener and is refused; B's app never sees it.
    assert!(!b.gateway.is_empty(), "no gateway in B's ADD result");
    let before = envoy_stats(&envoy.admin);
    let (status, body) = curl_from_node(&url_b);
    assert_ne!(
        status, 200,
        "strict: plaintext from the node's gateway address reached B's app: {body}"
    );
    let after = envoy_stats(&envoy.admin);
    assert!(
        after.get(&inbound_cx_b).copied().unwrap_or(0)
            > before.get(&inbound_cx_b).copied().unwrap_or(0),
        "strict: the node's plaintext did not land on B's inbound listener"
    );
    let seen = peers_seen(&mesh.b_app);
    assert!(
        !seen
            .iter()
            .any(|s| s.starts_with(&format!("{}:", b.gateway))),
        "strict: B's app saw the node's gateway address: {seen:?}"
    );

    // ---- Kubelet's probes (a process in the probe cgroup) leave the node from the
    // link-local probe source and reach B's app directly, not through Envoy.
    let before = envoy_stats(&envoy.admin);
    let (status, body) = probe_cgroup.curl(&url_b);
    assert_eq!(status, 200, "{body}");
    assert!(
        body.starts_with("web-0 saw 169.254.7.127:"),
        "the probe did not reach B's app from the probe source: {body}"
    );
    let after = envoy_stats(&envoy.admin);
    assert_eq!(
        after.get(hcm_b),
        before.get(hcm_b),
        "the probe went through B's inbound listener"
    );
    assert_eq!(
        mesh_connections(&after),
        mesh_connections(&before),
        "the probe's connection reached an Envoy listener"
    );

    // ---- Envoy hot restart (SIGHUP to the supervisor) under a stream of
    // captured requests: none fails.
    let stop = Arc::new(AtomicBool::new(false));
    let load = {
        let (stop, ns, url) = (stop.clone(), a.ns.name.clone(), url_b.clone());
        let from_a = from_a.clone();
        std::thread::spawn(move || {
            let (mut ok, mut failed) = (0u32, Vec::new());
            while !stop.load(Ordering::Relaxed) {
                let out = std::process::Command::new("ip")
                    .args(["netns", "exec", &ns, "curl", "-sS", "-m", "5"])
                    .args(["-o", "-", "-w", "\n%{http_code}", &url])
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&out.stdout).into_owned();
                if text.ends_with("\n200") && text.starts_with(&from_a) {
                    ok += 1;
                } else {
                    failed.push(format!("{text:?} {}", String::from_utf8_lossy(&out.stderr)));
                }
            }
            (ok, failed)
        })
    };
    let epoch_live = |epoch: u64| {
        envoy_server_info(&envoy.admin).is_some_and(|v| {
            v["state"] == "LIVE" && v["command_line_options"]["restart_epoch"] == epoch
        })
    };
    wait_for("Envoy epoch 0 LIVE", WAIT, || epoch_live(0));
    let t0 = Instant::now();
    envoy.proc.signal("HUP");
    wait_for(
        "Envoy epoch 1 LIVE after SIGHUP",
        Duration::from_secs(30),
        || epoch_live(1),
    );
    let to_live = t0.elapsed();
    // Keep the stream on across the old epoch's drain and shutdown.
    wait_for("epoch 0 gone", Duration::from_secs(20), || {
        envoy_epochs(envoy.base_id) == vec![1]
    });
    let (ok, failed) = {
        stop.store(true, Ordering::Relaxed);
        load.join().unwrap()
    };
    println!(
        "capture under an Envoy hot restart: {ok} requests, {} failed, SIGHUP → epoch 1 LIVE in {to_live:?}",
        failed.len()
    );
    assert!(
        failed.is_empty(),
        "{} of {} captured requests failed across the hot restart: {:?}",
        failed.len(),
        ok as usize + failed.len(),
        &failed[..failed.len().min(5)]
    );
    assert!(ok >= 20, "too little traffic to mean anything: {ok}");
    // After the restart the new epoch still routes captured connections over mTLS.
    let (status, body) = curl_in(&a.ns, &url_b);
    assert_eq!((status, body.starts_with(&from_a)), (200, true), "{body}");

    drop(mesh);
    drop(envoy);
}

/// Connections accepted by all of Envoy's pod listeners (every `listener.<address>.`
/// `downstream_cx_total` but the admin's, which each stats fetch itself moves).
fn mesh_connections(stats: &std::collections::BTreeMap<String, u64>) -> u64 {
    stats
        .iter()
        .filter(|(n, _)| {
            n.starts_with("listener.")
                && !n.starts_with("listener.admin.")
                && n.ends_with(".downstream_cx_total")
        })
        .map(|(_, v)| v)
        .sum()
}

#[test]
fn the_access_log_has_one_line_per_request_with_both_identities() {
    let logs = tempfile::tempdir().unwrap();
    let log_path = logs.path().join("access.log");
    let agent = capture_agent_with(&["--access-log", log_path.to_str().unwrap()]);
    let _envoy = SupervisedEnvoy::start(&agent);
    let mesh = Mesh::start(&agent, "alog");
    let (a, b) = (&mesh.a, &mesh.b);
    until_ok(&a.ns, &format!("http://{}:8080/warm-up", b.ip));
    const REQUESTS: usize = 100;
    for i in 0..REQUESTS {
        // The query carries a token: it must not reach the log.
        let url = format!("http://{}:8080/req-{i}?token=s3cret", b.ip);
        let (status, body) = curl_in(&a.ns, &url);
        assert_eq!(status, 200, "request {i}: {body}");
    }
    let ours = |text: &str| -> Vec<serde_json::Value> {
        text.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).expect("a JSON line"))
            .filter(|v| v["path"].as_str().is_some_and(|p| p.starts_with("/req-")))
            .collect()
    };
    // Envoy flushes its buffered entries at least once a second.
    let (lines, text) = wait_for("100 access log lines", WAIT, || {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        let lines = ours(&text);
        (lines.len() >= REQUESTS).then_some((lines, text))
    });
    assert_eq!(lines.len(), REQUESTS, "one line per request");
    assert!(!text.contains("s3cret"), "a query reached the log");
    let paths: std::collections::BTreeSet<&str> =
        lines.iter().filter_map(|l| l["path"].as_str()).collect();
    assert_eq!(paths.len(), REQUESTS, "each request once");
    println!("an access log line: {}", lines[0]);
    for l in &lines {
        assert_eq!(l["protocol"], "http", "{l}");
        assert_eq!(
            l["source_spiffe_id"],
            format!("spiffe://{TRUST_DOMAIN}/ns/{}/sa/client", a.namespace),
            "{l}"
        );
        assert_eq!(
            l["destination_spiffe_id"],
            format!("spiffe://{TRUST_DOMAIN}/ns/default/sa/web"),
            "{l}"
        );
        assert_eq!(
            l["source_pod"],
            format!("{}/{}", a.namespace, a.name),
            "{l}"
        );
        assert_eq!(l["destination_pod"], "default/web-0", "{l}");
        assert_eq!(l["destination_service"], "web.default", "{l}");
        assert_eq!(l["destination_port"], 8080, "{l}");
        assert_eq!(l["method"], "GET", "{l}");
        assert_eq!(l["status"], 200, "{l}");
        assert!(l["duration_ms"].as_f64().is_some_and(|d| d > 0.0), "{l}");
        assert!(l["bytes_sent"].as_u64().is_some_and(|n| n > 0), "{l}");
        assert!(
            l["start_time"].as_str().is_some_and(|t| t.ends_with('Z')),
            "{l}"
        );
        let from = l["source_address"].as_str().unwrap_or_default();
        assert!(from.starts_with(&format!("{}:", a.ip)), "{l}");
    }
    // The file is the agent's: 0600.
    use std::os::unix::fs::PermissionsExt as _;
    let mode = std::fs::metadata(&log_path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    let (_, metrics) = agent.get("/metrics");
    assert!(
        metrics.contains("flock_access_log_dropped_total 0"),
        "{metrics}"
    );
}

/// The restart epochs of the live Envoy processes of `base_id` (from `/proc`; the
/// supervisor moves to the next base id when its own is taken).
fn envoy_epochs(base_id: u32) -> Vec<u32> {
    let mut epochs = Vec::new();
    let ids = [base_id.to_string(), (base_id + 1).to_string()];
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if !args.first().is_some_and(|a| a.ends_with("envoy"))
            || !args
                .windows(2)
                .any(|w| w[0] == "--base-id" && ids.contains(&w[1]))
        {
            continue;
        }
        if let Some(e) = args
            .windows(2)
            .find(|w| w[0] == "--restart-epoch")
            .and_then(|w| w[1].parse().ok())
        {
            epochs.push(e);
        }
    }
    epochs.sort();
    epochs
}

#[test]
fn agent_crash_leaves_one_table_and_check_and_restart_repair_drift() {
    let mut agent = capture_agent();
    let envoy = SupervisedEnvoy::start(&agent);
    let mesh = Mesh::start(&agent, "crash");
    let (a, b) = (&mesh.a, &mesh.b);
    let cni = &mesh.net.cni;
    let url_b = format!("http://{}:8080/", b.ip);
    until_ok(&a.ns, &url_b);
    let flock_tables = |pod: &Pod| {
        pod.tables()
            .into_iter()
            .filter(|(_, name)| name.starts_with("flock"))
            .count()
    };
    let rules_before = without_counts(&b.ruleset_text());
    let count_before = b.rule_count();
    assert_eq!(flock_tables(b), 1);

    // SIGKILL and restart: start-up verifies the stored pods' tables; nothing is
    // added twice.
    let flags = ["--capture", "strict", "--trust-domain", TRUST_DOMAIN];
    agent.respawn("n1", "memory", &flags);
    agent.wait_ready(WAIT);
    for pod in [a, b, &mesh.p] {
        assert_eq!(
            pod.tables(),
            vec![("inet".to_string(), "flock_capture".to_string())],
            "{} after an agent crash",
            pod.name
        );
    }
    assert_eq!(
        b.rule_count(),
        count_before,
        "rules duplicated by the restart"
    );
    assert_eq!(without_counts(&b.ruleset_text()), rules_before);
    let out = b.cni(cni, "check");
    assert!(
        out.status.success(),
        "CHECK after the restart: {}",
        String::from_utf8_lossy(&out.stderr)
    );

    // Drift: the table is deleted behind the agent's back. CHECK fails, naming it.
    b.ns.command("nft")
        .args(["delete", "table", "inet", "flock_capture"])
        .status()
        .unwrap();
    assert!(b.tables().is_empty());
    let out = b.cni(cni, "check");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success(),
        "CHECK passed without the table: {said}"
    );
    assert!(
        said.contains("flock_capture") && said.contains(&b.ns.path()),
        "CHECK's message does not name the table and the netns: {said}"
    );
    println!("CHECK with the table deleted: {}", said.trim());

    // The next start repairs it: one table, the same rules, CHECK passes, counted.
    agent.respawn("n1", "memory", &flags);
    agent.wait_ready(WAIT);
    assert_eq!(flock_tables(b), 1, "{}", b.ruleset_text());
    assert_eq!(without_counts(&b.ruleset_text()), rules_before);
    let out = b.cni(cni, "check");
    assert!(
        out.status.success(),
        "CHECK after the repair: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_, metrics) = agent.get("/metrics");
    let repairs: f64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("flock_capture_repairs_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no flock_capture_repairs_total in /metrics:\n{metrics}"));
    assert!(repairs >= 1.0, "repairs counted: {repairs}");
    // And the repaired capture still meshes A's unmodified client.
    let body = until_ok(&a.ns, &url_b);
    assert!(body.starts_with(&format!("web-0 saw {}:", a.ip)), "{body}");

    drop(mesh);
    drop(envoy);
}

/// The Service VIP phase, in kube mode: outside it the agent has no source of VIPs
/// (annotation mode knows no Services, only the service a pod joins), so this is the
/// only way to give one. The Kubernetes API server is flock-kube's API-server DOUBLE
/// (`flock_kube::double`, feature `testing`): it serves the real HTTP API to the
/// agent's kube client; everything else (libcni, nft, Envoy) is real.
#[test]
fn a_service_vip_is_routed_to_the_service_over_mtls() {
    use flock_kube::double::ApiServer;
    use k8s_openapi::api::core::v1::{Namespace, Pod as KubePod, Service};

    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let api = rt.block_on(ApiServer::start());
    let ns: Namespace = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {"flock.io/mesh": "enabled"}}
    }))
    .unwrap();
    api.apply(&ns);
    let kube_pod = |name: &str, account: &str, labels: serde_json::Value, ports| -> KubePod {
        serde_json::from_value(json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "shop", "uid": format!("uid-{name}"),
                         "labels": labels},
            "spec": {"nodeName": "n1", "serviceAccountName": account,
                     "containers": [{"name": "app", "image": "app", "ports": ports}]}
        }))
        .unwrap()
    };
    // An RFC 5737 address: never a real route here; only the capture makes it work.
    let vip = "192.0.2.80";
    let service: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"selector": {"app": "web"}, "clusterIP": vip, "clusterIPs": [vip],
                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    }))
    .unwrap();
    api.apply(&service);
    api.apply(&kube_pod(
        "web-0",
        "web",
        json!({"app": "web"}),
        json!([{"name": "http", "containerPort": 8080}]),
    ));
    api.apply(&kube_pod(
        "client-0",
        "client",
        json!({"app": "client"}),
        json!([]),
    ));

    let work = tempfile::Builder::new()
        .prefix("flock-capture-vip-")
        .tempdir()
        .unwrap();
    let kubeconfig = work.path().join("kubeconfig");
    api.write_kubeconfig(&kubeconfig);
    let agent = Agent::start(&[
        "--kube",
        "--kubeconfig",
        kubeconfig.to_str().unwrap(),
        "--kube-pod-wait",
        "1s",
        "--trust-domain",
        TRUST_DOMAIN,
        "--capture",
        "strict",
    ]);
    let envoy = SupervisedEnvoy::start(&agent);
    let net = ChainedNetwork::start(work.path(), &agent, "vip", 8000);
    let ns_b = NetNs::new("vb");
    let b_app = peer_echo_server_in(&ns_b, 8080, "web-0", &work.path().join("web.log"));
    let b = Pod::add_in(&net.cni, ns_b, "shop", "web-0", json!({}));
    let a = Pod::add_in(&net.cni, NetNs::new("va"), "shop", "client-0", json!({}));
    // A pod's default route goes to its node (what a cluster's CNI config sets up); a
    // ClusterIP is on no link, so without one connect() fails before any nat hook.
    ip(&[
        "-n", &a.ns.name, "route", "add", "default", "via", &a.gateway,
    ]);
    for pod in [&a, &b] {
        assert_eq!(
            pod.tables(),
            vec![("inet".to_string(), "flock_capture".to_string())],
            "{}",
            pod.name
        );
    }

    let before = envoy_stats(&envoy.admin);
    let body = until_ok(&a.ns, &format!("http://{vip}/"));
    assert!(
        body.starts_with(&format!("web-0 saw {}:", a.ip)),
        "B's app did not see A's own pod address: {body}"
    );
    let after = envoy_stats(&envoy.admin);
    let mtls_cluster = ["outbound|80|web.shop|", "ns/shop/sa/client."];
    assert!(
        stat(&after, &mtls_cluster, ".upstream_rq_total")
            > stat(&before, &mtls_cluster, ".upstream_rq_total"),
        "the VIP request did not take A's mTLS cluster of web.shop:80"
    );
    assert!(stat(&after, &mtls_cluster, ".ssl.handshake") >= 1);
    assert!(
        after
            .get(&format!("listener.{}_15006.ssl.handshake", b.ip))
            .copied()
            .unwrap_or(0)
            >= 1,
        "no TLS handshake on B's inbound listener"
    );
    let seen = peers_seen(&b_app);
    let callers: Vec<&String> = seen
        .iter()
        .filter(|s| !s.starts_with("127.0.0.1:"))
        .collect();
    assert!(
        !callers.is_empty() && callers.iter().all(|s| s.starts_with(&format!("{}:", a.ip))),
        "B's app saw another address than A's: {seen:?}"
    );

    drop((a, b, b_app, net));
    drop(envoy);
    drop(agent);
    drop(api);
    rt.shutdown_timeout(Duration::from_secs(1));
}
