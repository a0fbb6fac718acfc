//! Benchmarks of the CNI plugin and installer, printed as plain numbers (no criterion:
//! each sample is a real process run on a real network namespace).
//!
//! 1. ADD latency through libcni, 200 iterations each: `bridge` + `host-local` alone,
//!    then with `flock-cni` chained (talking to the in-test agent double). p50/p99 and
//!    the ratio: the overhead flock adds to pod network setup.
//! 2. Installer reaction: a primary config renamed into the directory, until the
//!    patched version is in place; p50/p99 over 200 events, and our writes per event.
//!
//! Run as root after scripts/prereqs/20-cni.sh (it exports FLOCK_CNITOOL and
//! FLOCK_CNI_PLUGIN_DIR):
//!
//! ```sh
//! cargo build --release -p flock-cni-plugin && cargo bench -p flock-install-cni --bench cni
//! ```

#[path = "../tests/common/mod.rs"]
mod common;

use std::fs;
use std::time::{Duration, Instant};

use common::e2e::*;
use common::*;
use flock_cni::testing::TestAgent;
use serde_json::Value;

const N: usize = 200;

fn percentile(sorted: &[f64], p: f64) -> f64 {
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

fn summary(samples_us: &mut [f64]) -> (f64, f64) {
    samples_us.sort_by(|a, b| a.total_cmp(b));
    (percentile(samples_us, 0.50), percentile(samples_us, 0.99))
}

fn add_latency(
    conflist: &std::path::Path,
    cni_path: &str,
    ns: &NetNs,
    cache: &std::path::Path,
    prefix: &str,
) -> (f64, f64) {
    let out = cnitool(
        &[
            "bench",
            &N.to_string(),
            conflist.to_str().unwrap(),
            &ns.path(),
            prefix,
            "eth0",
        ],
        cni_path,
        cache,
    );
    assert!(
        out.status.success(),
        "cnitool bench: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut us: Vec<f64> = v["add_us"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    summary(&mut us)
}

fn main() {
    // `cargo bench` passes --bench; nothing to parse.
    let plugin_dir = required_env("FLOCK_CNI_PLUGIN_DIR");
    let plugin = plugin_binary();

    // ---------------------------------------------------------------- 1. ADD latency
    let mut inst = Installer::prepare();
    inst.plugin = plugin;
    let ns = NetNs::new();
    let network = format!("flockbench{}", std::process::id());
    let list_text = bridge_conflist(&ns, inst.tmp.path(), &network);
    let plain = inst.tmp.path().join("plain.conflist");
    fs::write(&plain, &list_text).unwrap();
    fs::write(inst.path("10-bridge.conflist"), &list_text).unwrap();
    let agent_sock = inst.tmp.path().join("agent.sock");
    let agent = TestAgent::start(&agent_sock).unwrap();
    let ours = serde_json::json!({"type": "flock-cni", "agent_socket": agent_sock}).to_string();
    let mut inst = inst.start(&["--plugin-config", &ours]);
    wait_for("ready", WAIT, || inst.is_ready());
    let cache = inst.tmp.path().join("cache");
    let cni_path = format!("{}:{}", inst.bin.display(), plugin_dir.display());
    let (alone50, alone99) = add_latency(&plain, &cni_path, &ns, &cache, "alone-");
    let (chain50, chain99) = add_latency(
        &inst.path("10-bridge.conflist"),
        &cni_path,
        &ns,
        &cache,
        "chained-",
    );
    let adds = agent.calls().len();
    println!("ADD latency through libcni, {N} iterations (bridge + host-local on a real netns):");
    println!(
        "  bridge+host-local alone      p50 {:8.2} ms   p99 {:8.2} ms",
        alone50 / 1e3,
        alone99 / 1e3
    );
    println!(
        "  with flock-cni chained       p50 {:8.2} ms   p99 {:8.2} ms",
        chain50 / 1e3,
        chain99 / 1e3
    );
    println!(
        "  ratio chained/alone          p50 {:8.2}x     p99 {:8.2}x   ({adds} agent calls)",
        chain50 / alone50,
        chain99 / alone99
    );
    assert_eq!(inst.stop().code(), Some(0));
    drop(agent);
    drop(ns);

    // ---------------------------------------------------------------- 2. reaction
    // No write throttling here (--write-interval-ms 0): this measures reaction time.
    let inst = Installer::prepare().start(&["--write-interval-ms", "0"]);
    let name = "10-primary.conflist";
    let text = conflist("primary", "calico");
    fs::write(inst.path(name), &text).unwrap();
    inst.wait_patched(name);
    let base_writes = inst.writes_to(name);
    let mut lat = Vec::with_capacity(N);
    for _ in 0..N {
        let tmp = inst.tmp.path().join("net.d").join("primary.tmp");
        fs::write(&tmp, &text).unwrap();
        let t = Instant::now();
        fs::rename(&tmp, inst.path(name)).unwrap();
        loop {
            if is_patched(&inst.read(name)) {
                break;
            }
            assert!(t.elapsed() < Duration::from_secs(10), "not re-patched");
            std::thread::sleep(Duration::from_micros(50));
        }
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    std::thread::sleep(Duration::from_millis(500));
    let writes = inst.writes_to(name) - base_writes;
    let (r50, r99) = summary(&mut lat);
    println!("Installer reaction, {N} primary configs renamed into the directory:");
    println!(
        "  rename -> patched in place   p50 {:8.3} ms   p99 {:8.3} ms",
        r50 / 1e3,
        r99 / 1e3
    );
    println!(
        "  our writes per external event {:.2} ({writes} writes / {N} events)",
        writes as f64 / N as f64
    );
}
