//! Soak: pod churn through the real agent's CNI socket (the plugin's own client,
//! [`IN_FLIGHT`] operations at a time over [`KEYS`] pods) on a real etcd registry
//! (`FLOCK_ETCD_BIN`, `--registry-ttl 2`), with the dependencies killed in turn: each
//! round churns for a period, and either etcd is SIGKILLed in the middle of it and
//! started again on the same data a few seconds later (churn going on), or, every
//! third round, the agent itself is SIGKILLed with operations in flight and started
//! again on the same state (then one orphan-GC pass with the runtime's view, as the
//! kubelet's CNI GC would).
//!
//! After every round: the store, `/debug/pods`, the registry (the agent's etcd view)
//! and a real Delta xDS client agree, with every acknowledged pod and no acknowledged
//! removal (after an etcd round without any GC: the registry sync alone converges); during an etcd round no CNI operation fails or goes unanswered (the
//! registry is off the CNI path); nothing is quarantined. Every round prints
//! operations, failures, the agent's RSS and open file descriptors; at the end the
//! figures per agent process (RSS and fds first and last: flat means no leak).
//!
//! `FLOCK_SOAK_SECS` sets the length (default 60: the short variant `scripts/test`
//! runs; `scripts/soak` runs 30 minutes). `FLOCK_CHURN_SEED` overrides the seed.

mod churnkit;
mod common;

use churnkit::*;
use common::{Agent, Etcd};
use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Churn per round.
const PERIOD: Duration = Duration::from_secs(4);
/// How long etcd stays down in an etcd round: longer than the lease TTL (2 s), so
/// the other side of the registry sees this node's leases expire.
const ETCD_DOWN: Duration = Duration::from_secs(3);

/// One sample of the agent process after a round.
struct Sample {
    at: Duration,
    incarnation: usize,
    rss_kib: u64,
    fds: usize,
}

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("VmRSS:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        })
        .unwrap_or(0)
}

fn fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count())
}

fn soak_seconds() -> u64 {
    match std::env::var("FLOCK_SOAK_SECS") {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("FLOCK_SOAK_SECS={v:?}: not a number of seconds")),
        Err(_) => 60,
    }
}

#[test]
fn churn_with_agent_and_etcd_kills_loses_nothing_and_leaks_nothing() {
    let length = Duration::from_secs(soak_seconds());
    let seed = seed(0x50a1_c0de_0000_0016);
    println!("soak: {length:?}, seed {seed:#x} (FLOCK_CHURN_SEED overrides)");
    let started = Instant::now();
    let ns = common::NetNs::new("soak");
    set_netns(ns.path());
    let mut rng = Rng::new(seed);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut etcd = Etcd::start();
    let registry = etcd.registry_spec();
    let flags = [
        "--gc-interval",
        "1",
        "--probe-interval-ms",
        "200",
        "--registry-ttl",
        "2",
    ];
    let mut agent = Agent::start_node("n1", &registry, &flags);
    let model = Model::new();
    let mut samples = Vec::new();
    let mut incarnation = 0;
    let (mut agent_kills, mut etcd_kills, mut total_ops) = (0, 0, 0u64);
    let mut round = 0;
    while started.elapsed() < length || round < 3 {
        let agent_round = round % 3 == 2;
        let xds = Arc::new(Mutex::new(XdsLog::default()));
        let recorder = rt.spawn(record_xds(
            agent.xds_target(),
            Arc::clone(&xds),
            Arc::new(AtomicBool::new(false)),
        ));
        let (ops0, unanswered0) = (
            model.started.load(Ordering::Relaxed),
            model.no_answer.load(Ordering::Relaxed),
        );
        let stop = Arc::new(AtomicBool::new(false));
        let driver = {
            let socket = agent.cni_socket.clone();
            let m = Arc::clone(&model);
            let stop = Arc::clone(&stop);
            let mut round_rng = Rng::new(rng.next_u64());
            rt.spawn(async move {
                drive(socket, m, &mut round_rng, |_| stop.load(Ordering::SeqCst)).await
            })
        };
        let fault = if agent_round {
            // The kill point is random on purpose (as in the crash test).
            let kill_after = Duration::from_millis(200 + rng.below(PERIOD.as_millis() as u64));
            std::thread::sleep(kill_after);
            stop.store(true, Ordering::SeqCst);
            agent.kill9();
            rt.block_on(driver).unwrap();
            recorder.abort();
            agent_kills += 1;
            format!("agent SIGKILL after {kill_after:.1?}")
        } else {
            // The fault's schedule: churn, etcd down for ETCD_DOWN, churn.
            std::thread::sleep(PERIOD / 2);
            etcd.kill9();
            std::thread::sleep(ETCD_DOWN);
            etcd.restart();
            std::thread::sleep(PERIOD / 2);
            stop.store(true, Ordering::SeqCst);
            rt.block_on(driver).unwrap();
            recorder.abort();
            etcd_kills += 1;
            format!("etcd SIGKILL for {ETCD_DOWN:?}")
        };
        let log = xds.lock().unwrap().clone();
        assert!(
            log.violations.is_empty(),
            "round {round} ({fault}): xDS during the churn: {}",
            log.violations.join("\n")
        );
        let violations = model.violations();
        assert!(
            violations.is_empty(),
            "round {round} ({fault}): answers contradict the model:\n{}",
            violations.join("\n")
        );
        let ops = model.started.load(Ordering::Relaxed) - ops0;
        let unanswered = model.no_answer.load(Ordering::Relaxed) - unanswered0;
        total_ops += ops;
        if !agent_round {
            assert_eq!(
                unanswered, 0,
                "round {round}: CNI operations went unanswered while only etcd was down"
            );
        }
        let unknown = model.set(Known::Unknown);
        if agent_round {
            agent.respawn("n1", &registry, &flags);
            agent.wait_ready(common::WAIT);
            incarnation += 1;
        }
        assert_nothing_quarantined(&agent, &format!("after round {round}"));

        // After an etcd round nothing is left for the GC: the registry sync alone must
        // bring the registry back to exactly the live pods. After an agent kill, the
        // runtime's CNI GC (acknowledged + unknown are valid) decides the operations
        // that were in flight.
        let present = model.set(Known::Present);
        let valid: BTreeSet<usize> = present.union(&unknown).copied().collect();
        let converge = Instant::now();
        let (agreed, removed) = gc_and_settle(
            &rt,
            &agent,
            agent_round.then_some(&valid),
            &present,
            &unknown,
        );
        let converged = converge.elapsed();
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
        let pid = agent.proc.pid();
        let sample = Sample {
            at: started.elapsed(),
            incarnation,
            rss_kib: rss_kib(pid),
            fds: fds(pid),
        };
        println!(
            "t={:6.1}s round {round:3} {fault:28} {ops:5} ops, {unanswered:2} unanswered \
             (agent down), agreed on {:3} pods in {converged:.2?} (GC removed {removed}); \
             agent #{incarnation}: RSS {} KiB, {} fds",
            sample.at.as_secs_f64(),
            agreed.len(),
            sample.rss_kib,
            sample.fds
        );
        samples.push(sample);
        round += 1;
    }

    println!(
        "soak done: {round} rounds in {:.1?}, {total_ops} CNI operations, {agent_kills} agent \
         kills, {etcd_kills} etcd kills, 0 contradictions, every round agreed",
        started.elapsed()
    );
    println!("agent #  rounds  RSS KiB first → last   fds first → last");
    for i in 0..=incarnation {
        let mine: Vec<&Sample> = samples.iter().filter(|s| s.incarnation == i).collect();
        let (Some(first), Some(last)) = (mine.first(), mine.last()) else {
            continue;
        };
        println!(
            "{i:7}  {:6}  {:7} → {:7}   {:5} → {:5}",
            mine.len(),
            first.rss_kib,
            last.rss_kib,
            first.fds,
            last.fds
        );
        // A leak of one descriptor per operation or per round shows as growth far
        // beyond the connection churn's noise; the bound is loose on purpose.
        assert!(
            last.fds <= first.fds * 2 + 64,
            "agent #{i}: open fds grew from {} to {} over {} rounds",
            first.fds,
            last.fds,
            mine.len()
        );
    }
}
