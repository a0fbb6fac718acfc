//! The registry off the CNI path, against a real etcd that fails under load: two
//! agents (nodes n1 and n2, one machine) on one real etcd (`FLOCK_ETCD_BIN`),
//! `--registry-ttl 2`, and CNI churn on n1 over its real CNI socket (the plugin's own
//! client) from concurrent workers, each ADDing a new pod and DELeting its previous one.
//!
//! Two faults, each longer than the lease TTL, each under churn:
//! * etcd SIGSTOPped (it hangs: nothing refuses, nothing answers), then SIGCONT;
//! * etcd SIGKILLed (it refuses), then started again on the same data dir.
//!
//! Asserted: every ADD and DEL during the fault succeeds; n1's `/readyz` stays 200 and
//! says the registry is out of sync, and `flock_registry_in_sync` is 0, during it; once
//! etcd answers again both nodes' registry views hold exactly n1's live pods (and n2's
//! pod) within 2 s, measured from etcd's first healthy answer by polling; and after that
//! no ghost (an endpoint of a pod that is gone) shows up in either view for two TTLs.
//! Whether n2 saw n1's endpoints leave (lease expiry) and return is printed.
//!
//! The churn stops before etcd comes back, so "the live pods" is a fixed set when
//! convergence is measured. Figures (operations during each fault, failures, time to
//! converge) are printed, with the churn's rate in the second before each fault as
//! the baseline of the same run. While etcd hangs, the sync's first round waits out
//! its per-call bound, and ADD/DEL wait for it up to the agent's registry wait (1 s)
//! before answering: the rate drops during that window, it does not fail. Needs `FLOCK_ETCD_BIN` and `cargo build -p flock-agent`.

mod common;

use common::*;
use flock_cni::proto::v1::{AddPodRequest, IpConfig, Outcome, PodRef, RemovePodRequest};
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// `--registry-ttl`, seconds.
const TTL: Duration = Duration::from_secs(2);
/// How long each fault lasts: longer than the lease TTL.
const FAULT: Duration = Duration::from_secs(5);
/// Concurrent churn workers on n1.
const WORKERS: usize = 48;
/// The convergence bound after etcd answers again.
const CONVERGE: Duration = Duration::from_secs(2);

/// A single-member etcd on fixed ports and data dir, so it can be killed and started
/// again on the same data.
struct EtcdProc {
    proc: Option<ChildGuard>,
    dir: tempfile::TempDir,
    client_port: u16,
    peer_port: u16,
    starts: usize,
}

impl EtcdProc {
    fn start() -> Self {
        let mut e = Self {
            proc: None,
            dir: tempfile::Builder::new()
                .prefix("flock-etcd-outage-")
                .tempdir()
                .unwrap(),
            client_port: free_port(),
            peer_port: free_port(),
            starts: 0,
        };
        e.spawn();
        e
    }

    fn spawn(&mut self) {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        let peer = format!("http://127.0.0.1:{}", self.peer_port);
        let mut cmd = Command::new(etcd_bin());
        cmd.args(["--name", "e1", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer])
            .args(["--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("e1={peer}")])
            .args(["--heartbeat-interval", "50", "--election-timeout", "250"]);
        self.starts += 1;
        let log = self.dir.path().join(format!("etcd-{}.log", self.starts));
        self.proc = Some(ChildGuard::spawn(cmd, log));
        self.wait_healthy(WAIT);
    }

    fn wait_healthy(&mut self, limit: Duration) {
        let proc = self.proc.as_mut().unwrap();
        let addr = format!("127.0.0.1:{}", self.client_port);
        wait_for("etcd /health true", limit, || {
            assert!(proc.running(), "etcd exited:\n{}", proc.log_text());
            matches!(http_get(&addr, "/health"), Ok((200, body)) if body.contains("true"))
        });
    }

    fn signal(&self, sig: &str) {
        self.proc.as_ref().unwrap().signal(sig);
    }

    fn kill9(&mut self) {
        if let Some(mut p) = self.proc.take() {
            p.signal("KILL");
            p.stop(Duration::from_secs(5));
        }
    }

    fn spec(&self) -> String {
        format!("etcd://127.0.0.1:{}", self.client_port)
    }
}

/// The pods n1 has acknowledged and not deleted (their addresses), and the counts.
#[derive(Default)]
struct Churn {
    live: Mutex<BTreeSet<String>>,
    ops: AtomicU64,
    failures: AtomicU64,
    errors: Mutex<Vec<String>>,
    stop: AtomicBool,
}

fn pod_ref(name: &str) -> PodRef {
    PodRef {
        name: name.into(),
        namespace: "default".into(),
        uid: format!("uid-{name}"),
    }
}

async fn add(socket: &Path, id: &str, ip: &str) -> Result<(), String> {
    let req = AddPodRequest {
        container_id: id.into(),
        netns: "/proc/1/ns/net".into(),
        ifname: "eth0".into(),
        pod: Some(pod_ref(id)),
        ips: vec![IpConfig {
            address: format!("{ip}/16"),
            interface: -1,
            ..IpConfig::default()
        }],
        annotations: [("flock.io/service", "web"), ("flock.io/ports", "8080")]
            .into_iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        network_name: "flock-test".into(),
        cni_version: "1.1.0".into(),
        prev_result_json: String::new(),
    };
    let resp = flock_cni::client::call(socket, Duration::from_secs(5), |mut c| async move {
        c.add_pod(req).await
    })
    .await
    .map_err(|e| format!("ADD {id}: {e}"))?;
    if resp.outcome == Outcome::Success as i32 {
        Ok(())
    } else {
        Err(format!("ADD {id}: {}", resp.message))
    }
}

async fn del(socket: &Path, id: &str) -> Result<(), String> {
    let req = RemovePodRequest {
        container_id: id.into(),
        netns: "/proc/1/ns/net".into(),
        ifname: "eth0".into(),
        pod: Some(pod_ref(id)),
        network_name: "flock-test".into(),
    };
    let resp = flock_cni::client::call(socket, Duration::from_secs(5), |mut c| async move {
        c.remove_pod(req).await
    })
    .await
    .map_err(|e| format!("DEL {id}: {e}"))?;
    if resp.outcome == Outcome::Success as i32 {
        Ok(())
    } else {
        Err(format!("DEL {id}: {}", resp.message))
    }
}

/// One churn worker: ADD a new pod, then DEL its previous one, until told to stop.
/// Pod addresses are 10.<50 + round>.<worker>.<n>, unique while live (a worker keeps
/// at most two live; the previous round's last pods stay live).
async fn worker(w: usize, round: usize, socket: PathBuf, churn: Arc<Churn>) {
    let mut previous: Option<(String, String)> = None;
    let mut generation = 0u64;
    while !churn.stop.load(Ordering::SeqCst) {
        generation += 1;
        let id = format!("r{round}-w{w}-g{generation}");
        let ip = format!("10.{}.{w}.{}", 50 + round, generation % 250 + 1);
        match add(&socket, &id, &ip).await {
            Ok(()) => {
                churn.live.lock().unwrap().insert(ip.clone());
            }
            Err(e) => {
                churn.failures.fetch_add(1, Ordering::SeqCst);
                churn.errors.lock().unwrap().push(e);
            }
        }
        churn.ops.fetch_add(1, Ordering::SeqCst);
        if let Some((old_id, old_ip)) = previous.take() {
            match del(&socket, &old_id).await {
                Ok(()) => {
                    churn.live.lock().unwrap().remove(&old_ip);
                }
                Err(e) => {
                    churn.failures.fetch_add(1, Ordering::SeqCst);
                    churn.errors.lock().unwrap().push(e);
                }
            }
            churn.ops.fetch_add(1, Ordering::SeqCst);
        }
        previous = Some((id, ip));
    }
}

/// Runs the churn on `rt` until [`Churn::stop`]; returns the join handles.
fn start_churn(
    rt: &tokio::runtime::Runtime,
    socket: &Path,
    churn: &Arc<Churn>,
    round: usize,
) -> Vec<tokio::task::JoinHandle<()>> {
    churn.stop.store(false, Ordering::SeqCst);
    (0..WORKERS)
        .map(|w| rt.spawn(worker(w, round, socket.to_owned(), Arc::clone(churn))))
        .collect()
}

fn stop_churn(
    rt: &tokio::runtime::Runtime,
    churn: &Churn,
    handles: Vec<tokio::task::JoinHandle<()>>,
) {
    churn.stop.store(true, Ordering::SeqCst);
    rt.block_on(async {
        for h in handles {
            h.await.unwrap();
        }
    });
}

/// `node`'s endpoints in `agent`'s registry view (`/debug/registry`): their addresses.
fn view_of(agent: &Agent, node: &str) -> Option<BTreeSet<String>> {
    let (status, body) = agent.get("/debug/registry");
    if status != 200 {
        return None;
    }
    let reg: Value = serde_json::from_str(&body).ok()?;
    let eps: Vec<Value> = match &reg["endpoints"] {
        Value::Object(m) => m.values().cloned().collect(),
        Value::Array(a) => a.clone(),
        _ => return None,
    };
    Some(
        eps.iter()
            .filter(|e| e["node"].as_str() == Some(node))
            .map(|e| e["address"].as_str().unwrap_or_default().to_owned())
            .collect(),
    )
}

fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// What n1 said about the registry during a fault.
#[derive(Default, Debug)]
struct Seen {
    readyz_not_200: u32,
    readyz_out_of_sync: bool,
    metric_out_of_sync: bool,
    n2_lost_n1: bool,
}

/// Holds the fault for [`FAULT`], polling what n1 reports and what n2 sees of n1.
fn during_fault(n1: &Agent, n2: &Agent) -> Seen {
    let mut seen = Seen::default();
    let start = Instant::now();
    while start.elapsed() < FAULT {
        let (status, body) = n1.get("/readyz");
        if status != 200 {
            seen.readyz_not_200 += 1;
        }
        if body.contains("out of sync") {
            seen.readyz_out_of_sync = true;
        }
        let (_, m) = n1.get("/metrics");
        if metric(&m, "flock_registry_in_sync") == Some(0) {
            seen.metric_out_of_sync = true;
        }
        if view_of(n2, "n1").is_some_and(|v| v.is_empty()) {
            seen.n2_lost_n1 = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    seen
}

/// From etcd's first healthy answer: the time until both views hold exactly the live
/// pods of n1 and n2's pod; then no ghost for two TTLs.
fn converge(
    n1: &Agent,
    n2: &Agent,
    live: &BTreeSet<String>,
    n2_pod: &str,
    fault: &str,
) -> Duration {
    let t0 = Instant::now();
    let n2_set: BTreeSet<String> = [n2_pod.to_owned()].into();
    let matches = |a: &Agent| {
        view_of(a, "n1").as_ref() == Some(live) && view_of(a, "n2").as_ref() == Some(&n2_set)
    };
    let took = loop {
        if matches(n1) && matches(n2) {
            break t0.elapsed();
        }
        let last = (view_of(n1, "n1"), view_of(n2, "n1"));
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "{fault}: never converged: live {} pods, n1 sees {:?}, n2 sees {:?} of n1",
            live.len(),
            last.0.as_ref().map(BTreeSet::len),
            last.1.as_ref().map(BTreeSet::len),
        );
        std::thread::sleep(Duration::from_millis(10));
    };
    let settled = Instant::now();
    while settled.elapsed() < 2 * TTL {
        for (who, a) in [("n1", n1), ("n2", n2)] {
            let v = view_of(a, "n1").unwrap_or_default();
            let ghosts: Vec<_> = v.difference(live).collect();
            assert!(
                ghosts.is_empty(),
                "{fault}: ghost(s) in {who}'s view after recovery: {ghosts:?}"
            );
            assert_eq!(
                &v, live,
                "{fault}: {who}'s view lost live pods after recovery"
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    took
}

#[test]
fn cni_keeps_working_through_etcd_hanging_and_dying_and_both_nodes_converge() {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut etcd = EtcdProc::start();
    let ttl = TTL.as_secs().to_string();
    let flags = ["--registry-ttl", ttl.as_str()];
    let n1 = Agent::start_node("n1", &etcd.spec(), &flags);
    let n2 = Agent::start_node("n2", &etcd.spec(), &flags);
    let n2_pod = "10.60.0.9";
    rt.block_on(add(&n2.cni_socket, "n2-pod", n2_pod)).unwrap();

    let churn = Arc::new(Churn::default());
    let mut report = Vec::new();
    for (round, fault) in ["SIGSTOP", "SIGKILL"].into_iter().enumerate() {
        let handles = start_churn(&rt, &n1.cni_socket, &churn, round);
        // Load first: the fault starts once the churn runs (at least 50 ops done).
        let before = churn.ops.load(Ordering::SeqCst);
        wait_for("churn under way", WAIT, || {
            churn.ops.load(Ordering::SeqCst) >= before + 50
        });
        // The rate without a fault, for comparison: one second of the same churn.
        let (b0, t0) = (churn.ops.load(Ordering::SeqCst), Instant::now());
        wait_for("a second of churn", WAIT, || {
            t0.elapsed() >= Duration::from_secs(1)
        });
        let baseline = (churn.ops.load(Ordering::SeqCst) - b0) as f64 / t0.elapsed().as_secs_f64();
        let (ops0, fail0) = (
            churn.ops.load(Ordering::SeqCst),
            churn.failures.load(Ordering::SeqCst),
        );
        let started = Instant::now();
        match fault {
            "SIGSTOP" => etcd.signal("STOP"),
            _ => etcd.kill9(),
        }
        let seen = during_fault(&n1, &n2);
        let (ops, failures) = (
            churn.ops.load(Ordering::SeqCst) - ops0,
            churn.failures.load(Ordering::SeqCst) - fail0,
        );
        let held = started.elapsed();
        stop_churn(&rt, &churn, handles);
        let live = churn.live.lock().unwrap().clone();
        match fault {
            "SIGSTOP" => {
                etcd.signal("CONT");
                etcd.wait_healthy(WAIT);
            }
            _ => etcd.spawn(),
        }
        let took = converge(&n1, &n2, &live, n2_pod, fault);
        let rate = ops as f64 / held.as_secs_f64();
        let line = format!(
            "etcd {fault} for {:.1}s (TTL {}s): {ops} CNI ops on n1 during it ({rate:.0}/s; \
             {baseline:.0}/s just before it), \
             {failures} failed; readyz non-200 {} times, said out of sync: {}, \
             flock_registry_in_sync 0 seen: {}; n2 saw n1's endpoints gone: {}; \
             both nodes converged to the {} live pods {:.0} ms after etcd answered; no ghost for {}s after",
            held.as_secs_f64(),
            TTL.as_secs(),
            seen.readyz_not_200,
            seen.readyz_out_of_sync,
            seen.metric_out_of_sync,
            seen.n2_lost_n1,
            live.len(),
            took.as_secs_f64() * 1000.0,
            2 * TTL.as_secs(),
        );
        println!("{line}");
        report.push(line);
        let errors = churn.errors.lock().unwrap().clone();
        assert_eq!(
            failures, 0,
            "{fault}: CNI ops failed during the fault: {errors:?}"
        );
        assert!(errors.is_empty(), "{fault}: CNI ops failed: {errors:?}");
        assert_eq!(seen.readyz_not_200, 0, "{fault}: n1 became unready for CNI");
        assert!(
            seen.readyz_out_of_sync,
            "{fault}: /readyz never said out of sync"
        );
        assert!(
            seen.metric_out_of_sync,
            "{fault}: flock_registry_in_sync never 0"
        );
        assert!(
            took <= CONVERGE,
            "{fault}: converged after {took:?}, over {CONVERGE:?}"
        );
    }
    for line in report {
        println!("{line}");
    }
}
