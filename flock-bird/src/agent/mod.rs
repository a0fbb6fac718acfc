//! The agent: pod lifecycle (AddPod / RemovePod in flock-core's step order), the mesh
//! model built from local pods and the registry, and the one publisher of xDS.
//!
//! # Where each race is closed (docs/races.md)
//! The agent's pod state and every decision about it live in flock-core's sans-IO
//! [`AgentCore`] (`flock_core::agent`), behind the agent's one pod-side lock; this
//! module performs the I/O around it (store, registry, identity provider, probes,
//! capture rules) and feeds back what happened. The core's loom models and property
//! test check the interleavings of these operations; see its docs for each rule.
//! * **R1** (version vs content): every publish goes through the node group's
//!   `flock_core::snapshot::Publisher`, and the mesh is read *inside* the publish
//!   closure, under its lock, so a later version is always built from later state.
//! * **R3** (startup load wipes a concurrent AddPod): [`Agent::load`] merges the stored
//!   pods into the live table (`AgentCore::load`: adds absent keys only).
//! * **R4** (ghost endpoint): `RemovePod` deletes the store record first
//!   (`flock_core::lifecycle::REMOVE_POD`), and a registration made outside the pod's
//!   turn (the liveness re-registration, kube mode's resync) is re-checked after it
//!   lands (`AgentCore::registered`) and undone at the revision it wrote.
//! * **R6** (leaked subscription): the start-up resubscription is re-checked
//!   (`AgentCore::subscribed`), and its undo, like the GC's unsubscribe, runs in the
//!   pod's turn only while the pod is still gone (`AgentCore::may_unsubscribe`).
//! * Operations on one pod (ADD, DEL, a GC removal, a resync) take the pod's turn
//!   (`turns`: the core's queue, in arrival order); different pods proceed in
//!   parallel.
//!
//! # Where each job lives
//! * `config`: [`AgentConfig`]; `error`: [`PodError`], [`PodOutcome`]; `metrics`:
//!   [`AgentMetrics`];
//! * `request`: an AddPod request ([`AddPodInput`]) checked into a pod record by the
//!   shared pod validator (`flock_core::pod`);
//! * `turns`: the per-pod turns; `lifecycle`: AddPod, RemovePod, CHECK and startup load;
//! * `liveness`: the probe round and the guarded re-registration;
//! * `regsync`: the registry sync (this node's pods in the registry, planned from the
//!   changed keys); `podinputs`: the pod table and SPIFFE IDs a per-pod derivation
//!   last read, so the sync and the publish visit only the pods that changed;
//! * [`mesh`]: the registry view and the live pods as a translation model;
//!   [`services`]: the registry's services kept incrementally from the view's deltas;
//! * `publish`: the one publish point, translating through each node group's
//!   `flock_xds::translate::Memo` (the publish side's state, behind its one lock);
//!   `gc`: the orphan-GC executor;
//! * `members`: kube mode's registrations (one endpoint per Service port the pod is a
//!   member of) and the resync that keeps them current as labels and Services change.
//!
//! # Kube mode
//! With [`Agent::with_kube`] (`--kube`) every fact about a pod comes from the
//! Kubernetes API ([`crate::kube`]): its record holds the service account and ports
//! the API gives and no service; what it registers is recomputed from the reflectors
//! ([`Agent::kube_resync`], run by [`Agent::run_kube_resync`] on every change), under
//! the pod's turn and with the same guards as the liveness re-registration (R4) and
//! conditional deletes.

mod capture;
mod config;
mod error;
#[cfg(feature = "fault-injection")]
mod fault;
mod gc;
mod lifecycle;
mod liveness;
mod members;
pub mod mesh;
mod metrics;
mod podinputs;
pub mod policies;
pub mod pools;
mod publish;
mod regsync;
mod request;
pub mod routes;
pub mod services;
mod turns;

pub use capture::CaptureMetrics;
pub use config::AgentConfig;
pub use error::{PodError, PodOutcome};
pub use members::member_endpoints;
pub use metrics::AgentMetrics;
pub use regsync::{LINGER as REGISTRY_SYNC_LINGER, SyncStatus};
pub use request::{AddPodInput, parse_ports};

use crate::identity::{IdentityProvider, IdentityView};
use crate::model::PodRecord;
use crate::registry::Registry;
use crate::store::PodStore;
use envoy_types::pb::google::protobuf::Any;
use flock_core::agent::AgentCore;
use flock_core::pod::PodKey;
use flock_core::sync::{Mutex, MutexGuard, lock};
use flock_xds::cache::Cache;
use flock_xds::callbacks::NodeInfo;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// The node group of Envoy proxies (`user_agent_name` contains "envoy").
pub const ENVOY_GROUP: &str = "envoy";
/// The node group of proxyless gRPC clients (every other node).
pub const GRPC_GROUP: &str = "grpc";

/// Which translation an xDS node gets, from its `user_agent_name`. Any client can
/// write that field, so the server applies this only to peers trusted to choose
/// (`GroupChoice::ByNode` from [`crate::xds_auth::AgentAuthorizer`]: the allowed uids
/// on the unix socket); an mTLS client's group comes from its certificate instead.
/// Only [`ENVOY_GROUP`]'s snapshots carry secrets.
pub fn group_of(node: &NodeInfo) -> String {
    if node.user_agent_name.to_ascii_lowercase().contains("envoy") {
        ENVOY_GROUP.to_string()
    } else {
        GRPC_GROUP.to_string()
    }
}

/// The agent's sans-IO core over its pod records; an operation waiting for a pod's
/// turn is woken through its oneshot.
type Core = AgentCore<Arc<PodRecord>, tokio::sync::oneshot::Sender<()>>;

/// The agent. See the module docs.
pub struct Agent {
    cfg: AgentConfig,
    store: Arc<PodStore>,
    registry: Arc<dyn Registry>,
    cache: Arc<Cache<Any>>,
    identity: Option<Arc<dyn IdentityProvider>>,
    /// Kube mode's pod source (`--kube`), if on.
    kube: Option<Arc<crate::kube::KubePods>>,
    /// The agent's pod state and every decision about it (`flock_core::agent`): the
    /// live table, liveness, this agent's registry writes, the GC's state and the
    /// per-pod turns. The one lock of the pod side: each method of the core is one step
    /// of an operation, and no I/O runs under it.
    core: Mutex<Core>,
    /// What the publish keeps between publishes (the translation memos, the
    /// incremental service table, the pod models and secrets): the one lock of the
    /// publish side, held for a whole publish. Lock order: `publish`, then `core`.
    publish: Mutex<publish::PublishState>,
    store_loaded: AtomicBool,
    first_published: AtomicBool,
    /// The registry sync: the one path from the pod table to the registry
    /// (`regsync`).
    sync: Arc<regsync::RegSync>,
    /// Set once the registry's view was first synced: later outages do not make the
    /// agent unready (see [`Agent::not_ready`]).
    registry_synced_once: AtomicBool,
    /// How the xDS clients answer (NACKs, slow ACKs): the server's hook, read by
    /// `/readyz` and `/metrics`.
    xds_answers: Arc<crate::xds_answers::XdsAnswers>,
    /// Held across each rebuild of the node's probe table (read the live pods, then
    /// apply): without it two ADDs could read the pods in one order and apply in the
    /// other, and the table would keep the older pod set.
    node_table: tokio::sync::Mutex<()>,
    /// Authorization denials Envoy streams back: counted per policy, logged once
    /// per caller (`crate::denials`).
    denials: Arc<crate::denials::Denials>,
    /// The access log writer (`--access-log`), if on.
    access_logs: Option<Arc<crate::access_log::AccessLogs>>,
    /// Kube mode's unmeshed-pod sweeper.
    repairer: Option<Arc<crate::repair::Repairer>>,
    /// The metrics.
    pub metrics: AgentMetrics,
}

impl Agent {
    /// An agent over its store, registry and xDS cache (whose node hash must be
    /// [`group_of`]). Call [`load`](Self::load) before serving.
    pub fn new(
        cfg: AgentConfig,
        store: Arc<PodStore>,
        registry: Arc<dyn Registry>,
        cache: Arc<Cache<Any>>,
    ) -> Self {
        Self {
            core: Mutex::new(Core::new(cfg.liveness)),
            publish: Mutex::new(publish::PublishState::new()),
            cfg,
            store,
            registry,
            cache,
            identity: None,
            kube: None,
            store_loaded: AtomicBool::new(false),
            first_published: AtomicBool::new(false),
            sync: Arc::new(regsync::RegSync::new()),
            registry_synced_once: AtomicBool::new(false),
            xds_answers: Arc::default(),
            denials: Arc::default(),
            access_logs: None,
            repairer: None,
            node_table: tokio::sync::Mutex::new(()),
            metrics: AgentMetrics::default(),
        }
    }

    /// Gives every meshed pod a workload identity from `provider` (mTLS between pods);
    /// without one, pods talk plaintext.
    pub fn with_identity(mut self, provider: Arc<dyn IdentityProvider>) -> Self {
        self.identity = Some(provider);
        self
    }

    /// Kube mode: pods' facts from the Kubernetes API through `kube` (see the module
    /// docs); without it, from their annotations.
    pub fn with_kube(mut self, kube: Arc<crate::kube::KubePods>) -> Self {
        self.kube = Some(kube);
        self
    }

    /// How the xDS clients answer: give it to the xDS server as a callbacks hook.
    pub fn xds_answers(&self) -> &Arc<crate::xds_answers::XdsAnswers> {
        &self.xds_answers
    }

    /// Writes the access log entries Envoy streams back with `logs`.
    pub fn with_access_logs(mut self, logs: Arc<crate::access_log::AccessLogs>) -> Self {
        self.access_logs = Some(logs);
        self
    }

    /// Sweeps for running pods that should be meshed and are not (kube mode).
    pub fn with_repairer(mut self, repairer: Arc<crate::repair::Repairer>) -> Self {
        self.repairer = Some(repairer);
        self
    }

    /// The unmeshed-pod sweeper (kube mode).
    pub fn repairer(&self) -> Option<&Arc<crate::repair::Repairer>> {
        self.repairer.as_ref()
    }

    /// The access log writer, if the access log is on.
    pub fn access_logs(&self) -> Option<&Arc<crate::access_log::AccessLogs>> {
        self.access_logs.as_ref()
    }

    /// The authorization denials Envoy reports (the xDS server's access log sink).
    pub fn denials(&self) -> &Arc<crate::denials::Denials> {
        &self.denials
    }

    /// Kube mode's pod source, when on.
    pub fn kube(&self) -> Option<&Arc<crate::kube::KubePods>> {
        self.kube.as_ref()
    }

    /// A failpoint: in test builds with the `fault-injection` feature, the agent is
    /// killed or stopped here when the point named is armed (see `fault.rs`); nothing
    /// at all otherwise.
    #[inline]
    pub(crate) fn failpoint(&self, name: impl FnOnce() -> String) {
        #[cfg(feature = "fault-injection")]
        fault::failpoint(self.store.dir(), &name());
        #[cfg(not(feature = "fault-injection"))]
        let _ = name;
    }

    /// The identity provider, if any.
    pub fn identity(&self) -> Option<&Arc<dyn IdentityProvider>> {
        self.identity.as_ref()
    }

    pub(super) fn identity_view(&self) -> Option<Arc<IdentityView>> {
        self.identity.as_ref().map(|p| p.view().borrow().clone())
    }

    /// The configuration.
    pub fn config(&self) -> &AgentConfig {
        &self.cfg
    }

    /// The registry.
    pub fn registry(&self) -> &Arc<dyn Registry> {
        &self.registry
    }

    /// The xDS cache.
    pub fn cache(&self) -> &Arc<Cache<Any>> {
        &self.cache
    }

    /// The core, locked: one step of an operation (never held across I/O).
    pub(super) fn core(&self) -> MutexGuard<'_, Core> {
        lock(&self.core)
    }

    /// A live pod's record.
    pub(super) fn pod(&self, key: &PodKey) -> Option<Arc<PodRecord>> {
        self.core().pod(key).cloned()
    }

    /// Whether the pod is live (in the table, which RemovePod leaves first).
    pub(super) fn is_live(&self, key: &PodKey) -> bool {
        self.core().is_live(key)
    }

    /// How many pods are live (O(1): the metrics read it on every scrape).
    pub fn pod_count(&self) -> usize {
        self.core().pod_count()
    }

    /// The live pods (a copy of every record).
    pub fn pods(&self) -> BTreeMap<PodKey, PodRecord> {
        self.core()
            .pods()
            .iter()
            .map(|(k, rec)| (k.clone(), PodRecord::clone(rec)))
            .collect()
    }

    /// Which pods have an operation running, and how many more wait for their turn.
    pub fn busy_pods(&self) -> BTreeMap<PodKey, (flock_core::agent::OpKind, usize)> {
        self.core().busy()
    }

    /// Why the agent is not ready, or `None` when it is: the store is loaded, in kube
    /// mode the Kubernetes reflectors have listed everything, the registry's view was
    /// synced once, and the first snapshot is published.
    ///
    /// Ready means "this node can mesh pods" (CNI `STATUS` answers from it, and so does
    /// `/readyz`). A registry that goes down *after* its first sync does not make the
    /// agent unready: pods are still meshed and served locally, and the registry sync
    /// registers them once the registry is back ([`Agent::registry_out_of_sync`] says
    /// so meanwhile, on `/readyz` and in the metrics). Failing readiness then would
    /// make the runtime stop creating pods on every node during a registry outage.
    pub fn not_ready(&self) -> Option<String> {
        if !self.store_loaded.load(Ordering::Acquire) {
            return Some("pod store not loaded yet".into());
        }
        if let Some(why) = self.kube.as_ref().and_then(|k| k.not_ready()) {
            return Some(why);
        }
        if !self.registry_synced_once.load(Ordering::Acquire) {
            if !self.registry.view().borrow().synced {
                return Some(format!("registry {} not synced", self.registry.describe()));
            }
            self.registry_synced_once.store(true, Ordering::Release);
        }
        if !self.first_published.load(Ordering::Acquire) {
            return Some("first xDS snapshot not published yet".into());
        }
        None
    }
}
