//! What `flock-cni` adds to a pod's CNI ADD, next to another chained plugin, printed as
//! plain numbers. CNI ADD latency through libcni (`cnitool bench`: ADD then DEL, the ADD
//! timed in-process, N times; root, real network namespaces, Debian's plugins) for:
//!
//! 1. `bridge` + `host-local` alone;
//! 2. the same with Debian's `portmap` chained after them (`"capabilities":
//!    {"portMappings": true}`, no mappings in the runtime config: what a pod without
//!    `hostPort`s costs);
//! 3. the same with `flock-cni` chained after them (patched in by the real
//!    `flock-install-cni`), talking to the real `flock-agent` holding no other pod;
//! 4. the same with the agent holding 250 pods (added through its CNI gRPC service
//!    directly, spread over 16 services, all healthy: their probes hit a real HTTP
//!    server in a network namespace they share).
//!
//! Goal: flock-cni (real agent) ≤ portmap + 0.5 ms at p50 and p99, with 0 and 250
//! pods. The bench reports whether it is met; it never fails on a number.
//!
//! Order. One agent, as on a node: a phase with 0 pods, then the 250 pods are added
//! and a second phase runs. In each phase the three chains (alone, portmap, flock-cni)
//! are measured round-robin in batches of 10 ADDs, 30 rounds (300 ADDs each), the
//! starting chain rotating every round so each chain is first, second and third
//! equally often; a few unmeasured ADDs per chain warm each phase up (the first ADD on
//! a bridge creates it). Alone and portmap are measured again in the 250-pod phase, so
//! each flock-cni figure is compared with baselines taken in the same minutes, under
//! the same background (the 250 pods' liveness probes, whatever else this machine
//! runs), and a drift of the machine over the run lands on all three chains alike.
//! Beside the goal's p50/p99 comparison the bench prints a paired figure: the median
//! over rounds of flock-cni's batch median minus portmap's batch median of the same
//! round, which takes out the drift between rounds (on this project's 2-core test
//! machines the whole chain's p50 moved by several ms between phases of one run).
//!
//! The pods. The agent runs with its default capture (`--capture off`, which
//! [`Agent::start`] keeps: it passes no `--capture`), its default probe interval (5 s,
//! passed explicitly: the test harness uses 1 s) and its default log filter
//! (`RUST_LOG=info`; the harness uses debug). A normal mesh pod on such a node has no
//! capture rules; the bench's pods say so explicitly with `flock.io/capture: off`
//! (resolved exactly like no annotation on a node whose capture is off). The measured
//! pod is `default/bench-0` of service `svc-0` (port 8080): in the 250-pod phase it
//! joins a service that already has other endpoints, as a scaled-up deployment does.
//! The agent's pod store is its default (`--store-sync crash`: written by rename, not
//! flushed); `FLOCK_CHAIN_STORE_SYNC=power-loss` runs the agent with the store that
//! fsyncs the record and the directory on every ADD and DEL.
//!
//! ```sh
//! cargo build --release -p flock-agent -p flock-cni-plugin -p flock-install-cni &&
//!   cargo bench -p flock-agent --bench cni_chain
//! ```
//!
//! (`flock-install-cni` patches flock-cni into the chain, as on a node.) Needs root,
//! iproute2, Debian's CNI plugins (`bridge`, `host-local`, `portmap`) in
//! `FLOCK_CNI_PLUGIN_DIR` and the libcni driver `FLOCK_CNITOOL`: `ROOT=$PWD;
//! die(){ echo "$*"; return 1; }; . scripts/prereqs/20-cni.sh` installs them and
//! exports both.

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "../tests/capturekit/mod.rs"]
mod capturekit;

use std::collections::HashMap;
use std::ffi::OsStr;
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::Path;
use std::time::{Duration, Instant};

use capturekit::{Pod, cnitool_adds};
use common::*;
use serde_json::{Value, json};

/// Measured ADDs per chain and phase: a p99 of 300 rests on 3 samples above it, not
/// 1.5 (run-to-run p99s of 150 moved by several ms).
const ADDS: usize = 300;
/// ADDs per `cnitool bench` run (one batch of the round-robin): small, so the batches a
/// paired difference compares ran within a second of each other.
const BATCH: usize = 10;
/// Unmeasured ADDs per chain at the start of each phase.
const WARMUP: usize = 5;
/// The pods the agent holds in the second phase, and their services.
const HELD: usize = 250;
const SERVICES: usize = 16;
/// The agent's default liveness probe interval (`--probe-interval-ms`).
const PROBE_INTERVAL_MS: &str = "5000";
/// The goal: flock-cni at most this much over portmap, at p50 and at p99.
const GOAL_MS: f64 = 0.5;

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// One conflist to measure, and the netns its ADDs go to.
struct Chain {
    name: &'static str,
    cni: Cni,
    ns: NetNs,
}

/// `n` ADDs (each followed by its DEL) of `chain` through libcni: each ADD's latency, ms.
fn batch(chain: &Chain, n: usize, prefix: &str, annotations: &Value) -> Vec<f64> {
    cnitool_adds(&chain.cni, &chain.ns.path(), n, prefix, annotations)
}

/// A counter or gauge from the agent's `/metrics` (0 when absent).
fn metric(agent: &Agent, name: &str) -> u64 {
    let (_, text) = agent.get("/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}

/// A `bridge` + `host-local` conflist on a bridge and /24 of its own, with `then`
/// appended to its plugins, written to `<dir>/<name>.conflist` (a directory the
/// installer does not watch), and the libcni driver on it.
fn plain_chain(
    work: &Path,
    dir: &Path,
    installer_bin: &Path,
    name: &'static str,
    then: Option<Value>,
) -> (Chain, Bridge) {
    let bridge = Bridge::new();
    let mut list = bridge_conflist(
        &bridge,
        &work.join(format!("ipam-{name}")),
        &format!("flock{name}{}", std::process::id()),
    );
    if let Some(plugin) = then {
        list["plugins"].as_array_mut().unwrap().push(plugin);
    }
    let path = dir.join(format!("{name}.conflist"));
    std::fs::write(&path, list.to_string()).unwrap();
    let chain = Chain {
        name,
        // The same CNI_PATH as the flock-cni chain's (the installer's bin dir first).
        cni: Cni::new(path, installer_bin, work.join(format!("cache-{name}"))),
        ns: NetNs::new(name),
    };
    (chain, bridge)
}

/// One ADD and DEL of `chain` through libcni, checking the result: an address on the
/// chain's bridge.
fn check_chain(chain: &Chain, bridge: &Bridge, annotations: &Value) {
    let pod = Pod::add_in(
        &chain.cni,
        NetNs::new(&format!("{}-chk", chain.name)),
        "default",
        &format!("check-{}", chain.name),
        annotations.clone(),
    );
    let prefix = bridge.subnet.trim_end_matches("0/24");
    assert!(
        pod.ip.starts_with(prefix),
        "{}: ADD gave {} outside {}",
        chain.name,
        pod.ip,
        bridge.subnet
    );
    let out = pod.cni(&chain.cni, "del");
    assert!(out.status.success(), "{}: DEL: {out:?}", chain.name);
}

/// A plain HTTP/1.1 server on `0.0.0.0:port` in `ns` answering every request with an
/// empty 200 and closing (the held pods' app, for the agent's liveness probes). Runs
/// until the process exits.
fn probe_target_in(ns: &NetNs, port: u16) {
    let path = ns.path();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap();
        nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).unwrap();
        let listener = TcpListener::bind(("0.0.0.0", port)).unwrap();
        tx.send(()).unwrap();
        for conn in listener.incoming().flatten() {
            // A round's probes come at once: one thread each.
            std::thread::spawn(move || answer_ok(conn));
        }
    });
    rx.recv().unwrap();
}

/// Reads one request head from `conn`, answers an empty 200 and closes.
fn answer_ok(mut conn: TcpStream) {
    let _ = conn.set_read_timeout(Some(Duration::from_secs(1)));
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    while !got.windows(4).any(|w| w == b"\r\n\r\n") {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => got.extend_from_slice(&buf[..n]),
        }
    }
    let _ = conn.write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
}

/// Adds `HELD` pods to the agent through its CNI gRPC service (as flock-cni would,
/// without the bridge): distinct container IDs and addresses, services `svc-0` ..
/// `svc-15`, port 8080, no capture, all in the netns `netns`.
fn add_held_pods(agent: &Agent, netns: &str) {
    use flock_cni::proto::v1::{AddPodRequest, IpConfig, Outcome, PodRef};
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        for i in 0..HELD {
            let name = format!("held-{i}");
            let req = AddPodRequest {
                container_id: format!("held-{i}"),
                netns: netns.into(),
                ifname: "eth0".into(),
                pod: Some(PodRef {
                    name: name.clone(),
                    namespace: "default".into(),
                    uid: format!("uid-{name}"),
                }),
                ips: vec![IpConfig {
                    address: format!("10.200.{}.{}/16", (i + 1) / 256, (i + 1) % 256),
                    ..IpConfig::default()
                }],
                annotations: HashMap::from([
                    (
                        "flock.io/service".to_string(),
                        format!("svc-{}", i % SERVICES),
                    ),
                    ("flock.io/ports".to_string(), "8080".to_string()),
                    ("flock.io/capture".to_string(), "off".to_string()),
                ]),
                network_name: "net".into(),
                cni_version: "1.1.0".into(),
                ..AddPodRequest::default()
            };
            let resp = flock_cni::client::call(
                &agent.cni_socket,
                Duration::from_secs(30),
                |mut c| async move { c.add_pod(req).await },
            )
            .await
            .expect("AddPod");
            assert_eq!(resp.outcome, Outcome::Success as i32, "{}", resp.message);
        }
    });
}

/// One phase's latencies (ms): each chain's, sorted, and each round's batch of each
/// chain.
struct PhaseSamples {
    sorted: Vec<Vec<f64>>,
    rounds: Vec<Vec<Vec<f64>>>,
}

impl PhaseSamples {
    /// The median over rounds of (chain `a`'s batch median − chain `b`'s batch median
    /// in the same round): the margin of `a` over `b` with the machine's drift between
    /// rounds taken out (each round's batches ran within a second or two of each other).
    fn paired_median(&self, a: usize, b: usize) -> f64 {
        let mut d: Vec<f64> = self
            .rounds
            .iter()
            .map(|r| {
                let med = |v: &Vec<f64>| {
                    let mut v = v.clone();
                    v.sort_by(f64::total_cmp);
                    pct(&v, 0.5)
                };
                med(&r[a]) - med(&r[b])
            })
            .collect();
        d.sort_by(f64::total_cmp);
        pct(&d, 0.5)
    }
}

/// One phase: a warm-up, then `ADDS` ADDs per chain, round-robin in batches of
/// `BATCH` with the first chain rotating.
fn phase(chains: &[&Chain], tag: &str, annotations: &Value) -> PhaseSamples {
    for c in chains {
        batch(c, WARMUP, &format!("{tag}-warm-{}-", c.name), annotations);
    }
    let mut sorted = vec![Vec::with_capacity(ADDS); chains.len()];
    let mut rounds = Vec::with_capacity(ADDS / BATCH);
    for round in 0..ADDS / BATCH {
        let mut this = vec![Vec::new(); chains.len()];
        for k in 0..chains.len() {
            let i = (round + k) % chains.len();
            let c = chains[i];
            this[i] = batch(
                c,
                BATCH,
                &format!("{tag}-r{round}-{}-", c.name),
                annotations,
            );
            sorted[i].extend_from_slice(&this[i]);
        }
        rounds.push(this);
    }
    for s in &mut sorted {
        s.sort_by(f64::total_cmp);
    }
    PhaseSamples { sorted, rounds }
}

fn main() {
    // `cargo bench` passes --bench; nothing to parse.
    let plugins = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    for p in ["bridge", "host-local", "portmap"] {
        assert!(
            plugins.join(p).is_file(),
            "{} is missing: Debian's containernetworking-plugins (scripts/prereqs/20-cni.sh)",
            plugins.join(p).display()
        );
    }
    assert_eq!(nix::unistd::geteuid().as_raw(), 0, "run as root");

    // The agent's default store (`crash`: no flush), or `FLOCK_CHAIN_STORE_SYNC=power-loss`
    // for the store that fsyncs the file and the directory on every ADD and DEL.
    let store_sync = std::env::var("FLOCK_CHAIN_STORE_SYNC").unwrap_or_else(|_| "crash".into());
    let agent = Agent::start_node_env(
        "n1",
        "memory",
        &[
            "--probe-interval-ms",
            PROBE_INTERVAL_MS,
            "--store-sync",
            &store_sync,
        ],
        // Without fault injection (the harness arms it for tests): a release build's
        // agent.
        &[
            ("RUST_LOG", OsStr::new("info")),
            ("FLOCK_FAULT_INJECTION", OsStr::new("0")),
        ],
    );
    let work = tempfile::Builder::new()
        .prefix("flock-cni-chain-bench-")
        .tempdir()
        .unwrap();
    let net = ChainedNetwork::start(work.path(), &agent, "chain", 8000);
    let plain_dir = work.path().join("plain.d");
    std::fs::create_dir(&plain_dir).unwrap();
    let bin = net.installer.bin_dir.clone();
    let (alone, alone_bridge) = plain_chain(work.path(), &plain_dir, &bin, "alone", None);
    let (portmap, portmap_bridge) = plain_chain(
        work.path(),
        &plain_dir,
        &bin,
        "portmap",
        Some(json!({"type": "portmap", "capabilities": {"portMappings": true}})),
    );
    let flock = Chain {
        name: "flock",
        cni: Cni {
            conflist: net.cni.conflist.clone(),
            cni_path: net.cni.cni_path.clone(),
            cache: net.cni.cache.clone(),
        },
        ns: NetNs::new("flock"),
    };
    let conflist = std::fs::read_to_string(&flock.cni.conflist).unwrap();
    let types: Vec<String> = serde_json::from_str::<Value>(&conflist).unwrap()["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap_or_default().to_owned())
        .collect();
    assert_eq!(
        types,
        ["bridge", "flock-cni"],
        "the patched conflist: {conflist}"
    );

    let annotations = json!({"flock.io/service": "svc-0", "flock.io/ports": "8080",
                             "flock.io/capture": "off"});
    // Each chain works, and flock-cni's ADD reaches the agent (the pod is meshed).
    check_chain(&alone, &alone_bridge, &annotations);
    check_chain(&portmap, &portmap_bridge, &annotations);
    let added = metric(&agent, "flock_agent_pods_added_total");
    check_chain(&flock, &net.bridge, &annotations);
    assert_eq!(
        metric(&agent, "flock_agent_pods_added_total"),
        added + 1,
        "flock-cni's ADD did not mesh the pod in the agent"
    );
    assert_eq!(metric(&agent, "flock_agent_pods"), 0);

    let chains = [&alone, &portmap, &flock];
    let per_phase = (WARMUP + ADDS) as u64;

    // ------------------------------------------------------------ phase 1: 0 pods
    let added = metric(&agent, "flock_agent_pods_added_total");
    let t = Instant::now();
    let empty = phase(&chains, "p0", &annotations);
    let empty_took = t.elapsed();
    assert_eq!(
        metric(&agent, "flock_agent_pods_added_total"),
        added + per_phase,
        "not every flock-cni ADD meshed the pod"
    );
    assert_eq!(metric(&agent, "flock_agent_pods"), 0, "a DEL left a pod");

    // ------------------------------------------------------------ phase 2: 250 pods
    let held_ns = NetNs::new("held");
    probe_target_in(&held_ns, 8080);
    add_held_pods(&agent, &held_ns.path());
    assert_eq!(metric(&agent, "flock_agent_pods"), HELD as u64);
    // Steady state: every held pod probed and healthy (their first probes are spread
    // over one interval).
    let health = |pods: &Value, want: &str| {
        pods["pods"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|p| p["health"] == want)
            .count()
    };
    let pods = wait_for("every held pod healthy", Duration::from_secs(60), || {
        let pods = agent.json("/debug/pods");
        (health(&pods, "healthy") == HELD).then_some(pods)
    });
    let services: std::collections::BTreeSet<&str> = pods["pods"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|p| p["service"].as_str())
        .collect();
    assert_eq!(services.len(), SERVICES);

    let added = metric(&agent, "flock_agent_pods_added_total");
    let probes_before = metric(&agent, "flock_agent_probes_total");
    let failures_before = metric(&agent, "flock_agent_probe_failures_total");
    let changes_before = metric(&agent, "flock_agent_health_changes_total");
    let t = Instant::now();
    let held = phase(&chains, "p250", &annotations);
    let held_took = t.elapsed();
    assert_eq!(
        metric(&agent, "flock_agent_pods_added_total"),
        added + per_phase,
        "not every flock-cni ADD meshed the pod"
    );
    assert_eq!(metric(&agent, "flock_agent_pods"), HELD as u64);
    let probes_during = metric(&agent, "flock_agent_probes_total") - probes_before;
    let failed = metric(&agent, "flock_agent_probe_failures_total") - failures_before;
    let health_changes = metric(&agent, "flock_agent_health_changes_total") - changes_before;

    // ------------------------------------------------------------ report
    println!(
        "CNI ADD through libcni ({ADDS} ADDs per chain and phase, each followed by its DEL; \
         round-robin in batches of {BATCH}, {WARMUP} unmeasured ADDs per chain first; \
         flock-cni pods: `flock.io/capture: off`, agent `--capture off`, probes every \
         {PROBE_INTERVAL_MS} ms, `--store-sync {store_sync}`):"
    );
    println!();
    println!("| chain | p50 ms | p99 ms | over bridge+host-local p50 | over portmap p50 / p99 |");
    println!("|---|---|---|---|---|");
    let mut verdicts = Vec::new();
    let mut paired = Vec::new();
    for (pods, phase_samples) in [(0, &empty), (HELD, &held)] {
        let s = &phase_samples.sorted;
        paired.push((pods, phase_samples.paired_median(2, 1)));
        let p = |i: usize| (pct(&s[i], 0.50), pct(&s[i], 0.99));
        let (a50, a99) = p(0);
        let (m50, m99) = p(1);
        let (f50, f99) = p(2);
        let phase = format!("{pods}-pod phase");
        println!("| bridge + host-local ({phase}) | {a50:.2} | {a99:.2} | — | — |");
        println!(
            "| bridge + host-local + portmap ({phase}) | {m50:.2} | {m99:.2} | {:+.2} ms | — |",
            m50 - a50
        );
        println!(
            "| bridge + host-local + flock-cni, agent with {pods} pods | {f50:.2} | {f99:.2} | \
             {:+.2} ms | {:+.2} / {:+.2} ms |",
            f50 - a50,
            f50 - m50,
            f99 - m99
        );
        let met = f50 <= m50 + GOAL_MS && f99 <= m99 + GOAL_MS;
        verdicts.push(format!(
            "{pods} pods: p50 {:+.2} ms, p99 {:+.2} ms over portmap: {}",
            f50 - m50,
            f99 - m99,
            if met { "met" } else { "NOT met" }
        ));
    }
    println!();
    println!(
        "Goal: flock-cni (real agent) ≤ portmap + {GOAL_MS} ms at p50 and p99, with 0 and {HELD} pods."
    );
    for v in verdicts {
        println!("  {v}");
    }
    println!(
        "Paired (median over the {} rounds of flock-cni's batch median minus portmap's in the same round):",
        ADDS / BATCH
    );
    for (pods, d) in paired {
        println!("  {pods} pods: {d:+.2} ms");
    }
    // The agent's own share of a flock-cni ADD: `took_us` of its `pod added` log line
    // (from the request's first step to the answer), for the measured ADDs.
    let log = agent.proc.log_text();
    for (pods, tag) in [(0, "p0-r"), (HELD, "p250-r")] {
        let mut took: Vec<f64> = log
            .lines()
            .filter(|l| l.contains("pod added") && l.contains(&format!("key={tag}")))
            .filter_map(|l| {
                let v = l.split("took_us=").nth(1)?.split_whitespace().next()?;
                v.parse::<f64>().ok().map(|us| us / 1000.0)
            })
            .collect();
        took.sort_by(f64::total_cmp);
        if took.len() == ADDS {
            println!(
                "  the agent's own time in those ADDs ({pods} pods): p50 {:.2} ms, p99 {:.2} ms",
                pct(&took, 0.5),
                pct(&took, 0.99)
            );
        }
        // And per step (`step_us` of the same lines): where that time goes.
        let mut steps: Vec<(String, Vec<f64>)> = Vec::new();
        for line in log
            .lines()
            .filter(|l| l.contains("pod added") && l.contains(&format!("key={tag}")))
        {
            let Some(list) = line.split("step_us=").nth(1) else {
                continue;
            };
            let list = list.trim_start_matches('"');
            let list = list.split(['"', ' ']).next().unwrap_or_default();
            for (i, item) in list.split(',').enumerate() {
                let Some((name, us)) = item.split_once(':') else {
                    continue;
                };
                let Ok(us) = us.parse::<f64>() else { continue };
                if steps.len() <= i {
                    steps.push((name.to_string(), Vec::new()));
                }
                steps[i].1.push(us / 1000.0);
            }
        }
        let medians: Vec<String> = steps
            .iter_mut()
            .map(|(name, v)| {
                v.sort_by(f64::total_cmp);
                format!("{name} {:.2}", pct(v, 0.5))
            })
            .collect();
        if !medians.is_empty() {
            println!("    per step, p50 ms: {}", medians.join(", "));
        }
    }
    println!(
        "(phases took {:.0} s and {:.0} s; in the {HELD}-pod phase the agent held {HELD} pods \
         of {} services and ran {probes_during} liveness probes, {failed} failed, {health_changes} health \
         changes)",
        empty_took.as_secs_f64(),
        held_took.as_secs_f64(),
        services.len()
    );

    drop((alone, portmap, flock, held_ns));
    drop((alone_bridge, portmap_bridge, net));
    drop(agent);
    drop(work);
}
