//! The agent in process over a real pod store (tempdir) and the embedded registry:
//! AddPod/RemovePod steps and answers, bad input, restart merge, and the R4 guard
//! under a forced interleaving.

mod common;

use common::input;
use envoy_types::pb::google::protobuf::Any;
use flock_bird::agent::{
    AddPodInput, Agent, AgentConfig, ENVOY_GROUP, PodError, PodOutcome, group_of,
};
use flock_bird::model::Endpoint;
use flock_bird::registry::{self, Registry, RegistryError, RegistryOptions, RegistrySpec, View};
use flock_bird::store::PodStore;
use flock_core::pod::PodKey;
use flock_xds::cache::Cache;
use flock_xds::types::{CLUSTER, LISTENER};
use std::sync::Arc;
use tokio::sync::{Notify, watch};

async fn memory() -> Arc<dyn Registry> {
    registry::connect(
        &RegistrySpec::Memory,
        RegistryOptions {
            node: "n1".into(),
            ..RegistryOptions::default()
        },
    )
    .await
    .unwrap()
}

fn agent_over(dir: &std::path::Path, reg: Arc<dyn Registry>) -> Arc<Agent> {
    let store = Arc::new(PodStore::open(dir).unwrap());
    let cache: Arc<Cache<Any>> = Arc::new(Cache::new(group_of));
    Arc::new(Agent::new(AgentConfig::new("n1"), store, reg, cache))
}

/// The keys of every endpoint in the agent's registry view.
fn endpoint_keys(agent: &Agent) -> Vec<String> {
    agent
        .registry()
        .view()
        .borrow()
        .endpoints
        .keys()
        .cloned()
        .collect()
}

fn names(agent: &Agent, type_url: &str) -> Vec<String> {
    let snap = agent.cache().snapshot(ENVOY_GROUP).unwrap();
    snap.state()
        .iter_type(type_url)
        .map(|(n, _)| n.to_string())
        .collect()
}

#[tokio::test]
async fn add_then_remove_runs_every_step_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_over(dir.path(), memory().await);
    agent.load().await.unwrap();
    assert_eq!(agent.not_ready(), None);

    let out = agent
        .add_pod(&input("c1", Some("web"), "8080/http"))
        .await
        .unwrap();
    assert!(
        matches!(&out, PodOutcome::Done(m) if m.contains("web.default")),
        "{out:?}"
    );
    // Store, registry and snapshot all have the pod.
    let reopened = PodStore::open(dir.path()).unwrap().load_all().unwrap();
    assert_eq!(reopened.pods.len(), 1);
    let view = agent.registry().view().borrow().clone();
    let ep: Vec<&Endpoint> = view.endpoints.values().map(|e| &**e).collect();
    assert_eq!(ep.len(), 1);
    assert_eq!(
        (
            ep[0].port,
            ep[0].service_port,
            ep[0].address.to_string().as_str()
        ),
        (15006, 8080, "10.1.0.5")
    );
    agent.publish(); // the refresher's job, done synchronously here
    assert!(names(&agent, LISTENER).contains(&"inbound|default/pod-c1|8080".to_string()));
    assert!(names(&agent, CLUSTER).contains(&"outbound|8080|web.default".to_string()));

    let out = agent.remove_pod(&PodKey::new("c1", "eth0")).await;
    assert!(matches!(out, Ok(PodOutcome::Done(_))), "{out:?}");
    assert!(
        PodStore::open(dir.path())
            .unwrap()
            .load_all()
            .unwrap()
            .pods
            .is_empty()
    );
    assert!(agent.registry().view().borrow().endpoints.is_empty());
    agent.publish();
    assert!(
        names(&agent, LISTENER).is_empty(),
        "{:?}",
        names(&agent, LISTENER)
    );
    assert!(names(&agent, CLUSTER).is_empty());

    // DEL is idempotent: a repeat is IGNORED.
    let again = agent.remove_pod(&PodKey::new("c1", "eth0")).await;
    assert!(matches!(again, Ok(PodOutcome::Ignored(_))), "{again:?}");
}

#[tokio::test]
async fn pods_without_the_service_annotation_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_over(dir.path(), memory().await);
    agent.load().await.unwrap();
    let out = agent.add_pod(&input("c1", None, "8080")).await.unwrap();
    assert!(
        matches!(&out, PodOutcome::Ignored(m) if m.contains("flock.io/service")),
        "{out:?}"
    );
    assert!(agent.pods().is_empty());
    assert!(
        PodStore::open(dir.path())
            .unwrap()
            .load_all()
            .unwrap()
            .pods
            .is_empty()
    );
}

#[tokio::test]
async fn bad_add_requests_get_precise_errors_and_change_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_over(dir.path(), memory().await);
    agent.load().await.unwrap();
    let cases: Vec<(AddPodInput, &str)> = vec![
        (
            input("c1", Some("web"), "80/udp"),
            "is not http, grpc, grpc-xds or tcp",
        ),
        (input("c1", Some("web"), "0"), "is not a port"),
        (input("c1", Some("web"), "8080,8080"), "listed twice"),
        (input("c1", Some("web"), "15001"), "collides with Envoy"),
        (input("c1", Some("Web_Service"), ""), "contains 'W'"),
        // A dot passes a Kubernetes name check but breaks `<svc>.<ns>` in the
        // translation: refused at ADD, not accepted and then never served.
        (input("c1", Some("web.v2"), ""), "a DNS label"),
        (
            input("", Some("web"), ""),
            "container id: \"\" must be 1 to 256 bytes",
        ),
        (
            input(&"x".repeat(300), Some("web"), ""),
            "must be 1 to 256 bytes",
        ),
        (input("c/1", Some("web"), ""), "hold only letters"),
        (
            AddPodInput {
                ips: vec![],
                ..input("c1", Some("web"), "")
            },
            "has no IP",
        ),
        (
            AddPodInput {
                ips: vec!["banana".into()],
                ..input("c1", Some("web"), "")
            },
            "is not an IP address",
        ),
        (
            AddPodInput {
                netns: "relative/path".into(),
                ..input("c1", Some("web"), "")
            },
            "absolute path",
        ),
    ];
    for (req, want) in cases {
        match agent.add_pod(&req).await {
            Err(PodError::Invalid(m)) => assert!(m.contains(want), "{m:?} should contain {want:?}"),
            other => panic!("{req:?}: expected Invalid({want}), got {other:?}"),
        }
    }
    assert!(agent.pods().is_empty());
    assert!(agent.registry().view().borrow().endpoints.is_empty());
}

#[tokio::test]
async fn a_restart_loads_the_store_and_keeps_a_pod_added_meanwhile() {
    let dir = tempfile::tempdir().unwrap();
    let reg = memory().await;
    {
        let first = agent_over(dir.path(), Arc::clone(&reg));
        first.load().await.unwrap();
        first
            .add_pod(&input("old", Some("web"), "8080"))
            .await
            .unwrap();
    }
    // The restarted agent takes an AddPod before its load runs: the load merges.
    let second = agent_over(dir.path(), memory().await);
    second
        .add_pod(&input("new", Some("web"), "8080"))
        .await
        .unwrap();
    let (loaded, quarantined) = second.load().await.unwrap();
    assert_eq!(
        (loaded, quarantined),
        (1, 0),
        "only the stored pod not already live is added"
    );
    let keys: Vec<String> = second
        .pods()
        .keys()
        .map(|k| k.container_id.clone())
        .collect();
    assert_eq!(keys, vec!["new", "old"]);
    // The loaded pod's endpoint is registered again (a new registry here).
    let view = second.registry().view().borrow().clone();
    assert_eq!(view.endpoints.len(), 2);
}

/// A restarted agent (or one taking over from its predecessor) publishes its first
/// snapshot only after re-registering its stored pods: every snapshot Envoy can get
/// from it routes to the stored pod's service. (Envoy keeps its last configuration
/// until it gets one; a first snapshot built from a registry view without the node's
/// own endpoints made requests to them fail until the sync caught up.)
#[tokio::test]
async fn a_restarted_agents_first_snapshot_already_routes_to_its_stored_pods() {
    let dir = tempfile::tempdir().unwrap();
    {
        let first = agent_over(dir.path(), memory().await);
        first.load().await.unwrap();
        first
            .add_pod(&input("web-1", Some("web"), "8080/http"))
            .await
            .unwrap();
    }
    // The successor, on a registry that holds nothing yet.
    let second = agent_over(dir.path(), memory().await);
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    {
        let seen = Arc::clone(&seen);
        second.cache().publisher(ENVOY_GROUP).add_sink(move |snap| {
            let clusters: Vec<String> = snap
                .state()
                .iter_type(CLUSTER)
                .map(|(n, _)| n.to_string())
                .collect();
            // Version 0 is the cache's empty start, which the xDS server never
            // sends.
            if snap.version() > 0 {
                seen.lock().unwrap().push((snap.version(), clusters));
            }
        });
    }
    second.load().await.unwrap();
    let seen = seen.lock().unwrap().clone();
    assert!(!seen.is_empty(), "nothing published");
    for (version, clusters) in &seen {
        assert!(
            clusters.iter().any(|c| c == "outbound|8080|web.default"),
            "snapshot {version} has no cluster for the stored pod's service: {clusters:?}"
        );
    }
}

/// A registry whose `put` can be held at a gate: the test decides when it lands.
struct Gated {
    inner: Arc<dyn Registry>,
    hold: std::sync::atomic::AtomicBool,
    arrived: Notify,
    release: Notify,
}

#[async_trait::async_trait]
impl Registry for Gated {
    async fn put(&self, ep: &Endpoint) -> Result<u64, RegistryError> {
        if self.hold.swap(false, std::sync::atomic::Ordering::SeqCst) {
            self.arrived.notify_one();
            self.release.notified().await;
        }
        self.inner.put(ep).await
    }
    async fn delete(&self, key: &str) -> Result<bool, RegistryError> {
        self.inner.delete(key).await
    }
    async fn delete_if_revision(&self, key: &str, revision: u64) -> Result<bool, RegistryError> {
        self.inner.delete_if_revision(key, revision).await
    }
    fn view(&self) -> watch::Receiver<Arc<View>> {
        self.inner.view()
    }
    fn describe(&self) -> String {
        format!("gated {}", self.inner.describe())
    }
}

/// R4 with its interleaving forced: the liveness loop's re-registration is
/// in flight (its put held at the gate) while RemovePod runs to completion; then the
/// put lands. The re-check after registering sees the pod gone and undoes it, so no
/// ghost endpoint survives. Without the re-check (`reintroduced!("r4-agent")`,
/// checked by scripts/test) this test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_a_reregistration_racing_remove_pod_leaves_no_ghost() {
    let dir = tempfile::tempdir().unwrap();
    let gated = Arc::new(Gated {
        inner: memory().await,
        hold: false.into(),
        arrived: Notify::new(),
        release: Notify::new(),
    });
    let agent = agent_over(dir.path(), Arc::clone(&gated) as Arc<dyn Registry>);
    agent.load().await.unwrap();
    agent
        .add_pod(&input("c1", Some("web"), "8080"))
        .await
        .unwrap();
    let key = PodKey::new("c1", "eth0");

    gated.hold.store(true, std::sync::atomic::Ordering::SeqCst);
    let a = Arc::clone(&agent);
    let k = key.clone();
    let liveness = tokio::spawn(async move { a.reregister(&k).await });
    gated.arrived.notified().await; // the re-registration's put is in flight
    let removed = agent.remove_pod(&key).await;
    assert!(matches!(removed, Ok(PodOutcome::Done(_))));
    assert!(
        agent.registry().view().borrow().endpoints.is_empty(),
        "RemovePod unregistered"
    );
    gated.release.notify_one(); // the late put lands now
    liveness.await.unwrap();
    // The undo first: it is done (or not) once the re-registration returned, while
    // the ghost it leaves may already be gone again by the registry sync's own repair.
    assert_eq!(
        agent
            .metrics
            .guard_undos
            .load(std::sync::atomic::Ordering::Relaxed),
        1,
        "R4: the re-registration that landed after RemovePod was not undone by its re-check"
    );
    let ghosts: Vec<String> = endpoint_keys(&agent);
    assert!(
        ghosts.is_empty(),
        "ghost endpoint(s) after RemovePod: {ghosts:?}"
    );
}

#[tokio::test]
async fn orphan_endpoints_of_this_node_are_collected_after_k_sweeps() {
    let dir = tempfile::tempdir().unwrap();
    let reg = memory().await;
    let agent = agent_over(dir.path(), Arc::clone(&reg));
    agent.load().await.unwrap();
    agent
        .add_pod(&input("live", Some("web"), "8080"))
        .await
        .unwrap();
    // An endpoint of this node whose pod is not in the store (a crash between the
    // store delete and the unregister), and one of another node (never ours to GC).
    let mut orphan = reg
        .view()
        .borrow()
        .endpoints
        .values()
        .next()
        .map(|e| (**e).clone())
        .unwrap();
    orphan.pod_key = PodKey::new("crashed", "eth0");
    reg.put(&orphan).await.unwrap();
    let mut foreign = orphan.clone();
    foreign.node = "n2".into();
    reg.put(&foreign).await.unwrap();
    let sweeps = flock_core::gc::GcPolicy::default().confirm_sweeps;
    for i in 1..sweeps {
        assert_eq!(
            agent.gc_sweep(None).await,
            0,
            "sweep {i}: not confirmed yet"
        );
    }
    assert_eq!(agent.gc_sweep(None).await, 1);
    let left: Vec<String> = reg
        .view()
        .borrow()
        .endpoints
        .values()
        .map(|e| format!("{}/{}", e.node, e.pod_key))
        .collect();
    assert_eq!(left.len(), 2, "{left:?}");
    assert!(
        left.contains(&"n1/live/eth0".to_string()) && left.contains(&"n2/crashed/eth0".to_string()),
        "{left:?}"
    );
}

/// A registry that lets the pod come back just before the GC's first delete lands:
/// on that delete it runs the pod's AddPod (the same pod key, so the same endpoint
/// key), then forwards the delete.
struct ComesBack {
    inner: Arc<dyn Registry>,
    agent: std::sync::Mutex<std::sync::Weak<Agent>>,
    input: AddPodInput,
    fired: std::sync::atomic::AtomicBool,
}

impl ComesBack {
    /// Over the memory registry; the agent is set once it exists.
    async fn over_memory(input: AddPodInput) -> Arc<Self> {
        Arc::new(Self {
            inner: memory().await,
            agent: std::sync::Mutex::new(std::sync::Weak::new()),
            input,
            fired: false.into(),
        })
    }

    async fn before_delete(&self) {
        if self.fired.swap(true, std::sync::atomic::Ordering::SeqCst) {
            return;
        }
        let agent = self.agent.lock().unwrap().upgrade().expect("agent");
        agent
            .add_pod(&self.input)
            .await
            .expect("the pod comes back");
    }
}

#[async_trait::async_trait]
impl Registry for ComesBack {
    async fn put(&self, ep: &Endpoint) -> Result<u64, RegistryError> {
        self.inner.put(ep).await
    }
    async fn delete(&self, key: &str) -> Result<bool, RegistryError> {
        self.before_delete().await;
        self.inner.delete(key).await
    }
    async fn delete_if_revision(&self, key: &str, revision: u64) -> Result<bool, RegistryError> {
        self.before_delete().await;
        self.inner.delete_if_revision(key, revision).await
    }
    fn view(&self) -> watch::Receiver<Arc<View>> {
        self.inner.view()
    }
    fn describe(&self) -> String {
        format!("comes-back {}", self.inner.describe())
    }
}

/// The orphan GC against a pod that comes back: the sweep planned the endpoint's
/// removal from a view in which its pod was gone (a crash between the store delete
/// and the unregister), and the pod's AddPod re-registered the same key before the
/// delete landed. The delete is conditional on the revision the plan saw, so the new
/// registration survives and the live pod stays reachable. With an unconditional
/// delete (`reintroduced!("gc-unconditional")`, checked by scripts/test) the
/// live pod loses its endpoint and this test fails.
#[tokio::test]
async fn gc_never_deletes_a_registration_newer_than_its_plan() {
    let dir = tempfile::tempdir().unwrap();
    let pod = input("back", Some("web"), "8080");
    let racing = ComesBack::over_memory(pod.clone()).await;
    let agent = agent_over(dir.path(), Arc::clone(&racing) as Arc<dyn Registry>);
    agent.load().await.unwrap();
    // The pod's endpoint is registered, then its store record is lost as in a crash
    // after RemovePod's store delete: the endpoint is an orphan.
    agent.add_pod(&pod).await.unwrap();
    let key = PodKey::new("back", "eth0");
    let ep_keys: Vec<String> = endpoint_keys(&agent);
    assert_eq!(ep_keys.len(), 1);
    drop(agent);
    assert!(PodStore::open(dir.path()).unwrap().remove(&key).unwrap());
    let reopened = agent_over(dir.path(), Arc::clone(&racing) as Arc<dyn Registry>);
    *racing.agent.lock().unwrap() = Arc::downgrade(&reopened);
    reopened.load().await.unwrap();
    assert!(
        !reopened.pods().contains_key(&key),
        "the store lost the pod"
    );

    let sweeps = flock_core::gc::GcPolicy::default().confirm_sweeps;
    for _ in 1..sweeps {
        assert_eq!(reopened.gc_sweep(None).await, 0, "not confirmed yet");
    }
    // This sweep plans the delete; the pod comes back before it lands.
    reopened.gc_sweep(None).await;
    assert!(reopened.pods().contains_key(&key), "the pod came back");
    let left: Vec<String> = endpoint_keys(&reopened);
    assert_eq!(
        left, ep_keys,
        "the live pod's new registration was deleted by a GC plan made before it"
    );
}

/// The orphan GC's unsubscribe against a pod that comes back: a crash after the
/// store delete leaked the pod's endpoint and its identity subscription; the sweep
/// plans to remove both, and the pod's AddPod (run just before the GC's endpoint
/// delete lands) subscribes it again. The GC withdraws a subscription only in the
/// pod's turn and only while the pod is still gone, so the live pod keeps its
/// certificate. With the unconditional unsubscribe
/// (`reintroduced!("gc-unsubscribe-unconditional")`, checked by scripts/test) the live
/// pod loses its subscription and this test fails.
#[tokio::test]
async fn gc_never_unsubscribes_a_pod_added_after_its_plan() {
    let dir = tempfile::tempdir().unwrap();
    let pod = input("back", Some("web"), "8080");
    let racing = ComesBack::over_memory(pod.clone()).await;
    // One provider across the restart: its subscriptions outlive the first agent,
    // as a SPIRE agent's do.
    let ca = flock_bird::identity::BuiltinCa::new(
        "cluster.local",
        std::time::Duration::from_secs(3600),
        flock_clock::unix_now,
    )
    .unwrap();
    let with_ca =
        |agent: Arc<Agent>| Arc::new(Arc::into_inner(agent).unwrap().with_identity(ca.clone()));
    let agent = with_ca(agent_over(
        dir.path(),
        Arc::clone(&racing) as Arc<dyn Registry>,
    ));
    agent.load().await.unwrap();
    agent.add_pod(&pod).await.unwrap();
    let key = PodKey::new("back", "eth0");
    drop(agent);
    assert!(PodStore::open(dir.path()).unwrap().remove(&key).unwrap());
    let reopened = with_ca(agent_over(
        dir.path(),
        Arc::clone(&racing) as Arc<dyn Registry>,
    ));
    *racing.agent.lock().unwrap() = Arc::downgrade(&reopened);
    reopened.load().await.unwrap();
    let subscribed = || {
        flock_bird::identity::IdentityProvider::view(&*ca)
            .borrow()
            .subscriptions
            .contains_key(&key)
    };
    assert!(
        !reopened.pods().contains_key(&key),
        "the store lost the pod"
    );
    assert!(subscribed(), "the crash leaked the pod's subscription");

    let sweeps = flock_core::gc::GcPolicy::default().confirm_sweeps;
    for _ in 1..sweeps {
        assert_eq!(reopened.gc_sweep(None).await, 0, "not confirmed yet");
    }
    // This sweep plans the endpoint delete and the unsubscribe; the pod comes back
    // before the delete lands, so before the unsubscribe too.
    reopened.gc_sweep(None).await;
    assert!(reopened.pods().contains_key(&key), "the pod came back");
    assert!(
        subscribed(),
        "the live pod's subscription was withdrawn by a GC plan made before its ADD"
    );
}

/// An identity provider whose `subscribe` can be held at a gate.
struct GatedIdentity {
    inner: Arc<dyn flock_bird::identity::IdentityProvider>,
    hold: std::sync::atomic::AtomicBool,
    arrived: Notify,
    release: Notify,
}

#[async_trait::async_trait]
impl flock_bird::identity::IdentityProvider for GatedIdentity {
    async fn subscribe(
        &self,
        pod: &flock_bird::identity::PodIdentity,
    ) -> Result<String, flock_bird::identity::IdentityError> {
        if self.hold.swap(false, std::sync::atomic::Ordering::SeqCst) {
            self.arrived.notify_one();
            self.release.notified().await;
        }
        self.inner.subscribe(pod).await
    }
    async fn unsubscribe(&self, key: &PodKey) {
        self.inner.unsubscribe(key).await
    }
    fn view(&self) -> watch::Receiver<Arc<flock_bird::identity::IdentityView>> {
        self.inner.view()
    }
    fn describe(&self) -> String {
        format!("gated {}", self.inner.describe())
    }
}

/// R6 with its interleaving forced: after a restart, the agent resubscribes
/// the identities of its stored pods; one resubscription is in flight (held at the
/// gate) while RemovePod of that pod runs to completion, then it lands. The re-check
/// after subscribing sees the pod gone and withdraws it: no leaked subscription, no
/// SVID kept alive. Without the re-check (`reintroduced!("r6-agent")`,
/// checked by scripts/test) this test fails.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r6_a_resubscription_racing_remove_pod_leaks_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let ca = flock_bird::identity::BuiltinCa::new(
        "cluster.local",
        std::time::Duration::from_secs(3600),
        flock_clock::unix_now,
    )
    .unwrap();
    {
        let first = Arc::new(
            Arc::into_inner(agent_over(dir.path(), memory().await))
                .unwrap()
                .with_identity(ca.clone()),
        );
        first.load().await.unwrap();
        first
            .add_pod(&input("c1", Some("web"), "8080"))
            .await
            .unwrap();
    }
    // The restarted agent's provider starts empty (keys live in memory only).
    let fresh = flock_bird::identity::BuiltinCa::new(
        "cluster.local",
        std::time::Duration::from_secs(3600),
        flock_clock::unix_now,
    )
    .unwrap();
    let gated = Arc::new(GatedIdentity {
        inner: fresh,
        hold: true.into(),
        arrived: Notify::new(),
        release: Notify::new(),
    });
    let agent = Arc::new(
        Arc::into_inner(agent_over(dir.path(), memory().await))
            .unwrap()
            .with_identity(Arc::clone(&gated) as Arc<dyn flock_bird::identity::IdentityProvider>),
    );
    let a = Arc::clone(&agent);
    let loading = tokio::spawn(async move { a.load().await });
    gated.arrived.notified().await; // the resubscription is in flight
    let key = PodKey::new("c1", "eth0");
    assert!(matches!(
        agent.remove_pod(&key).await,
        Ok(PodOutcome::Done(_))
    ));
    gated.release.notify_one();
    loading.await.unwrap().unwrap();
    let view = flock_bird::identity::IdentityProvider::view(&*gated)
        .borrow()
        .clone();
    assert!(
        view.subscriptions.is_empty(),
        "leaked subscription(s): {:?}",
        view.subscriptions.keys().collect::<Vec<_>>()
    );
    assert!(
        view.svids.is_empty(),
        "an SVID kept alive for a removed pod"
    );
}

/// A stored record that parses but could not be served (no IP: the publisher takes
/// the pod's first IP) is quarantined at load; the agent loads the rest and
/// publishes.
#[tokio::test]
async fn a_stored_pod_without_an_ip_is_quarantined_and_publish_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    {
        let first = agent_over(dir.path(), memory().await);
        first.load().await.unwrap();
        first
            .add_pod(&input("good", Some("web"), "8080"))
            .await
            .unwrap();
        let mut bad = first
            .record_for(&input("noip", Some("web"), "8080"))
            .unwrap()
            .unwrap();
        bad.ips.clear();
        let store = PodStore::open(dir.path()).unwrap();
        std::fs::write(
            store.path_for(&bad.key),
            flock_bird::store::encode_record(&bad).unwrap(),
        )
        .unwrap();
    }
    let second = agent_over(dir.path(), memory().await);
    assert_eq!(second.load().await.unwrap(), (1, 1));
    assert_eq!(
        second.pods().into_keys().collect::<Vec<_>>(),
        vec![PodKey::new("good", "eth0")]
    );
    second.publish();
    let snap = second.cache().publisher(ENVOY_GROUP).latest();
    assert!(
        snap.state()
            .get(LISTENER, "inbound|default/pod-good|8080")
            .is_some()
    );
}

/// The agent translates for its own `--region`/`--zone`: in the service's EDS its
/// own zone's endpoint is priority 0, another zone of its region 1, another region 2
/// (so its Envoy keeps traffic in the zone and fails over by priority).
#[tokio::test]
async fn eds_priorities_follow_the_agents_zone_and_region() {
    use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
    use prost::Message;

    let dir = tempfile::tempdir().unwrap();
    let reg = memory().await;
    let store = Arc::new(PodStore::open(dir.path()).unwrap());
    let cache: Arc<Cache<Any>> = Arc::new(Cache::new(group_of));
    let mut config = AgentConfig::new("n1");
    config.region = "r1".into();
    config.zone = "z1".into();
    let agent = Arc::new(Agent::new(config, store, Arc::clone(&reg), cache));
    agent.load().await.unwrap();
    agent
        .add_pod(&input("live", Some("web"), "8080"))
        .await
        .unwrap();
    let own = reg
        .view()
        .borrow()
        .endpoints
        .values()
        .next()
        .map(|e| (**e).clone())
        .unwrap();
    assert_eq!((own.region.as_str(), own.zone.as_str()), ("r1", "z1"));
    // Endpoints of web on other nodes: same region other zone, another region.
    for (i, (node, region, zone)) in [("n2", "r1", "z2"), ("n3", "r2", "z3")]
        .into_iter()
        .enumerate()
    {
        let mut e = own.clone();
        e.node = node.into();
        e.pod_key = PodKey::new(format!("remote-{i}"), "eth0");
        e.address = std::net::Ipv4Addr::new(10, 9, 0, i as u8 + 1).into();
        e.region = region.into();
        e.zone = zone.into();
        reg.put(&e).await.unwrap();
    }
    agent.publish();
    let snap = agent.cache().snapshot(ENVOY_GROUP).unwrap();
    let (_, cla) = snap
        .state()
        .iter_type(flock_xds::types::ENDPOINT)
        .find(|(n, _)| n.to_string() == "outbound|8080|web.default")
        .expect("web's endpoints");
    let cla = ClusterLoadAssignment::decode(cla.value().value.as_slice()).unwrap();
    let mut priorities: Vec<(String, u32)> = Vec::new();
    for group in &cla.endpoints {
        for e in &group.lb_endpoints {
            let Some(lb_endpoint::HostIdentifier::Endpoint(ep)) = &e.host_identifier else {
                panic!("no endpoint");
            };
            let Some(envoy_types::pb::envoy::config::core::v3::address::Address::SocketAddress(sa)) =
                ep.address.as_ref().and_then(|a| a.address.as_ref())
            else {
                panic!("no socket address");
            };
            priorities.push((sa.address.clone(), group.priority));
        }
    }
    priorities.sort();
    assert_eq!(
        priorities,
        vec![
            (own.address.to_string(), 0),
            ("10.9.0.1".to_string(), 1),
            ("10.9.0.2".to_string(), 2),
        ]
    );
}
