//! The node side of probe admission: kubelet's probes reach captured pods' apps from
//! one link-local source address that only the named cgroups' sockets on this node
//! are given, and nothing else is exempt from capture.
//!
//! A captured pod in strict mode drops every inbound TCP connection that does not
//! come through Envoy, but kubelet's liveness and readiness probes are plain HTTP/TCP
//! from the node and must reach the app. Exempting the node's address on the pod
//! network (the gateway) would also exempt every hostNetwork process and every
//! connection kube-proxy SNATs to the node (NodePort, external traffic): they all
//! arrive from that address. Instead (as Istio's ambient mode does with the same
//! addresses) the node rewrites the source of exactly the probe sockets:
//!
//! * **`probe_mark`** and **`probe_snat`** (`inet flock_node`, filter output and nat
//!   postrouting): a TCP connection whose socket belongs to one of the named cgroup
//!   v2 subtrees (kubelet's: `system.slice/kubelet.service` under systemd) and whose
//!   destination is a captured pod's address (the sets `targets4` / `targets6`) gets
//!   the [`PROBE_MARK`] bit on its way out and leaves with source
//!   [`PROBE_SOURCE_V4`] / [`PROBE_SOURCE_V6`]. Every other process on the node,
//!   root or not, keeps its own source and is captured like any caller.
//! * **antispoof** (`inet flock_node` prerouting and `bridge flock_node` prerouting,
//!   both at raw priority): a packet that *arrives* with a probe source is dropped.
//!   Locally generated packets never traverse prerouting, so only a forged one (a pod
//!   with `CAP_NET_RAW` writing the address itself) is ever matched; the bridge
//!   table catches forgeries between two pods on the same bridge, which the `inet`
//!   hooks never see (without `br_netfilter`).
//!
//! The pod's own table admits the probe source only (see [`super::policy`]).
//!
//! The table is rebuilt whole on every change (one nft transaction; conntrack keeps
//! the translation of connections already open), from the captured pods the agent
//! holds at that moment, so it converges to the store however changes interleave as
//! long as each rebuild reads the store after taking the rebuild lock.

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The node table's name (in the `inet` and `bridge` families).
pub const NODE_TABLE: &str = "flock_node";
/// The IPv4 source kubelet's probes are given: link-local, never a pod's or node's.
pub const PROBE_SOURCE_V4: Ipv4Addr = Ipv4Addr::new(169, 254, 7, 127);
/// The IPv6 source kubelet's probes are given (a ULA address no CNI hands out).
pub const PROBE_SOURCE_V6: Ipv6Addr = Ipv6Addr::new(
    0xfd16, 0x9254, 0x7127, 0x1337, 0xffff, 0xffff, 0xffff, 0xffff,
);
/// The packet-mark bit the output chain gives a probe socket's packets so the nat
/// chain can rewrite their source (bit 13: clear of kube-proxy's 0x4000/0x8000,
/// Calico's 0xffff0000, Cilium's 0x0f00 and the capture mark 0x539's bits are only
/// ever set inside pods). Only the bit is set; the rest of the mark is kept.
pub const PROBE_MARK: u32 = 0x2000;
/// Most cgroups a node may name.
pub const MAX_PROBE_CGROUPS: usize = 16;
/// Most bytes of one cgroup path.
pub const MAX_CGROUP_PATH: usize = 512;

/// A cgroup v2 subtree whose sockets are probes, as nft matches it: `level` path
/// components below the cgroup v2 root, and the path nft resolves under
/// `/sys/fs/cgroup` (which includes the mount's own prefix on a hybrid host, where
/// the v2 hierarchy is mounted at `/sys/fs/cgroup/unified`).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct CgroupMatch {
    /// Depth of the cgroup below the v2 root (`system.slice/kubelet.service`: 2).
    pub level: u32,
    /// The path as nft reads it, relative to `/sys/fs/cgroup`.
    pub nft_path: String,
}

impl CgroupMatch {
    /// `path` relative to the cgroup v2 root (`system.slice/kubelet.service`), on a
    /// host whose v2 hierarchy is mounted `mount_prefix` below `/sys/fs/cgroup` (`""`
    /// on a pure v2 host, `"unified"` on a hybrid one). Refused: an empty or absolute
    /// path, `.`/`..` components, a path too long, characters nft would not take.
    pub fn new(mount_prefix: &str, path: &str) -> Result<Self, String> {
        let trimmed = path.trim_matches('/');
        if trimmed.is_empty() {
            return Err("a probe cgroup path must name a cgroup below the root".into());
        }
        if path.len() > MAX_CGROUP_PATH {
            return Err(format!(
                "a probe cgroup path is longer than {MAX_CGROUP_PATH} bytes"
            ));
        }
        let parts: Vec<&str> = trimmed.split('/').collect();
        for p in &parts {
            if p.is_empty() || *p == "." || *p == ".." {
                return Err(format!(
                    "probe cgroup path {trimmed:?}: empty, . or .. component"
                ));
            }
            if !p
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "-_.:@\\".contains(c))
            {
                return Err(format!(
                    "probe cgroup path {trimmed:?}: only ASCII letters, digits and -_.:@\\ are allowed"
                ));
            }
        }
        let prefix = mount_prefix.trim_matches('/');
        let nft_path = if prefix.is_empty() {
            trimmed.to_string()
        } else {
            format!("{prefix}/{trimmed}")
        };
        Ok(CgroupMatch {
            level: parts.len() as u32,
            nft_path,
        })
    }
}

/// What the node table holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeProbeTable {
    /// The cgroups whose sockets are probes (none: no connection is rewritten, and
    /// kubelet's probes to a strict pod's app ports are refused like any caller's).
    pub cgroups: BTreeSet<CgroupMatch>,
    /// Captured pods' addresses: where a probe socket's source is rewritten.
    pub targets: BTreeSet<IpAddr>,
}

impl NodeProbeTable {
    /// One `nft -f -` script that (re)creates both tables as one transaction. Text,
    /// not nft's JSON: nft's JSON reader drops the `level` of a `socket cgroupv2`
    /// match (nftables 1.0.6), and this table is only ever written, never listed back.
    /// Every value in it is typed (addresses) or validated ([`CgroupMatch::new`]).
    pub fn to_nft_script(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        for family in ["inet", "bridge"] {
            // `add` first so the `delete` finds a table: the script converges from any
            // state, and a failure leaves the previous tables as they were.
            let _ = writeln!(out, "add table {family} {NODE_TABLE}");
            let _ = writeln!(out, "delete table {family} {NODE_TABLE}");
        }
        let elements = |v4: bool| -> String {
            let elems: Vec<String> = self
                .targets
                .iter()
                .filter(|a| a.is_ipv4() == v4)
                .map(|a| a.to_string())
                .collect();
            if elems.is_empty() {
                String::new()
            } else {
                format!(" elements = {{ {} }};", elems.join(", "))
            }
        };
        let _ = writeln!(out, "table inet {NODE_TABLE} {{");
        let _ = writeln!(
            out,
            "    set targets4 {{ type ipv4_addr;{} }}",
            elements(true)
        );
        let _ = writeln!(
            out,
            "    set targets6 {{ type ipv6_addr;{} }}",
            elements(false)
        );
        // The kernel matches a socket's cgroup only in the prerouting, input and
        // output hooks, and rewrites a source only in postrouting: the output chain
        // marks a probe socket's packets with one bit, the nat chain rewrites what
        // carries it.
        let _ = writeln!(out, "    chain probe_mark {{");
        let _ = writeln!(
            out,
            "        type filter hook output priority -150; policy accept;"
        );
        let cgroup_any = crate::reintroduced!("probe-snat-any-host-socket");
        for cg in &self.cgroups {
            let socket = if cgroup_any {
                // The mutant takes every socket on the node for a probe.
                String::new()
            } else {
                format!("socket cgroupv2 level {} \"{}\" ", cg.level, cg.nft_path)
            };
            for (proto, set) in [("ip", "@targets4"), ("ip6", "@targets6")] {
                let _ = writeln!(
                    out,
                    "        {socket}{proto} daddr {set} meta l4proto tcp meta mark set meta mark | {PROBE_MARK:#010x}"
                );
            }
        }
        let _ = writeln!(out, "    }}");
        let _ = writeln!(out, "    chain probe_snat {{");
        let _ = writeln!(
            out,
            "        type nat hook postrouting priority 100; policy accept;"
        );
        if !self.cgroups.is_empty() {
            let _ = writeln!(
                out,
                "        meta mark & {PROBE_MARK:#010x} == {PROBE_MARK:#010x} ip daddr @targets4 counter snat ip to {PROBE_SOURCE_V4}"
            );
            let _ = writeln!(
                out,
                "        meta mark & {PROBE_MARK:#010x} == {PROBE_MARK:#010x} ip6 daddr @targets6 counter snat ip6 to {PROBE_SOURCE_V6}"
            );
        }
        let _ = writeln!(out, "    }}");
        let antispoof = |out: &mut String| {
            let _ = writeln!(out, "    chain antispoof {{");
            let _ = writeln!(
                out,
                "        type filter hook prerouting priority -300; policy accept;"
            );
            let _ = writeln!(out, "        ip saddr {PROBE_SOURCE_V4} counter drop");
            let _ = writeln!(out, "        ip6 saddr {PROBE_SOURCE_V6} counter drop");
            let _ = writeln!(out, "    }}");
        };
        antispoof(&mut out);
        let _ = writeln!(out, "}}");
        let _ = writeln!(out, "table bridge {NODE_TABLE} {{");
        antispoof(&mut out);
        let _ = writeln!(out, "}}");
        out
    }
}

/// An `nft -f -` script that deletes both node tables, present or not.
pub fn remove_node_script() -> String {
    let mut out = String::new();
    for family in ["inet", "bridge"] {
        out.push_str(&format!(
            "add table {family} {NODE_TABLE}\ndelete table {family} {NODE_TABLE}\n"
        ));
    }
    out
}

/// Where the cgroup v2 hierarchy is mounted below `/sys/fs/cgroup`, from
/// `/proc/self/mountinfo`: `Some("")` on a pure v2 host, `Some("unified")` on a
/// hybrid one, `None` without a v2 mount there (nft resolves cgroup paths under
/// `/sys/fs/cgroup` only). Bounded: reads at most 4,096 lines.
pub fn cgroup2_prefix(mountinfo: &str) -> Option<String> {
    mountinfo.lines().take(4096).find_map(|line| {
        // `id parent major:minor root mountpoint opts [optional...] - fstype src opts`
        let (pre, post) = line.split_once(" - ")?;
        if post.split_whitespace().next()? != "cgroup2" {
            return None;
        }
        let mountpoint = pre.split_whitespace().nth(4)?;
        let rest = mountpoint.strip_prefix("/sys/fs/cgroup")?;
        if !rest.is_empty() && !rest.starts_with('/') {
            return None;
        }
        Some(rest.trim_matches('/').to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_paths_are_leveled_and_prefixed() {
        let pure = CgroupMatch::new("", "/system.slice/kubelet.service").unwrap();
        assert_eq!(pure.level, 2);
        assert_eq!(pure.nft_path, "system.slice/kubelet.service");
        let hybrid = CgroupMatch::new("unified", "kubelet").unwrap();
        assert_eq!(hybrid.level, 1);
        assert_eq!(hybrid.nft_path, "unified/kubelet");
        for bad in ["", "/", "a/../b", "a//b", "a b", "a\"b", &"x".repeat(600)] {
            assert!(CgroupMatch::new("", bad).is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn mountinfo_prefix() {
        let hybrid = "30 25 0:26 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
                      31 30 0:27 / /sys/fs/cgroup/unified rw,nosuid shared:10 - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_prefix(hybrid).as_deref(), Some("unified"));
        let pure =
            "29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(cgroup2_prefix(pure).as_deref(), Some(""));
        let elsewhere = "31 30 0:27 / /run/cilium/cgroupv2 rw - cgroup2 none rw\n";
        assert_eq!(cgroup2_prefix(elsewhere), None);
        assert_eq!(cgroup2_prefix("garbage\n - \n"), None);
    }

    #[test]
    fn the_script_rewrites_only_the_named_cgroups_sockets_to_captured_pods() {
        let t = NodeProbeTable {
            cgroups: [CgroupMatch::new("", "system.slice/kubelet.service").unwrap()].into(),
            targets: [
                "10.1.0.5".parse().unwrap(),
                "10.1.0.6".parse().unwrap(),
                "fd00::5".parse().unwrap(),
            ]
            .into(),
        };
        let script = t.to_nft_script();
        assert!(
            script.contains("set targets4 { type ipv4_addr; elements = { 10.1.0.5, 10.1.0.6 }; }"),
            "{script}"
        );
        assert!(
            script.contains("set targets6 { type ipv6_addr; elements = { fd00::5 }; }"),
            "{script}"
        );
        let marks: Vec<&str> = script
            .lines()
            .filter(|l| l.contains("meta mark set"))
            .collect();
        assert_eq!(marks.len(), 2, "{script}");
        for l in &marks {
            assert!(
                l.trim_start()
                    .starts_with(r#"socket cgroupv2 level 2 "system.slice/kubelet.service" "#),
                "a probe mark not scoped to the cgroup: {l}"
            );
            assert!(l.ends_with("meta mark set meta mark | 0x00002000"), "{l}");
        }
        let snat: Vec<&str> = script.lines().filter(|l| l.contains(" snat ")).collect();
        assert_eq!(snat.len(), 2, "{script}");
        for l in &snat {
            assert!(
                l.trim_start()
                    .starts_with("meta mark & 0x00002000 == 0x00002000 "),
                "{l}"
            );
        }
        assert!(snat[0].ends_with("snat ip to 169.254.7.127"), "{}", snat[0]);
        assert!(snat[1].ends_with("snat ip6 to fd16:9254:7127:1337:ffff:ffff:ffff:ffff"));
        // Both families drop a packet that arrives with the probe source.
        assert_eq!(
            script
                .matches("ip saddr 169.254.7.127 counter drop")
                .count(),
            2
        );
        // No cgroup: no rewriting at all, the antispoof rules stay; no targets: empty sets.
        let none = NodeProbeTable::default().to_nft_script();
        assert!(!none.contains(" snat "), "{none}");
        assert!(none.contains("set targets4 { type ipv4_addr; }"), "{none}");
        assert!(none.contains("chain antispoof"));
    }
}
