//! Benchmarks of the node agent, printed as plain numbers (each sample is a real process run):
//!
//! 1. AddPod latency through the real plugin: `flock-cni` exec'd as the runtime does
//!    (CNI env, config with `prevResult` on stdin) against the real `flock-agent`,
//!    from exec to exit, with 0, 100 and 1,000 pods already present. p50/p99.
//! 2. Snapshot publish cost per pod change at 1,000 pods (in process: one endpoint
//!    changes in the registry, then `Agent::publish`), beside the cost of a publish
//!    with nothing changed (the re-translation alone).
//! 3. The agent's resident memory with 0 and 1,000 pods.
//! 4. Snapshot publish cost of one SVID rotation with 1,000 pods (16 identities, the
//!    built-in CA with 30 s SVIDs; the identities are issued at least 250 ms apart, so
//!    each comes due alone, half a lifetime after its issuance on the monotonic clock
//!    rotation runs on: this part takes about 20 s, twice).
//!
//! Parts 1, 2 and 4 run twice: the agent as it is, then the baseline that rebuilds
//! the whole mesh and its translation on every publish (`publish_from_scratch`;
//! `FLOCK_PUBLISH_FROM_SCRATCH=1` for the agent binary of part 1).
//!
//! ```sh
//! cargo build --release -p flock-agent -p flock-cni-plugin && cargo bench -p flock-agent --bench agent
//! ```
//!
//! `FLOCK_BENCH_PARTS=add` (or `rotation`, `publish`, comma-separated) runs only those
//! parts, e.g. to profile the agent process during the AddPod part.

use flock_bird::agent::{AddPodInput, Agent, AgentConfig, group_of};
use flock_bird::registry::{self, RegistryOptions, RegistrySpec};
use flock_bird::store::PodStore;
use flock_cni::proto::v1::{AddPodRequest, IpConfig, Outcome, PodRef};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn bin(name: &str) -> PathBuf {
    let agent = PathBuf::from(env!("CARGO_BIN_EXE_flock-agent"));
    let p = agent.with_file_name(name);
    assert!(
        p.is_file(),
        "{} missing: cargo build --release -p flock-agent -p flock-cni-plugin",
        p.display()
    );
    p
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn ip_of(i: usize) -> String {
    format!("10.{}.{}.{}/8", 100 + i / 65536, (i / 256) % 256, i % 256)
}

/// One ADD through the real plugin binary; returns the wall time.
fn plugin_add(plugin: &Path, socket: &Path, i: usize) -> Duration {
    let conf = serde_json::json!({
        "cniVersion": "1.0.0", "name": "net", "type": "flock-cni",
        "agent_socket": socket, "timeout_ms": 5000,
        "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {
            "flock.io/service": format!("svc-{}", i % 16), "flock.io/ports": "8080"}},
        "prevResult": {"cniVersion": "1.0.0", "ips": [{"address": ip_of(i)}]}
    })
    .to_string();
    let start = Instant::now();
    let mut child = Command::new(plugin)
        .env("CNI_COMMAND", "ADD")
        .env("CNI_CONTAINERID", format!("bench-{i}"))
        .env("CNI_NETNS", flock_testkit::netns::pods_netns())
        .env("CNI_IFNAME", "eth0")
        .env("CNI_PATH", "/usr/lib/cni")
        .env(
            "CNI_ARGS",
            format!("K8S_POD_NAME=bench-{i};K8S_POD_NAMESPACE=default"),
        )
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn flock-cni");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(conf.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let took = start.elapsed();
    assert!(
        out.status.success(),
        "plugin ADD {i}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    took
}

async fn grpc_add(socket: &Path, i: usize) {
    let req = AddPodRequest {
        container_id: format!("fill-{i}"),
        netns: flock_testkit::netns::pods_netns().into(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: format!("fill-{i}"),
            namespace: "default".into(),
            uid: String::new(),
        }),
        ips: vec![IpConfig {
            address: ip_of(10_000 + i),
            ..IpConfig::default()
        }],
        annotations: HashMap::from([
            ("flock.io/service".to_string(), format!("svc-{}", i % 16)),
            ("flock.io/ports".to_string(), "8080".to_string()),
        ]),
        network_name: "net".into(),
        ..AddPodRequest::default()
    };
    let resp = flock_cni::client::call(socket, Duration::from_secs(10), |mut c| async move {
        c.add_pod(req).await
    })
    .await
    .unwrap();
    assert_eq!(resp.outcome, Outcome::Success as i32, "{}", resp.message);
}

async fn add_latency(from_scratch: bool) {
    let plugin = bin("flock-cni");
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("cni.sock");
    let mut agent = Command::new(bin("flock-agent"))
        .args([
            "--node-name",
            "bench",
            "--registry",
            "memory",
            "--probe-interval-ms",
            "60000",
        ])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--cni-socket")
        .arg(&socket)
        .arg("--xds-socket")
        .arg(dir.path().join("run").join("xds.sock"))
        // The bench never calls the admin API: port 0.
        .args(["--admin-address", "127.0.0.1:0"])
        .env("RUST_LOG", "warn")
        .env(
            "FLOCK_PUBLISH_FROM_SCRATCH",
            if from_scratch { "1" } else { "0" },
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !socket.exists() {
        assert!(Instant::now() < deadline, "agent did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    println!(
        "AddPod through the real plugin (exec → exit), 100 samples each{}:",
        label(from_scratch)
    );
    println!("{:>14} {:>10} {:>10}", "pods present", "p50 ms", "p99 ms");
    let rss0 = rss_kib(agent.id());
    let mut present = 0;
    let mut next_sample = 0;
    for target in [0usize, 100, 1000] {
        while present < target {
            grpc_add(&socket, present).await;
            present += 1;
        }
        let mut samples = Vec::new();
        for _ in 0..100 {
            let s = next_sample;
            next_sample += 1;
            let took = tokio::task::spawn_blocking({
                let plugin = plugin.clone();
                let socket = socket.clone();
                move || plugin_add(&plugin, &socket, s)
            })
            .await
            .unwrap();
            samples.push(took.as_secs_f64() * 1e3);
            // Keep the population at `target`: remove the sampled pod again.
            let req = flock_cni::proto::v1::RemovePodRequest {
                container_id: format!("bench-{s}"),
                ifname: "eth0".into(),
                ..Default::default()
            };
            flock_cni::client::call(&socket, Duration::from_secs(10), |mut c| async move {
                c.remove_pod(req).await
            })
            .await
            .unwrap();
        }
        samples.sort_by(f64::total_cmp);
        println!(
            "{:>14} {:>10.2} {:>10.2}",
            target,
            pct(&samples, 0.5),
            pct(&samples, 0.99)
        );
    }
    let rss1000 = rss_kib(agent.id());
    println!(
        "agent resident memory: {:.1} MiB with 0 pods, {:.1} MiB with 1,000 pods ({:.1} KiB per pod)",
        rss0 as f64 / 1024.0,
        rss1000 as f64 / 1024.0,
        (rss1000.saturating_sub(rss0)) as f64 / 1000.0
    );
    let _ = agent.kill();
    let _ = agent.wait();
}

/// The in-process agent's configuration; `from_scratch`: the baseline, which rebuilds
/// the whole mesh and its translation on every publish
/// (`AgentConfig::publish_from_scratch`, the agent before it was incremental).
fn config(from_scratch: bool) -> AgentConfig {
    let mut cfg = AgentConfig::new("bench");
    cfg.publish_from_scratch = from_scratch;
    cfg
}

fn label(from_scratch: bool) -> &'static str {
    if from_scratch {
        ", baseline: full rebuild"
    } else {
        ""
    }
}

async fn publish_cost(from_scratch: bool) {
    let dir = tempfile::tempdir().unwrap();
    let reg = registry::connect(
        &RegistrySpec::Memory,
        RegistryOptions {
            node: "bench".into(),
            ..RegistryOptions::default()
        },
    )
    .await
    .unwrap();
    let store = Arc::new(PodStore::open(dir.path()).unwrap());
    let cache = Arc::new(flock_xds::cache::Cache::new(group_of));
    let agent = Arc::new(Agent::new(
        config(from_scratch),
        store,
        Arc::clone(&reg),
        cache,
    ));
    agent.load().await.unwrap();
    for i in 0..1000 {
        let input = AddPodInput {
            container_id: format!("p{i}"),
            ifname: "eth0".into(),
            netns: "/proc/self/ns/net".into(),
            name: format!("p{i}"),
            namespace: "default".into(),
            uid: String::new(),
            ips: vec![ip_of(i)],
            gateways: Vec::new(),
            annotations: BTreeMap::from([
                ("flock.io/service".to_string(), format!("svc-{}", i % 16)),
                ("flock.io/ports".to_string(), "8080".to_string()),
            ]),
            network_name: "net".into(),
        };
        agent.add_pod(&input).await.unwrap();
    }
    agent.publish();
    let eps: Vec<_> = reg
        .view()
        .borrow()
        .endpoints
        .values()
        .map(|e| (**e).clone())
        .collect();
    let mut changed = Vec::new();
    let mut unchanged = Vec::new();
    for round in 0..50 {
        let mut ep = eps[round % eps.len()].clone();
        ep.health = if round % 2 == 0 {
            flock_bird::model::Health::Unhealthy
        } else {
            flock_bird::model::Health::Healthy
        };
        reg.put(&ep).await.unwrap();
        let t = Instant::now();
        agent.publish();
        changed.push(t.elapsed().as_secs_f64() * 1e3);
        let t = Instant::now();
        agent.publish();
        unchanged.push(t.elapsed().as_secs_f64() * 1e3);
    }
    changed.sort_by(f64::total_cmp);
    unchanged.sort_by(f64::total_cmp);
    println!(
        "snapshot publish at 1,000 pods (50 samples){}:",
        label(from_scratch)
    );
    println!(
        "  one endpoint changed: p50 {:.2} ms, p99 {:.2} ms; nothing changed (re-translation only): p50 {:.2} ms",
        pct(&changed, 0.5),
        pct(&changed, 0.99),
        pct(&unchanged, 0.5)
    );
}

async fn rotation_cost(from_scratch: bool) {
    const LIFETIME: Duration = Duration::from_secs(30);
    const APART: Duration = Duration::from_millis(250);
    let dir = tempfile::tempdir().unwrap();
    let reg = registry::connect(
        &RegistrySpec::Memory,
        RegistryOptions {
            node: "bench".into(),
            ..RegistryOptions::default()
        },
    )
    .await
    .unwrap();
    let ca = flock_bird::identity::BuiltinCa::new("cluster.local", LIFETIME, flock_clock::unix_now)
        .unwrap();
    let store = Arc::new(PodStore::open(dir.path()).unwrap());
    let cache = Arc::new(flock_xds::cache::Cache::new(group_of));
    let agent = Arc::new(
        Agent::new(config(from_scratch), store, Arc::clone(&reg), cache).with_identity(ca.clone()),
    );
    agent.load().await.unwrap();
    // Identity k's SVID is issued (with its first pod) at least APART after identity
    // k - 1's, so they come due one at a time.
    for k in 0..16 {
        let group = Instant::now();
        for i in (0..1000).filter(|i| i % 16 == k) {
            let input = AddPodInput {
                container_id: format!("p{i}"),
                ifname: "eth0".into(),
                netns: "/proc/self/ns/net".into(),
                name: format!("p{i}"),
                namespace: "default".into(),
                uid: String::new(),
                ips: vec![ip_of(i)],
                gateways: Vec::new(),
                annotations: BTreeMap::from([
                    ("flock.io/service".to_string(), format!("svc-{k}")),
                    ("flock.io/ports".to_string(), "8080".to_string()),
                    ("flock.io/service-account".to_string(), format!("sa-{k}")),
                ]),
                network_name: "net".into(),
            };
            agent.add_pod(&input).await.unwrap();
        }
        tokio::time::sleep_until((group + APART).into()).await;
    }
    agent.publish();
    // Only rounds that rotated exactly one SVID are samples (a slow machine may
    // issue two identities closer than APART).
    let mut samples = Vec::new();
    let mut rounds = 0;
    let mut rotated = 0;
    while rotated < 16 {
        let due = ca.next_rotation().expect("SVIDs held");
        tokio::time::sleep_until(flock_clock::mono_instant(due)).await;
        let n = ca.rotate_due();
        assert!(n >= 1, "an SVID was due");
        rounds += 1;
        rotated += n;
        let t = Instant::now();
        agent.publish();
        if n == 1 {
            samples.push(t.elapsed().as_secs_f64() * 1e3);
        }
    }
    assert!(!samples.is_empty(), "no round rotated exactly one SVID");
    println!(
        "SVID rotation rounds: {rounds} for 16 identities; {} rotated one SVID",
        samples.len()
    );
    samples.sort_by(f64::total_cmp);
    println!(
        "publish after one SVID rotation at 1,000 pods / 16 identities{}: p50 {:.2} ms, max {:.2} ms",
        label(from_scratch),
        pct(&samples, 0.5),
        pct(&samples, 1.0)
    );
}

#[tokio::main]
async fn main() {
    // `cargo bench` passes --bench; nothing else is accepted. FLOCK_BENCH_PARTS
    // (comma-separated: rotation, publish, add) runs only those parts.
    let parts = std::env::var("FLOCK_BENCH_PARTS").unwrap_or_default();
    let run = |part: &str| parts.is_empty() || parts.split(',').any(|p| p.trim() == part);
    // Each beside its baseline in the same run.
    if run("rotation") {
        rotation_cost(false).await;
        rotation_cost(true).await;
    }
    if run("publish") {
        publish_cost(false).await;
        publish_cost(true).await;
    }
    if run("add") {
        add_latency(false).await;
        add_latency(true).await;
    }
}
