//! Shared setup of the installer's integration tests: a temporary CNI config
//! directory, a stand-in plugin binary, and a daemon config over them.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use flock_cni::install::{Config, Hooks, Mode, OnExit};
use flock_core::cniconf::{ConfPolicy, ConfigKind, OurPlugin, is_patched, parse};

/// A conflist for network `network` holding one foreign plugin.
pub fn conflist(network: &str) -> String {
    format!(r#"{{"cniVersion": "1.0.0", "name": "{network}", "plugins": [{{"type": "bridge"}}]}}"#)
}

/// The plugin entry the installer adds.
pub fn ours() -> OurPlugin {
    OurPlugin::from_bytes(br#"{"type": "flock-cni", "agent_socket": "/run/flock/cni.sock"}"#)
        .unwrap()
}

/// Whether the conflist at `path` carries our plugin.
pub fn patched(path: &Path) -> bool {
    fs::read(path)
        .ok()
        .and_then(|b| parse(&b, ConfigKind::ConfList).ok())
        .is_some_and(|c| is_patched(&c, &ours()))
}

/// A temporary directory holding an empty `net.d` and a plugin binary; the ready file
/// path is inside it, not created.
pub struct Dirs {
    pub tmp: tempfile::TempDir,
    pub conf: PathBuf,
    pub plugin: PathBuf,
    pub ready: PathBuf,
}

pub fn dirs() -> Dirs {
    let tmp = tempfile::tempdir().unwrap();
    let conf = tmp.path().join("net.d");
    fs::create_dir(&conf).unwrap();
    let plugin = tmp.path().join("flock-cni-binary");
    fs::write(&plugin, b"#!/bin/sh\n").unwrap();
    let ready = tmp.path().join("ready");
    Dirs {
        tmp,
        conf,
        plugin,
        ready,
    }
}

/// A chained-mode daemon config over `d` that restores on exit; the timing fields
/// (`resync`, `write_burst`, `write_interval`) and `hooks` are each test's own.
pub fn config(
    d: &Dirs,
    resync: Duration,
    write_burst: u32,
    write_interval: Duration,
    hooks: Hooks,
) -> Config {
    Config {
        conf_dir: d.conf.clone(),
        bin_dir: d.tmp.path().join("bin"),
        plugin_bin: d.plugin.clone(),
        ours: ours(),
        mode: Mode::Chained,
        conf_policy: ConfPolicy::ConvertToList,
        ready_file: Some(d.ready.clone()),
        on_exit: OnExit::Restore,
        resync,
        write_burst,
        write_interval,
        hooks,
    }
}
