//! A network namespace for tests and benchmarks whose pods need one that exists.
//!
//! The agent refuses an ADD naming the node's own network namespace
//! (`/proc/1/ns/net`, `/proc/self/ns/net`): meshing a pod there would capture the
//! node's own traffic. Tests and benchmarks whose pods need a namespace that exists but
//! not one of their own (no capture, nothing of theirs binds in it) share this one.

use std::path::Path;
use std::process::Command;
use std::sync::OnceLock;

/// `/var/run/netns/flock-pods-<pid>`: made (as root, with `ip netns add`, loopback up)
/// on first use in this process. A static is never dropped, so namespaces left by
/// earlier processes that have exited are deleted here instead.
pub fn pods_netns() -> &'static str {
    static PATH: OnceLock<String> = OnceLock::new();
    PATH.get_or_init(|| {
        if let Ok(dir) = std::fs::read_dir("/var/run/netns") {
            for entry in dir.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let gone = name
                    .strip_prefix("flock-pods-")
                    .and_then(|pid| pid.parse::<u32>().ok())
                    .is_some_and(|pid| !Path::new(&format!("/proc/{pid}")).exists());
                if gone {
                    let _ = Command::new("ip").args(["netns", "del", &name]).output();
                }
            }
        }
        let name = format!("flock-pods-{}", std::process::id());
        for args in [
            &["netns", "add", name.as_str()][..],
            &["-n", name.as_str(), "link", "set", "lo", "up"],
        ] {
            let out = Command::new("ip")
                .args(args)
                .output()
                .expect("ip (iproute2) is needed: run scripts/test (scripts/prereqs/20-cni.sh)");
            assert!(
                out.status.success(),
                "ip {args:?} (needs root): {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        format!("/var/run/netns/{name}")
    })
}
