//! Crash consistency: the real `flock-agent` is SIGKILLed at 20+ random
//! points while 32 AddPod/RemovePod operations are in flight through its CNI socket.
//! After each restart (same state dir, `--registry file:` so the registry survives the
//! agent too) and one orphan-GC pass (CNI GC with the runtime's valid attachments,
//! repeated until the planner's 3-sweep hysteresis confirms), the store files,
//! `/debug/pods`, the registry and xDS (the snapshot's names and what a fresh Delta
//! ADS client receives) hold exactly the same pods, every acknowledged pod among them
//! and no acknowledged removal; no store file is quarantined (a SIGKILL never leaves
//! a torn record).
//!
//! Operations answered before the kill are acknowledged; the ones in flight at the
//! kill are indeterminate: their key may be present or absent (the same in all four
//! places) until the next answered operation on it. The seed (`FLOCK_CHURN_SEED`
//! overrides it) is printed, and so is each round's kill point and in-flight count.

mod churnkit;
mod common;

use churnkit::*;
use common::Agent;
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ROUNDS: usize = 20;
/// Pods added (all acknowledged) before the first kill: a node with a realistic
/// population, on which one crash's orphans stay under the GC breaker's 25 %.
const FILL: u64 = 100;

#[test]
fn sigkill_at_random_points_during_churn_loses_no_acknowledged_pod_and_store_registry_xds_agree() {
    let seed = seed(0x0c4a_5b00_0000_f10c);
    println!("crash seed: {seed:#x} (FLOCK_CHURN_SEED overrides)");
    let started = Instant::now();
    let ns = common::NetNs::new("churn");
    set_netns(ns.path());
    let mut rng = Rng::new(seed);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let work = tempfile::Builder::new()
        .prefix("flock-crash-")
        .tempdir()
        .unwrap();
    let registry = format!("file:{}", work.path().join("registry.json").display());
    let flags = ["--gc-interval", "1", "--probe-interval-ms", "200"];
    let mut agent = Agent::start_node("n1", &registry, &flags);
    let model = Model::new();

    // Fill: FILL answered adds, no kill.
    {
        let socket = agent.cni_socket.clone();
        let m = Arc::clone(&model);
        let mut fill_rng = Rng::new(seed ^ 0x5eed);
        rt.block_on(async move {
            drive(socket, m, &mut fill_rng, |m| {
                m.set(Known::Present).len() as u64 >= FILL
            })
            .await
        });
        assert!(model.violations().is_empty(), "{:?}", model.violations());
    }

    let mut total_ops = 0;
    let mut kills = Vec::new();
    for round in 0..ROUNDS {
        // Churn for a random short time, then SIGKILL with operations in flight.
        let xds = Arc::new(Mutex::new(XdsLog::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let recorder = rt.spawn(record_xds(
            agent.xds_target(),
            Arc::clone(&xds),
            Arc::new(AtomicBool::new(false)),
        ));
        let before = model.started.load(Ordering::Relaxed);
        let driver = {
            let socket = agent.cni_socket.clone();
            let m = Arc::clone(&model);
            let stop = Arc::clone(&stop);
            let mut round_rng = Rng::new(rng.next_u64());
            rt.spawn(async move {
                drive(socket, m, &mut round_rng, |_| stop.load(Ordering::SeqCst)).await
            })
        };
        let kill_after = Duration::from_millis(50 + rng.below(351));
        std::thread::sleep(kill_after); // the random kill point, on purpose
        stop.store(true, Ordering::SeqCst);
        let in_flight = model.in_flight.load(Ordering::SeqCst);
        agent.kill9();
        rt.block_on(driver).unwrap();
        recorder.abort();
        let churn_log = xds.lock().unwrap().clone();
        assert!(
            churn_log.violations.is_empty(),
            "xDS during the churn: {}",
            churn_log.violations.join("\n")
        );
        let ops = model.started.load(Ordering::Relaxed) - before;
        total_ops += ops;
        let unknown = model.set(Known::Unknown);
        kills.push((kill_after, ops, in_flight));
        println!(
            "round {round:2}: SIGKILL after {kill_after:?}, {ops} ops, {in_flight} in flight, \
             {} unknown keys",
            unknown.len()
        );
        let violations = model.violations();
        assert!(
            violations.is_empty(),
            "answers contradict the model:\n{}",
            violations.join("\n")
        );

        // Restart on the same state and registry file.
        agent.respawn("n1", &registry, &flags);
        agent.wait_ready(common::WAIT);
        assert_nothing_quarantined(&agent, "after SIGKILL");
        let corrupt: Vec<_> = std::fs::read_dir(work.path())
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.contains("corrupt"))
            .collect();
        assert!(corrupt.is_empty(), "registry file torn: {corrupt:?}");

        // One orphan-GC pass: CNI GC with the runtime's view (acknowledged + unknown),
        // three sweeps for the planner's confirmation.
        let present = model.set(Known::Present);
        let valid: BTreeSet<usize> = present.union(&unknown).copied().collect();
        let (agreed, removed) = gc_and_settle(&rt, &agent, Some(&valid), &present, &unknown);
        let trips = metric(&agent, "flock_agent_gc_breaker_trips_total");
        assert_eq!(trips, 0, "the GC breaker tripped");
        println!(
            "          restarted: {} pods ({} acknowledged, {} of {} unknown kept), GC removed {removed}",
            agreed.len(),
            present.len(),
            agreed.intersection(&unknown).count(),
            unknown.len()
        );
        // The unknown keys are decided now: the agent's state is the truth for them.
        {
            let mut keys = model.keys.lock().unwrap();
            for k in &unknown {
                keys[*k] = if agreed.contains(k) {
                    Known::Present
                } else {
                    Known::Absent
                };
            }
        }
    }
    let in_flight: Vec<usize> = kills.iter().map(|k| k.2).collect();
    println!(
        "{} kills, {total_ops} ops in the rounds (+{FILL} fill), in flight at the kills: {in_flight:?}; \
         wall time {:.2?}",
        kills.len(),
        started.elapsed()
    );
    assert!(kills.len() >= 20);
    assert!(
        in_flight.iter().filter(|n| **n > 0).count() >= 20,
        "operations were in flight at 20+ kills"
    );
}
