//! Traffic policy end to end: the real agent with `--routes-dir`, a real Envoy under
//! `flock-supervisor`, pods on a libcni bridge whose apps are real HTTP servers, and
//! an unmodified `curl` in the client pod sending through its outbound listener
//! (`Host: web`). The routes are Gateway API `HTTPRoute` files, as an operator writes
//! them, on the Service `web` (no endpoints of its own: GAMMA's usual shape), with
//! `web-v1`, `web-v2`, `web-slow` and `web-flaky` behind it.
//!
//! `routes_split_match_time_out_and_retry_through_envoy` checks, in one mesh:
//! * a 90/10 split over 1,000 requests lands within ±3 points;
//! * `x-canary: 1` goes to v2 only;
//! * a backend taking 2 s under a 500 ms timeout answers 504, long before the 2 s;
//! * a backend failing every other GET, with 2 retries, leaves under 1% errors, and
//!   its POSTs are not repeated (the backend counts each one);
//! * weights rewritten every second for 30 s under load fail no request;
//! * a route with an unknown filter is refused alone and one with a missing backend
//!   is reported (`/debug/routes`, `flockctl routes` exits 1), while the other
//!   routes keep serving;
//! * with `--capture strict`, an unmodified request to a routed service's address
//!   follows the route as well.
//!
//! Needs root, `FLOCK_ENVOY_BIN`, `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL`, python3,
//! curl and the sibling binaries (see `common`).

mod capturekit;
mod common;

use capturekit::*;
use common::*;
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// A real HTTP/1.1 server (Python) in `ns` on port 8080, naming itself in the
/// `x-backend` header of every answer and logging `req <METHOD> <path>` per request.
/// `/slow` answers after 2 s; `/flaky` fails every other request of each method with
/// 503.
fn backend_in(ns: &NetNs, name: &str, log: &Path) -> ChildGuard {
    let src = format!(
        "import http.server, time, threading\n\
         lock = threading.Lock()\n\
         counts = {{}}\n\
         class H(http.server.BaseHTTPRequestHandler):\n\
         \x20   protocol_version = 'HTTP/1.1'\n\
         \x20   def answer(self):\n\
         \x20       n = int(self.headers.get('content-length') or 0)\n\
         \x20       if n: self.rfile.read(n)\n\
         \x20       print('req %s %s' % (self.command, self.path), flush=True)\n\
         \x20       code = 200\n\
         \x20       if self.path.startswith('/slow'): time.sleep(2)\n\
         \x20       if self.path.startswith('/flaky'):\n\
         \x20           with lock:\n\
         \x20               counts[self.command] = counts.get(self.command, 0) + 1\n\
         \x20               code = 503 if counts[self.command] % 2 == 1 else 200\n\
         \x20       self.send_response(code)\n\
         \x20       self.send_header('x-backend', '{name}')\n\
         \x20       self.send_header('content-length', '0')\n\
         \x20       self.end_headers()\n\
         \x20   do_GET = answer\n\
         \x20   do_POST = answer\n\
         \x20   def log_message(self, *a): pass\n\
         http.server.ThreadingHTTPServer(('0.0.0.0', 8080), H).serve_forever()\n"
    );
    let mut cmd = ns.command("python3");
    cmd.args(["-u", "-c", &src]);
    let mut server = ChildGuard::spawn(cmd, log.to_path_buf());
    wait_for("the backend's HTTP server", WAIT, || {
        assert!(server.running(), "server exited: {}", server.log_text());
        ns.command("curl")
            .args(["-sf", "-m", "2", "http://127.0.0.1:8080/ready"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    server
}

/// `count` requests from `ns` through its outbound listener to `Host: web` at
/// `path` (one curl, one connection reused), with `extra` curl arguments: each
/// answer's (status, x-backend).
fn burst(ns: &NetNs, path: &str, count: usize, extra: &[&str]) -> Vec<(u16, String)> {
    burst_to(ns, "web", path, count, extra)
}

/// [`burst`] to `Host: host`.
fn burst_to(
    ns: &NetNs,
    host: &str,
    path: &str,
    count: usize,
    extra: &[&str],
) -> Vec<(u16, String)> {
    let url = format!("http://127.0.0.1:15001{path}?n=[1-{count}]");
    let out = ns
        .command("curl")
        .args([
            "-s",
            "-m",
            "120",
            "-o",
            "/dev/null",
            "-H",
            &format!("Host: {host}"),
        ])
        .args(extra)
        .args(["-w", "%{http_code} %header{x-backend}\\n", &url])
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .map(|l| {
            let (code, backend) = l.split_once(' ').unwrap_or((l, ""));
            (code.parse().unwrap_or(0), backend.to_string())
        })
        .collect()
}

fn tally(answers: &[(u16, String)]) -> BTreeMap<String, usize> {
    let mut t = BTreeMap::new();
    for (code, backend) in answers {
        *t.entry(format!("{code} {backend}")).or_default() += 1;
    }
    t
}

/// Writes `route` as `dir/name` the way a ConfigMap update or `kubectl cp` lands:
/// a temporary file renamed into place.
fn write_route(dir: &Path, name: &str, route: &Value) {
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, serde_json::to_vec_pretty(route).unwrap()).unwrap();
    std::fs::rename(&tmp, dir.join(name)).unwrap();
}

fn web_route(v1: u32, v2: u32) -> Value {
    json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": { "name": "web", "namespace": "default" },
        "spec": {
            "parentRefs": [{ "group": "", "kind": "Service", "name": "web", "port": 8080 }],
            "rules": [
                { "matches": [{ "headers": [{ "name": "x-canary", "value": "1" }] }],
                  "backendRefs": [{ "name": "web-v2", "port": 8080 }] },
                { "matches": [{ "path": { "type": "PathPrefix", "value": "/slow" } }],
                  "backendRefs": [{ "name": "web-slow", "port": 8080 }],
                  "timeouts": { "request": "500ms" } },
                { "matches": [{ "path": { "type": "PathPrefix", "value": "/flaky" } }],
                  "backendRefs": [{ "name": "web-flaky", "port": 8080 }],
                  "retry": { "attempts": 2, "codes": [503], "backoff": "10ms" } },
                { "backendRefs": [
                    { "name": "web-v1", "port": 8080, "weight": v1 },
                    { "name": "web-v2", "port": 8080, "weight": v2 }] }
            ]
        }
    })
}

fn route_states(agent: &Agent) -> BTreeMap<String, (String, Vec<String>)> {
    agent.json("/debug/routes")["routes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            let problems = r["problems"]
                .as_array()
                .map(|p| p.iter().map(|x| x.as_str().unwrap().to_string()).collect())
                .unwrap_or_default();
            (
                r["key"].as_str().unwrap().to_string(),
                (r["state"].as_str().unwrap().to_string(), problems),
            )
        })
        .collect()
}

#[test]
fn routes_split_match_time_out_and_retry_through_envoy() {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let _ = envoy_bin();
    let work = tempfile::Builder::new()
        .prefix("flock-traffic-")
        .tempdir()
        .unwrap();
    let routes = work.path().join("routes");
    std::fs::create_dir(&routes).unwrap();
    write_route(&routes, "web.json", &web_route(90, 10));
    let agent = Agent::start(&[
        "--routes-dir",
        routes.to_str().unwrap(),
        "--capture",
        "strict",
    ]);
    let _envoy = SupervisedEnvoy::start(&agent);
    let net = ChainedNetwork::start(work.path(), &agent, "trf", 8000);
    let log = |n: &str| work.path().join(format!("{n}.log"));
    let mut apps = Vec::new();
    let mut pods = Vec::new();
    for (tag, name) in [
        ("tv1", "web-v1"),
        ("tv2", "web-v2"),
        ("tsl", "web-slow"),
        ("tfl", "web-flaky"),
    ] {
        let ns = NetNs::new(tag);
        apps.push(backend_in(&ns, name, &log(name)));
        pods.push(Pod::add_server(&net.cni, ns, &format!("{name}-0"), name));
    }
    let client = Pod::add_client(&net.cni, "tcl", "client-0");
    wait_for("web's route in force with every backend", WAIT, || {
        let states = route_states(&agent);
        states.get("web.json").is_some_and(|(s, _)| s == "Accepted")
            && burst(&client.ns, "/", 1, &[])[0].0 == 200
            && burst(&client.ns, "/", 1, &["-H", "x-canary: 1"])[0].0 == 200
    });

    // The 90/10 split over 1,000 requests.
    let answers = burst(&client.ns, "/", 1000, &[]);
    let t = tally(&answers);
    let v2 = t.get("200 web-v2").copied().unwrap_or(0);
    println!("split 90/10 over 1000: {t:?}");
    assert_eq!(
        t.get("200 web-v1").copied().unwrap_or(0) + v2,
        1000,
        "every request answered by v1 or v2: {t:?}"
    );
    assert!((70..=130).contains(&v2), "v2 got {v2} of 1000: {t:?}");

    // The canary header: v2 only.
    let t = tally(&burst(&client.ns, "/", 100, &["-H", "x-canary: 1"]));
    assert_eq!(t, BTreeMap::from([("200 web-v2".to_string(), 100)]));

    // A 2 s backend under a 500 ms timeout: 504, cut at the timeout.
    let started = Instant::now();
    let slow = burst(&client.ns, "/slow", 1, &[]);
    let took = started.elapsed();
    println!("/slow answered {:?} in {took:?}", slow[0]);
    assert_eq!(slow[0].0, 504, "{slow:?}");
    assert!(
        took < Duration::from_millis(1900),
        "took {took:?}: the timeout did not cut it"
    );

    // Every other GET of web-flaky fails: 2 retries hide them.
    let flaky = burst(&client.ns, "/flaky", 200, &[]);
    let errors = flaky.iter().filter(|(c, _)| *c != 200).count();
    println!("flaky GETs: {:?}", tally(&flaky));
    assert!(
        errors * 100 < flaky.len(),
        "{errors} of {} GETs failed",
        flaky.len()
    );
    // POSTs reach the app once each: half fail, none is repeated.
    let posts = burst(&client.ns, "/flaky", 100, &["-X", "POST", "-d", "x"]);
    let post_errors = posts.iter().filter(|(c, _)| *c == 503).count();
    println!("flaky POSTs: {:?}", tally(&posts));
    let seen = wait_for("the flaky app to log every POST", WAIT, || {
        let n = apps[3]
            .log_text()
            .lines()
            .filter(|l| l.starts_with("req POST /flaky"))
            .count();
        (n >= 100).then_some(n)
    });
    assert_eq!(seen, 100, "POSTs repeated: the app saw {seen} for 100 sent");
    assert!(
        post_errors >= 40,
        "{post_errors} POSTs failed: the app fails every other one"
    );

    // Weights rewritten every second for 30 s under load: no request fails.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut i = 0u32;
    let under_load = std::thread::scope(|scope| {
        let load = scope.spawn(|| {
            let mut all = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                all.extend(burst(&client.ns, "/", 200, &[]));
            }
            all
        });
        let until = Instant::now() + Duration::from_secs(30);
        while Instant::now() < until {
            i += 1;
            let v2 = (i * 17) % 100 + 1;
            write_route(&routes, "web.json", &web_route(101 - v2, v2));
            // The pace of the change, not a wait for anything.
            std::thread::sleep(Duration::from_secs(1));
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        load.join().unwrap()
    });
    let t = tally(&under_load);
    println!(
        "{} requests while the weights changed {i} times: {t:?}",
        under_load.len()
    );
    assert!(under_load.len() > 1000, "{t:?}");
    let failed = under_load.iter().filter(|(c, _)| *c != 200).count();
    assert_eq!(failed, 0, "{t:?}");

    // A route with an unknown filter is refused alone; one with a missing backend is
    // served without it; both are reported, and web keeps working.
    let mut bad = web_route(50, 50);
    bad["metadata"]["name"] = "other".into();
    bad["spec"]["parentRefs"][0]["name"] = "other".into();
    bad["spec"]["rules"][3]["filters"] = json!([{ "type": "RequestMirror" }]);
    write_route(&routes, "other.json", &bad);
    let mut missing = web_route(50, 50);
    missing["metadata"]["name"] = "third".into();
    missing["spec"]["parentRefs"][0]["name"] = "third".into();
    missing["spec"]["rules"][3]["backendRefs"][1]["name"] = "web-gone".into();
    write_route(&routes, "third.json", &missing);
    let states = wait_for("both new routes reported", WAIT, || {
        let s = route_states(&agent);
        (s.get("other.json").is_some_and(|(st, _)| st == "Refused")
            && s.get("third.json")
                .is_some_and(|(st, _)| st == "PartiallyInvalid"))
        .then_some(s)
    });
    println!("{states:?}");
    assert!(
        states["other.json"].1[0].contains("spec.rules[3].filters[0]"),
        "{states:?}"
    );
    assert!(states["third.json"].1[0].contains("web-gone"), "{states:?}");
    assert_eq!(states["web.json"].0, "Accepted", "{states:?}");
    let out = agent.flockctl(&["routes"]);
    assert_eq!(out.status.code(), Some(1), "{out:?}");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Refused") && text.contains("web-gone"),
        "{text}"
    );
    let t = tally(&burst(&client.ns, "/", 100, &[]));
    assert_eq!(t.values().sum::<usize>(), 100);
    assert!(t.keys().all(|k| k.starts_with("200 ")), "{t:?}");
    // `third` routes what it can: the missing backend's share is gone, v1 takes all.
    let third = burst_to(&client.ns, "third", "/", 20, &[]);
    assert!(
        third.iter().all(|(c, b)| *c == 200 && b == "web-v1"),
        "{third:?}"
    );

    // Captured callers follow routes too: an unmodified request to web-v1's own
    // address (no Host trick, no proxy setting) with `x-canary: 1` is routed to v2 by
    // a route on web-v1, through the client's captured outbound listener.
    let mut on_v1 = web_route(100, 0);
    on_v1["metadata"]["name"] = "v1".into();
    on_v1["spec"]["parentRefs"][0]["name"] = "web-v1".into();
    on_v1["spec"]["rules"][3]["backendRefs"] = json!([{ "name": "web-v1", "port": 8080 }]);
    write_route(&routes, "v1.json", &on_v1);
    let v1_url = format!("http://{}:8080/", pods[0].ip);
    let backend_of = |extra: &[&str]| {
        let out = client
            .ns
            .command("curl")
            .args(["-s", "-m", "5", "-o", "/dev/null"])
            .args(extra)
            .args(["-w", "%{http_code} %header{x-backend}", &v1_url])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    wait_for(
        "a captured request to web-v1 with x-canary routed to v2",
        WAIT,
        || backend_of(&["-H", "x-canary: 1"]) == "200 web-v2",
    );
    assert_eq!(backend_of(&[]), "200 web-v1");
    drop(pods);
}

/// Subsets of one Service by label: three pods serve `shop`, registered with
/// `flock.io/labels` `version=v1`, `version=v2` and none; a route on `shop` sends
/// `x-canary: 1` to the subset v2 and splits the rest 80/20 over the subsets v1 and
/// v2 (`flock.io/subsets`, backendRefs of kind `ServiceSubset`). The pod without a
/// version is in neither subset, so a routed request never reaches it; a subset no
/// pod matches is reported and its share dropped. The real agent and Envoy, pods on
/// a libcni bridge, unmodified curl (as [`routes_split_match_time_out_and_retry_through_envoy`]).
#[test]
fn subsets_split_one_service_by_version_label_through_envoy() {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let _ = envoy_bin();
    let work = tempfile::Builder::new()
        .prefix("flock-subsets-")
        .tempdir()
        .unwrap();
    let routes = work.path().join("routes");
    std::fs::create_dir(&routes).unwrap();
    let subset = |name: &str, port: u16, weight: u32| {
        json!({ "group": "flock.io", "kind": "ServiceSubset", "name": name,
                "port": port, "weight": weight })
    };
    let route = json!({
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": { "name": "shop", "namespace": "default", "annotations": {
            "flock.io/subsets": json!({
                "v1": { "service": "shop", "labels": { "version": "v1" } },
                "v2": { "service": "shop", "labels": { "version": "v2" } },
                "v3": { "service": "shop", "labels": { "version": "v3" } }
            }).to_string() } },
        "spec": {
            "parentRefs": [{ "group": "", "kind": "Service", "name": "shop", "port": 8080 }],
            "rules": [
                { "matches": [{ "headers": [{ "name": "x-canary", "value": "1" }] }],
                  "backendRefs": [subset("v2", 8080, 1)] },
                { "backendRefs": [subset("v1", 8080, 80), subset("v2", 8080, 20),
                                  subset("v3", 8080, 10)] }
            ]
        }
    });
    write_route(&routes, "shop.json", &route);
    let agent = Agent::start(&["--routes-dir", routes.to_str().unwrap()]);
    let _envoy = SupervisedEnvoy::start(&agent);
    let net = ChainedNetwork::start(work.path(), &agent, "sub", 8000);
    let log = |n: &str| work.path().join(format!("{n}.log"));
    let mut apps = Vec::new();
    let mut pods = Vec::new();
    for (tag, name, labels) in [
        ("sv1", "shop-v1", Some("version=v1")),
        ("sv2", "shop-v2", Some("version=v2")),
        ("svx", "shop-x", None),
    ] {
        let ns = NetNs::new(tag);
        apps.push(backend_in(&ns, name, &log(name)));
        let mut annotations = json!({"flock.io/service": "shop", "flock.io/ports": "8080/http",
                                     "flock.io/service-account": "shop"});
        if let Some(l) = labels {
            annotations["flock.io/labels"] = l.into();
        }
        pods.push(Pod::add_in(
            &net.cni,
            ns,
            "default",
            &format!("{name}-0"),
            annotations,
        ));
    }
    let client = Pod::add_client(&net.cni, "scl", "client-0");
    let states = wait_for("shop's route in force over both subsets", WAIT, || {
        let states = route_states(&agent);
        (burst_to(&client.ns, "shop", "/", 1, &["-H", "x-canary: 1"])[0]
            == (200, "shop-v2".to_string())
            && states.get("shop.json").is_some_and(|(_, p)| !p.is_empty()))
        .then_some(states)
    });
    // v3 matches no pod: reported, its share dropped; the rest is served.
    let (state, problems) = &states["shop.json"];
    assert_eq!(state, "PartiallyInvalid", "{states:?}");
    assert!(
        problems.len() == 1 && problems[0].contains("subset version=v3 has no endpoints"),
        "{problems:?}"
    );

    let t = tally(&burst_to(
        &client.ns,
        "shop",
        "/",
        100,
        &["-H", "x-canary: 1"],
    ));
    assert_eq!(t, BTreeMap::from([("200 shop-v2".to_string(), 100)]));

    let answers = burst_to(&client.ns, "shop", "/", 1000, &[]);
    let t = tally(&answers);
    println!("subsets 80/20 over 1000: {t:?}");
    let v1 = t.get("200 shop-v1").copied().unwrap_or(0);
    let v2 = t.get("200 shop-v2").copied().unwrap_or(0);
    assert_eq!(v1 + v2, 1000, "every request answered by v1 or v2: {t:?}");
    assert!((170..=230).contains(&v2), "v2 got {v2} of 1000: {t:?}");
    // The pod without a version label saw none of it.
    assert!(
        !apps[2].log_text().contains("req GET /?n="),
        "shop-x was sent a routed request: {}",
        apps[2].log_text()
    );
    drop(pods);
}

/// The bootstrap's overload manager as `flock-agent envoy-bootstrap` writes it with
/// the DaemonSet's memory limit (the downward API's bytes) is one the real Envoy
/// accepts (`--mode validate` loads every extension and checks every field), with
/// the heap monitor at 90% of the limit and the three actions; without a limit only
/// the connection cap is there. Every other end-to-end test runs Envoy on this
/// bootstrap too (`Agent::envoy_bootstrap`).
#[test]
fn the_overload_manager_in_the_bootstrap_is_accepted_by_envoy() {
    let envoy = envoy_bin();
    let dir = tempfile::tempdir().unwrap();
    for limit in [Some("536870912"), None] {
        let mut cmd = std::process::Command::new(sibling_bin("flock-agent"));
        cmd.args(["--node-name", "n1", "--xds-socket"])
            .arg(dir.path().join("xds.sock"))
            .arg("--envoy-admin-socket")
            .arg(dir.path().join("admin.sock"))
            .env_remove("FLOCK_ENVOY_MEMORY_LIMIT");
        if let Some(bytes) = limit {
            cmd.env("FLOCK_ENVOY_MEMORY_LIMIT", bytes);
        }
        let out = cmd.arg("envoy-bootstrap").output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let doc: Value = serde_json::from_slice(&out.stdout).unwrap();
        let om = &doc["overload_manager"];
        let monitors = om["resource_monitors"].as_array().unwrap();
        assert_eq!(
            monitors[0]["typed_config"]["max_active_downstream_connections"],
            65536
        );
        match limit {
            Some(_) => {
                assert_eq!(
                    monitors[1]["typed_config"]["max_heap_size_bytes"],
                    536870912u64 / 100 * 90
                );
                assert_eq!(om["actions"].as_array().unwrap().len(), 3, "{om}");
            }
            None => {
                assert_eq!(monitors.len(), 1, "{om}");
                assert!(om["actions"].as_array().unwrap().is_empty(), "{om}");
            }
        }
        let path = dir.path().join("envoy.json");
        std::fs::write(&path, &out.stdout).unwrap();
        let check = std::process::Command::new(&envoy)
            .args(["--mode", "validate", "-c"])
            .arg(&path)
            .output()
            .unwrap();
        assert!(
            check.status.success(),
            "Envoy refused the bootstrap: {}{}",
            String::from_utf8_lossy(&check.stdout),
            String::from_utf8_lossy(&check.stderr)
        );
    }
}
