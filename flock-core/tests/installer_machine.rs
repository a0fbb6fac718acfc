#![cfg(not(loom))]
//! The CNI installer's machine, rule by rule: each test feeds events in with an explicit
//! monotonic time and checks the requests and states that come out. The daemon's I/O
//! loop has no other decisions, so its timing (retries, throttling, resync) is tested
//! here, deterministically, by the times passed in.

mod installer_sim;

use flock_core::cniconf::installer::{
    Blocked, DropInDir, Entry, Event, Expect, FileState, Installer, Io, Mode, Notice, Restore,
    WriteKind, WriteOutcome,
};
use flock_core::cniconf::{CniConfError, ConfPolicy, SkipReason, parse_file, semantically_equal};
use flock_core::time::MonoMs;
use installer_sim::*;

fn t(ms: u64) -> MonoMs {
    MonoMs(ms)
}

/// Everything the machine asks for now, without performing any of it.
fn requests(m: &mut Installer) -> Vec<Io> {
    std::iter::from_fn(|| m.poll_io()).collect()
}

fn writes(ios: &[Io]) -> Vec<&flock_core::cniconf::installer::Write> {
    ios.iter()
        .filter_map(|io| match io {
            Io::Write(w) => Some(w),
            _ => None,
        })
        .collect()
}

fn observe(m: &mut Installer, now: MonoMs, name: &str, bytes: &[u8]) -> Vec<Io> {
    m.handle(
        now,
        Event::Observed {
            name: name.into(),
            entry: Entry::File(bytes.to_vec()),
        },
    );
    requests(m)
}

// ------------------------------------------------------------------- readiness

#[test]
fn ready_only_after_watch_armed_and_the_first_scan_is_fully_handled() {
    let mut sim = Sim::new(settings(Mode::Chained, ConfPolicy::ConvertToList));
    sim.dir.insert("10-a.conflist".into(), unpatched("a"));
    sim.dir.insert("20-b.conflist".into(), unpatched("b"));
    // Nothing known yet: not ready.
    sim.drain(t(0));
    assert_eq!(sim.readiness, [false]);
    // Armed but not scanned: still not ready, and nothing new reported.
    sim.m.handle(t(0), Event::WatchArmed);
    sim.drain(t(0));
    assert_eq!(sim.readiness, [false]);
    // The scan: ready exactly once, after both files were read and written.
    let names = sim.dir.keys().cloned().collect();
    sim.m.handle(t(1), Event::Listed(names));
    let done = sim.drain(t(1));
    assert_eq!(sim.readiness, [false, true]);
    let ready_at = done
        .iter()
        .position(|io| matches!(io, Io::Ready { ready: true, .. }))
        .unwrap();
    let last_write = done
        .iter()
        .rposition(|io| matches!(io, Io::Write(_)))
        .unwrap();
    assert!(ready_at > last_write, "ready before the scan was handled");
    assert!(
        done.iter()
            .position(|io| matches!(io, Io::Notice(Notice::ScanDone(2))))
            .unwrap()
            > last_write
    );
}

/// The daemon's one queue: the watch is armed, the directory listed, then a config is
/// created and its event reaches the machine before the listing does. The listing
/// does not hold the file, so the event is all there is: it must be read and
/// patched (mutant `installer-drops-early-events` drops it as "the scan covers it").
#[test]
fn an_event_handled_before_the_scans_listing_is_read_and_patched() {
    let mut sim = Sim::new(settings(Mode::Chained, ConfPolicy::ConvertToList));
    sim.dir.insert("10-a.conflist".into(), unpatched("a"));
    sim.arm(t(0));
    let listing = sim.listing();
    // Created after the listing was taken: only the watch reports it.
    sim.dir.insert("20-late.conflist".into(), unpatched("late"));
    sim.m
        .handle(t(1), Event::Changed("20-late.conflist".into()));
    sim.perform_all(t(1));
    assert_eq!(sim.readiness, [false], "ready before the scan's listing");
    sim.m.handle(t(2), Event::Listed(listing));
    sim.drain(t(2));
    assert!(
        is_patched(&sim.dir["20-late.conflist"]),
        "the event handled before the scan's listing was dropped: 20-late.conflist is {:?}",
        sim.m.state("20-late.conflist")
    );
    assert!(is_patched(&sim.dir["10-a.conflist"]));
    assert_eq!(sim.readiness, [false, true]);
}

#[test]
fn a_scan_without_a_watch_is_never_ready() {
    let mut sim = Sim::new(settings(Mode::Chained, ConfPolicy::ConvertToList));
    sim.dir.insert("10-a.conflist".into(), unpatched("a"));
    sim.m
        .handle(t(0), Event::Listed(vec!["10-a.conflist".into()]));
    sim.drain(t(0));
    assert!(is_patched(&sim.dir["10-a.conflist"]));
    assert_eq!(sim.readiness, [false]);
    sim.m.handle(t(1), Event::WatchArmed);
    sim.drain(t(1));
    assert_eq!(sim.readiness, [false, true]);
}

#[test]
fn readiness_needs_a_patched_primary_and_none_blocking() {
    let mut sim = Sim::started(settings(Mode::Chained, ConfPolicy::Skip), &[]);
    // An empty directory: nothing patched, not ready.
    assert_eq!(sim.readiness, [false]);
    // Partial and invalid files do not block (runtimes cannot load them either) ...
    sim.external(t(1), "05-partial.conflist", b"{\"cniVersion\": ");
    sim.external(t(1), "06-bad.conflist", b"{\"plugins\": 7}");
    sim.external(t(1), "10-a.conflist", &unpatched("a"));
    assert_eq!(sim.readiness, [false, true]);
    // ... but a refused primary does (a .conf under --conf-policy skip).
    sim.external(t(2), "00-single.conf", &single_conf("s"));
    assert_eq!(sim.readiness, [false, true, false]);
    assert!(matches!(
        sim.m.state("00-single.conf"),
        Some(FileState::Blocked(Blocked::Refused(_)))
    ));
    // Removing it makes the installer ready again.
    sim.remove(t(3), "00-single.conf");
    assert_eq!(sim.readiness, [false, true, false, true]);
}

// ----------------------------------------------------------- skip reason → state

#[test]
fn each_skip_reason_maps_to_one_state() {
    assert_eq!(FileState::for_skip(SkipReason::NotAConfigFile), None);
    let partial = FileState::for_skip(SkipReason::Incomplete(CniConfError::Empty)).unwrap();
    assert!(matches!(partial, FileState::Partial(_)));
    assert!(!partial.blocks_readiness());
    let invalid = parse_file("x.conflist", b"[1]").unwrap_err();
    let invalid = FileState::for_skip(SkipReason::Invalid(invalid)).unwrap();
    assert!(matches!(invalid, FileState::Invalid(_)));
    assert!(!invalid.blocks_readiness());
    let refused = FileState::for_skip(SkipReason::Refused(CniConfError::Empty)).unwrap();
    assert!(matches!(refused, FileState::Blocked(Blocked::Refused(_))));
    assert!(refused.blocks_readiness());
    assert!(FileState::Throttled.blocks_readiness());
    assert!(FileState::Pending("x".into()).blocks_readiness());
    assert!(!FileState::Patched.blocks_readiness());
}

#[test]
fn partial_invalid_and_refused_files_are_never_written() {
    let mut sim = Sim::started(settings(Mode::Chained, ConfPolicy::Skip), &[]);
    sim.external(t(1), "01-empty.conflist", b"");
    sim.external(t(1), "02-cut.conflist", &unpatched("x")[..20]);
    sim.external(t(1), "03-bad.conflist", b"{\"name\": \"n\"}");
    sim.external(
        t(1),
        "04-old.conflist",
        br#"{"cniVersion": "0.2.0", "name": "o", "plugins": [{"type": "p"}]}"#,
    );
    sim.external(t(1), "05-single.conf", &single_conf("s"));
    assert_eq!(sim.total_writes(), 0);
    assert!(matches!(
        sim.m.state("01-empty.conflist"),
        Some(FileState::Partial(_))
    ));
    assert!(matches!(
        sim.m.state("02-cut.conflist"),
        Some(FileState::Partial(_))
    ));
    assert!(matches!(
        sim.m.state("03-bad.conflist"),
        Some(FileState::Invalid(_))
    ));
    assert!(matches!(
        sim.m.state("04-old.conflist"),
        Some(FileState::Blocked(Blocked::Refused(SkipReason::Refused(_))))
    ));
    assert!(matches!(
        sim.m.state("05-single.conf"),
        Some(FileState::Blocked(Blocked::Refused(_)))
    ));
    // A completed write of the partial file is patched.
    sim.external(t(2), "02-cut.conflist", &unpatched("x"));
    assert_eq!(sim.m.state("02-cut.conflist"), Some(&FileState::Patched));
    assert_eq!(sim.writes_to("02-cut.conflist"), 1);
}

#[test]
fn names_that_are_not_configs_of_the_directory_are_ignored() {
    let mut m = Installer::new(settings(Mode::Chained, ConfPolicy::Skip), t(0));
    for name in [
        "notes.txt",
        ".10-a.conflist.flock-tmp",
        "sub/10-a.conflist",
        "",
    ] {
        m.handle(t(0), Event::Changed(name.into()));
        m.handle(
            t(0),
            Event::Observed {
                name: name.into(),
                entry: Entry::File(unpatched("a")),
            },
        );
    }
    assert!(writes(&requests(&mut m)).is_empty());
    assert_eq!(m.files().count(), 0);
}

// ------------------------------------------------------------ own writes, CAS

#[test]
fn a_patch_is_conditional_on_the_bytes_decided_on_and_our_write_is_recognised() {
    let mut m = Installer::new(settings(Mode::Chained, ConfPolicy::Skip), t(0));
    let original = unpatched("a");
    let ios = observe(&mut m, t(0), "10-a.conflist", &original);
    let [w] = writes(&ios)[..] else {
        panic!("one write expected: {ios:?}")
    };
    assert_eq!(w.expect, Expect::Holds(original.clone()));
    assert_eq!(w.kind, WriteKind::Patch);
    let patched = w.bytes.clone();
    // Another agent rewrote it meanwhile: read again at once, nothing recorded.
    m.handle(
        t(1),
        Event::Written {
            write: w.clone(),
            outcome: WriteOutcome::ConditionFailed,
        },
    );
    let ios = requests(&mut m);
    assert!(ios.contains(&Io::Read("10-a.conflist".into())), "{ios:?}");
    // The retry succeeds; the event of our own write is recognised, no second write.
    let ios = observe(&mut m, t(2), "10-a.conflist", &original);
    let w = writes(&ios)[0].clone();
    m.handle(
        t(2),
        Event::Written {
            write: w,
            outcome: WriteOutcome::Written,
        },
    );
    requests(&mut m);
    let ios = observe(&mut m, t(3), "10-a.conflist", &patched);
    assert!(writes(&ios).is_empty());
    assert_eq!(m.own_write_events(), 1);
    assert_eq!(m.state("10-a.conflist"), Some(&FileState::Patched));
}

// --------------------------------------------------------- refusal to overwrite

#[test]
fn converting_never_overwrites_a_list_flock_did_not_write() {
    let mut sim = Sim::started(settings(Mode::Chained, ConfPolicy::ConvertToList), &[]);
    let foreign = unpatched("foreign");
    sim.external(t(1), "10-a.conflist", &foreign);
    // 10-a.conflist is patched (it was a primary itself); replace it with a file
    // the ledger knows nothing about by removing and recreating it invalid.
    sim.remove(t(2), "10-a.conflist");
    sim.external(
        t(2),
        "10-a.conflist",
        b"not json at all, but someone's file",
    );
    let before = sim.dir["10-a.conflist"].clone();
    sim.external(t(3), "10-a.conf", &single_conf("a"));
    let w = sim
        .performed
        .iter()
        .rev()
        .find_map(|io| match io {
            Io::Write(w) if w.path == "10-a.conflist" => Some(w.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(w.expect, Expect::Absent);
    assert_eq!(
        sim.dir["10-a.conflist"], before,
        "overwrote a file that is not ours"
    );
    assert_eq!(
        sim.m.state("10-a.conf"),
        Some(&FileState::Blocked(Blocked::WouldOverwrite {
            list_name: "10-a.conflist".into()
        }))
    );
    assert!(sim.dir.contains_key("10-a.conf"), "the .conf must stay");
}

#[test]
fn converting_replaces_a_list_flock_wrote_and_removes_the_conf_after() {
    let mut sim = Sim::started(settings(Mode::Chained, ConfPolicy::ConvertToList), &[]);
    sim.external(t(1), "10-a.conf", &single_conf("a"));
    assert!(!sim.dir.contains_key("10-a.conf"));
    assert!(is_patched(&sim.dir["10-a.conflist"]));
    assert_eq!(sim.m.converted_from("10-a.conflist"), Some("10-a.conf"));
    // The .conf comes back (the primary rewrote it): the list is ours, so replaced.
    sim.external(t(2), "10-a.conf", &single_conf("a2"));
    let w = sim
        .performed
        .iter()
        .rev()
        .find_map(|io| match io {
            Io::Write(w) => Some(w.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(w.expect, Expect::Anything);
    assert!(!sim.dir.contains_key("10-a.conf"));
    assert!(String::from_utf8_lossy(&sim.dir["10-a.conflist"]).contains("a2"));
    // The list is written before the .conf is removed: loadable at every instant.
    let write_at = sim
        .performed
        .iter()
        .rposition(|io| matches!(io, Io::Write(_)))
        .unwrap();
    let remove_at = sim
        .performed
        .iter()
        .rposition(|io| matches!(io, Io::Remove(_)))
        .unwrap();
    assert!(write_at < remove_at);
}

// ------------------------------------------------------------------- symlinks

#[test]
fn a_symlink_is_typed_never_written_and_rechecked_after_our_writes() {
    let mut m = Installer::new(settings(Mode::Chained, ConfPolicy::Skip), t(0));
    let link = |content: Result<Vec<u8>, String>| Event::Observed {
        name: "20-alias.conflist".into(),
        entry: Entry::Symlink {
            target: "10-a.conflist".into(),
            content,
        },
    };
    m.handle(t(0), link(Ok(unpatched("a"))));
    let ios = requests(&mut m);
    assert!(writes(&ios).is_empty(), "wrote through a link: {ios:?}");
    assert_eq!(
        m.state("20-alias.conflist"),
        Some(&FileState::Blocked(Blocked::Symlink {
            target: "10-a.conflist".into()
        }))
    );
    // A write of ours (to the link's target) makes the machine look at the link again.
    let ios = observe(&mut m, t(1), "10-a.conflist", &unpatched("a"));
    let w = writes(&ios)[0].clone();
    let patched = w.bytes.clone();
    m.handle(
        t(1),
        Event::Written {
            write: w,
            outcome: WriteOutcome::Written,
        },
    );
    let ios = requests(&mut m);
    assert!(
        ios.contains(&Io::Read("20-alias.conflist".into())),
        "{ios:?}"
    );
    // Its target is patched now: the link counts as patched.
    m.handle(t(1), link(Ok(patched)));
    requests(&mut m);
    assert_eq!(m.state("20-alias.conflist"), Some(&FileState::Patched));
    // An unreadable target blocks, with the reason.
    m.handle(t(2), link(Err("permission denied".into())));
    assert!(writes(&requests(&mut m)).is_empty());
    assert_eq!(
        m.state("20-alias.conflist"),
        Some(&FileState::Blocked(Blocked::SymlinkUnreadable {
            target: "10-a.conflist".into(),
            error: "permission denied".into()
        }))
    );
    // A link to an invalid config is invalid, not blocking.
    m.handle(t(3), link(Ok(b"{}".to_vec())));
    requests(&mut m);
    assert!(matches!(
        m.state("20-alias.conflist"),
        Some(FileState::Invalid(_))
    ));
}

#[test]
fn other_entry_kinds_and_removal() {
    let mut m = Installer::new(settings(Mode::Chained, ConfPolicy::Skip), t(0));
    m.handle(
        t(0),
        Event::Observed {
            name: "10-dir.conflist".into(),
            entry: Entry::NotRegular,
        },
    );
    assert!(matches!(
        m.state("10-dir.conflist"),
        Some(FileState::Invalid(_))
    ));
    m.handle(
        t(0),
        Event::Observed {
            name: "10-dir.conflist".into(),
            entry: Entry::Missing,
        },
    );
    let ios = requests(&mut m);
    assert!(ios.contains(&Io::Notice(Notice::Removed("10-dir.conflist".into()))));
    assert_eq!(m.state("10-dir.conflist"), None);
}

// ------------------------------------------------- write budget and retry timing

#[test]
fn a_constant_rewriter_is_throttled_then_repatched_when_the_next_token_is_due() {
    let mut s = settings(Mode::Chained, ConfPolicy::Skip);
    s.write_burst = 2;
    s.write_interval_ms = 1_000;
    s.resync_ms = 1_000_000;
    let mut sim = Sim::started(s, &[]);
    for i in 0..2 {
        sim.external(t(10 + i), "10-a.conflist", &unpatched(&format!("v{i}")));
    }
    assert_eq!(sim.writes_to("10-a.conflist"), 2);
    // The third rewrite within the interval is over budget.
    sim.external(t(20), "10-a.conflist", &unpatched("v2"));
    assert_eq!(sim.writes_to("10-a.conflist"), 2);
    assert_eq!(sim.m.state("10-a.conflist"), Some(&FileState::Throttled));
    assert!(
        sim.performed
            .contains(&Io::Notice(Notice::ThrottleStarted("10-a.conflist".into())))
    );
    assert_eq!(sim.readiness.last(), Some(&false));
    // The bucket's first token came back 1000 ms after the first take (t = 10).
    assert_eq!(sim.m.poll_timeout(), t(1_010));
    // Nothing fires early.
    sim.m.handle_timeout(t(1_009));
    sim.drain(t(1_009));
    assert_eq!(sim.writes_to("10-a.conflist"), 2);
    // On time: re-read, re-patched, ready again.
    sim.m.handle_timeout(t(1_010));
    sim.drain(t(1_010));
    assert_eq!(sim.writes_to("10-a.conflist"), 3);
    assert_eq!(sim.m.state("10-a.conflist"), Some(&FileState::Patched));
    assert!(
        sim.performed
            .contains(&Io::Notice(Notice::ThrottleEnded("10-a.conflist".into())))
    );
    assert_eq!(sim.readiness.last(), Some(&true));
}

#[test]
fn a_failed_write_is_pending_and_retried_after_a_second() {
    let mut m = Installer::new(settings(Mode::Chained, ConfPolicy::Skip), t(0));
    let ios = observe(&mut m, t(100), "10-a.conflist", &unpatched("a"));
    let w = writes(&ios)[0].clone();
    m.handle(
        t(100),
        Event::Written {
            write: w,
            outcome: WriteOutcome::Failed("read-only file system".into()),
        },
    );
    requests(&mut m);
    assert!(matches!(
        m.state("10-a.conflist"),
        Some(FileState::Pending(_))
    ));
    assert_eq!(m.poll_timeout(), t(1_100));
    m.handle_timeout(t(1_099));
    assert!(!requests(&mut m).contains(&Io::Read("10-a.conflist".into())));
    m.handle_timeout(t(1_100));
    assert!(requests(&mut m).contains(&Io::Read("10-a.conflist".into())));
}

#[test]
fn the_directory_is_relisted_every_resync_period() {
    let mut s = settings(Mode::Chained, ConfPolicy::Skip);
    s.resync_ms = 60_000;
    let mut m = Installer::new(s, t(5));
    assert_eq!(m.poll_timeout(), t(60_005));
    m.handle_timeout(t(60_004));
    assert!(!requests(&mut m).contains(&Io::List));
    m.handle_timeout(t(60_005));
    assert!(requests(&mut m).contains(&Io::List));
    assert_eq!(m.poll_timeout(), t(120_005));
    // An inotify overflow re-lists at once.
    m.handle(t(70_000), Event::Overflow);
    assert!(requests(&mut m).contains(&Io::List));
}

#[test]
fn a_relisting_reads_known_files_too() {
    let mut sim = Sim::started(settings(Mode::Chained, ConfPolicy::Skip), &[]);
    sim.external(t(1), "10-a.conflist", &unpatched("a"));
    // Deleted without an event reaching us: the listing no longer has it, but the
    // relisting reads it anyway and forgets it.
    sim.dir.remove("10-a.conflist");
    sim.m.handle(t(2), Event::Overflow);
    sim.drain(t(2));
    assert_eq!(sim.m.state("10-a.conflist"), None);
}

// --------------------------------------------------------------------- drop-ins

#[test]
fn subdir_mode_probes_creates_and_removes_drop_ins() {
    let mut m = Installer::new(settings(Mode::Subdir, ConfPolicy::Skip), t(0));
    let ios = observe(&mut m, t(0), "10-a.conflist", &unpatched("net-a"));
    let Some(Io::ProbeDropIn { primary, dropin }) = ios.into_iter().next() else {
        panic!("probe expected")
    };
    assert_eq!(primary, "10-a.conflist");
    assert_eq!(dropin.dir_name, "net-a");
    // Something that is not a directory holds the name: blocked, nothing written.
    m.handle(
        t(0),
        Event::DropInProbed {
            primary: primary.clone(),
            dropin: dropin.clone(),
            dir: DropInDir::NotADirectory,
        },
    );
    assert!(writes(&requests(&mut m)).is_empty());
    assert!(matches!(
        m.state("10-a.conflist"),
        Some(FileState::Blocked(Blocked::DropInDirNotADirectory { .. }))
    ));
    // Missing: created with the drop-in.
    m.handle(
        t(1),
        Event::DropInProbed {
            primary: primary.clone(),
            dropin: dropin.clone(),
            dir: DropInDir::Missing,
        },
    );
    let ios = requests(&mut m);
    let w = writes(&ios)[0].clone();
    assert_eq!(w.path, "net-a/zz-flock.conf");
    assert!(matches!(
        w.kind,
        WriteKind::DropIn {
            create_dir: true,
            ..
        }
    ));
    m.handle(
        t(1),
        Event::Written {
            write: w,
            outcome: WriteOutcome::Written,
        },
    );
    requests(&mut m);
    assert_eq!(m.state("10-a.conflist"), Some(&FileState::Patched));
    // Already in place: no write.
    m.handle(
        t(2),
        Event::DropInProbed {
            primary: primary.clone(),
            dropin: dropin.clone(),
            dir: DropInDir::Directory(Some(dropin.bytes.clone())),
        },
    );
    assert!(writes(&requests(&mut m)).is_empty());
    // The primary goes away: the drop-in and the directory we created go too.
    m.handle(
        t(3),
        Event::Observed {
            name: primary,
            entry: Entry::Missing,
        },
    );
    assert!(requests(&mut m).contains(&Io::RemoveDropIn {
        dir_name: "net-a".into(),
        file_name: "zz-flock.conf".into(),
        remove_dir: true,
    }));
}

#[test]
fn a_drop_in_shared_by_two_primaries_stays_until_both_are_gone() {
    let mut sim = Sim::started(settings(Mode::Subdir, ConfPolicy::Skip), &[]);
    sim.external(t(1), "10-a.conflist", &unpatched("net"));
    sim.external(t(1), "20-b.conflist", &unpatched("net"));
    assert!(sim.dir.contains_key("net/zz-flock.conf"));
    sim.remove(t(2), "10-a.conflist");
    assert!(sim.dir.contains_key("net/zz-flock.conf"));
    sim.remove(t(3), "20-b.conflist");
    assert!(!sim.dir.contains_key("net/zz-flock.conf"));
}

// ------------------------------------------------------------------ on exit

#[test]
fn restore_decisions() {
    let mut sim = Sim::started(settings(Mode::Chained, ConfPolicy::ConvertToList), &[]);
    sim.external(t(1), "10-a.conflist", &unpatched("a"));
    sim.external(t(1), "20-b.conf", &single_conf("b"));
    let m = &sim.m;
    // Unpatched in place.
    let Restore::Rewrite(bytes) = m.restore("10-a.conflist", &sim.dir["10-a.conflist"], false)
    else {
        panic!("rewrite expected")
    };
    assert!(!is_patched(&bytes));
    // A converted list turns back into its .conf ...
    let Restore::BackToConf { conf_name, bytes } =
        m.restore("20-b.conflist", &sim.dir["20-b.conflist"], false)
    else {
        panic!("back to .conf expected")
    };
    assert_eq!(conf_name, "20-b.conf");
    assert!(semantically_equal(
        &parse_file("20-b.conf", &bytes).unwrap(),
        &parse_file("20-b.conf", &single_conf("b")).unwrap()
    ));
    // ... unless a .conf of that name exists again: then unpatched in place.
    assert!(matches!(
        m.restore("20-b.conflist", &sim.dir["20-b.conflist"], true),
        Restore::Rewrite(_)
    ));
    // Nothing of ours, or not a config: untouched.
    assert_eq!(
        m.restore("30-c.conflist", &unpatched("c"), false),
        Restore::Untouched
    );
    assert_eq!(
        m.restore("30-c.conflist", b"garbage", false),
        Restore::Untouched
    );
}
