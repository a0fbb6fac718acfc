//! `flock-agent`: the flock node agent (pod store, CNI server, registry, liveness, orphan GC, xDS).

use anyhow::Context as _;
use clap::Parser;
use flock_bird::agent::AgentConfig;
use flock_bird::runtime::{
    self, IdentitySource, KubeOptions, Options, XdsLimits, XdsSocket, XdsTls,
};
use flock_core::access::{AccessPolicy, check_listen_addr};
use flock_core::capture::policy::{NodeCapture, Setting};
use std::io::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The flock node agent: runs beside a node-local Envoy on every node.
///
/// The chained CNI plugin (flock-cni) reports pod sandboxes on --cni-socket; pods with
/// a `flock.io/service` annotation are stored durably in --state-dir, registered in the
/// shared --registry, probed for liveness, and served to the node's Envoy over xDS on
/// the unix socket --xds-socket (and, with mTLS, to proxyless gRPC clients on
/// --xds-address). Pods without the annotation are ignored. An orphan GC removes what
/// crashed operations or missed CNI DELs leave.
///
/// In a Kubernetes cluster (or with --kube) the pods' facts come from the Kubernetes
/// API instead of annotations: opt-in by the `flock.io/mesh: enabled` label, identity
/// from the service account, ports from the containers, memberships from Services (see
/// --kube).
///
/// Every meshed pod gets a SPIFFE identity from --identity (by default a node-local
/// CA), delivered to Envoy over SDS: pods talk mTLS. Only an authenticated peer gets
/// anything over xDS, and only the node's Envoy gets keys: on the unix socket a peer
/// is identified by its uid (the agent's own, --envoy-uid, --xds-allow-uid/-gid), on
/// TCP by its client certificate.
///
/// Start Envoy with the bootstrap `flock-agent [FLAGS] envoy-bootstrap` prints.
///
/// Try it: `flock-agent --dev` (everything in a temporary directory, on loopback,
/// with the embedded registry and mTLS), then `flockctl snapshot`.
/// `--store-sync`: the pod store's [`Durability`](flock_bird::store::Durability).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum StoreSync {
    /// Survives the agent's crash (no flush).
    Crash,
    /// Survives a power loss (fsync the file and the directory).
    PowerLoss,
}

impl From<StoreSync> for flock_bird::store::Durability {
    fn from(s: StoreSync) -> Self {
        match s {
            StoreSync::Crash => flock_bird::store::Durability::ProcessCrash,
            StoreSync::PowerLoss => flock_bird::store::Durability::PowerLoss,
        }
    }
}

#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Args {
    #[command(subcommand)]
    command: Option<Command>,
    /// This node's name: owner of its registry endpoints and Envoy's node id. A
    /// DNS-1123 subdomain (a-z 0-9 - ., at most 253), unique per node; required (in
    /// Kubernetes set $FLOCK_NODE_NAME from spec.nodeName). With --dev: `flock-dev`.
    #[arg(long, env = "FLOCK_NODE_NAME", value_name = "NAME", global = true)]
    node_name: Option<String>,
    /// Pod store directory (one 0600 file per pod).
    #[arg(long, default_value = "/var/lib/flock", value_name = "DIR")]
    state_dir: PathBuf,
    /// What a pod store write survives before the agent answers the CNI plugin.
    /// `crash`: the agent's crash, kill or restart (write and rename, no flush); enough
    /// for pod sandboxes, which do not survive the node's reboot either (the records of
    /// the old ones are orphans that GC removes). `power-loss`: also a power loss or
    /// kernel crash (fsync the file and the directory: about 0.5 ms more per CNI ADD and
    /// DEL).
    #[arg(long, value_enum, default_value_t = StoreSync::Crash, value_name = "WHAT")]
    store_sync: StoreSync,
    /// The CNI plugin's socket (created 0600; flock-cni's `agent_socket`).
    #[arg(long, default_value = "/run/flock/cni.sock", value_name = "PATH")]
    cni_socket: PathBuf,
    /// Serve xDS (ADS, SotW and Delta) to the node's Envoy on this unix socket, in a
    /// directory the agent owns (created 0700; never group- or other-writable). The
    /// socket is 0600, so only the agent's uid (and --envoy-uid) can connect
    /// [default: /run/flock/xds.sock; with --dev, in the temporary directory].
    #[arg(long, value_name = "PATH", global = true)]
    xds_socket: Option<PathBuf>,
    /// The uid Envoy runs as: allowed on the xDS socket, which is chowned to it (mode
    /// 0600) and its directory made traversable (0711) so Envoy can reach it.
    #[arg(long, value_name = "UID")]
    envoy_uid: Option<u32>,
    /// Also allow unix peers with this uid on the xDS socket (repeatable). The socket's
    /// file mode still decides who can open it: use with --xds-socket-group.
    #[arg(long = "xds-allow-uid", value_name = "UID")]
    xds_allow_uids: Vec<u32>,
    /// Allow unix peers whose gid is this on the xDS socket (repeatable).
    #[arg(long = "xds-allow-gid", value_name = "GID")]
    xds_allow_gids: Vec<u32>,
    /// Give the xDS socket to this group, mode 0660 (its directory 0711), so processes
    /// of that group can open it; they must still pass --xds-allow-uid/--xds-allow-gid.
    #[arg(long, value_name = "GID")]
    xds_socket_group: Option<u32>,
    /// Also serve xDS on this TCP address, with mTLS only: needs --xds-tls-cert,
    /// --xds-tls-key and --xds-tls-client-ca (plaintext TCP xDS is refused). A client
    /// certificate whose SPIFFE ID is in --trust-domain gets the proxyless gRPC
    /// resources, never secrets; one listed in --xds-envoy-spiffe-id gets Envoy's. A
    /// non-loopback address needs --allow-non-loopback.
    #[arg(long, value_name = "HOST:PORT")]
    xds_address: Option<SocketAddr>,
    /// PEM certificate chain of the mTLS xDS listener.
    #[arg(long, value_name = "PATH")]
    xds_tls_cert: Option<PathBuf>,
    /// PEM private key of the mTLS xDS listener (read into memory wiped on drop).
    #[arg(long, value_name = "PATH")]
    xds_tls_key: Option<PathBuf>,
    /// PEM CA bundle that xDS client certificates must chain to.
    #[arg(long, value_name = "PATH")]
    xds_tls_client_ca: Option<PathBuf>,
    /// An mTLS xDS client with exactly this SPIFFE ID is an Envoy of this node: Envoy
    /// resources with secrets (repeatable).
    #[arg(long = "xds-envoy-spiffe-id", value_name = "SPIFFE_ID")]
    xds_envoy_spiffe_ids: Vec<String>,
    /// Open xDS connections at once, across the xDS listeners; one more is closed at
    /// once and counted.
    #[arg(long, default_value_t = 1024, value_name = "N")]
    xds_max_connections: usize,
    /// Concurrent xDS streams per connection (HTTP/2 MAX_CONCURRENT_STREAMS).
    #[arg(long, default_value_t = 100, value_name = "N")]
    xds_max_streams: u32,
    /// Open xDS streams at once, across every connection and listener; one more gets
    /// RESOURCE_EXHAUSTED at once (a node-local Envoy uses one).
    #[arg(long, default_value_t = 4096, value_name = "N")]
    xds_max_open_streams: usize,
    /// An xDS stream whose first request does not arrive within this many seconds ends
    /// with DEADLINE_EXCEEDED.
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    xds_first_request_timeout: u64,
    /// Admin endpoint: /healthz /readyz /metrics /debug/pods /debug/snapshot
    /// /debug/registry (no authentication: keep it on loopback). A non-loopback address
    /// needs --allow-non-loopback.
    #[arg(long, default_value = "127.0.0.1:18090", value_name = "HOST:PORT")]
    admin_address: SocketAddr,
    /// Admin connections served at once; further clients wait in the listen backlog.
    #[arg(long, default_value_t = flock_bird::admin::server::DEFAULT_MAX_CONNECTIONS, value_name = "N")]
    admin_max_connections: usize,
    /// Allow --admin-address and --xds-address on non-loopback addresses (reachable from
    /// other hosts and from hostNetwork pods).
    #[arg(long)]
    allow_non_loopback: bool,
    /// Where endpoints are shared: `memory` (embedded, single node), `file:PATH`
    /// (embedded, persisted), `etcd://HOST:PORT[,HOST:PORT]` (multi-node, plaintext) or
    /// `etcds://HOST:PORT[,HOST:PORT]` (multi-node over TLS: needs --registry-ca). Each
    /// agent's endpoints live on its lease and expire if it dies; keys are
    /// `/flock/endpoints/<node>/...`, so etcd RBAC can confine each agent to its node's
    /// prefix (docs/registry-security.md).
    #[arg(long, default_value = "memory", value_name = "SPEC")]
    registry: String,
    /// Lease TTL of this agent's etcd registrations, seconds.
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    registry_ttl: i64,
    /// etcds:// only: PEM CA bundle that verifies etcd's server certificate.
    #[arg(long, value_name = "FILE", help_heading = "Registry security")]
    registry_ca: Option<PathBuf>,
    /// etcds:// only: PEM client certificate for etcd (`--client-cert-auth`); with etcd
    /// auth on and no --registry-user, etcd takes its CN as the user. Needs --registry-key.
    #[arg(long, value_name = "FILE", help_heading = "Registry security")]
    registry_cert: Option<PathBuf>,
    /// etcds:// only: PEM private key of --registry-cert.
    #[arg(long, value_name = "FILE", help_heading = "Registry security")]
    registry_key: Option<PathBuf>,
    /// etcds:// only: etcd user (etcd auth); give its password with --registry-password-file.
    #[arg(long, value_name = "USER", help_heading = "Registry security")]
    registry_user: Option<String>,
    /// File holding the password of --registry-user (a file, not a flag: command lines
    /// show in `ps`).
    #[arg(long, value_name = "FILE", help_heading = "Registry security")]
    registry_password_file: Option<PathBuf>,
    /// Where pods' workload identities come from: `builtin` (a node-local CA; mTLS
    /// between pods), `spire:PATH` (a SPIRE agent's Delegated Identity API on its admin
    /// socket PATH), `none` (plaintext).
    #[arg(long, default_value = "builtin", value_name = "SOURCE")]
    identity: String,
    /// SPIFFE trust domain of the built-in CA's SVIDs (`spiffe://DOMAIN/ns/NAMESPACE/sa/ACCOUNT`),
    /// and of the mTLS xDS clients served as proxyless gRPC.
    #[arg(long, default_value = "cluster.local", value_name = "DOMAIN")]
    trust_domain: String,
    /// The built-in CA's issuer under a shared root, so that nodes trust each other's
    /// SVIDs (cross-node mTLS): a directory in the layout of a Kubernetes Secret like
    /// Istio's `cacerts` — ca-cert.pem (this node's issuer), ca-key.pem (PKCS#8),
    /// cert-chain.pem (issuer → root; optional), root-cert.pem (the trusted roots, one
    /// or more). Checked whole at start (the agent refuses to start on a bad set) and
    /// re-read when it changes: a valid new set re-issues every SVID, a bad one is
    /// refused with a warning and the old kept. `flock-agent ca init` / `ca issue` make
    /// one. Without it: a node-local CA, trusted on this node only.
    #[arg(long, value_name = "DIR")]
    ca_dir: Option<PathBuf>,
    /// Lifetime of the built-in CA's SVIDs, seconds; each is renewed at half its lifetime.
    #[arg(long, default_value_t = 3600, value_name = "SECS")]
    svid_ttl: u64,
    /// Zone of this node's endpoints (EDS locality).
    #[arg(long, default_value = "", value_name = "ZONE")]
    zone: String,
    /// Region of this node's endpoints (EDS locality).
    #[arg(long, default_value = "", value_name = "REGION")]
    region: String,
    /// Liveness probe interval per pod, milliseconds.
    #[arg(long, default_value_t = 5000, value_name = "MS")]
    probe_interval_ms: u64,
    /// Orphan GC period, seconds.
    #[arg(long, default_value_t = 60, value_name = "SECS")]
    gc_interval: u64,
    /// Envoy's cluster name in the bootstrap (`envoy-bootstrap`).
    #[arg(long, default_value = "flock", value_name = "NAME", global = true)]
    envoy_cluster: String,
    /// Envoy's admin port in the bootstrap (`envoy-bootstrap`), on 127.0.0.1.
    #[arg(long, default_value_t = 15000, value_name = "PORT", global = true)]
    envoy_admin_port: u16,
    /// Try-it-out mode: state, CNI and xDS sockets in a fresh temporary directory, the
    /// embedded in-memory registry (the `--registry` default), everything on loopback,
    /// node name `flock-dev` unless --node-name is given; the Envoy bootstrap is
    /// written into the directory (its path is logged). Explicit flags still win for
    /// the registry and addresses.
    #[arg(long)]
    dev: bool,
    /// Also keep this Linux capability after start (repeatable; e.g. CAP_SYS_PTRACE
    /// when the runtime passes /proc/PID/ns/net paths). The agent keeps only
    /// CAP_SYS_ADMIN (liveness probes enter pods' network namespaces) and drops every
    /// other capability once its listeners are bound.
    #[arg(long = "keep-capability", value_name = "CAP", value_parser = harden::parse_capability)]
    keep_capabilities: Vec<caps::Capability>,
    /// Kube mode: every fact about a pod from the Kubernetes API, none from annotations.
    /// A pod is meshed when its namespace or itself has the label `flock.io/mesh:
    /// enabled` (a pod label `flock.io/mesh: disabled` opts out); its identity is its
    /// `spec.serviceAccountName`, its ports its containers' TCP ports, and it registers
    /// under every Service of its namespace that selects it (followed live as labels
    /// and Services change). The annotations flock.io/service, flock.io/ports and
    /// flock.io/service-account are ignored. A CNI ADD fails when the API cannot be
    /// asked (the agent refuses to guess an identity). On by default when the agent
    /// runs in a cluster (`KUBERNETES_SERVICE_HOST` is set) — annotations there could
    /// be written by anyone who can create a pod — and with --kubeconfig; off with
    /// --no-kube.
    #[arg(long, help_heading = "Kubernetes")]
    kube: bool,
    /// Turn kube mode off even in a cluster: pods are meshed by their annotations.
    #[arg(long, conflicts_with_all = ["kube", "kubeconfig"], help_heading = "Kubernetes")]
    no_kube: bool,
    /// Kube mode: the kubeconfig to reach the API with (implies --kube) [default: the
    /// in-cluster configuration: the pod's service-account token].
    #[arg(long, value_name = "PATH", help_heading = "Kubernetes")]
    kubeconfig: Option<PathBuf>,
    /// Kube mode: how long a CNI ADD waits for its pod to appear in the agent's watch
    /// before asking the API directly (`500ms`, `2s`, or seconds). The API then has
    /// 2.5 s more to answer; keep the sum under flock-cni's `timeout_ms` (5 s by
    /// default), so a failed ADD carries the agent's reason.
    #[arg(long, default_value = "2s", value_name = "DURATION", value_parser = parse_duration, help_heading = "Kubernetes")]
    kube_pod_wait: Duration,
    /// Kube mode: remove the startup taint flock.io/agent-not-ready:NoSchedule from
    /// this node's Node once the node is ready (store loaded, CNI socket bound,
    /// --cni-ready-file present if given, the first snapshot ACKed by an Envoy). Other
    /// taints are kept. Register nodes with kubelet
    /// `--register-with-taints=flock.io/agent-not-ready=:NoSchedule` so that no pod is
    /// scheduled before. On by default in kube mode; `--remove-startup-taint=false`
    /// turns it off.
    #[arg(long, value_name = "BOOL", num_args = 0..=1, default_value_t = true, default_missing_value = "true", action = clap::ArgAction::Set, help_heading = "Kubernetes")]
    remove_startup_taint: bool,
    /// Kube mode: the CNI installer's ready file (flock-install-cni --ready-file); the
    /// startup taint stays until it exists.
    #[arg(long, value_name = "PATH", help_heading = "Kubernetes")]
    cni_ready_file: Option<PathBuf>,
    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
    /// Transparent capture of meshed pods' TCP traffic: nftables rules in each pod's
    /// network namespace (installed before the CNI ADD is answered) send the apps'
    /// outbound connections to Envoy's listener (port 15001, routed by original
    /// destination; destinations outside the mesh pass through) and inbound
    /// connections to the app ports through Envoy's inbound listeners. `off` (the
    /// default): no rules, apps call Envoy's outbound listener explicitly, and the xDS
    /// output is the same as without this flag. `strict`: inbound listeners take mTLS
    /// only, and a plaintext connection that escaped the redirect is dropped.
    /// `permissive`: plaintext callers (not meshed yet) still reach the app, through
    /// Envoy. A pod's `flock.io/capture: off|strict|permissive` annotation overrides
    /// this (in kube mode the Pod's annotation), but no pod is captured while this is
    /// `off`: a pod asking for capture then is refused. Not `off`: the agent checks at
    /// start that `nft` and the kernel's nf_tables work (exits with the cause if not),
    /// and keeps CAP_NET_ADMIN. UDP (DNS included) is never captured.
    #[arg(long, default_value = "off", value_name = "MODE", value_parser = ["off", "strict", "permissive"], help_heading = "Transparent capture")]
    capture: String,
    /// A source address or prefix whose connections reach captured pods' apps directly,
    /// not through Envoy: where kubelet's liveness and readiness probes come from
    /// (repeatable; a comma list works too). Default: the gateway address(es) of each
    /// pod's interfaces in the CNI result — the node's own address on the pod network,
    /// which is where kubelet's probes come from. Set it when probes come from
    /// elsewhere (e.g. the node's primary IP with a routed pod network).
    #[arg(
        long = "capture-probe-source",
        value_name = "CIDR",
        help_heading = "Transparent capture"
    )]
    capture_probe_sources: Vec<String>,
    /// Destination ports (comma list, e.g. `5432,6379`) captured pods' apps reach
    /// directly, not through Envoy (node-wide; a pod's
    /// `flock.io/capture-exclude-outbound-ports` adds to it). Repeatable.
    #[arg(long, value_name = "PORTS", help_heading = "Transparent capture")]
    capture_exclude_outbound_ports: Vec<String>,
    /// Destination prefixes (comma list, e.g. `169.254.169.254/32,10.0.0.0/8`) captured
    /// pods' apps reach directly (node-wide; a pod's
    /// `flock.io/capture-exclude-outbound-cidrs` adds to it). Repeatable.
    #[arg(long, value_name = "CIDRS", help_heading = "Transparent capture")]
    capture_exclude_outbound_cidrs: Vec<String>,
    /// App ports (comma list) whose inbound connections are not captured: callers
    /// reach the app directly (node-wide; a pod's
    /// `flock.io/capture-exclude-inbound-ports` adds to it). Repeatable.
    #[arg(long, value_name = "PORTS", help_heading = "Transparent capture")]
    capture_exclude_inbound_ports: Vec<String>,
}

/// The node's capture settings from the `--capture*` flags; an error names the flag
/// and the value.
fn node_capture(args: &Args) -> anyhow::Result<NodeCapture> {
    use flock_core::capture::policy::{parse_cidr_list, parse_port_list};
    let setting: Setting = args
        .capture
        .parse()
        .map_err(|e| anyhow::anyhow!("--capture: {e}"))?;
    let mut node = NodeCapture {
        setting,
        ..NodeCapture::default()
    };
    for v in &args.capture_probe_sources {
        node.probe_sources.extend(
            parse_cidr_list(v).map_err(|e| anyhow::anyhow!("--capture-probe-source: {e}"))?,
        );
    }
    for v in &args.capture_exclude_outbound_ports {
        node.exclude_outbound_ports.extend(
            parse_port_list(v)
                .map_err(|e| anyhow::anyhow!("--capture-exclude-outbound-ports: {e}"))?,
        );
    }
    for v in &args.capture_exclude_outbound_cidrs {
        node.exclude_outbound_cidrs.extend(
            parse_cidr_list(v)
                .map_err(|e| anyhow::anyhow!("--capture-exclude-outbound-cidrs: {e}"))?,
        );
    }
    for v in &args.capture_exclude_inbound_ports {
        node.exclude_inbound_ports.extend(
            parse_port_list(v)
                .map_err(|e| anyhow::anyhow!("--capture-exclude-inbound-ports: {e}"))?,
        );
    }
    node.validate().map_err(|e| anyhow::anyhow!(e))?;
    Ok(node)
}

/// `500ms`, `2s` or `2` (seconds).
fn parse_duration(s: &str) -> Result<Duration, String> {
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

/// Kube mode's settings, when on: --kube or --kubeconfig, or in a cluster
/// (`in_cluster`: `KUBERNETES_SERVICE_HOST` set) unless --no-kube.
fn kube_options(args: &Args, in_cluster: bool) -> Option<KubeOptions> {
    let on = !args.no_kube && (args.kube || args.kubeconfig.is_some() || in_cluster);
    on.then(|| KubeOptions {
        kubeconfig: args.kubeconfig.clone(),
        pod_wait: args.kube_pod_wait,
        remove_startup_taint: args.remove_startup_taint,
        cni_ready_file: args.cni_ready_file.clone(),
    })
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Print the Envoy bootstrap (JSON) matching these flags: ADS (Delta xDS) over the
    /// --xds-socket unix socket (Envoy's `pipe` address), node id = --node-name, cluster
    /// --envoy-cluster, admin on 127.0.0.1:--envoy-admin-port. Example:
    /// `flock-agent --node-name "$NODE" envoy-bootstrap > envoy.json`.
    EnvoyBootstrap,
    /// Make a shared trust root for --ca-dir: `ca init` (a root CA), `ca issue` (a node
    /// issuer signed by it, in the --ca-dir layout).
    #[command(subcommand)]
    Ca(ca::CaCommand),
}

/// The default --xds-socket.
const DEFAULT_XDS_SOCKET: &str = "/run/flock/xds.sock";
/// The --dev node name.
const DEV_NODE_NAME: &str = "flock-dev";

/// The node name: --node-name / $FLOCK_NODE_NAME, `flock-dev` under --dev; validated.
fn node_name(args: &Args) -> anyhow::Result<String> {
    let name = match (&args.node_name, args.dev) {
        (Some(name), _) => name.clone(),
        (None, true) => DEV_NODE_NAME.to_string(),
        (None, false) => anyhow::bail!(
            "no node name: set --node-name or $FLOCK_NODE_NAME to this node's name (a \
             DNS-1123 subdomain, unique per node; in Kubernetes the downward API's \
             spec.nodeName), or use --dev"
        ),
    };
    flock_core::pod::check_node_name(&name).map_err(|e| anyhow::anyhow!(e))?;
    Ok(name)
}

mod ca;
mod harden;

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    if let Some(Command::EnvoyBootstrap) = args.command {
        return match print_bootstrap(&args) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("flock-agent envoy-bootstrap: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    if let Some(Command::Ca(cmd)) = &args.command {
        return match ca::run(cmd) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("flock-agent ca: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    flock_telemetry::logging::init(args.log_format.parse().unwrap_or_default());
    if flock_clock::CLOCK_FAULT_COMPILED {
        // Only test builds have it (flock-clock's `clock-fault` feature, enabled by this
        // crate's dev-dependencies): say so loudly if one is ever run for real.
        tracing::warn!(
            offset_file = ?std::env::var_os(flock_clock::CLOCK_FAULT_ENV),
            "built with the test-only clock-fault hook: the wall clock may be offset by {}",
            flock_clock::CLOCK_FAULT_ENV
        );
    }
    // No core dumps and no ptrace by other processes of our uid: the agent's memory
    // holds every workload key of the node.
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!("prctl(PR_SET_DUMPABLE, 0) failed: {e}");
    }
    let capture = match node_capture(&args) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("flock-agent: {e:#}");
            return std::process::ExitCode::FAILURE;
        }
    };
    // Capture changes pods' nftables: `nft`, run in their network namespaces, needs
    // CAP_NET_ADMIN (entering them needs CAP_SYS_ADMIN, always kept).
    let mut keep = args.keep_capabilities.clone();
    if capture.setting != Setting::Off {
        keep.push(caps::Capability::CAP_NET_ADMIN);
    }
    // Before the runtime starts any thread: every later thread inherits this.
    harden::drop_early(&keep, &bind_time_capabilities(&args));
    if capture.setting != Setting::Off {
        // With the capabilities the agent will run with: a host that cannot install the
        // rules must not start meshing pods whose ADD would then fail one by one.
        if let Err(e) = flock_bird::flock_capture::probe() {
            tracing::error!("--capture {}: {e}", capture.setting);
            eprintln!(
                "flock-agent: --capture {} needs nftables on this host: {e}",
                capture.setting
            );
            return std::process::ExitCode::FAILURE;
        }
        tracing::info!(mode = %capture.setting, probe_sources = ?capture.probe_sources, "transparent capture on: nftables probe passed");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // Capabilities are per thread: each worker applies the drop requested after
        // the listeners are bound at its next park or unpark (see `harden`).
        .on_thread_park(harden::apply_pending_drop)
        .on_thread_unpark(harden::apply_pending_drop)
        .build();
    let runtime = match runtime {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("flock-agent: starting the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("flock-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The capabilities binding the listeners needs with these flags (none by default).
fn bind_time_capabilities(args: &Args) -> Vec<caps::Capability> {
    let mut caps = Vec::new();
    if args.envoy_uid.is_some() || args.xds_socket_group.is_some() {
        caps.push(caps::Capability::CAP_CHOWN);
    }
    let privileged = |port: u16| port != 0 && port < 1024;
    if privileged(args.admin_address.port())
        || args.xds_address.is_some_and(|a| privileged(a.port()))
    {
        caps.push(caps::Capability::CAP_NET_BIND_SERVICE);
    }
    caps
}

fn print_bootstrap(args: &Args) -> anyhow::Result<()> {
    let node = node_name(args)?;
    let socket = match (&args.xds_socket, args.dev) {
        (Some(p), _) => p.clone(),
        (None, false) => PathBuf::from(DEFAULT_XDS_SOCKET),
        (None, true) => anyhow::bail!(
            "with --dev the xDS socket is in a fresh temporary directory: use the bootstrap \
             the agent wrote there (its path is in the agent's log), or pass --xds-socket"
        ),
    };
    let bootstrap =
        runtime::envoy_bootstrap(&node, &args.envoy_cluster, &socket, args.envoy_admin_port);
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string_pretty(&bootstrap)?)
        .and_then(|()| out.flush())
        .context("writing the bootstrap to stdout")
}

/// The mTLS xDS listener from the flags: all of --xds-address and the three TLS files,
/// or none of them; never plaintext.
fn xds_tls(args: &Args) -> anyhow::Result<Option<XdsTls>> {
    let files = (
        &args.xds_tls_cert,
        &args.xds_tls_key,
        &args.xds_tls_client_ca,
    );
    match (args.xds_address, files) {
        (None, (None, None, None)) => Ok(None),
        (Some(address), (Some(cert), Some(key), Some(client_ca))) => {
            check_listen_addr("--xds-address", address, args.allow_non_loopback)
                .map_err(|e| anyhow::anyhow!(e))?;
            Ok(Some(XdsTls {
                address,
                cert: cert.clone(),
                key: key.clone(),
                client_ca: client_ca.clone(),
            }))
        }
        (Some(address), _) => anyhow::bail!(
            "--xds-address {address}: xDS over TCP needs mTLS (--xds-tls-cert, --xds-tls-key \
             and --xds-tls-client-ca): a plaintext TCP peer has no identity, and the xDS \
             server hands out workload keys. The node's Envoy uses the unix socket \
             (--xds-socket)"
        ),
        (None, _) => anyhow::bail!(
            "--xds-tls-cert/--xds-tls-key/--xds-tls-client-ca need --xds-address (and all three)"
        ),
    }
}

/// `--registry-ca/--registry-cert/--registry-key`: TLS to etcd (etcds://).
fn registry_tls(args: &Args) -> anyhow::Result<Option<flock_bird::registry::EtcdTls>> {
    match (&args.registry_ca, &args.registry_cert, &args.registry_key) {
        (None, None, None) => Ok(None),
        (Some(ca), cert, key) => {
            flock_bird::registry::load_tls(ca, cert.as_deref(), key.as_deref())
                .map(Some)
                .map_err(|e| anyhow::anyhow!(e))
        }
        (None, _, _) => anyhow::bail!(
            "--registry-cert/--registry-key need --registry-ca (the CA of etcd's server certificate)"
        ),
    }
}

/// `--registry-user/--registry-password-file`: etcd user authentication.
fn registry_auth(args: &Args) -> anyhow::Result<Option<flock_bird::registry::EtcdAuth>> {
    match (&args.registry_user, &args.registry_password_file) {
        (None, None) => Ok(None),
        (Some(user), Some(file)) => flock_bird::registry::load_auth(user, file)
            .map(Some)
            .map_err(|e| anyhow::anyhow!(e)),
        _ => anyhow::bail!("--registry-user and --registry-password-file go together"),
    }
}

/// `--identity` with `--ca-dir` (which only the built-in CA takes).
fn identity_source(args: &Args) -> anyhow::Result<IdentitySource> {
    let mut source = IdentitySource::parse(
        &args.identity,
        &args.trust_domain,
        Duration::from_secs(args.svid_ttl),
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    match (&mut source, &args.ca_dir) {
        (IdentitySource::Builtin { ca_dir, .. }, dir) => ca_dir.clone_from(dir),
        (_, Some(dir)) => anyhow::bail!(
            "--ca-dir {}: only the built-in CA (--identity builtin) takes an issuer from a directory",
            dir.display()
        ),
        (_, None) => {}
    }
    Ok(source)
}

/// Who may use xDS: on the socket the agent's own euid, --envoy-uid and the allow-lists;
/// on mTLS the listed Envoy SPIFFE IDs and the trust domain's gRPC clients.
fn access_policy(args: &Args) -> AccessPolicy {
    let mut allow_uids: std::collections::BTreeSet<u32> =
        args.xds_allow_uids.iter().copied().collect();
    allow_uids.insert(nix::unistd::geteuid().as_raw());
    allow_uids.extend(args.envoy_uid);
    AccessPolicy {
        allow_uids,
        allow_gids: args.xds_allow_gids.iter().copied().collect(),
        trust_domain: args.trust_domain.clone(),
        envoy_spiffe_ids: args.xds_envoy_spiffe_ids.iter().cloned().collect(),
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let mut agent = AgentConfig::new(node_name(&args)?);
    agent.zone = args.zone.clone();
    agent.region = args.region.clone();
    agent.liveness.interval_ms = args.probe_interval_ms.max(100);
    agent.gc_interval = Duration::from_secs(args.gc_interval.max(1));
    agent.capture = node_capture(&args)?;
    // The scale benchmark's baseline only (not a flag: nobody should run it): every
    // publish rebuilds the whole mesh and its translation.
    agent.publish_from_scratch =
        std::env::var_os("FLOCK_PUBLISH_FROM_SCRATCH").is_some_and(|v| v == "1");
    check_listen_addr(
        "--admin-address",
        args.admin_address,
        args.allow_non_loopback,
    )
    .map_err(|e| anyhow::anyhow!(e))?;
    let xds_socket = args
        .xds_socket
        .clone()
        .unwrap_or_else(|| PathBuf::from(DEFAULT_XDS_SOCKET));
    let mut opts = Options {
        agent,
        state_dir: args.state_dir.clone(),
        store_durability: args.store_sync.into(),
        cni_socket: args.cni_socket.clone(),
        xds_socket: Some(XdsSocket {
            path: xds_socket,
            owner_uid: args.envoy_uid,
            group: args.xds_socket_group,
        }),
        xds_tls: xds_tls(&args)?,
        xds_access: access_policy(&args),
        xds_limits: XdsLimits {
            max_connections: args.xds_max_connections.max(1),
            max_streams_per_connection: args.xds_max_streams.max(1),
            first_request_timeout: Duration::from_secs(args.xds_first_request_timeout.max(1)),
            max_open_streams: args.xds_max_open_streams.max(1),
        },
        admin_address: args.admin_address,
        admin_max_connections: args.admin_max_connections,
        registry: args.registry.clone(),
        registry_ttl_secs: args.registry_ttl,
        registry_tls: registry_tls(&args)?,
        registry_auth: registry_auth(&args)?,
        identity: identity_source(&args)?,
        kube: kube_options(
            &args,
            std::env::var_os("KUBERNETES_SERVICE_HOST").is_some_and(|h| !h.is_empty()),
        ),
    };
    // Kept alive until exit: the --dev directory is removed when the agent stops.
    let _dev_dir = if args.dev {
        let dir = tempfile::Builder::new()
            .prefix("flock-dev-")
            .tempdir()
            .context("creating the --dev directory")?;
        opts.state_dir = dir.path().join("pods");
        opts.cni_socket = dir.path().join("cni.sock");
        let run_dir = dir.path().join("run");
        if let Some(socket) = opts
            .xds_socket
            .as_mut()
            .filter(|_| args.xds_socket.is_none())
        {
            socket.path = run_dir.join("xds.sock");
        }
        let xds_path = opts
            .xds_socket
            .as_ref()
            .map(|s| s.path.clone())
            .unwrap_or_default();
        let bootstrap = dir.path().join("envoy-bootstrap.json");
        let doc = runtime::envoy_bootstrap(
            &opts.agent.node_name,
            &args.envoy_cluster,
            &xds_path,
            args.envoy_admin_port,
        );
        std::fs::write(&bootstrap, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", bootstrap.display()))?;
        tracing::info!(
            dir = %dir.path().display(),
            cni_socket = %opts.cni_socket.display(),
            xds_socket = %xds_path.display(),
            admin = %args.admin_address,
            envoy_bootstrap = %bootstrap.display(),
            "--dev: state and sockets in a temporary directory; registry {}; start Envoy \
             with `envoy -c {}`",
            opts.registry,
            bootstrap.display()
        );
        Some(dir)
    } else {
        None
    };
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("SIGTERM handler");
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    };
    runtime::run(opts, shutdown, |bound| {
        tracing::info!(
            admin = %bound.admin,
            xds_socket = ?bound.xds_socket,
            xds_mtls = ?bound.xds,
            "flock-agent listening"
        );
        // Every listener is bound (the only step that may need CAP_NET_BIND_SERVICE or
        // CAP_CHOWN): from here on the agent keeps only what it uses while running.
        harden::drop_capabilities();
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(flags: &[&str]) -> Args {
        Args::try_parse_from(std::iter::once("flock-agent").chain(flags.iter().copied())).unwrap()
    }

    #[test]
    fn kube_mode_is_on_with_the_flag_the_kubeconfig_or_in_a_cluster_unless_refused() {
        assert_eq!(kube_options(&args(&[]), false), None);
        let on = kube_options(&args(&["--kube"]), false).unwrap();
        assert_eq!(on.kubeconfig, None);
        assert_eq!(on.pod_wait, Duration::from_secs(2));
        let with_config = kube_options(&args(&["--kubeconfig", "/k"]), false).unwrap();
        assert_eq!(with_config.kubeconfig, Some(PathBuf::from("/k")));
        assert!(kube_options(&args(&[]), true).is_some());
        assert_eq!(kube_options(&args(&["--no-kube"]), true), None);
        assert!(Args::try_parse_from(["flock-agent", "--kube", "--no-kube"]).is_err());
        let wait = kube_options(&args(&["--kube", "--kube-pod-wait", "500ms"]), false).unwrap();
        assert_eq!(wait.pod_wait, Duration::from_millis(500));
    }

    #[test]
    fn the_startup_taint_is_removed_by_default_in_kube_mode_unless_turned_off() {
        let on = kube_options(&args(&["--kube"]), false).unwrap();
        assert!(on.remove_startup_taint);
        assert_eq!(on.cni_ready_file, None);
        let bare = kube_options(&args(&["--kube", "--remove-startup-taint"]), false).unwrap();
        assert!(bare.remove_startup_taint);
        let off = kube_options(&args(&["--kube", "--remove-startup-taint=false"]), false).unwrap();
        assert!(!off.remove_startup_taint);
        let file = kube_options(&args(&["--kube", "--cni-ready-file", "/r"]), false).unwrap();
        assert_eq!(file.cni_ready_file, Some(PathBuf::from("/r")));
    }

    #[test]
    fn the_pod_store_survives_the_agents_crash_by_default_and_a_power_loss_on_request() {
        use flock_bird::store::Durability;
        let default: Durability = args(&[]).store_sync.into();
        assert_eq!(default, Durability::ProcessCrash);
        let power: Durability = args(&["--store-sync", "power-loss"]).store_sync.into();
        assert_eq!(power, Durability::PowerLoss);
        assert!(Args::try_parse_from(["flock-agent", "--store-sync", "never"]).is_err());
    }

    #[test]
    fn durations_take_ms_s_or_plain_seconds() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("3"), Ok(Duration::from_secs(3)));
        for bad in ["", "s", "-1s", "2m", "1.5s", "99999999999999999999s"] {
            assert!(parse_duration(bad).is_err(), "{bad:?}");
        }
    }
}
