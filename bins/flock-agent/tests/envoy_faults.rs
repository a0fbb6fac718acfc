//! Envoy faults under CNI load: the real `flock-agent` (a test build: its
//! `fault-injection` feature publishes configs Envoy rejects while
//! `<state-dir>/fault-xds-invalid` exists), a real Envoy under the real
//! `flock-supervisor` on the agent's own bootstrap (Delta ADS over its unix socket), and
//! CNI ADD/DEL load through the agent's CNI socket (gRPC, as the plugin sends it) on
//! pods that each have a network namespace and an address of their own, so Envoy can
//! bind every listener it is given.
//!
//! * **NACK everything**: every cluster and listener published is invalid (a negative
//!   `connect_timeout`, no filter chains), so Envoy rejects every CDS and LDS update.
//!   CNI keeps succeeding, the admin endpoint answers, `/readyz` stays 200 and names
//!   the rejecting node and type, `flock_xds_streams_nacked` counts it, `flockctl
//!   proxy-status` shows both types NACKED with Envoy's reason (exit 1), and a request
//!   through a listener Envoy had before the fault still reaches the app (Envoy keeps
//!   its last good config). The first valid snapshot after the fault is ACKed, and
//!   Envoy then holds exactly the agent's listeners and clusters, and proxy-status
//!   shows every type SYNCED (exit 0).
//! * **Envoy SIGKILLed**: the supervisor starts a new Envoy, which gets the current
//!   snapshot (its `/config_dump` holds exactly the agent's listeners and clusters);
//!   CNI is unaffected meanwhile.
//! * **Slow ACKs**: a raw Delta ADS client (flock-xds's) that holds its ACK is named in
//!   `/readyz` and counted in `flock_agent_xds_streams_slow_ack` once past the limit,
//!   while CNI, the admin endpoint and the real Envoy's stream go on (Envoy keeps ACKing
//!   and converges); once it ACKs it gets the newest version at once (coalesced, no
//!   backlog).
//!
//! Each prints its figures: CNI operations during the fault, failures, the slowest
//! operation, time to detect and to converge.
//!
//! Needs root (network namespaces), `FLOCK_ENVOY_BIN` and the sibling binaries built
//! (see `common`).

mod common;

use common::*;
use flock_cni::client;
use flock_cni::proto::v1::{AddPodRequest, IpConfig, Outcome, PodRef, RemovePodRequest};
use serde_json::Value;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Pods the load toggles (ADD when absent, DEL when present), one netns each.
const LOAD_PODS: usize = 12;
/// Load workers; each owns `LOAD_PODS / WORKERS` pods, so no pod sees two calls at once.
const WORKERS: usize = 4;
/// One CNI call's limit (the plugin's default is 5 s).
const CALL: Duration = Duration::from_secs(5);
/// The pod that stays through every fault: its app answers through its inbound
/// listener.
/// web-0's address: routed from the host namespace, so unique per test process (tests
/// run in parallel), from the pid in 100.64.0.0/10 (shared address space, not routed
/// beyond the host).
fn web_ip() -> String {
    let pid = std::process::id() & 0x3f_ffff;
    format!(
        "100.{}.{}.{}",
        64 + (pid >> 16),
        (pid >> 8) & 0xff,
        pid & 0xff
    )
}
const WEB_BODY: &str = "hello from web-0";

fn pod_ip(k: usize) -> String {
    format!("10.77.1.{}", k + 2)
}

/// The pods: network namespaces with their address (web-0's on a veth link to the host,
/// the load pods' on loopback: the inbound listener binds it there) and the AddPod/RemovePod requests for them.
struct Pods {
    web: NetNs,
    load: Vec<NetNs>,
}

impl Pods {
    fn new() -> Self {
        // web-0 is reached from Envoy's (root) namespace, so it gets a veth link: its
        // address on its end, a host route to it on ours. Deleting the namespace
        // deletes both ends.
        let web = NetNs::new("ef-web");
        let host_end = format!("efw{}", std::process::id() % 1_000_000);
        ip(&[
            "link", "add", &host_end, "type", "veth", "peer", "name", "eth0", "netns", &web.name,
        ]);
        ip(&["link", "set", &host_end, "up"]);
        ip(&["-n", &web.name, "link", "set", "eth0", "up"]);
        ip(&[
            "-n",
            &web.name,
            "addr",
            "add",
            &format!("{}/32", web_ip()),
            "dev",
            "eth0",
        ]);
        ip(&["-n", &web.name, "route", "add", "default", "dev", "eth0"]);
        ip(&[
            "route",
            "add",
            &format!("{}/32", web_ip()),
            "dev",
            &host_end,
        ]);
        let load = (0..LOAD_PODS)
            .map(|k| {
                let ns = NetNs::new("ef");
                ip(&[
                    "-n",
                    &ns.name,
                    "addr",
                    "add",
                    &format!("{}/32", pod_ip(k)),
                    "dev",
                    "lo",
                ]);
                ns
            })
            .collect();
        Self { web, load }
    }

    fn web_add(&self) -> AddPodRequest {
        add_request(
            "ctr-web",
            "web-0",
            &self.web.path(),
            &web_ip(),
            "web",
            "8080/http",
        )
    }

    fn load_add(&self, k: usize) -> AddPodRequest {
        add_request(
            &format!("ctr-{k}"),
            &format!("pod-{k}"),
            &self.load[k].path(),
            &pod_ip(k),
            &format!("svc-{}", k % 3),
            "8080",
        )
    }

    fn load_del(&self, k: usize) -> RemovePodRequest {
        RemovePodRequest {
            container_id: format!("ctr-{k}"),
            netns: self.load[k].path(),
            ifname: "eth0".into(),
            pod: Some(PodRef {
                name: format!("pod-{k}"),
                namespace: "default".into(),
                uid: format!("uid-pod-{k}"),
            }),
            network_name: "net".into(),
        }
    }
}

fn add_request(
    container: &str,
    name: &str,
    netns: &str,
    ip: &str,
    service: &str,
    ports: &str,
) -> AddPodRequest {
    AddPodRequest {
        container_id: container.into(),
        netns: netns.into(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: name.into(),
            namespace: "default".into(),
            uid: format!("uid-{name}"),
        }),
        ips: vec![IpConfig {
            address: format!("{ip}/32"),
            ..IpConfig::default()
        }],
        annotations: HashMap::from([
            ("flock.io/service".to_string(), service.to_string()),
            ("flock.io/ports".to_string(), ports.to_string()),
        ]),
        network_name: "net".into(),
        cni_version: "1.1.0".into(),
        prev_result_json: String::new(),
    }
}

/// What the load did in one window.
#[derive(Debug, Default)]
struct Counts {
    ops: AtomicU64,
    failures: AtomicU64,
    /// The slowest call, in microseconds.
    slowest_us: AtomicU64,
}

impl Counts {
    fn take(&self) -> (u64, u64, Duration) {
        (
            self.ops.swap(0, Ordering::SeqCst),
            self.failures.swap(0, Ordering::SeqCst),
            Duration::from_micros(self.slowest_us.swap(0, Ordering::SeqCst)),
        )
    }
}

/// CNI ADD/DEL load on the agent's socket until stopped; every failure's message is
/// kept.
struct Load {
    counts: Arc<Counts>,
    errors: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Load {
    fn start(rt: &tokio::runtime::Runtime, socket: PathBuf, pods: &Arc<Pods>) -> Self {
        let counts = Arc::new(Counts::default());
        let errors = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let tasks = (0..WORKERS)
            .map(|w| {
                let (counts, errors, stop) = (counts.clone(), errors.clone(), stop.clone());
                let (pods, socket) = (Arc::clone(pods), socket.clone());
                rt.spawn(async move {
                    let mine: Vec<usize> = (w..LOAD_PODS).step_by(WORKERS).collect();
                    let mut present = [false; LOAD_PODS];
                    let mut i = 0;
                    while !stop.load(Ordering::SeqCst) {
                        let k = mine[i % mine.len()];
                        i += 1;
                        let started = Instant::now();
                        let result = if present[k] {
                            let req = pods.load_del(k);
                            client::call(
                                &socket,
                                CALL,
                                |mut c| async move { c.remove_pod(req).await },
                            )
                            .await
                            .map(|r| (r.outcome, r.message))
                        } else {
                            let req = pods.load_add(k);
                            client::call(&socket, CALL, |mut c| async move { c.add_pod(req).await })
                                .await
                                .map(|r| (r.outcome, r.message))
                        };
                        let took = started.elapsed().as_micros() as u64;
                        counts.slowest_us.fetch_max(took, Ordering::SeqCst);
                        counts.ops.fetch_add(1, Ordering::SeqCst);
                        match result {
                            Ok((outcome, _)) if outcome == Outcome::Success as i32 => {
                                present[k] = !present[k];
                            }
                            Ok((outcome, message)) => {
                                counts.failures.fetch_add(1, Ordering::SeqCst);
                                errors
                                    .lock()
                                    .unwrap()
                                    .push(format!("pod {k}: outcome {outcome}: {message}"));
                            }
                            Err(e) => {
                                counts.failures.fetch_add(1, Ordering::SeqCst);
                                errors.lock().unwrap().push(format!("pod {k}: {e}"));
                            }
                        }
                    }
                })
            })
            .collect();
        Self {
            counts,
            errors,
            stop,
            tasks,
        }
    }

    /// Waits until the load has done `n` more operations (it makes progress).
    fn wait_ops(&self, n: u64) {
        let start = self.counts.ops.load(Ordering::SeqCst);
        wait_for("CNI load to make progress", WAIT, || {
            self.counts.ops.load(Ordering::SeqCst) >= start + n
        });
    }

    fn stop(mut self, rt: &tokio::runtime::Runtime) -> Vec<String> {
        self.stop.store(true, Ordering::SeqCst);
        for t in std::mem::take(&mut self.tasks) {
            rt.block_on(t).unwrap();
        }
        self.errors.lock().unwrap().clone()
    }
}

impl Drop for Load {
    /// A test that panics with the load running stops it too, so its tasks end with
    /// the runtime instead of calling a torn-down agent.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

/// One agent, one supervised Envoy, the web pod with its app, and a runtime for the
/// load. Field order is drop order: Envoy before the agent, processes before netns.
struct Setup {
    envoy: SupervisedEnvoy,
    _app: ChildGuard,
    agent: Agent,
    pods: Arc<Pods>,
    rt: tokio::runtime::Runtime,
}

impl Setup {
    fn start() -> Self {
        let _ = envoy_bin();
        let _ = sibling_bin("flock-supervisor");
        let pods = Arc::new(Pods::new());
        let agent = Agent::start_node("n1", "memory", &[]);
        let envoy = SupervisedEnvoy::start(&agent);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        let app = http_server_in(
            &pods.web,
            8080,
            WEB_BODY,
            agent.dir.path().join("web-0.log"),
        );
        let req = pods.web_add();
        let resp = rt
            .block_on(client::call(&agent.cni_socket, CALL, |mut c| async move {
                c.add_pod(req).await
            }))
            .expect("ADD web-0");
        assert_eq!(resp.outcome, Outcome::Success as i32, "{resp:?}");
        let setup = Self {
            envoy,
            _app: app,
            agent,
            pods,
            rt,
        };
        wait_for(
            "a request through web-0's inbound listener in Envoy",
            WAIT,
            || setup.web_request() == Some(WEB_BODY.to_string()),
        );
        setup
    }

    /// GET `web` from web-0's own netns through Envoy: its outbound listener
    /// (127.0.0.1:15001, routed by `Host`), the service's cluster over mTLS, web-0's
    /// inbound listener, its app. The body on 200, else `None`.
    fn web_request(&self) -> Option<String> {
        let out = self
            .pods
            .web
            .command("curl")
            .args(["-sS", "-m", "3", "-o", "-", "-w", "\n%{http_code}"])
            .args(["-H", "Host: web"])
            .arg("http://127.0.0.1:15001/")
            .output()
            .expect("curl is needed (apt-get install curl)");
        let text = String::from_utf8_lossy(&out.stdout);
        let (body, code) = text.rsplit_once('\n')?;
        (code.trim() == "200").then(|| body.to_string())
    }

    fn load(&self) -> Load {
        Load::start(&self.rt, self.agent.cni_socket.clone(), &self.pods)
    }

    /// `/readyz`: status and body, asserting the admin endpoint answers.
    fn readyz(&self) -> (u16, String) {
        self.agent.get("/readyz")
    }

    /// A sample of the agent's `/metrics` by its full name with labels (0 if absent).
    fn metric(&self, series: &str) -> u64 {
        let (status, text) = self.agent.get("/metrics");
        assert_eq!(status, 200, "/metrics: {text}");
        text.lines()
            .find_map(|l| {
                l.strip_prefix(series)?
                    .strip_prefix(' ')?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or(0)
    }

    /// `flockctl proxy-status` (the real binary) against the agent: exit code, output.
    fn proxy_status(&self) -> (Option<i32>, String) {
        let out = std::process::Command::new(sibling_bin("flockctl"))
            .args(["--admin", &self.agent.admin, "proxy-status"])
            .output()
            .expect("run flockctl");
        (
            out.status.code(),
            format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            ),
        )
    }

    /// The agent's Envoy snapshot: version, listener and cluster names.
    fn agent_snapshot(&self) -> (u64, BTreeSet<String>, BTreeSet<String>) {
        let snap = self.agent.json("/debug/snapshot");
        let group = &snap["groups"]["envoy"];
        let names = |t: &str| -> BTreeSet<String> {
            group["resources"][t]
                .as_array()
                .map(|a| {
                    a.iter()
                        .filter_map(|v| v.as_str().map(str::to_string))
                        .collect()
                })
                .unwrap_or_default()
        };
        (
            group["version"].as_u64().unwrap_or(0),
            names("lds"),
            names("cds"),
        )
    }

    /// How Envoy differs from the agent's current listeners and clusters (the load
    /// stopped: the snapshot is still); `None` once it holds exactly them.
    fn envoy_divergence(&self) -> Option<String> {
        let (version, listeners, clusters) = self.agent_snapshot();
        let Some((el, ec)) = envoy_names(&self.envoy.config_dump()) else {
            return Some("no config dump from Envoy".into());
        };
        if el == listeners && ec == clusters {
            return None;
        }
        let warming = envoy_warming(&self.envoy.config_dump());
        let diff = |what: &str, agent: &BTreeSet<String>, envoy: &BTreeSet<String>| {
            format!(
                "{what} only in the agent's: {:?}, only in Envoy's: {:?}",
                agent.difference(envoy).collect::<Vec<_>>(),
                envoy.difference(agent).collect::<Vec<_>>()
            )
        };
        Some(format!(
            "snapshot version {version}: {}; {}; warming in Envoy: {warming:?}",
            diff("listeners", &listeners, &el),
            diff("clusters", &clusters, &ec)
        ))
    }

    /// Waits until Envoy holds exactly the agent's snapshot; panics with the last
    /// difference after [`WAIT`].
    fn wait_envoy_converged(&self, what: &str) {
        let deadline = Instant::now() + WAIT;
        loop {
            let Some(diff) = self.envoy_divergence() else {
                return;
            };
            assert!(
                Instant::now() < deadline,
                "timed out after {WAIT:?} waiting for {what}: {diff}"
            );
            if std::env::var_os("FLOCK_TEST_TRACE_CONVERGENCE").is_some() {
                eprintln!("waiting for {what}: {diff}");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Envoy's dynamic active listeners and clusters from its `/config_dump`.
fn envoy_names(dump: &str) -> Option<(BTreeSet<String>, BTreeSet<String>)> {
    let v: Value = serde_json::from_str(dump).ok()?;
    let mut listeners = BTreeSet::new();
    let mut clusters = BTreeSet::new();
    for c in v["configs"].as_array()? {
        for l in c["dynamic_listeners"].as_array().into_iter().flatten() {
            if l.get("active_state").is_some() {
                listeners.insert(l["name"].as_str()?.to_string());
            }
        }
        for cl in c["dynamic_active_clusters"]
            .as_array()
            .into_iter()
            .flatten()
        {
            clusters.insert(cl["cluster"]["name"].as_str()?.to_string());
        }
    }
    Some((listeners, clusters))
}

/// Envoy's warming listeners and clusters (waiting for their first endpoints or
/// routes), from its `/config_dump`: what a slow convergence waits for.
fn envoy_warming(dump: &str) -> Vec<String> {
    let Ok(v) = serde_json::from_str::<Value>(dump) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for c in v["configs"].as_array().into_iter().flatten() {
        for l in c["dynamic_listeners"].as_array().into_iter().flatten() {
            if l.get("warming_state").is_some() {
                out.push(format!("listener {}", l["name"]));
            }
        }
        for cl in c["dynamic_warming_clusters"]
            .as_array()
            .into_iter()
            .flatten()
        {
            out.push(format!("cluster {}", cl["cluster"]["name"]));
        }
    }
    out
}

/// An Envoy counter from its admin `/stats` (0 when absent or unreachable).
fn envoy_stat(envoy: &SupervisedEnvoy, name: &str) -> u64 {
    let Ok((200, text)) = http_get(&envoy.admin, "/stats") else {
        return 0;
    };
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(": ")?
                .trim()
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn print_window(what: &str, took: Duration, (ops, failures, slowest): (u64, u64, Duration)) {
    let rate = ops as f64 / took.as_secs_f64().max(1e-3);
    println!(
        "{what}: {ops} CNI ops in {took:.2?} ({rate:.0} ops/s), {failures} failures, slowest {slowest:.2?}"
    );
}

#[test]
fn envoy_nacking_every_update_keeps_cni_and_admin_up_is_reported_and_converges_after() {
    let s = Setup::start();
    let switch = s.agent.state_dir.join("fault-xds-invalid");
    assert_eq!(s.metric("flock_xds_streams_nacked{type=\"cds\"}"), 0);
    let load = s.load();

    // Baseline under load.
    let t = Instant::now();
    load.wait_ops(60);
    print_window("baseline", t.elapsed(), load.counts.take());
    let nacks_before = s.metric("flock_xds_nacks_total{type=\"cds\"}")
        + s.metric("flock_xds_nacks_total{type=\"lds\"}");

    // The fault: every cluster and listener published from now on is invalid.
    std::fs::write(&switch, b"").unwrap();
    let fault = Instant::now();
    let line = wait_for("/readyz to name the NACKing Envoy", WAIT, || {
        let (status, body) = s.readyz();
        assert_eq!(
            status, 200,
            "a NACKing proxy made the agent not ready: {body}"
        );
        (body.contains("node \"flock-mesh-test\"") && body.contains("rejects cds")).then_some(body)
    });
    let detect = fault.elapsed();
    println!("NACK reported after {detect:.2?}:\n{line}");
    assert!(
        line.contains("Expected positive duration"),
        "Envoy's reason: {line}"
    );
    wait_for("the stream counted as NACKing CDS and LDS", WAIT, || {
        s.metric("flock_xds_streams_nacked{type=\"cds\"}") == 1
            && s.metric("flock_xds_streams_nacked{type=\"lds\"}") == 1
    });
    // flockctl proxy-status names the stream NACKED for both types, with Envoy's own
    // reason, and exits 1.
    let (code, table) = s.proxy_status();
    println!("flockctl proxy-status during the fault:\n{table}");
    assert_eq!(code, Some(1), "{table}");
    let row = table
        .lines()
        .find(|l| l.contains("flock-mesh-test"))
        .unwrap_or_else(|| panic!("no row for the node's Envoy: {table}"));
    assert!(
        row.contains("envoy") && row.matches("NACKED (").count() >= 2,
        "cds and lds NACKED: {row}"
    );
    assert!(
        table.contains(" cds: rejected version ") && table.contains("Expected positive duration"),
        "Envoy's reason for cds: {table}"
    );
    // More updates during the fault: every one carrying clusters or listeners is
    // rejected (an update that only removes names is applied), while the admin
    // endpoint answers.
    let rejected_before = envoy_stat(&s.envoy, "cluster_manager.cds.update_rejected");
    load.wait_ops(60);
    let (status, _) = s.readyz();
    assert_eq!(status, 200);
    assert_eq!(s.metric("flock_agent_ready"), 1);
    let nacks = s.metric("flock_xds_nacks_total{type=\"cds\"}")
        + s.metric("flock_xds_nacks_total{type=\"lds\"}")
        - nacks_before;
    assert!(nacks >= 2, "{nacks} NACKs during the fault");
    assert!(
        envoy_stat(&s.envoy, "cluster_manager.cds.update_rejected") > rejected_before,
        "Envoy rejected no CDS update during the load under the fault"
    );
    // No cluster of the rejected updates reached Envoy: none is invalid.
    assert!(
        !s.envoy.config_dump().contains("\"connect_timeout\": \"-"),
        "Envoy runs a rejected cluster"
    );
    // Envoy keeps its last good config: the web pod's listener still serves.
    assert_eq!(s.web_request().as_deref(), Some(WEB_BODY));
    let during = fault.elapsed();
    let window = load.counts.take();
    print_window("during the NACK fault", during, window);
    println!("{nacks} NACKs (cds+lds) during the fault");

    // Valid config again: the next publish (the load's next operation) is ACKed.
    std::fs::remove_file(&switch).unwrap();
    let healed = Instant::now();
    wait_for("Envoy to ACK a valid snapshot", WAIT, || {
        s.metric("flock_xds_streams_nacked{type=\"cds\"}") == 0
            && s.metric("flock_xds_streams_nacked{type=\"lds\"}") == 0
    });
    let first_ack = healed.elapsed();
    let errors = load.stop(&s.rt);
    s.wait_envoy_converged("Envoy to hold exactly the agent's snapshot");
    let converged = healed.elapsed();
    let (status, body) = s.readyz();
    assert_eq!(status, 200);
    assert!(
        !body.contains("xds:"),
        "still reported after the fault: {body}"
    );
    // Every type of the node's Envoy SYNCED again (no NACKED, exit 0); its last ACK
    // may trail the config dump by a moment (STALE meanwhile).
    let table = wait_for(
        "flockctl proxy-status: the node's Envoy SYNCED",
        WAIT,
        || {
            let (code, table) = s.proxy_status();
            let row = table.lines().find(|l| l.contains("flock-mesh-test"))?;
            (code == Some(0) && row.matches("SYNCED (").count() >= 4 && !row.contains("NACKED"))
                .then_some(table)
        },
    );
    println!("flockctl proxy-status after the fault:\n{table}");
    assert_eq!(s.web_request().as_deref(), Some(WEB_BODY));
    println!(
        "after the fault: first ACK in {first_ack:.2?}, Envoy converged (load stopped) in {converged:.2?}"
    );
    assert!(errors.is_empty(), "CNI failures: {errors:?}");
    assert_eq!(window.1, 0);
}

/// The live Envoy processes of `envoy`'s base ids (the supervisor's epochs): pids.
fn envoy_pids(envoy: &SupervisedEnvoy) -> Vec<u32> {
    [envoy.base_id, envoy.base_id + 1]
        .into_iter()
        .flat_map(envoy_pids_with_base_id)
        .collect()
}

#[test]
fn envoy_sigkilled_under_load_is_restarted_and_gets_the_current_snapshot() {
    let s = Setup::start();
    let load = s.load();
    let t = Instant::now();
    load.wait_ops(60);
    print_window("baseline", t.elapsed(), load.counts.take());
    let streams_before = s.metric("flock_xds_streams_total");

    let old = envoy_pids(&s.envoy);
    assert_eq!(old.len(), 1, "one Envoy: {old:?}");
    let killed = Instant::now();
    assert!(
        std::process::Command::new("kill")
            .args(["-KILL", &old[0].to_string()])
            .status()
            .unwrap()
            .success()
    );
    let new = wait_for("the supervisor to start a new Envoy", WAIT, || {
        let pids = envoy_pids(&s.envoy);
        (pids.len() == 1 && pids[0] != old[0]).then(|| pids[0])
    });
    wait_for("the new Envoy's /ready 200", WAIT, || {
        matches!(http_get(&s.envoy.admin, "/ready"), Ok((200, _)))
    });
    let restarted = killed.elapsed();
    wait_for("the new Envoy's stream to the agent", WAIT, || {
        s.metric("flock_xds_streams_total") > streams_before
    });
    // CNI and admin meanwhile, and after.
    load.wait_ops(60);
    let (status, body) = s.readyz();
    assert_eq!(status, 200, "{body}");
    let window = load.counts.take();
    print_window("kill to new Envoy up, and after", killed.elapsed(), window);
    let errors = load.stop(&s.rt);
    s.wait_envoy_converged("the new Envoy to hold exactly the agent's snapshot");
    let converged = killed.elapsed();
    assert_eq!(envoy_pids(&s.envoy), vec![new]);
    assert_eq!(s.web_request().as_deref(), Some(WEB_BODY));
    let (version, listeners, clusters) = s.agent_snapshot();
    println!(
        "Envoy SIGKILLed: new Envoy (pid {new}) ready in {restarted:.2?}, holds snapshot v{version} \
         ({} listeners, {} clusters) {converged:.2?} after the kill",
        listeners.len(),
        clusters.len()
    );
    assert!(errors.is_empty(), "CNI failures: {errors:?}");
}

#[test]
fn a_slow_acking_client_is_reported_without_holding_back_cni_admin_or_envoy() {
    use envoy_types::pb::envoy::config::core::v3::Node;
    use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
    use flock_xds::types::{CLUSTER, LISTENER};

    let s = Setup::start();
    let target = s.agent.xds_target();
    let node = Node {
        id: "slow-proxy".into(),
        cluster: "flock-test".into(),
        user_agent_name: "envoy".into(),
        ..Node::default()
    };
    let mut ads = s.rt.block_on(async {
        let channel = flock_xds::client::connect(&target).await.unwrap();
        flock_xds::client::delta(channel).await.unwrap()
    });
    for type_url in [CLUSTER, LISTENER] {
        ads.send(DeltaDiscoveryRequest {
            node: Some(node.clone()),
            type_url: type_url.into(),
            resource_names_subscribe: vec!["*".into()],
            ..Default::default()
        })
        .unwrap();
    }
    // The first response of each type arrives; the client answers neither.
    let mut held = Vec::new();
    while held.len() < 2 {
        let r = s.rt.block_on(ads.recv(WAIT)).expect("a first response");
        held.push(r);
    }

    let load = s.load();
    let acks_before = s.metric("flock_xds_acks_total{type=\"cds\"}");
    let fault = Instant::now();
    let line = wait_for("/readyz to name the slow client", WAIT, || {
        let (status, body) = s.readyz();
        assert_eq!(
            status, 200,
            "a slow client made the agent not ready: {body}"
        );
        body.contains("node \"slow-proxy\" has not answered")
            .then_some(body)
    });
    let detect = fault.elapsed();
    println!("slow ACK reported after {detect:.2?}:\n{line}");
    assert!(
        !line.contains("flock-mesh-test"),
        "the real Envoy reported: {line}"
    );
    assert_eq!(s.metric("flock_agent_xds_streams_slow_ack"), 1);
    // Envoy's own stream went on meanwhile: it ACKed the load's updates.
    assert!(
        s.metric("flock_xds_acks_total{type=\"cds\"}") > acks_before,
        "Envoy ACKed nothing while the slow client held its answer"
    );
    let window = load.counts.take();
    print_window("while a client holds its ACKs", fault.elapsed(), window);
    let errors = load.stop(&s.rt);
    s.wait_envoy_converged("Envoy to hold exactly the agent's snapshot");
    assert_eq!(s.web_request().as_deref(), Some(WEB_BODY));

    // The client ACKs its held responses: it gets the newest version of each type
    // next (the updates it missed are coalesced), and is no longer reported.
    let (version, _, _) = s.agent_snapshot();
    let acked = Instant::now();
    for r in &held {
        ads.send(DeltaDiscoveryRequest {
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            ..Default::default()
        })
        .unwrap();
    }
    let mut latest = BTreeSet::new();
    while latest.len() < 2 {
        let r = s.rt.block_on(ads.recv(WAIT)).expect("the newest response");
        // The newest version at the ACK or later (a probe result may publish after the
        // load stopped); never an older one from a backlog.
        let got: u64 = r.system_version_info.parse().expect("a numeric version");
        assert!(
            got >= version,
            "v{got} after the ACK: older than the v{version} current at the ACK"
        );
        ads.send(DeltaDiscoveryRequest {
            type_url: r.type_url.clone(),
            response_nonce: r.nonce.clone(),
            ..Default::default()
        })
        .unwrap();
        latest.insert(r.type_url);
    }
    wait_for("the slow client no longer reported", WAIT, || {
        !s.readyz().1.contains("slow-proxy")
    });
    assert_eq!(s.metric("flock_agent_xds_streams_slow_ack"), 0);
    println!(
        "slow client caught up to v{version} in {:.2?} after its ACK",
        acked.elapsed()
    );
    assert!(errors.is_empty(), "CNI failures: {errors:?}");
    assert_eq!(window.1, 0);
}
