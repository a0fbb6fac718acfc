//! The registry off the CNI critical path, deterministically: ADD and DEL answer while
//! the registry hangs, a DEL racing a pending registration leaves no ghost, and an ADD
//! whose caller went away is undone.
//!
//! The registry here is a **test double of the `Registry` trait only** (`Stalling`,
//! over the real embedded `memory` backend): it holds puts on command, as an etcd that
//! is stopped does, and lets a held put land later even if its caller gave up (the
//! request was abandoned, not undone). Everything else is the real agent over a real
//! pod store. The clock is tokio's paused clock, so timeouts fire in order without
//! real waiting.

mod common;

use common::input;
use envoy_types::pb::google::protobuf::Any;
use flock_bird::agent::{Agent, AgentConfig, PodOutcome, group_of};
use flock_bird::model::Endpoint;
use flock_bird::registry::{self, Registry, RegistryError, RegistryOptions, RegistrySpec, View};
use flock_bird::store::PodStore;
use flock_core::pod::PodKey;
use flock_xds::cache::Cache;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;
use tokio::sync::{Notify, watch};

/// The registry double (see the module docs): with `hold` set, every put waits for
/// `release` in a task of its own and then lands in the inner registry, whether or not
/// the caller still waits for it.
struct Stalling {
    inner: Arc<dyn Registry>,
    hold: AtomicBool,
    /// Deletes (both kinds) wait for `release_deletes` while set (an unregistration in
    /// flight).
    hold_deletes: AtomicBool,
    release_deletes: Arc<Notify>,
    release: Arc<Notify>,
    held: AtomicUsize,
    landed_late: Arc<AtomicUsize>,
}

impl Stalling {
    async fn new() -> Arc<Self> {
        let inner = registry::connect(
            &RegistrySpec::Memory,
            RegistryOptions {
                node: "n1".into(),
                ..RegistryOptions::default()
            },
        )
        .await
        .unwrap();
        Arc::new(Self {
            inner,
            hold: false.into(),
            hold_deletes: false.into(),
            release_deletes: Arc::new(Notify::new()),
            release: Arc::new(Notify::new()),
            held: 0.into(),
            landed_late: Arc::new(0.into()),
        })
    }
}

#[async_trait::async_trait]
impl Registry for Stalling {
    async fn put(&self, ep: &Endpoint) -> Result<u64, RegistryError> {
        if !self.hold.load(Ordering::SeqCst) {
            return self.inner.put(ep).await;
        }
        self.held.fetch_add(1, Ordering::SeqCst);
        let (inner, release, landed) = (
            Arc::clone(&self.inner),
            Arc::clone(&self.release),
            Arc::clone(&self.landed_late),
        );
        let ep = ep.clone();
        // The request is in the registry's hands: it lands when released, even if
        // the caller timed out and dropped this future meanwhile.
        let task = tokio::spawn(async move {
            release.notified().await;
            let r = inner.put(&ep).await;
            landed.fetch_add(1, Ordering::SeqCst);
            r
        });
        task.await.expect("put task")
    }
    async fn delete(&self, key: &str) -> Result<bool, RegistryError> {
        if self.hold_deletes.load(Ordering::SeqCst) {
            self.release_deletes.notified().await;
        }
        self.inner.delete(key).await
    }
    async fn delete_if_revision(&self, key: &str, revision: u64) -> Result<bool, RegistryError> {
        if self.hold_deletes.load(Ordering::SeqCst) {
            self.release_deletes.notified().await;
        }
        self.inner.delete_if_revision(key, revision).await
    }
    fn view(&self) -> watch::Receiver<Arc<View>> {
        self.inner.view()
    }
    fn describe(&self) -> String {
        format!("stalling {}", self.inner.describe())
    }
}

const OP_TIMEOUT: Duration = Duration::from_secs(2);
const REGISTER_WAIT: Duration = Duration::from_millis(500);

fn agent_over(dir: &std::path::Path, reg: Arc<dyn Registry>) -> Arc<Agent> {
    agent_with(dir, reg, OP_TIMEOUT, REGISTER_WAIT)
}

fn agent_with(
    dir: &std::path::Path,
    reg: Arc<dyn Registry>,
    op_timeout: Duration,
    register_wait: Duration,
) -> Arc<Agent> {
    let store = Arc::new(PodStore::open(dir).unwrap());
    let cache: Arc<Cache<Any>> = Arc::new(Cache::new(group_of));
    let mut cfg = AgentConfig::new("n1");
    cfg.registry_op_timeout = op_timeout;
    cfg.register_wait = register_wait;
    Arc::new(Agent::new(cfg, store, reg, cache))
}

fn endpoints(reg: &Stalling) -> Vec<String> {
    reg.view().borrow().endpoints.keys().cloned().collect()
}

/// Waits (in paused time) until `cond` holds; panics with `what` after a minute.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the sync has run a full round that started after this call and left
/// the registry matching the table.
async fn settled(agent: &Arc<Agent>) {
    let before = agent.registry_sync_status().applied;
    agent.request_registry_sync();
    until("the registry sync settles", || {
        let s = agent.registry_sync_status();
        s.in_sync && s.applied > before
    })
    .await;
}

/// A DEL while the pod's registration hangs in the registry, which then times out and
/// lands later (the put was abandoned by its caller, not undone): ADD and DEL both
/// answer within their bound, and once the late write is visible the sync deletes it:
/// no ghost. With the sync's writes unguarded
/// (`reintroduced!("regsync-unguarded")`: a key tracked only once its put succeeded,
/// no re-check after it; checked by scripts/test) the late write stays.
#[tokio::test(start_paused = true)]
async fn a_del_during_a_registration_that_times_out_and_lands_late_leaves_no_ghost() {
    let dir = tempfile::tempdir().unwrap();
    let reg = Stalling::new().await;
    let agent = agent_over(dir.path(), Arc::clone(&reg) as Arc<dyn Registry>);
    agent.load().await.unwrap();
    reg.hold.store(true, Ordering::SeqCst);

    let started = tokio::time::Instant::now();
    let added = agent.add_pod(&input("c1", Some("web"), "8080")).await;
    let Ok(PodOutcome::Done(message)) = added else {
        panic!("ADD failed while the registry hangs: {added:?}");
    };
    assert!(
        message.contains("registration pending"),
        "the answer says the registry has not confirmed: {message}"
    );
    assert!(started.elapsed() <= REGISTER_WAIT + Duration::from_millis(50));
    assert_eq!(reg.held.load(Ordering::SeqCst), 1, "the put is in flight");

    let key = PodKey::new("c1", "eth0");
    let removed = agent.remove_pod(&key).await;
    assert!(matches!(removed, Ok(PodOutcome::Done(_))), "{removed:?}");
    // The put times out in the sync; the registry is out of sync meanwhile.
    until("the sync reports the hung put", || {
        agent.registry_sync_status().last_error.is_some()
    })
    .await;
    assert!(agent.registry_out_of_sync().is_some());

    // Now the registry answers: the abandoned put lands.
    reg.hold.store(false, Ordering::SeqCst);
    reg.release.notify_one();
    until("the late put landed", || {
        reg.landed_late.load(Ordering::SeqCst) == 1
    })
    .await;
    settled(&agent).await;
    let ghosts = endpoints(&reg);
    assert!(
        ghosts.is_empty(),
        "ghost endpoint(s) after the DEL: {ghosts:?}"
    );
    assert!(agent.registry_out_of_sync().is_none());
    assert!(agent.pods().is_empty());
}

/// While the registry hangs, only the first registry wait costs the runtime anything:
/// the first ADD waits it out; an ADD that comes once the sync's call in flight has
/// gone unanswered for the registry wait answers at once ("registration pending",
/// naming the call), although that call's own bound (10 s here) has not passed and
/// the sync does not report a failure yet. Before, each such ADD waited the full
/// registry wait, which capped CNI throughput under a hung etcd at one operation per
/// worker per registry wait.
#[tokio::test(start_paused = true)]
async fn adds_stop_waiting_once_the_call_in_flight_has_hung_for_the_registry_wait() {
    let dir = tempfile::tempdir().unwrap();
    let reg = Stalling::new().await;
    let agent = agent_with(
        dir.path(),
        Arc::clone(&reg) as Arc<dyn Registry>,
        Duration::from_secs(10),
        REGISTER_WAIT,
    );
    agent.load().await.unwrap();
    reg.hold.store(true, Ordering::SeqCst);

    let started = tokio::time::Instant::now();
    let first = agent.add_pod(&input("c1", Some("web"), "8080")).await;
    let Ok(PodOutcome::Done(message)) = first else {
        panic!("ADD failed while the registry hangs: {first:?}");
    };
    assert!(message.contains("registration pending"), "{message}");
    let waited = started.elapsed();
    assert!(
        waited >= REGISTER_WAIT && waited <= REGISTER_WAIT + Duration::from_millis(50),
        "the first ADD waits the registry wait: {waited:?}"
    );
    assert_eq!(reg.held.load(Ordering::SeqCst), 1, "the put is in flight");
    assert!(
        agent.registry_sync_status().last_error.is_none(),
        "the sync's put has not reached its own bound yet"
    );

    for i in 2..=4 {
        let started = tokio::time::Instant::now();
        let added = agent
            .add_pod(&input(&format!("c{i}"), Some("web"), "8080"))
            .await;
        let Ok(PodOutcome::Done(message)) = added else {
            panic!("ADD c{i} failed while the registry hangs: {added:?}");
        };
        assert!(
            message.contains("registration pending") && message.contains("has not answered"),
            "the answer names the hung call: {message}"
        );
        assert!(
            started.elapsed() < Duration::from_millis(50),
            "ADD c{i} waited {:?} for a call already hung for the registry wait",
            started.elapsed()
        );
    }
    assert_eq!(agent.pods().len(), 4);
}

/// A DEL while the pod's registration is in flight, which lands before the sync's
/// timeout: the put's re-check sees the pod gone and undoes exactly that write. With
/// `reintroduced!("regsync-unguarded")` (checked by scripts/test) it stays.
#[tokio::test(start_paused = true)]
async fn a_del_during_a_pending_registration_leaves_no_ghost() {
    let dir = tempfile::tempdir().unwrap();
    let reg = Stalling::new().await;
    let agent = agent_over(dir.path(), Arc::clone(&reg) as Arc<dyn Registry>);
    agent.load().await.unwrap();
    reg.hold.store(true, Ordering::SeqCst);
    let added = agent.add_pod(&input("c1", Some("web"), "8080")).await;
    assert!(matches!(added, Ok(PodOutcome::Done(_))), "{added:?}");
    let removed = agent.remove_pod(&PodKey::new("c1", "eth0")).await;
    assert!(matches!(removed, Ok(PodOutcome::Done(_))), "{removed:?}");
    // Both answered within their bound while the put is still held (< OP_TIMEOUT).
    assert_eq!(reg.landed_late.load(Ordering::SeqCst), 0);
    reg.hold.store(false, Ordering::SeqCst);
    reg.release.notify_one();
    until("the put landed", || {
        reg.landed_late.load(Ordering::SeqCst) == 1
    })
    .await;
    until("the sync undid it", || endpoints(&reg).is_empty()).await;
    settled(&agent).await;
    assert!(endpoints(&reg).is_empty(), "ghost: {:?}", endpoints(&reg));
    assert_eq!(
        agent.metrics.guard_undos.load(Ordering::Relaxed),
        1,
        "the registration that landed after the DEL was not undone by its guard"
    );
}

/// A DEL repeated while the first one's unregistration is still in flight (the
/// registry holds the delete, so the pod's key is still in the view): the pod is gone
/// from the agent, so the repeat answers IGNORED ("not known"), not a second removal —
/// the runtime and the crash test read a DONE for a removed pod as the pod having come
/// back. With pending registry keys counted as the pod
/// (`reintroduced!("del-counts-pending-keys")`, checked by scripts/test) the repeat
/// answers DONE.
#[tokio::test(start_paused = true)]
async fn a_repeated_del_while_the_unregistration_is_pending_answers_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let reg = Stalling::new().await;
    let agent = agent_over(dir.path(), Arc::clone(&reg) as Arc<dyn Registry>);
    agent.load().await.unwrap();
    let added = agent.add_pod(&input("c1", Some("web"), "8080")).await;
    assert!(matches!(added, Ok(PodOutcome::Done(_))), "{added:?}");
    settled(&agent).await;
    assert_eq!(endpoints(&reg).len(), 1, "registered");
    reg.hold_deletes.store(true, Ordering::SeqCst);
    let key = PodKey::new("c1", "eth0");
    let first = agent.remove_pod(&key).await;
    assert!(matches!(first, Ok(PodOutcome::Done(_))), "{first:?}");
    assert_eq!(endpoints(&reg).len(), 1, "the unregistration is still held");
    let repeat = agent.remove_pod(&key).await;
    assert!(
        matches!(repeat, Ok(PodOutcome::Ignored(_))),
        "a repeated DEL of a removed pod: {repeat:?}"
    );
    reg.hold_deletes.store(false, Ordering::SeqCst);
    reg.release_deletes.notify_waiters();
    until("the unregistration landed", || endpoints(&reg).is_empty()).await;
    settled(&agent).await;
    assert!(endpoints(&reg).is_empty(), "ghost: {:?}", endpoints(&reg));
}

/// The plugin gives up on an ADD (its future is dropped, as tonic drops a handler
/// when the client goes away) while the ADD waits for the registry: the ADD still
/// runs to completion, and because nobody received its answer (the runtime saw it
/// fail and will not DEL it) it is undone: no pod, no record, no endpoint. Without
/// the undo (`reintroduced!("abandoned-add-kept")`, checked by scripts/test)
/// the pod stays meshed.
#[tokio::test(start_paused = true)]
async fn an_add_whose_caller_went_away_is_completed_then_undone() {
    let dir = tempfile::tempdir().unwrap();
    let reg = Stalling::new().await;
    let agent = agent_over(dir.path(), Arc::clone(&reg) as Arc<dyn Registry>);
    agent.load().await.unwrap();
    reg.hold.store(true, Ordering::SeqCst);
    let gave_up = tokio::time::timeout(
        REGISTER_WAIT / 5,
        agent.add_pod_to_completion(input("c1", Some("web"), "8080")),
    )
    .await;
    assert!(gave_up.is_err(), "the caller gave up before the answer");
    until("the abandoned ADD is undone", || {
        agent.metrics.adds_undone.load(Ordering::Relaxed) == 1
    })
    .await;
    assert!(agent.pods().is_empty(), "the pod stayed meshed");
    reg.hold.store(false, Ordering::SeqCst);
    reg.release.notify_one();
    settled(&agent).await;
    assert!(endpoints(&reg).is_empty(), "ghost: {:?}", endpoints(&reg));
    let store = PodStore::open(dir.path()).unwrap();
    assert!(
        store.load_all().unwrap().pods.is_empty(),
        "the record stayed"
    );

    // A caller that waits gets its answer and the pod stays.
    let added = agent
        .add_pod_to_completion(input("c2", Some("web"), "8080"))
        .await;
    assert!(matches!(added, Ok(PodOutcome::Done(_))), "{added:?}");
    settled(&agent).await;
    assert_eq!(agent.pods().len(), 1);
    assert_eq!(endpoints(&reg).len(), 1);
    assert_eq!(agent.metrics.adds_undone.load(Ordering::Relaxed), 1);
}

/// The value of the unlabelled sample `name` in a Prometheus exposition.
fn metric(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

/// While the registry hangs, the agent stays ready for CNI (`/readyz` 200, ADD
/// answers) and says the registry is out of sync: a `/readyz` line with the pending
/// writes and how long, `flock_registry_in_sync` 0, `flock_registry_pending_ops` and
/// `flock_registry_out_of_sync_ms` above 0. Once the registry answers, all of it
/// clears. Over real HTTP on a real port, so in real time (a paused clock would fire
/// the admin server's timeouts while the client waits on its socket).
#[tokio::test]
async fn readyz_and_metrics_say_the_registry_is_out_of_sync_while_the_agent_stays_ready() {
    use flock_bird::admin::api::Route;
    use flock_bird::admin::client::AdminClient;
    use flock_bird::admin::server::{AgentViews, ServeOptions, serve_with};

    let dir = tempfile::tempdir().unwrap();
    let reg = Stalling::new().await;
    let agent = agent_with(
        dir.path(),
        Arc::clone(&reg) as Arc<dyn Registry>,
        Duration::from_millis(300),
        Duration::from_millis(100),
    );
    let xds = flock_xds::server::Server::builder(Arc::clone(agent.cache())).build();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let client = AdminClient::new(listener.local_addr().unwrap().to_string());
    let views = Arc::new(AgentViews::new(Arc::clone(&agent), &xds));
    let (_stop, stop) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(
        listener,
        views,
        ServeOptions::default(),
        async {
            let _ = stop.await;
        },
    ));
    agent.load().await.unwrap();
    let readyz = || async {
        let r = client.get(Route::Readyz).await.unwrap();
        (r.status, String::from_utf8(r.body.to_vec()).unwrap())
    };
    let (status, body) = readyz().await;
    assert_eq!((status, body.as_str()), (200, "ready\n"));
    let m = client.metrics().await.unwrap();
    assert_eq!(metric(&m, "flock_registry_in_sync"), Some(1), "{m}");
    assert_eq!(metric(&m, "flock_registry_out_of_sync_ms"), Some(0), "{m}");

    reg.hold.store(true, Ordering::SeqCst);
    let added = agent.add_pod(&input("c1", Some("web"), "8080")).await;
    assert!(matches!(added, Ok(PodOutcome::Done(_))), "{added:?}");
    // The put hangs past its bound: the sync's round fails and says so.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let (status, body, m) = loop {
        let (status, body) = readyz().await;
        let m = client.metrics().await.unwrap();
        if metric(&m, "flock_registry_out_of_sync_ms").is_some_and(|ms| ms > 0)
            && body.contains("did not answer")
        {
            break (status, body, m);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never out of sync: {body}\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert_eq!(status, 200, "ready for CNI while out of sync: {body}");
    let mut lines = body.lines();
    assert_eq!(lines.next(), Some("ready"), "{body}");
    let why = lines.next().unwrap_or_default();
    assert!(
        why.starts_with("registry stalling") && why.contains("out of sync"),
        "{body}"
    );
    assert!(
        why.contains("write(s) pending") && why.contains("last in sync"),
        "{body}"
    );
    assert_eq!(metric(&m, "flock_agent_ready"), Some(1), "{m}");
    assert_eq!(metric(&m, "flock_registry_in_sync"), Some(0), "{m}");
    assert!(
        metric(&m, "flock_registry_pending_ops").is_some_and(|n| n >= 1),
        "{m}"
    );
    assert!(
        metric(&m, "flock_registry_sync_errors_total").is_some_and(|n| n >= 1),
        "{m}"
    );
    // ADDs keep answering meanwhile.
    let added = agent.add_pod(&input("c2", Some("web"), "8080")).await;
    assert!(matches!(added, Ok(PodOutcome::Done(_))), "{added:?}");

    // The registry answers again: everything clears.
    reg.hold.store(false, Ordering::SeqCst);
    reg.release.notify_waiters();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let (status, body) = readyz().await;
        let m = client.metrics().await.unwrap();
        if body == "ready\n"
            && metric(&m, "flock_registry_in_sync") == Some(1)
            && metric(&m, "flock_registry_out_of_sync_ms") == Some(0)
            && metric(&m, "flock_registry_pending_ops") == Some(0)
        {
            assert_eq!(status, 200);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "never back in sync: {body}\n{m}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(endpoints(&reg).len(), 2, "{:?}", endpoints(&reg));
}

/// Another writer deletes one of this node's keys and overwrites another (an operator
/// with `etcdctl`, a stale agent of the same name): the sync puts both back as the
/// pods want them, from the view's change alone (no request, no reconnect), and
/// leaves another node's key alone. The sync plans only over the keys changed since
/// its last clean plan; the view's deltas are what name these. Without them in the
/// plan (`reintroduced!("regsync-plan-misses-view-changes")`, checked by
/// scripts/test) the registry keeps the other writer's version.
#[tokio::test(start_paused = true)]
async fn another_writers_change_of_this_nodes_keys_is_repaired_from_the_views_deltas() {
    let dir = tempfile::tempdir().unwrap();
    let reg = Stalling::new().await;
    let agent = agent_over(dir.path(), Arc::clone(&reg) as Arc<dyn Registry>);
    agent.load().await.unwrap();
    for c in ["c1", "c2", "c3"] {
        let added = agent.add_pod(&input(c, Some("web"), "8080")).await;
        assert!(matches!(added, Ok(PodOutcome::Done(_))), "{added:?}");
    }
    settled(&agent).await;
    let wanted: std::collections::BTreeMap<String, Endpoint> = reg
        .view()
        .borrow()
        .endpoints
        .iter()
        .map(|(k, e)| (k.clone(), (**e).clone()))
        .collect();
    assert_eq!(wanted.len(), 3);
    let mut keys = wanted.keys();
    let (gone, changed) = (keys.next().unwrap().clone(), keys.next().unwrap().clone());
    // The other writer, straight to the backend.
    assert!(reg.inner.delete(&gone).await.unwrap());
    let mut other = wanted[&changed].clone();
    other.port += 1;
    reg.inner.put(&other).await.unwrap();
    let mut remote = wanted[&gone].clone();
    remote.node = "n2".into();
    reg.inner.put(&remote).await.unwrap();
    let remote_key = remote.key();
    until("the sync restored both keys", || {
        let view = reg.view().borrow().clone();
        wanted
            .iter()
            .all(|(k, ep)| view.endpoints.get(k).map(|e| &**e) == Some(ep))
    })
    .await;
    let view = reg.view().borrow().clone();
    assert_eq!(
        view.endpoints.get(&remote_key).map(|e| &**e),
        Some(&remote),
        "another node's key is not ours"
    );
    assert_eq!(view.endpoints.len(), 4);
}
