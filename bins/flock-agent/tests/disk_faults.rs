//! Disk faults of the pod store: the real `flock-agent` with its state dir on a real
//! size-limited tmpfs (mounted by the test, unmounted by a guard also when the test
//! fails), driven through the real `flock-cni` plugin binary (invoked as a runtime
//! invokes a chained plugin: `CNI_*` environment and a config with `prevResult` on
//! stdin).
//!
//! * Full (`ENOSPC`): every ADD fails with CNI error 100 naming the store path and
//!   "No space left on device"; no temporary file is left; every stored record is
//!   byte-identical and every earlier pod still served; a DEL still works (unlinking
//!   needs no space). Once the filler file is deleted the next ADD succeeds, with no
//!   agent restart, and a restart loads exactly the acknowledged pods.
//! * Read-only (`mount -o remount,ro`): ADD fails the same way ("Read-only file
//!   system"); a DEL fails too (CNI error 100, so the runtime retries it) and keeps
//!   the pod whole: still served, still stored, still there after a restart on the
//!   read-only store (no acknowledged removal is undone, no pod lost). After `remount,rw`
//!   the retried DEL and new ADDs succeed without a restart, and a restart loads
//!   exactly the acknowledged pods.
//!
//! Needs root (`mount`): a peers-tier test. When mounting a tmpfs is refused it
//! fails, saying so, unless `FLOCK_ALLOW_SKIP` names `disk_faults` (a
//! whitespace-separated list; tests/README.md): then it prints SKIPPED and passes. A
//! skip that is not asked for would let the suite pass without this evidence.
//! Prints the figures: operations during the fault, failures, time to recover.

mod common;

use common::{Agent, WAIT, sibling_bin};
use flock_core::pod::PodKey;
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Size of the tmpfs holding the store: room for the pods, small enough to fill fast.
const TMPFS_SIZE: &str = "1m";
/// Pods added (and acknowledged) before the fault.
const BEFORE: usize = 5;
/// ADD attempts while the fault lasts.
const DURING: usize = 20;

/// A tmpfs mounted at a directory; unmounted on drop (lazily if still busy), so a
/// failing test leaves no mount behind.
struct Tmpfs {
    at: PathBuf,
}

impl Tmpfs {
    /// Mounts a `size` tmpfs (mode 0700, as the store creates its directory) at `at`;
    /// `Err` with mount's message when that is not permitted.
    fn mount(at: &Path, size: &str) -> Result<Self, String> {
        std::fs::create_dir_all(at).map_err(|e| format!("create {}: {e}", at.display()))?;
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size},mode=0700")])
            .arg("flock-disk-faults")
            .arg(at)
            .output()
            .map_err(|e| format!("run mount: {e}"))?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).trim().to_owned());
        }
        Ok(Self { at: at.to_owned() })
    }

    /// `mount -o remount,<how>`.
    fn remount(&self, how: &str) {
        let out = Command::new("mount")
            .args(["-o", &format!("remount,{how}")])
            .arg(&self.at)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "remount,{how} {}: {}",
            self.at.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let ok = Command::new("umount")
            .arg(&self.at)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            let _ = Command::new("umount").arg("-l").arg(&self.at).status();
        }
    }
}

/// Whether `FLOCK_ALLOW_SKIP` (whitespace-separated test binary names) lets this
/// binary skip when it cannot mount.
fn skip_allowed() -> bool {
    std::env::var("FLOCK_ALLOW_SKIP")
        .unwrap_or_default()
        .split_whitespace()
        .any(|name| name == "disk_faults")
}

/// The agent (state dir on a fresh tmpfs) and the mount. `None` (after printing
/// why) when this process may not mount and `FLOCK_ALLOW_SKIP` allows the skip;
/// without that opt-out a refused mount fails the test.
struct Node {
    /// Dropped first: unmounted while the agent's temp dir still exists.
    store: Tmpfs,
    agent: Agent,
}

impl Node {
    fn start() -> Option<Self> {
        // Probe first, on a scratch dir: a refusal fails the test unless the run opted
        // out of it explicitly.
        let probe_dir = tempfile::tempdir().unwrap();
        match Tmpfs::mount(&probe_dir.path().join("m"), "64k") {
            Ok(probe) => drop(probe),
            Err(e) if skip_allowed() => {
                println!(
                    "SKIPPED (FLOCK_ALLOW_SKIP names disk_faults): mounting a tmpfs is not \
                     permitted here ({e})"
                );
                return None;
            }
            Err(e) => panic!(
                "mounting a tmpfs is not permitted here ({e}): the disk-fault tests need root \
                 with CAP_SYS_ADMIN (scripts/test runs them as root). To skip them on purpose, \
                 set FLOCK_ALLOW_SKIP=disk_faults"
            ),
        }
        // The agent creates its temp dir; restart it on a tmpfs mounted at its store.
        let mut agent = Agent::start_node("n1", "memory", &[]);
        agent.kill9();
        let store = Tmpfs::mount(&agent.state_dir, TMPFS_SIZE).unwrap();
        let mut node = Self { store, agent };
        node.restart();
        Some(node)
    }

    /// SIGKILL and start again on the same state (the registry is in memory: the store
    /// is the only state that survives).
    fn restart(&mut self) {
        self.agent.respawn("n1", "memory", &[]);
        self.agent.wait_ready(WAIT);
    }

    /// The real plugin, run as a runtime runs a chained plugin.
    fn cni(&self, verb: &str, pod: usize) -> Output {
        let plugin = sibling_bin("flock-cni");
        let name = format!("web-{pod}");
        let conf = json!({
            "cniVersion": "1.1.0",
            "name": "net",
            "type": "flock-cni",
            "agent_socket": self.agent.cni_socket,
            "timeout_ms": 10_000,
            "runtimeConfig": {"io.kubernetes.cri.pod-annotations": {
                "flock.io/service": "web", "flock.io/ports": "8080"
            }},
            "prevResult": {
                "cniVersion": "1.1.0",
                "interfaces": [{"name": "eth0", "sandbox": common::pods_netns()}],
                "ips": [{"address": format!("10.7.{}.{}/16", pod / 200, pod % 200 + 2), "interface": 0}]
            }
        });
        let mut child = Command::new(&plugin)
            .env_clear()
            .env("CNI_COMMAND", verb)
            .env("CNI_CONTAINERID", container(pod))
            .env("CNI_NETNS", common::pods_netns())
            .env("CNI_IFNAME", "eth0")
            .env("CNI_PATH", plugin.parent().unwrap())
            .env(
                "CNI_ARGS",
                format!(
                    "IgnoreUnknown=1;K8S_POD_NAMESPACE=default;K8S_POD_NAME={name};K8S_POD_UID=uid-{name}"
                ),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(conf.to_string().as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    }

    /// Runs `verb` for `pod` and panics unless the plugin succeeded.
    fn cni_ok(&self, verb: &str, pod: usize) {
        let out = self.cni(verb, pod);
        assert!(
            out.status.success(),
            "{verb} {}: {}{}",
            container(pod),
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    /// Runs `verb` for `pod`, requires the CNI error 100 whose message has every
    /// needle, and returns the message.
    fn cni_fails(&self, verb: &str, pod: usize, needles: &[&str]) -> String {
        let out = self.cni(verb, pod);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            !out.status.success(),
            "{verb} {} succeeded during the fault: {stdout}",
            container(pod)
        );
        let err: Value = serde_json::from_str(&stdout)
            .unwrap_or_else(|e| panic!("{verb}: not a CNI error JSON ({e}): {stdout}"));
        assert_eq!(err["code"], 100, "{verb}: {err}");
        let msg = err["msg"].as_str().unwrap_or_default().to_owned();
        for needle in needles {
            assert!(msg.contains(needle), "{verb}: {needle:?} not in {msg:?}");
        }
        msg
    }

    /// The addresses of the endpoints in the agent's registry view (`/debug/registry`).
    fn registered(&self) -> BTreeSet<String> {
        let reg = self.agent.json("/debug/registry");
        let eps: Vec<Value> = match &reg["endpoints"] {
            Value::Object(m) => m.values().cloned().collect(),
            Value::Array(a) => a.clone(),
            other => panic!("/debug/registry endpoints: {other}"),
        };
        eps.iter()
            .map(|e| e["address"].as_str().unwrap_or_default().to_owned())
            .collect()
    }

    /// Container IDs of the pods the agent serves (`/debug/pods`).
    fn served(&self) -> Vec<String> {
        let mut ids: Vec<String> = self.agent.json("/debug/pods")["pods"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| p["container_id"].as_str().unwrap().to_owned())
            .collect();
        ids.sort();
        ids
    }

    /// Every file in the store directory, name → bytes (the quarantine dir as a
    /// name with no bytes).
    fn store_contents(&self) -> BTreeMap<String, Vec<u8>> {
        std::fs::read_dir(&self.agent.state_dir)
            .unwrap()
            .flatten()
            .filter(|e| e.file_name() != "filler")
            .map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                (name, std::fs::read(e.path()).unwrap_or_default())
            })
            .collect()
    }

    fn pod_errors(&self) -> u64 {
        let (_, text) = self.agent.get("/metrics");
        text.lines()
            .find_map(|l| {
                l.strip_prefix("flock_agent_pod_errors_total ")?
                    .trim()
                    .parse()
                    .ok()
            })
            .unwrap_or_else(|| panic!("no flock_agent_pod_errors_total in {text}"))
    }

    /// The agent answers its admin endpoint and CHECK of every pod in `pods`.
    fn assert_responsive(&self, pods: &[usize]) {
        assert_eq!(self.agent.get("/healthz").0, 200);
        assert_eq!(self.agent.get("/readyz").0, 200);
        for &pod in pods {
            self.cni_ok("CHECK", pod);
        }
    }
}

fn container(pod: usize) -> String {
    format!("disk-fault-{pod:04}")
}

fn containers(pods: impl IntoIterator<Item = usize>) -> Vec<String> {
    let mut ids: Vec<String> = pods.into_iter().map(container).collect();
    ids.sort();
    ids
}

/// Fills the filesystem of `dir` with `<dir>/filler` until `ENOSPC`; returns its size.
fn fill(dir: &Path) -> u64 {
    let mut f = std::fs::File::create(dir.join("filler")).unwrap();
    let chunk = vec![0xa5u8; 4096];
    let mut written = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(n) => written += n as u64,
            Err(e) if e.raw_os_error() == Some(28) => break,
            Err(e) => panic!("filling {}: {e}", dir.display()),
        }
    }
    // The fault is real: not even one byte fits.
    let probe = dir.join("probe");
    let one = std::fs::write(&probe, b"x");
    let _ = std::fs::remove_file(&probe);
    assert_eq!(
        one.map_err(|e| e.raw_os_error()),
        Err(Some(28)),
        "the tmpfs is not full"
    );
    written
}

/// Every record in `before` but `deleted`'s is in `now`, byte for byte.
fn assert_intact(
    before: &BTreeMap<String, Vec<u8>>,
    now: &BTreeMap<String, Vec<u8>>,
    deleted: usize,
) {
    let gone = flock_bird::store::file_name_for(&PodKey::new(container(deleted), "eth0"));
    assert!(before.contains_key(&gone) && !now.contains_key(&gone));
    for (name, bytes) in before.iter().filter(|(n, _)| **n != gone) {
        assert_eq!(now.get(name), Some(bytes), "{name} changed or is gone");
    }
}

/// Names of temporary files (writes in progress or leftovers) in the store.
fn temp_files(contents: &BTreeMap<String, Vec<u8>>) -> Vec<&String> {
    contents.keys().filter(|n| n.contains(".tmp-")).collect()
}

#[test]
fn a_full_pod_store_fails_add_clearly_damages_nothing_and_recovers_without_a_restart() {
    let Some(mut node) = Node::start() else {
        return;
    };
    let state = node.agent.state_dir.display().to_string();
    for pod in 0..BEFORE {
        node.cni_ok("ADD", pod);
    }
    let before = node.store_contents();
    assert_eq!(before.len(), BEFORE, "{:?}", before.keys());
    let errors_before = node.pod_errors();
    let registered_before = node.registered();
    assert_eq!(registered_before.len(), BEFORE, "{registered_before:?}");

    let filler = fill(&node.agent.state_dir);
    let fault = Instant::now();
    let mut failures = 0;
    let mut slowest = Duration::ZERO;
    for pod in 100..100 + DURING {
        let t = Instant::now();
        let msg = node.cni_fails("ADD", pod, &[&state, "No space left on device", "is full"]);
        slowest = slowest.max(t.elapsed());
        failures += 1;
        if pod == 100 {
            println!("ADD on the full store: {msg}");
        }
    }
    assert_eq!(node.pod_errors() - errors_before, DURING as u64);
    let during = node.store_contents();
    assert!(
        temp_files(&during).is_empty(),
        "left behind: {:?}",
        temp_files(&during)
    );
    assert_eq!(during, before, "stored records changed during the fault");
    assert_eq!(node.served(), containers(0..BEFORE));
    // An ADD runs its in-process steps while its record is written (the write fails
    // after the pod was published): rolled back, and nothing of it registered.
    assert_eq!(node.registered(), registered_before);
    node.assert_responsive(&[0, BEFORE - 1]);

    // DEL needs no space on a full disk: it works, and is not undone by a restart.
    node.cni_ok("DEL", 0);
    assert_eq!(node.store_contents().len(), BEFORE - 1);
    // Unlinking freed a page: take it again, so the fault still holds.
    fill_more(&node.agent.state_dir);
    node.cni_fails("ADD", 100 + DURING, &[&state, "No space left on device"]);
    failures += 1;

    // Space freed: the very next ADD succeeds, no restart.
    std::fs::remove_file(node.agent.state_dir.join("filler")).unwrap();
    let freed = Instant::now();
    node.cni_ok("ADD", 200);
    let recovered = freed.elapsed();
    let fault_lasted = fault.elapsed();
    node.cni_ok("ADD", 201);
    let expected = containers((1..BEFORE).chain([200, 201]));
    assert_eq!(node.served(), expected);
    assert!(temp_files(&node.store_contents()).is_empty());

    node.restart();
    assert_eq!(node.served(), expected, "after a restart");
    assert!(
        !node
            .agent
            .state_dir
            .join(flock_bird::store::QUARANTINE_DIR)
            .exists()
    );
    assert_intact(&before, &node.store_contents(), 0);
    println!(
        "full store ({TMPFS_SIZE} tmpfs, filler {filler} bytes): {} ADDs during the fault, \
         {failures} failed (slowest answer {slowest:?}); fault lasted {fault_lasted:?}; \
         first ADD after freeing space succeeded in {recovered:?} (no restart)",
        DURING + 1
    );
}

/// Takes any space freed since [`fill`] (the filler exists and is appended to).
fn fill_more(dir: &Path) {
    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .open(dir.join("filler"))
        .unwrap();
    let chunk = vec![0x5au8; 4096];
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(28) => break,
            Err(e) => panic!("filling {}: {e}", dir.display()),
        }
    }
}

#[test]
fn a_read_only_pod_store_fails_add_and_del_clearly_keeps_every_pod_and_recovers_on_remount() {
    let Some(mut node) = Node::start() else {
        return;
    };
    let state = node.agent.state_dir.display().to_string();
    for pod in 0..BEFORE {
        node.cni_ok("ADD", pod);
    }
    let before = node.store_contents();
    assert_eq!(before.len(), BEFORE);
    let errors_before = node.pod_errors();

    node.store.remount("ro");
    let fault = Instant::now();
    let mut failures = 0;
    let mut slowest = Duration::ZERO;
    for pod in 100..100 + DURING {
        let t = Instant::now();
        let msg = node.cni_fails("ADD", pod, &[&state, "Read-only file system", "read-only"]);
        slowest = slowest.max(t.elapsed());
        failures += 1;
        if pod == 100 {
            println!("ADD on the read-only store: {msg}");
        }
    }
    // DEL fails (the runtime retries it) and changes nothing: pod 0 stays served.
    let msg = node.cni_fails(
        "DEL",
        0,
        &[
            &state,
            "Read-only file system",
            "kept",
            "until a DEL succeeds",
        ],
    );
    println!("DEL on the read-only store: {msg}");
    failures += 1;
    // A DEL of a pod that was never stored is still a success (nothing to delete).
    node.cni_ok("DEL", 100);
    assert_eq!(node.pod_errors() - errors_before, DURING as u64 + 1);
    assert_eq!(node.store_contents(), before);
    assert_eq!(node.served(), containers(0..BEFORE));
    node.assert_responsive(&[0, BEFORE - 1]);

    // A restart on the read-only store: the failed DEL's pod is there, as it was
    // served; nothing acknowledged is lost.
    node.restart();
    assert_eq!(
        node.served(),
        containers(0..BEFORE),
        "restart while read-only"
    );
    node.cni_fails("ADD", 150, &[&state, "Read-only file system"]);
    failures += 1;

    node.store.remount("rw");
    let freed = Instant::now();
    node.cni_ok("DEL", 0); // the runtime's retry
    let recovered = freed.elapsed();
    let fault_lasted = fault.elapsed();
    node.cni_ok("ADD", 200);
    let expected = containers((1..BEFORE).chain([200]));
    assert_eq!(node.served(), expected);
    let after = node.store_contents();
    assert!(temp_files(&after).is_empty(), "{:?}", temp_files(&after));
    assert_intact(&before, &after, 0);
    assert_eq!(after.len(), BEFORE);

    node.restart();
    assert_eq!(node.served(), expected, "after a restart");
    println!(
        "read-only store: {} ADDs + 1 DEL during the fault, {failures} failed (slowest \
         answer {slowest:?}); fault lasted {fault_lasted:?} (one agent restart inside); \
         retried DEL after remount,rw succeeded in {recovered:?} (no restart)",
        DURING + 1
    );
}
