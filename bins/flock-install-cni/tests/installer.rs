//! The installer's race and failure scenarios against the real `flock-install-cni` binary,
//! real files and real inotify, each in its own temp directory.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, PermissionsExt, symlink};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;
use flock_core::cniconf::kind_for_file_name;
use nix::sys::signal::Signal;
use serde_json::Value;

fn json(text: &str) -> Value {
    serde_json::from_str(text).unwrap()
}

/// The shared-hash patch loop: two configs created within a millisecond, in both
/// orders. Each is patched exactly once, and then nothing is written for 2 s (the
/// shell installer with one shared hash patched them forever). Run as two installers
/// at once so the quiet window is shared.
#[test]
fn two_configs_within_a_millisecond_both_orders_never_loop() {
    let ab = Installer::prepare().start(&[]);
    let ba = Installer::prepare().start(&[]);
    let a = conflist("aws-cni", "foo");
    let b = conflist("aws-cni", "bar");
    // The reproduction's exact commands: two `echo > file` (truncate + write), back to back.
    let t = Instant::now();
    fs::write(ab.path("01-foo.conflist"), &a).unwrap();
    fs::write(ab.path("02-bar.conflist"), &b).unwrap();
    fs::write(ba.path("02-bar.conflist"), &b).unwrap();
    fs::write(ba.path("01-foo.conflist"), &a).unwrap();
    let gap = t.elapsed();
    for inst in [&ab, &ba] {
        inst.wait_patched("01-foo.conflist");
        inst.wait_patched("02-bar.conflist");
    }
    let mtimes = |i: &Installer| {
        ["01-foo.conflist", "02-bar.conflist"]
            .map(|n| fs::metadata(i.path(n)).unwrap().modified().unwrap())
    };
    let before = (
        mtimes(&ab),
        mtimes(&ba),
        ab.read("01-foo.conflist"),
        ba.read("02-bar.conflist"),
    );
    // The loop, if any, shows within milliseconds; watch for 2 s.
    std::thread::sleep(Duration::from_secs(2));
    let after = (
        mtimes(&ab),
        mtimes(&ba),
        ab.read("01-foo.conflist"),
        ba.read("02-bar.conflist"),
    );
    assert_eq!(
        before, after,
        "files changed after both were patched: a write loop"
    );
    for inst in [&ab, &ba] {
        let mut writes = inst.writes();
        writes.sort();
        assert_eq!(
            writes,
            ["01-foo.conflist", "02-bar.conflist"],
            "each file written exactly once (4 writes in {gap:?})\n{}",
            inst.dump_log()
        );
        assert!(inst.is_ready());
        let foo = json(&inst.read("01-foo.conflist"));
        assert_eq!(foo["plugins"][0]["type"], "foo");
        assert_eq!(
            foo["plugins"][1],
            json(r#"{"type":"flock-cni","agent_socket":"/run/flock/cni.sock"}"#)
        );
        assert_eq!(foo["disableCheck"], true);
    }
}

/// Configs that exist before the start, and configs created while it starts (during
/// the scan): all patched (the watch is armed before the scan, one queue).
#[test]
fn configs_created_before_and_during_startup_are_all_patched() {
    let mut inst = Installer::prepare();
    for i in 0..20 {
        fs::write(
            inst.path(&format!("{i:02}-pre.conflist")),
            conflist(&format!("pre{i}"), "ptp"),
        )
        .unwrap();
    }
    let conf = inst.conf.clone();
    let creator = std::thread::spawn(move || {
        for i in 0..60 {
            let tmp = conf.join(format!("during-{i}.tmp"));
            fs::write(&tmp, conflist(&format!("during{i}"), "bridge")).unwrap();
            fs::rename(&tmp, conf.join(format!("{i:02}-during.conflist"))).unwrap();
            std::thread::sleep(Duration::from_micros(500));
        }
    });
    inst.spawn_nowait(&[]);
    creator.join().unwrap();
    for i in 0..20 {
        inst.wait_patched(&format!("{i:02}-pre.conflist"));
    }
    for i in 0..60 {
        inst.wait_patched(&format!("{i:02}-during.conflist"));
    }
    wait_for("ready", WAIT, || inst.is_ready());
    wait_for("80 writes logged", WAIT, || inst.writes().len() >= 80);
    assert_eq!(inst.writes().len(), 80, "{}", inst.dump_log());
}

/// The primary rewrites its file in place (MODIFY), by atomic rename (MOVED_TO), and by
/// delete-then-create with 0–50 ms gaps: re-patched every time, one write per event.
#[test]
fn rewrites_in_place_by_rename_and_delete_then_create_are_repatched() {
    let inst = Installer::prepare().start(&[]);
    let name = "10-calico.conflist";
    let original = conflist("k8s-pod-network", "calico");
    fs::write(inst.path(name), &original).unwrap();
    inst.wait_patched(name);
    let mut expected = 1;
    let check = |expected: usize, how: &str| {
        inst.wait_patched(name);
        wait_for(&format!("{how}: write #{expected}"), WAIT, || {
            inst.writes_to(name) >= expected
        });
        assert_eq!(
            inst.writes_to(name),
            expected,
            "{how}: one write per external change\n{}",
            inst.dump_log()
        );
    };
    // In place: open, truncate, write (MODIFY + CLOSE_WRITE).
    let mut f = fs::OpenOptions::new()
        .write(true)
        .truncate(true)
        .open(inst.path(name))
        .unwrap();
    f.write_all(original.as_bytes()).unwrap();
    drop(f);
    expected += 1;
    check(expected, "in place");
    // Atomic rename from a name no runtime reads.
    fs::write(inst.path("calico.tmp"), &original).unwrap();
    fs::rename(inst.path("calico.tmp"), inst.path(name)).unwrap();
    expected += 1;
    check(expected, "rename");
    for gap_ms in [0u64, 10, 50] {
        fs::remove_file(inst.path(name)).unwrap();
        std::thread::sleep(Duration::from_millis(gap_ms));
        fs::write(inst.path(name), &original).unwrap();
        expected += 1;
        check(expected, &format!("delete, {gap_ms} ms, create"));
    }
    wait_for("ready", WAIT, || inst.is_ready());
}

/// A non-atomic writer (truncate, then chunks with pauses, file kept open): never
/// patched while partial, patched once complete, and none of the writer's bytes lost.
#[test]
fn partial_writes_are_never_patched() {
    let inst = Installer::prepare().start(&[]);
    let name = "20-slow.conflist";
    let full = format!(
        r#"{{"cniVersion": "1.0.0", "name": "slow", "plugins": [{{"type": "bridge", "bridge": "cni0", "pad": "{}"}}]}}"#,
        "x".repeat(3000)
    );
    let mut f = fs::File::create(inst.path(name)).unwrap();
    let chunks: Vec<&[u8]> = full.as_bytes().chunks(1000).collect();
    let (last, partial) = chunks.split_last().unwrap();
    for chunk in partial {
        f.write_all(chunk).unwrap();
        f.sync_all().unwrap();
        std::thread::sleep(Duration::from_millis(60));
        assert!(
            !inst.is_ready(),
            "ready while the only primary is partial\n{}",
            inst.dump_log()
        );
        assert_eq!(
            inst.writes_to(name),
            0,
            "patched a partial file\n{}",
            inst.dump_log()
        );
    }
    f.write_all(last).unwrap();
    drop(f);
    inst.wait_patched(name);
    let patched = json(&inst.read(name));
    assert_eq!(
        patched["plugins"][0]["pad"].as_str().unwrap().len(),
        3000,
        "writer's bytes lost"
    );
    wait_for("the write logged", WAIT, || inst.writes_to(name) >= 1);
    assert_eq!(inst.writes_to(name), 1);
    wait_for("ready", WAIT, || inst.is_ready());
    assert!(
        inst.logged("not patched yet") >= 1,
        "the partial state is logged"
    );
}

/// Invalid JSON, an empty file, a list without plugins, a .conf without type, a plugin
/// entry that is not an object, a kubeconfig: skipped with a reason, byte-identical;
/// fixing one gets it patched.
#[test]
fn invalid_files_are_skipped_untouched_and_patched_once_fixed() {
    let inst = Installer::prepare();
    let cases = [
        (
            "10-broken.conflist",
            r#"{"cniVersion": "1.0.0", "name": "x", "plugins": [{"type": "a"},]}"#,
        ),
        ("11-empty.conflist", ""),
        (
            "12-noplugins.conflist",
            r#"{"cniVersion": "1.0.0", "name": "x"}"#,
        ),
        ("13-notype.conf", r#"{"cniVersion": "1.0.0", "name": "x"}"#),
        (
            "14-notobject.conflist",
            r#"{"cniVersion": "1.0.0", "name": "x", "plugins": ["bridge"]}"#,
        ),
        ("ZZZ-flock-kubeconfig", "apiVersion: v1\nkind: Config\n"),
    ];
    for (n, text) in cases {
        fs::write(inst.path(n), text).unwrap();
    }
    fs::set_permissions(
        inst.path("ZZZ-flock-kubeconfig"),
        fs::Permissions::from_mode(0o600),
    )
    .unwrap();
    fs::write(inst.path("50-good.conflist"), conflist("good", "ptp")).unwrap();
    let mut inst = inst.start(&[]);
    inst.wait_patched("50-good.conflist");
    wait_for(
        "ready (invalid files do not block it; the runtime cannot load them either)",
        WAIT,
        || inst.is_ready(),
    );
    for (n, text) in cases {
        assert_eq!(inst.read(n), text, "{n} was modified");
    }
    let reasons: Vec<String> = inst
        .logs()
        .iter()
        .filter(|l| {
            l["fields"]["message"] == "skipped" || l["fields"]["message"] == "not patched yet"
        })
        .map(|l| format!("{} {}", l["fields"]["file"], l["fields"]["reason"]))
        .collect();
    for n in ["10-broken", "12-noplugins", "13-notype", "14-notobject"] {
        assert!(
            reasons.iter().any(|r| r.contains(n)),
            "no reason logged for {n}: {reasons:#?}"
        );
    }
    assert_eq!(
        fs::metadata(inst.path("ZZZ-flock-kubeconfig"))
            .unwrap()
            .mode()
            & 0o777,
        0o600
    );
    fs::write(inst.path("10-broken.conflist"), conflist("fixed", "a")).unwrap();
    inst.wait_patched("10-broken.conflist");
    assert!(inst.stop().success());
}

/// Our entry duplicated and in the wrong position, plus a stale temp file of an earlier
/// run: exactly one entry remains, last; the temp file is gone.
#[test]
fn duplicates_and_stale_temp_files_are_repaired_on_start() {
    let inst = Installer::prepare();
    let dup = r#"{"cniVersion": "1.0.0", "name": "dup", "plugins": [
        {"type": "flock-cni", "agent_socket": "/old.sock"}, {"type": "calico"},
        {"type": "flock-cni", "agent_socket": "/run/flock/cni.sock"}, {"type": "portmap"}]}"#;
    fs::write(inst.path("10-dup.conflist"), dup).unwrap();
    fs::write(inst.path(".10-dup.conflist.flock-tmp"), "{\"half\": ").unwrap();
    let inst = inst.start(&[]);
    inst.wait_patched("10-dup.conflist");
    let v = json(&inst.read("10-dup.conflist"));
    let types: Vec<&str> = v["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["calico", "portmap", "flock-cni"]);
    assert_eq!(v["plugins"][2]["agent_socket"], "/run/flock/cni.sock");
    assert!(temp_files(&inst.conf).is_empty(), "stale temp file left");
}

/// SIGTERM restores every file (semantically), a converted .conf comes back as .conf,
/// mode and owner are kept throughout, the binary and ready file are removed, exit 0.
#[test]
fn sigterm_restores_everything_and_preserves_mode_and_owner() {
    let inst = Installer::prepare();
    let list = conflist("net-a", "bridge");
    let conf = r#"{"cniVersion": "1.0.0", "name": "net-b", "type": "ptp", "ipam": {"type": "host-local"}}"#;
    fs::write(inst.path("10-a.conflist"), &list).unwrap();
    fs::write(inst.path("20-b.conf"), conf).unwrap();
    fs::set_permissions(
        inst.path("10-a.conflist"),
        fs::Permissions::from_mode(0o640),
    )
    .unwrap();
    std::os::unix::fs::chown(inst.path("10-a.conflist"), Some(1234), Some(5678)).unwrap();
    let mut inst = inst.start(&[]);
    inst.wait_patched("10-a.conflist");
    inst.wait_patched("20-b.conflist");
    wait_for("ready", WAIT, || inst.is_ready());
    assert!(
        !inst.path("20-b.conf").exists(),
        "the .conf is replaced by its list"
    );
    let m = fs::metadata(inst.path("10-a.conflist")).unwrap();
    assert_eq!((m.mode() & 0o7777, m.uid(), m.gid()), (0o640, 1234, 5678));
    assert!(inst.bin.join("flock-cni").exists());
    assert_eq!(
        fs::metadata(inst.bin.join("flock-cni")).unwrap().mode() & 0o777,
        0o755
    );

    let status = inst.stop();
    assert_eq!(status.code(), Some(0), "{}", inst.dump_log());
    assert_eq!(json(&inst.read("10-a.conflist")), json(&list));
    assert_eq!(json(&inst.read("20-b.conf")), json(conf));
    assert!(!inst.path("20-b.conflist").exists());
    let m = fs::metadata(inst.path("10-a.conflist")).unwrap();
    assert_eq!((m.mode() & 0o7777, m.uid(), m.gid()), (0o640, 1234, 5678));
    assert!(!inst.bin.join("flock-cni").exists(), "binary left behind");
    assert!(!inst.is_ready(), "ready file left behind");
    assert!(temp_files(&inst.conf).is_empty());
    let mut names: Vec<_> = fs::read_dir(&inst.conf)
        .unwrap()
        .flatten()
        .map(|e| e.file_name())
        .collect();
    names.sort();
    assert_eq!(names, ["10-a.conflist", "20-b.conf"]);
}

/// Converting a .conf never replaces a .conflist of that name that flock did not write
/// (here an invalid file another tool owns): the .conf stays, is reported, and keeps
/// readiness false; on exit nothing of it is touched.
#[test]
fn converting_a_conf_never_overwrites_a_foreign_list() {
    let inst = Installer::prepare();
    let foreign = "someone else's file, not JSON";
    let conf = r#"{"cniVersion": "1.0.0", "name": "net-a", "type": "ptp"}"#;
    fs::write(inst.path("10-a.conflist"), foreign).unwrap();
    fs::write(inst.path("10-a.conf"), conf).unwrap();
    fs::write(inst.path("20-b.conflist"), conflist("net-b", "bridge")).unwrap();
    let mut inst = inst.start(&[]);
    inst.wait_patched("20-b.conflist");
    wait_for("the refusal logged", WAIT, || {
        inst.logs().iter().any(|l| {
            l["fields"]["file"] == "10-a.conf"
                && l["fields"]["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("would overwrite 10-a.conflist"))
        })
    });
    assert_eq!(inst.read("10-a.conflist"), foreign);
    assert_eq!(inst.read("10-a.conf"), conf);
    assert!(
        !inst.is_ready(),
        "a refused primary must keep readiness false"
    );
    assert_eq!(inst.writes(), ["20-b.conflist"]);
    let status = inst.stop();
    assert_eq!(status.code(), Some(0), "{}", inst.dump_log());
    assert_eq!(inst.read("10-a.conflist"), foreign);
    assert_eq!(inst.read("10-a.conf"), conf);
}

/// A symlinked config pointing outside the directory is never written through or
/// replaced (and readiness says so); one pointing at a config inside is fine.
#[test]
fn symlinks_are_never_written_through() {
    let inst = Installer::prepare();
    let outside = inst.tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let target = outside.join("05-evil.conflist");
    let text = conflist("outside", "bridge");
    fs::write(&target, &text).unwrap();
    symlink(&target, inst.path("05-evil.conflist")).unwrap();
    fs::write(inst.path("10-real.conflist"), conflist("real", "ptp")).unwrap();
    symlink("10-real.conflist", inst.path("20-alias.conflist")).unwrap();
    let inst = inst.start(&[]);
    inst.wait_patched("10-real.conflist");
    wait_for("the outside link reported", WAIT, || {
        inst.logs().iter().any(|l| {
            l["fields"]["file"] == "05-evil.conflist"
                && l["fields"]["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("symlink"))
        })
    });
    assert_eq!(
        fs::read_to_string(&target).unwrap(),
        text,
        "wrote outside the config directory"
    );
    assert!(
        fs::symlink_metadata(inst.path("05-evil.conflist"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(
        fs::symlink_metadata(inst.path("20-alias.conflist"))
            .unwrap()
            .file_type()
            .is_symlink()
    );
    assert!(
        !inst.is_ready(),
        "an unpatchable primary must keep readiness false"
    );
    fs::remove_file(inst.path("05-evil.conflist")).unwrap();
    wait_for("ready once the outside link is gone", WAIT, || {
        inst.is_ready()
    });
}

/// A primary that rewrites its file constantly: bounded writes, a warning, readiness
/// false meanwhile; patched again once it stops.
#[test]
fn constant_rewriter_is_throttled_and_reported() {
    let inst =
        Installer::prepare().start(&["--max-write-burst", "3", "--write-interval-ms", "400"]);
    let name = "10-greedy.conflist";
    let text = conflist("greedy", "cilium-cni");
    fs::write(inst.path(name), &text).unwrap();
    inst.wait_patched(name);
    let start = Instant::now();
    let mut saw_unready = false;
    let mut rewrites = 0;
    while start.elapsed() < Duration::from_millis(2000) {
        fs::write(inst.path("greedy.tmp"), &text).unwrap();
        fs::rename(inst.path("greedy.tmp"), inst.path(name)).unwrap();
        rewrites += 1;
        saw_unready |= !inst.is_ready();
        std::thread::sleep(Duration::from_millis(5));
    }
    let elapsed = start.elapsed();
    let writes = inst.writes_to(name);
    // Budget: 1 initial + burst 3 + one per 400 ms.
    let bound = 1 + 3 + (elapsed.as_millis() / 400) as usize + 1;
    assert!(
        writes <= bound,
        "{writes} writes for {rewrites} rewrites in {elapsed:?}; bound {bound}"
    );
    assert!(saw_unready, "readiness stayed true while throttled");
    assert!(
        inst.logged("another agent keeps rewriting") >= 1,
        "no warning\n{}",
        inst.dump_log()
    );
    inst.wait_patched(name);
    wait_for("ready after the storm", WAIT, || inst.is_ready());
}

/// Subdirectory mode (libcni >= 1.3): a drop-in next to the untouched primary,
/// removed with its directory on SIGTERM.
#[test]
fn subdir_mode_writes_and_removes_drop_ins() {
    let inst = Installer::prepare();
    let text = conflist("podnet", "bridge");
    fs::write(inst.path("10-pod.conflist"), &text).unwrap();
    let mut inst = inst.start(&["--mode", "subdir"]);
    let dropin = inst.conf.join("podnet").join("zz-flock.conf");
    wait_for("drop-in", WAIT, || dropin.exists());
    assert_eq!(
        json(&fs::read_to_string(&dropin).unwrap()),
        json(r#"{"type":"flock-cni","agent_socket":"/run/flock/cni.sock"}"#)
    );
    assert_eq!(
        inst.read("10-pod.conflist"),
        text,
        "subdir mode must not touch the primary"
    );
    wait_for("ready", WAIT, || inst.is_ready());
    assert_eq!(inst.stop().code(), Some(0));
    assert!(
        !inst.conf.join("podnet").exists(),
        "drop-in directory left behind"
    );
}

/// Exhausted inotify limits (set to 0 in a user namespace of this test): exit 1 with a
/// clear message, nothing left behind; never runs unwatched.
#[test]
fn inotify_limit_exhaustion_is_a_clear_fatal_error() {
    for (sysctl, expect) in [
        ("max_inotify_instances", "instance limit"),
        ("max_inotify_watches", "watch limit"),
    ] {
        let inst = Installer::prepare();
        fs::write(inst.path("10-a.conflist"), conflist("a", "bridge")).unwrap();
        let cmd = inst.command(&[]);
        let mut argv = vec![cmd.get_program().to_string_lossy().into_owned()];
        argv.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
        let script = format!("echo 0 > /proc/sys/user/{sysctl} && exec \"$@\"");
        let out = Command::new("unshare")
            .args(["--user", "--map-root-user", "sh", "-c", &script, "sh"])
            .args(&argv)
            .output()
            .expect("unshare (util-linux) is needed for this test");
        let log = inst.dump_log() + &String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{sysctl}: {log}");
        assert!(
            log.contains(expect) && log.contains("refuses to run unwatched"),
            "{sysctl}: {log}"
        );
        assert!(
            !inst.bin.join("flock-cni").exists(),
            "{sysctl}: binary left behind"
        );
        assert_eq!(inst.read("10-a.conflist"), conflist("a", "bridge"));
    }
}

#[test]
fn help_explains_every_flag() {
    let out = Command::new(BIN).arg("--help").output().unwrap();
    assert!(out.status.success());
    let help = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--cni-conf-dir",
        "--cni-bin-dir",
        "--plugin-bin",
        "--plugin-config",
        "--mode",
        "--ready-file",
        "--conf-policy",
        "--on-exit",
        "--resync-seconds",
        "--max-write-burst",
        "--write-interval-ms",
        "--log-format",
    ] {
        assert!(help.contains(flag), "--help does not mention {flag}");
    }
}

/// Scenario 10: SIGKILL while a burst of primaries is being renamed in and the installer
/// is writing, five rounds over one directory, killed at a different point each round
/// (the first instant one of its temp files is seen after a varying number of
/// completed writes). After each kill: every config is complete JSON (never zero bytes)
/// and is either the writer's original or patched exactly once; a leftover temp file
/// has a name no runtime loads. Each restart removes every stale temp file (one planted
/// in each directory plus whatever the kill left), writes exactly the configs the
/// killed run had not patched, once each, and leaves every config patched exactly once.
#[test]
fn sigkill_mid_write_leaves_no_partial_config_and_restart_repairs() {
    const ROUNDS: usize = 5;
    const BURST: usize = 60;
    let mut inst = Installer::prepare().start(&[]);
    let mut originals = std::collections::BTreeMap::new();
    let mut killed_with_unpatched = 0;
    let mut temp_files_left_by_kills = 0;
    for round in 0..ROUNDS {
        let burst: Vec<(String, String)> = (0..BURST)
            .map(|i| {
                (
                    format!("{round}-{i:02}.conflist"),
                    conflist(&format!("net{round}-{i}"), &format!("primary{round}-{i}")),
                )
            })
            .collect();
        originals.extend(burst.iter().cloned());
        let conf = inst.conf.clone();
        let writer = std::thread::spawn(move || {
            for (name, text) in burst {
                let tmp = conf.join(format!(".writer-{name}.part"));
                fs::write(&tmp, text).unwrap();
                fs::rename(&tmp, conf.join(name)).unwrap();
            }
        });
        // Busy-wait (no sleep) so the kill lands as close as possible to a write in
        // flight; after `target + 10` writes, kill anyway (a burst needs 60).
        let target = inst.writes().len() + 1 + round * 5;
        let deadline = Instant::now() + WAIT;
        loop {
            let written = inst.writes().len();
            if written >= target && (!temp_files(&inst.conf).is_empty() || written >= target + 10) {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "round {round}: the installer did not write\n{}",
                inst.dump_log()
            );
        }
        inst.signal(Signal::SIGKILL);
        inst.wait_exit();
        writer.join().unwrap();

        // What a runtime would see now.
        let mut unpatched = Vec::new();
        for e in fs::read_dir(&inst.conf).unwrap().flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.ends_with(".flock-tmp") {
                assert!(
                    name.starts_with('.') && kind_for_file_name(&name).is_none(),
                    "temp file {name} could be loaded as a config"
                );
                temp_files_left_by_kills += 1;
                continue;
            }
            let original = originals
                .get(&name)
                .unwrap_or_else(|| panic!("round {round}: unexpected file {name} after SIGKILL"));
            let text = inst.read(&name);
            assert!(
                !text.is_empty(),
                "round {round}: {name} is empty after SIGKILL"
            );
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| {
                panic!("round {round}: {name} is not complete JSON after SIGKILL ({e}): {text}")
            });
            if is_patched(&text) {
                assert_eq!(v["plugins"].as_array().unwrap().len(), 2, "{name}: {text}");
                assert_eq!(v["plugins"][0], json(original)["plugins"][0], "{name}");
            } else {
                assert_eq!(&text, original, "round {round}: {name} half-patched");
                unpatched.push(name);
            }
        }
        if !unpatched.is_empty() {
            killed_with_unpatched += 1;
        }
        // A stale temp file in each directory, as a kill right after create leaves it
        // (the binary's is replaced by the reinstall, the others are logged).
        fs::write(inst.path(".gone.conflist.flock-tmp"), b"").unwrap();
        fs::write(inst.bin.join(".flock-cni.flock-tmp"), b"").unwrap();
        let stale = temp_files(&inst.conf).len();

        inst.spawn(&[]);
        // The log line, not just the file: the killed run's ready file is stale.
        wait_for(&format!("round {round}: ready after restart"), WAIT, || {
            inst.logged("ready: every primary config is patched") > 0 && inst.is_ready()
        });
        for name in originals.keys() {
            let text = inst.read(name);
            assert!(
                is_patched(&text),
                "round {round}: {name} not patched: {text}"
            );
            let v = json(&text);
            assert_eq!(v["plugins"].as_array().unwrap().len(), 2, "{name}: {text}");
            assert_eq!(v["plugins"][0], json(&originals[name])["plugins"][0]);
        }
        unpatched.sort();
        let mut writes = inst.writes();
        writes.sort();
        assert_eq!(
            writes,
            unpatched,
            "round {round}: the restart writes exactly what the killed run left unpatched\n{}",
            inst.dump_log()
        );
        assert_eq!(
            inst.logged("removed a stale temp file of an earlier run"),
            stale,
            "round {round}\n{}",
            inst.dump_log()
        );
        assert!(
            temp_files(&inst.conf).is_empty(),
            "round {round}: temp file left"
        );
        assert!(
            temp_files(&inst.bin).is_empty(),
            "round {round}: temp file left"
        );
        assert_eq!(
            fs::read(inst.bin.join("flock-cni")).unwrap(),
            fs::read(&inst.plugin).unwrap()
        );
    }
    eprintln!(
        "{ROUNDS} kills: {killed_with_unpatched} left configs unpatched, \
         {temp_files_left_by_kills} left a temp file of a write in flight"
    );
    assert!(
        killed_with_unpatched > 0,
        "no kill landed mid-burst: the restart path was not exercised"
    );
    assert_eq!(inst.stop().code(), Some(0));
}

/// Scenario 14: higher-priority primaries (lexically first: the network a runtime uses)
/// appear after another was patched, one renamed in, one written in place: each is
/// patched too, flock's entry after its plugins, the write is logged under its name,
/// the earlier primary is not rewritten, nothing is reported as unpatched, and the
/// installer is ready with all three.
#[test]
fn higher_priority_primary_appearing_later_is_patched_and_reported() {
    let inst = Installer::prepare();
    let calico = conflist("k8s-pod-network", "calico");
    fs::write(inst.path("50-calico.conflist"), &calico).unwrap();
    let inst = inst.start(&[]);
    inst.wait_patched("50-calico.conflist");
    wait_for("ready", WAIT, || inst.is_ready());
    let patched_calico = inst.read("50-calico.conflist");

    let cilium = r#"{"cniVersion": "1.0.0", "name": "cilium", "plugins": [
        {"type": "cilium-cni", "enable-debug": false},
        {"type": "portmap", "capabilities": {"portMappings": true}}]}"#;
    fs::write(inst.path("cilium.tmp"), cilium).unwrap();
    fs::rename(inst.path("cilium.tmp"), inst.path("05-cilium.conflist")).unwrap();
    let multus = r#"{"cniVersion": "0.3.1", "name": "multus-cni-network", "plugins": [
        {"type": "multus", "kubeconfig": "/etc/cni/net.d/multus.d/multus.kubeconfig"}]}"#;
    fs::write(inst.path("00-multus.conflist"), multus).unwrap();

    for (name, original, types) in [
        (
            "05-cilium.conflist",
            cilium,
            &["cilium-cni", "portmap", "flock-cni"][..],
        ),
        ("00-multus.conflist", multus, &["multus", "flock-cni"][..]),
    ] {
        inst.wait_patched(name);
        let v = json(&inst.read(name));
        let got: Vec<&str> = v["plugins"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["type"].as_str().unwrap())
            .collect();
        assert_eq!(got, types, "{name}: flock's entry follows the primary's");
        let o = json(original);
        let plugins = o["plugins"].as_array().unwrap();
        assert_eq!(
            v["plugins"].as_array().unwrap()[..plugins.len()],
            plugins[..]
        );
        assert_eq!(
            (&v["name"], &v["cniVersion"]),
            (&o["name"], &o["cniVersion"])
        );
        wait_for(&format!("{name}: the write logged"), WAIT, || {
            inst.writes_to(name) >= 1
        });
        assert_eq!(inst.writes_to(name), 1, "{}", inst.dump_log());
    }
    // libcni's pick: the first of the sorted *.conf, *.conflist, *.json.
    let mut configs: Vec<String> = fs::read_dir(&inst.conf)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| kind_for_file_name(n).is_some())
        .collect();
    configs.sort();
    assert_eq!(
        configs,
        [
            "00-multus.conflist",
            "05-cilium.conflist",
            "50-calico.conflist"
        ]
    );
    assert!(is_patched(&inst.read(&configs[0])));
    assert_eq!(inst.read("50-calico.conflist"), patched_calico);
    assert_eq!(
        inst.writes_to("50-calico.conflist"),
        1,
        "rewrote the old primary"
    );
    wait_for("ready with three primaries", WAIT, || inst.is_ready());
    assert_eq!(inst.logged("primary config NOT patched"), 0);
}

/// Scenario 17, `loadOnlyInlinedPlugins: true` in subdir mode: libcni ignores the
/// network's drop-in directory, so no drop-in is written (it would never run), the
/// reason is logged, the primary is untouched and readiness stays false (pods on that
/// network would start without flock). Once the flag is dropped the drop-in appears and
/// the installer is ready; SIGTERM removes it.
#[test]
fn subdir_mode_respects_load_only_inlined_plugins() {
    let inst = Installer::prepare();
    let inlined_only = r#"{"cniVersion": "1.1.0", "name": "podnet", "loadOnlyInlinedPlugins": true, "plugins": [{"type": "bridge"}]}"#;
    fs::write(inst.path("10-pod.conflist"), inlined_only).unwrap();
    let mut inst = inst.start(&["--mode", "subdir"]);
    wait_for("the refusal logged", WAIT, || {
        inst.logs().iter().any(|l| {
            l["fields"]["message"]
                .as_str()
                .is_some_and(|m| m.starts_with("primary config NOT patched"))
                && l["fields"]["file"] == "10-pod.conflist"
                && l["fields"]["reason"]
                    .as_str()
                    .is_some_and(|r| r.contains("loadOnlyInlinedPlugins"))
        })
    });
    assert!(inst.logged("initial scan done") > 0);
    assert!(!inst.conf.join("podnet").exists(), "drop-in written anyway");
    assert!(
        !inst.is_ready(),
        "ready with a primary flock cannot chain into"
    );
    assert_eq!(inst.writes().len(), 0);
    assert_eq!(inst.read("10-pod.conflist"), inlined_only);

    let plain = r#"{"cniVersion": "1.1.0", "name": "podnet", "plugins": [{"type": "bridge"}]}"#;
    fs::write(inst.path("pod.tmp"), plain).unwrap();
    fs::rename(inst.path("pod.tmp"), inst.path("10-pod.conflist")).unwrap();
    let dropin = inst.conf.join("podnet").join("zz-flock.conf");
    wait_for("drop-in once the flag is gone", WAIT, || dropin.exists());
    wait_for("ready", WAIT, || inst.is_ready());
    assert_eq!(inst.read("10-pod.conflist"), plain);
    assert_eq!(inst.stop().code(), Some(0));
    assert!(!inst.conf.join("podnet").exists());
}

/// Scenario 12 (restart/upgrade), with the explicit `--on-exit keep` policy: SIGTERM
/// leaves every config patched and the plugin installed (pods created while flock is
/// being upgraded fail closed instead of starting unmeshed), and the next installer on
/// the same directory adopts the patched files without rewriting them or duplicating
/// our entry. With the default policy the same SIGTERM restores everything
/// (`sigterm_restores_everything_and_preserves_mode_and_owner`).
#[test]
fn on_exit_keep_leaves_the_plugin_chained_and_a_restart_adopts_it() {
    let inst = Installer::prepare();
    let list = conflist("net-a", "bridge");
    fs::write(inst.path("10-a.conflist"), &list).unwrap();
    let mut inst = inst.start(&["--on-exit", "keep"]);
    inst.wait_patched("10-a.conflist");
    wait_for("ready", WAIT, || inst.is_ready());
    let patched = inst.read("10-a.conflist");
    let mtime = fs::metadata(inst.path("10-a.conflist"))
        .unwrap()
        .modified()
        .unwrap();

    let status = inst.stop();
    assert_eq!(status.code(), Some(0), "{}", inst.dump_log());
    assert_eq!(
        inst.read("10-a.conflist"),
        patched,
        "--on-exit keep must leave the config patched"
    );
    assert!(
        inst.bin.join("flock-cni").exists(),
        "--on-exit keep must leave the plugin installed"
    );
    assert!(
        !inst.is_ready(),
        "not ready once stopped, whatever the policy"
    );

    // The upgraded installer starts on the kept state.
    inst.spawn(&["--on-exit", "keep"]);
    wait_for("ready after restart", WAIT, || inst.is_ready());
    assert_eq!(inst.read("10-a.conflist"), patched);
    assert!(is_patched(&inst.read("10-a.conflist")));
    assert_eq!(
        fs::metadata(inst.path("10-a.conflist"))
            .unwrap()
            .modified()
            .unwrap(),
        mtime,
        "an already patched config is adopted, not rewritten\n{}",
        inst.dump_log()
    );
    assert!(temp_files(&inst.conf).is_empty());
}
