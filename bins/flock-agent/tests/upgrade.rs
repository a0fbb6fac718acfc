//! An upgrade and a rollback without losing traffic or a CNI call, as a DaemonSet with
//! surge does them: generation N serving (real agent with `--capture strict`, real
//! Envoy under `flock-supervisor`, pods added through libcni with the real
//! `flock-cni`); generation N+1 started beside it (an agent on the same state
//! directory, sockets and admin address; a supervisor on the same state directory and
//! base id); then N's agent and supervisor SIGTERMed (the old pod's termination). Twice:
//! N → N+1, then N+1 → N+2 (the way back). Under
//!
//! * four loops of new connections from an unmodified client (curl) through Envoy to
//!   a meshed web pod,
//! * a long-lived HTTP/2 stream per hand-over (curl with prior knowledge to Envoy's
//!   outbound listener; the app streams its answer over 3 s),
//! * CNI ADD/DEL churn of other pods.
//!
//! `a_surge_upgrade_hands_the_node_over_without_losing_anything` asserts, each time:
//! N+1's agent stands by (its `--ready-file` says `standby`) without touching the store
//! or the sockets while N serves; N+1's supervisor hot-restarts Envoy (the next epoch is
//! LIVE); after N exits, N+1 serves (its ready file says `serving`, its `/readyz`
//! answers; the time is printed) and Envoy's epoch is N's + 1. At the end: no new
//! connection, stream or CNI call failed; the store, the registry and Envoy's config
//! agree on the pods; each pod has exactly one capture table.
//!
//! Needs root, nft, `FLOCK_ENVOY_BIN`, `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL`.

mod common;

use common::*;
use serde_json::{Value, json};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

const OUTBOUND: &str = "127.0.0.1:15001";

/// The web app: `/` answers `web-0`, `/slow` streams 6 chunks 0.5 s apart.
fn web_server(ns: &NetNs, log: std::path::PathBuf) -> ChildGuard {
    let src = r#"
import http.server, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = 'HTTP/1.1'
    def do_GET(self):
        if self.path == '/slow':
            self.send_response(200)
            self.send_header('transfer-encoding', 'chunked')
            self.end_headers()
            for i in range(6):
                b = ('part-%d\n' % i).encode()
                self.wfile.write(b'%x\r\n%s\r\n' % (len(b), b))
                self.wfile.flush()
                time.sleep(0.5)
            self.wfile.write(b'0\r\n\r\n')
            return
        b = b'web-0'
        self.send_response(200)
        self.send_header('content-length', str(len(b)))
        self.end_headers()
        self.wfile.write(b)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer.daemon_threads = True
http.server.ThreadingHTTPServer(('0.0.0.0', 8080), H).serve_forever()
"#;
    let mut cmd = ns.command("python3");
    cmd.args(["-c", src]);
    let mut server = ChildGuard::spawn(cmd, log);
    wait_for("the web app on its loopback", WAIT, || {
        assert!(server.running(), "{}", server.log_text());
        ns.command("curl")
            .args(["-sf", "-m", "2", "http://127.0.0.1:8080/"])
            .output()
            .is_ok_and(|o| o.stdout == b"web-0")
    });
    server
}

/// `curl` in `ns` to Envoy's outbound listener with `Host: web`: (status, body).
fn get(ns: &NetNs, path: &str, extra: &[&str]) -> (u16, String) {
    let out = ns
        .command("curl")
        .args(["-sS", "-m", "10", "-o", "-", "-w", "\n%{http_code}"])
        .args(extra)
        .args(["-H", "Host: web"])
        .arg(format!("http://{OUTBOUND}{path}"))
        .output()
        .expect("curl is needed");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

fn ready_file_says(path: &std::path::Path) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// The pod names of `/debug/pods`, sorted.
fn pods_of(admin: &str) -> Vec<String> {
    let Some(v) = http_json(admin, "/debug/pods") else {
        return Vec::new();
    };
    let mut pods: Vec<String> = v["pods"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| p["pod"].as_str().map(str::to_owned))
        .collect();
    pods.sort();
    pods
}

#[test]
fn a_surge_upgrade_hands_the_node_over_without_losing_anything() {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let work = tempfile::Builder::new()
        .prefix("flock-upgrade-")
        .tempdir()
        .unwrap();
    let ready_n = work.path().join("ready-n");
    let args = |ready: &std::path::Path| -> Vec<String> {
        vec![
            "--capture".into(),
            "strict".into(),
            "--ready-file".into(),
            ready.to_str().unwrap().into(),
        ]
    };
    let args_n = args(&ready_n);
    let args_n_ref: Vec<&str> = args_n.iter().map(String::as_str).collect();
    let mut agent = Agent::start(&args_n_ref);
    // Written once the CNI socket is served, right after the load that /readyz waits
    // for.
    wait_for("N's ready file says serving", WAIT, || {
        ready_file_says(&ready_n) == "serving"
    });
    let envoy = SupervisedEnvoy::start(&agent);
    let net = ChainedNetwork::start(work.path(), &agent, "upg", 5000);
    let cni = Arc::new(net.cni);

    let ns_web = NetNs::new("uw");
    let ns_client = NetNs::new("uc");
    let _web = web_server(&ns_web, work.path().join("web.log"));
    cni.ok(
        "add",
        &ns_web,
        "ctr-web",
        &PodSpec {
            namespace: "default",
            name: "web-0",
            uid: "uid-web",
            annotations: json!({"flock.io/service": "web", "flock.io/ports": "8080/http"}),
        },
    );
    cni.ok(
        "add",
        &ns_client,
        "ctr-client",
        &PodSpec {
            namespace: "default",
            name: "client-0",
            uid: "uid-client",
            annotations: json!({"flock.io/service": "client"}),
        },
    );
    wait_for("client → web through Envoy", WAIT, || {
        get(&ns_client, "/", &[]) == (200, "web-0".to_string())
    });

    // The load: new connections in a loop, and CNI churn of other pods.
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let failures = Arc::new(std::sync::Mutex::new(Vec::new()));
    // Four clients, so that even a short gap in what Envoy serves meets a request.
    let conns: Vec<_> = (0..4)
        .map(|_| {
            let (stop, ok, failed, failures) =
                (stop.clone(), ok.clone(), failed.clone(), failures.clone());
            let ns = NetNs {
                name: ns_client.name.clone(),
            };
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let r = get(&ns, "/", &[]);
                    if r == (200, "web-0".to_string()) {
                        ok.fetch_add(1, Ordering::Relaxed);
                    } else {
                        failed.fetch_add(1, Ordering::Relaxed);
                        failures.lock().unwrap().push(format!("{r:?}"));
                    }
                }
                // Not ours to delete.
                std::mem::forget(ns);
            })
        })
        .collect();
    let (cni_ok, cni_failed) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let cni_errors = Arc::new(std::sync::Mutex::new(Vec::new()));
    let churn = {
        let (stop, cni, cni_ok, cni_failed, cni_errors) = (
            stop.clone(),
            cni.clone(),
            cni_ok.clone(),
            cni_failed.clone(),
            cni_errors.clone(),
        );
        std::thread::spawn(move || {
            let mut i = 0;
            while !stop.load(Ordering::Relaxed) {
                i += 1;
                let ns = NetNs::new("uch");
                let name = format!("churn-{i}");
                let uid = format!("uid-churn-{i}");
                let pod = PodSpec {
                    namespace: "default",
                    name: &name,
                    uid: &uid,
                    annotations: json!({"flock.io/service": "churn"}),
                };
                let id = format!("ctr-churn-{i}");
                for verb in ["add", "del"] {
                    let out = cni.run(verb, &ns, &id, &pod);
                    if out.status.success() {
                        cni_ok.fetch_add(1, Ordering::Relaxed);
                    } else {
                        cni_failed.fetch_add(1, Ordering::Relaxed);
                        cni_errors.lock().unwrap().push(format!(
                            "{verb} {id}: {}",
                            String::from_utf8_lossy(&out.stdout)
                        ));
                    }
                }
            }
        })
    };
    wait_for("load running", WAIT, || {
        ok.load(Ordering::Relaxed) >= 3 && cni_ok.load(Ordering::Relaxed) >= 2
    });

    // Two hand-overs: N → N+1 (the upgrade), then N+1 → N+2 (a rollback, the same
    // way back). Each: the next agent stands by beside the current one, the next
    // supervisor hot-restarts Envoy (epoch + 1), then the current pair is SIGTERMed
    // (the old pod's termination) while an HTTP/2 stream is under way.
    let mut envoy = envoy;
    let mut streams = Vec::new();
    let mut ready_now = ready_n.clone();
    for generation in 1..=2u32 {
        let ready_next = work.path().join(format!("ready-{generation}"));
        let args_next = args(&ready_next);
        let args_next_ref: Vec<&str> = args_next.iter().map(String::as_str).collect();
        let mut successor =
            agent.successor("n1", "memory", &args_next_ref, &format!("gen{generation}"));
        wait_for("N+1 standing by", WAIT, || {
            assert!(
                successor.running(),
                "N+1 did not stand by beside N: it exited:\n{}",
                successor.log_text()
            );
            let says = ready_file_says(&ready_next);
            assert_ne!(
                says, "serving",
                "N+1 did not stand by beside N: it serves too"
            );
            says == "standby"
        });
        assert!(
            successor.log_text().contains("standing by until it exits"),
            "{}",
            successor.log_text()
        );
        assert!(!successor.log_text().contains("flock-agent listening"));
        assert_eq!(ready_file_says(&ready_now), "serving");

        // The next pod's supervisor takes Envoy over: epoch + 1, LIVE.
        let next_envoy = envoy.successor(&format!("gen{generation}"));
        let epoch = u64::from(generation);
        wait_for("Envoy's next epoch LIVE", WAIT, || {
            let log = next_envoy.log_text();
            assert!(
                !log.contains("died unexpectedly"),
                "Envoy hand-over failed: the next supervisor's hot restart (its Envoy epoch died):\n{log}"
            );
            let Ok((200, body)) = http_get(&envoy.admin, "/server_info") else {
                return false;
            };
            let info: Value = serde_json::from_str(&body).unwrap_or_default();
            info["state"] == "LIVE"
                && info["command_line_options"]["restart_epoch"].as_u64() == Some(epoch)
        });

        // The long-lived HTTP/2 stream starts before the hand-over and ends after it.
        streams.push({
            let ns = NetNs {
                name: ns_client.name.clone(),
            };
            std::thread::spawn(move || {
                let r = get(&ns, "/slow", &["--http2-prior-knowledge"]);
                std::mem::forget(ns);
                r
            })
        });
        std::thread::sleep(Duration::from_millis(300)); // under way (not a sync)

        // The old pod goes: its supervisor (superseded) and its agent get SIGTERM.
        envoy.proc.signal("TERM");
        let exit = agent.proc.stop(Duration::from_secs(30));
        let exited = Instant::now();
        assert_eq!(exit, Some(0), "N's exit status:\n{}", agent.proc.log_text());
        wait_for("N+1 serving", WAIT, || {
            assert!(successor.running(), "N+1 exited:\n{}", successor.log_text());
            ready_file_says(&ready_next) == "serving"
        });
        let serving_after = exited.elapsed();
        wait_for("N+1's /readyz", WAIT, || {
            matches!(http_get(&agent.admin, "/readyz"), Ok((200, _)))
        });
        let ready_after = exited.elapsed();
        eprintln!(
            "hand-over {generation}: N+1 serving the CNI socket {serving_after:?} and /readyz 200 {ready_after:?} after N exited"
        );
        assert!(!ready_now.exists(), "N left its ready file");
        let old_supervisor = envoy.proc.stop(Duration::from_secs(30));
        assert_eq!(old_supervisor, Some(0), "{}", envoy.proc.log_text());
        agent.proc = successor;
        envoy.proc = next_envoy;
        ready_now = ready_next;

        // Load through N+1 before the next round (or the end).
        let more = ok.load(Ordering::Relaxed) + 5;
        let more_cni = cni_ok.load(Ordering::Relaxed) + 4;
        wait_for("load through N+1", WAIT, || {
            ok.load(Ordering::Relaxed) >= more && cni_ok.load(Ordering::Relaxed) >= more_cni
        });
        let info: Value = wait_for("Envoy's admin after the hand-over", WAIT, || {
            let log = envoy.proc.log_text();
            assert!(
                !log.contains("died unexpectedly"),
                "Envoy hand-over failed: the next supervisor's Envoy died after it:\n{log}"
            );
            match http_get(&envoy.admin, "/server_info") {
                Ok((200, body)) => serde_json::from_str(&body).ok(),
                _ => None,
            }
        });
        assert_eq!(
            info["command_line_options"]["restart_epoch"].as_u64(),
            Some(epoch),
            "Envoy hand-over failed: Envoy's epoch after hand-over {generation}: {info}\n{}",
            envoy.proc.log_text()
        );
    }
    stop.store(true, Ordering::Relaxed);
    for c in conns {
        c.join().unwrap();
    }
    churn.join().unwrap();
    let streams: Vec<(u16, String)> = streams.into_iter().map(|t| t.join().unwrap()).collect();
    eprintln!(
        "load: {} new connections ok, {} failed; CNI {} ok, {} failed; the streams: {:?}",
        ok.load(Ordering::Relaxed),
        failed.load(Ordering::Relaxed),
        cni_ok.load(Ordering::Relaxed),
        cni_failed.load(Ordering::Relaxed),
        streams
            .iter()
            .map(|(s, b)| (s, b.len()))
            .collect::<Vec<_>>()
    );
    assert_eq!(
        failed.load(Ordering::Relaxed),
        0,
        "new connections failed across the hand-over: {:?}",
        failures.lock().unwrap()
    );
    assert_eq!(
        cni_failed.load(Ordering::Relaxed),
        0,
        "failed CNI calls: {:?}",
        cni_errors.lock().unwrap()
    );
    for (status, body) in &streams {
        assert_eq!(*status, 200, "a stream: {body}");
        assert_eq!(
            body.lines().collect::<Vec<_>>(),
            (0..6).map(|i| format!("part-{i}")).collect::<Vec<_>>(),
            "a stream's body"
        );
    }

    // Store, agent, registry and Envoy agree: web-0 and client-0, no churn leftovers.
    let want = vec!["default/client-0".to_string(), "default/web-0".to_string()];
    wait_for("N+1 holds exactly the two pods", WAIT, || {
        pods_of(&agent.admin) == want
    });
    assert_eq!(agent.store_files().len(), 2, "{:?}", agent.store_files());
    let reg = http_json(&agent.admin, "/debug/registry").unwrap();
    let entries: Vec<Value> = match &reg["endpoints"] {
        Value::Object(m) => m.values().cloned().collect(),
        Value::Array(a) => a.clone(),
        _ => Vec::new(),
    };
    assert_eq!(entries.len(), 1, "the registry: {reg}");
    assert_eq!(entries[0]["service"], "web", "{reg}");
    wait_for("Envoy's config from N+1", WAIT, || {
        let d = envoy.config_dump();
        d.contains("inbound|default/web-0|8080") && !d.contains("churn-")
    });
    // One capture table per pod: N+1's start-up check re-applied nothing twice.
    for ns in [&ns_web, &ns_client] {
        let out = ns.command("nft").args(["list", "tables"]).output().unwrap();
        let tables = String::from_utf8_lossy(&out.stdout);
        assert_eq!(
            tables.matches("flock_capture").count(),
            1,
            "{}: {tables}",
            ns.name
        );
    }
}
