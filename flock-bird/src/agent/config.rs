//! The agent's settings that are not I/O endpoints.

use flock_core::capture::policy::NodeCapture;
use flock_core::gc::GcPolicy;
use flock_core::lifecycle::liveness::LivenessPolicy;
use std::time::Duration;

/// Settings of the agent that are not I/O endpoints.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// This node's name (`--node-name`): owner of its registry endpoints.
    pub node_name: String,
    /// Zone of this node's endpoints (`--zone`).
    pub zone: String,
    /// Region of this node's endpoints (`--region`).
    pub region: String,
    /// Liveness probe schedule and thresholds.
    pub liveness: LivenessPolicy,
    /// One probe's timeout.
    pub probe_timeout: Duration,
    /// Trailing debounce of registry-driven republishing.
    pub refresh_debounce: Duration,
    /// Period of the orphan GC.
    pub gc_interval: Duration,
    /// The orphan GC's hysteresis and breaker.
    pub gc_policy: GcPolicy,
    /// Transparent capture (`--capture*`): off by default, which leaves pods, their
    /// netns and the xDS output exactly as without capture.
    pub capture: NodeCapture,
    /// The longest one registry call of the registry sync may take (an etcd that is
    /// stopped or partitioned does not refuse, it never answers).
    pub registry_op_timeout: Duration,
    /// How long ADD and DEL wait for the registry sync before answering anyway (the
    /// sync keeps retrying): bounds what a down registry adds to CNI latency.
    pub register_wait: Duration,
    /// Rebuild the whole mesh on every publish, as the agent did before it was
    /// incremental: the registry's services from the whole view, every pod's model,
    /// the secrets, and the translation and encoding of everything (a fresh memo).
    /// Only the benchmarks' baselines set it (`FLOCK_PUBLISH_FROM_SCRATCH=1` for the
    /// binary).
    pub publish_from_scratch: bool,
    /// The Envoy bootstrap's cluster of the agent's own xDS socket, where each inbound
    /// port under an authorization policy streams its denials (gRPC access log
    /// service) for `flock_authz_denied_total` and the once-per-caller log line.
    /// `None`: Envoy's own `rbac.denied` stats only. flock-agent sets it to its
    /// bootstrap's `xds`.
    pub denial_log_cluster: Option<String>,
    /// Access logs: each inbound port streams an entry per request or connection
    /// (sampled) to this cluster (flock-agent: its bootstrap's `xds`). `None`: none.
    pub access_log: Option<flock_xds::translate::telemetry::AccessLogOptions>,
    /// Tracing: Envoy's OpenTelemetry tracer on every HTTP listener, spans to this
    /// collector. `None`: none.
    pub tracing: Option<flock_xds::translate::telemetry::TracingOptions>,
}

impl AgentConfig {
    /// Defaults for a node named `node_name`.
    pub fn new(node_name: impl Into<String>) -> Self {
        Self {
            node_name: node_name.into(),
            zone: String::new(),
            region: String::new(),
            liveness: LivenessPolicy::default(),
            probe_timeout: Duration::from_secs(1),
            refresh_debounce: Duration::from_millis(100),
            gc_interval: Duration::from_secs(60),
            gc_policy: GcPolicy::default(),
            capture: NodeCapture::default(),
            registry_op_timeout: Duration::from_secs(5),
            register_wait: Duration::from_secs(1),
            publish_from_scratch: false,
            denial_log_cluster: None,
            access_log: None,
            tracing: None,
        }
    }
}
