//! Clock faults: a real agent's wall clock stepped +6 h, then to −6 h, then back,
//! while it runs with pods on a real etcd. What must not happen, and is measured:
//!
//! * **no mass expiry**: the etcd lease is kept alive (every endpoint key of the node
//!   stays in etcd under the one lease it was put with, at every poll);
//! * **no rotation storm, no rotation stall**: the SVIDs the built-in CA signs
//!   (`flock_identity_svids_issued_total`) stay within what *monotonic* time warrants —
//!   one per identity at its first subscription, then one per identity per half-life.
//!   With the schedule on the wall clock, the step forward rotates every identity at
//!   once and the step back stops rotation for hours;
//! * **no premature GC**: orphan-GC sweeps keep running (one a second) and a CNI GC
//!   lists every pod as valid, and no pod, store file or endpoint is collected —
//!   including pods whose `added_at_ms` the step put six hours into the future or past.
//!
//! The wall clock is faked at its one source: the agent is the test build, with
//! flock-clock's test-only `clock-fault` hook (enabled by this crate's
//! dev-dependencies), and reads the offset from a file this test rewrites. A time
//! namespace cannot move `CLOCK_REALTIME`, and stepping the host's clock would step
//! every process on the machine; here only the agent's clock moves, as when one node's
//! clock is stepped while etcd's is right. etcd is real (`FLOCK_ETCD_BIN`); the
//! agent's pods are added through its CNI socket with the plugin's own client. Waits
//! are polls with deadlines; the phases are lengths of real time the faults last.

mod common;

use common::*;
use flock_cni::proto::v1::{
    AddPodRequest, Attachment, GarbageCollectRequest, IpConfig, Outcome, PodRef,
};
use serde_json::{Value, json};
use std::collections::BTreeSet;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::{Duration, Instant};

/// `--registry-ttl`, seconds: the lease expires 2 s after its last keep-alive.
const LEASE_TTL_S: u64 = 2;
/// `--svid-ttl`, seconds: rotation every 10 s of monotonic time.
const SVID_TTL_S: u64 = 20;
const HALF_LIFE: Duration = Duration::from_secs(SVID_TTL_S / 2);
const HOUR_MS: i64 = 3_600_000;
const NETWORK: &str = "flock-test";
/// The node's keys in etcd (the agent's default prefix).
const NODE_PREFIX: &str = "/flock/endpoints/n1/";
/// One service account per identity; two pods each.
const ACCOUNTS: [&str; 3] = ["sa1", "sa2", "sa3"];

/// Blocking harness calls (HTTP polls, process waits) off the runtime's workers.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// The agent on `etcd` with its wall clock offset by what `offset_file` holds.
fn start_agent(etcd: &Etcd, offset_file: &Path) -> Agent {
    let (ttl, svid_ttl) = (LEASE_TTL_S.to_string(), SVID_TTL_S.to_string());
    let agent = Agent::start_node_env(
        "n1",
        &etcd.registry_spec(),
        &[
            "--registry-ttl",
            &ttl,
            "--svid-ttl",
            &svid_ttl,
            "--gc-interval",
            "1",
        ],
        &[("FLOCK_TEST_CLOCK_OFFSET_FILE", offset_file.as_os_str())],
    );
    assert!(
        agent.proc.log_text().contains("test-only clock-fault hook"),
        "the agent was built without flock-clock's clock-fault feature (bins/flock-agent's \
         dev-dependencies enable it in test builds):\n{}",
        agent.proc.log_text()
    );
    agent
}

/// Steps the agent's wall clock to real time + `offset_ms` (atomically: the agent
/// reads the file on every clock read).
fn set_offset(file: &Path, offset_ms: i64) {
    let tmp = file.with_extension("tmp");
    std::fs::write(&tmp, offset_ms.to_string()).unwrap();
    std::fs::rename(&tmp, file).unwrap();
}

/// AddPod `p<i>` (service `web`, port 8080, service account `sa`) on the CNI socket.
async fn add_pod(socket: &Path, i: u32, sa: &str) {
    let name = format!("p{i}");
    let req = AddPodRequest {
        container_id: format!("c{i}"),
        netns: common::pods_netns().into(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: name.clone(),
            namespace: "default".into(),
            uid: format!("uid-{name}"),
        }),
        ips: vec![IpConfig {
            address: format!("10.9.0.{}/16", 10 + i),
            ..IpConfig::default()
        }],
        annotations: [
            ("flock.io/service", "web"),
            ("flock.io/ports", "8080"),
            ("flock.io/service-account", sa),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect(),
        network_name: NETWORK.into(),
        cni_version: "1.1.0".into(),
        prev_result_json: String::new(),
    };
    let resp = flock_cni::client::call(socket, Duration::from_secs(10), |mut c| async move {
        c.add_pod(req).await
    })
    .await
    .unwrap_or_else(|e| panic!("AddPod {name}: {e}"));
    assert_eq!(
        resp.outcome,
        Outcome::Success as i32,
        "AddPod {name}: {}",
        resp.message
    );
}

/// A CNI GC from the runtime listing pods `0..pods` as valid; returns how many
/// attachments the agent removed.
async fn cni_gc(socket: &Path, pods: u32) -> u32 {
    let req = GarbageCollectRequest {
        network_name: NETWORK.into(),
        valid_attachments: (0..pods)
            .map(|i| Attachment {
                container_id: format!("c{i}"),
                ifname: "eth0".into(),
            })
            .collect(),
    };
    let resp = flock_cni::client::call(socket, Duration::from_secs(10), |mut c| async move {
        c.garbage_collect(req).await
    })
    .await
    .unwrap_or_else(|e| panic!("GarbageCollect: {e}"));
    assert_eq!(
        resp.outcome,
        Outcome::Success as i32,
        "GC: {}",
        resp.message
    );
    resp.removed
}

/// One POST of JSON to etcd's gRPC gateway; the JSON answer.
fn etcd_post(port: u16, path: &str, body: &Value) -> Value {
    let addr = format!("127.0.0.1:{port}");
    let body = body.to_string();
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw);
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    assert!(head.contains(" 200 "), "etcd {path}: {head}\n{rest}");
    // The gateway may answer chunked: the JSON document is between the first `{` and
    // the last `}`.
    let json = &rest[rest.find('{').unwrap_or(0)..=rest.rfind('}').unwrap_or(0)];
    serde_json::from_str(json).unwrap_or_else(|e| panic!("etcd {path}: {e}: {rest}"))
}

fn b64(s: &str) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in s.as_bytes().chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, b)| n | u32::from(*b) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The node's endpoint keys in etcd right now: how many, and the leases they hang on.
fn etcd_keys(port: u16) -> (usize, BTreeSet<String>) {
    // The prefix's range end: the prefix with its last byte incremented ('/' + 1 = '0').
    let end = format!("{}0", NODE_PREFIX.trim_end_matches('/'));
    let answer = etcd_post(
        port,
        "/v3/kv/range",
        &json!({ "key": b64(NODE_PREFIX), "range_end": b64(&end) }),
    );
    let kvs = answer["kvs"].as_array().cloned().unwrap_or_default();
    let leases = kvs
        .iter()
        .map(|kv| kv["lease"].as_str().unwrap_or("0").to_owned())
        .collect();
    (kvs.len(), leases)
}

/// Seconds the lease has left, by etcd.
fn lease_ttl_left(port: u16, lease: &str) -> i64 {
    let answer = etcd_post(port, "/v3/lease/timetolive", &json!({ "ID": lease }));
    answer["TTL"]
        .as_str()
        .and_then(|t| t.parse().ok())
        .or_else(|| answer["TTL"].as_i64())
        .unwrap_or(-1)
}

/// A counter or gauge from `/metrics` (0 when absent).
fn metric(agent: &Agent, name: &str) -> u64 {
    let (_, text) = agent.get("/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}

/// What one fault phase saw.
#[derive(Debug)]
struct Phase {
    name: &'static str,
    polls: u32,
    min_keys: usize,
    leases: BTreeSet<String>,
    gc_sweeps: u64,
    issued: u64,
    warranted: (u64, u64),
}

/// Holds the clock at `offset_ms` until `until`, polling etcd every 100 ms; then reads
/// the agent's figures and checks them. `adds`: (first, last) instants of the pods'
/// first subscriptions, which start each identity's monotonic schedule.
fn hold(
    name: &'static str,
    agent: &Agent,
    etcd_port: u16,
    until: Instant,
    pods: u32,
    adds: (Instant, Instant),
) -> Phase {
    let sweeps_before = metric(agent, "flock_agent_gc_sweeps_total");
    let mut phase = Phase {
        name,
        polls: 0,
        min_keys: usize::MAX,
        leases: BTreeSet::new(),
        gc_sweeps: 0,
        issued: 0,
        warranted: (0, 0),
    };
    while Instant::now() < until {
        let (keys, leases) = etcd_keys(etcd_port);
        phase.min_keys = phase.min_keys.min(keys);
        phase.leases.extend(leases);
        phase.polls += 1;
        std::thread::sleep(Duration::from_millis(100));
    }
    // The bounds monotonic time sets: each identity issued once at its subscription,
    // then once per half-life (lower bound: 1 s of slack per rotation for the loop).
    let before = Instant::now();
    phase.issued = metric(agent, "flock_identity_svids_issued_total");
    let after = Instant::now();
    let ids = ACCOUNTS.len() as u64;
    let rotations = |since: Instant, at: Instant, period: Duration| {
        (at.saturating_duration_since(since).as_millis() / period.as_millis()) as u64
    };
    phase.warranted = (
        ids * (1 + rotations(adds.1, before, HALF_LIFE + Duration::from_secs(1))),
        ids * (1 + rotations(adds.0, after, HALF_LIFE)),
    );
    phase.gc_sweeps = metric(agent, "flock_agent_gc_sweeps_total") - sweeps_before;
    println!("{phase:?}");

    assert_eq!(
        phase.min_keys, pods as usize,
        "{name}: the node's endpoints left etcd (lease expired?)"
    );
    assert!(
        phase.issued >= phase.warranted.0,
        "{name}: {} SVIDs issued, monotonic time warrants at least {} (rotation stalled)",
        phase.issued,
        phase.warranted.0
    );
    assert!(
        phase.issued <= phase.warranted.1,
        "{name}: {} SVIDs issued, monotonic time warrants at most {} (rotation storm)",
        phase.issued,
        phase.warranted.1
    );
    assert!(
        phase.gc_sweeps >= 3,
        "{name}: only {} GC sweeps ran: the test saw no hysteresis window",
        phase.gc_sweeps
    );
    assert_eq!(metric(agent, "flock_agent_gc_removed_pods_total"), 0);
    assert_eq!(metric(agent, "flock_agent_gc_removed_endpoints_total"), 0);
    let listed = agent.json("/debug/pods")["pods"]
        .as_array()
        .map_or(0, Vec::len);
    assert_eq!(listed, pods as usize, "{name}: pods collected");
    assert_eq!(agent.store_files().len(), pods as usize, "{name}: store");
    phase
}

/// The `added_at_ms` `/debug/pods` shows for pod `p<i>`.
fn added_at_ms(agent: &Agent, i: u32) -> i64 {
    let doc = agent.json("/debug/pods");
    let pod = doc["pods"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pod"] == format!("default/p{i}"))
        .unwrap_or_else(|| panic!("p{i} not in /debug/pods: {doc}"));
    pod["added_at_ms"].as_i64().unwrap()
}

fn real_now_ms() -> i64 {
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    since.unwrap().as_millis() as i64
}

/// Waits until etcd holds `pods` endpoint keys of the node (ADD returns before the
/// registry write: the registry is off its path).
fn wait_keys(port: u16, pods: u32) {
    wait_for(&format!("{pods} endpoints in etcd"), WAIT, || {
        etcd_keys(port).0 == pods as usize
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wall_clock_steps_of_six_hours_expire_nothing_rotate_nothing_extra_and_collect_nothing() {
    let etcd = blocking(Etcd::start);
    let offsets = tempfile::tempdir().unwrap();
    let offset_file = offsets.path().join("offset-ms");
    set_offset(&offset_file, 0);
    let agent = blocking(|| start_agent(&etcd, &offset_file));
    let port = etcd.client_port.port();

    // Six pods, two per identity: three SVIDs, issued at the first pod of each.
    let first_add = Instant::now();
    for (i, sa) in ACCOUNTS.iter().flat_map(|sa| [sa, sa]).enumerate() {
        add_pod(&agent.cni_socket, i as u32, sa).await;
    }
    let adds = (first_add, Instant::now());
    let mut pods = 6;
    blocking(|| wait_keys(port, pods));
    let (_, leases) = blocking(|| etcd_keys(port));
    assert_eq!(leases.len(), 1, "one lease for the node: {leases:?}");
    let lease = leases.into_iter().next().unwrap();
    assert_ne!(lease, "0", "the endpoints hang on a lease");
    assert_eq!(
        blocking(|| metric(&agent, "flock_identity_svids_issued_total")),
        3
    );

    // +6 h, well before the first half-life: nothing may rotate.
    set_offset(&offset_file, 6 * HOUR_MS);
    let stepped = Instant::now();
    add_pod(&agent.cni_socket, pods, "sa1").await;
    pods += 1;
    let skew = blocking(|| added_at_ms(&agent, pods - 1)) - real_now_ms();
    assert!(
        (6 * HOUR_MS - 60_000..=6 * HOUR_MS + 60_000).contains(&skew),
        "the agent's wall clock did not step: added_at is {skew} ms from real time"
    );
    blocking(|| wait_keys(port, pods));
    assert_eq!(cni_gc(&agent.cni_socket, pods).await, 0);
    let forward = blocking(|| {
        hold(
            "+6h",
            &agent,
            port,
            stepped + Duration::from_secs(5),
            pods,
            adds,
        )
    });

    // −6 h (a step of 12 h back), held across two half-lives: each identity must still
    // rotate twice.
    set_offset(&offset_file, -6 * HOUR_MS);
    let back = Instant::now();
    add_pod(&agent.cni_socket, pods, "sa2").await;
    pods += 1;
    let skew = blocking(|| added_at_ms(&agent, pods - 1)) - real_now_ms();
    assert!(
        (-6 * HOUR_MS - 60_000..=-6 * HOUR_MS + 60_000).contains(&skew),
        "the agent's wall clock did not step back: added_at is {skew} ms from real time"
    );
    blocking(|| wait_keys(port, pods));
    assert_eq!(cni_gc(&agent.cni_socket, pods).await, 0);
    let backward = blocking(|| {
        hold(
            "-6h",
            &agent,
            port,
            (adds.1 + 2 * HALF_LIFE + Duration::from_secs(3)).max(back + Duration::from_secs(5)),
            pods,
            adds,
        )
    });
    assert!(
        backward.issued >= 9,
        "two rotations of each identity after the step back"
    );

    // Back to the real time.
    set_offset(&offset_file, 0);
    let healed = Instant::now();
    assert_eq!(cni_gc(&agent.cni_socket, pods).await, 0);
    let restored = blocking(|| {
        hold(
            "0",
            &agent,
            port,
            healed + Duration::from_secs(4),
            pods,
            adds,
        )
    });

    // One lease through it all, still alive by etcd's (unstepped) clock.
    for phase in [&forward, &backward, &restored] {
        assert_eq!(
            phase.leases,
            BTreeSet::from([lease.clone()]),
            "{}: the endpoints moved to another lease (the old one expired)",
            phase.name
        );
    }
    let left = blocking(|| lease_ttl_left(port, &lease));
    assert!(left > 0, "lease {lease}: {left} s left");
    println!(
        "clock faults: lease {lease} kept ({left} s left); polls of etcd {}/{}/{}, min keys {}/{}/{}; \
         SVIDs issued {}/{}/{} (warranted by monotonic time {:?}/{:?}/{:?}); GC sweeps {}/{}/{}, \
         pods removed 0",
        forward.polls,
        backward.polls,
        restored.polls,
        forward.min_keys,
        backward.min_keys,
        restored.min_keys,
        forward.issued,
        backward.issued,
        restored.issued,
        forward.warranted,
        backward.warranted,
        restored.warranted,
        forward.gc_sweeps,
        backward.gc_sweeps,
        restored.gc_sweeps,
    );
}
