//! What transparent capture costs, printed as plain numbers (root and the real peers:
//! the agent with `--capture strict`, Envoy under `flock-supervisor`, libcni with
//! Debian's `bridge` + `host-local` chained with `flock-cni`, real netns and nft):
//!
//! 1. Request latency (p50/p99 over one keep-alive connection) and throughput (four
//!    keep-alive connections for a few seconds) to the same kind of app, three ways:
//!    * **captured**: an unmodified client in pod A dials B's pod address; capture
//!      sends it through A's outbound listener and mTLS to B's inbound listener;
//!    * **explicit**: a pod with `flock.io/capture: off` dials its outbound listener
//!      `127.0.0.1:15001` with `Host: web` (the mesh without capture: same Envoy
//!      path, no redirect and no original-destination match);
//!    * **direct**: plaintext from a pod outside the mesh to an app outside the mesh
//!      (no Envoy at all).
//!
//!    The client and the apps are Rust threads that entered the pods' netns (`setns`),
//!    so neither a process spawn nor a slow app is in what is measured.
//! 2. CNI ADD latency through libcni (`cnitool bench`: ADD then DEL, N times), with
//!    capture (`flock.io/capture: strict`: the agent installs the nft table in the
//!    pod's netns before answering) and without (`flock.io/capture: off`).
//!
//! ```sh
//! cargo build --release -p flock-agent -p flockctl -p flock-cni-plugin -p flock-install-cni -p flock-supervisor
//! cargo bench -p flock-agent --bench capture
//! ```
//!
//! Needs what `tests/capture.rs` needs (root, nft, `FLOCK_ENVOY_BIN`,
//! `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL`).

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "../tests/capturekit/mod.rs"]
mod capturekit;

mod httpkit;

use capturekit::*;
use common::*;
use httpkit::*;
use serde_json::{Value, json};

const CNI_ADDS: usize = 100;

/// (p50 ms, p99 ms) of `CNI_ADDS` ADDs (each followed by its DEL) through libcni.
fn add_latency(cni: &Cni, ns: &NetNs, prefix: &str, annotations: &Value) -> (f64, f64) {
    let mut ms = cnitool_adds(cni, &ns.path(), CNI_ADDS, prefix, annotations);
    ms.sort_by(f64::total_cmp);
    (pct(&ms, 0.50), pct(&ms, 0.99))
}

fn main() {
    // `cargo bench` passes --bench; nothing to parse.
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let agent = Agent::start(&["--capture", "strict", "--trust-domain", "mesh.test"]);
    let envoy = SupervisedEnvoy::start(&agent);
    let work = tempfile::Builder::new()
        .prefix("flock-capture-bench-")
        .tempdir()
        .unwrap();
    let net = ChainedNetwork::start(work.path(), &agent, "cbench", 8000);
    let cni = &net.cni;

    // The apps first (B's in the mesh, M's outside it), then the pods' ADDs.
    let ns_b = NetNs::new("bb");
    app_in(&ns_b.path(), 8080);
    let ns_m = NetNs::new("bm");
    app_in(&ns_m.path(), 8080);
    let b = Pod::add_server(cni, ns_b, "web-0", "web");
    let a = Pod::add_client(cni, "ba", "client-0");
    let e = Pod::add(
        cni,
        "be",
        "explicit-0",
        json!({"flock.io/service": "client", "flock.io/service-account": "client",
               "flock.io/capture": "off"}),
    );
    let m = Pod::add_in(cni, ns_m, "default", "plain-0", json!({}));
    let n = Pod::add(cni, "bn", "outside-0", json!({}));
    assert_eq!(e.tables(), Vec::new(), "capture: off still got rules");

    let b_addr = format!("{}:8080", b.ip);
    let captured = measure(&a.ns.path(), &b_addr, "anything.example");
    let explicit = measure(&e.ns.path(), "127.0.0.1:15001", "web");
    let direct = measure(&n.ns.path(), &format!("{}:8080", m.ip), "plain");
    // Each way's requests went where it says: the captured and explicit ones through
    // the client's mTLS cluster of web.
    let stats = envoy_stats(&envoy.admin);
    // The service's mTLS cluster itself, not its per-endpoint `|direct-N` ones.
    let mtls = stat(
        &stats,
        &["outbound|8080|web.default|"],
        "sa/client.upstream_rq_total",
    );
    assert!(
        mtls > 2 * LATENCY_REQUESTS as u64,
        "mTLS cluster saw {mtls}"
    );

    println!(
        "A→B request latency ({LATENCY_REQUESTS} sequential GETs on one keep-alive connection) \
         and throughput ({THROUGHPUT_CONNS} keep-alive connections, {THROUGHPUT_FOR:?}):"
    );
    println!("| path | p50 | p99 | throughput |");
    println!("|---|---|---|---|");
    for (name, (p50, p99, rps)) in [
        (
            "captured: unmodified client → B's pod IP:8080 (Envoy, mTLS)",
            captured,
        ),
        (
            "explicit: client → 127.0.0.1:15001, Host: web (Envoy, mTLS, no capture)",
            explicit,
        ),
        (
            "direct: plaintext to an app outside the mesh (no Envoy)",
            direct,
        ),
    ] {
        println!("| {name} | {p50:.0} µs | {p99:.0} µs | {rps:.0} req/s |");
    }

    // ---------------------------------------------------------------- 2. CNI ADD
    let ns = NetNs::new("badd");
    let base = json!({"flock.io/service": "bench", "flock.io/ports": "8080"});
    let with = |mode: &str| {
        let mut a = base.clone();
        a["flock.io/capture"] = json!(mode);
        a
    };
    let (off50, off99) = add_latency(cni, &ns, "nocap-", &with("off"));
    let (on50, on99) = add_latency(cni, &ns, "cap-", &with("strict"));
    println!();
    println!(
        "CNI ADD through libcni ({CNI_ADDS} ADDs, each followed by its DEL; bridge + host-local + flock-cni):"
    );
    println!("| pod | p50 | p99 |");
    println!("|---|---|---|");
    println!("| `flock.io/capture: off` | {off50:.2} ms | {off99:.2} ms |");
    println!(
        "| `flock.io/capture: strict` (nft table installed before the answer) | {on50:.2} ms | {on99:.2} ms |"
    );

    // Where an ADD's time goes, from the agent's own `pod added` lines (`step_us`):
    // the median of each step over the pods of each kind.
    let log = agent.proc.log_text();
    for (kind, prefix) in [("off", "nocap-"), ("strict", "cap-")] {
        let mut steps: std::collections::BTreeMap<String, Vec<u64>> = Default::default();
        for line in log
            .lines()
            .filter(|l| l.contains("pod added") && l.contains(&format!("key={prefix}")))
        {
            let Some(rest) = line.split("step_us=").nth(1) else {
                continue;
            };
            let list = rest.trim_start_matches('"').split('"').next().unwrap_or("");
            for item in list.split(',') {
                if let Some((step, us)) = item.split_once(':')
                    && let Ok(us) = us.trim().parse::<u64>()
                {
                    steps.entry(step.to_string()).or_default().push(us);
                }
            }
        }
        let medians: Vec<String> = steps
            .into_iter()
            .map(|(step, mut us)| {
                us.sort_unstable();
                format!("{step} {} µs", us[us.len() / 2])
            })
            .collect();
        println!(
            "agent AddPod steps, capture {kind} (median): {}",
            medians.join(", ")
        );
    }

    drop((a, b, e, m, n, ns, net));
    drop(envoy);
    drop(agent);
}
