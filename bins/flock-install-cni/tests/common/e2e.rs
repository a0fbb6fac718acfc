//! Real CNI runtime pieces for the end-to-end tests and benchmarks: Debian's reference
//! plugins, the libcni driver built by scripts/prereqs/20-cni.sh, network namespaces.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::atomic::{AtomicU32, Ordering};

/// Reads a variable scripts/test exports, or fails with what to do.
pub fn required_env(name: &str) -> PathBuf {
    match std::env::var_os(name) {
        Some(v) if Path::new(&v).exists() => PathBuf::from(v),
        Some(v) => panic!(
            "{name}={} does not exist: run scripts/test (scripts/prereqs/20-cni.sh installs the CNI plugins and builds the libcni driver)",
            PathBuf::from(v).display()
        ),
        None => panic!(
            "{name} is not set: run this test through scripts/test, which installs Debian's CNI plugins, Go and libcni and exports FLOCK_CNI_PLUGIN_DIR and FLOCK_CNITOOL (scripts/prereqs/20-cni.sh)"
        ),
    }
}

/// The real flock-cni plugin: built next to flock-install-cni by `cargo build`/nextest
/// of the workspace.
pub fn plugin_binary() -> PathBuf {
    let p = Path::new(super::BIN).with_file_name("flock-cni");
    assert!(
        p.exists(),
        "{} is missing: build the workspace (cargo build -p flock-cni-plugin) or run scripts/test",
        p.display()
    );
    p
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A network namespace and a bridge name unique to this process and call; both are
/// deleted on drop (also when the test fails).
pub struct NetNs {
    pub name: String,
    pub bridge: String,
    /// A /24 in 198.18.0.0/15 (RFC 2544 benchmarking range; only ever inside our own
    /// namespaces and bridge, which has no address: no traffic leaves).
    pub subnet: String,
}

impl NetNs {
    pub fn new() -> Self {
        let n = SEQ.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let name = format!("flock-e2e-{pid}-{n}");
        // Interface names are at most 15 bytes.
        let bridge = format!("flk{:x}{n}", pid % 0xfffff);
        let third = (pid.wrapping_mul(7).wrapping_add(n)) % 250 + 1;
        let subnet = format!("198.18.{third}.0/24");
        let out = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .expect("ip (iproute2) is needed: run scripts/test");
        assert!(
            out.status.success(),
            "ip netns add {name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Self {
            name,
            bridge,
            subnet,
        }
    }

    pub fn path(&self) -> String {
        format!("/var/run/netns/{}", self.name)
    }

    /// `ip -n <ns> -j addr` output.
    pub fn addresses(&self) -> String {
        let out = Command::new("ip")
            .args(["-n", &self.name, "-j", "addr"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .output();
    }
}

/// A bridge + host-local primary list for `ns`, state under `dir`.
pub fn bridge_conflist(ns: &NetNs, dir: &Path, network: &str) -> String {
    serde_json::json!({
        "cniVersion": "1.0.0",
        "name": network,
        "plugins": [{
            "type": "bridge",
            "bridge": ns.bridge,
            "isGateway": false,
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": ns.subnet}]],
                "dataDir": dir.join("ipam").to_str().unwrap()
            }
        }]
    })
    .to_string()
}

/// Runs the libcni driver.
pub fn cnitool(args: &[&str], cni_path: &str, cache: &Path) -> Output {
    Command::new(required_env("FLOCK_CNITOOL"))
        .args(args)
        .env("CNI_PATH", cni_path)
        .env("CNI_CACHE_DIR", cache)
        .env(
            "CNI_ARGS_K8S",
            "IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME=cart-1;K8S_POD_UID=u-1",
        )
        .output()
        .unwrap()
}
