//! Kube mode in process: the agent over a real pod store and the embedded registry,
//! its pod source (`flock_bird::kube::KubePods`) over real kube reflectors talking HTTP
//! to flock-kube's API-server double. The API server is a double because no Kubernetes
//! control plane can run where this suite runs; it serves the list/watch/get HTTP API
//! kube's client and watcher use, and can be made unreachable.
//!
//! What is checked: identity and ports come from the API (annotations change nothing);
//! a Service created after the pod's ADD registers it without any new CNI call, a
//! label change unregisters it, and the GC leaves memberships of live pods alone; an
//! unreachable API fails the ADD with the message the runtime shows; a pod not opted
//! in is ignored; a sandbox whose pod was re-created under the same name is refused;
//! malformed flock annotations do not stop a kube pod at the CNI plugin (the agent,
//! which ignores them, is their one judge).

use envoy_types::pb::google::protobuf::Any;
use flock_bird::agent::{
    AddPodInput, Agent, AgentConfig, ENVOY_GROUP, PodError, PodOutcome, group_of,
};
use flock_bird::kube::KubePods;
use flock_bird::model::Endpoint;
use flock_bird::registry::{self, Registry, RegistryError, RegistryOptions, RegistrySpec, View};
use flock_bird::store::PodStore;
use flock_kube::double::ApiServer;
use flock_kube::watch::{KubeWatch, WatchOptions};
use flock_testkit::wait_for_async;
use flock_xds::cache::Cache;
use flock_xds::types::CLUSTER;
use k8s_openapi::api::core::v1::{Namespace, Pod, Service};
use serde_json::json;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, watch};

const UID: &str = "0e0c8a4f-0000-4000-8000-00000000000a";
/// A network namespace file that exists on every Linux machine (the agent serves a
/// pod only if its netns exists; no Envoy runs here).
const NETNS: &str = "/proc/self/ns/net";
/// The namespace path of ADDs through the CNI socket: one that does not exist.
const PLUGIN_NETNS: &str = "/var/run/netns/flock-kube-agent-absent";

fn namespace(name: &str, meshed: bool) -> Namespace {
    let labels = if meshed {
        json!({"flock.io/mesh": "enabled"})
    } else {
        json!({})
    };
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": name, "labels": labels}
    }))
    .unwrap()
}

fn pod(ns: &str, name: &str, uid: &str, labels: serde_json::Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "uid": uid, "labels": labels},
        "spec": {
            "nodeName": "n1",
            "serviceAccountName": "web-sa",
            "containers": [{"name": "app", "image": "web",
                "ports": [{"containerPort": 8080, "name": "http"}]}]
        }
    }))
    .unwrap()
}

fn web_service() -> Service {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 80, "targetPort": "http"}]}
    }))
    .unwrap()
}

fn input(ns: &str, name: &str, uid: &str) -> AddPodInput {
    AddPodInput {
        container_id: format!("ctr-{name}"),
        ifname: "eth0".into(),
        netns: NETNS.into(),
        name: name.into(),
        namespace: ns.into(),
        uid: uid.into(),
        ips: vec!["10.1.0.5/24".into()],
        gateways: Vec::new(),
        annotations: BTreeMap::new(),
        network_name: "net".into(),
    }
}

struct Setup {
    api: ApiServer,
    agent: Arc<Agent>,
    _stop: watch::Sender<bool>,
    _dir: tempfile::TempDir,
}

async fn setup() -> Setup {
    setup_with(|reg| reg, true).await
}

/// [`setup`] with the registry wrapped by `wrap`, and the background resync loop only
/// when `background_resync` (a test that forces a schedule runs each resync itself).
async fn setup_with(
    wrap: impl FnOnce(Arc<dyn Registry>) -> Arc<dyn Registry>,
    background_resync: bool,
) -> Setup {
    let api = ApiServer::start().await;
    api.apply(&namespace("shop", true));
    api.apply(&namespace("plain", false));
    let dir = tempfile::tempdir().unwrap();
    let reg: Arc<dyn Registry> = registry::connect(
        &RegistrySpec::Memory,
        RegistryOptions {
            node: "n1".into(),
            ..RegistryOptions::default()
        },
    )
    .await
    .unwrap();
    let reg = wrap(reg);
    let watch = Arc::new(KubeWatch::start(
        api.client(),
        WatchOptions {
            node_name: "n1".into(),
            endpoint_slices: false,
        },
    ));
    let mut cfg = AgentConfig::new("n1");
    cfg.refresh_debounce = Duration::from_millis(20);
    cfg.gc_policy.confirm_sweeps = 1;
    let store = Arc::new(PodStore::open(dir.path()).unwrap());
    let cache: Arc<Cache<Any>> = Arc::new(Cache::new(group_of));
    let agent = Arc::new(
        Agent::new(cfg, store, reg, cache).with_kube(Arc::new(KubePods::new(
            watch,
            "n1",
            Duration::from_millis(500),
        ))),
    );
    agent.load().await.unwrap();
    let (stop, stop_rx) = watch::channel(false);
    if background_resync {
        tokio::spawn(Arc::clone(&agent).run_kube_resync(stop_rx.clone()));
        // The runtime's refresher, as the agent binary runs it: a registry write that
        // lands after a membership change's own publish (the registry sync's, say) is
        // published too, so the snapshot follows the registry as in production.
        let a = Arc::clone(&agent);
        let ids = agent.identity().map(|p| p.view());
        tokio::spawn(flock_bird::runtime::refresh_loop(
            agent.registry().view(),
            ids,
            Duration::from_millis(20),
            move || {
                a.publish();
            },
            stop_rx,
        ));
    }
    Setup {
        api,
        agent,
        _stop: stop,
        _dir: dir,
    }
}

/// How long a wait for the agent or its reflectors may take.
const WAIT: Duration = Duration::from_secs(10);

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

fn clusters(agent: &Agent) -> Vec<String> {
    let snap = agent.cache().snapshot(ENVOY_GROUP).unwrap();
    snap.state()
        .iter_type(CLUSTER)
        .map(|(n, _)| n.to_string())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identity_from_the_api_and_memberships_follow_services_and_labels() {
    let s = setup().await;
    let agent = &s.agent;
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web"})));
    wait_for_async("the reflectors synced (ready)", WAIT, || {
        agent.not_ready().is_none()
    })
    .await;

    // An annotation claiming another account, service and ports changes nothing.
    let mut req = input("shop", "web-0", UID);
    req.annotations = [
        ("flock.io/service-account".to_string(), "admin".to_string()),
        ("flock.io/service".to_string(), "payments".to_string()),
        ("flock.io/ports".to_string(), "7000".to_string()),
    ]
    .into();
    let out = agent.add_pod(&req).await.unwrap();
    assert!(
        matches!(&out, PodOutcome::Done(m) if m.contains("web-sa")),
        "{out:?}"
    );
    let rec = agent.pods().into_values().next().unwrap();
    assert_eq!(rec.service_account, "web-sa");
    assert_eq!(rec.service, "");
    assert_eq!(
        rec.ports.iter().map(|p| p.app_port).collect::<Vec<_>>(),
        vec![8080]
    );
    // No Service selects it yet: nothing registered.
    assert_eq!(endpoint_keys(agent), Vec::<String>::new());

    // A Service created after the ADD: registered and published, no CNI call.
    s.api.apply(&web_service());
    let key = "n1/shop/web/ctr-web-0/eth0/80";
    wait_for_async("the membership registered", WAIT, || {
        endpoint_keys(agent) == vec![key.to_string()]
    })
    .await;
    let ep = agent.registry().view().borrow().endpoints[key].clone();
    assert_eq!((ep.service_port, ep.port), (80, 15006));
    assert_eq!(ep.pod, "shop/web-0");
    wait_for_async("the Service's cluster published", WAIT, || {
        clusters(agent).iter().any(|c| c.contains("web.shop"))
    })
    .await;

    // The GC judges by pod key: a live pod's memberships are not orphans.
    for _ in 0..3 {
        agent.gc_sweep(None).await;
    }
    assert_eq!(endpoint_keys(agent), vec![key.to_string()]);

    // A label change takes it out of the Service.
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web-v2"})));
    wait_for_async("the membership unregistered", WAIT, || {
        endpoint_keys(agent).is_empty()
    })
    .await;
    wait_for_async("the Service's cluster withdrawn", WAIT, || {
        !clusters(agent).iter().any(|c| c.contains("web.shop"))
    })
    .await;

    // Back in: registered again; then CNI DEL leaves nothing.
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web"})));
    wait_for_async("the membership registered again", WAIT, || {
        endpoint_keys(agent) == vec![key.to_string()]
    })
    .await;
    let rec_key = agent.pods().into_keys().next().unwrap();
    assert!(matches!(
        agent.remove_pod(&rec_key).await,
        Ok(PodOutcome::Done(_))
    ));
    assert!(endpoint_keys(agent).is_empty());
    assert!(agent.pods().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_api_fails_the_add_and_refuses_to_guess() {
    let s = setup().await;
    wait_for_async("the reflectors synced (ready)", WAIT, || {
        s.agent.not_ready().is_none()
    })
    .await;
    s.api.set_unreachable(true);
    // Created while the agent cannot see it: neither the watch nor a GET answers.
    s.api
        .apply(&pod("shop", "web-1", UID, json!({"app": "web"})));
    match s.agent.add_pod(&input("shop", "web-1", UID)).await {
        Err(PodError::Unidentified(m)) => {
            assert!(
                m.starts_with(
                    "cannot identify pod shop/web-1: the Kubernetes API is unreachable ("
                ) && m.ends_with("); refusing to guess its identity"),
                "{m}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(s.agent.pods().is_empty());
    assert!(endpoint_keys(&s.agent).is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_not_opted_in_is_ignored_and_a_recreated_pods_sandbox_refused() {
    let s = setup().await;
    wait_for_async("the reflectors synced (ready)", WAIT, || {
        s.agent.not_ready().is_none()
    })
    .await;
    s.api
        .apply(&pod("plain", "app-0", UID, json!({"app": "web"})));
    match s.agent.add_pod(&input("plain", "app-0", UID)).await {
        Ok(PodOutcome::Ignored(why)) => assert!(why.contains("not meshed"), "{why}"),
        other => panic!("{other:?}"),
    }
    // The API's pod of this name is another one than the runtime's sandbox is for.
    s.api
        .apply(&pod("shop", "web-2", UID, json!({"app": "web"})));
    let old_sandbox = input("shop", "web-2", "99999999-0000-4000-8000-000000000000");
    match s.agent.add_pod(&old_sandbox).await {
        Err(PodError::Unidentified(m)) => assert!(m.contains("re-created"), "{m}"),
        other => panic!("{other:?}"),
    }
    assert!(s.agent.pods().is_empty());
}

/// An API server that accepts connections and never answers (hung, or a proxy in
/// front of a dead one): the ADD still fails with the reason, and before the CNI
/// plugin's default 5 s timeout would cut it off with a bare "deadline exceeded".
/// (A plain listener, not the double: the double answers or closes.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_silent_api_fails_the_add_in_time_with_the_reason() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut open = Vec::new();
        while let Ok((conn, _)) = listener.accept().await {
            open.push(conn);
        }
    });
    let config = kube::Config::new(format!("http://{addr}").parse().unwrap());
    let watch = Arc::new(KubeWatch::start(
        kube::Client::try_from(config).unwrap(),
        WatchOptions {
            node_name: "n1".into(),
            endpoint_slices: false,
        },
    ));
    let pods = KubePods::new(watch, "n1", Duration::from_secs(1));
    let started = std::time::Instant::now();
    match pods.admit(&input("shop", "web-0", UID)).await {
        Err(PodError::Unidentified(m)) => assert!(
            m.starts_with("cannot identify pod shop/web-0: the Kubernetes API is unreachable (")
                && m.contains("no answer"),
            "{m}"
        ),
        other => panic!("{other:?}"),
    }
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(4900),
        "the ADD took {took:?}: the plugin would have given up first"
    );
    held.abort();
}

/// Runs one CNI ADD the way the `flock-cni` binary does (`flock_cni::plugin::run`, from
/// environment and stdin) against the agent's CNI socket at `socket`, for `pod` with
/// `annotations` as the runtime passes them. Blocking (the plugin runs its own
/// runtime): call it from `spawn_blocking`.
fn plugin_add(
    socket: &std::path::Path,
    pod: &AddPodInput,
    annotations: &serde_json::Value,
) -> flock_cni::plugin::Output {
    let env: BTreeMap<&str, String> = [
        ("CNI_COMMAND", "ADD".to_string()),
        ("CNI_CONTAINERID", pod.container_id.clone()),
        // Not `pod.netns` (`/proc/self/ns/net`): over the CNI socket the agent refuses
        // its own namespace. The record is all this path is judged by.
        ("CNI_NETNS", PLUGIN_NETNS.to_string()),
        ("CNI_IFNAME", pod.ifname.clone()),
        ("CNI_PATH", "/opt/cni/bin".to_string()),
        (
            "CNI_ARGS",
            format!(
                "K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_UID={}",
                pod.namespace, pod.name, pod.uid
            ),
        ),
    ]
    .into();
    let conf = json!({
        "cniVersion": "1.1.0", "name": pod.network_name, "type": "flock-cni",
        "agent_socket": socket, "timeout_ms": 5000,
        "prevResult": {"cniVersion": "1.1.0",
                       "ips": pod.ips.iter().map(|a| json!({"address": a})).collect::<Vec<_>>()},
        "runtimeConfig": {"io.kubernetes.cri.pod-annotations": annotations}
    });
    flock_cni::plugin::run(
        &|k| env.get(k).map(Into::into),
        Some(&serde_json::to_vec(&conf).unwrap()),
    )
}

/// Serves `agent`'s CNI API on a socket in `dir` until the returned sender is dropped
/// or fires; returns the socket's path.
fn serve_cni(
    agent: &Arc<Agent>,
    dir: &std::path::Path,
) -> (std::path::PathBuf, tokio::sync::oneshot::Sender<()>) {
    let socket = dir.join("cni.sock");
    let listener = flock_bird::cni_server::CniServer::bind(&socket).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = flock_bird::cni_server::CniServer::new(Arc::clone(agent));
    let path = socket.clone();
    tokio::spawn(async move {
        server
            .serve_bound(listener, &path, async {
                let _ = stopped.await;
            })
            .await
    });
    (socket, stop)
}

/// The plugin does not judge the flock annotations, because only the agent knows
/// whether it reads them. The same ADD — the real plugin code
/// (`flock_cni::plugin::run`) over the agent's CNI socket — for a pod whose
/// `flock.io/service`, `flock.io/ports` and `flock.io/service-account` annotations are
/// malformed: a kube-mode agent ignores them and meshes the pod from its API facts; an
/// annotation-mode agent refuses it, and the runtime gets CNI error 102 naming the
/// field. The API server is flock-kube's double (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_flock_annotations_are_the_agents_to_judge_kube_mode_ignores_them() {
    let s = setup().await;
    let agent = &s.agent;
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web"})));
    wait_for_async("the reflectors synced (ready)", WAIT, || {
        agent.not_ready().is_none()
    })
    .await;
    let annotations = json!({"flock.io/service": "web", "flock.io/ports": "http",
                             "flock.io/service-account": "Not_An_Account"});
    let add = |socket: std::path::PathBuf| {
        let annotations = annotations.clone();
        tokio::task::spawn_blocking(move || {
            plugin_add(&socket, &input("shop", "web-0", UID), &annotations)
        })
    };

    let dir = tempfile::tempdir().unwrap();
    let (socket, _stop) = serve_cni(agent, dir.path());
    let out = add(socket).await.unwrap();
    assert_eq!(
        out.exit_code,
        0,
        "kube-mode ADD failed: {} {:?}",
        String::from_utf8_lossy(&out.stdout),
        out.stderr
    );
    let rec = agent
        .pods()
        .into_values()
        .next()
        .expect("the pod is meshed");
    assert_eq!(rec.service_account, "web-sa");
    assert_eq!(rec.service, "");
    assert_eq!(
        rec.ports.iter().map(|p| p.app_port).collect::<Vec<_>>(),
        vec![8080]
    );

    // The same ADD to an agent without --kube, which reads the annotations.
    let plain_dir = tempfile::tempdir().unwrap();
    let plain = Arc::new(Agent::new(
        AgentConfig::new("n1"),
        Arc::new(PodStore::open(plain_dir.path()).unwrap()),
        registry::connect(&RegistrySpec::Memory, RegistryOptions::default())
            .await
            .unwrap(),
        Arc::new(Cache::new(group_of)),
    ));
    plain.load().await.unwrap();
    let (socket, _stop_plain) = serve_cni(&plain, plain_dir.path());
    let out = add(socket).await.unwrap();
    assert_eq!(out.exit_code, 1);
    let err: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(err["code"], 102, "{err}");
    let msg = err["msg"].as_str().unwrap();
    assert!(
        msg.contains("pod shop/web-0 cannot be meshed: flock.io/ports: \"http\" is not a port"),
        "{msg}"
    );
    assert!(plain.pods().is_empty());
}

/// A registry whose next `put` after `hold` is set stops at a gate: it says it
/// `arrived`, waits for `release`, then writes and says it `landed`.
struct Gated {
    inner: Arc<dyn Registry>,
    hold: AtomicBool,
    arrived: Notify,
    release: Notify,
    landed: Notify,
    /// Set by the test once RemovePod of the pod has answered.
    answered: AtomicBool,
    /// The held put landed after that answer: the registry then holds an endpoint of
    /// a pod whose removal was acknowledged (a ghost, however briefly).
    landed_after_answer: AtomicBool,
}

#[async_trait::async_trait]
impl Registry for Gated {
    async fn put(&self, ep: &Endpoint) -> Result<u64, RegistryError> {
        if self.hold.swap(false, Ordering::SeqCst) {
            self.arrived.notify_one();
            self.release.notified().await;
            let rev = self.inner.put(ep).await;
            if self.answered.load(Ordering::SeqCst) {
                self.landed_after_answer.store(true, Ordering::SeqCst);
            }
            self.landed.notify_one();
            return rev;
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

/// R4 in kube mode's resync, its interleaving forced: a Service appears, the resync's
/// put of the pod's new membership endpoint is held at the registry while RemovePod of
/// that pod is asked for, then the put lands. No ghost endpoint may outlive the pod.
/// The resync holds the pod's lock, so RemovePod waits for it and then unregisters
/// the endpoint; the re-check after the put (the second layer) would undo it were the
/// pod gone. Without both (`reintroduced!("r4-kube-resync")`, checked by
/// scripts/test) RemovePod finishes while the put is held, misses it, and the late put
/// lands after that answer: a ghost (the registry sync deletes it soon after, so the
/// test catches the late landing itself): this test fails. Under the fix RemovePod cannot finish while the
/// put is held; the test waits for it at most `BLOCKED` before releasing the put (the
/// bound only ends the wait for what the lock forbids; the outcome does not depend
/// on it). The API server is flock-kube's double (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_a_membership_put_racing_remove_pod_leaves_no_ghost() {
    const BLOCKED: Duration = Duration::from_secs(2);
    let mut gate = None;
    let s = setup_with(
        |inner| {
            let gated = Arc::new(Gated {
                inner,
                hold: false.into(),
                arrived: Notify::new(),
                release: Notify::new(),
                landed: Notify::new(),
                answered: false.into(),
                landed_after_answer: false.into(),
            });
            gate = Some(Arc::clone(&gated));
            gated
        },
        false,
    )
    .await;
    let gated = gate.unwrap();
    let agent = &s.agent;
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web"})));
    wait_for_async("the reflectors synced (ready)", WAIT, || {
        agent.not_ready().is_none()
    })
    .await;
    agent.add_pod(&input("shop", "web-0", UID)).await.unwrap();
    let key = agent.pods().into_keys().next().unwrap();
    assert!(endpoint_keys(agent).is_empty(), "no Service selects it yet");

    s.api.apply(&web_service());
    let kube = Arc::clone(agent.kube().unwrap());
    wait_for_async("the reflector has Service web", WAIT, || {
        !kube.watch().view().borrow().services.is_empty()
    })
    .await;
    gated.hold.store(true, Ordering::SeqCst);
    let resync = tokio::spawn({
        let agent = Arc::clone(agent);
        async move { agent.kube_resync().await }
    });
    gated.arrived.notified().await; // the membership's put is in flight
    let mut remove = tokio::spawn({
        let agent = Arc::clone(agent);
        let key = key.clone();
        async move { agent.remove_pod(&key).await }
    });
    let finished_early = tokio::time::timeout(BLOCKED, &mut remove).await.ok();
    if finished_early.is_some() {
        gated.answered.store(true, Ordering::SeqCst);
    }
    gated.release.notify_one(); // the late put lands now
    gated.landed.notified().await;
    let removed = match finished_early {
        Some(done) => done.unwrap(),
        None => remove.await.unwrap(),
    };
    assert!(matches!(removed, Ok(PodOutcome::Done(_))), "{removed:?}");
    resync.await.unwrap();
    assert!(agent.pods().is_empty());
    // The registry sync would delete such a late write soon after (a third layer), so
    // the ghost is caught where it happens, not by looking for it later.
    assert!(
        !gated.landed_after_answer.load(Ordering::SeqCst),
        "the pod's membership endpoint was registered after its RemovePod answered: a \
         ghost endpoint, served to other nodes until something deletes it"
    );
    let ghosts = endpoint_keys(agent);
    assert!(
        ghosts.is_empty(),
        "ghost endpoint(s) after RemovePod: {ghosts:?}"
    );
}

fn authz_policy(name: &str, spec: serde_json::Value) -> flock_kube::policy::AuthorizationPolicy {
    serde_json::from_value(json!({
        "apiVersion": "flock.io/v1alpha1", "kind": "AuthorizationPolicy",
        "metadata": {"name": name, "namespace": "shop"},
        "spec": spec,
    }))
    .unwrap()
}

/// The published inbound listener of pod `shop/web-0`, as bytes (the RBAC filter and
/// its principals are plain strings in them).
fn web_listener(agent: &Agent) -> String {
    let snap = agent.cache().snapshot(ENVOY_GROUP).unwrap();
    snap.state()
        .iter_type(flock_xds::types::LISTENER)
        .find(|(n, _)| n.starts_with("inbound|shop/web-0|"))
        .map(|(_, l)| String::from_utf8_lossy(&l.value().value).into_owned())
        .unwrap_or_default()
}

/// Kube mode's authorization policies: AuthorizationPolicy objects from the API reach
/// the pod's inbound listener through its Service memberships, follow those
/// memberships (a label change takes the pod out from under its Service's policy), a
/// port behind two Services under different policies is refused, a malformed object
/// is refused and named, and a deleted one is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn authorization_policies_come_from_the_api_and_follow_memberships() {
    let s = setup().await;
    let agent = &s.agent;
    tokio::spawn(flock_bird::agent::policies::follow_kube(
        Arc::clone(agent),
        agent.kube().cloned().unwrap(),
    ));
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web"})));
    s.api.apply(&web_service());
    wait_for_async("the reflectors synced (ready)", WAIT, || {
        agent.not_ready().is_none()
    })
    .await;
    agent.add_pod(&input("shop", "web-0", UID)).await.unwrap();
    wait_for_async("the membership registered", WAIT, || {
        endpoint_keys(agent).len() == 1
    })
    .await;
    assert!(
        !web_listener(agent).is_empty(),
        "web-0's listener published"
    );
    assert!(!web_listener(agent).contains("envoy.filters.http.rbac"));

    // web's policy: only shop/caller, on the Service's port 80 (the pod's 8080).
    let allow_caller = json!({"service": "web", "default": "deny", "rules": [
        {"action": "allow", "from": {"serviceAccounts": ["shop/caller"]}, "to": {"ports": [80]}}]});
    s.api
        .apply(&authz_policy("web-allow", allow_caller.clone()));
    let under_web = |l: &str| l.contains("envoy.filters.http.rbac") && l.contains("sa/caller");
    wait_for_async("web's policy on web-0's listener", WAIT, || {
        under_web(&web_listener(agent))
    })
    .await;
    let policies = agent.policies();
    assert_eq!(policies.len(), 1, "{policies:?}");
    assert_eq!(policies[0].0.to_string(), "shop/web");
    assert_eq!(policies[0].1.origin, "AuthorizationPolicy shop/web-allow");

    // Out of the Service: web's policy no longer governs the pod.
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web-v2"})));
    wait_for_async("web-0 out from under web's policy", WAIT, || {
        !web_listener(agent).contains("envoy.filters.http.rbac")
    })
    .await;
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web"})));
    wait_for_async("web-0 under web's policy again", WAIT, || {
        under_web(&web_listener(agent))
    })
    .await;

    // A second Service on the same pod port, with no policy of its own: which Service
    // a caller addressed cannot be told at the pod, so the port is refused (RBAC with
    // no rule that allows), not opened to the namespace's default.
    let alt: Service = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": "web-alt", "namespace": "shop"},
        "spec": {"selector": {"app": "web"},
                 "ports": [{"name": "http", "port": 81, "targetPort": "http"}]}
    }))
    .unwrap();
    s.api.apply(&alt);
    wait_for_async("the port refused while two policies claim it", WAIT, || {
        let l = web_listener(agent);
        l.contains("envoy.filters.http.rbac") && !l.contains("sa/caller")
    })
    .await;
    assert!(s.api.delete::<Service>(Some("shop"), "web-alt"));
    wait_for_async("web's policy alone again", WAIT, || {
        under_web(&web_listener(agent))
    })
    .await;

    // A misspelt field: refused (fail closed) and named.
    s.api.apply(&authz_policy(
        "web-allow",
        json!({"service": "web", "rules": [{"action": "allow", "frm": {}}]}),
    ));
    wait_for_async("the malformed object refused", WAIT, || {
        agent.policies().iter().any(|(_, p)| {
            p.written
                .as_ref()
                .is_err_and(|e| e.to_string().contains("frm"))
        })
    })
    .await;
    wait_for_async("web-0 denies everyone", WAIT, || {
        let l = web_listener(agent);
        l.contains("envoy.filters.http.rbac") && !l.contains("sa/caller")
    })
    .await;

    // Deleted: no policy left, the listener as before any.
    assert!(
        s.api
            .delete::<flock_kube::policy::AuthorizationPolicy>(Some("shop"), "web-allow")
    );
    wait_for_async("the policy gone", WAIT, || agent.policies().is_empty()).await;
    wait_for_async("web-0's listener without RBAC", WAIT, || {
        !web_listener(agent).contains("envoy.filters.http.rbac")
    })
    .await;
}

/// `pod` with `status.phase`.
fn pod_in_phase(ns: &str, name: &str, uid: &str, phase: &str) -> Pod {
    let mut p = pod(ns, name, uid, json!({"app": "web"}));
    p.status = Some(k8s_openapi::api::core::v1::PodStatus {
        phase: Some(phase.into()),
        ..Default::default()
    });
    p
}

/// Unmeshed pods: a Running, opted-in pod of this node with no store record (it
/// started before the plugin was in the chain) is reported by one sweep — the
/// sweeper's count and one Warning Event `Unmeshed` on the pod — while a pod the agent
/// added, a pod not opted in and a Pending pod are not; with `--repair delete` it is
/// deleted (only that UID: a pod re-created under the name is not). The API server is
/// the double, as in the rest of this file.
#[tokio::test]
async fn a_running_pod_without_a_record_is_reported_in_one_sweep_and_deleted_on_request() {
    use flock_bird::repair::{RepairMode, Repairer};
    use k8s_openapi::api::core::v1::Event;
    let s = setup().await;
    let uid = |n: u8| format!("0e0c8a4f-0000-4000-8000-0000000000{n:02x}");
    s.api
        .apply(&pod_in_phase("shop", "web-0", &uid(1), "Running"));
    s.api
        .apply(&pod_in_phase("shop", "web-1", &uid(2), "Running"));
    s.api
        .apply(&pod_in_phase("plain", "app-0", &uid(3), "Running"));
    s.api
        .apply(&pod_in_phase("shop", "web-2", &uid(4), "Pending"));
    let kube = Arc::clone(s.agent.kube().unwrap());
    wait_for_async("the reflector to hold the four pods", WAIT, || {
        kube.snapshot().pods.len() == 4
    })
    .await;
    // web-0 went through the agent (its record is in the store); web-1 did not.
    let out = s
        .agent
        .add_pod(&input("shop", "web-0", &uid(1)))
        .await
        .unwrap();
    assert!(matches!(out, PodOutcome::Done(_)), "{out:?}");
    wait_for_async("the agent ready", WAIT, || s.agent.not_ready().is_none()).await;

    let report = Repairer::new("n1", RepairMode::Report);
    let found = report.sweep(&s.agent, &kube).await;
    let names: Vec<&str> = found.iter().map(|u| u.name.as_str()).collect();
    assert_eq!(names, ["web-1"]);
    assert_eq!(report.unmeshed(), 1);
    // Read in process: the audit of the agent's requests stays the agent's.
    let list: Vec<Event> = s.api.list(Some("shop"));
    assert_eq!(list.len(), 1, "{list:?}");
    let e = &list[0];
    assert_eq!(e.reason.as_deref(), Some("Unmeshed"));
    assert_eq!(e.type_.as_deref(), Some("Warning"));
    assert_eq!(e.involved_object.name.as_deref(), Some("web-1"));
    assert_eq!(e.involved_object.uid.as_deref(), Some(uid(2).as_str()));
    // Reported once per pod: a second sweep finds it again and writes no new Event.
    assert_eq!(report.sweep(&s.agent, &kube).await.len(), 1);
    assert_eq!(s.api.list::<Event>(Some("shop")).len(), 1);
    assert!(
        s.api.get::<Pod>(Some("shop"), "web-1").is_some(),
        "report mode deletes nothing"
    );

    // --repair delete: the unmeshed pod goes; the others stay.
    let repair = Repairer::new("n1", RepairMode::Delete);
    assert_eq!(repair.sweep(&s.agent, &kube).await.len(), 1);
    assert_eq!(repair.deleted(), 1);
    assert!(s.api.get::<Pod>(Some("shop"), "web-1").is_none(), "deleted");
    for (ns, name) in [("shop", "web-0"), ("plain", "app-0"), ("shop", "web-2")] {
        assert!(
            s.api.get::<Pod>(Some(ns), name).is_some(),
            "{ns}/{name} kept"
        );
    }
    // Only the UID it saw: a pod re-created under the name before the delete lands
    // is refused by the UID precondition (the reflector still shows the old one).
    let stale = flock_bird::repair::Unmeshed {
        namespace: "shop".into(),
        name: "web-0".into(),
        uid: uid(9),
    };
    let api: kube::Api<Pod> = kube::Api::namespaced(s.api.client(), "shop");
    let params = kube::api::DeleteParams {
        preconditions: Some(kube::api::Preconditions {
            uid: Some(stale.uid.clone()),
            resource_version: None,
        }),
        ..Default::default()
    };
    let err = api.delete(&stale.name, &params).await.unwrap_err();
    assert!(err.to_string().contains("Precondition failed"), "{err}");
    assert!(s.api.get::<Pod>(Some("shop"), "web-0").is_some());
}

/// [`setup`] with the routes follower running, pod `shop/web-0` (not yet added),
/// Service `web` and `extra` Services in the API, and the reflectors synced.
async fn route_setup(extra: &[Service]) -> Setup {
    let s = setup().await;
    tokio::spawn(flock_bird::agent::routes::follow_kube(
        Arc::clone(&s.agent),
        s.agent.kube().cloned().unwrap(),
    ));
    s.api
        .apply(&pod("shop", "web-0", UID, json!({"app": "web"})));
    s.api.apply(&web_service());
    for svc in extra {
        s.api.apply(svc);
    }
    wait_for_async("the reflectors synced (ready)", WAIT, || {
        s.agent.not_ready().is_none()
    })
    .await;
    s
}

/// An HTTPRoute `shop/web` on Service web's port 80, every request to `backend`.
fn route_to(backend: &str) -> flock_kube::route::HttpRoute {
    serde_json::from_value(json!({
        "apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
        "metadata": {"name": "web", "namespace": "shop"},
        "spec": {"parentRefs": [{"group": "", "kind": "Service", "name": "web", "port": 80}],
                 "rules": [{"backendRefs": [{"name": backend, "port": 80}]}]}
    }))
    .unwrap()
}

/// The status of HTTPRoute `shop/web` as stored.
fn route_status(api: &ApiServer) -> Option<serde_json::Value> {
    api.get::<flock_kube::route::HttpRoute>(Some("shop"), "web")?
        .status
}

/// HTTPRoute status over the status subresource: the agent writes the mesh's entry
/// (`ResolvedRefs` False for a missing backend) with the object's resourceVersion as
/// a precondition. Another controller's status written between the agent's read and
/// its patch (the double's interposed write) fails the patch with 409; the agent's
/// write after it keeps that controller's entry, never overwriting the list it did
/// not see.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_status_is_written_without_dropping_another_controllers_entry() {
    let s = route_setup(&[]).await;
    s.agent.add_pod(&input("shop", "web-0", UID)).await.unwrap();
    let route = route_to("web-gone");
    let mut theirs = route.clone();
    theirs.status = Some(json!({"parents": [{
        "parentRef": {"name": "edge"},
        "controllerName": "example.com/gateway",
        "conditions": [],
    }]}));
    s.api.write_before_next_patch(&theirs);
    s.api.apply(&route);
    let controllers = || -> Vec<String> {
        route_status(&s.api)
            .and_then(|st| st["parents"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|p| p["controllerName"].as_str().map(str::to_string))
            .collect()
    };
    wait_for_async("the mesh's status entry written", WAIT, || {
        controllers().contains(&flock_kube::route::CONTROLLER_NAME.to_string())
    })
    .await;
    assert_eq!(
        controllers(),
        vec![
            "example.com/gateway".to_string(),
            "flock.io/mesh".to_string()
        ],
        "the agent's status write dropped another controller's entry"
    );
    let status = route_status(&s.api).unwrap();
    let ours = &status["parents"][1]["conditions"];
    assert_eq!(ours[1]["type"], "ResolvedRefs", "{status}");
    assert_eq!(ours[1]["reason"], "BackendNotFound", "{status}");
}

/// A route's status follows the services it resolves against, not only the route
/// object: a backend with no endpoints is `BackendNotFound`, and once its pod is
/// added (no change of the route) the status turns `ResolvedRefs: True`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn route_status_follows_a_backend_that_gains_endpoints() {
    // web-v1: the same pods, the route's backend.
    let mut v1 = web_service();
    v1.metadata.name = Some("web-v1".into());
    let s = route_setup(&[v1]).await;
    s.api.apply(&route_to("web-v1"));
    let resolved = || -> Option<String> {
        let st = route_status(&s.api)?;
        let c = st["parents"][0]["conditions"]
            .as_array()?
            .iter()
            .find(|c| c["type"] == "ResolvedRefs")?
            .clone();
        c["status"].as_str().map(str::to_string)
    };
    wait_for_async(
        "ResolvedRefs False: web-v1 has no endpoints yet",
        WAIT,
        || resolved().as_deref() == Some("False"),
    )
    .await;
    s.agent.add_pod(&input("shop", "web-0", UID)).await.unwrap();
    wait_for_async(
        "ResolvedRefs True once web-0 serves web-v1 (the route unchanged)",
        WAIT,
        || resolved().as_deref() == Some("True"),
    )
    .await;
}
