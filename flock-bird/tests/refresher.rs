//! The registry refresher's timing on a paused tokio clock: a burst of changes
//! publishes once, a quiet period after its last change; an identity change alone
//! publishes too; a stream of changes that never goes quiet still publishes at the
//! cap (2 quiet periods after the first change of the burst); stop ends the loop.

use flock_bird::runtime::refresh_loop;
use flock_core::MonoMs;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::sleep;

#[tokio::test(start_paused = true)]
async fn bursts_publish_once_after_the_quiet_period_and_streams_at_the_cap() {
    let (view_tx, view_rx) = watch::channel(0u32);
    let (id_tx, id_rx) = watch::channel(0u32);
    let (stop_tx, stop_rx) = watch::channel(false);
    let published: Arc<Mutex<Vec<MonoMs>>> = Arc::default();
    let p = Arc::clone(&published);
    let start = flock_clock::mono_now();
    let task = tokio::spawn(refresh_loop(
        view_rx,
        Some(id_rx),
        Duration::from_millis(100),
        move || p.lock().unwrap().push(flock_clock::mono_now()),
        stop_rx,
    ));
    let at = || -> Vec<u64> {
        published
            .lock()
            .unwrap()
            .iter()
            .map(|t| t.since(start))
            .collect()
    };

    // A burst: changes at 0, 30 and 60 ms; one publish at 60 + 100.
    for _ in 0..3 {
        view_tx.send_modify(|v| *v += 1);
        sleep(Duration::from_millis(30)).await;
    }
    sleep(Duration::from_millis(500)).await; // now 590
    assert_eq!(at(), [160]);

    // An identity change alone (at 590).
    id_tx.send_modify(|v| *v += 1);
    sleep(Duration::from_millis(500)).await; // now 1090
    assert_eq!(at(), [160, 690]);

    // A change every 30 ms from 1090 to 2860: each burst is cut at its cap (its
    // first change + 200: 1090 → 1290, 1300 → 1500, ...); the last, from 2770, ends
    // 100 ms after the last change (2960, before its cap at 2970).
    for _ in 0..60 {
        view_tx.send_modify(|v| *v += 1);
        sleep(Duration::from_millis(30)).await;
    }
    sleep(Duration::from_millis(500)).await;
    assert_eq!(
        at(),
        [
            160, 690, 1290, 1500, 1710, 1920, 2130, 2340, 2550, 2760, 2960
        ]
    );

    stop_tx.send(true).unwrap();
    tokio::time::timeout(Duration::from_secs(1), task)
        .await
        .expect("the loop stops")
        .unwrap();
    assert_eq!(at().len(), 11, "nothing published after stop");
}

#[tokio::test(start_paused = true)]
async fn the_loop_ends_when_the_registry_view_is_gone() {
    let (view_tx, view_rx) = watch::channel(());
    let (_stop_tx, stop_rx) = watch::channel(false);
    let task = tokio::spawn(refresh_loop::<(), ()>(
        view_rx,
        None,
        Duration::from_millis(100),
        || {},
        stop_rx,
    ));
    drop(view_tx);
    tokio::time::timeout(Duration::from_secs(1), task)
        .await
        .expect("the loop ends")
        .unwrap();
}
