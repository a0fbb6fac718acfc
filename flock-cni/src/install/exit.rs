//! The installer's exit: take every trace of flock out of the directory (unless told
//! to keep it), remove the plugin binary and the ready file.

use std::fs;
use std::io;

use flock_core::cniconf::installer::{Io, Restore};
use tracing::{error, info};

use super::files::{self, Perm, Replace, read_regular, remove_if_exists, sync_dir, write_atomic};
use super::{Daemon, Mode, OnExit};

impl Daemon {
    /// Restores the directory (unless `--on-exit keep`); true when everything was
    /// restored.
    pub(super) fn shutdown(&mut self) -> bool {
        if let Some(path) = &self.cfg.ready_file
            && let Err(e) = remove_if_exists(path)
        {
            error!(file = %path.display(), error = %e, "cannot remove the ready file");
        }
        let own_write_events = self.machine.own_write_events();
        if self.cfg.on_exit == OnExit::Keep {
            info!(
                writes = self.writes,
                own_write_events,
                "leaving configs patched and the plugin installed (--on-exit keep)"
            );
            return true;
        }
        let mut ok = true;
        let mut restored = 0u32;
        match self.cfg.mode {
            Mode::Chained => {
                for name in files::list_config_names(&self.dir).unwrap_or_default() {
                    match self.restore_file(&name) {
                        Ok(true) => restored += 1,
                        Ok(false) => {}
                        Err(e) => {
                            ok = false;
                            error!(file = name, error = %e, "cannot restore config");
                        }
                    }
                }
            }
            Mode::Subdir => {
                for io in self.machine.remove_all_dropins() {
                    if let Io::RemoveDropIn {
                        dir_name,
                        file_name,
                        remove_dir,
                    } = io
                    {
                        files::remove_dropin(&self.dir, &dir_name, &file_name, remove_dir);
                        restored += 1;
                    }
                }
            }
        }
        files::remove_stale_temp_files(&self.dir, &self.cfg.bin_dir);
        if let Some(bin) = self.installed_bin.take() {
            match remove_if_exists(&bin) {
                Ok(()) => info!(binary = %bin.display(), "removed plugin binary"),
                Err(e) => {
                    ok = false;
                    error!(binary = %bin.display(), error = %e, "cannot remove plugin binary");
                }
            }
        }
        info!(
            restored,
            writes = self.writes,
            own_write_events,
            "restored; exiting"
        );
        ok
    }

    fn restore_file(&mut self, name: &str) -> io::Result<bool> {
        // Regular files only (`O_NOFOLLOW`): a link was never written, so it holds
        // nothing to restore.
        let Ok((bytes, meta)) = read_regular(&self.dir.join(name), false) else {
            return Ok(false);
        };
        let conf_exists = self
            .machine
            .converted_from(name)
            .is_some_and(|conf| fs::symlink_metadata(self.dir.join(conf)).is_ok());
        match self.machine.restore(name, &bytes, conf_exists) {
            Restore::Untouched => Ok(false),
            Restore::Error(e) => Err(io::Error::other(e)),
            Restore::BackToConf {
                conf_name,
                bytes: conf,
            } => {
                // Never over a `.conf` that appeared since: that one is not ours.
                if !write_atomic(
                    &self.dir,
                    &conf_name,
                    &conf,
                    Perm::Like(&meta),
                    Replace::Never,
                )? {
                    return Err(io::Error::other(format!(
                        "{conf_name} appeared while restoring it; left {name} patched"
                    )));
                }
                fs::remove_file(self.dir.join(name))?;
                sync_dir(&self.dir)?;
                info!(file = %conf_name, from = name, "restored the original single-plugin .conf");
                Ok(true)
            }
            Restore::Rewrite(out) => {
                if !write_atomic(
                    &self.dir,
                    name,
                    &out,
                    Perm::Like(&meta),
                    Replace::IfHolds(&bytes),
                )? {
                    return Err(io::Error::other("changed while we restored it"));
                }
                info!(file = name, "restored config (flock's entry removed)");
                Ok(true)
            }
        }
    }
}
