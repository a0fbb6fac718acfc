//! The startup taint (`--remove-startup-taint`, on by default with `--kube`): the
//! agent removes `flock.io/agent-not-ready:NoSchedule` from its own Node once the node
//! can mesh pods.
//!
//! Register nodes with the taint so that no pod is scheduled onto a node before its
//! agent is ready (a pod started before the CNI plugin is chained in, or before Envoy
//! has its configuration, would run unmeshed or fail its first connections): kubelet
//! `--register-with-taints=flock.io/agent-not-ready=:NoSchedule` (or
//! `registerWithTaints` in its config file). flock's own DaemonSet tolerates it.
//!
//! Ready means, in this order (the first unmet one is the reason [`NodeReadiness::waiting_for`]
//! gives, shown by `/readyz` while the taint is still there):
//! 1. the agent is ready ([`Agent::not_ready`]: store loaded, reflectors and registry
//!    synced, first snapshot published) — the CNI socket is bound before the store is
//!    loaded, so it is bound too;
//! 2. the CNI installer's ready file exists (`--cni-ready-file`, if given: the
//!    installer's `--ready-file`, present while flock-cni is chained into the node's
//!    CNI configs);
//! 3. an Envoy node ACKed a snapshot ([`EnvoyAcks`], an xDS [`Callbacks`] hook). The
//!    hook sees the node as the client describes it (`user_agent_name` naming Envoy,
//!    [`group_of`]), so any peer the xDS authorizer admits could claim to be that
//!    Envoy; on the unix socket those are the node's Envoy uids only.
//!
//! Then [`flock_kube::taint::remove_startup_taint`] runs, retried with backoff
//! ([`flock_core::backoff`]) until the API answers; it keeps every other taint (a merge
//! patch preconditioned on the Node's resourceVersion). The removal happens once: a
//! taint added back later by someone else is theirs.

use crate::agent::{Agent, ENVOY_GROUP, group_of};
use flock_core::backoff::Backoff;
use flock_core::sync::{Mutex, lock};
use flock_xds::callbacks::{Callbacks, NodeInfo, StreamId};
use flock_xds::protocol::{RequestKind, RequestOutcome};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// How often the conditions are re-checked while waiting (the ready file has no
/// change notification here; the other conditions are cheap reads).
const POLL: Duration = Duration::from_millis(250);

/// An xDS [`Callbacks`] hook that notes the first ACK from a node of the Envoy group.
#[derive(Debug)]
pub struct EnvoyAcks {
    acked: watch::Sender<bool>,
}

impl Default for EnvoyAcks {
    fn default() -> Self {
        Self {
            acked: watch::channel(false).0,
        }
    }
}

impl EnvoyAcks {
    /// Whether an Envoy node has ACKed a snapshot.
    pub fn acked(&self) -> bool {
        *self.acked.borrow()
    }

    /// A receiver that turns true at the first ACK.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.acked.subscribe()
    }
}

impl Callbacks for EnvoyAcks {
    fn on_request(&self, _stream: StreamId, node: &NodeInfo, outcome: &RequestOutcome) {
        if matches!(outcome.kind, RequestKind::Ack { .. }) && group_of(node) == ENVOY_GROUP {
            self.acked
                .send_if_modified(|acked| !std::mem::replace(acked, true));
        }
    }
}

/// What the startup-taint removal waits for, and where it stands.
pub struct NodeReadiness {
    agent: Arc<Agent>,
    cni_ready_file: Option<PathBuf>,
    acks: Arc<EnvoyAcks>,
    state: Mutex<TaintState>,
}

impl std::fmt::Debug for NodeReadiness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeReadiness")
            .field("cni_ready_file", &self.cni_ready_file)
            .field("acked", &self.acks.acked())
            .field("state", &self.state())
            .finish_non_exhaustive()
    }
}

/// Where the removal stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaintState {
    /// Waiting for a condition.
    Waiting,
    /// Ready; asking the API (with the last error, if a try failed).
    Removing(Option<String>),
    /// Done: the taint was removed (`true`) or was not there (`false`).
    Done(bool),
}

impl NodeReadiness {
    /// The conditions of `agent`'s node (see the module docs).
    pub fn new(agent: Arc<Agent>, cni_ready_file: Option<PathBuf>, acks: Arc<EnvoyAcks>) -> Self {
        Self {
            agent,
            cni_ready_file,
            acks,
            state: Mutex::new(TaintState::Waiting),
        }
    }

    /// The first unmet condition, or `None` when the node is ready.
    pub fn waiting_for(&self) -> Option<String> {
        if let Some(why) = self.agent.not_ready() {
            return Some(why);
        }
        if let Some(path) = &self.cni_ready_file
            && !path.exists()
        {
            return Some(format!(
                "the CNI installer's ready file {} does not exist yet",
                path.display()
            ));
        }
        if !self.acks.acked() {
            return Some("no Envoy has ACKed a snapshot yet".to_string());
        }
        None
    }

    /// Where the removal stands.
    pub fn state(&self) -> TaintState {
        lock(&self.state).clone()
    }

    /// One line for `/readyz` while the taint is not removed: why.
    pub fn describe(&self) -> Option<String> {
        match self.state() {
            TaintState::Done(_) => None,
            TaintState::Waiting => Some(format!(
                "startup taint {} kept: {}",
                flock_kube::taint::STARTUP_TAINT_KEY,
                self.waiting_for()
                    .unwrap_or_else(|| "about to remove it".to_string())
            )),
            TaintState::Removing(err) => Some(format!(
                "startup taint {} being removed{}",
                flock_kube::taint::STARTUP_TAINT_KEY,
                err.map(|e| format!(" (last try: {e})")).unwrap_or_default()
            )),
        }
    }

    /// Waits for the node to be ready, then removes the startup taint from `node`
    /// (retrying with backoff until the API answers). Returns when done or when `stop`
    /// turns true.
    pub async fn run(
        self: Arc<Self>,
        client: kube::Client,
        node: String,
        mut stop: watch::Receiver<bool>,
    ) {
        let mut acked = self.acks.subscribe();
        let mut logged: Option<String> = None;
        loop {
            match self.waiting_for() {
                None => break,
                Some(why) => {
                    if logged.as_deref() != Some(why.as_str()) {
                        tracing::info!(node = %node, "startup taint kept: {why}");
                        logged = Some(why);
                    }
                }
            }
            tokio::select! {
                _ = stop.wait_for(|s| *s) => return,
                _ = acked.changed() => {}
                () = tokio::time::sleep(POLL) => {}
            }
        }
        *lock(&self.state) = TaintState::Removing(None);
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(30));
        loop {
            match flock_kube::taint::remove_startup_taint(&client, &node).await {
                Ok(removed) => {
                    if removed {
                        tracing::info!(node = %node, taint = flock_kube::taint::STARTUP_TAINT_KEY, "node ready; startup taint removed");
                    } else {
                        tracing::info!(node = %node, taint = flock_kube::taint::STARTUP_TAINT_KEY, "node ready; the node has no startup taint (nothing to remove)");
                    }
                    *lock(&self.state) = TaintState::Done(removed);
                    return;
                }
                Err(e) => {
                    let delay = backoff.next_delay(flock_clock::jitter());
                    tracing::warn!(node = %node, retry_in = ?delay, "removing the startup taint failed: {e}");
                    *lock(&self.state) = TaintState::Removing(Some(e.to_string()));
                    tokio::select! {
                        _ = stop.wait_for(|s| *s) => return,
                        () = tokio::time::sleep(delay) => {}
                    }
                }
            }
        }
    }
}
