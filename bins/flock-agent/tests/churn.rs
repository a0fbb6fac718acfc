//! Churn: at least 1,000 AddPod/RemovePod operations, 32 at a time, through
//! the real CNI gRPC API of the real `flock-agent` process, while its liveness probes
//! (every 200 ms; they fail, so health transitions re-register endpoints under churn),
//! registry refresher and orphan GC (every second) run. At the end the store files,
//! `/debug/pods`, the registry and the served snapshot (names in `/debug/snapshot`, and
//! the listeners and ClusterLoadAssignments an xDS client received) agree exactly with
//! the pods the test acknowledged: no ghost endpoint, no lost pod. The xDS client
//! (Delta ADS as an Envoy node, LDS/CDS/EDS wildcard, every response ACKed) sees
//! strictly increasing versions per type throughout — except that flock-xds, by
//! design (make-before-break ordering, `flock_xds::protocol::order`), may send one
//! snapshot's adds/changes and its removals of a type as two responses with the same
//! version; exactly that one repeat is allowed and counted.
//!
//! "No leaked subscriptions": workload identity is not implemented yet (the agent's
//! `IdentitySubscribe`/`IdentityUnsubscribe` steps are no-ops), so there is nothing to
//! leak and nothing to check here; this test grows that check when identity lands.
//!
//! The operations are drawn from a fixed seed (`FLOCK_CHURN_SEED` overrides it; the
//! seed is printed) — see `churnkit` for the pods and the model.

mod churnkit;
mod common;

use churnkit::*;
use common::Agent;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const OPS: u64 = 1_000;
/// Churn at least this long, so the resident pods (`churnkit::RESIDENTS`, added first
/// and never touched again) outlive the agent's 10 s probe warm-up and their failing
/// probes turn them unhealthy (re-registration) while the churn goes on.
const MIN_CHURN: Duration = Duration::from_secs(15);

#[test]
fn a_thousand_adds_and_removes_32_at_a_time_leave_store_registry_and_xds_in_exact_agreement() {
    let seed = seed(0x00f1_0c4c_4a2e_5eed);
    println!("churn seed: {seed:#x} (FLOCK_CHURN_SEED overrides)");
    let started = Instant::now();
    let ns = common::NetNs::new("churn");
    set_netns(ns.path());
    let agent = Agent::start_node(
        "n1",
        "memory",
        &["--gc-interval", "1", "--probe-interval-ms", "200"],
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    let xds = Arc::new(Mutex::new(XdsLog::default()));
    let xds_stop = Arc::new(AtomicBool::new(false));
    let recorder = rt.spawn(record_xds(
        agent.xds_target(),
        Arc::clone(&xds),
        Arc::clone(&xds_stop),
    ));

    let model = Model::new();
    let churn_start = Instant::now();
    let socket = agent.cni_socket.clone();
    let m = Arc::clone(&model);
    rt.block_on(async move {
        // Residents first: pods that outlive the probe warm-up, whatever the pace.
        add_residents(&socket, &m).await;
        let mut rng = Rng::new(seed);
        drive(socket, m, &mut rng, |m| {
            m.started.load(Ordering::Relaxed) >= OPS && churn_start.elapsed() >= MIN_CHURN
        })
        .await;
    });
    let churn = churn_start.elapsed();
    let ops = model.started.load(Ordering::Relaxed);
    let rate = ops as f64 / churn.as_secs_f64();
    println!(
        "churn: {ops} operations in {churn:.2?} ({rate:.0} ops/s, {IN_FLIGHT} in flight), \
         {} pods present at the end",
        model.set(Known::Present).len()
    );
    assert!(ops >= OPS);
    assert_eq!(
        model.no_answer.load(Ordering::Relaxed),
        0,
        "calls got no answer"
    );
    let violations = model.violations();
    assert!(
        violations.is_empty(),
        "answers contradict the model:\n{}",
        violations.join("\n")
    );

    // Quiescence: everything agrees and the snapshot version stays put for 3 × the
    // refresh debounce (100 ms).
    let present = model.set(Known::Present);
    let agreed = settle(
        &agent,
        &xds,
        &present,
        &Default::default(),
        Duration::from_millis(300),
        Duration::from_secs(30),
    );
    assert_eq!(agreed, present);
    assert_eq!(agent.store_files().len(), present.len());

    xds_stop.store(true, Ordering::Relaxed);
    rt.block_on(recorder).unwrap();
    let log = xds.lock().unwrap().clone();
    assert!(
        log.violations.is_empty(),
        "xDS: {}",
        log.violations.join("\n")
    );
    assert!(log.ended.is_none(), "the xDS stream ended: {:?}", log.ended);
    println!(
        "xDS: {} responses, {} make/break halves repeating a version",
        log.responses, log.split_responses
    );
    for (t, v) in &log.versions {
        println!(
            "xDS {}: {} responses, versions {}..{}",
            flock_xds::types::short_name(t),
            v.len(),
            v.first().unwrap(),
            v.last().unwrap()
        );
    }
    assert!(
        log.versions.len() == 3,
        "responses for LDS, CDS and EDS: {:?}",
        log.versions.keys()
    );

    let health_changes = metric(&agent, "flock_agent_health_changes_total");
    let gc_sweeps = metric(&agent, "flock_agent_gc_sweeps_total");
    let undos = metric(&agent, "flock_agent_guard_undos_total");
    let gc_endpoints = metric(&agent, "flock_agent_gc_removed_endpoints_total");
    let trips = metric(&agent, "flock_agent_gc_breaker_trips_total");
    println!(
        "agent: {health_changes} health changes, {undos} guarded re-registrations undone, \
         {gc_sweeps} GC sweeps ({gc_endpoints} endpoints removed, {trips} breaker trips); \
         wall time {:.2?}",
        started.elapsed()
    );
    assert!(gc_sweeps >= 5, "the GC ran during the churn");
    assert!(
        health_changes > 0,
        "liveness transitions happened during the churn"
    );
    assert_eq!(
        gc_endpoints, 0,
        "the GC found orphans while the agent ran (a lost guard?)"
    );
    assert_eq!(trips, 0);
}
