//! Failpoints: the real `flock-agent` killed (SIGKILL) at each named step of AddPod,
//! RemovePod, the orphan-GC sweep and the registry sync in turn, deterministically: the
//! test binary's agent is built with flock-bird's test-only `fault-injection`
//! failpoints (flock-bird `agent/fault.rs`), and the test arms one point at a time by
//! writing its name into `<state-dir>/failpoint`; the agent removes the file and kills
//! itself the first time it reaches that point (or stops itself, for the points armed
//! with ` stop`: the runtime's call times out, then the hung agent is SIGKILLed). The
//! agent log must show that it died there.
//!
//! After each kill the agent is started again on the same state (`--registry file:`, so
//! the registry survives it as in the crash test), and the runtime does what the CNI
//! spec makes it do with the call that got no answer (an ADD that failed is DELeted, a
//! DEL is retried, a GC is retried), then one CNI GC with the runtime's pods. Then the
//! store, `/debug/pods`, the registry and a real Delta xDS client agree on exactly the
//! acknowledged pods: none lost, no ghost endpoint; the agent holds exactly one identity
//! subscription per pod (none leaked); nothing is quarantined.

mod churnkit;
mod common;

use churnkit::*;
use common::{Agent, wait_for};
use flock_cni::client;
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

/// What the runtime does to reach a failpoint.
#[derive(Clone, Copy, Debug)]
enum Trigger {
    /// ADD a new pod.
    Add,
    /// DEL an acknowledged pod.
    Remove,
    /// CNI GC (three sweeps: the planner's confirmation) without one acknowledged pod.
    Gc,
    /// An orphan endpoint first (a kill right after a DEL's store delete leaves the
    /// pod's endpoint in the registry without its record), then CNI GC.
    GcEndpoint,
}

/// Every failpoint, with what reaches it.
const POINTS: &[(&str, Trigger)] = &[
    ("add/start", Trigger::Add),
    ("add/StoreWrite", Trigger::Add),
    ("add/CaptureApply", Trigger::Add),
    ("add/IdentitySubscribe", Trigger::Add),
    ("add/XdsPublish", Trigger::Add),
    ("add/RegistryRegister", Trigger::Add),
    ("regsync/put", Trigger::Add),
    ("remove/start", Trigger::Remove),
    ("remove/StoreDelete", Trigger::Remove),
    ("remove/XdsWithdraw", Trigger::Remove),
    ("remove/RegistryUnregister", Trigger::Remove),
    ("remove/IdentityUnsubscribe", Trigger::Remove),
    ("remove/CaptureRemove", Trigger::Remove),
    ("regsync/delete", Trigger::Remove),
    ("gc/planned", Trigger::Gc),
    ("gc/pod-removed", Trigger::Gc),
    ("gc/endpoint-removed", Trigger::GcEndpoint),
    // Stopped instead of killed (` stop`): an agent that hangs mid-operation. The
    // plugin's call times out; the agent is then SIGKILLed, as a hung agent is by its
    // liveness probe.
    ("add/XdsPublish stop", Trigger::Add),
    ("remove/RegistryUnregister stop", Trigger::Remove),
];

/// How long the runtime's call waits for a stopped agent.
const STOPPED_CALL: Duration = Duration::from_secs(2);

/// The runtime's call on `k` for `point`: a short timeout when the point stops the
/// agent (it never answers), the CNI driver's otherwise.
async fn call_for(point: &str, socket: &std::path::Path, k: usize, op: Op) -> Reply {
    if !point.ends_with(" stop") {
        return call(socket, k, op).await;
    }
    let r = match op {
        Op::Add => {
            let req = add_request(k);
            client::call(
                socket,
                STOPPED_CALL,
                |mut c| async move { c.add_pod(req).await },
            )
            .await
        }
        Op::Remove => {
            let req = remove_request(k);
            client::call(socket, STOPPED_CALL, |mut c| async move {
                c.remove_pod(req).await
            })
            .await
        }
    };
    match r {
        Ok(resp) => panic!("{point}: a stopped agent answered: {resp:?}"),
        Err(e) => Reply::NoAnswer(e.to_string()),
    }
}

/// Acknowledged pods before the first kill: enough that one GC removal stays under the
/// GC breaker's 25 % after the DEL rounds.
const FILL: usize = 14;

/// Arms `point` (the agent reads the file at every failpoint).
fn arm(agent: &Agent, point: &str) {
    std::fs::write(agent.state_dir.join("failpoint"), point).unwrap();
}

/// Waits until the agent died at `point` (a stopped one is SIGKILLed once stopped).
fn died_at(agent: &mut Agent, point: &str) {
    if let Some(name) = point.strip_suffix(" stop") {
        let pid = agent.proc.pid();
        wait_for(
            &format!("the agent stopped at {name}"),
            common::WAIT,
            || {
                std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
                    s.rsplit_once(") ")
                        .is_some_and(|(_, rest)| rest.starts_with('T'))
                })
            },
        );
        agent.kill9();
    }
    let point = point.strip_suffix(" stop").unwrap_or(point);
    wait_for(
        &format!("the agent killed at {point}"),
        common::WAIT,
        || !agent.proc.running(),
    );
    assert!(
        !agent.state_dir.join("failpoint").exists(),
        "{point}: the failpoint file was not consumed"
    );
    let log = agent.proc.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("failpoint reached") && l.contains(point)),
        "{point}: the agent died, but not at the failpoint:\n{log}"
    );
}

#[test]
fn a_kill_at_every_named_step_loses_nothing_and_leaks_nothing() {
    let ns = common::NetNs::new("failpoints");
    set_netns(ns.path());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let work = tempfile::Builder::new()
        .prefix("flock-failpoints-")
        .tempdir()
        .unwrap();
    let registry = format!("file:{}", work.path().join("registry.json").display());
    // No periodic sweep: only the runtime's CNI GC sweeps, so a gc/* point fires
    // where the test expects it.
    let flags = ["--gc-interval", "86400"];
    let mut agent = Agent::start_node("n1", &registry, &flags);
    let mut present = BTreeSet::new();
    for k in 0..FILL {
        let reply = rt.block_on(call(&agent.cni_socket, k, Op::Add));
        assert_eq!(reply, Reply::Success, "fill ADD {k}");
        present.insert(k);
    }
    let mut next = FILL;
    let started = Instant::now();
    for &(point, trigger) in POINTS {
        let round = Instant::now();
        let socket = agent.cni_socket.clone();
        // The key the runtime's call is about, and whether that call was answered.
        let (k, answered) = match trigger {
            Trigger::Add => {
                let k = next;
                next += 1;
                arm(&agent, point);
                (k, rt.block_on(call_for(point, &socket, k, Op::Add)))
            }
            Trigger::Remove => {
                let k = *present.first().unwrap();
                arm(&agent, point);
                (k, rt.block_on(call_for(point, &socket, k, Op::Remove)))
            }
            Trigger::Gc | Trigger::GcEndpoint => {
                let k = *present.first().unwrap();
                if let Trigger::GcEndpoint = trigger {
                    arm(&agent, "remove/StoreDelete");
                    let r = rt.block_on(call(&socket, k, Op::Remove));
                    assert!(matches!(r, Reply::NoAnswer(_)), "{point}: {r:?}");
                    died_at(&mut agent, "remove/StoreDelete");
                    agent.respawn("n1", &registry, &flags);
                    agent.wait_ready(common::WAIT);
                }
                arm(&agent, point);
                let valid: BTreeSet<usize> = present.iter().copied().filter(|p| *p != k).collect();
                let mut answered = Reply::Success;
                for _ in 0..3 {
                    if rt.block_on(try_cni_gc(&agent.cni_socket, &valid)).is_err() {
                        answered = Reply::NoAnswer("GC".into());
                        break;
                    }
                }
                (k, answered)
            }
        };
        died_at(&mut agent, point);
        agent.respawn("n1", &registry, &flags);
        agent.wait_ready(common::WAIT);

        // The runtime's side of the call that got no answer.
        let socket = agent.cni_socket.clone();
        match (trigger, &answered) {
            (Trigger::Add, Reply::Success) => {
                present.insert(k);
            }
            (Trigger::Add, _) => {
                // A failed ADD is DELeted (CNI spec).
                let r = rt.block_on(call(&socket, k, Op::Remove));
                assert!(
                    matches!(r, Reply::Success | Reply::Ignored),
                    "{point}: the DEL of the failed ADD: {r:?}"
                );
            }
            (Trigger::Remove, _) => {
                // A DEL is retried until it succeeds.
                let r = rt.block_on(call(&socket, k, Op::Remove));
                assert!(
                    matches!(r, Reply::Success | Reply::Ignored),
                    "{point}: the retried DEL: {r:?}"
                );
                present.remove(&k);
            }
            (Trigger::Gc | Trigger::GcEndpoint, _) => {
                present.remove(&k);
            }
        }
        if let Trigger::GcEndpoint = trigger {
            // The DEL whose answer the first kill swallowed, retried.
            let r = rt.block_on(call(&socket, k, Op::Remove));
            assert!(
                matches!(r, Reply::Success | Reply::Ignored),
                "{point}: {r:?}"
            );
        }
        // One CNI GC with the runtime's pods (three sweeps: the planner confirms).
        let (agreed, removed) =
            gc_and_settle(&rt, &agent, Some(&present), &present, &BTreeSet::new());
        assert_eq!(agreed, present, "{point}: the agreed pods");
        let subscriptions = metric(&agent, "flock_identity_subscriptions");
        assert_eq!(
            subscriptions,
            present.len() as u64,
            "{point}: identity subscriptions (one per pod)"
        );
        assert_nothing_quarantined(&agent, point);
        println!(
            "{point:30} reached; the call: {:?}; restarted, GC removed {removed}; store, \
             /debug/pods, registry and xDS agree on {} pods, {subscriptions} identity \
             subscriptions ({:.2?})",
            match &answered {
                Reply::NoAnswer(_) => "no answer".to_string(),
                other => format!("{other:?}"),
            },
            agreed.len(),
            round.elapsed()
        );
    }
    println!(
        "{} failpoints, each a kill and a restart, in {:.1?}",
        POINTS.len(),
        started.elapsed()
    );
}

/// Without `FLOCK_FAULT_INJECTION=1` at start the failpoints are not looked at: an
/// agent of this same fault-injection build, with `add/start` armed, answers the ADD
/// and lives (what the benchmarks rely on to measure a release build's agent).
#[test]
fn an_agent_started_without_fault_injection_ignores_an_armed_failpoint() {
    let ns = common::NetNs::new("failpoints-off");
    set_netns(ns.path());
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let mut agent = Agent::start_node_env(
        "n1",
        "memory",
        &[],
        &[("FLOCK_FAULT_INJECTION", std::ffi::OsStr::new("0"))],
    );
    arm(&agent, "add/start");
    let reply = rt.block_on(call(&agent.cni_socket, 0, Op::Add));
    assert_eq!(reply, Reply::Success, "the ADD with add/start armed");
    assert!(
        agent.proc.running(),
        "the agent died at an unarmed failpoint"
    );
    assert!(
        agent.state_dir.join("failpoint").exists(),
        "the agent consumed the failpoint file"
    );
}
