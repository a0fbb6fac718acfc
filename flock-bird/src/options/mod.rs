//! `flock-agent`'s flags and the one place their defaults, clamps and cross-flag rules
//! live.
//!
//! The binary parses [`Flags`] with clap and turns them into [`Options`] with
//! `Options::try_from(flags)`: which flags go together (the mTLS listener's four, the
//! registry's TLS files and credentials, `--ca-dir` with the built-in CA), the node
//! name, loopback-only listeners, the capture settings, when kube mode is on, the
//! clamps of intervals and limits, and which capabilities the flags need. Everything
//! here is checked before the agent touches the host, and each error names the flag.
//! The single-value checks these rules call stay with their subject (`flock_core::pod`
//! for node names, `flock_core::access` for listen addresses, `flock_core::capture`
//! for capture lists, [`crate::registry`] for the credential files).

use crate::agent::AgentConfig;
use crate::runtime::{self, IdentitySource, KubeOptions, XdsLimits, XdsSocket, XdsTls};
use caps::Capability;
use flock_core::access::{AccessPolicy, check_listen_addr};
use flock_core::capture::policy::{NodeCapture, Setting, parse_cidr_list, parse_port_list};
use flock_xds::server::{SubscriptionBudget, Usage};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// The default `--xds-socket`.
pub const DEFAULT_XDS_SOCKET: &str = "/run/flock/xds.sock";
/// Envoy's admin socket in the bootstrap (`--envoy-admin-socket`): where
/// flock-supervisor looks for it with `--state-dir /run/flock/envoy` (its control
/// directory `<state-dir>/control`, 0700).
pub const DEFAULT_ENVOY_ADMIN_SOCKET: &str = "/run/flock/envoy/control/admin.sock";
/// The admin socket's name in the `--dev` directory.
pub const DEV_ENVOY_ADMIN_SOCKET: &str = "envoy-admin.sock";
/// The node name under `--dev` without `--node-name`.
pub const DEV_NODE_NAME: &str = "flock-dev";
/// The shortest liveness probe interval (`--probe-interval-ms` is raised to it): a
/// smaller one would probe every pod in a busy loop.
pub const MIN_PROBE_INTERVAL_MS: u64 = 100;

/// `--store-sync`: the pod store's [`Durability`](crate::store::Durability).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreSync {
    /// Survives the agent's crash (no flush).
    Crash,
    /// Survives a power loss (fsync the file and the directory).
    PowerLoss,
}

impl From<StoreSync> for crate::store::Durability {
    fn from(s: StoreSync) -> Self {
        match s {
            StoreSync::Crash => crate::store::Durability::ProcessCrash,
            StoreSync::PowerLoss => crate::store::Durability::PowerLoss,
        }
    }
}

/// The agent's flags as clap parses them (the binary flattens them into its command
/// line, beside its subcommands). Only syntax is checked here; [`Options::try_from`]
/// applies the rules.
#[derive(clap::Args, Debug, Clone)]
pub struct Flags {
    /// This node's name: owner of its registry endpoints and Envoy's node id. A
    /// DNS-1123 subdomain (a-z 0-9 - ., at most 253), unique per node; required (in
    /// Kubernetes set $FLOCK_NODE_NAME from spec.nodeName). With --dev: `flock-dev`.
    #[arg(long, env = "FLOCK_NODE_NAME", value_name = "NAME", global = true)]
    pub node_name: Option<String>,
    /// Pod store directory (one 0600 file per pod). Also the node lock (`flock(2)` on
    /// the directory): one agent serves a node at a time; a second one started on the
    /// same directory (an upgrade with surge) stands by until the first exits, then
    /// takes over.
    #[arg(long, default_value = "/var/lib/flock", value_name = "DIR")]
    pub state_dir: PathBuf,
    /// A file that exists while this agent is ready to serve the node: standing by
    /// for the node lock with its API watches synced (contents `standby`), or serving
    /// (`serving`, once the store is loaded and the CNI socket is served). Removed at
    /// exit. Use it as the DaemonSet's readiness probe: a surge upgrade then replaces
    /// the old agent only once the new one can take over.
    #[arg(long, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,
    /// What a pod store write survives before the agent answers the CNI plugin.
    /// `crash`: the agent's crash, kill or restart (write and rename, no flush); enough
    /// for pod sandboxes, which do not survive the node's reboot either (the records of
    /// the old ones are orphans that GC removes). `power-loss`: also a power loss or
    /// kernel crash (fsync the file and the directory: about 0.5 ms more per CNI ADD and
    /// DEL).
    #[arg(long, value_enum, default_value_t = StoreSync::Crash, value_name = "WHAT")]
    pub store_sync: StoreSync,
    /// The CNI plugin's socket (created 0600; flock-cni's `agent_socket`).
    #[arg(long, default_value = flock_cni::cni::DEFAULT_AGENT_SOCKET, value_name = "PATH")]
    pub cni_socket: PathBuf,
    /// Serve xDS (ADS, SotW and Delta) to the node's Envoy on this unix socket, in a
    /// directory the agent owns (created 0700; never group- or other-writable). The
    /// socket is 0600, so only the agent's uid (and --envoy-uid) can connect
    /// [default: /run/flock/xds.sock; with --dev, in the temporary directory].
    #[arg(long, value_name = "PATH", global = true)]
    pub xds_socket: Option<PathBuf>,
    /// The uid Envoy runs as: allowed on the xDS socket, which is chowned to it (mode
    /// 0600) and its directory made traversable (0711) so Envoy can reach it.
    #[arg(long, value_name = "UID")]
    pub envoy_uid: Option<u32>,
    /// Also allow unix peers with this uid on the xDS socket (repeatable). The socket's
    /// file mode still decides who can open it: use with --xds-socket-group.
    #[arg(long = "xds-allow-uid", value_name = "UID")]
    pub xds_allow_uids: Vec<u32>,
    /// Allow unix peers whose gid is this on the xDS socket (repeatable).
    #[arg(long = "xds-allow-gid", value_name = "GID")]
    pub xds_allow_gids: Vec<u32>,
    /// Give the xDS socket to this group, mode 0660 (its directory 0711), so processes
    /// of that group can open it; they must still pass --xds-allow-uid/--xds-allow-gid.
    #[arg(long, value_name = "GID")]
    pub xds_socket_group: Option<u32>,
    /// Also serve xDS on this TCP address, with mTLS only: needs --xds-tls-cert,
    /// --xds-tls-key and --xds-tls-client-ca (plaintext TCP xDS is refused). A client
    /// certificate whose SPIFFE ID is in --trust-domain gets the proxyless gRPC
    /// resources, never secrets; one listed in --xds-envoy-spiffe-id gets Envoy's. A
    /// non-loopback address needs --allow-non-loopback.
    #[arg(long, value_name = "HOST:PORT")]
    pub xds_address: Option<SocketAddr>,
    /// PEM certificate chain of the mTLS xDS listener.
    #[arg(long, value_name = "PATH")]
    pub xds_tls_cert: Option<PathBuf>,
    /// PEM private key of the mTLS xDS listener (read into memory wiped on drop).
    #[arg(long, value_name = "PATH")]
    pub xds_tls_key: Option<PathBuf>,
    /// PEM CA bundle that xDS client certificates must chain to.
    #[arg(long, value_name = "PATH")]
    pub xds_tls_client_ca: Option<PathBuf>,
    /// An mTLS xDS client with exactly this SPIFFE ID is an Envoy of this node: Envoy
    /// resources with secrets (repeatable).
    #[arg(long = "xds-envoy-spiffe-id", value_name = "SPIFFE_ID")]
    pub xds_envoy_spiffe_ids: Vec<String>,
    /// Open xDS connections at once on the mTLS listener (--xds-address); one more is
    /// closed at once and counted. The unix socket has its own cap
    /// (--xds-max-unix-connections), which these clients cannot take.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub xds_max_connections: usize,
    /// Open xDS connections at once on the unix socket (the node's Envoy), a pool of
    /// its own: clients of the TCP listener, with a certificate or without, cannot
    /// use it up.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    pub xds_max_unix_connections: usize,
    /// Close an mTLS xDS connection that has not completed its TLS handshake, or
    /// carries no authorized stream (it opened none, or only refused ones such as a
    /// client without a certificate), for this many seconds from its accept or from
    /// the end of its last stream. Counted in flock_xds_connections_idle_closed_total
    /// and flock_xds_connections_handshake_timeout_total.
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    pub xds_idle_timeout: u64,
    /// Subscription budget: resource names the streams of one xDS connection may hold
    /// subscribed at once. A request over any budget ends its stream with
    /// RESOURCE_EXHAUSTED naming the budget (logged once per client, counted in
    /// flock_xds_streams_refused_total{reason="subscription_budget"}); other clients,
    /// and the client's other streams, keep what they hold.
    #[arg(
        long,
        default_value_t = 10_000,
        value_name = "N",
        help_heading = "xDS subscription budget"
    )]
    pub xds_budget_connection_names: usize,
    /// Bytes of resource names (lengths summed) one xDS connection may hold subscribed.
    #[arg(long, default_value_t = 512 << 10, value_name = "BYTES", help_heading = "xDS subscription budget")]
    pub xds_budget_connection_bytes: usize,
    /// Resource names one xDS client (its SPIFFE ID, or its uid on the unix socket) may
    /// hold subscribed across all its connections.
    #[arg(
        long,
        default_value_t = 20_000,
        value_name = "N",
        help_heading = "xDS subscription budget"
    )]
    pub xds_budget_client_names: usize,
    /// Bytes of resource names one xDS client may hold subscribed across its connections.
    #[arg(long, default_value_t = 1 << 20, value_name = "BYTES", help_heading = "xDS subscription budget")]
    pub xds_budget_client_bytes: usize,
    /// Resource names every client of a listener kind may hold together: the unix
    /// socket's clients and the mTLS listener's each have this much, so remote clients
    /// cannot spend the node's Envoy's share.
    #[arg(
        long,
        default_value_t = 250_000,
        value_name = "N",
        help_heading = "xDS subscription budget"
    )]
    pub xds_budget_total_names: usize,
    /// Bytes of resource names every client of a listener kind may hold together.
    #[arg(long, default_value_t = 32 << 20, value_name = "BYTES", help_heading = "xDS subscription budget")]
    pub xds_budget_total_bytes: usize,
    /// Concurrent xDS streams per connection (HTTP/2 MAX_CONCURRENT_STREAMS).
    #[arg(long, default_value_t = 100, value_name = "N")]
    pub xds_max_streams: u32,
    /// Open xDS streams at once, across every connection and listener; one more gets
    /// RESOURCE_EXHAUSTED at once (a node-local Envoy uses one).
    #[arg(long, default_value_t = 4096, value_name = "N")]
    pub xds_max_open_streams: usize,
    /// An xDS stream whose first request does not arrive within this many seconds ends
    /// with DEADLINE_EXCEEDED.
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    pub xds_first_request_timeout: u64,
    /// Admin endpoint: /healthz /readyz /metrics /debug/pods /debug/snapshot
    /// /debug/registry (no authentication: keep it on loopback). A non-loopback address
    /// needs --allow-non-loopback.
    #[arg(long, default_value = "127.0.0.1:18090", value_name = "HOST:PORT")]
    pub admin_address: SocketAddr,
    /// Admin connections served at once; further clients wait in the listen backlog.
    #[arg(long, default_value_t = crate::admin::server::DEFAULT_MAX_CONNECTIONS, value_name = "N")]
    pub admin_max_connections: usize,
    /// Allow --admin-address and --xds-address on non-loopback addresses (reachable from
    /// other hosts and from hostNetwork pods).
    #[arg(long)]
    pub allow_non_loopback: bool,
    /// Where endpoints are shared: `memory` (embedded, single node), `file:PATH`
    /// (embedded, persisted), `etcd://HOST:PORT[,HOST:PORT]` (multi-node, plaintext) or
    /// `etcds://HOST:PORT[,HOST:PORT]` (multi-node over TLS: needs --registry-ca). Each
    /// agent's endpoints live on its lease and expire if it dies; keys are
    /// `/flock/endpoints/<node>/...`, so etcd RBAC can confine each agent to its node's
    /// prefix (docs/registry-security.md).
    #[arg(long, default_value = "memory", value_name = "SPEC")]
    pub registry: String,
    /// Lease TTL of this agent's etcd registrations, seconds.
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    pub registry_ttl: i64,
    /// etcds:// only: PEM CA bundle that verifies etcd's server certificate.
    #[arg(long, value_name = "FILE", help_heading = "Registry security")]
    pub registry_ca: Option<PathBuf>,
    /// etcds:// only: PEM client certificate for etcd (`--client-cert-auth`); with etcd
    /// auth on and no --registry-user, etcd takes its CN as the user. Needs --registry-key.
    #[arg(long, value_name = "FILE", help_heading = "Registry security")]
    pub registry_cert: Option<PathBuf>,
    /// etcds:// only: PEM private key of --registry-cert.
    #[arg(long, value_name = "FILE", help_heading = "Registry security")]
    pub registry_key: Option<PathBuf>,
    /// etcds:// only: etcd user (etcd auth); give its password with --registry-password-file.
    #[arg(long, value_name = "USER", help_heading = "Registry security")]
    pub registry_user: Option<String>,
    /// File holding the password of --registry-user (a file, not a flag: command lines
    /// show in `ps`).
    #[arg(long, value_name = "FILE", help_heading = "Registry security")]
    pub registry_password_file: Option<PathBuf>,
    /// etcd registries only: the node-scoped signer's scope file (`<node>: <ns>/<sa>
    /// ...` per line, the file `flock-ca serve --scope` reads). Another node's entry is
    /// then dropped (metric reason `node_scope`) if its identity names an account the
    /// file does not let that node host, so a node cannot advertise endpoints as
    /// another node's pods. Read at start: restart the agent after changing it.
    #[arg(long, value_name = "FILE", help_heading = "Registry security")]
    pub registry_scope: Option<PathBuf>,
    /// etcd registries only: the most entries of one other node this agent loads
    /// (the first ones listed, in key order, are kept; the rest are dropped with
    /// metric reason `node_cap`), so one node writing without bound cannot exhaust
    /// every agent's memory.
    #[arg(long, default_value_t = flock_core::registry::DEFAULT_MAX_ENTRIES_PER_NODE, value_name = "N", help_heading = "Registry security")]
    pub registry_max_entries_per_node: usize,
    /// Where pods' workload identities come from: `builtin` (a CA in this agent; mTLS
    /// between pods), `flock-ca:https://HOST:PORT` (the node-scoped signer: no issuer
    /// key on the node; needs --node-credential), `spire:PATH` (a SPIRE agent's
    /// Delegated Identity API on its admin socket PATH), `none` (plaintext).
    #[arg(long, default_value = "builtin", value_name = "SOURCE")]
    pub identity: String,
    /// SPIFFE trust domain of the built-in CA's SVIDs (`spiffe://DOMAIN/ns/NAMESPACE/sa/ACCOUNT`),
    /// and of the mTLS xDS clients served as proxyless gRPC.
    #[arg(long, default_value = "cluster.local", value_name = "DOMAIN")]
    pub trust_domain: String,
    /// The built-in CA's issuer under a shared root, so that nodes trust each other's
    /// SVIDs (cross-node mTLS): a directory in the layout of a Kubernetes Secret like
    /// Istio's `cacerts` — ca-cert.pem (this node's issuer), ca-key.pem (PKCS#8),
    /// cert-chain.pem (issuer → root; optional), root-cert.pem (the trusted roots, one
    /// or more). Checked whole at start (the agent refuses to start on a bad set) and
    /// re-read when it changes: a valid new set re-issues every SVID, a bad one is
    /// refused with a warning and the old kept. `flock-agent ca init` / `ca issue` make
    /// one. Without it: a node-local CA, trusted on this node only.
    #[arg(long, value_name = "DIR")]
    pub ca_dir: Option<PathBuf>,
    /// --identity flock-ca: this node's credential directory (node-cert.pem,
    /// node-key.pem, bundle.pem; `flock-ca node-credential` makes one). The agent
    /// renews the credential through the signer at half its life.
    #[arg(long, value_name = "DIR")]
    pub node_credential: Option<PathBuf>,
    /// --identity flock-ca: the DNS name the signer's certificate must carry.
    #[arg(long, default_value = "flock-ca", value_name = "NAME")]
    pub ca_server_name: String,
    /// Lifetime of the built-in CA's SVIDs, seconds; each is renewed at half its lifetime.
    #[arg(long, default_value_t = 3600, value_name = "SECS")]
    pub svid_ttl: u64,
    /// Zone of this node's endpoints (EDS locality).
    #[arg(long, default_value = "", value_name = "ZONE")]
    pub zone: String,
    /// Region of this node's endpoints (EDS locality).
    #[arg(long, default_value = "", value_name = "REGION")]
    pub region: String,
    /// Liveness probe interval per pod, milliseconds.
    #[arg(long, default_value_t = 5000, value_name = "MS")]
    pub probe_interval_ms: u64,
    /// Orphan GC period, seconds.
    #[arg(long, default_value_t = 60, value_name = "SECS")]
    pub gc_interval: u64,
    /// Envoy's cluster name in the bootstrap (`envoy-bootstrap`).
    #[arg(long, default_value = "flock", value_name = "NAME", global = true)]
    pub envoy_cluster: String,
    /// Envoy's admin socket in the bootstrap (`envoy-bootstrap`): a unix socket of
    /// mode 0600 (default /run/flock/envoy/control/admin.sock, inside flock-supervisor's
    /// 0700 control directory with `--state-dir /run/flock/envoy`; with --dev,
    /// `envoy-admin.sock` in the --dev directory). flock-supervisor's `--admin-socket`
    /// must name the same path.
    #[arg(long, value_name = "PATH", global = true)]
    pub envoy_admin_socket: Option<PathBuf>,
    /// The Envoy container's memory limit in bytes, for the bootstrap's overload
    /// manager (`envoy-bootstrap`; in Kubernetes the downward API's
    /// `resourceFieldRef: {containerName: envoy, resource: limits.memory}`): Envoy's
    /// heap may use 90% of it; at 90%, 95% and 98% of that it returns free memory,
    /// stops keeping connections alive, and answers new requests 503, rather
    /// than be OOM-killed with every pod's connections. Unset or 0: no heap limit.
    #[arg(
        long,
        value_name = "BYTES",
        env = "FLOCK_ENVOY_MEMORY_LIMIT",
        global = true
    )]
    pub envoy_memory_limit: Option<u64>,
    /// Most downstream connections the node's Envoy holds at once, all listeners
    /// together (`envoy-bootstrap`'s overload manager): one pod's flood of
    /// connections cannot exhaust Envoy's descriptors for every other pod.
    #[arg(long, value_name = "N", default_value_t = runtime::DEFAULT_ENVOY_MAX_CONNECTIONS, global = true)]
    pub envoy_max_connections: u64,
    /// Compatibility, opt-in: Envoy's admin on TCP 127.0.0.1:PORT instead of the unix
    /// socket (wins over --envoy-admin-socket). Any process on the host can reach it,
    /// stop Envoy (`/quitquitquit`) and read its config, secrets included.
    #[arg(long, value_name = "PORT", global = true)]
    pub envoy_admin_port: Option<u16>,
    /// Try-it-out mode: state, CNI and xDS sockets in a fresh temporary directory, the
    /// embedded in-memory registry (the `--registry` default), everything on loopback,
    /// node name `flock-dev` unless --node-name is given; the Envoy bootstrap is
    /// written into the directory (its path is logged). Explicit flags still win for
    /// the registry and addresses.
    #[arg(long)]
    pub dev: bool,
    /// Also keep this Linux capability after start (repeatable; e.g. CAP_SYS_PTRACE
    /// when the runtime passes /proc/PID/ns/net paths). The agent keeps only
    /// CAP_SYS_ADMIN (liveness probes enter pods' network namespaces) and drops every
    /// other capability once its listeners are bound.
    #[arg(long = "keep-capability", value_name = "CAP", value_parser = parse_capability)]
    pub keep_capabilities: Vec<caps::Capability>,
    /// Kube mode: every fact about a pod from the Kubernetes API, none from annotations.
    /// A pod is meshed when its namespace or itself has the label `flock.io/mesh:
    /// enabled` (a pod label `flock.io/mesh: disabled` opts out); its identity is its
    /// `spec.serviceAccountName`, its ports its containers' TCP ports, and it registers
    /// under every Service of its namespace that selects it (followed live as labels
    /// and Services change). The annotations flock.io/service, flock.io/ports and
    /// flock.io/service-account are ignored. A CNI ADD fails when the API cannot be
    /// asked (the agent refuses to guess an identity). Chosen by a flag only, never by
    /// the environment: in a cluster (`KUBERNETES_SERVICE_HOST` is set) the agent
    /// refuses to start until --kube, --kubeconfig or --no-kube says which — there,
    /// annotations could be written by anyone who can create a pod.
    #[arg(long, help_heading = "Kubernetes")]
    pub kube: bool,
    /// Turn kube mode off even in a cluster: pods are meshed by their annotations.
    #[arg(long, conflicts_with_all = ["kube", "kubeconfig"], help_heading = "Kubernetes")]
    pub no_kube: bool,
    /// Kube mode: the kubeconfig to reach the API with (implies --kube) [default: the
    /// in-cluster configuration: the pod's service-account token].
    #[arg(long, value_name = "PATH", help_heading = "Kubernetes")]
    pub kubeconfig: Option<PathBuf>,
    /// Kube mode: how long a CNI ADD waits for its pod to appear in the agent's watch
    /// before asking the API directly (`500ms`, `2s`, or seconds). The API then has
    /// 2.5 s more to answer; keep the sum under flock-cni's `timeout_ms` (5 s by
    /// default), so a failed ADD carries the agent's reason.
    #[arg(long, default_value = "2s", value_name = "DURATION", value_parser = parse_duration, help_heading = "Kubernetes")]
    pub kube_pod_wait: Duration,
    /// Kube mode: the pod label keys a pod's registry endpoints carry, which route
    /// subsets (`flock.io/subsets` on an HTTPRoute) can select on, such as
    /// `version,app.kubernetes.io/version`; at most 8. Only these travel to other
    /// nodes, not every label of every pod. Default none: turn it on once every node
    /// runs an agent of this version (an older agent drops a registry entry that
    /// carries labels). Outside kube mode a pod names its labels in the
    /// `flock.io/labels` annotation.
    #[arg(
        long,
        value_name = "KEYS",
        value_delimiter = ',',
        help_heading = "Kubernetes"
    )]
    pub endpoint_labels: Vec<String>,
    /// Kube mode: remove the startup taint flock.io/agent-not-ready:NoSchedule from
    /// this node's Node once the node is ready (store loaded, CNI socket bound,
    /// --cni-ready-file present if given, the first snapshot ACKed by an Envoy). Other
    /// taints are kept. Register nodes with kubelet
    /// `--register-with-taints=flock.io/agent-not-ready=:NoSchedule` so that no pod is
    /// scheduled before. On by default in kube mode; `--remove-startup-taint=false`
    /// turns it off.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = true, default_missing_value = "true", action = clap::ArgAction::Set, help_heading = "Kubernetes")]
    pub remove_startup_taint: bool,
    /// Kube mode: what to do with a pod of this node that should be meshed and runs
    /// without the mesh (it started before the CNI plugin was in the node's chain):
    /// `report` (the default: a Warning Event `Unmeshed` on the pod, a log line and
    /// flock_agent_unmeshed_pods) or `delete` (report it, then delete it so its
    /// controller recreates it meshed; at most 5 per sweep). Checked every
    /// --gc-interval.
    #[arg(long, value_name = "WHAT", default_value = "report", value_parser = ["report", "delete"], help_heading = "Kubernetes")]
    pub repair: String,
    /// Kube mode: the CNI installer's ready file (flock-install-cni --ready-file); the
    /// startup taint stays until it exists.
    #[arg(long, value_name = "PATH", help_heading = "Kubernetes")]
    pub cni_ready_file: Option<PathBuf>,
    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    pub log_format: String,
    /// Transparent capture of meshed pods' TCP traffic: nftables rules in each pod's
    /// network namespace (installed before the CNI ADD is answered) send the apps'
    /// outbound connections to Envoy's listener (port 15001, routed by original
    /// destination; destinations outside the mesh pass through) and inbound
    /// connections to the app ports through Envoy's inbound listeners. `off` (the
    /// default): no rules, apps call Envoy's outbound listener explicitly, and the xDS
    /// output is the same as without this flag. `strict`: default deny — inbound
    /// listeners take mTLS only, and TCP from outside to any other port (an undeclared
    /// one, Envoy's outbound listener, a connection that escaped the redirect) is
    /// dropped; the probe sources and excluded inbound ports still pass.
    /// `permissive`: plaintext callers (not meshed yet) still reach the app, through
    /// Envoy. A pod's `flock.io/capture: off|strict|permissive` annotation overrides
    /// this (in kube mode the Pod's annotation), but no pod is captured while this is
    /// `off`: a pod asking for capture then is refused. Not `off`: the agent checks at
    /// start that `nft` and the kernel's nf_tables work (exits with the cause if not),
    /// and keeps CAP_NET_ADMIN. UDP (DNS included) is never captured.
    #[arg(long, default_value = "off", value_name = "MODE", value_parser = ["off", "strict", "permissive"], help_heading = "Transparent capture")]
    pub capture: String,
    /// A source address or prefix whose connections reach captured pods' apps directly,
    /// not through Envoy (repeatable; a comma list works too). Default: only the
    /// link-local probe source (169.254.7.127, fd16:9254:7127:1337:ffff:ffff:ffff:ffff)
    /// that the node gives the sockets of `--capture-probe-cgroup` (kubelet's probes).
    /// The node's own address on the pod network is never exempt by default: every
    /// hostNetwork process and all traffic kube-proxy SNATs to the node comes from it.
    #[arg(
        long = "capture-probe-source",
        value_name = "CIDR",
        help_heading = "Transparent capture"
    )]
    pub capture_probe_sources: Vec<String>,
    /// A cgroup v2 path, relative to the cgroup root, whose processes' connections to
    /// captured pods leave the node from the link-local probe source, which captured
    /// pods let reach their apps directly: kubelet's, for its liveness, readiness and
    /// startup probes (repeatable; typically `system.slice/kubelet.service`, the last
    /// field of the `0::` line of `/proc/<kubelet pid>/cgroup`). Must exist at start;
    /// needs cgroup v2 at `/sys/fs/cgroup` (or `/sys/fs/cgroup/unified`). None: no
    /// socket gets the probe source, and strict pods refuse kubelet's plaintext
    /// probes like any other caller's.
    #[arg(
        long = "capture-probe-cgroup",
        value_name = "PATH",
        help_heading = "Transparent capture"
    )]
    pub capture_probe_cgroups: Vec<String>,
    /// Destination ports (comma list, e.g. `5432,6379`) captured pods' apps reach
    /// directly, not through Envoy (node-wide; a pod's
    /// `flock.io/capture-exclude-outbound-ports` adds to it). Repeatable.
    #[arg(long, value_name = "PORTS", help_heading = "Transparent capture")]
    pub capture_exclude_outbound_ports: Vec<String>,
    /// Destination prefixes (comma list, e.g. `169.254.169.254/32,10.0.0.0/8`) captured
    /// pods' apps reach directly (node-wide; a pod's
    /// `flock.io/capture-exclude-outbound-cidrs` adds to it). Repeatable.
    #[arg(long, value_name = "CIDRS", help_heading = "Transparent capture")]
    pub capture_exclude_outbound_cidrs: Vec<String>,
    /// App ports (comma list) whose inbound connections are not captured: callers
    /// reach the app directly (node-wide; a pod's
    /// `flock.io/capture-exclude-inbound-ports` adds to it). Repeatable.
    #[arg(long, value_name = "PORTS", help_heading = "Transparent capture")]
    pub capture_exclude_inbound_ports: Vec<String>,
    /// App ports (comma list) a pod may mark as its proxyless gRPC xDS server's
    /// (`flock.io/ports: 50051/grpc-xds`, or a container port named `grpc-xds`) when
    /// capture is enforced: that pod's port is left to the app, which terminates mTLS
    /// and enforces the port's policy itself; other pods' same port stays captured.
    /// Without --capture-enforce any pod may. Repeatable.
    #[arg(long, value_name = "PORTS", help_heading = "Transparent capture")]
    pub capture_allow_proxyless_ports: Vec<String>,
    /// Enforce the node's capture: a pod's `flock.io/capture` annotation may raise the
    /// mode (permissive to strict) but never lower it, and its
    /// `flock.io/capture-exclude-*` annotations are refused — the CNI ADD fails and
    /// names the annotation. Without it, anyone who can create a pod can opt it out of
    /// the mesh. Needs --capture strict or permissive.
    #[arg(long, help_heading = "Transparent capture")]
    pub capture_enforce: bool,

    /// A directory of authorization policies the agent watches (inotify, and a full
    /// re-read every 30 s): `<namespace>.json` governs a namespace,
    /// `<namespace>.<service>.json` one service of it. Each file is one policy
    /// (`default`: all-authenticated, same-namespace or deny; `rules`: allow or deny
    /// by caller identity, ports and HTTP method, path and host); deny rules win, and a
    /// file that does not parse or check denies every call to what its name says
    /// (fail closed) and is named in `/debug/status`. A pod's `flock.io/authz`
    /// annotation narrows its own policy, never widens it. None: no policy (every
    /// authenticated caller may call every meshed port). Not with kube mode: there the
    /// policies are AuthorizationPolicy objects (flock.io/v1alpha1, the same documents
    /// as the files). See docs/authz.md.
    #[arg(long, value_name = "DIR", conflicts_with_all = ["kube", "kubeconfig"], help_heading = "Authorization")]
    pub authz_dir: Option<PathBuf>,
    /// A directory of traffic-policy routes the agent watches (inotify, and a full
    /// re-read every 30 s): each `*.json` file is one Gateway API HTTPRoute
    /// (gateway.networking.k8s.io/v1) whose parentRefs name a Service (kind: Service,
    /// group: "") of its own namespace. Its rules split the Service's requests by
    /// weight over backendRefs (Services of the namespace), match on path (Exact,
    /// PathPrefix), headers (Exact) and method, and set timeouts (request,
    /// backendRequest) and retries (attempts, codes, backoff; POST and PATCH are only
    /// retried where the request never left, unless the route's annotation
    /// flock.io/retry-non-idempotent is "true"). A routed Service answers 404 to a
    /// request no rule matches. A file that does not parse or check is refused alone
    /// (its Service keeps its default route), a missing backend is dropped from its
    /// rule; both are named in /debug/routes and `flockctl routes`. See
    /// docs/traffic.md.
    #[arg(long, value_name = "DIR", help_heading = "Traffic policy")]
    pub routes_dir: Option<PathBuf>,
    /// Access log: one JSON line per HTTP request or TCP connection a meshed pod
    /// receives (caller and callee SPIFFE IDs, pods, service, status, duration,
    /// bytes), logged on the callee's side, to FILE (an absolute path; created 0600,
    /// rotated to FILE.1) or `-` for standard output. Off by default. See
    /// docs/telemetry.md.
    #[arg(long, value_name = "FILE|-", help_heading = "Telemetry")]
    pub access_log: Option<String>,
    /// Percentage of requests and connections the access log keeps (1-100), sampled
    /// by Envoy before anything is sent.
    #[arg(long, default_value_t = 100, value_name = "PERCENT", value_parser = clap::value_parser!(u32).range(1..=100), help_heading = "Telemetry")]
    pub access_log_sample_percent: u32,
    /// Size at which the access log file is rotated to FILE.1 (one old file kept),
    /// MiB.
    #[arg(long, default_value_t = 100, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..), help_heading = "Telemetry")]
    pub access_log_max_mib: u64,
    /// Golden metrics per workload pair on the admin /metrics: requests by response
    /// code and their latency histogram, TCP connections and bytes, per caller
    /// (namespace and service account, from its SPIFFE ID) and destination service;
    /// at most 10,000 label sets (flock_workload_metrics_dropped_total counts the
    /// rest). Envoy then streams every request's entry to the agent (any
    /// --access-log-sample-percent is applied by the agent). See docs/telemetry.md.
    #[arg(long, help_heading = "Telemetry")]
    pub workload_metrics: bool,
    /// Tracing: every HTTP request through the node's Envoy (outbound and inbound
    /// listeners) gets spans, exported over OTLP gRPC (plaintext) to this collector;
    /// W3C `traceparent` is read and propagated, so a call's hops share one trace.
    /// Off by default. See docs/telemetry.md.
    #[arg(long, value_name = "HOST:PORT", help_heading = "Telemetry")]
    pub trace_collector: Option<String>,
    /// Percentage of requests arriving without a sampled `traceparent` that start a
    /// trace (a request with one is always traced).
    #[arg(long, default_value_t = 1, value_name = "PERCENT", value_parser = clap::value_parser!(u32).range(0..=100), help_heading = "Telemetry")]
    pub trace_sample_percent: u32,
}

/// `--trace-collector`: host (a name or an address; IPv6 in brackets) and port.
fn trace_collector(
    flags: &Flags,
) -> Result<Option<flock_xds::translate::telemetry::TracingOptions>, OptionsError> {
    let Some(spec) = flags.trace_collector.as_deref() else {
        return Ok(None);
    };
    let bad = || {
        OptionsError(format!(
            "--trace-collector {spec:?}: expected HOST:PORT (a DNS name or an address, IPv6 in brackets)"
        ))
    };
    let (host, port) = spec.rsplit_once(':').ok_or_else(bad)?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    let host = host
        .strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host);
    let valid_name = !host.is_empty()
        && host.len() <= 253
        && host.split('.').all(|l| {
            !l.is_empty()
                && l.len() <= 63
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
        });
    if port == 0 || !(host.parse::<std::net::IpAddr>().is_ok() || valid_name) {
        return Err(bad());
    }
    Ok(Some(flock_xds::translate::telemetry::TracingOptions {
        collector_host: host.to_string(),
        collector_port: port,
        service_name: "flock-envoy".to_string(),
        sample_percent: flags.trace_sample_percent,
    }))
}

/// `--access-log`: where the lines go, if anywhere.
fn access_log(flags: &Flags) -> Result<Option<crate::access_log::Destination>, OptionsError> {
    use crate::access_log::Destination;
    Ok(match flags.access_log.as_deref() {
        None => None,
        Some("-") => Some(Destination::Stdout),
        Some(path) if Path::new(path).is_absolute() && !path.ends_with('/') => {
            Some(Destination::File {
                path: PathBuf::from(path),
                max_bytes: flags.access_log_max_mib.saturating_mul(1 << 20),
            })
        }
        Some(other) => {
            return Err(OptionsError(format!(
                "--access-log {other:?}: an absolute file path, or - for standard output"
            )));
        }
    })
}

/// Parses `--keep-capability` values (`CAP_SYS_PTRACE` or `sys_ptrace`).
pub fn parse_capability(name: &str) -> Result<Capability, String> {
    let upper = name.to_ascii_uppercase();
    let full = if upper.starts_with("CAP_") {
        upper
    } else {
        format!("CAP_{upper}")
    };
    full.parse::<Capability>()
        .map_err(|_| format!("{name:?} is not a Linux capability (e.g. CAP_SYS_PTRACE)"))
}

/// `500ms`, `2s` or `2` (seconds).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let bad = || format!("{s:?} is not a duration (e.g. 500ms, 2s, 2)");
    let (number, unit_ms) = if let Some(n) = s.strip_suffix("ms") {
        (n, 1)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1000)
    } else {
        (s, 1000)
    };
    let n: u64 = number.trim().parse().map_err(|_| bad())?;
    n.checked_mul(unit_ms)
        .map(Duration::from_millis)
        .ok_or_else(bad)
}

/// A flag, or a combination of flags, the agent refuses; the message names them and
/// says what would be accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct OptionsError(pub String);

/// What the rules read besides the flags (the process environment), explicit so that
/// tests can set it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Environment {
    /// `KUBERNETES_SERVICE_HOST` is set and not empty: the agent runs in a cluster,
    /// where it refuses to start until a flag chooses kube mode or annotations.
    pub in_cluster: bool,
    /// The agent's effective uid: always allowed on the xDS socket.
    pub euid: u32,
    /// `FLOCK_PUBLISH_FROM_SCRATCH=1`: the scale benchmark's baseline only (not a
    /// flag: nobody should run it), every publish rebuilds the whole mesh.
    pub publish_from_scratch: bool,
}

impl Environment {
    /// This process's environment.
    pub fn current() -> Self {
        Self {
            in_cluster: std::env::var_os("KUBERNETES_SERVICE_HOST").is_some_and(|h| !h.is_empty()),
            euid: nix::unistd::geteuid().as_raw(),
            publish_from_scratch: std::env::var_os("FLOCK_PUBLISH_FROM_SCRATCH")
                .is_some_and(|v| v == "1"),
        }
    }
}

/// The agent's checked configuration: what [`runtime::run`] takes, and what the
/// binary does around it (logging, `--dev`, capabilities).
#[derive(Debug, Clone)]
pub struct Options {
    /// The runtime's configuration.
    pub runtime: runtime::Options,
    /// `--dev`: state and sockets go into a temporary directory ([`Options::dev_layout`]).
    pub dev: bool,
    /// `--xds-socket` was given (under `--dev` it wins over the temporary directory).
    pub xds_socket_given: bool,
    /// `--envoy-cluster`, for the bootstrap.
    pub envoy_cluster: String,
    /// `--envoy-admin-socket` or `--envoy-admin-port`, for the bootstrap.
    pub envoy_admin: runtime::EnvoyAdmin,
    /// Either was given (under `--dev` it wins over the temporary directory).
    pub envoy_admin_given: bool,
    /// `--log-format`: `text` or `json`.
    pub log_format: String,
    /// The capabilities kept while running besides `CAP_SYS_ADMIN`: `--keep-capability`,
    /// and `CAP_NET_ADMIN` when capture is on (`nft` in pods' network namespaces
    /// needs it).
    pub keep_capabilities: Vec<Capability>,
    /// The capabilities binding the listeners needs (dropped once they are bound):
    /// `CAP_CHOWN` to hand the xDS socket to `--envoy-uid` or `--xds-socket-group`,
    /// `CAP_NET_BIND_SERVICE` for a port below 1024. None by default.
    pub bind_time_capabilities: Vec<Capability>,
}

impl TryFrom<Flags> for Options {
    type Error = OptionsError;

    /// Applies the rules with this process's [`Environment`].
    fn try_from(flags: Flags) -> Result<Self, OptionsError> {
        Self::check(&flags, &Environment::current())
    }
}

impl Options {
    /// Applies every rule to `flags` in `env`. The registry's credential files are read
    /// here (a missing or empty one is refused before the agent starts).
    pub fn check(flags: &Flags, env: &Environment) -> Result<Self, OptionsError> {
        let capture = node_capture(flags)?;
        let mut agent = AgentConfig::new(node_name(flags)?);
        agent.zone.clone_from(&flags.zone);
        agent.region.clone_from(&flags.region);
        agent.liveness.interval_ms = flags.probe_interval_ms.max(MIN_PROBE_INTERVAL_MS);
        agent.gc_interval = Duration::from_secs(flags.gc_interval.max(1));
        agent.publish_from_scratch = env.publish_from_scratch;
        agent.denial_log_cluster = Some(runtime::XDS_CLUSTER.to_string());
        let access_log = access_log(flags)?;
        // With the workload metrics on, Envoy must send every entry (the metrics count
        // them all) and the agent samples the lines; without, Envoy samples.
        let (envoy_percent, line_percent) = if flags.workload_metrics {
            (100, flags.access_log_sample_percent)
        } else {
            (flags.access_log_sample_percent, 100)
        };
        agent.tracing = trace_collector(flags)?;
        agent.access_log = (access_log.is_some() || flags.workload_metrics).then(|| {
            flock_xds::translate::telemetry::AccessLogOptions {
                cluster: runtime::XDS_CLUSTER.to_string(),
                sample_percent: envoy_percent,
            }
        });
        let mut keep_capabilities = flags.keep_capabilities.clone();
        if capture.setting != Setting::Off {
            keep_capabilities.push(Capability::CAP_NET_ADMIN);
        }
        agent.capture = capture;
        check_listen_addr(
            "--admin-address",
            flags.admin_address,
            flags.allow_non_loopback,
        )
        .map_err(OptionsError)?;
        let runtime = runtime::Options {
            agent,
            state_dir: flags.state_dir.clone(),
            ready_file: flags.ready_file.clone(),
            store_durability: flags.store_sync.into(),
            cni_socket: flags.cni_socket.clone(),
            xds_socket: Some(XdsSocket {
                path: flags
                    .xds_socket
                    .clone()
                    .unwrap_or_else(|| PathBuf::from(DEFAULT_XDS_SOCKET)),
                owner_uid: flags.envoy_uid,
                group: flags.xds_socket_group,
            }),
            xds_tls: xds_tls(flags)?,
            xds_access: access_policy(flags, env.euid),
            xds_limits: XdsLimits {
                max_connections: flags.xds_max_connections.max(1),
                max_streams_per_connection: flags.xds_max_streams.max(1),
                first_request_timeout: Duration::from_secs(flags.xds_first_request_timeout.max(1)),
                max_open_streams: flags.xds_max_open_streams.max(1),
                max_unix_connections: flags.xds_max_unix_connections.max(1),
                idle_timeout: Duration::from_secs(flags.xds_idle_timeout.max(1)),
                subscription_budget: SubscriptionBudget {
                    per_connection: Usage {
                        names: flags.xds_budget_connection_names,
                        bytes: flags.xds_budget_connection_bytes,
                    },
                    per_client: Usage {
                        names: flags.xds_budget_client_names,
                        bytes: flags.xds_budget_client_bytes,
                    },
                    total: Usage {
                        names: flags.xds_budget_total_names,
                        bytes: flags.xds_budget_total_bytes,
                    },
                },
            },
            admin_address: flags.admin_address,
            admin_max_connections: flags.admin_max_connections,
            registry: flags.registry.clone(),
            registry_ttl_secs: flags.registry_ttl,
            registry_tls: registry_tls(flags)?,
            registry_auth: registry_auth(flags)?,
            registry_scope: registry_scope(flags)?,
            registry_max_entries_per_node: flags.registry_max_entries_per_node.max(1),
            identity: identity_source(flags)?,
            kube: kube_options(flags, env.in_cluster)?,
            authz_dir: flags.authz_dir.clone(),
            routes_dir: flags.routes_dir.clone(),
            access_log,
            access_log_line_percent: line_percent,
            workload_metrics: flags.workload_metrics,
        };
        Ok(Self {
            runtime,
            dev: flags.dev,
            xds_socket_given: flags.xds_socket.is_some(),
            envoy_cluster: flags.envoy_cluster.clone(),
            envoy_admin: envoy_admin(flags),
            envoy_admin_given: flags.envoy_admin_socket.is_some()
                || flags.envoy_admin_port.is_some(),
            log_format: flags.log_format.clone(),
            keep_capabilities,
            bind_time_capabilities: bind_time_capabilities(flags),
        })
    }

    /// `--dev`: puts the pod store, the CNI socket and (unless `--xds-socket` was
    /// given) the xDS socket under `dir`, and returns where the Envoy bootstrap goes
    /// and the bootstrap itself.
    pub fn dev_layout(&mut self, dir: &Path) -> (PathBuf, serde_json::Value) {
        let rt = &mut self.runtime;
        rt.state_dir = dir.join("pods");
        rt.cni_socket = dir.join("cni.sock");
        if let Some(socket) = rt.xds_socket.as_mut().filter(|_| !self.xds_socket_given) {
            socket.path = dir.join("run").join("xds.sock");
        }
        let xds_path = rt
            .xds_socket
            .as_ref()
            .map(|s| s.path.clone())
            .unwrap_or_default();
        if !self.envoy_admin_given {
            self.envoy_admin = runtime::EnvoyAdmin::Socket(dir.join(DEV_ENVOY_ADMIN_SOCKET));
        }
        let doc = runtime::envoy_bootstrap(
            &rt.agent.node_name,
            &self.envoy_cluster,
            &xds_path,
            &self.envoy_admin,
        );
        (dir.join("envoy-bootstrap.json"), doc)
    }
}

/// `flock-agent envoy-bootstrap`: the bootstrap for these flags. Needs only the node
/// name and the xDS socket, so it works with flags the agent itself would refuse.
pub fn envoy_bootstrap(flags: &Flags) -> Result<serde_json::Value, OptionsError> {
    let node = node_name(flags)?;
    let socket = match (&flags.xds_socket, flags.dev) {
        (Some(p), _) => p.clone(),
        (None, false) => PathBuf::from(DEFAULT_XDS_SOCKET),
        (None, true) => {
            return Err(OptionsError(
                "with --dev the xDS socket is in a fresh temporary directory: use the \
                 bootstrap the agent wrote there (its path is in the agent's log), or pass \
                 --xds-socket"
                    .into(),
            ));
        }
    };
    // Envoy refuses a heap limit of 0 bytes and a connection cap of 0 (the whole
    // bootstrap, so Envoy would not start): refused here, with the flag's name.
    if let Some(bytes) = flags.envoy_memory_limit.filter(|b| *b > 0 && *b < 64 << 20) {
        return Err(OptionsError(format!(
            "--envoy-memory-limit {bytes}: less than 64 MiB (67108864 bytes) is not enough \
             for Envoy; it is the envoy container's memory limit in bytes"
        )));
    }
    if flags.envoy_max_connections == 0 {
        return Err(OptionsError(
            "--envoy-max-connections 0: Envoy would refuse every connection; give at least 1"
                .into(),
        ));
    }
    Ok(runtime::envoy_bootstrap_with(
        &node,
        &flags.envoy_cluster,
        &socket,
        &envoy_admin(flags),
        &runtime::EnvoyLimits {
            memory_limit_bytes: flags.envoy_memory_limit.filter(|b| *b > 0),
            max_downstream_connections: flags.envoy_max_connections,
        },
    ))
}

/// Envoy's admin in the bootstrap: the opt-in TCP port, else the socket (default
/// [`DEFAULT_ENVOY_ADMIN_SOCKET`]).
fn envoy_admin(flags: &Flags) -> runtime::EnvoyAdmin {
    match (flags.envoy_admin_port, &flags.envoy_admin_socket) {
        (Some(port), _) => runtime::EnvoyAdmin::LoopbackPort(port),
        (None, Some(path)) => runtime::EnvoyAdmin::Socket(path.clone()),
        (None, None) => runtime::EnvoyAdmin::Socket(PathBuf::from(DEFAULT_ENVOY_ADMIN_SOCKET)),
    }
}

/// The node name: --node-name / $FLOCK_NODE_NAME, `flock-dev` under --dev; validated.
fn node_name(flags: &Flags) -> Result<String, OptionsError> {
    let name = match (&flags.node_name, flags.dev) {
        (Some(name), _) => name.clone(),
        (None, true) => DEV_NODE_NAME.to_string(),
        (None, false) => {
            return Err(OptionsError(
                "no node name: set --node-name or $FLOCK_NODE_NAME to this node's name (a \
                 DNS-1123 subdomain, unique per node; in Kubernetes the downward API's \
                 spec.nodeName), or use --dev"
                    .into(),
            ));
        }
    };
    flock_core::pod::check_node_name(&name).map_err(OptionsError)?;
    Ok(name)
}

/// The node's capture settings from the `--capture*` flags; an error names the flag
/// and the value.
fn node_capture(flags: &Flags) -> Result<NodeCapture, OptionsError> {
    let setting: Setting = flags
        .capture
        .parse()
        .map_err(|e| OptionsError(format!("--capture: {e}")))?;
    let mut node = NodeCapture {
        setting,
        enforce: flags.capture_enforce,
        ..NodeCapture::default()
    };
    fn flag(name: &'static str) -> impl Fn(String) -> OptionsError {
        move |e| OptionsError(format!("{name}: {e}"))
    }
    for v in &flags.capture_probe_sources {
        node.probe_sources
            .extend(parse_cidr_list(v).map_err(flag("--capture-probe-source"))?);
    }
    if node.setting != Setting::Off {
        node.probe_cgroups = flock_capture::probe_cgroups(&flags.capture_probe_cgroups)
            .map_err(|e| OptionsError(format!("--capture-probe-cgroup: {e}")))?;
    } else if !flags.capture_probe_cgroups.is_empty() {
        return Err(OptionsError(
            "--capture-probe-cgroup: capture is off (--capture strict or permissive)".into(),
        ));
    }
    for v in &flags.capture_exclude_outbound_ports {
        node.exclude_outbound_ports
            .extend(parse_port_list(v).map_err(flag("--capture-exclude-outbound-ports"))?);
    }
    for v in &flags.capture_exclude_outbound_cidrs {
        node.exclude_outbound_cidrs
            .extend(parse_cidr_list(v).map_err(flag("--capture-exclude-outbound-cidrs"))?);
    }
    for v in &flags.capture_exclude_inbound_ports {
        node.exclude_inbound_ports
            .extend(parse_port_list(v).map_err(flag("--capture-exclude-inbound-ports"))?);
    }
    for v in &flags.capture_allow_proxyless_ports {
        node.allow_proxyless_ports
            .extend(parse_port_list(v).map_err(flag("--capture-allow-proxyless-ports"))?);
    }
    node.validate().map_err(OptionsError)?;
    Ok(node)
}

/// Kube mode's settings, when on: --kube or --kubeconfig; off with --no-kube or, outside
/// a cluster, by default. The environment never chooses: an agent in a cluster
/// (`in_cluster`: `KUBERNETES_SERVICE_HOST` set) that silently fell back to annotations
/// would let any pod author pick its identity, and one that silently switched to the
/// API because a variable leaked into its environment would change whom it trusts.
fn kube_options(flags: &Flags, in_cluster: bool) -> Result<Option<KubeOptions>, OptionsError> {
    let on = flags.kube || flags.kubeconfig.is_some();
    if !on && !flags.no_kube && in_cluster {
        return Err(OptionsError(
            "running in a Kubernetes cluster (KUBERNETES_SERVICE_HOST is set) without a \
             choice of where pod facts come from: pass --kube (the API server: identities \
             from service accounts) or --no-kube (pod annotations, which anyone who can \
             create a pod writes)"
                .into(),
        ));
    }
    let endpoint_labels = endpoint_label_keys(&flags.endpoint_labels)?;
    Ok(on.then(|| KubeOptions {
        kubeconfig: flags.kubeconfig.clone(),
        pod_wait: flags.kube_pod_wait,
        endpoint_labels,
        remove_startup_taint: flags.remove_startup_taint,
        cni_ready_file: flags.cni_ready_file.clone(),
        repair: if flags.repair == "delete" {
            crate::repair::RepairMode::Delete
        } else {
            crate::repair::RepairMode::Report
        },
    }))
}

/// The capabilities binding the listeners needs with these flags (none by default).
fn bind_time_capabilities(flags: &Flags) -> Vec<Capability> {
    let mut caps = Vec::new();
    if flags.envoy_uid.is_some() || flags.xds_socket_group.is_some() {
        caps.push(Capability::CAP_CHOWN);
    }
    let privileged = |port: u16| port != 0 && port < 1024;
    if privileged(flags.admin_address.port())
        || flags.xds_address.is_some_and(|a| privileged(a.port()))
    {
        caps.push(Capability::CAP_NET_BIND_SERVICE);
    }
    caps
}

/// The mTLS xDS listener from the flags: all of --xds-address and the three TLS files,
/// or none of them; never plaintext.
fn xds_tls(flags: &Flags) -> Result<Option<XdsTls>, OptionsError> {
    let files = (
        &flags.xds_tls_cert,
        &flags.xds_tls_key,
        &flags.xds_tls_client_ca,
    );
    match (flags.xds_address, files) {
        (None, (None, None, None)) => Ok(None),
        (Some(address), (Some(cert), Some(key), Some(client_ca))) => {
            check_listen_addr("--xds-address", address, flags.allow_non_loopback)
                .map_err(OptionsError)?;
            Ok(Some(XdsTls {
                address,
                cert: cert.clone(),
                key: key.clone(),
                client_ca: client_ca.clone(),
            }))
        }
        (Some(address), _) => Err(OptionsError(format!(
            "--xds-address {address}: xDS over TCP needs mTLS (--xds-tls-cert, --xds-tls-key \
             and --xds-tls-client-ca): a plaintext TCP peer has no identity, and the xDS \
             server hands out workload keys. The node's Envoy uses the unix socket \
             (--xds-socket)"
        ))),
        (None, _) => Err(OptionsError(
            "--xds-tls-cert/--xds-tls-key/--xds-tls-client-ca need --xds-address (and all three)"
                .into(),
        )),
    }
}

/// `--registry-ca/--registry-cert/--registry-key`: TLS to etcd (etcds://). Whether a
/// client certificate has its key is [`crate::registry::load_tls`]'s rule.
fn registry_tls(flags: &Flags) -> Result<Option<crate::registry::EtcdTls>, OptionsError> {
    match (&flags.registry_ca, &flags.registry_cert, &flags.registry_key) {
        (None, None, None) => Ok(None),
        (Some(ca), cert, key) => crate::registry::load_tls(ca, cert.as_deref(), key.as_deref())
            .map(Some)
            .map_err(OptionsError),
        (None, _, _) => Err(OptionsError(
            "--registry-cert/--registry-key need --registry-ca (the CA of etcd's server certificate)"
                .into(),
        )),
    }
}

/// `--registry-scope`: read and parsed here, so a bad file stops the agent at start
/// with the line at fault; only etcd registries have other nodes' entries to check.
fn registry_scope(
    flags: &Flags,
) -> Result<Option<std::sync::Arc<flock_core::issuance::Scope>>, OptionsError> {
    let Some(path) = &flags.registry_scope else {
        return Ok(None);
    };
    if !(flags.registry.starts_with("etcd://") || flags.registry.starts_with("etcds://")) {
        return Err(OptionsError(format!(
            "--registry-scope applies to etcd registries (etcd:// or etcds://), not --registry {}: \
             the other backends hold no entries written by other nodes",
            flags.registry
        )));
    }
    let text = std::fs::read(path)
        .map_err(|e| OptionsError(format!("--registry-scope {}: {e}", path.display())))?;
    if text.len() > flock_core::issuance::MAX_SCOPE_BYTES {
        return Err(OptionsError(format!(
            "--registry-scope {}: {} bytes, at most {} allowed",
            path.display(),
            text.len(),
            flock_core::issuance::MAX_SCOPE_BYTES
        )));
    }
    let text = String::from_utf8(text)
        .map_err(|_| OptionsError(format!("--registry-scope {}: not UTF-8", path.display())))?;
    flock_core::issuance::parse_scope(&text)
        .map(|s| Some(std::sync::Arc::new(s)))
        .map_err(|e| OptionsError(format!("--registry-scope {}: {e}", path.display())))
}

/// `--registry-user/--registry-password-file`: etcd user authentication.
fn registry_auth(flags: &Flags) -> Result<Option<crate::registry::EtcdAuth>, OptionsError> {
    match (&flags.registry_user, &flags.registry_password_file) {
        (None, None) => Ok(None),
        (Some(user), Some(file)) => crate::registry::load_auth(user, file)
            .map(Some)
            .map_err(OptionsError),
        _ => Err(OptionsError(
            "--registry-user and --registry-password-file go together".into(),
        )),
    }
}

/// `--identity` with `--ca-dir` (which only the built-in CA takes).
fn identity_source(flags: &Flags) -> Result<IdentitySource, OptionsError> {
    let mut source = IdentitySource::parse(
        &flags.identity,
        &flags.trust_domain,
        Duration::from_secs(flags.svid_ttl),
    )
    .map_err(OptionsError)?;
    match (&mut source, &flags.node_credential) {
        (
            IdentitySource::FlockCa {
                credential_dir,
                server_name,
                ..
            },
            Some(dir),
        ) => {
            credential_dir.clone_from(dir);
            server_name.clone_from(&flags.ca_server_name);
        }
        (IdentitySource::FlockCa { .. }, None) => {
            return Err(OptionsError(
                "--identity flock-ca:... needs --node-credential DIR (this node's credential; \
                 `flock-ca node-credential` makes one)"
                    .into(),
            ));
        }
        (_, Some(dir)) => {
            return Err(OptionsError(format!(
                "--node-credential {}: only --identity flock-ca:... takes a node credential",
                dir.display()
            )));
        }
        (_, None) => {}
    }
    match (&mut source, &flags.ca_dir) {
        (IdentitySource::Builtin { ca_dir, .. }, dir) => ca_dir.clone_from(dir),
        (_, Some(dir)) => {
            return Err(OptionsError(format!(
                "--ca-dir {}: only the built-in CA (--identity builtin) takes an issuer from a directory",
                dir.display()
            )));
        }
        (_, None) => {}
    }
    Ok(source)
}

/// Who may use xDS: on the socket the agent's own euid, --envoy-uid and the allow-lists;
/// on mTLS the listed Envoy SPIFFE IDs and the trust domain's gRPC clients.
fn access_policy(flags: &Flags, euid: u32) -> AccessPolicy {
    let mut allow_uids: std::collections::BTreeSet<u32> =
        flags.xds_allow_uids.iter().copied().collect();
    allow_uids.insert(euid);
    allow_uids.extend(flags.envoy_uid);
    AccessPolicy {
        allow_uids,
        allow_gids: flags.xds_allow_gids.iter().copied().collect(),
        trust_domain: flags.trust_domain.clone(),
        envoy_spiffe_ids: flags.xds_envoy_spiffe_ids.iter().cloned().collect(),
    }
}

#[cfg(test)]
mod tests;

/// `--endpoint-labels`, checked: label keys, at most [`flock_core::labels::MAX_LABELS`].
fn endpoint_label_keys(keys: &[String]) -> Result<Vec<String>, OptionsError> {
    let keys: Vec<String> = keys
        .iter()
        .map(|k| k.trim().to_string())
        .filter(|k| !k.is_empty())
        .collect();
    if keys.len() > flock_core::labels::MAX_LABELS {
        return Err(OptionsError(format!(
            "--endpoint-labels: {} keys, more than {}",
            keys.len(),
            flock_core::labels::MAX_LABELS
        )));
    }
    for k in &keys {
        flock_core::labels::check_key(k)
            .map_err(|e| OptionsError(format!("--endpoint-labels: {e}")))?;
    }
    Ok(keys)
}
