//! `flock-supervisor`: runs Envoy and hot-restarts it without dropping a request.
//!
//! Argument parsing and wiring only; the supervisor is `flock_hotrestart::supervisor`.

// The `Args` doc comment is clap's verbatim `--help` text, with `<placeholders>` a
// terminal shows as typed; rustdoc would read them as HTML tags.
#![allow(rustdoc::invalid_html_tags)]

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use flock_hotrestart::admin::AdminAddress;
use flock_hotrestart::config::{self, defaults};
use flock_hotrestart::envoy::{SHIM_ARG, exec_with_parent_death_signal};
use flock_hotrestart::{Config, Exit};

mod user;

/// Runs Envoy and hot-restarts it without dropping a request.
///
/// Starts Envoy at the epoch flock-core's start decision picks (epoch+1 of a LIVE
/// predecessor recorded in the state directory with a fresh heartbeat, else 0),
/// hot-restarts it on SIGHUP and when the config file changes (debounced, validated
/// with `envoy --mode validate` first, never while the newest epoch is not LIVE),
/// records the LIVE epoch in `<state-dir>/epoch` every second, restarts a crashed
/// Envoy with bounded retries, and on SIGTERM drains and stops every epoch.
///
/// Envoy dies with the supervisor (parent-death signal), so a killed supervisor
/// leaves no orphan.
///
/// Envoy's control plane is private to the supervisor's uid: every epoch gets
/// `--socket-path <control-dir>/envoy_domain_socket --socket-mode 600` (no abstract
/// `@envoy_domain_socket_*` sockets any uid could reach), and the supervisor talks to
/// Envoy's admin on the unix socket `<control-dir>/admin.sock`. The control directory
/// (default `<state-dir>/control`) is created 0700; a symlink or a directory owned by
/// another uid is refused. Envoy's bootstrap must put the admin there, mode 0600:
///   admin: {address: {pipe: {path: <control-dir>/admin.sock, mode: 384}}}
/// (`flock-agent envoy-bootstrap` writes that by default).
///
/// With `--user UID[:GID]` the supervisor switches to that uid at start, so every
/// Envoy runs as it, not as root: the agent's CNI socket and state (uid 0's) refuse
/// it, and `flock-agent --envoy-uid UID` hands it the xDS socket. Envoy keeps
/// CAP_SYS_ADMIN, CAP_NET_ADMIN and CAP_NET_BIND_SERVICE (those the supervisor had)
/// as ambient capabilities; the state and control directories must be the uid's to
/// create.
///
/// Example:
///   flock-supervisor --envoy-bin /usr/local/bin/envoy --config /etc/envoy/envoy.yaml
///     --state-dir /run/flock/envoy --base-id 7
///     --ready-file /run/flock/envoy/ready -- --log-level info
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Args {
    /// The Envoy executable (the real ELF, not a wrapper script).
    #[arg(long, env = "FLOCK_ENVOY_BIN", value_name = "PATH")]
    envoy_bin: PathBuf,

    /// Envoy's bootstrap config (`-c`). Watched with inotify: a change of its content
    /// triggers a hot restart, like SIGHUP.
    #[arg(long, value_name = "FILE")]
    config: PathBuf,

    /// The Envoy `--base-id` for a cold start with no state-file record. A hot restart
    /// inherits its predecessor's base id; a cold start beside a still-answering Envoy
    /// uses the next one. Every Envoy on a host needs its own.
    #[arg(long, value_name = "N", default_value_t = defaults::BASE_ID)]
    base_id: u32,

    /// The directory of the state file `epoch` and its lock `epoch.lock` (created 0700).
    /// Share it (and /dev/shm) with the supervisor that takes over during a rolling
    /// update, so it can hand over at epoch+1.
    #[arg(long, value_name = "DIR")]
    state_dir: PathBuf,

    /// Envoy's private control directory (default: `<state-dir>/control`): Envoy's
    /// hot-restart sockets (`--socket-path DIR/envoy_domain_socket`, mode 600) and its
    /// admin socket. Created 0700 and owned by the supervisor's uid; an existing one
    /// that is a symlink or another uid's is refused, a looser mode is set back to
    /// 0700. Every supervisor of one chain (a handoff during a rolling update) must
    /// use the same directory, or the new epoch cannot find its predecessor.
    #[arg(long, value_name = "DIR")]
    control_dir: Option<PathBuf>,

    /// Envoy's admin unix socket, as in the bootstrap's `admin.address.pipe.path`
    /// (default: `<control-dir>/admin.sock`). `/server_info` there is the authority on
    /// which epoch is LIVE; the graceful drain is asked there too.
    #[arg(long, value_name = "PATH", conflicts_with = "admin_address")]
    admin_socket: Option<PathBuf>,

    /// Compatibility, opt-in: Envoy's admin on TCP `HOST:PORT` instead of the unix
    /// socket. Any process on the host can reach a loopback port: it can stop Envoy
    /// (`POST /quitquitquit`), drain it, and read its config. Only for a bootstrap
    /// that cannot use a unix socket.
    #[arg(long, value_name = "HOST:PORT")]
    admin_address: Option<String>,

    /// Envoy's `--drain-time-s`: how long a replaced epoch drains its listeners. Also
    /// the drain at SIGTERM.
    #[arg(long, value_name = "N", default_value_t = defaults::DRAIN_TIME_S)]
    drain_time_s: u64,

    /// Envoy's `--parent-shutdown-time-s`: when the new epoch shuts the old one down.
    #[arg(long, value_name = "N", default_value_t = defaults::PARENT_SHUTDOWN_TIME_S)]
    parent_shutdown_time_s: u64,

    /// Trailing debounce of restart triggers: a burst of triggers makes one restart,
    /// this long after the last.
    #[arg(long, value_name = "N", default_value_t = defaults::DEBOUNCE_MS)]
    debounce_ms: u64,

    /// The longest a continuous stream of triggers postpones a restart (default: 10 ×
    /// the debounce). Never shortens a wait for the newest epoch to become LIVE.
    #[arg(long, value_name = "N")]
    max_debounce_ms: Option<u64>,

    /// A file that exists exactly while the newest epoch is LIVE (for a readiness
    /// probe). It is removed while a new epoch initializes and at shutdown.
    #[arg(long, value_name = "PATH")]
    ready_file: Option<PathBuf>,

    /// Write metrics (restarts, deferrals, validation failures, current epoch…) in
    /// Prometheus text format to this file, replaced atomically on every change.
    #[arg(long, value_name = "PATH")]
    metrics_file: Option<PathBuf>,

    /// This supervisor's name in the state file (A-Z a-z 0-9 . _ -, up to 64; e.g. the
    /// pod name). Default: `<hostname>-<pid>`.
    #[arg(long, value_name = "ID", env = "FLOCK_WRITER_ID")]
    writer_id: Option<String>,

    /// State-file records with an older heartbeat are stale: a newcomer cold-starts
    /// instead of handing over. At least 3 × the heartbeat period (1 s).
    #[arg(long, value_name = "N", default_value_t = defaults::HEARTBEAT_MAX_AGE_MS)]
    heartbeat_max_age_ms: u64,

    /// A new epoch that is not LIVE this long after it started is stopped and counts
    /// as a failed start (e.g. a stuck initialization).
    #[arg(long, value_name = "N", default_value_t = defaults::LIVE_TIMEOUT_S)]
    live_timeout_s: u64,

    /// How long the start decision may wait (for a predecessor to become LIVE, or its
    /// record to go stale) before the supervisor gives up and exits non-zero.
    #[arg(long, value_name = "N", default_value_t = defaults::START_TIMEOUT_S)]
    start_timeout_s: u64,

    /// At SIGTERM during a hot restart: the longest to wait for the new epoch to
    /// become LIVE before stopping everything.
    #[arg(long, value_name = "N", default_value_t = defaults::HANDOFF_TIMEOUT_S)]
    handoff_timeout_s: u64,

    /// At SIGTERM, after the drain: how long the epochs get to exit after SIGTERM
    /// before SIGKILL. Shutdown takes at most drain-time + this (plus a handoff wait).
    #[arg(long, value_name = "N", default_value_t = defaults::SHUTDOWN_MARGIN_S)]
    shutdown_margin_s: u64,

    /// Consecutive unexpected deaths of the newest epoch tolerated (each restarted
    /// with exponential backoff) before the supervisor exits non-zero. The count
    /// resets once an epoch has been LIVE for 10 s.
    #[arg(long, value_name = "N", default_value_t = defaults::MAX_RESTARTS)]
    max_restarts: u32,

    /// Do not watch the config file; only SIGHUP triggers a hot restart.
    #[arg(long)]
    no_watch_config: bool,

    /// Run Envoy directly instead of through the parent-death exec shim: Envoy then
    /// survives a SIGKILLed supervisor (an orphan nobody hot-restarts).
    #[arg(long)]
    no_parent_death_signal: bool,

    /// Run as this uid (and gid; default the uid's number) instead of root, and every
    /// Envoy with it. Numbers only; 0 is refused. Needs the supervisor started as root
    /// with CAP_SETUID, CAP_SETGID and CAP_SETPCAP, which the switch drops.
    #[arg(long, value_name = "UID[:GID]", value_parser = user::parse)]
    user: Option<user::User>,

    /// Extra arguments passed to Envoy (after `--`), e.g. `-- --log-level warn`.
    #[arg(last = true, value_name = "ENVOY ARGS")]
    envoy_args: Vec<OsString>,
}

fn main() -> ExitCode {
    let argv: Vec<OsString> = std::env::args_os().collect();
    if argv.get(1).is_some_and(|a| a == SHIM_ARG) {
        return exec_shim(&argv[2..]);
    }
    let args = Args::parse();
    flock_telemetry::logging::init(flock_telemetry::logging::LogFormat::Text);
    let writer = match config::writer_id(args.writer_id.clone()) {
        Ok(w) => w,
        Err(e) => {
            eprintln!("flock-supervisor: {e}");
            return ExitCode::from(2);
        }
    };
    let shim = if args.no_parent_death_signal {
        None
    } else {
        match std::env::current_exe() {
            Ok(p) => Some(p),
            Err(e) => {
                eprintln!(
                    "flock-supervisor: cannot find its own executable for the exec shim: {e}"
                );
                return ExitCode::from(2);
            }
        }
    };
    // Before any thread starts: capabilities and uids are per thread.
    // The mutant keeps root: Envoy then passes every uid check of the agent's.
    let user = args
        .user
        .filter(|_| !flock_core::reintroduced!("envoy-user-ignored"));
    if let Some(u) = user {
        match user::become_user(u) {
            Ok(kept) => {
                let mut kept: Vec<String> = kept.iter().map(|c| c.to_string()).collect();
                kept.sort();
                tracing::info!(
                    uid = u.uid,
                    gid = u.gid,
                    ambient = %kept.join(","),
                    "running as Envoy's own uid"
                );
            }
            Err(e) => {
                eprintln!("flock-supervisor: {e}");
                return ExitCode::from(2);
            }
        }
    }
    let mut config = Config::new(args.envoy_bin, args.config, args.state_dir, writer);
    config.control_dir = args.control_dir;
    config.admin_address = match (args.admin_socket, args.admin_address) {
        (Some(path), _) => Some(AdminAddress::Unix(path)),
        (None, Some(tcp)) => Some(AdminAddress::Tcp(tcp)),
        (None, None) => None,
    };
    config.base_id = args.base_id;
    config.drain_time_s = args.drain_time_s;
    config.parent_shutdown_time_s = args.parent_shutdown_time_s;
    config.debounce_ms = args.debounce_ms;
    config.max_debounce_ms = config::max_debounce_ms(args.debounce_ms, args.max_debounce_ms);
    config.ready_file = args.ready_file;
    config.metrics_file = args.metrics_file;
    config.heartbeat_max_age_ms = args.heartbeat_max_age_ms;
    config.live_timeout = Duration::from_secs(args.live_timeout_s);
    config.start_timeout = Duration::from_secs(args.start_timeout_s);
    config.handoff_timeout = Duration::from_secs(args.handoff_timeout_s);
    config.shutdown_margin = Duration::from_secs(args.shutdown_margin_s);
    config.max_restarts = args.max_restarts;
    config.watch_config = !args.no_watch_config;
    config.envoy_args = args.envoy_args;
    config.shim = shim;
    if let Err(e) = config.check() {
        eprintln!("flock-supervisor: {e}");
        return ExitCode::from(2);
    }
    // One thread: every Envoy is forked from it, which the parent-death signal needs.
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("flock-supervisor: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(flock_hotrestart::run(config)) {
        Ok(Exit::Terminated | Exit::Superseded) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("flock-supervisor: {e}");
            eprintln!("flock-supervisor: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `flock-supervisor __flock-exec-with-pdeathsig <pid> <program> <args>…` (internal).
fn exec_shim(rest: &[OsString]) -> ExitCode {
    let (Some(pid), Some(program)) = (rest.first(), rest.get(1)) else {
        eprintln!("flock-supervisor: {SHIM_ARG} needs <pid> <program> [args]");
        return ExitCode::from(127);
    };
    let Some(pid) = pid.to_str().and_then(|p| p.parse::<i32>().ok()) else {
        eprintln!("flock-supervisor: {SHIM_ARG}: bad pid {pid:?}");
        return ExitCode::from(127);
    };
    let err = exec_with_parent_death_signal(pid, std::path::Path::new(program), &rest[2..]);
    eprintln!(
        "flock-supervisor: cannot exec {}: {err}",
        std::path::Path::new(program).display()
    );
    ExitCode::from(127)
}
