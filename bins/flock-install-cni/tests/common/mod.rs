//! Harness for running the real `flock-install-cni` binary in a temp directory.
#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub mod e2e;

use nix::sys::signal::{Signal, kill};
use nix::unistd::Pid;
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_flock-install-cni");

pub use flock_testkit::wait_for;

pub const WAIT: Duration = Duration::from_secs(10);

/// One installer process on its own temp dirs; killed (SIGKILL) on drop if still up.
pub struct Installer {
    pub tmp: tempfile::TempDir,
    pub conf: PathBuf,
    pub bin: PathBuf,
    pub ready: PathBuf,
    pub log: PathBuf,
    pub plugin: PathBuf,
    child: Option<Child>,
}

impl Installer {
    /// Temp dirs and a fake plugin binary, without starting.
    pub fn prepare() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let conf = tmp.path().join("net.d");
        let bin = tmp.path().join("bin");
        fs::create_dir(&conf).unwrap();
        let plugin = tmp.path().join("flock-cni-build");
        fs::write(&plugin, b"#!/bin/sh\necho fake flock-cni\n").unwrap();
        Self {
            ready: tmp.path().join("ready"),
            log: tmp.path().join("installer.log"),
            conf,
            bin,
            plugin,
            tmp,
            child: None,
        }
    }

    pub fn start(mut self, extra: &[&str]) -> Self {
        self.spawn(extra);
        self
    }

    pub fn command(&self, extra: &[&str]) -> Command {
        let mut cmd = Command::new(BIN);
        cmd.arg("--cni-conf-dir")
            .arg(&self.conf)
            .arg("--cni-bin-dir")
            .arg(&self.bin)
            .arg("--plugin-bin")
            .arg(&self.plugin)
            .arg("--ready-file")
            .arg(&self.ready)
            .args(["--log-format", "json"])
            .args(extra)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(&self.log).unwrap());
        cmd
    }

    /// Starts without waiting for anything.
    pub fn spawn_nowait(&mut self, extra: &[&str]) {
        self.child = Some(self.command(extra).spawn().unwrap());
    }

    pub fn spawn(&mut self, extra: &[&str]) {
        self.spawn_nowait(extra);
        wait_for("the initial scan", WAIT, || {
            self.logged("initial scan done") > 0 || self.exited()
        });
    }

    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| c.try_wait().unwrap().is_some())
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.conf.join(name)
    }

    pub fn read(&self, name: &str) -> String {
        fs::read_to_string(self.path(name)).unwrap_or_default()
    }

    /// Every JSON log line.
    pub fn logs(&self) -> Vec<Value> {
        fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect()
    }

    pub fn logged(&self, message_prefix: &str) -> usize {
        self.logs()
            .iter()
            .filter(|l| {
                l["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with(message_prefix))
            })
            .count()
    }

    /// The files the installer wrote (one entry per write), in order.
    pub fn writes(&self) -> Vec<String> {
        self.logs()
            .iter()
            .filter(|l| {
                l["fields"]["message"]
                    .as_str()
                    .is_some_and(|m| m.starts_with("wrote config"))
            })
            .filter_map(|l| l["fields"]["file"].as_str().map(str::to_owned))
            .collect()
    }

    pub fn writes_to(&self, name: &str) -> usize {
        self.writes().iter().filter(|f| *f == name).count()
    }

    pub fn is_ready(&self) -> bool {
        self.ready.exists()
    }

    pub fn wait_patched(&self, name: &str) {
        wait_for(&format!("{name} patched"), WAIT, || {
            is_patched(&self.read(name))
        });
    }

    pub fn signal(&mut self, sig: Signal) {
        if let Some(c) = &self.child {
            kill(Pid::from_raw(c.id() as i32), sig).unwrap();
        }
    }

    /// SIGTERM, then the exit status (within 10 s).
    pub fn stop(&mut self) -> ExitStatus {
        self.signal(Signal::SIGTERM);
        self.wait_exit()
    }

    pub fn wait_exit(&mut self) -> ExitStatus {
        let mut child = self.child.take().expect("not running");
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                panic!(
                    "installer did not exit within {WAIT:?}; log:\n{}",
                    fs::read_to_string(&self.log).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    pub fn dump_log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Installer {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Our entry exactly once and last, in a parseable list.
pub fn is_patched(text: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(text) else {
        return false;
    };
    let Some(plugins) = v["plugins"].as_array() else {
        return false;
    };
    let ours = plugins.iter().filter(|p| p["type"] == "flock-cni").count();
    ours == 1 && plugins.last().is_some_and(|p| p["type"] == "flock-cni")
}

pub fn conflist(name: &str, plugin: &str) -> String {
    format!(
        r#"{{"cniVersion": "0.4.0", "name": "{name}", "disableCheck": true, "plugins": [{{"type": "{plugin}"}}]}}"#
    )
}

/// Files in `dir` whose names end in `.flock-tmp`.
pub fn temp_files(dir: &Path) -> Vec<String> {
    fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".flock-tmp"))
        .collect()
}
