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

mod common;

use std::fs;
use std::sync::Arc;
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
        },
    );
    let daemon = std::thread::spawn(move || install::run(config));

    // Readiness is declared only once the first scan has been handled in full.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !ready.exists() {
        assert!(
            !daemon.is_finished(),
            "the daemon stopped: {:?}",
            daemon.join()
        );
        assert!(Instant::now() < deadline, "never became ready");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(hook_calls.load(std::sync::atomic::Ordering::SeqCst), 1);
    assert!(patched(&conf.join("10-before.conflist")));
    assert!(
        patched(&gap_file),
        "the config created between arming the watch and the scan was missed: {}",
        fs::read_to_string(&gap_file).unwrap_or_default()
    );

    // Removing the directory is fatal for the daemon (it never runs unwatched): that
    // ends it, after it restored what it could.
    fs::remove_dir_all(&conf).unwrap();
    let result = daemon.join().unwrap();
    let err = result.expect_err("the daemon must stop when its directory goes away");
    assert!(err.0.contains("removed or moved away"), "{err}");
    assert!(!ready.exists(), "ready file left behind");
}
