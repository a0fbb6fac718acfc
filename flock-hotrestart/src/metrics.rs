//! Supervisor metrics, exported as a Prometheus text-format file.
//!
//! A textfile (for node-exporter's textfile collector, or any scraper that reads a
//! file) rather than an HTTP endpoint: the supervisor then opens no port of its own
//! beside Envoy's, and the file is still readable when the supervisor is wedged.
//! It is replaced atomically (temporary file + `rename`) on every change and every
//! heartbeat, mode `0644` (metrics are not secret and the collector usually runs as
//! another user), and never written through a symlink.

use std::fs::{self, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use std::sync::atomic::AtomicU64;

use nix::fcntl::OFlag;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The counters and gauges of one supervisor.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics {
    /// Hot restarts forked because of a trigger (SIGHUP, config change).
    pub restarts_trigger: u64,
    /// Restarts after the newest epoch died unexpectedly.
    pub restarts_crash: u64,
    /// Triggers received.
    pub triggers: u64,
    /// Restarts deferred because the newest epoch was not LIVE (R7) or its
    /// predecessor was still draining.
    pub deferrals: u64,
    /// Configs rejected by `envoy --mode validate`.
    pub validation_failures: u64,
    /// The newest epoch started by this supervisor (-1: none).
    pub current_epoch: i64,
    /// The base id of the chain.
    pub base_id: u32,
    /// 1 while the newest epoch is LIVE.
    pub live: bool,
    /// Envoy processes of this supervisor still running.
    pub children: u64,
    /// Seconds from the last hot-restart fork to that epoch LIVE.
    pub last_restart_seconds: f64,
}

/// The `cause` label of `flock_supervisor_restarts_total`.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct Cause {
    cause: &'static str,
}

impl Metrics {
    /// The Prometheus text exposition (encoded by `prometheus_client`).
    pub fn render(&self) -> String {
        let mut registry = Registry::default();
        let counter = |registry: &mut Registry, name: &str, help: &str, value: u64| {
            let c = Counter::<u64>::default();
            c.inc_by(value);
            registry.register(name, help, c);
        };
        let gauge = |registry: &mut Registry, name: &str, help: &str, value: i64| {
            let g = Gauge::<i64>::default();
            g.set(value);
            registry.register(name, help, g);
        };
        counter(
            &mut registry,
            "flock_supervisor_triggers",
            "Hot-restart triggers received (SIGHUP, config file changes).",
            self.triggers,
        );
        let restarts = Family::<Cause, Counter>::default();
        restarts
            .get_or_create(&Cause { cause: "trigger" })
            .inc_by(self.restarts_trigger);
        restarts
            .get_or_create(&Cause { cause: "crash" })
            .inc_by(self.restarts_crash);
        registry.register(
            "flock_supervisor_restarts",
            "Envoy epochs started after the first, by cause.",
            restarts,
        );
        counter(
            &mut registry,
            "flock_supervisor_deferrals",
            "Restarts deferred: the newest epoch was not LIVE, or its predecessor was still draining.",
            self.deferrals,
        );
        counter(
            &mut registry,
            "flock_supervisor_validation_failures",
            "Configs rejected by envoy --mode validate (never started).",
            self.validation_failures,
        );
        gauge(
            &mut registry,
            "flock_supervisor_current_epoch",
            "The newest Envoy restart epoch of this supervisor (-1: none).",
            self.current_epoch,
        );
        gauge(
            &mut registry,
            "flock_supervisor_base_id",
            "The Envoy base id of this supervisor's chain.",
            i64::from(self.base_id),
        );
        gauge(
            &mut registry,
            "flock_supervisor_epoch_live",
            "1 while the newest epoch is LIVE on the admin endpoint.",
            i64::from(self.live),
        );
        gauge(
            &mut registry,
            "flock_supervisor_envoy_processes",
            "Envoy processes (all epochs) of this supervisor still running.",
            i64::try_from(self.children).unwrap_or(i64::MAX),
        );
        let last = Gauge::<f64, AtomicU64>::default();
        last.set(self.last_restart_seconds);
        registry.register(
            "flock_supervisor_last_restart_seconds",
            "Seconds from the last hot-restart fork to the new epoch LIVE.",
            last,
        );
        flock_telemetry::metrics::render(&registry)
    }

    /// Writes [`render`](Self::render) to `path` atomically (see the module docs).
    pub fn write_textfile(&self, path: &Path) -> io::Result<()> {
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".tmp.{}", std::process::id()));
        let tmp = std::path::PathBuf::from(tmp);
        let _ = fs::remove_file(&tmp);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
            .open(&tmp)?;
        file.write_all(self.render().as_bytes())?;
        drop(file);
        fs::rename(&tmp, path)
    }
}

/// Creates (`0644`, the epoch number as content) or removes the ready file.
pub fn set_ready_file(path: &Path, ready: Option<u32>) -> io::Result<()> {
    match ready {
        Some(epoch) => {
            let mut tmp = path.as_os_str().to_owned();
            tmp.push(".tmp");
            let tmp = std::path::PathBuf::from(tmp);
            let _ = fs::remove_file(&tmp);
            let mut file = OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o644)
                .custom_flags((OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC).bits())
                .open(&tmp)?;
            writeln!(file, "{epoch}")?;
            drop(file);
            fs::rename(&tmp, path)
        }
        None => match fs::remove_file(path) {
            Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_prometheus_text() {
        let m = Metrics {
            restarts_trigger: 3,
            deferrals: 2,
            current_epoch: 3,
            live: true,
            ..Metrics::default()
        };
        let text = m.render();
        assert!(
            text.contains("\nflock_supervisor_deferrals_total 2\n"),
            "{text}"
        );
        assert!(text.contains("flock_supervisor_restarts_total{cause=\"trigger\"} 3\n"));
        assert!(text.contains("\nflock_supervisor_current_epoch 3\n"));
        assert!(text.contains("\nflock_supervisor_epoch_live 1\n"));
        assert!(text.contains("# TYPE flock_supervisor_validation_failures_total counter\n"));
        assert!(text.contains("\nflock_supervisor_current_epoch 3\n"));
        assert!(text.contains("flock_supervisor_restarts_total{cause=\"crash\"} 0\n"));
        // Every sample line is `name[{labels}] value`.
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let (_, value) = line.rsplit_once(' ').unwrap();
            value.parse::<f64>().unwrap();
        }
    }
}
