//! Running the Envoy binary: `--mode validate`, spawning an epoch, the shared-memory
//! file, and the parent-death exec shim.
//!
//! # Children never outlive the supervisor (the SIGKILL policy)
//!
//! If the supervisor is SIGKILLed it cannot stop its Envoys, and nobody would heartbeat
//! or hot-restart them any more: an orphan would serve a stale config forever and hold
//! the base id and the ports. flock's policy is that **Envoy dies with its
//! supervisor**: every epoch is started through [`exec_with_parent_death_signal`],
//! which sets `PR_SET_PDEATHSIG = SIGKILL` in the child (the kernel delivers it when
//! the supervisor's forking thread exits, however it exits), checks that the
//! supervisor is still its parent (closing the race where it died before the
//! `prctl`), and then `execv`s Envoy. The supervisor's restart (systemd,
//! the kubelet) starts a fresh chain; the state file's heartbeat stops with the
//! supervisor, so the newcomer cold-starts once the record is stale (it never forks
//! from a dead predecessor). This is the same behaviour as a container whose PID 1
//! dies, made true outside containers too.
//!
//! The signal is SIGKILL, not SIGTERM: with nobody left to drain, a graceful stop
//! buys nothing, and a hot-restart child that gets SIGTERM after its parent is gone
//! retries messaging it for seconds before it exits.
//!
//! The shim is the supervisor binary itself, re-executed with a hidden first argument
//! ([`SHIM_ARG`]), so no `unsafe` `pre_exec` hook is needed. The death signal fires
//! when the *thread* that forked exits, so the supervisor spawns every epoch from one
//! long-lived thread (its single-threaded runtime).

use std::ffi::{CString, OsStr, OsString};
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use tokio::process::{Child, Command};

/// The hidden first argument that turns the supervisor binary into the exec shim:
/// `flock-supervisor __flock-exec-with-pdeathsig <supervisor pid> <program> <args>…`.
pub const SHIM_ARG: &str = "__flock-exec-with-pdeathsig";

/// The shared-memory file Envoy creates for `base_id` (and leaves behind on exit).
pub fn shared_memory_path(base_id: u32) -> PathBuf {
    PathBuf::from(format!(
        "/dev/shm/envoy_shared_memory_{}",
        u64::from(base_id) * 10
    ))
}

/// How to run Envoy.
#[derive(Clone, Debug)]
pub struct EnvoySpec {
    /// The Envoy ELF.
    pub bin: PathBuf,
    /// The bootstrap config (`-c`).
    pub config: PathBuf,
    /// `--drain-time-s`.
    pub drain_time_s: u64,
    /// `--parent-shutdown-time-s`.
    pub parent_shutdown_time_s: u64,
    /// Extra arguments passed to Envoy as they are (after flock's own).
    pub extra_args: Vec<OsString>,
    /// The exec shim (the supervisor binary) that sets the parent-death signal; `None`
    /// runs Envoy directly (children may then outlive a SIGKILLed supervisor).
    pub shim: Option<PathBuf>,
    /// The private control directory ([`crate::control`]): every epoch gets
    /// `--socket-path <dir>/envoy_domain_socket --socket-mode 600`. `None` leaves
    /// Envoy's abstract `@envoy_domain_socket_*` sockets, which any uid can reach
    /// (only for a test that runs Envoy without a supervisor).
    pub control_dir: Option<PathBuf>,
}

/// `envoy --mode validate` rejected the config (or could not run).
#[derive(Clone, Debug)]
pub struct ValidationError {
    /// What went wrong: Envoy's last output lines, or the spawn error.
    pub detail: String,
}

impl std::fmt::Display for ValidationError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.detail)
    }
}

impl EnvoySpec {
    /// The arguments of epoch `epoch` on `base_id`.
    pub fn args(&self, epoch: u32, base_id: u32) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec![
            "-c".into(),
            self.config.clone().into(),
            "--base-id".into(),
            base_id.to_string().into(),
            "--restart-epoch".into(),
            epoch.to_string().into(),
            "--drain-time-s".into(),
            self.drain_time_s.to_string().into(),
            // A listener update (an authorization policy change re-configures the
            // inbound listeners' RBAC) drains the connections of the old filter
            // chains. Gradual (Envoy's default) closes them at random over the whole
            // drain time, so a caller's pooled mesh connection kept the old policy
            // for up to `drain_time_s`; immediate asks every one to close at once
            // (HTTP/2 GOAWAY; HTTP/1 `connection: close` on its next response), and
            // the next request opens a connection under the new policy.
            "--drain-strategy".into(),
            "immediate".into(),
            "--parent-shutdown-time-s".into(),
            self.parent_shutdown_time_s.to_string().into(),
        ];
        // Re-introduces the abstract hot-restart sockets so
        // tests/envoy_private_control.rs can show it catches them; never in real
        // builds: any uid on the host (or a hostNetwork pod) could send an epoch
        // Terminate or DrainListeners, take a listen socket's fd, or squat the next
        // epoch's socket name.
        let abstract_sockets = flock_core::reintroduced!("envoy-abstract-socket");
        if let Some(dir) = self.control_dir.as_ref().filter(|_| !abstract_sockets) {
            let mode = if flock_core::reintroduced!("envoy-socket-mode-open") {
                // Re-introduces sockets any uid may connect to (mode 666), for the
                // same test; never in real builds.
                "666"
            } else {
                crate::control::SOCKET_MODE
            };
            args.extend([
                "--socket-path".into(),
                crate::control::hot_restart_socket(dir).into(),
                // Envoy 1.40's default is 600 too; explicit, so an Envoy with another
                // default cannot open them up.
                "--socket-mode".into(),
                mode.into(),
            ]);
        }
        args.extend(self.extra_args.iter().cloned());
        args
    }

    /// Runs `envoy --mode validate -c CONFIG <extra args>`, bounded by `timeout`.
    pub async fn validate(&self, timeout: Duration) -> Result<(), ValidationError> {
        let mut cmd = Command::new(&self.bin);
        cmd.arg("--mode")
            .arg("validate")
            .arg("-c")
            .arg(&self.config)
            .args(&self.extra_args)
            .stdin(Stdio::null())
            .kill_on_drop(true);
        let out = match tokio::time::timeout(timeout, cmd.output()).await {
            Ok(Ok(out)) => out,
            Ok(Err(e)) => {
                return Err(ValidationError {
                    detail: format!("could not run {}: {e}", self.bin.display()),
                });
            }
            Err(_) => {
                return Err(ValidationError {
                    detail: format!("envoy --mode validate did not finish in {timeout:?}"),
                });
            }
        };
        if out.status.success() {
            return Ok(());
        }
        let mut text = String::from_utf8_lossy(&out.stderr).into_owned();
        text.push_str(&String::from_utf8_lossy(&out.stdout));
        let tail: Vec<&str> = text.lines().rev().take(6).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Err(ValidationError {
            detail: format!("{} ({})", tail.join(" | "), describe_exit(out.status)),
        })
    }

    /// Spawns epoch `epoch` on `base_id`. Envoy inherits stdout/stderr.
    pub fn spawn(&self, epoch: u32, base_id: u32) -> io::Result<Child> {
        let mut cmd = match &self.shim {
            Some(shim) => {
                let mut cmd = Command::new(shim);
                cmd.arg(SHIM_ARG)
                    .arg(std::process::id().to_string())
                    .arg(&self.bin);
                cmd
            }
            None => Command::new(&self.bin),
        };
        cmd.args(self.args(epoch, base_id))
            .stdin(Stdio::null())
            .kill_on_drop(false);
        cmd.spawn()
    }
}

/// "exit status 1", "killed by signal 9".
pub fn describe_exit(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(sig)) => format!("killed by signal {sig}"),
        _ => status.to_string(),
    }
}

/// The exec shim (see the module docs): sets `PR_SET_PDEATHSIG = SIGKILL`, verifies
/// that `supervisor_pid` is still the parent, and `execv`s `program` with `args`.
/// Returns only on failure. `args` excludes `argv[0]`.
pub fn exec_with_parent_death_signal(
    supervisor_pid: i32,
    program: &Path,
    args: &[OsString],
) -> io::Error {
    use nix::sys::signal::Signal;
    if let Err(e) = nix::sys::prctl::set_pdeathsig(Signal::SIGKILL) {
        return io::Error::from(e);
    }
    if nix::unistd::getppid().as_raw() != supervisor_pid {
        return io::Error::other(format!(
            "supervisor {supervisor_pid} exited before Envoy started; not starting an orphan"
        ));
    }
    let cstr = |s: &OsStr| CString::new(s.as_bytes()).map_err(io::Error::other);
    let path = match cstr(program.as_os_str()) {
        Ok(p) => p,
        Err(e) => return e,
    };
    let mut argv = vec![path.clone()];
    for a in args {
        match cstr(a) {
            Ok(a) => argv.push(a),
            Err(e) => return e,
        }
    }
    match nix::unistd::execv(&path, &argv) {
        Ok(never) => match never {},
        Err(e) => io::Error::from(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_put_flock_flags_first_then_the_operators() {
        let spec = EnvoySpec {
            bin: "/bin/envoy".into(),
            config: "/etc/envoy.yaml".into(),
            drain_time_s: 2,
            parent_shutdown_time_s: 3,
            extra_args: vec!["--log-level".into(), "warn".into()],
            shim: None,
            control_dir: Some("/run/flock/envoy/control".into()),
        };
        let args: Vec<String> = spec
            .args(4, 9)
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect();
        assert_eq!(
            args.join(" "),
            "-c /etc/envoy.yaml --base-id 9 --restart-epoch 4 --drain-time-s 2 \
             --drain-strategy immediate \
             --parent-shutdown-time-s 3 --socket-path \
             /run/flock/envoy/control/envoy_domain_socket --socket-mode 600 --log-level warn"
        );
        assert_eq!(
            shared_memory_path(9),
            PathBuf::from("/dev/shm/envoy_shared_memory_90")
        );
    }
}
