//! Wires an [`Agent`] to real I/O: the pod store, the registry, the xDS server, the
//! CNI socket, the admin endpoint, and the refresher, liveness and GC loops.

use crate::admin;
use crate::agent::{Agent, AgentConfig, group_of};
use crate::cni_server::CniServer;
use crate::identity::IdentityProvider as _;
use crate::identity::{BuiltinCa, SpireBridge};
use crate::registry::{self, RegistryOptions};
use crate::store::PodStore;
use anyhow::Context as _;
use flock_core::debounce::{Debounce, DebouncePoll};
use flock_xds::cache::Cache;
use flock_xds::server::Server;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::watch;

/// Where the agent keeps state and listens.
#[derive(Debug, Clone)]
pub struct Options {
    /// The agent's settings.
    pub agent: AgentConfig,
    /// The pod store directory.
    pub state_dir: PathBuf,
    /// The CNI socket (created 0600).
    pub cni_socket: PathBuf,
    /// xDS over TCP, if any.
    pub xds_address: Option<SocketAddr>,
    /// xDS over a unix socket (0600), if any.
    pub xds_socket: Option<PathBuf>,
    /// The admin endpoint.
    pub admin_address: SocketAddr,
    /// `memory`, `file:PATH` or `etcd://HOST:PORT[,…]`.
    pub registry: String,
    /// Lease TTL of etcd registrations, seconds.
    pub registry_ttl_secs: i64,
    /// Where pods' workload identities come from.
    pub identity: IdentitySource,
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
            }),
            s if s.starts_with("spire:") => match &s["spire:".len()..] {
                "" => Err(format!(
                    "--identity {s}: expected spire:PATH (the SPIRE agent admin socket)"
                )),
                path => Ok(Self::Spire {
                    socket: PathBuf::from(path),
                }),
            },
            s => Err(format!(
                "--identity {s:?}: expected builtin, none or spire:PATH"
            )),
        }
    }
}

/// The addresses a running agent actually bound (ports may have been 0).
#[derive(Debug, Clone)]
pub struct Bound {
    /// xDS TCP address.
    pub xds: Option<SocketAddr>,
    /// Admin address.
    pub admin: SocketAddr,
}

/// Runs the agent until `shutdown` resolves. `on_bound` is called once every
/// listener is bound (tests use it to learn ephemeral ports).
pub async fn run(
    opts: Options,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    on_bound: impl FnOnce(Bound) + Send,
) -> anyhow::Result<()> {
    let store = Arc::new(
        PodStore::open(&opts.state_dir)
            .with_context(|| format!("opening the pod store in {}", opts.state_dir.display()))?,
    );
    let spec =
        registry::parse_spec(&opts.registry).map_err(|e| anyhow::anyhow!("--registry: {e}"))?;
    let reg = registry::connect(
        &spec,
        RegistryOptions {
            node: opts.agent.node_name.clone(),
            lease_ttl_secs: opts.registry_ttl_secs,
            ..RegistryOptions::default()
        },
    )
    .await
    .with_context(|| format!("connecting to the registry {}", opts.registry))?;
    let cache = Arc::new(Cache::new(group_of));
    let mut agent = Agent::new(
        opts.agent.clone(),
        store,
        Arc::clone(&reg),
        Arc::clone(&cache),
    );
    let mut rotation = None;
    if let IdentitySource::Builtin {
        trust_domain,
        svid_ttl,
    } = &opts.identity
    {
        let ca = BuiltinCa::new(trust_domain, *svid_ttl, flock_clock::unix_now)
            .map_err(|e| anyhow::anyhow!("--identity builtin: {e}"))?;
        tracing::info!(identity = %ca.describe(), "workload identity: node-local CA (keys in memory only)");
        rotation = Some(Arc::clone(&ca));
        agent = agent.with_identity(ca);
    }
    if let IdentitySource::Spire { socket } = &opts.identity {
        // Connects (and reconnects) in the background; subscriptions wait for it.
        let bridge = SpireBridge::connect(socket.clone());
        tracing::info!(identity = %bridge.describe(), "workload identity: SPIRE Delegated Identity API");
        agent = agent.with_identity(bridge);
    }
    let agent = Arc::new(agent);
    let xds = Server::builder(Arc::clone(&cache))
        .identifier(format!("flock-agent/{}", opts.agent.node_name))
        .build();

    let (stop_tx, stop_rx) = watch::channel(false);
    let stopped = |mut rx: watch::Receiver<bool>| async move {
        let _ = rx.wait_for(|s| *s).await;
    };

    // Listeners first: a bind error is reported before anything else starts.
    let admin_listener = tokio::net::TcpListener::bind(opts.admin_address)
        .await
        .with_context(|| format!("binding the admin address {}", opts.admin_address))?;
    let xds_listener = match opts.xds_address {
        Some(addr) => Some(
            tokio::net::TcpListener::bind(addr)
                .await
                .with_context(|| format!("binding the xDS address {addr}"))?,
        ),
        None => None,
    };
    let bound = Bound {
        xds: xds_listener.as_ref().and_then(|l| l.local_addr().ok()),
        admin: admin_listener.local_addr()?,
    };
    let mut tasks = tokio::task::JoinSet::new();
    tasks.spawn(admin::serve(
        admin_listener,
        Arc::clone(&agent),
        xds.clone(),
        stopped(stop_rx.clone()),
    ));
    if let Some(listener) = xds_listener {
        let xds = xds.clone();
        let stop = stopped(stop_rx.clone());
        tasks.spawn(async move {
            if let Err(e) = xds.serve_tcp(listener, stop).await {
                tracing::error!("xDS server (TCP) failed: {e}");
            }
        });
    }
    if let Some(path) = opts.xds_socket.clone() {
        let xds = xds.clone();
        let stop = stopped(stop_rx.clone());
        tasks.spawn(async move {
            if let Err(e) = xds.serve_unix(&path, stop).await {
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
    tasks.spawn(liveness_loop(Arc::clone(&agent), stop_rx.clone()));
    tasks.spawn(gc_loop(Arc::clone(&agent), stop_rx.clone()));
    on_bound(bound);

    shutdown.await;
    tracing::info!("shutting down");
    let _ = stop_tx.send(true);
    xds.shutdown();
    while tasks.join_next().await.is_some() {}
    Ok(())
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
/// `10 × quiet` (the cap). Reads the monotonic clock once per event (a change or a
/// deadline); returns when `stop` turns true or a sender is gone.
pub async fn refresh_loop<A, B>(
    mut view: watch::Receiver<A>,
    mut ids: Option<watch::Receiver<B>>,
    quiet: Duration,
    mut publish: impl FnMut(),
    mut stop: watch::Receiver<bool>,
) {
    let quiet_ms = u64::try_from(quiet.as_millis()).unwrap_or(u64::MAX);
    let mut debounce = Debounce::new(quiet_ms).with_cap(quiet_ms.saturating_mul(10));
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
    // Each pod has its own schedule (flock-core's tracker); the loop only wakes often
    // enough to honour the shortest interval.
    let tick = Duration::from_millis(agent.config().liveness.interval_ms.clamp(100, 1000));
    let mut interval = tokio::time::interval(tick);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = until_stopped(&mut stop) => return,
            _ = interval.tick() => agent.liveness_round().await,
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
                // A reconnect: endpoints may have expired with an old lease.
                for key in agent.pods().into_keys() {
                    agent.reregister(&key).await;
                }
            }
        }
        let removed = agent.gc_sweep(None).await;
        if removed > 0 {
            tracing::info!(removed, "orphan GC sweep removed items");
        }
    }
}

/// Resolves once `stop` says so (the borrow of the value ends inside, so the
/// future stays `Send`).
async fn until_stopped(stop: &mut watch::Receiver<bool>) {
    let _ = stop.wait_for(|s| *s).await;
}
