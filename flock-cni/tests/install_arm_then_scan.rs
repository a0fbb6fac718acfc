//! The installer's startup order on a real directory with real inotify: the watch is
//! armed *before* the directory is listed for the first scan, so a config created
//! between the two steps is still patched.
//!
//! The gap between the two steps is microseconds wide in a real run; a test hook of
//! the daemon runs exactly inside it and creates the config there, every run. With
//! the right order the file is both reported by the armed watch and in the listing.
//! With the order swapped (mutant `install-scan-before-arm`: list, then arm) it is in
//! neither: the daemon declares itself ready without it, and the assertion below fails
//! at once rather than after a timeout. The periodic rescan, which would repair it
//! much later, is set to an hour.
//!
//! The second half of the rule: a config created after the listing was taken, but
//! before the listing reaches the machine, is in no listing; only its event tells.
//! A second hook runs in that window; the config is moved in (one event), and the hook
//! returns only once the watch has queued that event, so the event loop receives it
//! before the listing, every run. With the machine dropping events that arrive before
//! the listing (mutant `installer-drops-early-events`) the config is never patched
//! and the daemon becomes ready without it.

mod common;

use std::fs;
use std::path::Path;
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use common::{conflist, patched};
use flock_cni::install::{self, Hooks};

#[test]
fn a_config_created_between_arming_the_watch_and_the_scan_is_patched() {
    let d = common::dirs();
    let (conf, ready) = (d.conf.clone(), d.ready.clone());
    // One config before the start, so the daemon can become ready without the other.
    fs::write(conf.join("10-before.conflist"), conflist("before")).unwrap();
    let gap_file = conf.join("50-in-the-gap.conflist");
    let hook_calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let hook = {
        let gap_file = gap_file.clone();
        let calls = hook_calls.clone();
        Arc::new(move || {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            fs::write(&gap_file, conflist("gap")).unwrap();
        })
    };
    let config = common::config(
        &d,
        Duration::from_secs(3_600),
        5,
        Duration::from_millis(1_000),
        Hooks {
            between_arm_and_scan: Some(hook),
            ..Hooks::default()
        },
    );
    let daemon = std::thread::spawn(move || install::run(config));

    wait_ready(&ready, &daemon);
    assert_eq!(hook_calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(patched(&conf.join("10-before.conflist")));
    assert!(
        patched(&gap_file),
        "the config created between arming the watch and the scan was missed: {}",
        fs::read_to_string(&gap_file).unwrap_or_default()
    );

    stop(&conf, &ready, daemon);
}

#[test]
fn a_config_created_after_the_listing_and_before_the_machine_has_it_is_patched() {
    let d = common::dirs();
    let (conf, ready) = (d.conf.clone(), d.ready.clone());
    fs::write(conf.join("10-before.conflist"), conflist("before")).unwrap();
    let late_file = conf.join("50-after-the-listing.conflist");
    // Written outside the watched directory, then moved in: one event (MOVED_TO)
    // carries the whole file, so no later event of it can reach the loop after the
    // listing and hide a dropped one.
    let staged = d.tmp.path().join("staged.conflist");
    fs::write(&staged, conflist("late")).unwrap();
    let (queued_tx, queued_rx) = mpsc::channel::<String>();
    let (queued_tx, queued_rx) = (
        std::sync::Mutex::new(queued_tx),
        std::sync::Mutex::new(queued_rx),
    );
    let hook_calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let hook = {
        let (late_file, calls) = (late_file.clone(), hook_calls.clone());
        Arc::new(move || {
            calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            fs::rename(&staged, &late_file).unwrap();
            wait_queued(&queued_rx.lock().unwrap(), &late_file);
        })
    };
    let config = common::config(
        &d,
        Duration::from_secs(3_600),
        5,
        Duration::from_millis(1_000),
        Hooks {
            between_listing_and_listed: Some(hook),
            watch_queued: Some(Arc::new(move |name: &str| {
                let _ = queued_tx.lock().unwrap().send(name.to_owned());
            })),
            ..Hooks::default()
        },
    );
    let daemon = std::thread::spawn(move || install::run(config));

    wait_ready(&ready, &daemon);
    assert_eq!(hook_calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(patched(&conf.join("10-before.conflist")));
    assert!(
        patched(&late_file),
        "the config created after the listing was missed: its event, queued before the \
         listing, was dropped: {}",
        fs::read_to_string(&late_file).unwrap_or_default()
    );
    stop(&conf, &ready, daemon);
}

/// Blocks (on the daemon's thread, inside the hook) until the watch reports that it
/// queued an event of `file`.
fn wait_queued(queued: &mpsc::Receiver<String>, file: &Path) {
    let name = file.file_name().unwrap().to_str().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match queued.recv_timeout(left) {
            Ok(n) if n == name => return,
            Ok(_) => {}
            Err(e) => panic!("the watch never queued an event of {name}: {e}"),
        }
    }
}

/// Waits for the ready file: declared only once the first scan has been handled in
/// full. Fails at once if the daemon stopped.
fn wait_ready(ready: &Path, daemon: &std::thread::JoinHandle<Result<(), install::InstallError>>) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(
            !daemon.is_finished(),
            "the daemon stopped before it became ready"
        );
        assert!(Instant::now() < deadline, "never became ready");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Removing the directory is fatal for the daemon (it never runs unwatched): that
/// ends it, after it restored what it could.
fn stop(
    conf: &Path,
    ready: &Path,
    daemon: std::thread::JoinHandle<Result<(), install::InstallError>>,
) {
    fs::remove_dir_all(conf).unwrap();
    let result = daemon.join().unwrap();
    let err = result.expect_err("the daemon must stop when its directory goes away");
    assert!(err.0.contains("removed or moved away"), "{err}");
    assert!(!ready.exists(), "ready file left behind");
}
