//! The pod store on a real filesystem (temporary directories): round trips, modes,
//! quarantine of every kind of bad file, temporary-file cleanup, symlink safety,
//! crash consistency (simulated) and a property test.

use std::fs;
use std::net::IpAddr;
use std::os::unix::fs::{PermissionsExt, symlink};
use std::path::Path;
use std::time::{Duration, Instant, SystemTime};

use flock_bird::model::{PodPort, PodRecord, Protocol};
use flock_bird::store::{
    self, LoadReport, MAX_FILE_BYTES, PodStore, QUARANTINE_DIR, StoreError, file_name_for,
};
use flock_core::UnixMs;
use flock_core::capture::policy::PodCapture;
use flock_core::capture::{Cidr, MAX_SPEC_ENTRIES};
use flock_core::pod::{self, PodKey};
use proptest::prelude::*;

fn rec(id: &str, ifname: &str) -> PodRecord {
    PodRecord {
        key: PodKey::new(id, ifname),
        name: format!("pod-{id}"),
        namespace: "default".into(),
        uid: "0b3e6c1e-8d1f-4b8a-9d7e-3c2a1b0f9e8d".into(),
        netns: format!("/var/run/netns/cni-{id}"),
        ips: vec!["10.1.2.3".parse().unwrap(), "fd00::3".parse().unwrap()],
        service: "reviews".into(),
        service_account: "bookinfo-reviews".into(),
        ports: vec![
            PodPort {
                app_port: 8080,
                listen_port: 15006,
                protocol: Protocol::Http,
                proxyless: false,
            },
            PodPort {
                app_port: 50051,
                listen_port: 15007,
                protocol: Protocol::Grpc,
                proxyless: false,
            },
        ],
        network_name: "k8s-pod-network".into(),
        added_at_ms: UnixMs(1_700_000_000_000),
        capture: None,
        authz: None,
        labels: Default::default(),
    }
}

fn mode(p: &Path) -> u32 {
    fs::symlink_metadata(p).unwrap().permissions().mode() & 0o777
}

fn quarantined_names(dir: &Path) -> Vec<String> {
    let q = dir.join(QUARANTINE_DIR);
    let mut v: Vec<String> = match fs::read_dir(&q) {
        Ok(rd) => rd
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect(),
        Err(_) => vec![],
    };
    v.sort();
    v
}

fn reason_for<'a>(report: &'a LoadReport, name: &str) -> &'a str {
    report
        .quarantined
        .iter()
        .find(|(p, _)| p.file_name().unwrap() == name)
        .map(|(_, r)| r.as_str())
        .unwrap_or_else(|| panic!("{name} not quarantined: {:?}", report.quarantined))
}

#[test]
fn round_trip_get_and_load() {
    let tmp = tempfile::tempdir().unwrap();
    let store = PodStore::open(&tmp.path().join("pods")).unwrap();
    let r = rec("abc123", "eth0");
    assert_eq!(store.get(&r.key).unwrap(), None);
    store.put(&r).unwrap();
    assert_eq!(store.get(&r.key).unwrap(), Some(r.clone()));
    let report = store.load_all().unwrap();
    assert_eq!(report.pods, vec![r.clone()]);
    assert!(report.quarantined.is_empty());
    // The on-disk form is the documented envelope.
    let v: serde_json::Value =
        serde_json::from_slice(&fs::read(store.path_for(&r.key)).unwrap()).unwrap();
    assert_eq!(v["schema"], 1);
    assert_eq!(v["pod"]["key"]["container_id"], "abc123");
}

/// Both durabilities keep the same contract towards the process: a put is there when it
/// returns, a remove is gone, and a reopened store loads exactly that. (Whether the
/// flushes are made is what `benches/` measures; a power loss cannot be had here.)
#[test]
fn both_durabilities_round_trip_and_reopen() {
    for durability in [
        store::Durability::PowerLoss,
        store::Durability::ProcessCrash,
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join("pods");
        let store = PodStore::open_with(&dir, durability).unwrap();
        assert_eq!(store.durability(), durability);
        let (a, b) = (rec("a", "eth0"), rec("b", "eth0"));
        store.put(&a).unwrap();
        store.put(&b).unwrap();
        assert!(store.remove(&a.key).unwrap());
        drop(store);
        let again = PodStore::open_with(&dir, durability).unwrap();
        assert_eq!(again.load_all().unwrap().pods, vec![b], "{durability:?}");
        assert_eq!(mode(&again.path_for(&rec("b", "eth0").key)), 0o600);
    }
    assert_eq!(
        PodStore::open(tempfile::tempdir().unwrap().path())
            .unwrap()
            .durability(),
        store::Durability::PowerLoss,
        "the library's default is the strong contract"
    );
}

#[test]
fn files_are_0600_and_dir_is_0700() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("a/b/pods");
    let store = PodStore::open(&dir).unwrap();
    assert_eq!(mode(&dir), 0o700);
    let r = rec("c1", "eth0");
    store.put(&r).unwrap();
    assert_eq!(mode(&store.path_for(&r.key)), 0o600);
    // Quarantine dir is private too.
    fs::write(dir.join("pod-zz.json"), b"{").unwrap();
    store.load_all().unwrap();
    assert_eq!(mode(&dir.join(QUARANTINE_DIR)), 0o700);
}

#[test]
fn overwrite_replaces_the_record() {
    let tmp = tempfile::tempdir().unwrap();
    let store = PodStore::open(tmp.path()).unwrap();
    let mut r = rec("c1", "eth0");
    store.put(&r).unwrap();
    r.ips = vec!["10.9.9.9".parse().unwrap()];
    r.added_at_ms = r.added_at_ms.plus(1);
    store.put(&r).unwrap();
    assert_eq!(store.get(&r.key).unwrap(), Some(r.clone()));
    assert_eq!(store.load_all().unwrap().pods, vec![r]);
    // Only the one file: no temporary file left behind.
    assert_eq!(fs::read_dir(tmp.path()).unwrap().count(), 1);
}

#[test]
fn remove_reports_whether_it_existed() {
    let tmp = tempfile::tempdir().unwrap();
    let store = PodStore::open(tmp.path()).unwrap();
    let a = rec("a", "eth0");
    let b = rec("a", "net1"); // Same container, other interface: another pod key.
    store.put(&a).unwrap();
    store.put(&b).unwrap();
    assert!(store.remove(&a.key).unwrap());
    assert!(!store.remove(&a.key).unwrap());
    assert_eq!(store.get(&a.key).unwrap(), None);
    assert_eq!(store.load_all().unwrap().pods, vec![b]);
}

#[test]
fn load_of_many_pods_from_concurrent_writers_and_put_latency() {
    let tmp = tempfile::tempdir().unwrap();
    let store = PodStore::open(tmp.path()).unwrap();
    const THREADS: usize = 4;
    const PER: usize = 50;
    let start = Instant::now();
    std::thread::scope(|s| {
        for t in 0..THREADS {
            let store = &store;
            s.spawn(move || {
                for i in 0..PER {
                    store.put(&rec(&format!("t{t}-{i}"), "eth0")).unwrap();
                }
            });
        }
    });
    let concurrent = start.elapsed();
    let report = store.load_all().unwrap();
    assert_eq!(report.pods.len(), THREADS * PER);
    assert!(report.quarantined.is_empty());

    // One thread, sequential: the latency of a durable put (two fsyncs).
    let mut lat: Vec<Duration> = (0..100)
        .map(|i| {
            let r = rec(&format!("seq-{i}"), "eth0");
            let t = Instant::now();
            store.put(&r).unwrap();
            t.elapsed()
        })
        .collect();
    lat.sort();
    let t = Instant::now();
    let report = store.load_all().unwrap();
    let load = t.elapsed();
    assert_eq!(report.pods.len(), THREADS * PER + 100);
    println!(
        "put latency (fsync file + dir): p50 {:?}, p90 {:?}, max {:?}; {} concurrent puts on {THREADS} threads in {:?}; load_all of {} pods in {:?}",
        lat[50],
        lat[90],
        lat[99],
        THREADS * PER,
        concurrent,
        report.pods.len(),
        load
    );
}

#[test]
fn bad_files_are_quarantined_with_reasons_and_the_rest_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let store = PodStore::open(dir).unwrap();
    let good1 = rec("good1", "eth0");
    let good2 = rec("good2", "eth0");
    store.put(&good1).unwrap();
    store.put(&good2).unwrap();

    // Truncated JSON.
    let k_trunc = PodKey::new("trunc", "eth0");
    let full = store::encode_record(&rec("trunc", "eth0")).unwrap();
    let n_trunc = file_name_for(&k_trunc);
    fs::write(dir.join(&n_trunc), &full[..full.len() / 2]).unwrap();

    // A schema version no agent wrote (0; a newer one refuses the load instead:
    // `a_newer_schema_refuses_the_load_and_moves_nothing`).
    let n_schema = file_name_for(&PodKey::new("schema0", "eth0"));
    let mut v: serde_json::Value =
        serde_json::from_slice(&store::encode_record(&rec("schema0", "eth0")).unwrap()).unwrap();
    v["schema"] = 0.into();
    fs::write(dir.join(&n_schema), serde_json::to_vec(&v).unwrap()).unwrap();

    // Oversized (valid JSON padded with whitespace beyond the limit).
    let n_big = file_name_for(&PodKey::new("big", "eth0"));
    let mut big = store::encode_record(&rec("big", "eth0")).unwrap();
    big.resize(MAX_FILE_BYTES + 1, b' ');
    fs::write(dir.join(&n_big), &big).unwrap();

    // File name / key mismatch: good1's bytes under another key's name.
    let n_moved = file_name_for(&PodKey::new("other", "eth0"));
    fs::copy(store.path_for(&good1.key), dir.join(&n_moved)).unwrap();

    // A directory named like a pod file (with something inside).
    let n_dir = file_name_for(&PodKey::new("dir", "eth0"));
    fs::create_dir(dir.join(&n_dir)).unwrap();
    fs::write(dir.join(&n_dir).join("x"), b"x").unwrap();

    // Invalid UTF-8.
    let n_utf8 = file_name_for(&PodKey::new("utf8", "eth0"));
    fs::write(dir.join(&n_utf8), b"{\"schema\":1,\"pod\":\"\xff\xfe\"}").unwrap();

    // A record breaking a field limit (written behind the store's back).
    let mut too_many = rec("ips", "eth0");
    too_many.ips = (0..17u8).map(|i| IpAddr::from([10, 0, 0, i])).collect();
    let n_ips = file_name_for(&too_many.key);
    fs::write(dir.join(&n_ips), store::encode_record(&too_many).unwrap()).unwrap();

    // Not ours: ignored and left alone.
    fs::write(dir.join("README"), b"hello").unwrap();
    fs::write(dir.join("notes.json"), b"{").unwrap();

    let report = store.load_all().unwrap();
    assert_eq!(report.pods, vec![good1.clone(), good2.clone()]);
    assert_eq!(report.quarantined.len(), 7, "{:#?}", report.quarantined);

    let r = reason_for(&report, &n_trunc);
    assert!(r.contains("invalid JSON") && r.contains("EOF"), "{r}");
    let r = reason_for(&report, &n_schema);
    assert!(
        r.contains("schema version 0") && r.contains("supports only schema 1"),
        "{r}"
    );
    let r = reason_for(&report, &n_big);
    assert!(
        r.contains("65537 bytes") && r.contains("65536-byte limit"),
        "{r}"
    );
    let r = reason_for(&report, &n_moved);
    assert!(
        r.contains("does not match the key inside") && r.contains("good1"),
        "{r}"
    );
    let r = reason_for(&report, &n_dir);
    assert!(r.contains("directory"), "{r}");
    let r = reason_for(&report, &n_utf8);
    assert!(r.contains("not UTF-8"), "{r}");
    let r = reason_for(&report, &n_ips);
    assert!(r.contains("17 IPs"), "{r}");

    // Each was moved (not deleted) to quarantine/<name>.<ms>; ours and foreign files stay.
    let q = quarantined_names(dir);
    assert_eq!(q.len(), 7, "{q:?}");
    for n in [
        &n_trunc, &n_schema, &n_big, &n_moved, &n_dir, &n_utf8, &n_ips,
    ] {
        assert!(!dir.join(n).exists(), "{n} still in the store");
        let moved = q
            .iter()
            .find(|q| q.starts_with(&format!("{n}.")))
            .unwrap_or_else(|| panic!("{n} not in quarantine: {q:?}"));
        let ms = &moved[n.len() + 1..];
        assert!(ms.parse::<u128>().is_ok(), "{moved}");
    }
    assert!(dir.join(n_dir.clone()).symlink_metadata().is_err());
    assert!(dir.join("README").exists() && dir.join("notes.json").exists());

    // A second load finds only the good pods and quarantines nothing more.
    let again = store.load_all().unwrap();
    assert_eq!(again.pods, vec![good1, good2]);
    assert!(again.quarantined.is_empty());
}

#[test]
fn get_reports_a_corrupt_file_without_moving_it() {
    let tmp = tempfile::tempdir().unwrap();
    let store = PodStore::open(tmp.path()).unwrap();
    let key = PodKey::new("c", "eth0");
    fs::write(store.path_for(&key), b"{\"schema\":1,").unwrap();
    let err = store.get(&key).unwrap_err();
    assert!(matches!(err, StoreError::Corrupt { .. }));
    let msg = err.to_string();
    assert!(
        msg.contains(&file_name_for(&key)) && msg.contains("invalid JSON"),
        "{msg}"
    );
    assert!(store.path_for(&key).exists());
}

#[test]
fn leftover_temp_files_are_cleaned_at_open() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let name = file_name_for(&PodKey::new("c", "eth0"));
    // A crashed writer: its PID is gone (a reaped child).
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = child.id();
    child.wait().unwrap();
    let t_dead = dir.join(format!("{name}.tmp-{dead}-00000000deadbeef-0"));
    fs::write(&t_dead, b"{\"schema\":1").unwrap();
    // A live process's temp file, but stale: removed too.
    let t_stale = dir.join(format!("{name}.tmp-1-00000000deadbeef-7"));
    fs::write(&t_stale, b"").unwrap();
    let old = SystemTime::now() - Duration::from_secs(3600);
    fs::File::options()
        .write(true)
        .open(&t_stale)
        .unwrap()
        .set_modified(old)
        .unwrap();
    // A live process's recent temp file (a write in progress elsewhere): kept.
    let t_live = dir.join(format!("{name}.tmp-1-00000000deadbeef-8"));
    fs::write(&t_live, b"").unwrap();
    // The same PID as ours with another nonce: an earlier life of this PID (an agent
    // restarted as PID 1 in a container). Removed although "our" PID is alive.
    let t_prev = dir.join(format!(
        "{name}.tmp-{}-00000000deadbeef-0",
        std::process::id()
    ));
    fs::write(&t_prev, b"").unwrap();
    // Not ours: untouched.
    fs::write(dir.join("other.tmp"), b"").unwrap();

    PodStore::open(dir).unwrap();
    assert!(!t_dead.exists());
    assert!(!t_stale.exists());
    assert!(!t_prev.exists());
    assert!(t_live.exists());
    assert!(dir.join("other.tmp").exists());
}

#[test]
fn crash_before_rename_leaves_no_pod() {
    // Simulates a kill between "temp written and fsync'd" and "rename": the complete
    // record sits in a temporary file only. The store must not load it, before or
    // after the cleanup of `open`, and the previous version must survive.
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let store = PodStore::open(dir).unwrap();
    let old = rec("c", "eth0");
    store.put(&old).unwrap();
    let mut new = old.clone();
    new.added_at_ms = new.added_at_ms.plus(1);
    let new_pod = rec("never-renamed", "eth0");
    let n1 = format!(
        "{}.tmp-999999999-0000000000000001-3",
        file_name_for(&new.key)
    );
    let n2 = format!(
        "{}.tmp-999999999-0000000000000001-4",
        file_name_for(&new_pod.key)
    );
    fs::write(dir.join(&n1), store::encode_record(&new).unwrap()).unwrap();
    fs::write(dir.join(&n2), store::encode_record(&new_pod).unwrap()).unwrap();

    // The running store (before any reopen) skips them.
    let report = store.load_all().unwrap();
    assert_eq!(report.pods, vec![old.clone()]);
    assert!(report.quarantined.is_empty());

    // Restart: reopen cleans them (PID 999999999 does not exist) and loads the old one.
    let store = PodStore::open(dir).unwrap();
    assert!(!dir.join(&n1).exists() && !dir.join(&n2).exists());
    let report = store.load_all().unwrap();
    assert_eq!(report.pods, vec![old]);
    assert!(report.quarantined.is_empty());
}

#[test]
fn symlink_at_the_target_path_is_replaced_not_followed() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside");
    fs::create_dir(&outside).unwrap();
    let victim = outside.join("victim");
    fs::write(&victim, b"precious").unwrap();
    let dir = tmp.path().join("pods");
    let store = PodStore::open(&dir).unwrap();
    let r = rec("c", "eth0");
    let target = store.path_for(&r.key);
    symlink(&victim, &target).unwrap();
    // A dangling symlink too (a write through it would create the file outside).
    let r2 = rec("c2", "eth0");
    let dangling = outside.join("created-by-us");
    symlink(&dangling, store.path_for(&r2.key)).unwrap();

    store.put(&r).unwrap();
    store.put(&r2).unwrap();
    assert_eq!(fs::read(&victim).unwrap(), b"precious");
    assert!(!dangling.exists());
    assert!(fs::symlink_metadata(&target).unwrap().is_file());
    assert_eq!(mode(&target), 0o600);
    assert_eq!(store.load_all().unwrap().pods, vec![r, r2]);
}

#[test]
fn symlink_planted_as_a_pod_file_is_quarantined_not_read() {
    let tmp = tempfile::tempdir().unwrap();
    let outside = tmp.path().join("outside.json");
    let r = rec("c", "eth0");
    fs::write(&outside, store::encode_record(&r).unwrap()).unwrap();
    let store = PodStore::open(&tmp.path().join("pods")).unwrap();
    symlink(&outside, store.path_for(&r.key)).unwrap();
    assert!(matches!(store.get(&r.key), Err(StoreError::Corrupt { .. })));
    let report = store.load_all().unwrap();
    assert!(report.pods.is_empty());
    assert!(report.quarantined[0].1.contains("symlink"));
    // The link itself was moved; its target is untouched.
    assert!(outside.exists());
}

#[test]
fn store_dir_that_is_a_symlink_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let real = tmp.path().join("real");
    fs::create_dir(&real).unwrap();
    let link = tmp.path().join("link");
    symlink(&real, &link).unwrap();
    let err = PodStore::open(&link).unwrap_err();
    assert!(matches!(err, StoreError::DirIsSymlink { .. }), "{err}");
    assert!(err.to_string().contains("link") && err.to_string().contains("symlink"));

    let file = tmp.path().join("file");
    fs::write(&file, b"").unwrap();
    assert!(matches!(
        PodStore::open(&file),
        Err(StoreError::NotADirectory { .. })
    ));

    // A symlinked quarantine dir is not used either: the bad file stays, not loaded.
    let store = PodStore::open(&real).unwrap();
    let elsewhere = tmp.path().join("elsewhere");
    fs::create_dir(&elsewhere).unwrap();
    symlink(&elsewhere, real.join(QUARANTINE_DIR)).unwrap();
    fs::write(real.join("pod-bad.json"), b"{").unwrap();
    let report = store.load_all().unwrap();
    assert!(report.quarantined[0].1.contains("could not quarantine"));
    assert!(real.join("pod-bad.json").exists());
    assert_eq!(fs::read_dir(&elsewhere).unwrap().count(), 0);
}

#[test]
fn put_refuses_invalid_and_oversized_records() {
    let tmp = tempfile::tempdir().unwrap();
    let store = PodStore::open(tmp.path()).unwrap();
    let cases: Vec<(PodRecord, &str)> = vec![
        (rec("", "eth0"), "container id"),
        (rec(&"x".repeat(257), "eth0"), "container id"),
        (rec("c", &"i".repeat(16)), "interface name"),
        (
            PodRecord {
                name: "n".repeat(254),
                ..rec("c", "eth0")
            },
            "pod name",
        ),
        (
            PodRecord {
                ports: vec![
                    PodPort {
                        app_port: 1,
                        listen_port: 2,
                        protocol: Protocol::Tcp,
                        proxyless: false,
                    };
                    pod::MAX_PORTS + 1
                ],
                ..rec("c", "eth0")
            },
            "33 ports",
        ),
    ];
    for (r, want) in cases {
        let err = store.put(&r).unwrap_err();
        assert!(matches!(err, StoreError::InvalidRecord { .. }), "{err}");
        let msg = err.to_string();
        assert!(msg.contains(want) && msg.contains("pod-"), "{msg}");
    }
    // The largest record the validator allows, with as many bytes as possible escaped
    // by JSON (`"` is 2 bytes), still fits the file limit: whatever `put` accepts, a
    // later load accepts too (no record is stored only to be quarantined at the next
    // start). `RecordTooLarge` is the backstop should the limits ever grow.
    let quotes = |n: usize| "\"".repeat(n);
    let label = |n: usize| "a".repeat(n);
    let max = PodRecord {
        netns: format!("/{}", quotes(pod::MAX_NETNS_LEN - 1)),
        name: label(pod::MAX_NAME_LEN),
        namespace: label(pod::MAX_LABEL_LEN),
        uid: quotes(pod::MAX_UID_LEN),
        service: label(pod::MAX_LABEL_LEN),
        service_account: label(pod::MAX_NAME_LEN),
        network_name: quotes(pod::MAX_NAME_LEN),
        ips: vec!["fd00:ffff:ffff:ffff:ffff:ffff:ffff:ffff".parse().unwrap(); pod::MAX_IPS],
        ports: (0..pod::MAX_PORTS as u16)
            .map(|i| PodPort {
                app_port: 65535 - i,
                listen_port: pod::INBOUND_BASE_PORT + i,
                protocol: Protocol::Grpc,
                proxyless: false,
            })
            .collect(),
        added_at_ms: UnixMs(u64::MAX),
        // Every capture list at its limit, with the longest entries.
        capture: Some(PodCapture {
            mode: flock_core::capture::Mode::Permissive,
            mark: u32::MAX,
            probe_sources: (0..MAX_SPEC_ENTRIES as u128)
                .map(|i| Cidr::host(std::net::Ipv6Addr::from(u128::MAX - i).into()))
                .collect(),
            exclude_outbound_ports: (0..MAX_SPEC_ENTRIES as u16).map(|i| 65535 - i).collect(),
            exclude_outbound_cidrs: (0..MAX_SPEC_ENTRIES as u128)
                .map(|i| {
                    Cidr::new(std::net::Ipv6Addr::from(u128::MAX - (i << 8)).into(), 120).unwrap()
                })
                .collect(),
            exclude_inbound_ports: (0..MAX_SPEC_ENTRIES as u16).map(|i| 65535 - i).collect(),
        }),
        // The longest annotation, all of it escaped.
        authz: Some(quotes(flock_core::authz::MAX_ANNOTATION_BYTES)),
        ..rec(
            &label(pod::MAX_CONTAINER_ID_LEN),
            &label(pod::MAX_IFNAME_LEN),
        )
    };
    store::validate_record(&max).unwrap();
    let size = store::encode_record(&max).unwrap().len();
    println!("largest valid record encodes to {size} bytes (limit {MAX_FILE_BYTES})");
    assert!(size <= MAX_FILE_BYTES);
    store.put(&max).unwrap();
    assert_eq!(store.get(&max.key).unwrap(), Some(max.clone()));
    assert!(store.load_all().unwrap().quarantined.is_empty());
}

/// A record that is well-formed JSON of the right schema but that the agent could not
/// serve (no IP: the mesh builder needs one; a service name the translation refuses;
/// listener ports off the rule) is quarantined at load with the field named, never
/// handed to the agent.
#[test]
fn schema_valid_but_unservable_records_are_quarantined_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    let store = PodStore::open(tmp.path()).unwrap();
    let good = rec("good", "eth0");
    store.put(&good).unwrap();
    let bad = [
        (
            PodRecord {
                ips: vec![],
                ..rec("noip", "eth0")
            },
            "IPs",
        ),
        (
            PodRecord {
                service: "reviews.v2".into(),
                ..rec("dotted", "eth0")
            },
            "flock.io/service",
        ),
        (
            PodRecord {
                ports: vec![PodPort {
                    app_port: 8080,
                    listen_port: 15001,
                    protocol: Protocol::Http,
                    proxyless: false,
                }],
                ..rec("listener", "eth0")
            },
            "flock.io/ports",
        ),
    ];
    for (r, _) in &bad {
        // Written as an older or tampered agent would have: `put` would refuse it.
        assert!(store.put(r).is_err());
        fs::write(store.path_for(&r.key), store::encode_record(r).unwrap()).unwrap();
    }
    let report = store.load_all().unwrap();
    assert_eq!(report.pods, vec![good]);
    for (r, field) in &bad {
        let reason = reason_for(&report, &file_name_for(&r.key));
        assert!(reason.contains(field), "{reason}");
    }
}

#[test]
fn decode_record_rejects_garbage_without_panicking() {
    let r = rec("c", "eth0");
    let name = file_name_for(&r.key);
    let good = store::encode_record(&r).unwrap();
    assert_eq!(store::decode_record(&name, &good).unwrap(), r);
    for bad in [
        &b""[..],
        b"null",
        b"[]",
        b"{\"schema\":\"1\",\"pod\":{}}",
        b"{\"schema\":1}",
        b"{\"pod\":{}}",
        b"{\"schema\":1,\"pod\":{},\"extra\":1}",
    ] {
        assert!(store::decode_record(&name, bad).is_err());
    }
    let deep = "[".repeat(100_000);
    assert!(store::decode_record(&name, deep.as_bytes()).is_err());
    let mut unknown: serde_json::Value = serde_json::from_slice(&good).unwrap();
    unknown["pod"]["color"] = "blue".into();
    let e = store::decode_record(&name, &serde_json::to_vec(&unknown).unwrap()).unwrap_err();
    assert!(e.contains("color"), "{e}");
}

/// Valid records (the validator's alphabet, up to its limits): the store must keep
/// every record the validator accepts.
fn arb_record() -> impl Strategy<Value = PodRecord> {
    let ip = prop_oneof![
        any::<[u8; 4]>().prop_map(IpAddr::from),
        any::<[u8; 16]>().prop_map(IpAddr::from),
    ]
    .prop_filter("unicast", |ip| pod::check_ip(*ip).is_ok());
    let protocol = prop_oneof![
        Just(Protocol::Http),
        Just(Protocol::Grpc),
        Just(Protocol::Tcp)
    ];
    let ports = proptest::collection::btree_set(1u16..15000, 0..=8)
        .prop_flat_map(move |apps| {
            let n = apps.len();
            (Just(apps), proptest::collection::vec(protocol.clone(), n))
        })
        .prop_map(|(apps, protocols)| {
            apps.into_iter()
                .zip(protocols)
                .enumerate()
                .map(|(i, (app_port, protocol))| PodPort {
                    app_port,
                    listen_port: pod::INBOUND_BASE_PORT + i as u16,
                    protocol,
                    proxyless: false,
                })
                .collect::<Vec<_>>()
        });
    (
        ("[a-f0-9]{1,64}", "[a-z][a-z0-9]{0,14}"),
        (
            "[a-z0-9]([a-z0-9.-]{0,40}[a-z0-9])?",
            "[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?",
            "[ -~]{0,128}",
            "/[ -~]{0,80}",
        ),
        proptest::collection::vec(ip, 1..=16),
        (
            "[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?",
            "([a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?)?",
            "[ -~]{0,40}",
        ),
        ports,
        any::<u64>(),
    )
        .prop_map(
            |(
                (id, ifname),
                (name, namespace, uid, netns),
                ips,
                (service, service_account, network_name),
                ports,
                added_at_ms,
            )| PodRecord {
                key: PodKey::new(id, ifname),
                name,
                namespace,
                uid,
                netns,
                ips,
                service,
                service_account,
                ports,
                network_name,
                added_at_ms: UnixMs(added_at_ms),
                capture: None,
                authz: None,
                labels: Default::default(),
            },
        )
        // A regex can still give `a..b` or a `/../` path: keep the valid ones.
        .prop_filter("valid", |r| store::validate_record(r).is_ok())
}

proptest! {
    // Each case fsyncs: keep the count modest.
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn random_records_round_trip_through_put_and_load_all(
        recs in proptest::collection::vec(arb_record(), 1..6)
    ) {
        let tmp = tempfile::tempdir().unwrap();
        let store = PodStore::open(tmp.path()).unwrap();
        let mut want = std::collections::BTreeMap::new();
        for r in &recs {
            store.put(r).unwrap();
            want.insert(r.key.clone(), r.clone()); // A later put of a key wins.
        }
        for (k, r) in &want {
            prop_assert_eq!(store.get(k).unwrap(), Some(r.clone()));
        }
        let report = store.load_all().unwrap();
        prop_assert!(report.quarantined.is_empty(), "{:?}", report.quarantined);
        prop_assert_eq!(report.pods, want.into_values().collect::<Vec<_>>());
    }

    #[test]
    fn arbitrary_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = store::decode_record("pod-00000000000000000000000000000000.json", &bytes);
    }
}

/// A rollback: the store holds a file a newer agent wrote (a newer schema). This
/// agent refuses to load rather than quarantine it and drop that pod: the load fails
/// naming the file, its schema and what to do, and every file stays where it was.
#[test]
fn a_newer_schema_refuses_the_load_and_moves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let store = PodStore::open(dir).unwrap();
    store.put(&rec("older", "eth0")).unwrap();
    let n_newer = file_name_for(&PodKey::new("newer", "eth0"));
    let mut v: serde_json::Value =
        serde_json::from_slice(&store::encode_record(&rec("newer", "eth0")).unwrap()).unwrap();
    v["schema"] = (store::SCHEMA_VERSION + 1).into();
    v["pod"]["a_field_of_the_future"] = true.into();
    fs::write(dir.join(&n_newer), serde_json::to_vec(&v).unwrap()).unwrap();
    let e = store.load_all().unwrap_err().to_string();
    assert!(
        e.contains(&n_newer)
            && e.contains(&format!("schema {}", store::SCHEMA_VERSION + 1))
            && e.contains("newer flock-agent")
            && e.contains("roll forward"),
        "{e}"
    );
    assert!(dir.join(&n_newer).exists(), "the newer file was moved");
    assert!(quarantined_names(dir).is_empty());
    assert!(
        dir.join(file_name_for(&PodKey::new("older", "eth0")))
            .exists()
    );
}
