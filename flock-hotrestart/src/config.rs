//! The supervisor's configuration: its defaults, the rules a configuration must
//! follow, and its translation into the lifecycle machine's
//! [`Policy`].
//!
//! The binary maps its flags onto [`Config`] and calls [`Config::check`]; every
//! default and limit lives here so a library user gets the same ones.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flock_core::epoch::supervisor::Policy;
use flock_core::epoch::{InvalidWriterId, MAX_WRITER_LEN, WriterId};

use crate::admin::AdminAddress;
use crate::control;

/// Defaults, in the units of the binary's flags.
pub mod defaults {
    /// `--base-id`.
    pub const BASE_ID: u32 = 0;
    /// `--drain-time-s`.
    pub const DRAIN_TIME_S: u64 = 10;
    /// `--parent-shutdown-time-s`.
    pub const PARENT_SHUTDOWN_TIME_S: u64 = 15;
    /// `--debounce-ms`.
    pub const DEBOUNCE_MS: u64 = 500;
    /// `--max-debounce-ms` is this many debounces when not given.
    pub const MAX_DEBOUNCE_FACTOR: u64 = 10;
    /// The state-file heartbeat period (also the LIVE re-probe period).
    pub const HEARTBEAT_MS: u64 = 1_000;
    /// `--heartbeat-max-age-ms`.
    pub const HEARTBEAT_MAX_AGE_MS: u64 = 5_000;
    /// `--heartbeat-max-age-ms` must cover this many heartbeats, so one delayed
    /// heartbeat never makes a live owner's record stale.
    pub const MIN_HEARTBEATS_PER_MAX_AGE: u64 = 3;
    /// `--live-timeout-s`.
    pub const LIVE_TIMEOUT_S: u64 = 60;
    /// `--start-timeout-s`.
    pub const START_TIMEOUT_S: u64 = 60;
    /// `--handoff-timeout-s`.
    pub const HANDOFF_TIMEOUT_S: u64 = 30;
    /// `--shutdown-margin-s`.
    pub const SHUTDOWN_MARGIN_S: u64 = 5;
    /// `--max-restarts`.
    pub const MAX_RESTARTS: u32 = 5;
    /// A new epoch is probed this often until it is LIVE.
    pub const LIVE_PROBE_MS: u64 = 100;
    /// An epoch LIVE this long resets the consecutive-failure count.
    pub const STABLE_AFTER_MS: u64 = 10_000;
    /// Crash-restart backoff: first and largest delay.
    pub const RESTART_BACKOFF_MS: (u64, u64) = (200, 10_000);
    /// `envoy --mode validate` time limit.
    pub const VALIDATE_TIMEOUT_S: u64 = 30;
    /// Each admin request's time limit.
    pub const ADMIN_TIMEOUT_MS: u64 = 1_000;
    /// `--control-dir` is this directory inside `--state-dir` when not given.
    pub const CONTROL_DIR_NAME: &str = crate::control::DEFAULT_DIR_NAME;
    /// The host part of a default writer id is cut to this length, leaving room for
    /// `-<pid>` within the writer id's limit.
    pub const WRITER_HOST_LEN: usize = 48;
}

/// Everything the supervisor needs; the binary's flags map onto it one to one.
#[derive(Clone, Debug)]
pub struct Config {
    /// The Envoy ELF.
    pub envoy_bin: PathBuf,
    /// The bootstrap config; also watched for changes.
    pub config: PathBuf,
    /// The base id used for a cold start with no state-file record.
    pub base_id: u32,
    /// The state directory (`epoch`, `epoch.lock`).
    pub state_dir: PathBuf,
    /// Envoy's private control directory (hot-restart sockets, admin socket; see
    /// [`crate::control`]); `None`: `<state_dir>/control`.
    pub control_dir: Option<PathBuf>,
    /// Envoy's admin address, as in the bootstrap; `None`: the unix socket
    /// `<control dir>/admin.sock`.
    pub admin_address: Option<AdminAddress>,
    /// `--drain-time-s` for Envoy, and the drain at shutdown.
    pub drain_time_s: u64,
    /// `--parent-shutdown-time-s` for Envoy.
    pub parent_shutdown_time_s: u64,
    /// The restart gate's trailing debounce.
    pub debounce_ms: u64,
    /// The longest a stream of triggers can postpone a restart.
    pub max_debounce_ms: u64,
    /// Exists exactly while the newest epoch is LIVE.
    pub ready_file: Option<PathBuf>,
    /// Prometheus textfile.
    pub metrics_file: Option<PathBuf>,
    /// This supervisor's id in the state file.
    pub writer: WriterId,
    /// Heartbeat period (state file, LIVE probe).
    pub heartbeat: Duration,
    /// Records older than this are stale.
    pub heartbeat_max_age_ms: u64,
    /// A new epoch not LIVE after this long is stopped and counts as a failure.
    pub live_timeout: Duration,
    /// A new epoch is probed this often until it is LIVE.
    pub live_probe_every: Duration,
    /// An epoch LIVE this long resets the consecutive-failure count.
    pub stable_after: Duration,
    /// The longest the start decision may keep waiting before giving up.
    pub start_timeout: Duration,
    /// At SIGTERM, the longest to wait for an in-progress handoff to finish.
    pub handoff_timeout: Duration,
    /// At SIGTERM, after the drain: how long epochs get to exit before SIGKILL.
    pub shutdown_margin: Duration,
    /// Consecutive unexpected deaths tolerated before the supervisor gives up.
    pub max_restarts: u32,
    /// Restart backoff (initial, max).
    pub restart_backoff: (Duration, Duration),
    /// Watch the config file with inotify.
    pub watch_config: bool,
    /// `envoy --mode validate` time limit.
    pub validate_timeout: Duration,
    /// Each admin request's time limit.
    pub admin_timeout: Duration,
    /// Extra Envoy arguments.
    pub envoy_args: Vec<OsString>,
    /// The exec shim setting the parent-death signal (the supervisor binary).
    pub shim: Option<PathBuf>,
}

/// A configuration the supervisor refuses.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// The writer id is not a valid state-file writer.
    #[error("--writer-id: {0}")]
    WriterId(#[from] InvalidWriterId),
    /// The heartbeat max age covers fewer than three heartbeats.
    #[error(
        "--heartbeat-max-age-ms must be at least {min} ({n} heartbeats of {heartbeat} ms)",
        n = defaults::MIN_HEARTBEATS_PER_MAX_AGE
    )]
    HeartbeatMaxAge {
        /// The smallest accepted value.
        min: u64,
        /// The heartbeat period.
        heartbeat: u64,
    },
    /// The control directory's socket paths would not fit a unix socket address.
    #[error("--control-dir: {0}")]
    ControlDir(String),
}

impl Config {
    /// A configuration with every default, for `envoy_bin` running `config`, with its
    /// state in `state_dir`, Envoy's control directory `<state_dir>/control` and its
    /// admin socket `<state_dir>/control/admin.sock`.
    pub fn new(
        envoy_bin: impl Into<PathBuf>,
        config: impl Into<PathBuf>,
        state_dir: impl Into<PathBuf>,
        writer: WriterId,
    ) -> Self {
        let s = Duration::from_secs;
        let ms = Duration::from_millis;
        Self {
            envoy_bin: envoy_bin.into(),
            config: config.into(),
            base_id: defaults::BASE_ID,
            state_dir: state_dir.into(),
            control_dir: None,
            admin_address: None,
            drain_time_s: defaults::DRAIN_TIME_S,
            parent_shutdown_time_s: defaults::PARENT_SHUTDOWN_TIME_S,
            debounce_ms: defaults::DEBOUNCE_MS,
            max_debounce_ms: max_debounce_ms(defaults::DEBOUNCE_MS, None),
            ready_file: None,
            metrics_file: None,
            writer,
            heartbeat: ms(defaults::HEARTBEAT_MS),
            heartbeat_max_age_ms: defaults::HEARTBEAT_MAX_AGE_MS,
            live_timeout: s(defaults::LIVE_TIMEOUT_S),
            live_probe_every: ms(defaults::LIVE_PROBE_MS),
            stable_after: ms(defaults::STABLE_AFTER_MS),
            start_timeout: s(defaults::START_TIMEOUT_S),
            handoff_timeout: s(defaults::HANDOFF_TIMEOUT_S),
            shutdown_margin: s(defaults::SHUTDOWN_MARGIN_S),
            max_restarts: defaults::MAX_RESTARTS,
            restart_backoff: (
                ms(defaults::RESTART_BACKOFF_MS.0),
                ms(defaults::RESTART_BACKOFF_MS.1),
            ),
            watch_config: true,
            validate_timeout: s(defaults::VALIDATE_TIMEOUT_S),
            admin_timeout: ms(defaults::ADMIN_TIMEOUT_MS),
            envoy_args: Vec::new(),
            shim: None,
        }
    }

    /// Refuses a configuration that breaks a rule the decisions rely on.
    pub fn check(&self) -> Result<(), ConfigError> {
        let heartbeat = millis(self.heartbeat);
        let min = heartbeat.saturating_mul(defaults::MIN_HEARTBEATS_PER_MAX_AGE);
        if self.heartbeat_max_age_ms < min {
            return Err(ConfigError::HeartbeatMaxAge { min, heartbeat });
        }
        control::check_path_length(&self.control_dir()).map_err(ConfigError::ControlDir)?;
        Ok(())
    }

    /// Envoy's private control directory: `control_dir`, else `<state_dir>/control`.
    pub fn control_dir(&self) -> PathBuf {
        self.control_dir
            .clone()
            .unwrap_or_else(|| default_control_dir(&self.state_dir))
    }

    /// Envoy's admin address: `admin_address`, else the unix socket
    /// `<control dir>/admin.sock`.
    pub fn admin(&self) -> AdminAddress {
        self.admin_address
            .clone()
            .unwrap_or_else(|| AdminAddress::Unix(self.control_dir().join(control::ADMIN_SOCKET)))
    }

    /// The lifecycle machine's policy.
    pub fn policy(&self) -> Policy {
        Policy {
            writer: self.writer.clone(),
            base_id: self.base_id,
            drain_time_ms: self.drain_time_s.saturating_mul(1_000),
            parent_shutdown_ms: self.parent_shutdown_time_s.saturating_mul(1_000),
            debounce_ms: self.debounce_ms,
            max_debounce_ms: self.max_debounce_ms,
            heartbeat_ms: millis(self.heartbeat),
            heartbeat_max_age_ms: self.heartbeat_max_age_ms,
            live_probe_ms: millis(self.live_probe_every),
            live_timeout_ms: millis(self.live_timeout),
            stable_after_ms: millis(self.stable_after),
            start_timeout_ms: millis(self.start_timeout),
            handoff_timeout_ms: millis(self.handoff_timeout),
            shutdown_margin_ms: millis(self.shutdown_margin),
            max_restarts: self.max_restarts,
            backoff_ms: (
                millis(self.restart_backoff.0),
                millis(self.restart_backoff.1),
            ),
        }
    }
}

/// The control directory's default inside `state_dir`.
pub fn default_control_dir(state_dir: &Path) -> PathBuf {
    state_dir.join(defaults::CONTROL_DIR_NAME)
}

/// `--max-debounce-ms`: as given, else [`defaults::MAX_DEBOUNCE_FACTOR`] debounces.
pub fn max_debounce_ms(debounce_ms: u64, given: Option<u64>) -> u64 {
    given.unwrap_or(debounce_ms.saturating_mul(defaults::MAX_DEBOUNCE_FACTOR))
}

/// The writer id: as given, else [`default_writer_id`] of this host and process.
pub fn writer_id(given: Option<String>) -> Result<WriterId, ConfigError> {
    let id = match given {
        Some(id) => id,
        None => {
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_default();
            default_writer_id(&host, std::process::id())
        }
    };
    Ok(WriterId::new(id)?)
}

/// `<host>-<pid>`, the host name sanitised into a valid writer id: characters
/// outside `A-Z a-z 0-9 . _ -` become `-`, it is cut to
/// [`defaults::WRITER_HOST_LEN`] characters, leading punctuation is dropped (a
/// writer id starts with a letter or digit) and an empty name becomes `flock`.
pub fn default_writer_id(hostname: &str, pid: u32) -> String {
    let host: String = hostname
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .take(defaults::WRITER_HOST_LEN)
        .collect();
    let host = host.trim_start_matches(['.', '_', '-']);
    let host = if host.is_empty() { "flock" } else { host };
    // `-` and a u32 pid fit beside the cut host name.
    const { assert!(defaults::WRITER_HOST_LEN + 11 <= MAX_WRITER_LEN) };
    format!("{host}-{pid}")
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> Config {
        Config::new("envoy", "envoy.yaml", "/run/x", WriterId::new("w").unwrap())
    }

    #[test]
    fn default_writer_ids_are_valid_writer_ids() {
        for host in [
            "node-a",
            "  node-a.example.com\n",
            "ünïcode host",
            "",
            "---",
            "._-x",
            &"h".repeat(300),
        ] {
            let id = default_writer_id(host, u32::MAX);
            WriterId::new(id.clone()).unwrap_or_else(|e| panic!("{host:?} -> {id:?}: {e}"));
        }
        assert_eq!(default_writer_id("node-a\n", 42), "node-a-42");
        assert_eq!(default_writer_id("ünï code", 1), "n--code-1");
        assert_eq!(default_writer_id("", 7), "flock-7");
        assert_eq!(default_writer_id("--.x", 7), "x-7");
        assert_eq!(
            default_writer_id(&"h".repeat(100), 7),
            format!("{}-7", "h".repeat(48))
        );
    }

    #[test]
    fn a_given_writer_id_is_checked() {
        assert_eq!(writer_id(Some("pod-1".into())).unwrap().as_str(), "pod-1");
        assert!(matches!(
            writer_id(Some("bad id".into())),
            Err(ConfigError::WriterId(_))
        ));
        assert!(writer_id(None).is_ok());
    }

    #[test]
    fn heartbeat_max_age_must_cover_three_heartbeats() {
        let mut c = config();
        c.heartbeat_max_age_ms = 2_999;
        assert_eq!(
            c.check(),
            Err(ConfigError::HeartbeatMaxAge {
                min: 3_000,
                heartbeat: 1_000
            })
        );
        c.heartbeat_max_age_ms = 3_000;
        assert_eq!(c.check(), Ok(()));
        assert_eq!(config().check(), Ok(()));
    }

    #[test]
    fn the_admin_socket_and_control_dir_default_under_the_state_dir() {
        let mut c = config();
        assert_eq!(c.control_dir(), PathBuf::from("/run/x/control"));
        assert_eq!(
            c.admin(),
            AdminAddress::Unix("/run/x/control/admin.sock".into())
        );
        c.control_dir = Some("/run/e".into());
        assert_eq!(c.admin(), AdminAddress::Unix("/run/e/admin.sock".into()));
        c.admin_address = Some(AdminAddress::Tcp("127.0.0.1:9901".into()));
        assert_eq!(c.admin(), AdminAddress::Tcp("127.0.0.1:9901".into()));
        c.control_dir = Some(format!("/{}", "d".repeat(90)).into());
        assert!(matches!(c.check(), Err(ConfigError::ControlDir(_))));
    }

    #[test]
    fn max_debounce_defaults_to_ten_debounces() {
        assert_eq!(max_debounce_ms(500, None), 5_000);
        assert_eq!(max_debounce_ms(500, Some(700)), 700);
        assert_eq!(max_debounce_ms(u64::MAX, None), u64::MAX);
    }

    #[test]
    fn the_policy_is_the_config_in_milliseconds() {
        let p = config().policy();
        assert_eq!(p.drain_time_ms, 10_000);
        assert_eq!(p.parent_shutdown_ms, 15_000);
        assert_eq!(p.live_timeout_ms, 60_000);
        assert_eq!(p.live_probe_ms, 100);
        assert_eq!(p.stable_after_ms, 10_000);
        assert_eq!(p.heartbeat_ms, 1_000);
        assert_eq!(p.max_debounce_ms, 5_000);
        assert_eq!(p.backoff_ms, (200, 10_000));
        assert_eq!(p.max_restarts, 5);
        assert_eq!(p.writer.as_str(), "w");
    }
}
