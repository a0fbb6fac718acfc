//! Applies, checks and removes a pod's transparent-capture nftables table inside its network namespace, through `nft -j`.
//!
//! The rules (one table, `inet flock_capture`) and the comparison of what the kernel
//! holds with what we would install are pure and live in [`flock_core::capture`]; this
//! crate only runs `nft` inside the pod's netns and maps its failures to
//! [`CaptureError`]s that name the cause.
//!
//! * [`Nft::apply`]: one `nft -j -f -` batch, run inside the pod's netns (started
//!   from a thread of ours that entered it; the netns may be a `/var/run/netns` name
//!   or a CNI_NETNS like `/proc/<pid>/ns/net`). A batch is one nftables transaction: all of the table or,
//!   on failure, the previous state. It deletes and re-creates the table, so a
//!   repeated apply converges on one identical table.
//! * [`Nft::check`]: `nft -j list table inet flock_capture`, parsed (bounded) and
//!   compared rule by rule: a missing table or the first drifted rule, precisely.
//! * [`Nft::remove`]: deletes the table, present or not, and the policy route.
//! * With [`CaptureSpec::original_src`] (the app sees its callers' own addresses),
//!   apply, check and remove also cover the pod's policy route
//!   ([`flock_core::capture::PolicyRoute`]: `ip rule` and `ip route` of its own
//!   table, through iproute2's `ip -j` in the netns), which brings the app's replies
//!   to a caller's address back to Envoy.
//! * [`Nft::probe`]: whether this host can do any of it: a missing `nft` binary and a
//!   kernel without nf_tables each get their own error.
//!
//! # Why nft's JSON API, not netlink from Rust
//!
//! nftables is programmed over netlink, but the Rust crates that speak it either are
//! GPL-licensed (rustables) or bind libnftnl (C, GPL) — neither fits an Apache-2.0
//! agent. `nft -j` is nftables' own stable, documented interface (libnftables-json(5)):
//! the batch is validated and committed by nft as one transaction, and `nft -j list`
//! is machine-readable. The agent needs `nft` at run time (Debian package `nftables`;
//! [`Nft::probe`] names it when it is missing).
//! The JSON is built from typed values in `flock_core::capture`, not strings. The
//! `nftables` crate (0.6, MIT/Apache-2.0) models the whole schema, but `check` needs a
//! canonical comparison anyway — nft prints rules back normalised (a one-element set
//! as a scalar, a /32 as a bare address, the mark as a number, counters with values)
//! — so its structural types would still need our normaliser; its helper runs `nft`
//! in the caller's netns; and it would be a dependency for the nine statements we
//! emit. Our own types read exactly what nft prints, with size limits, and are fuzzed.
//!
//! # IPv6
//!
//! The table is `inet`: the same rules cover IPv4 and IPv6 (nat hooks in `inet` need
//! Linux ≥ 5.2), `redirect` works for both, and excluded CIDRs and probe sources may
//! be either family. The tests run both.
//!
//! # Capabilities
//!
//! `CAP_SYS_ADMIN` to enter the pod's netns (`setns`, by a short-lived thread whose
//! children start there) and
//! `CAP_NET_ADMIN` in that netns (its user namespace) to change its nftables. [`Nft::probe`]
//! creates a throw-away netns (`unshare --net`), which needs `CAP_SYS_ADMIN` too.
//!
//! # What still bypasses capture
//!
//! Only TCP is redirected. UDP — DNS included — leaves the pod unchanged: Envoy's
//! outbound listener is a TCP listener; capturing UDP would need a UDP proxy (for DNS a
//! resolver) in the pod's path, which the mesh does not have, so UDP is neither
//! redirected nor dropped. Also not captured, by design: loopback (including the
//! pod's own IP, routed over `lo`), link-local and multicast destinations, excluded
//! ports and CIDRs, Envoy's own marked sockets, and probe sources inbound. A process
//! that can set `SO_MARK` passes as Envoy: that takes `CAP_NET_ADMIN`, or, since Linux
//! 5.17, `CAP_NET_RAW` — which container runtimes grant by default, so pods that must
//! not bypass capture should drop `NET_RAW`. `CAP_NET_ADMIN` in the pod also deletes
//! the table. Capture binds applications, not a privileged process in the pod.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

mod node;
mod rtnl;

use flock_core::capture::{
    self, CaptureSpec, Drift, ORIGINAL_SRC_MARK, ORIGINAL_SRC_TABLE, ParseError, PolicyRoute,
    Ruleset, SpecError,
};

pub use node::probe_cgroups;

pub use flock_core::capture::{Cidr, Mode};

/// Why capture rules could not be applied, checked or removed.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The spec has no ruleset.
    #[error(transparent)]
    Spec(#[from] SpecError),
    /// No `nft` binary.
    #[error("nft binary {0:?} not found: install nftables (Debian package `nftables`)")]
    NftMissing(PathBuf),
    /// No `ip` binary.
    #[error("ip binary {0:?} not found: install iproute2 (Debian package `iproute2`)")]
    IpMissing(PathBuf),
    /// `ip` failed.
    #[error("ip {what} failed ({status}): {stderr}")]
    Ip {
        /// The operation.
        what: &'static str,
        /// Its exit status.
        status: String,
        /// Its stderr (bounded).
        stderr: String,
    },
    /// The policy route that brings the app's replies to callers back to Envoy is
    /// missing or differs.
    #[error("policy route in {netns:?} drifted: {detail}")]
    RouteDrifted {
        /// The netns.
        netns: PathBuf,
        /// What differs.
        detail: String,
    },
    /// No `unshare` binary (the probe's throw-away netns).
    #[error("{0:?} not found: install util-linux")]
    UtilMissing(PathBuf),
    /// The kernel has no nf_tables (or not the nat/inet parts the table needs).
    #[error(
        "the kernel does not support nf_tables (nft: {0}); load the nf_tables and nft_nat modules or use a kernel with them (inet nat needs Linux 5.2 or later)"
    )]
    KernelUnsupported(String),
    /// Not allowed to enter the netns or change its nftables.
    #[error("not permitted (needs CAP_SYS_ADMIN to enter the netns and CAP_NET_ADMIN in it): {0}")]
    NotPermitted(String),
    /// The netns path does not exist or is not a netns.
    #[error("network namespace {path:?}: {detail}")]
    Netns {
        /// The path given.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// The table is not there.
    #[error("capture table inet flock_capture is missing in {0:?}")]
    TableMissing(PathBuf),
    /// The table is there but differs from what we install.
    #[error("capture table in {netns:?} drifted: {drift}")]
    Drifted {
        /// The netns.
        netns: PathBuf,
        /// The first difference.
        drift: Drift,
    },
    /// nft's output could not be read.
    #[error(transparent)]
    Parse(#[from] ParseError),
    /// nft failed for another reason.
    #[error("nft {what} failed ({status}): {stderr}")]
    Nft {
        /// The operation.
        what: &'static str,
        /// Its exit status.
        status: String,
        /// Its stderr (bounded).
        stderr: String,
    },
    /// Spawning or talking to a child failed.
    #[error("running {0}: {1}")]
    Io(&'static str, std::io::Error),
    /// The kernel refused a policy-route request over rtnetlink (or the socket failed).
    #[error("{0} over rtnetlink: {1}")]
    Netlink(&'static str, std::io::Error),
}

/// Most bytes of nft's stderr kept in an error.
const MAX_STDERR: usize = 4096;

/// How the `nft`, `ip` and `unshare` binaries are found.
#[derive(Clone, Debug)]
pub struct Nft {
    nft: PathBuf,
    ip: PathBuf,
    unshare: PathBuf,
}

impl Default for Nft {
    fn default() -> Self {
        Nft {
            nft: "nft".into(),
            ip: "ip".into(),
            unshare: "unshare".into(),
        }
    }
}

/// `name` as given if it has a `/`, else the first executable of that name on `PATH`.
fn resolve(name: &Path) -> Option<PathBuf> {
    if name.components().count() > 1 {
        return name.is_file().then(|| name.to_path_buf());
    }
    let path = std::env::var_os("PATH").unwrap_or_else(|| "/usr/sbin:/usr/bin:/sbin:/bin".into());
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// What a failed nft's stderr says about the cause.
fn classify(what: &'static str, status: String, stderr: &str) -> CaptureError {
    let stderr: String = stderr.trim().chars().take(MAX_STDERR).collect();
    // nft reports the netlink socket's errno: EPROTONOSUPPORT when the kernel has no
    // nf_tables at all, EOPNOTSUPP / ENOENT-on-"nat" when a chain type or expression
    // module is missing.
    if stderr.contains("Protocol not supported")
        || stderr.contains("Operation not supported")
        || stderr.contains("Could not process rule: No such file or directory")
            && stderr.contains("type nat")
    {
        CaptureError::KernelUnsupported(stderr)
    } else if stderr.contains("Operation not permitted") {
        CaptureError::NotPermitted(stderr)
    } else {
        CaptureError::Nft {
            what,
            status,
            stderr,
        }
    }
}

impl Nft {
    /// `nft`, `ip` and `unshare` from `PATH`.
    pub fn new() -> Self {
        Self::default()
    }

    /// Another `nft` binary (a path, or a name looked up on `PATH`).
    pub fn with_nft(nft: impl Into<PathBuf>) -> Self {
        Nft {
            nft: nft.into(),
            ..Self::default()
        }
    }

    fn nft_path(&self) -> Result<PathBuf, CaptureError> {
        resolve(&self.nft).ok_or_else(|| CaptureError::NftMissing(self.nft.clone()))
    }

    /// Runs nft with `args` inside `netns`, `stdin` on its standard input; its stdout.
    fn run_in(
        &self,
        netns: &Path,
        what: &'static str,
        args: &[&str],
        stdin: Option<&[u8]>,
    ) -> Result<String, CaptureError> {
        let nft = self.nft_path()?;
        match self.exec_in(&nft, netns, args, stdin, what)? {
            Ran::Out(text) => Ok(text),
            Ran::Failed { status, stderr } => Err(classify(what, status, &stderr)),
        }
    }

    /// Runs `ip` with `args` inside `netns`; its stdout.
    fn ip_in(
        &self,
        netns: &Path,
        what: &'static str,
        args: &[&str],
    ) -> Result<String, CaptureError> {
        let ip = resolve(&self.ip).ok_or_else(|| CaptureError::IpMissing(self.ip.clone()))?;
        match self.exec_in(&ip, netns, args, None, what)? {
            Ran::Out(text) => Ok(text),
            Ran::Failed { status, stderr } => {
                let stderr: String = stderr.trim().chars().take(MAX_STDERR).collect();
                Err(if stderr.contains("Operation not permitted") {
                    CaptureError::NotPermitted(stderr)
                } else {
                    CaptureError::Ip {
                        what,
                        status,
                        stderr,
                    }
                })
            }
        }
    }

    /// Runs `program` with `args` inside `netns`: from a thread of our own that enters
    /// the netns (`setns`) and exits afterwards, so the child starts there — one
    /// process per command, not an `nsenter` in front of each (a process start is
    /// most of what a pod's capture costs its ADD). A netns that cannot be opened or
    /// entered is an error here.
    fn exec_in(
        &self,
        program: &Path,
        netns: &Path,
        args: &[&str],
        stdin: Option<&[u8]>,
        what: &'static str,
    ) -> Result<Ran, CaptureError> {
        let out = in_netns(netns, what, || {
            let mut cmd = Command::new(program);
            cmd.args(args);
            run(cmd, what, stdin)
        })?;
        if out.status.success() {
            return String::from_utf8(out.stdout)
                .map(Ran::Out)
                .map_err(|_| ParseError::Malformed(format!("{what}: output is not UTF-8")).into());
        }
        Ok(Ran::Failed {
            status: out.status.to_string(),
            stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        })
    }

    /// Checks that this host can apply capture rules: the `nft` and `ip` binaries exist and the
    /// kernel has nf_tables with inet nat (lists tables and creates a nat chain in a
    /// throw-away netns, so the host's own rules are untouched).
    pub fn probe(&self) -> Result<(), CaptureError> {
        let nft = self.nft_path()?;
        // The policy route of every captured pod is `ip`'s (iproute2) to install.
        resolve(&self.ip).ok_or_else(|| CaptureError::IpMissing(self.ip.clone()))?;
        let unshare = resolve(&self.unshare)
            .ok_or_else(|| CaptureError::UtilMissing(self.unshare.clone()))?;
        let mut cmd = Command::new(unshare);
        cmd.args(["--net", "--"]).arg(nft).args(["-j", "-f", "-"]);
        // The check that matters is the one apply needs: an inet table with a nat chain.
        let batch = serde_json::json!({"nftables": [
            {"add": {"table": {"family": "inet", "name": "flock_probe"}}},
            {"add": {"chain": {"family": "inet", "table": "flock_probe", "name": "nat",
                "type": "nat", "hook": "output", "prio": -100, "policy": "accept"}}},
        ]});
        let out = run(cmd, "probe", Some(batch.to_string().as_bytes()))?;
        if out.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&out.stderr);
        if let Some(rest) = stderr.strip_prefix("unshare: ") {
            return Err(CaptureError::NotPermitted(
                rest.trim().chars().take(MAX_STDERR).collect(),
            ));
        }
        Err(classify("probe", out.status.to_string(), &stderr))
    }

    /// Installs (or re-installs) the capture table for `spec` in `netns`, atomically:
    /// where there is no table (a new pod) one transaction creates it; where there is
    /// one (a repair, a repeated ADD), the converging batch replaces it. Each is one
    /// transaction, so a failure leaves the table as it was.
    pub fn apply(&self, netns: &Path, spec: &CaptureSpec) -> Result<(), CaptureError> {
        let ruleset = spec.ruleset()?;
        let create = ruleset.to_nft_create_batch().to_string();
        match self.run_in(netns, "apply", &["-j", "-f", "-"], Some(create.as_bytes())) {
            Ok(_) => {}
            // `create table` refused: the table is there, so nothing was applied.
            Err(CaptureError::Nft { stderr, .. }) if stderr.contains("File exists") => {
                let batch = ruleset.to_nft_batch().to_string();
                self.run_in(netns, "apply", &["-j", "-f", "-"], Some(batch.as_bytes()))?;
            }
            Err(e) => return Err(e),
        }
        match spec.original_src {
            Some(o) => self.apply_route(netns, o.routes()),
            None => Ok(()),
        }
    }

    /// The capture table as the kernel holds it.
    pub fn list(&self, netns: &Path) -> Result<Ruleset, CaptureError> {
        match self.run_in(
            netns,
            "list",
            &[
                "-j",
                "list",
                "table",
                capture::TABLE_FAMILY,
                capture::TABLE_NAME,
            ],
            None,
        ) {
            Ok(text) => Ok(capture::parse_listed(&text)?),
            Err(CaptureError::Nft { stderr, .. })
                if stderr.contains("No such file or directory") =>
            {
                Err(CaptureError::TableMissing(netns.into()))
            }
            Err(e) => Err(e),
        }
    }

    /// Whether `netns` holds exactly the table `spec` gives.
    pub fn check(&self, netns: &Path, spec: &CaptureSpec) -> Result<(), CaptureError> {
        let expected = spec.ruleset()?;
        let listed = self.list(netns)?;
        capture::verify(&expected, &listed).map_err(|drift| CaptureError::Drifted {
            netns: netns.into(),
            drift,
        })?;
        match spec.original_src {
            Some(o) => self.check_route(netns, o.routes()),
            None => Ok(()),
        }
    }

    /// Deletes the capture table and the policy route from `netns`; neither being
    /// there is not an error.
    pub fn remove(&self, netns: &Path) -> Result<(), CaptureError> {
        let batch = capture::remove_batch().to_string();
        self.run_in(netns, "remove", &["-j", "-f", "-"], Some(batch.as_bytes()))?;
        for ipv6 in [false, true] {
            let route = PolicyRoute {
                ipv6,
                mark: ORIGINAL_SRC_MARK,
                table: ORIGINAL_SRC_TABLE,
            };
            for _ in self.rules(netns, route)? {
                self.ip_in(
                    netns,
                    "rule del",
                    &ip_args(route, &["rule", "del", "pref", &route.table.to_string()]),
                )?;
            }
            if !self.routes(netns, route)?.is_empty() {
                self.ip_in(
                    netns,
                    "route flush",
                    &ip_args(
                        route,
                        &["route", "flush", "table", &route.table.to_string()],
                    ),
                )?;
            }
        }
        Ok(())
    }

    /// Makes `netns` hold `route`: the table's one local default route (`replace`
    /// converges), then the rule, unless exactly it is there already (adding it again
    /// would make a second copy), after removing any other rule at its priority.
    /// Over rtnetlink from a thread in the netns: a pod's ADD pays no `ip` process
    /// for it ([`rtnl`]).
    fn apply_route(&self, netns: &Path, route: PolicyRoute) -> Result<(), CaptureError> {
        const WHAT: &str = "route and rule";
        in_netns(netns, WHAT, || {
            rtnl::Rtnl::open()
                .and_then(|mut nl| nl.apply(route))
                .map_err(|e| match e.raw_os_error() {
                    Some(code) if code == nix::libc::EPERM => {
                        CaptureError::NotPermitted(format!("{WHAT}: {e}"))
                    }
                    _ => CaptureError::Netlink(WHAT, e),
                })
        })
    }

    /// Whether `netns` holds exactly `route`'s rule and route.
    fn check_route(&self, netns: &Path, route: PolicyRoute) -> Result<(), CaptureError> {
        let drifted = |detail: String| CaptureError::RouteDrifted {
            netns: netns.into(),
            detail,
        };
        let family = if route.ipv6 { "IPv6" } else { "IPv4" };
        let rules = self.rules(netns, route)?;
        if rules.len() != 1 || !rule_matches(&rules[0], route) {
            return Err(drifted(format!(
                "{family} rules at priority {} are {}, expected one: fwmark {:#x} lookup {}",
                route.table,
                serde_json::Value::Array(rules),
                route.mark,
                route.table
            )));
        }
        let routes = self.routes(netns, route)?;
        let local_default = |r: &serde_json::Value| {
            r["type"] == "local" && r["dst"] == "default" && r["dev"] == "lo"
        };
        if routes.len() != 1 || !local_default(&routes[0]) {
            return Err(drifted(format!(
                "{family} table {} holds {}, expected one route: local default dev lo",
                route.table,
                serde_json::Value::Array(routes)
            )));
        }
        Ok(())
    }

    /// `ip -j rule show pref <table>`: the rules at the route's priority.
    fn rules(
        &self,
        netns: &Path,
        route: PolicyRoute,
    ) -> Result<Vec<serde_json::Value>, CaptureError> {
        let table = route.table.to_string();
        let text = self.ip_in(
            netns,
            "rule show",
            &ip_args(route, &["-j", "rule", "show", "pref", &table]),
        )?;
        parse_ip_json(&text)
    }

    /// `ip -j route show table <table>`: the routes of the route's table (none when
    /// the kernel has no such table yet).
    fn routes(
        &self,
        netns: &Path,
        route: PolicyRoute,
    ) -> Result<Vec<serde_json::Value>, CaptureError> {
        let table = route.table.to_string();
        match self.ip_in(
            netns,
            "route show",
            &ip_args(route, &["-j", "route", "show", "table", &table]),
        ) {
            Ok(text) => parse_ip_json(&text),
            Err(CaptureError::Ip { stderr, .. }) if stderr.contains("table does not exist") => {
                Ok(Vec::new())
            }
            Err(e) => Err(e),
        }
    }
}

/// `ip -j` output: an array of objects (an empty output is none).
fn parse_ip_json(text: &str) -> Result<Vec<serde_json::Value>, CaptureError> {
    if text.trim().is_empty() {
        return Ok(Vec::new());
    }
    match serde_json::from_str(text) {
        Ok(serde_json::Value::Array(items)) if items.len() <= capture::MAX_LISTED_RULES => {
            Ok(items)
        }
        _ => Err(ParseError::Malformed(format!(
            "ip -j: not a JSON array: {}",
            text.chars().take(200).collect::<String>()
        ))
        .into()),
    }
}

/// `ip` arguments for `route`'s family: `-6` first for IPv6.
fn ip_args<'a>(route: PolicyRoute, args: &[&'a str]) -> Vec<&'a str> {
    let mut out = Vec::with_capacity(args.len() + 1);
    if route.ipv6 {
        out.push("-6");
    }
    out.extend_from_slice(args);
    out
}

/// Whether an `ip -j rule` entry is `route`'s rule: its mark, its table.
fn rule_matches(rule: &serde_json::Value, route: PolicyRoute) -> bool {
    let mark = rule["fwmark"]
        .as_str()
        .and_then(|m| u32::from_str_radix(m.trim_start_matches("0x"), 16).ok());
    mark == Some(route.mark)
        && rule["table"].as_str() == Some(route.table.to_string().as_str())
        && rule.get("fwmask").is_none()
}

/// What a child run inside a netns did.
enum Ran {
    /// It succeeded: its stdout.
    Out(String),
    /// It failed.
    Failed {
        /// Its exit status.
        status: String,
        /// Its stderr.
        stderr: String,
    },
}

fn run(
    mut cmd: Command,
    what: &'static str,
    stdin: Option<&[u8]>,
) -> Result<std::process::Output, CaptureError> {
    cmd.stdin(if stdin.is_some() {
        Stdio::piped()
    } else {
        Stdio::null()
    })
    .stdout(Stdio::piped())
    .stderr(Stdio::piped());
    let mut child = cmd.spawn().map_err(|e| CaptureError::Io(what, e))?;
    if let (Some(input), Some(mut pipe)) = (stdin, child.stdin.take()) {
        // nft reads the whole batch before it writes anything, so writing first and
        // reading after cannot deadlock on full pipes.
        pipe.write_all(input)
            .map_err(|e| CaptureError::Io(what, e))?;
    }
    let out = child
        .wait_with_output()
        .map_err(|e| CaptureError::Io(what, e))?;
    if out.stdout.len() > capture::MAX_LISTED_BYTES {
        return Err(ParseError::TooLarge(out.stdout.len()).into());
    }
    Ok(out)
}

/// Runs `f` on a thread of our own that enters `netns` (`setns`) and exits
/// afterwards: a child it starts, or a netlink socket it opens, lives in the pod's
/// netns, and no thread of the caller's (a runtime's worker) is ever left there. A
/// netns that does not exist or cannot be entered is an error here.
fn in_netns<T: Send>(
    netns: &Path,
    what: &'static str,
    f: impl FnOnce() -> Result<T, CaptureError> + Send,
) -> Result<T, CaptureError> {
    if !netns.exists() {
        return Err(CaptureError::Netns {
            path: netns.into(),
            detail: "does not exist".into(),
        });
    }
    // A scoped thread: its netns dies with it.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                enter_netns(netns)?;
                f()
            })
            .join()
            .unwrap_or_else(|_| {
                Err(CaptureError::Io(
                    what,
                    std::io::Error::other("the netns thread panicked"),
                ))
            })
    })
}

/// Moves the calling thread into the network namespace at `netns` (only for a thread
/// that exits afterwards).
fn enter_netns(netns: &Path) -> Result<(), CaptureError> {
    let file = std::fs::File::open(netns).map_err(|e| CaptureError::Netns {
        path: netns.into(),
        detail: format!("cannot open: {e}"),
    })?;
    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| match e {
        nix::errno::Errno::EPERM => {
            CaptureError::NotPermitted(format!("entering {}: {e}", netns.display()))
        }
        _ => CaptureError::Netns {
            path: netns.into(),
            detail: format!("cannot enter (not a network namespace?): {e}"),
        },
    })
}

/// [`Nft::apply`] with the binaries on `PATH`.
pub fn apply(netns: &Path, spec: &CaptureSpec) -> Result<(), CaptureError> {
    Nft::new().apply(netns, spec)
}

/// [`Nft::check`] with the binaries on `PATH`.
pub fn check(netns: &Path, spec: &CaptureSpec) -> Result<(), CaptureError> {
    Nft::new().check(netns, spec)
}

/// [`Nft::remove`] with the binaries on `PATH`.
pub fn remove(netns: &Path) -> Result<(), CaptureError> {
    Nft::new().remove(netns)
}

/// [`Nft::probe`] with the binaries on `PATH`.
pub fn probe() -> Result<(), CaptureError> {
    Nft::new().probe()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stderr_is_mapped_to_its_cause() {
        let e = classify(
            "apply",
            "exit status: 1".into(),
            "netlink: Error: cache initialization failed: Protocol not supported\n",
        );
        assert!(matches!(e, CaptureError::KernelUnsupported(_)), "{e}");
        assert!(e.to_string().contains("does not support nf_tables"), "{e}");
        let e = classify(
            "apply",
            "exit status: 1".into(),
            "Error: Could not process rule: Operation not permitted",
        );
        assert!(matches!(e, CaptureError::NotPermitted(_)), "{e}");
        let e = classify("apply", "exit status: 1".into(), "Error: syntax error");
        assert!(matches!(e, CaptureError::Nft { .. }), "{e}");
    }

    #[test]
    fn a_missing_nft_binary_is_named() {
        let e = Nft::with_nft("/nonexistent/nft").probe().unwrap_err();
        assert!(matches!(e, CaptureError::NftMissing(_)), "{e}");
        assert!(
            e.to_string().contains("/nonexistent/nft") && e.to_string().contains("nftables"),
            "{e}"
        );
        let e = Nft::with_nft("flock-no-such-nft")
            .apply(Path::new("/nonexistent"), &spec())
            .unwrap_err();
        assert!(matches!(e, CaptureError::NftMissing(_)), "{e}");
    }

    fn spec() -> CaptureSpec {
        CaptureSpec {
            outbound_port: 15001,
            inbound: vec![],
            envoy_mark: 0x539,
            exclude_outbound_ports: vec![],
            exclude_outbound_cidrs: vec![],
            exclude_inbound_ports: vec![],
            probe_sources: vec![],
            mode: Mode::Strict,
            original_src: None,
        }
    }
}
