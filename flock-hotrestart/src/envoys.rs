//! The Envoy side of the supervisor, behind one trait: validating the config,
//! starting and signalling epochs, and the admin endpoint (which epoch is LIVE, the
//! graceful drain). [`RealEnvoys`] runs the real Envoy; the I/O loop is generic over
//! [`Envoys`] so a test can run it on a paused clock against a fake.

use std::collections::BTreeMap;
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::process::ExitStatus;
use std::time::Duration;

use flock_core::epoch::PredecessorStatus;
use flock_core::epoch::supervisor::Stop;
use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use tracing::{debug, info, warn};

use crate::admin::AdminClient;
use crate::config::Config;
use crate::envoy::EnvoySpec;

/// How an Envoy process's exit is awaited.
pub type ExitFuture = Pin<Box<dyn Future<Output = io::Result<ExitStatus>> + Send>>;

/// The Envoy side of the supervisor: its processes and its admin endpoint. The real
/// one ([`RealEnvoys`]) runs Envoy; a test can run the I/O loop against a fake one on
/// a paused clock.
pub trait Envoys {
    /// `envoy --mode validate` on the config; the error says why it was rejected.
    fn validate(&mut self) -> impl Future<Output = Result<(), String>>;
    /// Starts epoch `epoch` on `base_id`; returns its pid (for the log) and its exit.
    fn spawn(&mut self, epoch: u32, base_id: u32) -> io::Result<(u32, ExitFuture)>;
    /// Signals epoch `epoch` (a no-op once it exited).
    fn signal(&mut self, epoch: u32, stop: Stop);
    /// Which epoch the admin endpoint reports.
    fn probe(&mut self) -> impl Future<Output = PredecessorStatus>;
    /// Drains through the admin endpoint if it answers for `epoch` of `base_id`;
    /// returns whether it did (never drain a successor's Envoy), and whether a later
    /// epoch of `base_id` answered instead (a successor's).
    fn drain(&mut self, epoch: u32, base_id: u32) -> impl Future<Output = (bool, bool)>;
}

/// Real Envoy processes and their admin endpoint.
pub struct RealEnvoys {
    envoy: EnvoySpec,
    admin: AdminClient,
    validate_timeout: Duration,
    drain_time_s: u64,
    pids: BTreeMap<u32, Pid>,
}

impl RealEnvoys {
    /// The Envoy `cfg` describes.
    pub fn new(cfg: &Config) -> Self {
        Self {
            envoy: EnvoySpec {
                bin: cfg.envoy_bin.clone(),
                config: cfg.config.clone(),
                drain_time_s: cfg.drain_time_s,
                parent_shutdown_time_s: cfg.parent_shutdown_time_s,
                extra_args: cfg.envoy_args.clone(),
                shim: cfg.shim.clone(),
                control_dir: Some(cfg.control_dir()),
            },
            admin: AdminClient::new(cfg.admin(), cfg.admin_timeout),
            validate_timeout: cfg.validate_timeout,
            drain_time_s: cfg.drain_time_s,
            pids: BTreeMap::new(),
        }
    }
}

impl Envoys for RealEnvoys {
    async fn validate(&mut self) -> Result<(), String> {
        self.envoy
            .validate(self.validate_timeout)
            .await
            .map_err(|e| e.to_string())
    }

    fn spawn(&mut self, epoch: u32, base_id: u32) -> io::Result<(u32, ExitFuture)> {
        let mut child = self.envoy.spawn(epoch, base_id)?;
        let pid = child
            .id()
            .ok_or_else(|| io::Error::other("exited before its pid was read"))?;
        self.pids
            .insert(epoch, Pid::from_raw(i32::try_from(pid).unwrap_or(i32::MAX)));
        Ok((pid, Box::pin(async move { child.wait().await })))
    }

    fn signal(&mut self, epoch: u32, stop: Stop) {
        let sig = match stop {
            Stop::Term => Signal::SIGTERM,
            Stop::Kill => Signal::SIGKILL,
        };
        if let Some(pid) = self.pids.get(&epoch)
            && let Err(e) = kill(*pid, sig)
        {
            debug!(epoch, error = %e, "signal {sig} not delivered");
        }
    }

    async fn probe(&mut self) -> PredecessorStatus {
        self.admin.probe().await
    }

    async fn drain(&mut self, epoch: u32, base_id: u32) -> (bool, bool) {
        let info = self.admin.server_info().await;
        let ours = matches!(&info, Ok(info) if info.epoch == epoch && info.base_id == base_id);
        let successor = matches!(&info, Ok(info) if info.epoch > epoch && info.base_id == base_id);
        if successor {
            info!(
                "a later epoch answers on the admin endpoint (another supervisor took Envoy \
                 over): leaving epoch {epoch} to its parent shutdown"
            );
            return (false, true);
        }
        if ours {
            match self.admin.drain_listeners_gracefully().await {
                Ok(()) => info!("draining listeners for {} s", self.drain_time_s),
                Err(e) => {
                    warn!(error = %e, "drain_listeners failed; stopping after the drain time")
                }
            }
        } else {
            info!("epoch {epoch} does not answer on the admin endpoint; stopping without a drain");
        }
        (ours, false)
    }
}
