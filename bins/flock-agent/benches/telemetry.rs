//! What telemetry costs, printed as plain numbers (root and the real peers, as
//! `benches/capture.rs`):
//!
//! 1. Request latency (p50/p99 over one keep-alive connection) and throughput (four
//!    connections) from an unmodified client in pod A to B's pod address, through the
//!    node's Envoy both ways (A's captured outbound listener, mTLS, B's inbound
//!    listener), with telemetry **off** and **on** (`--access-log FILE
//!    --workload-metrics`: every request an access log entry streamed to the agent, a
//!    JSON line and the golden metrics), in alternating rounds (a fresh agent, Envoy and
//!    pod network each), and the agent's CPU time per 1,000 requests in each.
//! 2. The golden metrics at 1,000 pods, in process: the cost of one observation with
//!    1,000 caller workloads each calling one service, and of one `/metrics` scrape of
//!    those 1,000 pairs.
//!
//! ```sh
//! cargo build --release -p flock-agent -p flockctl -p flock-cni-plugin -p flock-install-cni -p flock-supervisor
//! cargo bench -p flock-agent --bench telemetry
//! ```
//!
//! `FLOCK_BENCH_ROUNDS` (default 3) sets the rounds of each mode.

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "../tests/capturekit/mod.rs"]
mod capturekit;

mod httpkit;

use std::time::{Duration, Instant};

use capturekit::*;
use common::*;
use httpkit::*;

/// The agent's user + system CPU time so far (from `/proc/<pid>/stat`).
fn cpu_of(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // Fields after the command (which may hold spaces) start after the last ')'.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    let ticks: u64 = fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap();
    // CLK_TCK is 100 on Linux (sysconf(_SC_CLK_TCK) on every architecture flock runs on).
    Duration::from_millis(ticks * 10)
}

/// One round: (p50 µs, p99 µs, requests/s, agent CPU ms per 1,000 requests).
fn round(telemetry: bool) -> (f64, f64, f64, f64) {
    let logs = tempfile::tempdir().unwrap();
    let log = logs.path().join("access.log");
    let mut args = vec!["--capture", "strict", "--trust-domain", "mesh.test"];
    let log_arg = log.to_str().unwrap().to_string();
    if telemetry {
        args.extend(["--access-log", &log_arg, "--workload-metrics"]);
    }
    let agent = Agent::start(&args);
    let envoy = SupervisedEnvoy::start(&agent);
    let work = tempfile::Builder::new()
        .prefix("flock-telemetry-bench-")
        .tempdir()
        .unwrap();
    let net = ChainedNetwork::start(work.path(), &agent, "tbench", 8000);
    let ns_b = NetNs::new("tb");
    app_in(&ns_b.path(), 8080);
    let b = Pod::add_server(&net.cni, ns_b, "web-0", "web");
    let a = Pod::add_client(&net.cni, "ta", "client-0");
    let cpu = cpu_of(agent.proc.pid());
    let (p50, p99, rps) = measure(&a.ns.path(), &format!("{}:8080", b.ip), "web");
    let requests = (LATENCY_REQUESTS + 200) as f64 + rps * THROUGHPUT_FOR.as_secs_f64();
    if telemetry {
        // Every request became a line (what was measured is what was logged).
        wait_for("the access log to hold every request", WAIT, || {
            std::fs::read_to_string(&log)
                .unwrap_or_default()
                .lines()
                .count() as f64
                >= requests * 0.99
        });
    }
    let cpu_ms = (cpu_of(agent.proc.pid()) - cpu).as_secs_f64() * 1e3;
    drop((a, b, net));
    drop(envoy);
    drop(agent);
    (p50, p99, rps, cpu_ms / requests * 1e3)
}

fn median(mut v: Vec<f64>) -> (f64, f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[0], v[v.len() / 2], v[v.len() - 1])
}

/// The golden metrics at 1,000 caller workloads: (ns per observation, ms per scrape).
fn metrics_at_1000_pods() -> (f64, f64) {
    use flock_bird::workload_metrics::{MAX_SERIES, Pair, Recorder, WorkloadMetrics};
    let metrics = WorkloadMetrics::default();
    let mut recorder = Recorder::new(metrics.clone(), MAX_SERIES);
    let pairs: Vec<Pair> = (0..1000)
        .map(|i| {
            Pair::of(
                Some(&format!("spiffe://mesh.test/ns/default/sa/client-{i}")),
                Some("web.default"),
            )
        })
        .collect();
    const OBSERVATIONS: usize = 1_000_000;
    let t = Instant::now();
    for i in 0..OBSERVATIONS {
        recorder.request(&pairs[i % pairs.len()], 200, 0.002);
    }
    let per_observation = t.elapsed().as_secs_f64() * 1e9 / OBSERVATIONS as f64;
    let mut registry = flock_telemetry::prometheus_client::registry::Registry::default();
    metrics.register(&mut registry);
    let t = Instant::now();
    let mut out = String::new();
    for _ in 0..10 {
        out.clear();
        flock_telemetry::prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
    }
    let per_scrape = t.elapsed().as_secs_f64() * 1e3 / 10.0;
    assert!(out.contains("client-999"), "every pair exported");
    (per_observation, per_scrape)
}

fn main() {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let rounds: usize = std::env::var("FLOCK_BENCH_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1);
    let (mut off, mut on) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        off.push(round(false));
        on.push(round(true));
    }
    println!(
        "A→B through the node's Envoy both ways ({LATENCY_REQUESTS} sequential GETs on one keep-alive \
         connection; {THROUGHPUT_CONNS} connections for {THROUGHPUT_FOR:?}), {rounds} rounds each, min / median / max:"
    );
    println!("| telemetry | p50 | p99 | throughput | agent CPU per 1,000 requests |");
    println!("|---|---|---|---|---|");
    for (name, r) in [("off", &off), ("on", &on)] {
        let p50 = median(r.iter().map(|x| x.0).collect());
        let p99 = median(r.iter().map(|x| x.1).collect());
        let rps = median(r.iter().map(|x| x.2).collect());
        let cpu = median(r.iter().map(|x| x.3).collect());
        println!(
            "| {name} | {:.0} / {:.0} / {:.0} µs | {:.0} / {:.0} / {:.0} µs | {:.0} / {:.0} / {:.0} req/s | {:.1} / {:.1} / {:.1} ms |",
            p50.0, p50.1, p50.2, p99.0, p99.1, p99.2, rps.0, rps.1, rps.2, cpu.0, cpu.1, cpu.2
        );
    }
    // The p50 overhead, round by round (each "on" round against the "off" round before
    // it: the same machine state, minutes apart at most).
    let ratios: Vec<f64> = off.iter().zip(&on).map(|(o, n)| n.0 / o.0).collect();
    let r = median(ratios);
    println!(
        "p50 on / off: min {:.3}, median {:.3}, max {:.3} (goal: ≤ 1.05)",
        r.0, r.1, r.2
    );
    let (obs_ns, scrape_ms) = metrics_at_1000_pods();
    println!(
        "golden metrics at 1,000 caller workloads: {obs_ns:.0} ns per observation, {scrape_ms:.2} ms per /metrics scrape"
    );
}
