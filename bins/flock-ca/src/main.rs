//! `flock-ca`: the node-scoped signer. No node holds the issuer key; each asks this
//! service for its own pods' certificates, and gets them only for pods that run on it.

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use flock_bird::identity::BuiltinCa;
use flock_bird::identity::signer::{CaIssuer, KubePods};
use flock_ca::server::{PodSource, ScopeSource, SignerService};
use flock_ca::{DEFAULT_SERVER_NAME, SIGNER_PATH, files};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};

/// flock's node-scoped signer: issues workload certificates (X.509-SVIDs) only to the
/// node a pod runs on.
///
/// Run `serve` apart from the nodes (a Deployment with the CA directory mounted there
/// and nowhere else). Each node agent authenticates with its node credential (made
/// once by `node-credential`, renewed through the signer) and asks for its pods'
/// certificates with `flock-agent --identity flock-ca:https://HOST:PORT`.
#[derive(Parser, Debug)]
#[command(version)]
struct Args {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the signer (gRPC over mTLS; every client needs a node credential).
    Serve(Serve),
    /// Write a node credential for NODE into a new directory (run where the CA
    /// directory is; copy the directory to the node, e.g. as a per-node Secret).
    NodeCredential(NodeCredential),
}

#[derive(clap::Args, Debug)]
struct Serve {
    /// SPIFFE trust domain of the certificates.
    #[arg(long, default_value = "cluster.local", value_name = "DOMAIN")]
    trust_domain: String,
    /// The issuer: a CA directory (ca-cert.pem, ca-key.pem, cert-chain.pem,
    /// root-cert.pem; `flock-agent ca init`/`ca issue` make one), re-read when it
    /// changes (issuer rotation).
    #[arg(long, value_name = "DIR")]
    ca_dir: PathBuf,
    /// Address to listen on.
    #[arg(long, default_value = "0.0.0.0:8443", value_name = "HOST:PORT")]
    listen: SocketAddr,
    /// Check every request's pod with the Kubernetes API (in cluster, or with
    /// --kubeconfig): it must run on the asking node, as the account asked for.
    #[arg(long, conflicts_with = "scope_file")]
    kube: bool,
    /// Kubeconfig for --kube (default: the in-cluster service account).
    #[arg(long, value_name = "FILE", requires = "kube")]
    kubeconfig: Option<PathBuf>,
    /// Without Kubernetes: which node may host which service accounts, one line per
    /// node: `NODE: NS/SA NS/SA ...`.
    #[arg(long, value_name = "FILE")]
    scope_file: Option<PathBuf>,
    /// DNS names of the signer's own serving certificate (clients verify one of them:
    /// flock-agent --ca-server-name).
    #[arg(long = "dns-name", default_value = DEFAULT_SERVER_NAME, value_name = "NAME")]
    dns_names: Vec<String>,
    /// Lifetime of workload certificates, seconds.
    #[arg(long, default_value_t = 3600, value_name = "SECS")]
    svid_ttl: u64,
    /// Lifetime of node credentials (each renewal), seconds.
    #[arg(long, default_value_t = 7 * 24 * 3600, value_name = "SECS")]
    node_ttl: u64,
}

#[derive(clap::Args, Debug)]
struct NodeCredential {
    /// SPIFFE trust domain.
    #[arg(long, default_value = "cluster.local", value_name = "DOMAIN")]
    trust_domain: String,
    /// The issuer's CA directory.
    #[arg(long, value_name = "DIR")]
    ca_dir: PathBuf,
    /// The node's name (as Kubernetes knows it).
    #[arg(long, value_name = "NODE")]
    node: String,
    /// Directory to create (0700) for node-cert.pem, node-key.pem and bundle.pem (0600).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Lifetime, seconds (the agent renews it at half).
    #[arg(long, default_value_t = 7 * 24 * 3600, value_name = "SECS")]
    ttl: u64,
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    flock_telemetry::logging::init(flock_telemetry::logging::LogFormat::Text);
    let result = match args.command {
        Command::Serve(s) => tokio::runtime::Runtime::new()
            .context("starting the runtime")
            .and_then(|rt| rt.block_on(serve(s))),
        Command::NodeCredential(n) => node_credential(&n),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("flock-ca: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn load_ca(trust_domain: &str, svid_ttl: u64, dir: &Path) -> anyhow::Result<Arc<BuiltinCa>> {
    BuiltinCa::from_ca_dir(
        trust_domain,
        Duration::from_secs(svid_ttl),
        flock_clock::unix_now,
        dir,
    )
    .with_context(|| format!("--ca-dir {}", dir.display()))
}

fn node_credential(n: &NodeCredential) -> anyhow::Result<()> {
    flock_core::pod::check_node_name(&n.node)
        .map_err(|e| anyhow::anyhow!("--node {:?}: {e}", n.node))?;
    let ca = load_ca(&n.trust_domain, 3600, &n.ca_dir)?;
    let id = flock_core::issuance::node_id(&n.trust_domain, &n.node);
    let (leaf, key) = ca.issue_serving(&id, &[], Duration::from_secs(n.ttl))?;
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&n.out)
        .with_context(|| {
            format!(
                "--out {}: creating the directory (it must not exist)",
                n.out.display()
            )
        })?;
    flock_ca::client::write_private(&n.out, files::NODE_KEY, key.expose().as_bytes())?;
    flock_ca::client::write_private(&n.out, files::NODE_CERT, leaf.cert_chain_pem.as_bytes())?;
    flock_ca::client::write_private(&n.out, files::BUNDLE, ca.bundle().ca_pem.as_bytes())?;
    println!(
        "{id}: {} (expires at {} ms)",
        n.out.display(),
        leaf.not_after_ms.as_millis()
    );
    Ok(())
}

use std::os::unix::fs::DirBuilderExt as _;

async fn serve(s: Serve) -> anyhow::Result<()> {
    let ca = load_ca(&s.trust_domain, s.svid_ttl, &s.ca_dir)?;
    let pods: Arc<dyn PodSource> = match (&s.scope_file, s.kube) {
        (Some(file), false) => {
            let text = std::fs::read_to_string(file)
                .with_context(|| format!("--scope-file {}", file.display()))?;
            let scope = flock_core::issuance::parse_scope(&text)
                .map_err(|e| anyhow::anyhow!("--scope-file {}: {e}", file.display()))?;
            Arc::new(ScopeSource(scope))
        }
        (None, true) => {
            let client = flock_kube::watch::client(s.kubeconfig.as_deref())
                .await
                .context("--kube")?;
            Arc::new(KubePods::new(client))
        }
        _ => bail!("say how pods are checked: --kube (the Kubernetes API) or --scope-file FILE"),
    };
    tokio::spawn(Arc::clone(&ca).watch_ca_dir(
        s.ca_dir.clone(),
        Duration::from_millis(500),
        Duration::from_secs(30),
    ));
    let issuer = Arc::new(CaIssuer {
        ca: Arc::clone(&ca),
        node_ttl: Duration::from_secs(s.node_ttl),
    });
    let listener = Arc::new(
        tokio::net::TcpListener::bind(s.listen)
            .await
            .with_context(|| format!("--listen {}", s.listen))?,
    );
    let bound = listener.local_addr()?;
    tracing::info!(address = %bound, trust_domain = %s.trust_domain, pods = %pods.describe(), issuer = %ca.describe_issuer(), "flock-ca serving");
    // The serving certificate is renewed at half its life (and after an issuer
    // rotation, within that time) by serving again with a new one on the same socket;
    // in-flight requests finish first.
    let serving_ttl = Duration::from_secs(s.svid_ttl.max(60));
    let server_id = format!("spiffe://{}{SIGNER_PATH}", s.trust_domain);
    loop {
        let (leaf, key) = ca.issue_serving(&server_id, &s.dns_names, serving_ttl)?;
        let tls = ServerTlsConfig::new()
            .identity(Identity::from_pem(
                leaf.cert_chain_pem.as_bytes(),
                key.expose().as_bytes(),
            ))
            .client_ca_root(Certificate::from_pem(ca.bundle().ca_pem.as_bytes()));
        let service = SignerService::new(&s.trust_domain, issuer.clone(), Arc::clone(&pods));
        let incoming = SharedIncoming(Arc::clone(&listener));
        Server::builder()
            .tls_config(tls)
            .context("TLS configuration")?
            .timeout(Duration::from_secs(30))
            .add_service(service.into_server())
            .serve_with_incoming_shutdown(incoming, tokio::time::sleep(serving_ttl / 2))
            .await
            .context("serving")?;
        tracing::info!("renewing the signer's serving certificate");
    }
}

/// The accepted connections of a listener shared across serving rounds: accepting
/// only while polled, so a round's end leaves waiting connections to the next round.
struct SharedIncoming(Arc<tokio::net::TcpListener>);

impl tokio_stream::Stream for SharedIncoming {
    type Item = std::io::Result<tokio::net::TcpStream>;

    fn poll_next(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        self.0.poll_accept(cx).map(|r| Some(r.map(|(s, _)| s)))
    }
}
