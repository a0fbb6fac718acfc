//! `flock-install-cni`: keeps the flock CNI plugin patched into the node's CNI config
//! directory, race-free, and removes every trace on exit. The daemon is
//! `flock_cni::install`; this file parses flags and sets up logging.
// The `///` comments below are clap's --help text, where `<dir>/<network>` is the
// usual placeholder notation, not HTML.
#![allow(rustdoc::invalid_html_tags)]

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, ValueEnum};
use flock_cni::install::{self, Config, Mode, OnExit};
use flock_core::cniconf::{ConfPolicy, OurPlugin};

const DEFAULT_PLUGIN_CONFIG: &str = r#"{"type":"flock-cni","agent_socket":"/run/flock/cni.sock"}"#;

/// Keeps the flock CNI plugin chained into every primary CNI network config of a
/// node, race-free, and removes every trace on exit.
///
/// It installs the plugin binary into --cni-bin-dir, arms an inotify watch on
/// --cni-conf-dir, then scans it; every *.conf, *.conflist and *.json primary config
/// gets flock's entry appended last in its "plugins" (--mode chained) or a libcni >= 1.3
/// drop-in <dir>/<network>/zz-flock.conf (--mode subdir). It re-patches whenever
/// another agent rewrites a config (in place, by rename, or delete-then-create),
/// recognises its own writes per file (no patch loops), never patches a partial or
/// invalid file, and writes atomically (temp file, fsync, rename, directory fsync)
/// with the original mode and owner.
///
/// On SIGTERM or SIGINT it removes its entries from every config, deletes its drop-ins
/// and its binary, and exits 0 (see --on-exit). Fatal errors (e.g. inotify limits
/// exhausted, the directory removed) restore the same way and exit 1: it never runs
/// unwatched.
///
/// Logs go to stderr (RUST_LOG sets the level, default info). Every flag can also be
/// set through the environment variable shown.
#[derive(Parser, Debug)]
#[command(version, max_term_width = 100)]
struct Args {
    /// The CNI network config directory to keep patched. Must exist. Writes never leave
    /// it: symlinked configs are reported, never replaced or followed for writing.
    #[arg(long, env = "FLOCK_CNI_CONF_DIR", default_value = "/etc/cni/net.d")]
    cni_conf_dir: PathBuf,

    /// Where to install the plugin binary, as the plugin's "type" (flock-cni). Created
    /// if missing. Debian's runtimes look in /usr/lib/cni; most others in /opt/cni/bin.
    #[arg(long, env = "FLOCK_CNI_BIN_DIR", default_value = "/opt/cni/bin")]
    cni_bin_dir: PathBuf,

    /// The flock-cni binary to install. Default: `flock-cni` next to this executable.
    #[arg(long, env = "FLOCK_CNI_PLUGIN_BIN")]
    plugin_bin: Option<PathBuf>,

    /// The plugin entry to chain, as JSON. Its "type" names the binary; every entry of
    /// that type found in a config is considered flock's (duplicates are repaired).
    #[arg(long, env = "FLOCK_CNI_PLUGIN_CONFIG", default_value = DEFAULT_PLUGIN_CONFIG)]
    plugin_config: String,

    /// chained: append flock's entry to each primary's "plugins" (any runtime).
    /// subdir: write <dir>/<network>/zz-flock.conf drop-ins and leave the primaries'
    /// files alone (only runtimes on libcni >= 1.3 load them).
    #[arg(long, env = "FLOCK_CNI_MODE", value_enum, default_value_t = ModeArg::Chained)]
    mode: ModeArg,

    /// A file that exists only while the watch is armed, the first scan is done, at
    /// least one primary config is patched and none is pending (throttled, refused, a
    /// symlink, or a failed write). Use it as the DaemonSet's readiness probe.
    #[arg(long, env = "FLOCK_CNI_READY_FILE")]
    ready_file: Option<PathBuf>,

    /// Single-plugin .conf/.json primaries: convert (to <stem>.conflist, as libcni's
    /// ConfListFromConf does; the .conf comes back on exit) or skip (report, not ready).
    #[arg(long, env = "FLOCK_CNI_CONF_POLICY", value_enum, default_value_t = ConfPolicyArg::Convert)]
    conf_policy: ConfPolicyArg,

    /// On SIGTERM/SIGINT: restore (remove every trace) or keep (leave configs patched
    /// and the binary installed, so pods created while flock is being upgraded fail
    /// closed instead of starting without the mesh).
    #[arg(long, env = "FLOCK_CNI_ON_EXIT", value_enum, default_value_t = OnExitArg::Restore)]
    on_exit: OnExitArg,

    /// Re-scan the whole directory this often, in seconds (repairs anything an event
    /// could not tell, e.g. a removed drop-in).
    #[arg(long, env = "FLOCK_CNI_RESYNC_SECONDS", default_value_t = 60, value_parser = clap::value_parser!(u64).range(1..))]
    resync_seconds: u64,

    /// Writes per config file allowed in a burst before throttling (a primary CNI that
    /// keeps rewriting its file must not drive flock into a write loop).
    #[arg(long, env = "FLOCK_CNI_MAX_WRITE_BURST", default_value_t = 5)]
    max_write_burst: u32,

    /// After the burst, at most one write per config file per this many milliseconds;
    /// while throttled, a warning is logged and the ready file is removed.
    #[arg(long, env = "FLOCK_CNI_WRITE_INTERVAL_MS", default_value_t = 1000)]
    write_interval_ms: u64,

    /// Log format on stderr.
    #[arg(long, env = "FLOCK_CNI_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ModeArg {
    Chained,
    Subdir,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ConfPolicyArg {
    Convert,
    Skip,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum OnExitArg {
    Restore,
    Keep,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn main() {
    let args = Args::parse();
    flock_telemetry::logging::init(match args.log_format {
        LogFormat::Text => flock_telemetry::logging::LogFormat::Text,
        LogFormat::Json => flock_telemetry::logging::LogFormat::Json,
    });
    let code = match configure(args).and_then(|c| install::run(c).map_err(|e| e.0)) {
        Ok(()) => 0,
        Err(msg) => {
            tracing::error!("{msg}");
            eprintln!("flock-install-cni: {msg}");
            1
        }
    };
    std::process::exit(code);
}

fn configure(args: Args) -> Result<Config, String> {
    let ours = OurPlugin::from_bytes(args.plugin_config.as_bytes())
        .map_err(|e| format!("--plugin-config: {e}"))?;
    let plugin_bin = match args.plugin_bin {
        Some(p) => p,
        None => std::env::current_exe()
            .map_err(|e| format!("cannot locate this executable to find flock-cni next to it: {e}; pass --plugin-bin"))?
            .with_file_name("flock-cni"),
    };
    Ok(Config {
        conf_dir: args.cni_conf_dir,
        bin_dir: args.cni_bin_dir,
        plugin_bin,
        ours,
        mode: match args.mode {
            ModeArg::Chained => Mode::Chained,
            ModeArg::Subdir => Mode::Subdir,
        },
        conf_policy: match args.conf_policy {
            ConfPolicyArg::Convert => ConfPolicy::ConvertToList,
            ConfPolicyArg::Skip => ConfPolicy::Skip,
        },
        ready_file: args.ready_file,
        on_exit: match args.on_exit {
            OnExitArg::Restore => OnExit::Restore,
            OnExitArg::Keep => OnExit::Keep,
        },
        resync: Duration::from_secs(args.resync_seconds),
        write_burst: args.max_write_burst,
        write_interval: Duration::from_millis(args.write_interval_ms),
        hooks: install::Hooks::default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_plugin_config_points_at_the_agents_default_socket() {
        // The plugin, the agent (--cni-socket) and this default must name one socket.
        let config: serde_json::Value = serde_json::from_str(DEFAULT_PLUGIN_CONFIG).unwrap();
        assert_eq!(config["type"], "flock-cni");
        assert_eq!(config["agent_socket"], flock_cni::cni::DEFAULT_AGENT_SOCKET);
        assert!(OurPlugin::from_bytes(DEFAULT_PLUGIN_CONFIG.as_bytes()).is_ok());
    }
}
