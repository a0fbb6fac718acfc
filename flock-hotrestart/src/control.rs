//! Envoy's private control directory: where its hot-restart sockets and its admin
//! socket live, reachable only by the supervisor's uid.
//!
//! Without `--socket-path`, Envoy's hot-restart RPC binds *abstract* unix sockets
//! (`@envoy_domain_socket_*`): they have no file and no permission bits, so any uid
//! on the host (and any pod on the host network) can connect and send Terminate or
//! DrainListeners, ask for a listen socket's fd, or bind the next epoch's name first.
//! A TCP admin listener (`127.0.0.1:15000`) is just as open: anyone on the host can
//! `POST /quitquitquit` or read `/config_dump`. So every epoch the supervisor starts
//! gets `--socket-path <dir>/envoy_domain_socket --socket-mode 600`, and the admin
//! listens on a `0600` unix socket in the same directory (`admin.address.pipe` in the
//! bootstrap): the directory is `0700` and owned by the supervisor's uid, so another
//! uid can neither list nor connect to anything in it, whatever the sockets' own
//! modes are.
//!
//! Every supervisor of one chain (a hot restart, a handoff between two supervisor
//! processes) uses the same directory: Envoy names its sockets
//! `<socket-path>_{parent,child,udp_parent,udp_child}_<base id × 10 + epoch>`, and an
//! epoch finds its predecessor only at the same path.

use std::fs::{self, File, OpenOptions, Permissions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::OFlag;

/// The control directory's name inside the state directory (the default).
pub const DEFAULT_DIR_NAME: &str = "control";
/// The `--socket-path` prefix inside the control directory; Envoy appends
/// `_<role>_<base id × 10 + epoch>`.
pub const HOT_RESTART_SOCKET: &str = "envoy_domain_socket";
/// The admin socket's name inside the control directory (the default).
pub const ADMIN_SOCKET: &str = "admin.sock";
/// Envoy's `--socket-mode` for its hot-restart sockets (octal, as Envoy parses it).
pub const SOCKET_MODE: &str = "600";
/// The directory's mode.
pub const DIR_MODE: u32 = 0o700;

/// The longest socket path Linux accepts (`sun_path` is 108 bytes with its NUL).
pub const MAX_SOCKET_PATH: usize = 107;
/// The longest suffix Envoy appends to `--socket-path`: `_udp_parent_` and the
/// decimal of `base id × 10 + epoch` (at most 11 digits for a `u32` base id).
pub const MAX_SUFFIX: usize = "_udp_parent_".len() + 11;

/// The `--socket-path` value for a control directory.
pub fn hot_restart_socket(dir: &Path) -> PathBuf {
    dir.join(HOT_RESTART_SOCKET)
}

/// Whether Envoy's longest hot-restart socket name under `dir` fits a unix socket
/// address; the error names the limit.
pub fn check_path_length(dir: &Path) -> Result<(), String> {
    let len = hot_restart_socket(dir).as_os_str().len() + MAX_SUFFIX;
    if len > MAX_SOCKET_PATH {
        return Err(format!(
            "Envoy's hot-restart socket names under {} would be up to {len} bytes long; a \
             unix socket path holds at most {MAX_SOCKET_PATH}: choose a shorter directory",
            dir.display()
        ));
    }
    Ok(())
}

/// Makes `dir` the private control directory: creates it `0700` (and its missing
/// parents) if it does not exist; refuses a symlink, a non-directory, or a directory
/// owned by another uid than this process's effective uid; turns an existing
/// directory of ours that group or others may access back to `0700`.
///
/// The checks and the `chmod` are made on one descriptor opened with `O_NOFOLLOW`,
/// so a symlink swapped in after a check is never followed.
pub fn ensure_private_dir(dir: &Path) -> io::Result<()> {
    let open_mode = if flock_core::reintroduced!("envoy-control-dir-open") {
        // Re-introduces the open control directory so tests/control_dir.rs and
        // envoy_private_control.rs can show they catch it; never in real builds: a
        // directory any uid can list and enter.
        0o755
    } else {
        DIR_MODE
    };
    match fs::DirBuilder::new()
        .recursive(true)
        .mode(open_mode)
        .create(dir)
    {
        Ok(()) => {}
        // A symlink (to a directory or not) or a file: judged below, with a clear error.
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
        Err(e) => {
            return Err(io::Error::new(
                e.kind(),
                format!("creating Envoy's control directory {}: {e}", dir.display()),
            ));
        }
    }
    let foreign_ok = flock_core::reintroduced!("envoy-control-dir-foreign");
    let mut flags = OFlag::O_DIRECTORY | OFlag::O_CLOEXEC;
    if !foreign_ok {
        flags |= OFlag::O_NOFOLLOW;
    }
    if !foreign_ok
        && fs::symlink_metadata(dir)
            .map(|m| m.file_type().is_symlink())
            .unwrap_or(false)
    {
        return Err(io::Error::other(format!(
            "Envoy's control directory {} is a symlink; refusing to follow it (another uid \
             could point it at a directory it reads): remove it, the supervisor creates the \
             directory itself",
            dir.display()
        )));
    }
    let handle: File = OpenOptions::new()
        .read(true)
        .custom_flags(flags.bits())
        .open(dir)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "opening Envoy's control directory {} (it must be a directory, not a \
                     symlink): {e}",
                    dir.display()
                ),
            )
        })?;
    let meta = handle.metadata()?;
    let euid = nix::unistd::geteuid().as_raw();
    if meta.uid() != euid && !foreign_ok {
        return Err(io::Error::other(format!(
            "Envoy's control directory {} is owned by uid {}, not by this supervisor's uid \
             {euid}: that uid could reach Envoy's hot-restart and admin sockets; remove the \
             directory (the supervisor creates it) or choose another --control-dir",
            dir.display(),
            meta.uid()
        )));
    }
    if meta.mode() & 0o7777 != DIR_MODE && open_mode == DIR_MODE {
        handle
            .set_permissions(Permissions::from_mode(DIR_MODE))
            .map_err(|e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "making Envoy's control directory {} 0700: {e}",
                        dir.display()
                    ),
                )
            })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_long_directory_is_refused_before_envoy_fails_on_it() {
        assert!(check_path_length(Path::new("/run/flock/envoy/control")).is_ok());
        let long = PathBuf::from(format!("/{}", "d".repeat(80)));
        let e = check_path_length(&long).unwrap_err();
        assert!(e.contains("at most 107"), "{e}");
    }
}
