//! R8 at the file: two supervisors heartbeat into the same state file. The older
//! epoch's writer reads the record and decides to refresh it; before it writes, the
//! newer epoch's writer records its takeover. Under the exclusive lock the newer writer
//! must wait until the older one has written, then read that and write over it, so
//! the file ends at the newer epoch. Without the lock (mutant `r8-lock`) the newer
//! record lands in between and the older writer, acting on what it read, overwrites it:
//! the file regresses.
//!
//! Deterministic either way: the older writer pauses inside its decision (between its
//! read and its write) until the newer writer has finished, or for 500 ms. With the
//! lock the newer writer cannot finish meanwhile, so the pause always ends by its
//! timeout; without it the newer writer always finishes inside the pause.

use std::sync::mpsc;
use std::time::Duration;

use flock_core::UnixMs;
use flock_core::epoch::{EpochRecord, WriteDecision, WriterId, write_decision};
use flock_hotrestart::statefile::StateDir;

const NOW: UnixMs = UnixMs(1_764_400_000_000);
const MAX_AGE: u64 = 5_000;

fn rec(epoch: u32, writer: &str) -> EpochRecord {
    EpochRecord::new(epoch, 7, UnixMs::ZERO, WriterId::new(writer).unwrap())
}

#[test]
fn a_newer_epoch_written_while_an_older_writer_decides_is_never_overwritten() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = StateDir::open(tmp.path()).unwrap();
    // Epoch 3 is recorded and LIVE.
    let (_, first) = dir
        .locked_update(|on_disk| write_decision(on_disk, &rec(3, "old"), true, NOW, MAX_AGE))
        .unwrap();
    assert!(matches!(first, WriteDecision::Write { .. }));

    let (read_tx, read_rx) = mpsc::channel::<()>();
    let (done_tx, done_rx) = mpsc::channel::<()>();
    std::thread::scope(|s| {
        let old_dir = dir.clone();
        let old = s.spawn(move || {
            let mut newer_landed = false;
            let result = old_dir.locked_update(|on_disk| {
                // Decided on what it read: refresh its own fresh record.
                let d = write_decision(on_disk, &rec(3, "old"), true, NOW.plus(1_000), MAX_AGE);
                assert!(matches!(d, WriteDecision::Write { .. }), "{d}");
                read_tx.send(()).unwrap();
                // The test hook: pause between the read and the write.
                newer_landed = done_rx.recv_timeout(Duration::from_millis(500)).is_ok();
                d
            });
            result.map(|(_, d)| (d, newer_landed))
        });
        let new_dir = dir.clone();
        let new = s.spawn(move || {
            read_rx.recv().unwrap();
            // Epoch 4 became LIVE and takes the file over.
            let result = new_dir.locked_update(|on_disk| {
                write_decision(on_disk, &rec(4, "new"), true, NOW.plus(1_100), MAX_AGE)
            });
            let _ = done_tx.send(());
            result
        });
        let (old_decision, newer_landed_in_between) = old.join().unwrap().unwrap();
        let (new_saw, new_decision) = new.join().unwrap().unwrap();
        assert!(matches!(old_decision, WriteDecision::Write { .. }));
        assert!(
            !newer_landed_in_between,
            "the newer writer finished while the older one held the file between its read \
             and its write: the lock did not make it wait"
        );
        // The newer writer read the older writer's refresh, and wrote over it.
        assert_eq!(
            new_saw.record().map(|r| r.heartbeat_unix_ms),
            Some(NOW.plus(1_000))
        );
        assert!(
            matches!(new_decision, WriteDecision::Write { .. }),
            "{new_decision}"
        );
    });
    let on_disk = dir.read().unwrap();
    assert_eq!(
        on_disk.record().map(|r| r.epoch),
        Some(4),
        "the state file regressed: {on_disk:?}"
    );
}
