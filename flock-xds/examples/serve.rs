//! Serves a mesh model from a JSON file over ADS (SotW and Delta) and reloads it when
//! the file changes: the quickest way to try flock-xds with your own Envoy or gRPC
//! client.
//!
//! ```text
//! cargo run -p flock-xds --example serve -- --mesh flock-xds/examples/mesh.json
//! ```

use anyhow::Context as _;
use clap::Parser;
use flock_xds::cache::Cache;
use flock_xds::callbacks::NodeInfo;
use flock_xds::server::{GroupChoice, Listen, Peer, Principal, Server, TlsSettings};
use flock_xds::translate::{self, EnvoyOptions, EnvoyReferences, Mesh};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// The node group of Envoy proxies.
const ENVOY_GROUP: &str = "envoy";
/// The node group of proxyless gRPC clients.
const GRPC_GROUP: &str = "grpc";

#[derive(Parser, Debug)]
#[command(
    about = "Serve a flock mesh model (JSON) to Envoy and proxyless gRPC clients over xDS.",
    long_about = "Serve a flock mesh model (JSON) to Envoy and proxyless gRPC clients over \
ADS (SotW and Delta) and the per-type xDS services, and reload it when the file changes.\n\n\
Nodes whose user_agent_name contains \"envoy\" (every Envoy) receive the Envoy translation: \
per-pod inbound and outbound listeners, app clusters, service clusters over EDS, the \
outbound|http route configuration and secrets. Every other node (gRPC's xds:/// resolver) \
receives the proxyless translation: an ApiListener per gRPC service port named \
<svc>.<ns>:<port>, its route configuration, clusters and endpoints.\n\n\
A file that fails to parse or validate is reported with every problem and the last good \
model keeps being served. See the flock_xds::translate docs for the model and the resource \
naming scheme; examples/mesh.json is a starting point."
)]
struct Args {
    /// The mesh model (JSON, at most 16 MiB).
    #[arg(long, value_name = "FILE")]
    mesh: PathBuf,
    /// Where to serve: HOST:PORT or unix:PATH (the socket is created 0600 in a
    /// directory only we can write to, created 0700 if missing). Plain TCP authenticates
    /// no one and is refused on a non-loopback address: give --tls-* for mTLS.
    #[arg(long, default_value = "127.0.0.1:18000", value_name = "ADDR")]
    listen: Listen,
    /// Unix socket clients allowed, by uid (repeatable; default: our own uid).
    #[arg(long = "allow-uid", value_name = "UID")]
    allow_uids: Vec<u32>,
    /// mTLS on the TCP listener: the server certificate chain (PEM).
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "tls_client_ca"])]
    tls_cert: Option<PathBuf>,
    /// mTLS: the server's private key (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// mTLS: the CA that client certificates must chain to (PEM). Any client with a
    /// certificate it issued is served as its node, secrets included.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// How often to check the file for changes, in milliseconds.
    #[arg(long, default_value_t = 500, value_name = "MS")]
    poll_ms: u64,
    /// Validate the file, print the resources each node group would get, and exit.
    #[arg(long)]
    check: bool,
}

/// Which translation a node gets.
fn group_of(node: &NodeInfo) -> String {
    if node.user_agent_name.to_ascii_lowercase().contains("envoy") {
        ENVOY_GROUP.to_string()
    } else {
        GRPC_GROUP.to_string()
    }
}

fn load(path: &Path) -> anyhow::Result<Mesh> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mesh = Mesh::from_json(&bytes).with_context(|| format!("parsing {}", path.display()))?;
    if let Err(errors) = mesh.validate() {
        let list: Vec<String> = errors.iter().map(|e| format!("  - {e}")).collect();
        anyhow::bail!(
            "{} is not a valid mesh ({} problem(s)):\n{}",
            path.display(),
            errors.len(),
            list.join("\n")
        );
    }
    Ok(mesh)
}

/// Publishes `mesh` to both groups; unchanged resources keep their versions.
fn publish(
    cache: &Cache<envoy_types::pb::google::protobuf::Any>,
    mesh: &Mesh,
) -> anyhow::Result<(u64, u64)> {
    let envoy = translate::envoy_resources(mesh, &EnvoyOptions::default());
    let grpc = translate::grpc_resources(mesh);
    let e = cache
        .update_checked(ENVOY_GROUP, &EnvoyReferences, |prev| {
            let mut b = prev.edit();
            translate::replace_all(&mut b, envoy);
            b.build()
        })
        .context("the Envoy translation is inconsistent")?;
    let g = cache
        .update_checked(GRPC_GROUP, &EnvoyReferences, |prev| {
            let mut b = prev.edit();
            translate::replace_all(&mut b, grpc);
            b.build()
        })
        .context("the gRPC translation is inconsistent")?;
    Ok((e.version(), g.version()))
}

/// Who may connect: a unix peer with an allowed uid, a TLS peer with a verified
/// certificate, and a plain TCP peer (loopback only, checked at startup); each is
/// served as the node it names, secrets included.
fn authorize(allowed_uids: &[u32], peer: &Peer) -> Result<Principal, tonic::Status> {
    let trusted = |name: String| {
        Ok(Principal {
            name,
            group: GroupChoice::ByNode,
            secrets: true,
        })
    };
    match peer {
        Peer::Unix { uid, .. } if allowed_uids.contains(uid) => trusted(format!("uid {uid}")),
        Peer::Unix { uid, .. } => Err(tonic::Status::permission_denied(format!(
            "uid {uid} is not allowed (--allow-uid)"
        ))),
        Peer::Tls { .. } if peer.has_certificate() => trusted(peer.to_string()),
        Peer::Tls { .. } => Err(tonic::Status::unauthenticated(
            "a client certificate is required",
        )),
        Peer::Tcp { addr } => trusted(addr.to_string()),
        Peer::Unknown => Err(tonic::Status::unauthenticated("unknown peer")),
    }
}

fn read_pem(path: &Path) -> anyhow::Result<String> {
    std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))
}

/// What identifies a version of the file (editors replace files by rename).
fn stamp(path: &Path) -> Option<(std::time::SystemTime, u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len(), m.ino()))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,flock_xds=info".into()),
        )
        .init();
    let args = Args::parse();
    let mesh = load(&args.mesh)?;
    if args.check {
        for (group, resources) in [
            (
                ENVOY_GROUP,
                translate::envoy_resources(&mesh, &EnvoyOptions::default()),
            ),
            (GRPC_GROUP, translate::grpc_resources(&mesh)),
        ] {
            println!("{group}:");
            for r in resources {
                println!(
                    "  {:<4} {}",
                    flock_xds::types::short_name(r.type_url),
                    r.name
                );
            }
        }
        return Ok(());
    }

    let cache = Arc::new(Cache::new(group_of));
    let (ev, gv) = publish(&cache, &mesh)?;
    tracing::info!(mesh = %args.mesh.display(), envoy_version = ev, grpc_version = gv, "mesh loaded");
    let allowed_uids = if args.allow_uids.is_empty() {
        vec![nix::unistd::geteuid().as_raw()]
    } else {
        args.allow_uids.clone()
    };
    let server = Server::builder(Arc::clone(&cache))
        .authorizer(move |peer: &Peer| authorize(&allowed_uids, peer))
        .build();

    // Reload on change: poll the file's (mtime, size, inode). A bad file is logged
    // and the last good mesh stays served.
    let watcher = {
        let cache = Arc::clone(&cache);
        let path = args.mesh.clone();
        let interval = Duration::from_millis(args.poll_ms.max(10));
        tokio::spawn(async move {
            let mut last = stamp(&path);
            loop {
                tokio::time::sleep(interval).await;
                let now = stamp(&path);
                if now == last {
                    continue;
                }
                last = now;
                match load(&path).and_then(|mesh| publish(&cache, &mesh)) {
                    Ok((ev, gv)) => {
                        tracing::info!(envoy_version = ev, grpc_version = gv, "mesh reloaded")
                    }
                    Err(e) => tracing::error!("keeping the last good mesh: {e:#}"),
                }
            }
        })
    };

    let shutdown = async {
        let _ = tokio::signal::ctrl_c().await;
        tracing::info!("shutting down");
    };
    let result = match &args.listen {
        Listen::Tcp(addr) => {
            let tls = match (&args.tls_cert, &args.tls_key, &args.tls_client_ca) {
                (Some(cert), Some(key), Some(ca)) => Some(TlsSettings {
                    cert_chain_pem: read_pem(cert)?,
                    key_pem: read_pem(key)?.into(),
                    client_ca_pem: read_pem(ca)?,
                }),
                _ => None,
            };
            // On the canonical address: `[::ffff:127.0.0.1]` is loopback too.
            if tls.is_none() && !flock_core::pod::canonical_ip(addr.ip()).is_loopback() {
                anyhow::bail!(
                    "plaintext xDS on {addr} would hand every client on the network every \
                     secret: listen on loopback or a unix socket, or give --tls-cert, \
                     --tls-key and --tls-client-ca"
                );
            }
            let listener = tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding {addr}"))?;
            tracing::info!(%addr, mtls = tls.is_some(), "serving xDS");
            match tls {
                Some(tls) => server.serve_tls(listener, tls, shutdown).await,
                None => server.serve_tcp(listener, shutdown).await,
            }
        }
        Listen::Unix(path) => {
            if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
                flock_xds::server::ensure_private_dir(dir)?;
            }
            tracing::info!(path = %path.display(), "serving xDS");
            server.serve_unix(path, shutdown).await
        }
    };
    watcher.abort();
    result.context("xDS server failed")
}
