//! Envoy's control directory (`flock_hotrestart::control::ensure_private_dir`): created
//! 0700, a looser mode of ours set back to 0700, a symlink or another uid's directory
//! refused. Runs as root (it chowns a directory to uid 65534).

use std::os::unix::fs::{MetadataExt, PermissionsExt};

use flock_hotrestart::control::ensure_private_dir;

const NOBODY: u32 = 65534;

fn mode(path: &std::path::Path) -> u32 {
    std::fs::symlink_metadata(path).unwrap().mode() & 0o7777
}

/// A missing directory (and its missing parents) is created 0700; an existing one of
/// ours that others may enter is set back to 0700. Mutant `envoy-control-dir-open`:
/// "created with mode 0755".
#[test]
fn the_control_dir_is_created_0700_and_an_open_one_of_ours_is_closed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("state").join("control");
    ensure_private_dir(&dir).unwrap();
    let got = mode(&dir);
    assert_eq!(
        got, 0o700,
        "the control directory was created with mode {got:o}"
    );
    assert_eq!(
        std::fs::metadata(&dir).unwrap().uid(),
        nix::unistd::geteuid().as_raw()
    );

    let open = tmp.path().join("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    ensure_private_dir(&open).unwrap();
    assert_eq!(
        mode(&open),
        0o700,
        "an open control directory was left open"
    );
    // Idempotent: a second supervisor of the chain (a handoff) accepts it as it is.
    ensure_private_dir(&open).unwrap();
    ensure_private_dir(&dir).unwrap();
}

/// A directory of another uid (it could reach the sockets in it, or swap them), a
/// symlink (another uid could point it anywhere) and a file are refused, each with an
/// error naming the path and the reason. Mutant `envoy-control-dir-foreign`: "accepted
/// a control directory owned by uid 65534".
#[test]
fn another_uids_directory_a_symlink_or_a_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let foreign = tmp.path().join("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::set_permissions(&foreign, std::fs::Permissions::from_mode(0o700)).unwrap();
    std::os::unix::fs::chown(&foreign, Some(NOBODY), Some(NOBODY)).unwrap();
    let e = ensure_private_dir(&foreign)
        .map(|()| "Ok".to_owned())
        .unwrap_or_else(|e| e.to_string());
    assert!(
        e.contains(&format!("is owned by uid {NOBODY}"))
            && e.contains(&foreign.display().to_string()),
        "accepted a control directory owned by uid {NOBODY}: {e}"
    );

    let target = tmp.path().join("target");
    std::fs::create_dir(&target).unwrap();
    let link = tmp.path().join("link");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let e = ensure_private_dir(&link)
        .map(|()| "Ok".to_owned())
        .unwrap_or_else(|e| e.to_string());
    assert!(
        e.contains("is a symlink; refusing to follow it"),
        "accepted a control directory that is a symlink: {e}"
    );

    let file = tmp.path().join("file");
    std::fs::write(&file, "").unwrap();
    let e = ensure_private_dir(&file).unwrap_err().to_string();
    assert!(e.contains(&file.display().to_string()), "{e}");
}
