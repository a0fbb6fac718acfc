//! Shared by `churn.rs` and `crash.rs`: many pods added and removed through the real
//! CNI gRPC API (`flock_cni::client`), 32 at a time, with the test's own model of
//! which pods are present; a raw Delta ADS client recording every version and
//! resource the agent serves; and a reader of the four places a pod lives (the store
//! files, `/debug/pods`, the registry, the served snapshot) that checks they agree
//! with the model exactly.
//!
//! Pod `k` (of [`KEYS`]): container `churn-<k>`, interface `eth0`, pod
//! `default/pod-<k>`, service `svc-<k % 8>`, app port 8080, IP `10.200.<k/200>.<k%200+1>`,
//! netns [`netns`] (one real namespace for all, from `common::NetNs`: it exists, so
//! the agent serves the pods; nothing listens on 8080 in it, so their probes fail and
//! health transitions happen after the warm-up). Not `/proc/1/ns/net`: in a container
//! pid 1 may belong to another user and its namespace links are unreadable.
#![allow(dead_code)]

use crate::common::{Agent, http_get};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::config::core::v3::address::Address as AddressKind;
use envoy_types::pb::envoy::config::core::v3::socket_address::PortSpecifier;
use envoy_types::pb::envoy::config::endpoint::v3::ClusterLoadAssignment;
use envoy_types::pb::envoy::config::endpoint::v3::lb_endpoint::HostIdentifier;
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use envoy_types::pb::google::protobuf::Any;
use flock_cni::client;
use flock_cni::proto::v1::{
    AddPodRequest, Attachment, GarbageCollectRequest, IpConfig, Outcome, PodRef, RemovePodRequest,
};
use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER};
use prost::Message as _;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Pod keys the churn draws from.
pub const KEYS: usize = 300;
/// Resident pods, keys `KEYS..KEYS + RESIDENTS`: [`add_residents`] adds them and
/// [`drive`] never draws them, so they outlive the agent's 10 s probe warm-up however
/// fast the agent answers (at 640 operations/s even a "cold" key is touched about once
/// a second, and its pod rarely lives 10 s).
pub const RESIDENTS: usize = 8;
/// Operations in flight.
pub const IN_FLIGHT: usize = 32;
/// Services the pods spread over.
pub const SERVICES: usize = 8;
/// The CNI network name of every pod.
pub const NETWORK: &str = "flock-churn";
/// Deadline of one CNI call.
pub const CALL: Duration = Duration::from_secs(15);

/// xorshift64*: small, seeded, deterministic.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// True with probability `percent`/100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

/// The seed: `FLOCK_CHURN_SEED` (decimal or 0x-hex) or `default`.
pub fn seed(default: u64) -> u64 {
    match std::env::var("FLOCK_CHURN_SEED") {
        Ok(s) => {
            let s = s.trim();
            match s.strip_prefix("0x") {
                Some(h) => u64::from_str_radix(h, 16),
                None => s.parse(),
            }
            .unwrap_or_else(|e| panic!("FLOCK_CHURN_SEED={s:?}: {e}"))
        }
        Err(_) => default,
    }
}

static NETNS: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// Sets the netns path every pod gets (once per test process).
pub fn set_netns(path: String) {
    let _ = NETNS.set(path);
}

/// The pods' netns path (see [`set_netns`]).
pub fn netns() -> String {
    NETNS.get().expect("churnkit::set_netns first").clone()
}

pub fn container(k: usize) -> String {
    format!("churn-{k}")
}

pub fn pod_name(k: usize) -> String {
    format!("pod-{k}")
}

pub fn service(k: usize) -> String {
    format!("svc-{}", k % SERVICES)
}

pub fn ip(k: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 200, (k / 200) as u8, (k % 200 + 1) as u8)
}

/// `churn-<k>` → `k`.
pub fn key_of(container_id: &str) -> Option<usize> {
    container_id.strip_prefix("churn-")?.parse().ok()
}

/// The inbound listener of pod `k`'s port 8080.
pub fn inbound_listener(k: usize) -> String {
    format!("inbound|default/{}|8080", pod_name(k))
}

/// The EDS cluster of service `svc-<j>`.
pub fn outbound_cluster(j: usize) -> String {
    format!("outbound|8080|svc-{j}.default")
}

pub fn add_request(k: usize) -> AddPodRequest {
    AddPodRequest {
        container_id: container(k),
        netns: netns(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: pod_name(k),
            namespace: "default".into(),
            uid: format!("uid-{k}"),
        }),
        ips: vec![IpConfig {
            address: format!("{}/16", ip(k)),
            gateway: String::new(),
            interface: -1,
            interface_name: String::new(),
        }],
        annotations: HashMap::from([
            ("flock.io/service".to_string(), service(k)),
            ("flock.io/ports".to_string(), "8080".to_string()),
        ]),
        network_name: NETWORK.into(),
        cni_version: "1.1.0".into(),
        prev_result_json: String::new(),
    }
}

pub fn remove_request(k: usize) -> RemovePodRequest {
    RemovePodRequest {
        container_id: container(k),
        netns: netns(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: pod_name(k),
            namespace: "default".into(),
            uid: format!("uid-{k}"),
        }),
        network_name: NETWORK.into(),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Add,
    Remove,
}

/// What one CNI call returned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reply {
    Success,
    Ignored,
    /// The agent answered ERROR.
    Error(String),
    /// No answer (transport error, timeout, gRPC status): the operation may or may
    /// not have happened.
    NoAnswer(String),
}

pub async fn call(socket: &Path, k: usize, op: Op) -> Reply {
    let r = match op {
        Op::Add => {
            let req = add_request(k);
            client::call(socket, CALL, |mut c| async move { c.add_pod(req).await }).await
        }
        Op::Remove => {
            let req = remove_request(k);
            client::call(socket, CALL, |mut c| async move { c.remove_pod(req).await }).await
        }
    };
    match r {
        Ok(resp) => match Outcome::try_from(resp.outcome) {
            Ok(Outcome::Success) => Reply::Success,
            Ok(Outcome::Ignored) => Reply::Ignored,
            _ => Reply::Error(resp.message),
        },
        Err(e) => Reply::NoAnswer(e.to_string()),
    }
}

/// What the test knows about one pod key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Known {
    Present,
    Absent,
    /// An operation on it got no answer (the agent was killed meanwhile): either
    /// state is acceptable until the next answered operation on the key.
    Unknown,
}

/// The test's model plus counters, shared by the driver's tasks.
pub struct Model {
    pub keys: Mutex<Vec<Known>>,
    /// Contradictions between an answer and the model (a lost pod, a resurrected one,
    /// an unexpected ERROR).
    pub violations: Mutex<Vec<String>>,
    pub started: AtomicU64,
    pub answered: AtomicU64,
    pub no_answer: AtomicU64,
    pub in_flight: AtomicUsize,
}

impl Model {
    pub fn new() -> Arc<Self> {
        Arc::new(Self {
            keys: Mutex::new(vec![Known::Absent; KEYS + RESIDENTS]),
            violations: Mutex::new(Vec::new()),
            started: AtomicU64::new(0),
            answered: AtomicU64::new(0),
            no_answer: AtomicU64::new(0),
            in_flight: AtomicUsize::new(0),
        })
    }

    pub fn known(&self) -> Vec<Known> {
        self.keys.lock().unwrap().clone()
    }

    pub fn set(&self, want: Known) -> BTreeSet<usize> {
        self.known()
            .iter()
            .enumerate()
            .filter(|(_, s)| **s == want)
            .map(|(k, _)| k)
            .collect()
    }

    pub fn violations(&self) -> Vec<String> {
        self.violations.lock().unwrap().clone()
    }

    /// Applies the answer to `op` on `k` (whose state was `before` when it was sent).
    fn apply(&self, k: usize, before: Known, op: Op, reply: &Reply) {
        let bad = |m: String| self.violations.lock().unwrap().push(m);
        let after = match (op, reply) {
            (_, Reply::NoAnswer(_)) => Known::Unknown,
            (Op::Add, Reply::Success) => Known::Present,
            (Op::Remove, Reply::Success) => {
                if before == Known::Absent {
                    bad(format!(
                        "RemovePod of absent pod {k} answered SUCCESS: a removed pod came back"
                    ));
                }
                Known::Absent
            }
            (Op::Remove, Reply::Ignored) => {
                if before == Known::Present {
                    bad(format!(
                        "RemovePod of acknowledged pod {k} answered IGNORED: the pod was lost"
                    ));
                }
                Known::Absent
            }
            (op, other) => {
                bad(format!(
                    "{op:?} of pod {k} (was {before:?}) answered {other:?}"
                ));
                Known::Unknown
            }
        };
        self.keys.lock().unwrap()[k] = after;
    }
}

/// Adds the [`RESIDENTS`] pods (keys `KEYS..`), one at a time, recording the answers in
/// `model`.
pub async fn add_residents(socket: &Path, model: &Model) {
    for k in KEYS..KEYS + RESIDENTS {
        let before = model.keys.lock().unwrap()[k];
        let reply = call(socket, k, Op::Add).await;
        model.apply(k, before, Op::Add, &reply);
    }
}

/// Runs operations on random keys (of `0..KEYS`), [`IN_FLIGHT`] at a time, until `stop` says so
/// (checked before each new operation). Operations on one key are serialized (the
/// driver takes the key's lock before sending, the task releases it after the
/// answer), so the model is well defined; the key sequence comes from `rng` and each
/// operation from the key's state, hence deterministic for a seed as long as the
/// answers are the expected ones. Returns once every started operation is answered.
pub async fn drive(
    socket: PathBuf,
    model: Arc<Model>,
    rng: &mut Rng,
    stop: impl Fn(&Model) -> bool,
) {
    let sem = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let locks: Vec<Arc<tokio::sync::Mutex<()>>> = (0..KEYS).map(|_| Arc::default()).collect();
    let mut tasks = tokio::task::JoinSet::new();
    while !stop(&model) {
        let permit = Arc::clone(&sem).acquire_owned().await.unwrap();
        // Keys in the last quarter are "cold" (10 % of the operations): at a slow
        // agent's pace their pods may outlive the 10 s probe warm-up, so failing probes
        // make them unhealthy (a guarded re-registration) while the churn goes on. At a
        // fast pace only the residents (never drawn here) do.
        let hot = (KEYS * 3 / 4) as u64;
        let k = if rng.chance(90) {
            rng.below(hot)
        } else {
            hot + rng.below(KEYS as u64 - hot)
        } as usize;
        let guard = Arc::clone(&locks[k]).lock_owned().await;
        if stop(&model) {
            break;
        }
        let before = model.keys.lock().unwrap()[k];
        // Present: mostly remove, sometimes re-ADD (idempotent retry). Absent: add, or
        // a DEL of an unknown pod (IGNORED). Unknown: either.
        // The mix keeps about a third of the keys present (~110 pods): every AddPod
        // republishes all pods, so the population sets the agent's pace.
        let op = match before {
            Known::Present if rng.chance(80) => Op::Remove,
            Known::Present => Op::Add,
            Known::Absent if rng.chance(45) => Op::Add,
            Known::Absent => Op::Remove,
            Known::Unknown if rng.chance(50) => Op::Add,
            Known::Unknown => Op::Remove,
        };
        model.started.fetch_add(1, Ordering::Relaxed);
        model.in_flight.fetch_add(1, Ordering::SeqCst);
        let socket = socket.clone();
        let model = Arc::clone(&model);
        tasks.spawn(async move {
            let reply = call(&socket, k, op).await;
            model.apply(k, before, op, &reply);
            if matches!(reply, Reply::NoAnswer(_)) {
                model.no_answer.fetch_add(1, Ordering::Relaxed);
            } else {
                model.answered.fetch_add(1, Ordering::Relaxed);
            }
            model.in_flight.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
            drop(permit);
        });
        while tasks.try_join_next().is_some() {}
    }
    while tasks.join_next().await.is_some() {}
}

/// Sends a CNI GC of [`NETWORK`] listing `valid` as the runtime's attachments; the
/// number removed.
pub async fn cni_gc(socket: &Path, valid: &BTreeSet<usize>) -> u32 {
    try_cni_gc(socket, valid)
        .await
        .unwrap_or_else(|e| panic!("CNI GC: {e}"))
}

/// [`cni_gc`], or why the agent did not answer (it was killed meanwhile).
pub async fn try_cni_gc(socket: &Path, valid: &BTreeSet<usize>) -> Result<u32, String> {
    let req = GarbageCollectRequest {
        network_name: NETWORK.into(),
        valid_attachments: valid
            .iter()
            .map(|k| Attachment {
                container_id: container(*k),
                ifname: "eth0".into(),
            })
            .collect(),
    };
    let resp = client::call(
        socket,
        CALL,
        |mut c| async move { c.garbage_collect(req).await },
    )
    .await
    .map_err(|e| e.to_string())?;
    assert_eq!(resp.outcome, Outcome::Success as i32, "CNI GC: {resp:?}");
    Ok(resp.removed)
}

/// Fails unless the agent's store quarantined nothing (a kill never leaves a torn
/// record).
pub fn assert_nothing_quarantined(agent: &Agent, when: &str) {
    let quarantine = agent.state_dir.join(flock_bird::store::QUARANTINE_DIR);
    let quarantined: Vec<_> = std::fs::read_dir(&quarantine)
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(
        quarantined.is_empty(),
        "quarantined {when}: {quarantined:?}"
    );
}

/// After a restart or a fault: `gc_valid`, if given, is sent as the runtime's CNI GC
/// (three sweeps: the planner's confirmation); then [`settle`] with a fresh xDS
/// recorder, whose log must show no violation and no ended stream. Returns the agreed
/// pods and how many the GC removed.
pub fn gc_and_settle(
    rt: &tokio::runtime::Runtime,
    agent: &Agent,
    gc_valid: Option<&BTreeSet<usize>>,
    present: &BTreeSet<usize>,
    unknown: &BTreeSet<usize>,
) -> (BTreeSet<usize>, u32) {
    let xds = Arc::new(Mutex::new(XdsLog::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let recorder = rt.spawn(record_xds(
        agent.xds_target(),
        Arc::clone(&xds),
        Arc::clone(&stop),
    ));
    let removed = match gc_valid {
        Some(valid) => rt.block_on(async {
            let mut n = 0;
            for _ in 0..3 {
                n += cni_gc(&agent.cni_socket, valid).await;
            }
            n
        }),
        None => 0,
    };
    let agreed = settle(
        agent,
        &xds,
        present,
        unknown,
        Duration::from_millis(300),
        Duration::from_secs(30),
    );
    stop.store(true, Ordering::Relaxed);
    rt.block_on(recorder).unwrap();
    let log = xds.lock().unwrap().clone();
    assert!(
        log.violations.is_empty(),
        "xDS: {}",
        log.violations.join("\n")
    );
    assert!(log.ended.is_none(), "the xDS stream ended: {:?}", log.ended);
    (agreed, removed)
}

/// What one Delta ADS stream (node `user_agent_name: envoy`, LDS/CDS/EDS wildcard,
/// every response ACKed) received.
#[derive(Default, Clone)]
pub struct XdsLog {
    /// Responses received.
    pub responses: u64,
    /// Every `system_version_info` by type, in arrival order.
    pub versions: BTreeMap<String, Vec<u64>>,
    /// Non-increasing versions and bad responses.
    pub violations: Vec<String>,
    /// Responses repeating their type's version as the other make/break half.
    pub split_responses: u64,
    /// The current resources by type and name.
    pub resources: BTreeMap<String, BTreeMap<String, Any>>,
    /// Why the stream ended, if it did.
    pub ended: Option<String>,
}

impl XdsLog {
    pub fn names(&self, type_url: &str) -> BTreeSet<String> {
        self.resources
            .get(type_url)
            .map(|m| m.keys().cloned().collect())
            .unwrap_or_default()
    }

    /// The endpoints (`ip:port`) of every ClusterLoadAssignment, by cluster (clusters
    /// with no endpoint left out).
    pub fn endpoints(&self) -> BTreeMap<String, BTreeSet<String>> {
        let mut out = BTreeMap::new();
        for (name, any) in self.resources.get(ENDPOINT).into_iter().flatten() {
            let cla = ClusterLoadAssignment::decode(&*any.value)
                .unwrap_or_else(|e| panic!("CLA {name}: {e}"));
            assert_eq!(&cla.cluster_name, name);
            let mut set = BTreeSet::new();
            for lle in &cla.endpoints {
                for lb in &lle.lb_endpoints {
                    let Some(HostIdentifier::Endpoint(ep)) = &lb.host_identifier else {
                        continue;
                    };
                    let Some(AddressKind::SocketAddress(sa)) =
                        ep.address.as_ref().and_then(|a| a.address.as_ref())
                    else {
                        continue;
                    };
                    let port = match sa.port_specifier {
                        Some(PortSpecifier::PortValue(p)) => p,
                        _ => 0,
                    };
                    set.insert(format!("{}:{port}", sa.address));
                }
            }
            if !set.is_empty() {
                out.insert(name.clone(), set);
            }
        }
        out
    }
}

/// Records a Delta ADS stream to the agent's xDS `target` (`unix:PATH`) until `stop`
/// is set or the stream ends.
pub async fn record_xds(target: String, log: Arc<Mutex<XdsLog>>, stop: Arc<AtomicBool>) {
    let opened = async {
        let channel = flock_xds::client::connect(&target)
            .await
            .map_err(|e| format!("connecting to the agent's xDS socket: {e}"))?;
        flock_xds::client::delta(channel)
            .await
            .map_err(|e| format!("opening a Delta ADS stream: {e}"))
    };
    let mut ads = match opened.await {
        Ok(ads) => ads,
        Err(e) => {
            log.lock().unwrap().ended = Some(e);
            return;
        }
    };
    let node = Node {
        id: "churn-observer".into(),
        cluster: "churn".into(),
        user_agent_name: "envoy".into(),
        ..Node::default()
    };
    for t in [LISTENER, CLUSTER, ENDPOINT] {
        ads.send(DeltaDiscoveryRequest {
            node: Some(node.clone()),
            type_url: t.into(),
            resource_names_subscribe: vec!["*".into()],
            ..Default::default()
        })
        .unwrap();
    }
    // type → (last version, its response's (changes, removals), already repeated).
    let mut last: BTreeMap<String, (u64, (usize, usize), bool)> = BTreeMap::new();
    while !stop.load(Ordering::Relaxed) {
        let resp = match ads.recv(Duration::from_millis(100)).await {
            Ok(r) => r,
            Err(flock_xds::client::RecvError::Timeout(_)) => continue,
            Err(e) => {
                log.lock().unwrap().ended = Some(e.to_string());
                return;
            }
        };
        let mut l = log.lock().unwrap();
        l.responses += 1;
        let t = resp.type_url.clone();
        // Per type, versions strictly increase, with one exception by design
        // (flock_xds::protocol::order): a snapshot's changes of one type can go out in
        // two responses with the same version, its adds and changes ("make", withheld
        // until the types they depend on are sent) and its removals ("break", withheld
        // until the types referencing them are sent), in either order. So a version
        // may repeat once, when one of the two responses is removals-only and the
        // other has no removals.
        match resp.system_version_info.parse::<u64>() {
            Ok(v) => {
                let this = (resp.resources.len(), resp.removed_resources.len());
                match last.get(&t) {
                    None => {}
                    Some(&(prev, _, _)) if v > prev => {}
                    Some(&(prev, (changes, removals), false))
                        if v == prev
                            && ((removals == 0 && this.0 == 0)
                                || (changes == 0 && this.1 == 0)) =>
                    {
                        l.split_responses += 1;
                    }
                    Some(&(prev, before, _)) => l.violations.push(format!(
                        "{t}: version {v} after {prev} (not strictly increasing, and not \
                         the make/break halves of one snapshot: (changes, removals) \
                         {before:?} then {this:?})"
                    )),
                }
                let repeated = last.get(&t).is_some_and(|&(prev, _, _)| prev == v);
                last.insert(t.clone(), (v, this, repeated));
                l.versions.entry(t.clone()).or_default().push(v);
            }
            Err(_) => l.violations.push(format!(
                "{t}: system_version_info {:?} is not a number",
                resp.system_version_info
            )),
        }
        let set = l.resources.entry(t.clone()).or_default();
        for name in &resp.removed_resources {
            set.remove(name);
        }
        for r in &resp.resources {
            if let Some(any) = &r.resource {
                set.insert(r.name.clone(), any.clone());
            }
        }
        drop(l);
        let _ = ads.send(DeltaDiscoveryRequest {
            type_url: t,
            response_nonce: resp.nonce.clone(),
            ..Default::default()
        });
    }
}

/// The four places a pod lives, read from the running agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// Pods in the store files (decoded with flock_bird's own decoder).
    pub store: BTreeSet<usize>,
    /// `/debug/pods`.
    pub live: BTreeSet<usize>,
    /// Registry endpoints of node n1 (`/debug/registry`), by pod.
    pub registry: BTreeSet<usize>,
    /// Inbound listeners in the Envoy group's snapshot (`/debug/snapshot`).
    pub listeners: BTreeSet<usize>,
    /// EDS resource names in that snapshot.
    pub clusters: BTreeSet<String>,
    /// That snapshot's version.
    pub version: u64,
    /// Everything malformed found on the way.
    pub problems: Vec<String>,
}

fn json(admin: &str, path: &str) -> Result<Value, String> {
    match http_get(admin, path) {
        Ok((200, body)) => serde_json::from_str(&body).map_err(|e| format!("GET {path}: {e}")),
        Ok((s, body)) => Err(format!("GET {path}: {s} {body}")),
        Err(e) => Err(format!("GET {path}: {e}")),
    }
}

pub fn observe(agent: &Agent) -> Result<Observed, String> {
    let mut problems = Vec::new();
    let mut store = BTreeSet::new();
    for name in agent.store_files() {
        let path = agent.state_dir.join(&name);
        let Ok(bytes) = std::fs::read(&path) else {
            continue; // removed meanwhile
        };
        match flock_bird::store::decode_record(&name, &bytes) {
            Ok(rec) => match key_of(&rec.key.container_id) {
                Some(k) => {
                    if rec.ips.first().map(|a| a.to_string()) != Some(ip(k).to_string())
                        || rec.service != service(k)
                        || rec.name != pod_name(k)
                    {
                        problems.push(format!("store record of pod {k} is wrong: {rec:?}"));
                    }
                    store.insert(k);
                }
                None => problems.push(format!("store record {name} of a foreign pod: {rec:?}")),
            },
            Err(e) => problems.push(format!("store file {name} does not decode: {e}")),
        }
    }
    let pods = json(&agent.admin, "/debug/pods")?;
    let mut live = BTreeSet::new();
    for p in pods["pods"].as_array().ok_or("/debug/pods: no pods")? {
        match p["container_id"].as_str().and_then(key_of) {
            Some(k) => {
                live.insert(k);
            }
            None => problems.push(format!("/debug/pods: foreign pod {p}")),
        }
    }
    let reg = json(&agent.admin, "/debug/registry")?;
    let eps: Vec<Value> = match &reg["endpoints"] {
        Value::Object(m) => m.values().cloned().collect(),
        Value::Array(a) => a.clone(),
        other => return Err(format!("/debug/registry endpoints: {other}")),
    };
    let mut registry = BTreeSet::new();
    for e in eps {
        if e["node"] != "n1" {
            continue;
        }
        let Some(k) = e["pod_key"]["container_id"].as_str().and_then(key_of) else {
            problems.push(format!("registry: foreign endpoint {e}"));
            continue;
        };
        if e["address"].as_str() != Some(&ip(k).to_string())
            || e["port"] != 15006
            || e["service"].as_str() != Some(&service(k))
            || e["service_port"] != 8080
        {
            problems.push(format!("registry endpoint of pod {k} is wrong: {e}"));
        }
        if !registry.insert(k) {
            problems.push(format!("pod {k} has two registry endpoints"));
        }
    }
    let snap = json(&agent.admin, "/debug/snapshot")?;
    let envoy = &snap["groups"]["envoy"];
    let version = envoy["version"]
        .as_u64()
        .ok_or("/debug/snapshot: no version")?;
    let names = |t: &str| -> BTreeSet<String> {
        envoy["resources"][t]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|n| n.as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default()
    };
    let mut listeners = BTreeSet::new();
    for n in names("lds") {
        if let Some(rest) = n.strip_prefix("inbound|default/pod-") {
            match rest.strip_suffix("|8080").and_then(|k| k.parse().ok()) {
                Some(k) => {
                    listeners.insert(k);
                }
                None => problems.push(format!("snapshot: odd listener {n}")),
            }
        }
    }
    Ok(Observed {
        store,
        live,
        registry,
        listeners,
        clusters: names("eds"),
        version,
        problems,
    })
}

/// The EDS content the pods `pods` must produce: cluster → `ip:15006`.
pub fn expected_endpoints(pods: &BTreeSet<usize>) -> BTreeMap<String, BTreeSet<String>> {
    let mut out: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for k in pods {
        out.entry(outbound_cluster(k % SERVICES))
            .or_default()
            .insert(format!("{}:15006", ip(*k)));
    }
    out
}

/// Checks that store, `/debug/pods`, registry, snapshot and the xDS client's state
/// all hold exactly the same pods `S`, with `present ⊆ S ⊆ present ∪ unknown`; on
/// success returns `S` and the snapshot version.
pub fn agree(
    o: &Observed,
    x: &XdsLog,
    present: &BTreeSet<usize>,
    unknown: &BTreeSet<usize>,
) -> Result<(BTreeSet<usize>, u64), String> {
    if !o.problems.is_empty() {
        return Err(o.problems.join("\n"));
    }
    let s = &o.store;
    let mut diffs = Vec::new();
    let mut cmp = |what: &str, other: &BTreeSet<usize>| {
        if other != s {
            diffs.push(format!(
                "{what} differs from the store: only in {what} {:?}, only in the store {:?}",
                other.difference(s).collect::<Vec<_>>(),
                s.difference(other).collect::<Vec<_>>()
            ));
        }
    };
    cmp("/debug/pods", &o.live);
    cmp("registry", &o.registry);
    cmp("snapshot listeners", &o.listeners);
    let xds_listeners: BTreeSet<usize> = x
        .names(LISTENER)
        .iter()
        .filter_map(|n| {
            n.strip_prefix("inbound|default/pod-")?
                .strip_suffix("|8080")?
                .parse()
                .ok()
        })
        .collect();
    cmp("xDS client's listeners", &xds_listeners);
    let lost: Vec<_> = present.difference(s).collect();
    if !lost.is_empty() {
        diffs.push(format!(
            "acknowledged pods missing from the store: {lost:?}"
        ));
    }
    let ghosts: Vec<_> = s
        .iter()
        .filter(|k| !present.contains(k) && !unknown.contains(k))
        .collect();
    if !ghosts.is_empty() {
        diffs.push(format!("removed pods still in the store: {ghosts:?}"));
    }
    let want = expected_endpoints(s);
    // Each caller identity's mTLS cluster has a ClusterLoadAssignment of its own name
    // (`<service cluster>|<spiffe id>`: Envoy shares one EDS subscription per name) with
    // exactly the service port's endpoints: check each copy against its service, then
    // compare the services.
    let mut got = BTreeMap::new();
    for (name, eps) in x.endpoints() {
        match name.split_once("|spiffe://") {
            Some((base, _)) => {
                let w = want.get(base).cloned().unwrap_or_default();
                if w != eps {
                    diffs.push(format!(
                        "{name}: ghost {:?}, missing {:?} (its service's copy)",
                        eps.difference(&w).collect::<Vec<_>>(),
                        w.difference(&eps).collect::<Vec<_>>()
                    ));
                }
            }
            None => {
                got.insert(name, eps);
            }
        }
    }
    if got != want {
        let mut d = Vec::new();
        for c in want.keys().chain(got.keys()).collect::<BTreeSet<_>>() {
            let (w, g) = (
                want.get(c).cloned().unwrap_or_default(),
                got.get(c).cloned().unwrap_or_default(),
            );
            if w != g {
                d.push(format!(
                    "{c}: ghost {:?}, missing {:?}",
                    g.difference(&w).collect::<Vec<_>>(),
                    w.difference(&g).collect::<Vec<_>>()
                ));
            }
        }
        diffs.push(format!(
            "xDS ClusterLoadAssignments differ: {}",
            d.join("; ")
        ));
    }
    let want_clusters: BTreeSet<String> = want.keys().cloned().collect();
    let services: BTreeSet<String> = o
        .clusters
        .iter()
        .map(|n| {
            n.split_once("|spiffe://")
                .map_or(n.as_str(), |(b, _)| b)
                .to_string()
        })
        .collect();
    if services != want_clusters {
        diffs.push(format!(
            "snapshot EDS names {:?} != services with pods {want_clusters:?}",
            o.clusters
        ));
    }
    if diffs.is_empty() {
        Ok((s.clone(), o.version))
    } else {
        Err(diffs.join("\n"))
    }
}

/// Polls (25 ms) until [`agree`] holds and the snapshot version has not changed for
/// `quiet`; panics with the last disagreement after `limit`. Returns the agreed set.
pub fn settle(
    agent: &Agent,
    xds: &Mutex<XdsLog>,
    present: &BTreeSet<usize>,
    unknown: &BTreeSet<usize>,
    quiet: Duration,
    limit: Duration,
) -> BTreeSet<usize> {
    let deadline = Instant::now() + limit;
    let mut stable: Option<(u64, Instant)> = None;
    loop {
        let result = observe(agent).and_then(|o| {
            let x = xds.lock().unwrap().clone();
            agree(&o, &x, present, unknown)
        });
        match result {
            Ok((set, version)) => match stable {
                Some((v, since)) if v == version => {
                    if since.elapsed() >= quiet {
                        return set;
                    }
                }
                _ => stable = Some((version, Instant::now())),
            },
            Err(why) => {
                stable = None;
                assert!(
                    Instant::now() < deadline,
                    "store, /debug/pods, registry and xDS did not agree within {limit:?}:\n{why}"
                );
            }
        }
        assert!(
            Instant::now() < deadline,
            "the snapshot version did not settle within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(25));
    }
}

/// A counter from `/metrics` (0 when absent).
pub fn metric(agent: &Agent, name: &str) -> u64 {
    let (_, text) = agent.get("/metrics");
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
        .unwrap_or(0)
}
