//! Wires an [`Agent`] to real I/O: the pod store, the registry, the xDS server, the
//! CNI socket, the admin endpoint, and the refresher, liveness and GC loops.

use crate::admin;
use crate::agent::{Agent, AgentConfig, group_of};
use crate::cni_server::CniServer;
use crate::identity::IdentityProvider as _;
use crate::identity::{BuiltinCa, SpireBridge};
use crate::kube::KubePods;
use crate::node_ready::{EnvoyAcks, NodeReadiness};
use crate::registry::{self, RegistryOptions};
use crate::store::PodStore;
use crate::xds_auth::AgentAuthorizer;
use anyhow::Context as _;
use flock_core::access::AccessPolicy;
use flock_core::debounce::{Debounce, DebouncePoll};
use flock_kube::watch::{KubeWatch, WatchOptions};
use flock_xds::cache::Cache;
use flock_xds::server::{
    ConnectionLimits, Limits, Server, ServerTls, SubscriptionBudget, TlsSettings,
    bind_unix_with_mode, ensure_private_dir,
};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Where the agent keeps state and listens.
#[derive(Debug, Clone)]
pub struct Options {
    /// The agent's settings.
    pub agent: AgentConfig,
    /// The pod store directory (also the node lock's: [`crate::node_lock`]).
    pub state_dir: PathBuf,
    /// `--ready-file`: exists while the agent stands by for the node lock (its API
    /// watches synced) or serves.
    pub ready_file: Option<PathBuf>,
    /// What a returned pod store write survives (the agent's crash, or also a power loss).
    pub store_durability: crate::store::Durability,
    /// The CNI socket (created 0600).
    pub cni_socket: PathBuf,
    /// xDS over a unix socket (the node's Envoy, by its peer credentials), if any.
    pub xds_socket: Option<XdsSocket>,
    /// xDS over TCP with mTLS (proxyless gRPC clients, remote Envoys), if any. There is
    /// no plaintext TCP form: a TCP peer has no identity but its client certificate.
    pub xds_tls: Option<XdsTls>,
    /// Who may use xDS and what each peer may see.
    pub xds_access: AccessPolicy,
    /// Connection and stream bounds of the xDS listeners.
    pub xds_limits: XdsLimits,
    /// The admin endpoint.
    pub admin_address: SocketAddr,
    /// Admin connections served at once (the rest wait in the listen backlog).
    pub admin_max_connections: usize,
    /// `memory`, `file:PATH`, `etcd://HOST:PORT[,…]` or `etcds://HOST:PORT[,…]` (TLS).
    pub registry: String,
    /// Lease TTL of etcd registrations, seconds.
    pub registry_ttl_secs: i64,
    /// TLS to etcd (with `etcds://`): CA, client certificate and key.
    pub registry_tls: Option<registry::EtcdTls>,
    /// etcd user authentication.
    pub registry_auth: Option<registry::EtcdAuth>,
    /// `--registry-scope`: which accounts each node may host; other nodes' entries
    /// naming other accounts are dropped (etcd only).
    pub registry_scope: Option<Arc<flock_core::issuance::Scope>>,
    /// `--registry-max-entries-per-node`: the most entries of one other node loaded.
    pub registry_max_entries_per_node: usize,
    /// Where pods' workload identities come from.
    pub identity: IdentitySource,
    /// Kube mode (`--kube`): pod facts and Service memberships from the Kubernetes
    /// API; `None`: from pod annotations.
    pub kube: Option<KubeOptions>,
    /// `--authz-dir`: the watched directory of authorization policies.
    pub authz_dir: Option<PathBuf>,
    /// `--routes-dir`: the watched directory of traffic-policy routes.
    pub routes_dir: Option<PathBuf>,
    /// `--access-log`: where access log lines go (`None`: no access log). The agent
    /// config's `access_log` must be set with it, so Envoy sends the entries.
    pub access_log: Option<crate::access_log::Destination>,
    /// Percentage of entries the agent writes as lines (100 unless Envoy sends every
    /// entry for the workload metrics and the lines are sampled here).
    pub access_log_line_percent: u32,
    /// `--workload-metrics`: golden metrics per workload pair on `/metrics`
    /// ([`crate::workload_metrics`]). The agent config's `access_log` must be set with
    /// it, unsampled.
    pub workload_metrics: bool,
}

/// Kube mode's settings (see [`crate::kube`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KubeOptions {
    /// The kubeconfig to use; `None`: the in-cluster configuration (the pod's
    /// service-account token and `KUBERNETES_SERVICE_HOST`).
    pub kubeconfig: Option<PathBuf>,
    /// How long a CNI ADD waits for its pod to show up in the reflector before the
    /// agent asks the API directly.
    pub pod_wait: Duration,
    /// Remove the startup taint from this node's Node once ready
    /// ([`crate::node_ready`]).
    pub remove_startup_taint: bool,
    /// The CNI installer's ready file: the startup taint stays until it exists.
    pub cni_ready_file: Option<PathBuf>,
    /// What to do with a running pod that should be meshed and is not
    /// ([`crate::repair`]).
    pub repair: crate::repair::RepairMode,
    /// The pod label keys its endpoints carry for route subsets
    /// ([`crate::kube::KubePods::with_endpoint_labels`]).
    pub endpoint_labels: Vec<String>,
}

/// Starts kube mode's reflectors (`None` without kube mode): this node's pods, the
/// Services, Namespaces and this node's Node (with `--registry kubernetes` also every
/// EndpointSlice and Node, for the registry, which reads the same watch).
pub async fn start_kube_watch(opts: &Options) -> anyhow::Result<Option<Arc<KubeWatch>>> {
    let Some(kube) = &opts.kube else {
        return Ok(None);
    };
    let client = flock_kube::watch::client(kube.kubeconfig.as_deref())
        .await
        .context("--kube: connecting to the Kubernetes API")?;
    let watch = KubeWatch::start(
        client,
        WatchOptions {
            node_name: opts.agent.node_name.clone(),
            endpoint_slices: opts.registry == "kubernetes",
        },
    );
    tracing::info!(
        kubeconfig = ?kube.kubeconfig,
        node = %opts.agent.node_name,
        "kube mode: pod identities, ports and Service memberships from the Kubernetes API"
    );
    Ok(Some(Arc::new(watch)))
}

/// The xDS unix socket and who besides the agent's own uid can open it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsSocket {
    /// The socket path; its parent directory is created 0700 (or made traversable,
    /// 0711, when another uid or a group must reach the socket) and must be ours.
    pub path: PathBuf,
    /// Chown the socket to this uid (mode 0600): the node's Envoy runs as it.
    pub owner_uid: Option<u32>,
    /// Chgrp the socket to this gid and make it 0660 (an Envoy group).
    pub group: Option<u32>,
}

/// xDS over TCP with mTLS: PEM files of the server certificate chain, its key, and the
/// CA that issues client certificates.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsTls {
    /// The TCP address.
    pub address: SocketAddr,
    /// The server certificate chain (PEM).
    pub cert: PathBuf,
    /// The server key (PEM; read into a zeroizing buffer).
    pub key: PathBuf,
    /// The CA bundle client certificates must chain to (PEM).
    pub client_ca: PathBuf,
}

/// Operator-tunable bounds of the xDS listeners.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct XdsLimits {
    /// Open connections at once on the mTLS listener; one more is closed at once.
    pub max_connections: usize,
    /// Open connections at once on the unix socket: a pool the TCP clients cannot take.
    pub max_unix_connections: usize,
    /// An mTLS connection without a completed handshake or an authorized stream for
    /// this long is closed.
    pub idle_timeout: Duration,
    /// What a connection, a client and all clients of a listener kind may hold
    /// subscribed.
    pub subscription_budget: SubscriptionBudget,
    /// Concurrent streams per connection (HTTP/2 `MAX_CONCURRENT_STREAMS`).
    pub max_streams_per_connection: u32,
    /// A stream whose first request does not arrive within this ends `DEADLINE_EXCEEDED`.
    pub first_request_timeout: Duration,
    /// Open streams at once, server-wide; one more gets `RESOURCE_EXHAUSTED` at once.
    pub max_open_streams: usize,
}

impl Default for XdsLimits {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_unix_connections: 1024,
            idle_timeout: Duration::from_secs(10),
            subscription_budget: SubscriptionBudget::default(),
            max_streams_per_connection: 100,
            first_request_timeout: Duration::from_secs(10),
            max_open_streams: Limits::default().max_open_streams,
        }
    }
}

/// `--identity`: where workload identities (X.509-SVIDs) come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IdentitySource {
    /// No identities: pods talk plaintext.
    None,
    /// The node-local CA: SVIDs `spiffe://<trust_domain>/ns/<ns>/sa/<sa>`, keys only
    /// in memory, rotated at half their lifetime.
    Builtin {
        /// The trust domain.
        trust_domain: String,
        /// SVID lifetime.
        svid_ttl: Duration,
        /// `--ca-dir`: the issuer under a shared root (re-read when it changes);
        /// `None`: a node-local CA whose SVIDs only this node trusts.
        ca_dir: Option<PathBuf>,
    },
    /// The node-scoped signer (`flock-ca`): keys made here, certificates signed there
    /// for this node's pods only (see [`RemoteCa`](crate::identity::RemoteCa)).
    FlockCa {
        /// The trust domain.
        trust_domain: String,
        /// `https://HOST:PORT`.
        url: String,
        /// The node credential directory (`--node-credential`).
        credential_dir: PathBuf,
        /// The DNS name the signer's certificate must carry (`--ca-server-name`).
        server_name: String,
    },
    /// A SPIRE agent's Delegated Identity API on its admin socket: SPIRE issues and
    /// rotates the SVIDs (see [`SpireBridge`]).
    Spire {
        /// The SPIRE agent admin socket.
        socket: PathBuf,
    },
}

impl IdentitySource {
    /// Parses `builtin`, `none` or `spire:PATH` (with the trust domain and TTL for
    /// `builtin`).
    pub fn parse(spec: &str, trust_domain: &str, svid_ttl: Duration) -> Result<Self, String> {
        match spec {
            "none" => Ok(Self::None),
            "builtin" => Ok(Self::Builtin {
                trust_domain: trust_domain.to_string(),
                svid_ttl,
                ca_dir: None,
            }),
            s if s.starts_with("flock-ca:") => match &s["flock-ca:".len()..] {
                url if url.starts_with("https://") && url.len() > "https://".len() => {
                    Ok(Self::FlockCa {
                        trust_domain: trust_domain.to_string(),
                        url: url.to_string(),
                        credential_dir: PathBuf::new(),
                        server_name: flock_ca::DEFAULT_SERVER_NAME.to_string(),
                    })
                }
                _ => Err(format!(
                    "--identity {s}: expected flock-ca:https://HOST:PORT (the signer's address)"
                )),
            },
            s if s.starts_with("spire:") => match &s["spire:".len()..] {
                "" => Err(format!(
                    "--identity {s}: expected spire:PATH (the SPIRE agent admin socket)"
                )),
                path => Ok(Self::Spire {
                    socket: PathBuf::from(path),
                }),
            },
            s => Err(format!(
                "--identity {s:?}: expected builtin, flock-ca:https://HOST:PORT, none or spire:PATH"
            )),
        }
    }
}

/// The addresses a running agent actually bound (ports may have been 0).
#[derive(Debug, Clone)]
pub struct Bound {
    /// xDS mTLS address.
    pub xds: Option<SocketAddr>,
    /// xDS unix socket.
    pub xds_socket: Option<PathBuf>,
    /// Admin address.
    pub admin: SocketAddr,
}

/// Runs the agent until `shutdown` resolves. `on_bound` is called once every
/// listener is bound, before the pod store is loaded (tests use it to learn ephemeral
/// ports; the agent is ready when `/readyz` says so).
pub async fn run(
    opts: Options,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(Bound) + Send,
) -> anyhow::Result<()> {
    // Before the registry: `--registry kubernetes` reads EndpointSlices from this watch.
    // Read-only, so it starts before the node lock: a standing-by agent has synced its
    // view when it takes over.
    let kube_watch = start_kube_watch(&opts).await?;
    // Nothing of the node's is written before this: the store, the registry lease, the
    // sockets. A second agent (a surge upgrade's) waits here for the first to exit.
    let mut standby = None;
    let (_node_lock, taken) = crate::node_lock::NodeLock::acquire(&opts.state_dir, |path| {
        tracing::warn!(
            lock = %path.display(),
            "another flock-agent serves this node: standing by until it exits (an upgrade              that starts the new agent beside the old); then this one takes the store, the              registry entries and the sockets"
        );
        if let Some(file) = opts.ready_file.clone() {
            let view = kube_watch.as_ref().map(|w| w.view());
            standby = Some(tokio::spawn(async move {
                if let Some(mut view) = view {
                    // Ready to take over once the API view is complete.
                    if view.wait_for(|s| s.synced).await.is_err() {
                        return;
                    }
                }
                match crate::node_lock::write_ready_file(&file, "standby") {
                    Ok(()) => tracing::info!(file = %file.display(), "standing by: ready to take over"),
                    Err(e) => tracing::warn!(file = %file.display(), "--ready-file: {e}"),
                }
            }));
        }
    })
    .await?;
    if let Some(task) = standby.take() {
        task.abort();
    }
    if taken == crate::node_lock::Taken::AfterWaiting {
        tracing::info!(state_dir = %opts.state_dir.display(), "the previous agent exited: taking over this node");
    }
    let store = Arc::new(
        PodStore::open_with(&opts.state_dir, opts.store_durability)
            .with_context(|| format!("opening the pod store in {}", opts.state_dir.display()))?,
    );
    let spec =
        registry::parse_spec(&opts.registry).map_err(|e| anyhow::anyhow!("--registry: {e}"))?;
    let reg: Arc<dyn registry::Registry> = if spec == registry::RegistrySpec::Kubernetes {
        let Some(watch) = &kube_watch else {
            anyhow::bail!(
                "--registry kubernetes reads EndpointSlices from the Kubernetes API: it needs --kube"
            );
        };
        // SPIFFE IDs of meshed Services in the agent's trust domain (--trust-domain).
        Arc::new(registry::kube::KubeRegistry::start(
            watch,
            opts.xds_access.trust_domain.clone(),
        ))
    } else {
        registry::connect(
            &spec,
            RegistryOptions {
                node: opts.agent.node_name.clone(),
                lease_ttl_secs: opts.registry_ttl_secs,
                // Reconnect attempts at most 1 s apart (0.5–1 s with equal jitter): the
                // registry sync re-registers this node's pods as soon as the view is
                // back, so this is what bounds how long after an etcd outage remote
                // nodes miss them. Both nodes must agree again within 3 s of etcd
                // answering (the outage test's bound); with attempts up to 2 s apart,
                // the wait for the next attempt alone took most of a 2 s budget
                // (measured: 1.65 s of a 2.03 s convergence). One attempt a second per node is little for an etcd
                // that is down anyway, and the jitter spreads the nodes' attempts.
                reconnect_max: Duration::from_secs(1),
                tls: opts.registry_tls.clone(),
                auth: opts.registry_auth.clone(),
                scope: opts.registry_scope.clone(),
                max_entries_per_node: opts.registry_max_entries_per_node,
                // Remote endpoints' SPIFFE IDs must be in our trust domain: --trust-domain,
                // for the built-in CA and for SPIRE alike (SPIRE must be configured with the
                // same domain). Without an identity source nothing is checked against one.
                trust_domain: match &opts.identity {
                    IdentitySource::None => None,
                    _ => Some(opts.xds_access.trust_domain.clone()),
                },
                ..RegistryOptions::default()
            },
        )
        .await
        .with_context(|| format!("connecting to the registry {}", opts.registry))?
    };
    let cache = Arc::new(Cache::new(group_of));
    let mut agent = Agent::new(
        opts.agent.clone(),
        store,
        Arc::clone(&reg),
        Arc::clone(&cache),
    );
    let mut rotation = None;
    let mut ca_watch = None;
    if let IdentitySource::Builtin {
        trust_domain,
        svid_ttl,
        ca_dir,
    } = &opts.identity
    {
        let ca = match ca_dir {
            Some(dir) => {
                let ca =
                    BuiltinCa::from_ca_dir(trust_domain, *svid_ttl, flock_clock::unix_now, dir)
                        .map_err(|e| anyhow::anyhow!("--ca-dir {}: {e}", dir.display()))?;
                tracing::info!(identity = %ca.describe(), issuer = %ca.describe_issuer(), ca_dir = %dir.display(), "workload identity: built-in CA under a shared root (re-read when the directory changes)");
                ca_watch = Some((Arc::clone(&ca), dir.clone()));
                ca
            }
            None => {
                let ca = BuiltinCa::new(trust_domain, *svid_ttl, flock_clock::unix_now)
                    .map_err(|e| anyhow::anyhow!("--identity builtin: {e}"))?;
                tracing::info!(identity = %ca.describe(), "workload identity: node-local CA (keys in memory only)");
                tracing::info!(
                    "the node-local CA's SVIDs are trusted on this node only: cross-node mTLS needs a shared root (--ca-dir)"
                );
                ca
            }
        };
        rotation = Some(Arc::clone(&ca));
        agent = agent.with_identity(ca);
    }
    let mut remote_rotation = None;
    if let IdentitySource::FlockCa {
        trust_domain,
        url,
        credential_dir,
        server_name,
    } = &opts.identity
    {
        let remote = crate::identity::RemoteCa::new(crate::identity::RemoteCaOptions {
            trust_domain: trust_domain.clone(),
            signer: flock_ca::client::SignerAddress {
                url: url.clone(),
                server_name: server_name.clone(),
                timeout: Duration::from_secs(10),
            },
            credential_dir: credential_dir.clone(),
        })
        .map_err(|e| anyhow::anyhow!("--identity flock-ca: {e}"))?;
        tracing::info!(identity = %remote.describe(), "workload identity: the node-scoped signer (no issuer key on this node)");
        remote_rotation = Some(Arc::clone(&remote));
        agent = agent.with_identity(remote);
    }
    if let IdentitySource::Spire { socket } = &opts.identity {
        // Connects (and reconnects) in the background; subscriptions wait for it.
        let bridge = SpireBridge::connect(socket.clone());
        tracing::info!(identity = %bridge.describe(), "workload identity: SPIRE Delegated Identity API");
        agent = agent.with_identity(bridge);
    }
    if let (Some(watch), Some(kube)) = (&kube_watch, &opts.kube) {
        agent = agent.with_kube(Arc::new(
            KubePods::new(
                Arc::clone(watch),
                opts.agent.node_name.clone(),
                kube.pod_wait,
            )
            .with_endpoint_labels(kube.endpoint_labels.clone()),
        ));
        agent = agent.with_repairer(Arc::new(crate::repair::Repairer::new(
            opts.agent.node_name.clone(),
            kube.repair,
        )));
    }
    if opts.access_log.is_some() || opts.workload_metrics {
        let outputs = crate::access_log::Outputs {
            lines: opts.access_log.clone(),
            line_percent: opts.access_log_line_percent,
            metrics: opts
                .workload_metrics
                .then(crate::workload_metrics::WorkloadMetrics::default),
        };
        let logs = crate::access_log::AccessLogs::start(outputs, agent.registry().view())
            .context("--access-log")?;
        tracing::info!(
            access_log = ?opts.access_log,
            line_percent = opts.access_log_line_percent,
            envoy_sample_percent = opts.agent.access_log.as_ref().map(|a| a.sample_percent),
            workload_metrics = opts.workload_metrics,
            "telemetry from Envoy's access log stream on"
        );
        agent = agent.with_access_logs(logs);
    }
    let agent = Arc::new(agent);
    if let Some(logs) = agent.access_logs() {
        let weak = Arc::downgrade(&agent);
        logs.set_local_pods(Box::new(move || {
            weak.upgrade()
                .map(|a| {
                    a.pods()
                        .values()
                        .flat_map(|p| {
                            let who = crate::access_log::PodName {
                                pod: p.pod_ref(),
                                service: (!p.service.is_empty())
                                    .then(|| format!("{}.{}", p.service, p.namespace)),
                            };
                            p.ips.iter().map(move |ip| (*ip, who.clone()))
                        })
                        .collect()
                })
                .unwrap_or_default()
        }));
    }
    // The startup taint goes once the node is ready, which includes an Envoy's first
    // ACK: the xDS server reports ACKs to this hook.
    let envoy_acks = Arc::new(EnvoyAcks::default());
    let startup_taint = match (&kube_watch, &opts.kube) {
        (Some(watch), Some(kube)) if kube.remove_startup_taint => Some((
            Arc::new(NodeReadiness::new(
                Arc::clone(&agent),
                kube.cni_ready_file.clone(),
                Arc::clone(&envoy_acks),
            )),
            watch.client().clone(),
        )),
        _ => None,
    };
    // NACKs and slow ACKs go to the agent's report (/readyz, /metrics).
    let hooks = crate::xds_answers::Fanout(vec![
        envoy_acks as Arc<dyn flock_xds::callbacks::Callbacks>,
        Arc::clone(agent.xds_answers()) as Arc<dyn flock_xds::callbacks::Callbacks>,
    ]);
    let xds = Server::builder(Arc::clone(&cache))
        .callbacks(hooks)
        .identifier(format!("flock-agent/{}", opts.agent.node_name))
        .authorizer(AgentAuthorizer::new(opts.xds_access.clone()))
        // Envoy's authorization denials come back over the same socket (gRPC access
        // log service), accepted from the node's Envoy only.
        .access_log_sink(Arc::new(crate::access_log::Sinks(
            std::iter::once(
                Arc::clone(agent.denials()) as Arc<dyn flock_xds::server::accesslog::AccessLogSink>
            )
            .chain(
                agent
                    .access_logs()
                    .map(|l| Arc::clone(l) as Arc<dyn flock_xds::server::accesslog::AccessLogSink>),
            )
            .collect(),
        )))
        .connection_limits(ConnectionLimits {
            max_connections: opts.xds_limits.max_connections,
            max_unix_connections: opts.xds_limits.max_unix_connections,
            idle_timeout: Some(opts.xds_limits.idle_timeout),
            max_concurrent_streams_per_connection: opts.xds_limits.max_streams_per_connection,
            ..ConnectionLimits::default()
        })
        .limits(Limits {
            first_request_timeout: opts.xds_limits.first_request_timeout,
            max_open_streams: opts.xds_limits.max_open_streams,
            subscription_budget: opts.xds_limits.subscription_budget,
            ..Limits::default()
        })
        .build();

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    // Listeners first: a bind error is reported before anything else starts.
    let admin_listener = tokio::net::TcpListener::bind(opts.admin_address)
        .await
        .with_context(|| format!("binding the admin address {}", opts.admin_address))?;
    let xds_tls = match &opts.xds_tls {
        Some(tls) => {
            let settings = read_tls_settings(tls)?;
            let server_tls = Arc::new(
                ServerTls::new(&settings)
                    .context("the mTLS xDS listener's files (--xds-tls-cert, --xds-tls-key, --xds-tls-client-ca)")?,
            );
            let listener = tokio::net::TcpListener::bind(tls.address)
                .await
                .with_context(|| format!("binding the xDS address {}", tls.address))?;
            Some((listener, server_tls, tls.clone(), settings))
        }
        None => None,
    };
    let xds_unix = match &opts.xds_socket {
        Some(socket) => Some(bind_xds_socket(socket)?),
        None => None,
    };
    let bound = Bound {
        xds: xds_tls.as_ref().and_then(|(l, ..)| l.local_addr().ok()),
        xds_socket: opts.xds_socket.as_ref().map(|s| s.path.clone()),
        admin: admin_listener.local_addr()?,
    };
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(admin::serve_agent(
        admin_listener,
        Arc::clone(&agent),
        xds.clone(),
        admin::ServeOptions {
            max_connections: opts.admin_max_connections.max(1),
            startup_taint: startup_taint.as_ref().map(|(r, _)| Arc::clone(r)),
            ..admin::ServeOptions::default()
        },
        stopped(stop_rx.clone()),
    ));
    if let Some((listener, server_tls, files, settings)) = xds_tls {
        let xds = xds.clone();
        let stop = stopped(stop_rx.clone());
        let reload = Arc::clone(&server_tls);
        tasks.spawn(async move {
            if let Err(e) = xds.serve_tls_reloadable(listener, server_tls, stop).await {
                tracing::error!("xDS server (mTLS) failed: {e}");
            }
        });
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            tokio::select! {
                _ = until_stopped(&mut stop) => {}
                _ = reload_xds_tls(files, settings, reload, TLS_RELOAD_INTERVAL) => {}
            }
        });
    }
    if let Some(listener) = xds_unix {
        let xds = xds.clone();
        let stop = stopped(stop_rx.clone());
        let path = bound.xds_socket.clone().unwrap_or_default();
        tasks.spawn(async move {
            if let Err(e) = xds.serve_unix_listener(listener, &path, stop).await {
                tracing::error!(path = %path.display(), "xDS server (unix) failed: {e}");
            }
        });
    }

    // The CNI socket is bound before the load (which makes /readyz ready), so a
    // ready agent never refuses a CNI call (a stale socket file of a crashed agent
    // answered ECONNREFUSED until the bind) and a bind error stops the start; requests
    // wait in the backlog until the load is done.
    let socket = opts.cni_socket.clone();
    let cni_listener = CniServer::bind(&socket)
        .with_context(|| format!("binding the CNI socket {}", socket.display()))?;
    // Every listener is bound: the binary drops the capabilities binding needed here,
    // before the load starts blocking-pool threads that would inherit them.
    on_bound(bound);

    // Load the store (merging, R3) before serving CNI: a DEL for a stored pod then
    // finds it.
    let (loaded, quarantined) = agent.load().await.map_err(|e| anyhow::anyhow!(e))?;
    tracing::info!(loaded, quarantined, registry = %reg.describe(), "agent started");

    let cni = CniServer::new(Arc::clone(&agent));
    let stop = stopped(stop_rx.clone());
    tasks.spawn(async move {
        if let Err(e) = cni.serve_bound(cni_listener, &socket, stop).await {
            tracing::error!(socket = %socket.display(), "CNI server failed: {e}");
        }
    });
    if let Some(file) = &opts.ready_file
        && let Err(e) = crate::node_lock::write_ready_file(file, "serving")
    {
        tracing::warn!(file = %file.display(), "--ready-file: {e}");
    }

    if let Some((readiness, client)) = startup_taint {
        tasks.spawn(readiness.run(client, opts.agent.node_name.clone(), stop_rx.clone()));
    }
    tasks.spawn(refresher(Arc::clone(&agent), stop_rx.clone()));
    if let Some(ca) = rotation {
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            tokio::select! {
                _ = until_stopped(&mut stop) => {}
                _ = ca.run_rotation(Duration::from_secs(5)) => {}
            }
        });
    }
    if let Some(remote) = remote_rotation {
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            tokio::select! {
                _ = until_stopped(&mut stop) => {}
                _ = remote.run_rotation(Duration::from_secs(5)) => {}
            }
        });
    }
    if let Some((ca, dir)) = ca_watch {
        let mut stop = stop_rx.clone();
        tasks.spawn(async move {
            tokio::select! {
                _ = until_stopped(&mut stop) => {}
                // Half a second of quiet after the last event: a Secret update is a
                // burst of a few events within milliseconds.
                _ = ca.watch_ca_dir(dir, Duration::from_millis(500), Duration::from_secs(60)) => {}
            }
        });
    }
    if let Some(dir) = opts.authz_dir.clone() {
        let mut stop = stop_rx.clone();
        let agent = Arc::clone(&agent);
        tasks.spawn(async move {
            tokio::select! {
                _ = until_stopped(&mut stop) => {}
                _ = crate::agent::policies::watch_dir(agent, dir, Duration::from_secs(30)) => {}
            }
        });
    }
    if let Some(dir) = opts.routes_dir.clone() {
        let mut stop = stop_rx.clone();
        let agent = Arc::clone(&agent);
        tasks.spawn(async move {
            tokio::select! {
                _ = until_stopped(&mut stop) => {}
                _ = crate::agent::routes::watch_dir(agent, dir, Duration::from_secs(30)) => {}
            }
        });
    }
    if let Some(kube) = agent.kube().cloned() {
        let mut stop = stop_rx.clone();
        let agent = Arc::clone(&agent);
        tasks.spawn(async move {
            tokio::select! {
                _ = until_stopped(&mut stop) => {}
                _ = crate::agent::policies::follow_kube(agent, kube) => {}
            }
        });
    }
    if let Some(kube) = agent.kube().cloned() {
        let mut stop = stop_rx.clone();
        let agent = Arc::clone(&agent);
        tasks.spawn(async move {
            tokio::select! {
                _ = until_stopped(&mut stop) => {}
                _ = crate::agent::routes::follow_kube(agent, kube) => {}
            }
        });
    }
    tasks.spawn(liveness_loop(Arc::clone(&agent), stop_rx.clone()));
    tasks.spawn(gc_loop(Arc::clone(&agent), stop_rx.clone()));
    // Kube mode: registrations follow labels and Services (returns at once without).
    tasks.spawn(Arc::clone(&agent).run_kube_resync(stop_rx.clone()));

    shutdown.await;
    tracing::info!("shutting down");
    if let Some(file) = &opts.ready_file {
        let _ = std::fs::remove_file(file);
    }
    let _ = stop_tx.send(true);
    xds.shutdown();
    while tasks.join_next().await.is_some() {}
    Ok(())
}

/// How often the mTLS listener's files are read for a rotation.
pub const TLS_RELOAD_INTERVAL: Duration = Duration::from_secs(2);

/// Reads the mTLS listener's files every `every` and, when their content changed,
/// gives the listener the new material: connections accepted after that are
/// handshaken with it, established ones keep theirs. The files are rotated by whoever
/// issues them (cert-manager, a mounted Secret, the operator), and a certificate read
/// once would be served past its expiry. A set that does not load (a key that is not
/// the certificate's, half-written PEM while the files are swapped one by one) is
/// logged at `warn` once per content and the current material kept; the next change
/// is tried again.
async fn reload_xds_tls(
    files: XdsTls,
    mut current: TlsSettings,
    server: Arc<ServerTls>,
    every: Duration,
) {
    let mut refused: Option<TlsSettings> = None;
    let same = |a: &TlsSettings, b: &TlsSettings| {
        a.cert_chain_pem == b.cert_chain_pem
            && *a.key_pem == *b.key_pem
            && a.client_ca_pem == b.client_ca_pem
    };
    loop {
        tokio::time::sleep(every).await;
        let read = {
            let files = files.clone();
            tokio::task::spawn_blocking(move || read_tls_settings(&files)).await
        };
        let next = match read {
            Ok(Ok(next)) => next,
            Ok(Err(e)) => {
                tracing::debug!("re-reading the xDS TLS files: {e:#}");
                continue;
            }
            Err(_) => continue,
        };
        if same(&next, &current) || refused.as_ref().is_some_and(|r| same(r, &next)) {
            continue;
        }
        match server.replace(&next) {
            Ok(()) => {
                tracing::info!(
                    cert = %files.cert.display(),
                    "xDS TLS certificate, key or client CA changed; new connections use them"
                );
                current = next;
                refused = None;
            }
            Err(e) => {
                tracing::warn!(
                    cert = %files.cert.display(),
                    "the changed xDS TLS files do not load; keeping the current ones: {e}"
                );
                refused = Some(next);
            }
        }
    }
}

/// Reads the mTLS files of `tls`; the key goes straight into a zeroizing buffer.
fn read_tls_settings(tls: &XdsTls) -> anyhow::Result<TlsSettings> {
    let read = |what: &str, path: &Path| {
        std::fs::read_to_string(path).with_context(|| format!("reading {what} {}", path.display()))
    };
    let cert_chain_pem = read("--xds-tls-cert", &tls.cert)?;
    let key_pem = zeroize::Zeroizing::new(read("--xds-tls-key", &tls.key)?);
    let client_ca_pem = read("--xds-tls-client-ca", &tls.client_ca)?;
    Ok(TlsSettings {
        cert_chain_pem,
        key_pem,
        client_ca_pem,
    })
}

/// Binds the xDS unix socket: its directory private to us (0700; 0711 when another uid
/// or a group must reach the socket: traversable, never listable or writable by
/// others), the socket 0600 — or 0660 for `group` — and handed to `owner_uid`.
///
/// Why chown to the Envoy uid rather than a shared group by default: connecting needs
/// write permission on the socket, and an owner-only socket admits exactly that uid (a
/// group admits every member of it, which is more than the allow-list names). The
/// chown is on a path in a directory only we can write, so nobody can swap the socket
/// for a symlink between the bind and the chown (and `lchown` would not follow one).
fn bind_xds_socket(socket: &XdsSocket) -> anyhow::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt as _;
    let path = &socket.path;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    ensure_private_dir(dir)
        .with_context(|| format!("preparing the xDS socket directory {}", dir.display()))?;
    if socket.owner_uid.is_some() || socket.group.is_some() {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o711))
            .with_context(|| format!("chmod 0711 {}", dir.display()))?;
    }
    let mode = if socket.group.is_some() { 0o660 } else { 0o600 };
    let listener = bind_unix_with_mode(path, mode)
        .with_context(|| format!("binding the xDS socket {}", path.display()))?;
    if socket.owner_uid.is_some() || socket.group.is_some() {
        std::os::unix::fs::lchown(path, socket.owner_uid, socket.group).with_context(|| {
            format!(
                "handing the xDS socket {} to uid {:?} gid {:?}",
                path.display(),
                socket.owner_uid,
                socket.group
            )
        })?;
    }
    Ok(listener)
}

/// Where Envoy's admin listens, in the bootstrap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnvoyAdmin {
    /// A unix socket of mode 0600 (`admin.address.pipe`): the default, in
    /// flock-supervisor's 0700 control directory, so only Envoy's uid reaches it.
    Socket(PathBuf),
    /// `127.0.0.1:PORT`: opt-in compatibility. Any process on the host (or a pod on the
    /// host network) reaches a loopback port, and Envoy's admin can stop it
    /// (`/quitquitquit`) and dump its config, secrets included.
    LoopbackPort(u16),
}

/// The bootstrap's cluster of the agent's xDS socket (ADS, and the access log service
/// that takes authorization denials).
pub const XDS_CLUSTER: &str = "xds";

/// The admin socket's mode: owner read and write only (Envoy's `pipe.mode`).
pub const ENVOY_ADMIN_SOCKET_MODE: u32 = 0o600;

/// The Envoy bootstrap (JSON) matching an agent's flags: ADS over Delta xDS on the
/// agent's unix socket (Envoy's `pipe` address), node `node_id` of `cluster`, listeners
/// and clusters over ADS, admin on `admin` (a 0600 unix socket by default: Envoy's
/// admin can stop it and dump its config, secrets included).
pub fn envoy_bootstrap(
    node_id: &str,
    cluster: &str,
    xds_socket: &Path,
    admin: &EnvoyAdmin,
) -> serde_json::Value {
    envoy_bootstrap_with(node_id, cluster, xds_socket, admin, &EnvoyLimits::default())
}

/// Envoy's resource limits in the bootstrap (its overload manager).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EnvoyLimits {
    /// The Envoy container's memory limit, in bytes (`--envoy-memory-limit`): when
    /// set, Envoy's heap is watched against [`ENVOY_HEAP_SHARE_PERCENT`] of it.
    pub memory_limit_bytes: Option<u64>,
    /// Most downstream connections Envoy holds open at once, all listeners together.
    pub max_downstream_connections: u64,
}

/// The default of [`EnvoyLimits::max_downstream_connections`].
pub const DEFAULT_ENVOY_MAX_CONNECTIONS: u64 = 65_536;

/// The share of the container's memory limit Envoy's heap may use before it sheds
/// load: the rest is for what the heap monitor does not count (thread stacks, the
/// hot-restart shared memory, the allocator's free pages).
pub const ENVOY_HEAP_SHARE_PERCENT: u64 = 90;

impl Default for EnvoyLimits {
    fn default() -> Self {
        EnvoyLimits {
            memory_limit_bytes: None,
            max_downstream_connections: DEFAULT_ENVOY_MAX_CONNECTIONS,
        }
    }
}

/// The bootstrap's overload manager: one Envoy carries every pod of the node, so one
/// service's load (a flood of connections, requests whose buffers grow the heap) must
/// degrade that load, not kill the proxy every pod depends on. Always: a cap on the
/// downstream connections of all listeners (Envoy refuses new ones beyond it). With a
/// memory limit: the heap is watched against [`ENVOY_HEAP_SHARE_PERCENT`] of it; at
/// 90% of that Envoy returns free memory to the system (`shrink_heap`), at 95% it
/// stops keeping connections alive (`disable_http_keepalive`), and at 98% it
/// answers new requests with 503 (`stop_accepting_requests`) until the heap falls
/// back: the container is not OOM-killed, which would drop every connection of the
/// node.
pub fn overload_manager(limits: &EnvoyLimits) -> serde_json::Value {
    let mut monitors = vec![serde_json::json!({
        "name": "envoy.resource_monitors.global_downstream_max_connections",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.resource_monitors.downstream_connections.v3.DownstreamConnectionsConfig",
            "max_active_downstream_connections": limits.max_downstream_connections
        }
    })];
    let mut actions = Vec::new();
    if let Some(bytes) = limits.memory_limit_bytes {
        const HEAP: &str = "envoy.resource_monitors.fixed_heap";
        monitors.push(serde_json::json!({
            "name": HEAP,
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.resource_monitors.fixed_heap.v3.FixedHeapConfig",
                "max_heap_size_bytes": bytes / 100 * ENVOY_HEAP_SHARE_PERCENT
            }
        }));
        for (action, at) in [
            ("envoy.overload_actions.shrink_heap", 0.90),
            ("envoy.overload_actions.disable_http_keepalive", 0.95),
            ("envoy.overload_actions.stop_accepting_requests", 0.98),
        ] {
            actions.push(serde_json::json!({
                "name": action,
                "triggers": [{ "name": HEAP, "threshold": { "value": at } }]
            }));
        }
    }
    serde_json::json!({
        "refresh_interval": "0.25s",
        "resource_monitors": monitors,
        "actions": actions
    })
}

/// [`envoy_bootstrap`] with `limits` in its overload manager.
pub fn envoy_bootstrap_with(
    node_id: &str,
    cluster: &str,
    xds_socket: &Path,
    admin: &EnvoyAdmin,
    limits: &EnvoyLimits,
) -> serde_json::Value {
    let admin_address = match admin {
        EnvoyAdmin::Socket(path) => serde_json::json!({
            "pipe": { "path": path, "mode": ENVOY_ADMIN_SOCKET_MODE }
        }),
        EnvoyAdmin::LoopbackPort(port) => serde_json::json!({
            "socket_address": { "address": "127.0.0.1", "port_value": port }
        }),
    };
    serde_json::json!({
        "node": { "id": node_id, "cluster": cluster },
        "admin": { "address": admin_address },
        "overload_manager": overload_manager(limits),
        "dynamic_resources": {
            "ads_config": {
                "api_type": "DELTA_GRPC",
                "transport_api_version": "V3",
                "set_node_on_first_message_only": true,
                "grpc_services": [{ "envoy_grpc": { "cluster_name": XDS_CLUSTER } }]
            },
            "cds_config": { "ads": {}, "resource_api_version": "V3" },
            "lds_config": { "ads": {}, "resource_api_version": "V3" }
        },
        "static_resources": {
            "clusters": [{
                "name": XDS_CLUSTER,
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": {
                    "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": { "http2_protocol_options": {} }
                    }
                },
                "load_assignment": {
                    "cluster_name": XDS_CLUSTER,
                    "endpoints": [{
                        "lb_endpoints": [{
                            "endpoint": { "address": { "pipe": { "path": xds_socket.to_string_lossy() } } }
                        }]
                    }]
                }
            }]
        }
    })
}

/// Republishes when the registry view or the identity view changes.
async fn refresher(agent: Arc<Agent>, stop: watch::Receiver<bool>) {
    let view = agent.registry().view();
    // Identity changes (new SVIDs, rotations, bundles) republish SDS the same way.
    let ids = agent.identity().map(|p| p.view());
    let quiet = agent.config().refresh_debounce;
    refresh_loop(
        view,
        ids,
        quiet,
        || {
            let version = agent.publish();
            tracing::debug!(version, "registry or identity changed; published");
        },
        stop,
    )
    .await;
}

/// Calls `publish` after changes of `view` or `ids`, through a
/// [`flock_core::debounce::Debounce`]: a burst of changes becomes one publish `quiet`
/// after its last change, and a stream that never goes quiet still publishes every
/// `2 × quiet` (the cap). The cap bounds the change-to-Envoy latency under constant
/// churn (a rolling restart of a big Deployment): with publish cost proportional to
/// what changed, five publishes a second cost little, where a cap of ten quiet
/// periods held every change of a churning cluster back for up to a second. Reads the monotonic clock once per event (a change or a
/// deadline); returns when `stop` turns true or a sender is gone.
pub async fn refresh_loop<A, B>(
    mut view: watch::Receiver<A>,
    mut ids: Option<watch::Receiver<B>>,
    quiet: Duration,
    mut publish: impl FnMut(),
    mut stop: watch::Receiver<bool>,
) {
    let quiet_ms = u64::try_from(quiet.as_millis()).unwrap_or(u64::MAX);
    let mut debounce = Debounce::new(quiet_ms).with_cap(quiet_ms.saturating_mul(2));
    loop {
        let deadline = debounce.deadline();
        let changed = tokio::select! {
            _ = until_stopped(&mut stop) => return,
            changed = view.changed() => {
                if changed.is_err() { return }
                view.borrow_and_update();
                true
            }
            changed = async {
                match ids.as_mut() {
                    Some(rx) => rx.changed().await,
                    None => std::future::pending().await,
                }
            } => {
                if changed.is_err() { return }
                if let Some(rx) = ids.as_mut() {
                    rx.borrow_and_update();
                }
                true
            }
            () = async {
                match deadline {
                    Some(at) => tokio::time::sleep_until(flock_clock::mono_instant(at)).await,
                    None => std::future::pending().await,
                }
            } => false,
        };
        let now = flock_clock::mono_now();
        if changed {
            debounce.trigger(now);
        }
        if debounce.poll(now) == DebouncePoll::Fire {
            publish();
        }
    }
}

async fn liveness_loop(agent: Arc<Agent>, mut stop: watch::Receiver<bool>) {
    // Each pod has its own schedule (flock-core's tracker): the loop sleeps until the
    // core's next probe deadline, and at most a tick (so a pod added meanwhile, due at
    // once, waits no longer than that).
    let tick = Duration::from_millis(agent.config().liveness.interval_ms.clamp(100, 1000));
    loop {
        let now = tokio::time::Instant::now();
        let latest = now + tick;
        // Never sooner than 20 ms: a deadline left in the past (a probe whose task
        // failed) must not turn the loop into a spin.
        let wake = agent
            .next_probe()
            .map(flock_clock::mono_instant)
            .map_or(latest, |at| {
                at.clamp(now + Duration::from_millis(20), latest)
            });
        tokio::select! {
            _ = until_stopped(&mut stop) => return,
            () = tokio::time::sleep_until(wake) => agent.liveness_round().await,
        }
    }
}

/// Orphan GC: on start, on every registry (re)connect, and every `gc_interval`.
async fn gc_loop(agent: Arc<Agent>, mut stop: watch::Receiver<bool>) {
    let mut view = agent.registry().view();
    let mut generation = 0;
    let mut interval = tokio::time::interval(agent.config().gc_interval);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = until_stopped(&mut stop) => return,
            _ = interval.tick() => {}
            changed = view.changed() => {
                if changed.is_err() { return }
                let g = view.borrow_and_update().generation;
                if g == generation { continue }
                generation = g;
                // A reconnect: endpoints may have expired with an old lease. The
                // registry sync wakes on the reconnect by itself and puts back what
                // is missing (each call bounded); the sweep below runs after it.
                agent.request_registry_sync();
            }
        }
        let removed = agent.gc_sweep(None).await;
        if removed > 0 {
            tracing::info!(removed, "orphan GC sweep removed items");
        }
        // Kube mode: pods that run without the mesh (`crate::repair`).
        if let (Some(repairer), Some(kube)) = (agent.repairer(), agent.kube()) {
            repairer.sweep(&agent, kube).await;
        }
    }
}

/// Resolves once `stop` says so (the borrow of the value ends inside, so the
/// future stays `Send`).
async fn until_stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
