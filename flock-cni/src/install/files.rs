//! The installer's file I/O: reading an entry without following links, atomic writes
//! with a compare-and-swap, drop-in directories, stale temp files. No decisions: what
//! to write and when comes from `flock_core::cniconf::installer`.

use std::fs::{self, File, Metadata, OpenOptions};
use std::io::{self, Read, Write as _};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;

use flock_core::cniconf::installer::{DropInDir, Entry};
use flock_core::cniconf::{MAX_CONFIG_BYTES, kind_for_file_name, temp_file_name_for};
use tracing::{info, warn};

/// Reads a directory entry. What the entry *is* comes from `symlink_metadata` (a link
/// is reported as [`Entry::Symlink`], typed, never recognised from an error text); a
/// link's target is only ever read, and FIFOs are never opened blocking.
pub(super) fn read_entry(path: &Path) -> Entry {
    let meta = match fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(_) => return Entry::Missing,
    };
    if meta.file_type().is_symlink() {
        let target = fs::read_link(path).unwrap_or_default();
        return Entry::Symlink {
            target: target.display().to_string(),
            content: read_regular(path, true)
                .map(|(b, _)| b)
                .map_err(|e| e.to_string()),
        };
    }
    if !meta.is_file() {
        return Entry::NotRegular;
    }
    match read_regular(path, false) {
        Ok((bytes, _)) => Entry::File(bytes),
        // Gone, or replaced by a link or something else between the two calls: the
        // change produced an event, so it is looked at again.
        Err(_) => Entry::Missing,
    }
}

/// Reads a regular file (at most `MAX_CONFIG_BYTES + 1` bytes), never blocking on a
/// FIFO; with `follow` false a symlink fails (`O_NOFOLLOW`).
pub(super) fn read_regular(path: &Path, follow: bool) -> io::Result<(Vec<u8>, Metadata)> {
    let mut flags = nix::libc::O_NONBLOCK | nix::libc::O_CLOEXEC;
    if !follow {
        flags |= nix::libc::O_NOFOLLOW;
    }
    let file = OpenOptions::new()
        .read(true)
        .custom_flags(flags)
        .open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(io::Error::other("not a regular file"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_CONFIG_BYTES as u64 + 1)
        .read_to_end(&mut bytes)?;
    Ok((bytes, meta))
}

/// Mode and owner of a file written by [`write_atomic`].
pub(super) enum Perm<'a> {
    Like(&'a Metadata),
    Mode(u32),
}

/// When [`write_atomic`] may replace its target.
pub(super) enum Replace<'a> {
    /// Whatever is there.
    Any,
    /// Only if it still holds these bytes (checked just before the rename).
    IfHolds(&'a [u8]),
    /// Only if nothing is there: the rename itself refuses (`RENAME_NOREPLACE`), so a
    /// file created at the last moment is never clobbered.
    Never,
}

/// Writes `bytes` to `dir/name` atomically: a temp file in the same directory
/// (`O_EXCL`, so never through a planted link), mode and owner set, fsync, rename, fsync
/// of the directory. `Ok(false)` (and the temp file removed) when `replace` forbids
/// replacing what is there.
pub(super) fn write_atomic(
    dir: &Path,
    name: &str,
    bytes: &[u8],
    perm: Perm<'_>,
    replace: Replace<'_>,
) -> io::Result<bool> {
    let tmp = dir.join(temp_file_name_for(name));
    let target = dir.join(name);
    remove_if_exists(&tmp)?;
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_CLOEXEC)
            .open(&tmp)?;
        f.write_all(bytes)?;
        match perm {
            Perm::Like(meta) => {
                std::os::unix::fs::fchown(&f, Some(meta.uid()), Some(meta.gid()))?;
                f.set_permissions(fs::Permissions::from_mode(meta.mode() & 0o7777))?;
            }
            Perm::Mode(mode) => f.set_permissions(fs::Permissions::from_mode(mode))?,
        }
        f.sync_all()?;
        drop(f);
        match replace {
            Replace::Any => fs::rename(&tmp, &target)?,
            Replace::IfHolds(expect) => {
                match read_regular(&target, false) {
                    Ok((now, _)) if now == expect => {}
                    _ => return Ok(false),
                }
                fs::rename(&tmp, &target)?;
            }
            Replace::Never => {
                if !rename_noreplace(dir, &temp_file_name_for(name), name)? {
                    return Ok(false);
                }
            }
        }
        sync_dir(dir)?;
        Ok(true)
    })();
    if !matches!(result, Ok(true)) {
        let _ = fs::remove_file(&tmp);
    }
    result
}

/// Renames `dir/from` to `dir/to` unless `dir/to` exists; false when it does.
fn rename_noreplace(dir: &Path, from: &str, to: &str) -> io::Result<bool> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        use nix::errno::Errno;
        use nix::fcntl::{RenameFlags, renameat2};
        let d = File::open(dir)?;
        match renameat2(&d, from, &d, to, RenameFlags::RENAME_NOREPLACE) {
            Ok(()) => return Ok(true),
            Err(Errno::EEXIST) => return Ok(false),
            // A filesystem without the flag: fall back to look-then-rename below.
            Err(Errno::EINVAL | Errno::ENOSYS) => {}
            Err(e) => return Err(e.into()),
        }
    }
    if fs::symlink_metadata(dir.join(to)).is_ok() {
        return Ok(false);
    }
    fs::rename(dir.join(from), dir.join(to))?;
    Ok(true)
}

pub(super) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

pub(super) fn remove_if_exists(path: &Path) -> io::Result<()> {
    match fs::remove_file(path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The config-file names of `dir` (`.conf`, `.conflist`, `.json`), sorted.
pub(super) fn list_config_names(dir: &Path) -> io::Result<Vec<String>> {
    let mut names = Vec::new();
    for e in fs::read_dir(dir)? {
        let e = e?;
        if let Ok(name) = e.file_name().into_string()
            && kind_for_file_name(&name).is_some()
        {
            names.push(name);
        }
    }
    names.sort();
    Ok(names)
}

/// Removes `.<name>.flock-tmp` files an earlier run left behind in `dirs` and in the
/// sub-directories of the first one (never loaded by a runtime: see
/// [`temp_file_name_for`]).
pub(super) fn remove_stale_temp_files(conf_dir: &Path, bin_dir: &Path) {
    let mut dirs = vec![conf_dir.to_owned()];
    if let Ok(entries) = fs::read_dir(conf_dir) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                dirs.push(e.path());
            }
        }
    }
    dirs.push(bin_dir.to_owned());
    for d in dirs {
        let Ok(entries) = fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            let name = name.to_string_lossy();
            if name.starts_with('.') && name.ends_with(".flock-tmp") {
                match fs::remove_file(e.path()) {
                    Ok(()) => {
                        info!(file = %e.path().display(), "removed a stale temp file of an earlier run")
                    }
                    Err(err) => {
                        warn!(file = %e.path().display(), error = %err, "cannot remove stale temp file")
                    }
                }
            }
        }
    }
}

/// What a drop-in's sub-directory `sub` holds: a real directory (and the drop-in's
/// current bytes), nothing, or something flock must not write into.
pub(super) fn probe_dropin_dir(sub: &Path, file_name: &str) -> DropInDir {
    match fs::symlink_metadata(sub) {
        Ok(m) if m.is_dir() => DropInDir::Directory(match read_entry(&sub.join(file_name)) {
            Entry::File(b) => Some(b),
            _ => None,
        }),
        Ok(_) => DropInDir::NotADirectory,
        Err(e) if e.kind() == io::ErrorKind::NotFound => DropInDir::Missing,
        Err(e) => DropInDir::Error(e.to_string()),
    }
}

/// Removes a drop-in, and its sub-directory when `remove_dir` and it is empty
/// (someone else's drop-ins stay).
pub(super) fn remove_dropin(conf_dir: &Path, dir_name: &str, file_name: &str, remove_dir: bool) {
    let sub = conf_dir.join(dir_name);
    match fs::remove_file(sub.join(file_name)) {
        Ok(()) => info!(file = %format!("{dir_name}/{file_name}"), "removed drop-in"),
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => warn!(dir = %dir_name, error = %e, "cannot remove drop-in"),
    }
    if remove_dir {
        let _ = fs::remove_dir(&sub);
    }
    let _ = sync_dir(conf_dir);
}
