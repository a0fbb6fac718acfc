//! `flock-agent`: the flock node agent (pod store, CNI server, registry, liveness, orphan GC, xDS).

use anyhow::Context as _;
use clap::Parser;
use flock_bird::agent::AgentConfig;
use flock_bird::runtime::{self, IdentitySource, Options};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

/// The flock node agent: runs beside a node-local Envoy on every node.
///
/// The chained CNI plugin (flock-cni) reports pod sandboxes on --cni-socket; pods with
/// a `flock.io/service` annotation are stored durably in --state-dir, registered in the
/// shared --registry, probed for liveness, and served to Envoy (and proxyless gRPC
/// clients) over xDS on --xds-address / --xds-socket. Pods without the annotation are
/// ignored. An orphan GC removes what crashed operations or missed CNI DELs leave.
///
/// Every meshed pod gets a SPIFFE identity from --identity (by default a node-local
/// CA), delivered to Envoy over SDS: pods talk mTLS.
///
/// Try it: `flock-agent --dev` (everything in a temporary directory, on loopback,
/// with the embedded registry and mTLS), then `flockctl snapshot`.
#[derive(Parser, Debug)]
#[command(version, about, long_about)]
struct Args {
    /// This node's name: owner of its registry endpoints [default: the host name].
    #[arg(long, env = "FLOCK_NODE_NAME", value_name = "NAME")]
    node_name: Option<String>,
    /// Pod store directory (one 0600 file per pod).
    #[arg(long, default_value = "/var/lib/flock", value_name = "DIR")]
    state_dir: PathBuf,
    /// The CNI plugin's socket (created 0600; flock-cni's `agent_socket`).
    #[arg(long, default_value = "/run/flock/cni.sock", value_name = "PATH")]
    cni_socket: PathBuf,
    /// Serve xDS (ADS, SotW and Delta) on this TCP address.
    #[arg(long, default_value = "127.0.0.1:18000", value_name = "HOST:PORT")]
    xds_address: SocketAddr,
    /// Also serve xDS on this unix socket (created 0600).
    #[arg(long, value_name = "PATH")]
    xds_socket: Option<PathBuf>,
    /// Admin endpoint: /healthz /readyz /metrics /debug/pods /debug/snapshot /debug/registry.
    #[arg(long, default_value = "127.0.0.1:18090", value_name = "HOST:PORT")]
    admin_address: SocketAddr,
    /// Where endpoints are shared: `memory` (embedded, single node), `file:PATH`
    /// (embedded, persisted), or `etcd://HOST:PORT[,HOST:PORT]` (multi-node; each
    /// agent's endpoints live on its lease and expire if it dies).
    #[arg(long, default_value = "memory", value_name = "SPEC")]
    registry: String,
    /// Lease TTL of this agent's etcd registrations, seconds.
    #[arg(long, default_value_t = 10, value_name = "SECS")]
    registry_ttl: i64,
    /// Where pods' workload identities come from: `builtin` (a node-local CA; mTLS
    /// between pods), `spire:PATH` (a SPIRE agent's Delegated Identity API on its admin
    /// socket PATH), `none` (plaintext).
    #[arg(long, default_value = "builtin", value_name = "SOURCE")]
    identity: String,
    /// SPIFFE trust domain of the built-in CA's SVIDs (`spiffe://DOMAIN/ns/NAMESPACE/sa/ACCOUNT`).
    #[arg(long, default_value = "cluster.local", value_name = "DOMAIN")]
    trust_domain: String,
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
    /// Try-it-out mode: state and CNI socket in a fresh temporary directory, the
    /// embedded in-memory registry (the `--registry` default), everything on loopback.
    /// Explicit flags still win for the registry and addresses.
    #[arg(long)]
    dev: bool,
    /// Log format.
    #[arg(long, default_value = "text", value_parser = ["text", "json"])]
    log_format: String,
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_lowercase())
        .unwrap_or_else(|_| "node".into())
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let args = Args::parse();
    flock_telemetry::logging::init(args.log_format.parse().unwrap_or_default());
    match run(args).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e:#}");
            eprintln!("flock-agent: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> anyhow::Result<()> {
    let mut agent = AgentConfig::new(args.node_name.clone().unwrap_or_else(hostname));
    agent.zone = args.zone.clone();
    agent.region = args.region.clone();
    agent.liveness.interval_ms = args.probe_interval_ms.max(100);
    agent.gc_interval = Duration::from_secs(args.gc_interval.max(1));
    let mut opts = Options {
        agent,
        state_dir: args.state_dir.clone(),
        cni_socket: args.cni_socket.clone(),
        xds_address: Some(args.xds_address),
        xds_socket: args.xds_socket.clone(),
        admin_address: args.admin_address,
        registry: args.registry.clone(),
        registry_ttl_secs: args.registry_ttl,
        identity: IdentitySource::parse(
            &args.identity,
            &args.trust_domain,
            Duration::from_secs(args.svid_ttl),
        )
        .map_err(|e| anyhow::anyhow!(e))?,
    };
    // Kept alive until exit: the --dev directory is removed when the agent stops.
    let _dev_dir = if args.dev {
        let dir = tempfile::Builder::new()
            .prefix("flock-dev-")
            .tempdir()
            .context("creating the --dev directory")?;
        opts.state_dir = dir.path().join("pods");
        opts.cni_socket = dir.path().join("cni.sock");
        tracing::info!(
            dir = %dir.path().display(),
            cni_socket = %opts.cni_socket.display(),
            xds = %args.xds_address,
            admin = %args.admin_address,
            "--dev: state and CNI socket in a temporary directory; registry {}",
            opts.registry
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
        tracing::info!(admin = %bound.admin, xds = ?bound.xds, "flock-agent listening");
    })
    .await
}
