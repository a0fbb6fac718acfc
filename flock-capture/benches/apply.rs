//! What installing a new pod's capture costs ([`Nft::apply`], the agent's
//! CaptureApply step on ADD: the nft table and the original-source policy route, in a
//! netns that has neither), against the way it ran before, in the same run.
//!
//! Both do the same work in a real netns (root), emptied before each round (not
//! timed). `Nft::apply` starts `nft` from a thread that entered the netns, the table
//! created by one transaction without a deletion, and writes the policy route's
//! route and rule over rtnetlink from that thread (one process). The baseline is the
//! previous code path: each command behind its own `nsenter --net=<netns>`, the
//! converging batch (`add`, `delete`, then the table: its commit waits for an RCU
//! grace period), the route replaced, the rules listed, the rule added (eight
//! processes). A repair over an existing table is not measured: it tries the create
//! first and then replaces, one `nft` more than before.
//!
//! ```sh
//! cargo bench -p flock-capture --bench apply
//! ```

use flock_capture::Nft;
use flock_core::capture::{CaptureSpec, Mode, OriginalSrc};
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::Instant;

const ROUNDS: usize = 200;

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn spec() -> CaptureSpec {
    CaptureSpec {
        outbound_port: 15001,
        inbound: vec![(8080, 15006)],
        envoy_mark: 0x539,
        exclude_outbound_ports: vec![8443],
        exclude_outbound_cidrs: vec!["10.77.0.3".parse().unwrap()],
        exclude_inbound_ports: vec![],
        probe_sources: vec!["10.77.0.3".parse().unwrap()],
        mode: Mode::Strict,
        original_src: Some(OriginalSrc { ipv6: false }),
    }
}

/// The baseline: what `apply` ran before, each command behind `nsenter`.
fn apply_with_nsenter(netns: &str, batch: &str) {
    let run = |args: &[&str], stdin: Option<&str>| {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--net={netns}"))
            .arg("--")
            .args(args)
            .stdin(if stdin.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap();
        if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
            pipe.write_all(input.as_bytes()).unwrap();
        }
        let out = child.wait_with_output().unwrap();
        assert!(out.status.success(), "{args:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    run(&["nft", "-j", "-f", "-"], Some(batch));
    run(
        &[
            "ip", "route", "replace", "local", "default", "dev", "lo", "table", "1338",
        ],
        None,
    );
    let rules = run(&["ip", "-j", "rule", "show", "pref", "1338"], None);
    assert_eq!(rules.trim(), "[]", "the netns was emptied");
    run(
        &[
            "ip", "rule", "add", "fwmark", "0x53a", "lookup", "1338", "pref", "1338",
        ],
        None,
    );
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn main() {
    // `cargo test --benches` runs this with --bench absent: a smoke run only.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let rounds = if smoke { 3 } else { ROUNDS };
    let name = format!("flockcap-bench-{}", std::process::id());
    sh(&["ip", "netns", "add", &name]);
    sh(&["ip", "-n", &name, "link", "set", "lo", "up"]);
    let path = format!("/var/run/netns/{name}");
    let nft = Nft::new();
    let spec = spec();
    let batch = spec.ruleset().unwrap().to_nft_batch().to_string();
    let (mut ours, mut base) = (Vec::new(), Vec::new());
    // Interleaved, so both see the same machine; each on an emptied netns.
    for _ in 0..rounds {
        nft.remove(path.as_ref()).unwrap();
        let t = Instant::now();
        nft.apply(path.as_ref(), &spec).unwrap();
        ours.push(t.elapsed().as_secs_f64() * 1e3);
        nft.check(path.as_ref(), &spec).unwrap();
        nft.remove(path.as_ref()).unwrap();
        let t = Instant::now();
        apply_with_nsenter(&path, &batch);
        base.push(t.elapsed().as_secs_f64() * 1e3);
        nft.check(path.as_ref(), &spec).unwrap();
    }
    sh(&["ip", "netns", "del", &name]);
    ours.sort_by(f64::total_cmp);
    base.sort_by(f64::total_cmp);
    println!(
        "capture apply on a new pod's netns (table + original-source route), {rounds} rounds interleaved:"
    );
    println!("| way | p50 | p99 |");
    println!("|---|---|---|");
    println!(
        "| create in one transaction, from a thread in the netns (1 process, rtnetlink) | {:.2} ms | {:.2} ms |",
        pct(&ours, 0.5),
        pct(&ours, 0.99)
    );
    println!(
        "| before: converging batch, nsenter per command (8 processes) | {:.2} ms | {:.2} ms |",
        pct(&base, 0.5),
        pct(&base, 0.99)
    );
    println!(
        "p50 ratio now / before: {:.2}",
        pct(&ours, 0.5) / pct(&base, 0.5)
    );
}
