//! The node's own table (`inet flock_node` and `bridge flock_node`): kubelet's probe
//! sockets get the link-local probe source on their way to captured pods, and a packet
//! that arrives carrying that source is dropped. What it holds is
//! [`flock_core::capture::probe`]'s; this module runs `nft` in the node's netns.

use std::path::Path;
use std::process::Command;

use flock_core::capture::probe::{self, CgroupMatch, NodeProbeTable};

use super::{CaptureError, Nft, classify, run};

impl Nft {
    /// Installs (or re-installs, atomically) the node tables, in `netns` or, with
    /// `None`, in the caller's own network namespace (the agent's: the host's).
    pub fn apply_node(
        &self,
        netns: Option<&Path>,
        table: &NodeProbeTable,
    ) -> Result<(), CaptureError> {
        let script = table.to_nft_script();
        self.run_node(netns, "apply node table", script.as_bytes())
    }

    /// Deletes the node tables, present or not.
    pub fn remove_node(&self, netns: Option<&Path>) -> Result<(), CaptureError> {
        let script = probe::remove_node_script();
        self.run_node(netns, "remove node table", script.as_bytes())
    }

    fn run_node(
        &self,
        netns: Option<&Path>,
        what: &'static str,
        script: &[u8],
    ) -> Result<(), CaptureError> {
        if let Some(ns) = netns {
            return self.run_in(ns, what, &["-f", "-"], Some(script)).map(drop);
        }
        let nft = self.nft_path()?;
        let mut cmd = Command::new(nft);
        cmd.args(["-f", "-"]);
        let out = run(cmd, what, Some(script))?;
        if out.status.success() {
            return Ok(());
        }
        Err(classify(
            what,
            out.status.to_string(),
            &String::from_utf8_lossy(&out.stderr),
        ))
    }
}

/// The cgroup matches for `paths` (relative to the cgroup v2 root, as `--capture-probe-cgroup`
/// names them) on this host: finds where cgroup v2 is mounted below `/sys/fs/cgroup`
/// (nft resolves the paths there) and that each cgroup exists, so a typo or a host
/// without cgroup v2 is an error at start, not probes that silently fail later.
pub fn probe_cgroups(paths: &[String]) -> Result<Vec<CgroupMatch>, String> {
    if paths.is_empty() {
        return Ok(Vec::new());
    }
    if paths.len() > probe::MAX_PROBE_CGROUPS {
        return Err(format!(
            "more than {} probe cgroups",
            probe::MAX_PROBE_CGROUPS
        ));
    }
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo")
        .map_err(|e| format!("reading /proc/self/mountinfo: {e}"))?;
    let prefix = probe::cgroup2_prefix(&mountinfo).ok_or(
        "no cgroup v2 hierarchy at /sys/fs/cgroup or /sys/fs/cgroup/unified (in a container, \
         mount the host's /sys/fs/cgroup there)",
    )?;
    let mut out = Vec::new();
    for p in paths {
        let m = CgroupMatch::new(&prefix, p)?;
        let dir = Path::new("/sys/fs/cgroup").join(&m.nft_path);
        if !dir.is_dir() {
            return Err(format!(
                "probe cgroup {p:?}: {} does not exist (kubelet's cgroup is the last field \
                 of /proc/<kubelet pid>/cgroup's `0::` line)",
                dir.display()
            ));
        }
        out.push(m);
    }
    Ok(out)
}
