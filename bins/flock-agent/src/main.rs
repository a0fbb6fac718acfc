//! `flock-agent`: the flock node agent (pod store, CNI server, registry, liveness, orphan GC, xDS).
//!
//! Parsing and wiring only: the flags, their defaults and every rule relating them live
//! in `flock_bird::options`.

use anyhow::Context as _;
use clap::Parser;
use flock_bird::options::{Flags, Options};
use flock_bird::runtime;
use flock_core::capture::policy::Setting;
use std::io::Write as _;
use std::process::ExitCode;

mod ca;
mod harden;

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
#[derive(Parser, Debug)]
#[command(version)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    flags: Flags,
}

#[derive(clap::Subcommand, Debug)]
enum Command {
    /// Print the Envoy bootstrap (JSON) matching these flags: ADS (Delta xDS) over the
    /// --xds-socket unix socket (Envoy's `pipe` address), node id = --node-name, cluster
    /// --envoy-cluster, admin on the 0600 unix socket --envoy-admin-socket (default
    /// /run/flock/envoy/control/admin.sock, flock-supervisor's; TCP only with the
    /// opt-in --envoy-admin-port). Example:
    /// `flock-agent --node-name "$NODE" envoy-bootstrap > envoy.json`.
    EnvoyBootstrap,
    /// Make a shared trust root for --ca-dir: `ca init` (a root CA), `ca issue` (a node
    /// issuer signed by it, in the --ca-dir layout).
    #[command(subcommand)]
    Ca(ca::CaCommand),
    /// Print a proxyless gRPC app's xDS bootstrap (JSON, for `GRPC_XDS_BOOTSTRAP`): this
    /// agent's mTLS xDS listener (--xds-address, or --server-uri where the app dials
    /// another address), the app's own SVID files as its client certificate and as
    /// the certificate provider `flock` its mTLS and RBAC use, and the server listener
    /// template of a proxyless server (a `grpc-xds` port). Example:
    /// `flock-agent --xds-address 10.0.0.7:15010 grpc-bootstrap --node-id web --cert
    /// /var/run/svid/cert.pem --key /var/run/svid/key.pem --ca /var/run/svid/bundle.pem`.
    GrpcBootstrap(GrpcBootstrapArgs),
}

/// `grpc-bootstrap`'s arguments.
#[derive(clap::Args, Debug)]
struct GrpcBootstrapArgs {
    /// The app's node id (its name: it shows in the agent's proxy status).
    #[arg(long, value_name = "ID")]
    node_id: String,
    /// The address the app dials for xDS (default: --xds-address).
    #[arg(long, value_name = "HOST:PORT")]
    server_uri: Option<String>,
    /// The app's SVID certificate chain (PEM file, as the app sees it).
    #[arg(long, value_name = "PATH")]
    cert: String,
    /// The SVID's private key (PEM file).
    #[arg(long, value_name = "PATH")]
    key: String,
    /// The trust bundle (PEM file): verifies the agent and the app's peers.
    #[arg(long, value_name = "PATH")]
    ca: String,
}

fn main() -> ExitCode {
    let Cli { command, flags } = Cli::parse();
    match command {
        Some(Command::EnvoyBootstrap) => {
            return report("flock-agent envoy-bootstrap", print_bootstrap(&flags));
        }
        Some(Command::Ca(cmd)) => return report("flock-agent ca", ca::run(&cmd)),
        Some(Command::GrpcBootstrap(args)) => {
            return report(
                "flock-agent grpc-bootstrap",
                print_grpc_bootstrap(&flags, &args),
            );
        }
        None => {}
    }
    flock_telemetry::logging::init(flags.log_format.parse().unwrap_or_default());
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
    let opts = match Options::try_from(flags) {
        Ok(opts) => opts,
        Err(e) => return fail(&e.into()),
    };
    // Pid 1's network namespace is read while the agent still may: the CNI server
    // refuses ADDs naming it (the node's own network stack is never a pod's).
    if flock_bird::cni_server::remember_host_netns().is_none() {
        tracing::warn!(
            "cannot read /proc/1/ns/net: CNI ADDs naming the host's network namespace are \
             refused only where it is also the agent's own"
        );
    }
    // Before the runtime starts any thread: every later thread inherits this.
    harden::drop_early(&opts.keep_capabilities, &opts.bind_time_capabilities);
    let capture = &opts.runtime.agent.capture;
    if capture.setting != Setting::Off {
        // With the capabilities the agent will run with: a host that cannot install the
        // rules must not start meshing pods whose ADD would then fail one by one.
        if let Err(e) = flock_bird::flock_capture::probe() {
            tracing::error!("--capture {}: {e}", capture.setting);
            eprintln!(
                "flock-agent: --capture {} needs nftables on this host: {e}",
                capture.setting
            );
            return ExitCode::FAILURE;
        }
        tracing::info!(mode = %capture.setting, probe_sources = ?capture.probe_sources, "transparent capture on: nftables probe passed");
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        // Capabilities are per thread: each worker applies the drop requested after
        // the listeners are bound at its next park or unpark (see `harden`).
        .on_thread_park(harden::apply_pending_drop)
        .on_thread_unpark(harden::apply_pending_drop)
        .build()
        .context("starting the async runtime");
    match runtime.and_then(|rt| rt.block_on(run(opts))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => fail(&e),
    }
}

/// Logs and prints why the agent stops.
fn fail(e: &anyhow::Error) -> ExitCode {
    tracing::error!("{e:#}");
    eprintln!("flock-agent: {e:#}");
    ExitCode::FAILURE
}

/// A subcommand's exit: its error on stderr, prefixed with the subcommand.
fn report(what: &str, result: anyhow::Result<()>) -> ExitCode {
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("{what}: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn print_bootstrap(flags: &Flags) -> anyhow::Result<()> {
    let bootstrap = flock_bird::options::envoy_bootstrap(flags)?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string_pretty(&bootstrap)?)
        .and_then(|()| out.flush())
        .context("writing the bootstrap to stdout")
}

fn print_grpc_bootstrap(flags: &Flags, args: &GrpcBootstrapArgs) -> anyhow::Result<()> {
    let server_uri = match (&args.server_uri, flags.xds_address) {
        (Some(uri), _) => uri.clone(),
        (None, Some(addr)) if !addr.ip().is_unspecified() => addr.to_string(),
        (None, Some(addr)) => anyhow::bail!(
            "--xds-address {addr} is every address of the node: say which one the app \
             dials with --server-uri HOST:PORT"
        ),
        (None, None) => anyhow::bail!(
            "a proxyless app reaches the agent over its mTLS xDS listener: give \
             --xds-address (the agent's) or --server-uri HOST:PORT"
        ),
    };
    anyhow::ensure!(!args.node_id.is_empty(), "--node-id must not be empty");
    let bootstrap = flock_xds::translate::proxyless_bootstrap(
        &server_uri,
        &args.node_id,
        &flock_xds::translate::AppCertificates {
            certificate_file: args.cert.clone(),
            private_key_file: args.key.clone(),
            ca_certificate_file: args.ca.clone(),
        },
    );
    let mut out = std::io::stdout().lock();
    writeln!(out, "{}", serde_json::to_string_pretty(&bootstrap)?)
        .and_then(|()| out.flush())
        .context("writing the bootstrap to stdout")
}

async fn run(mut opts: Options) -> anyhow::Result<()> {
    // Kept alive until exit: the --dev directory is removed when the agent stops.
    let _dev_dir = if opts.dev {
        let dir = tempfile::Builder::new()
            .prefix("flock-dev-")
            .tempdir()
            .context("creating the --dev directory")?;
        let (bootstrap, doc) = opts.dev_layout(dir.path());
        std::fs::write(&bootstrap, serde_json::to_string_pretty(&doc)?)
            .with_context(|| format!("writing {}", bootstrap.display()))?;
        let rt = &opts.runtime;
        let xds_path = rt.xds_socket.as_ref().map(|s| s.path.display());
        tracing::info!(
            dir = %dir.path().display(),
            cni_socket = %rt.cni_socket.display(),
            xds_socket = %xds_path.map(|p| p.to_string()).unwrap_or_default(),
            admin = %rt.admin_address,
            envoy_admin = ?opts.envoy_admin,
            envoy_bootstrap = %bootstrap.display(),
            "--dev: state and sockets in a temporary directory; registry {}; start Envoy \
             with `envoy -c {}`",
            rt.registry,
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
    runtime::run(opts.runtime, shutdown, |bound| {
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
