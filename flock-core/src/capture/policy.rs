//! A pod's capture settings: the node's flags and the pod's annotations resolved into
//! what the agent stores with the pod ([`PodCapture`]) and installs in its netns
//! ([`PodCapture::spec`]).
//!
//! * The node ([`NodeCapture`], the agent's `--capture*` flags) sets the mode
//!   ([`Setting`]: off, strict or permissive), the probe sources and node-wide
//!   exclusions.
//! * A pod's annotations ([`parse_annotations`]: [`CAPTURE_ANNOTATION`] and the
//!   `flock.io/capture-exclude-*` ones) override the mode and **add** to the node's
//!   exclusions, like Istio's `traffic.sidecar.istio.io/excludeOutboundPorts`.
//! * [`resolve`] combines them; the probe sources, when the node names none, are the
//!   link-local addresses the node gives kubelet's sockets alone ([`super::probe`]),
//!   never the node's address on the pod network.
//!
//! A node whose mode is off has no capture machinery (no nft probe at start, no
//! `CAP_NET_ADMIN`): a pod asking for capture there is refused with a message that
//! says so, rather than meshed without the capture its owner asked for.
//!
//! Every parser bounds its input ([`MAX_ANNOTATION_LEN`], [`MAX_SPEC_ENTRIES`]) and
//! names the annotation or flag at fault.
//!
//! # Example
//!
//! ```
//! use std::collections::BTreeMap;
//! use flock_core::capture::policy::{parse_annotations, resolve, NodeCapture, Setting};
//! use flock_core::capture::Mode;
//! use flock_core::pod::parse_ports;
//!
//! let node = NodeCapture { setting: Setting::Strict, ..NodeCapture::default() };
//! let pod = parse_annotations(&BTreeMap::from([
//!     ("flock.io/capture".to_string(), "permissive".to_string()),
//!     ("flock.io/capture-exclude-outbound-ports".to_string(), "5432, 6379".to_string()),
//! ]))
//! .unwrap();
//! let ports = parse_ports("8080").unwrap();
//! let capture = resolve(&node, &pod, &ports).unwrap().unwrap();
//! assert_eq!(capture.mode, Mode::Permissive);
//! assert_eq!(capture.exclude_outbound_ports, vec![5432, 6379]);
//! // No --capture-probe-source: only the link-local probe source kubelet is given.
//! assert_eq!(capture.probe_sources, vec![
//!     "169.254.7.127".parse().unwrap(),
//!     "fd16:9254:7127:1337:ffff:ffff:ffff:ffff".parse().unwrap(),
//! ]);
//! assert_eq!(capture.spec("10.88.0.5".parse().ok(), &ports).inbound, vec![(8080, 15006)]);
//! ```

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use super::{CaptureSpec, Cidr, MAX_SPEC_ENTRIES, Mode, OriginalSrc};
use crate::pod::{OUTBOUND_PORT, PodPort};

/// The annotation choosing a pod's capture: `off`, `strict` or `permissive`
/// (overrides the node's `--capture`).
pub const CAPTURE_ANNOTATION: &str = "flock.io/capture";
/// The Namespace label choosing the capture of a namespace's pods in kube mode: `off`,
/// `strict` or `permissive`, in place of the node's `--capture`. Namespaces are
/// cluster-scoped objects, labelled by the cluster's admins, not by whoever may create
/// pods in them: so unlike the pod's annotation it may also lower an enforcing node's
/// mode (a namespace of workloads the admin keeps out of capture).
pub const NAMESPACE_LABEL: &str = "flock.io/capture";
/// Destination ports (comma list) the pod's apps reach directly, added to the node's
/// `--capture-exclude-outbound-ports`.
pub const EXCLUDE_OUTBOUND_PORTS_ANNOTATION: &str = "flock.io/capture-exclude-outbound-ports";
/// Destination prefixes (comma list of CIDRs or addresses) the pod's apps reach
/// directly, added to the node's `--capture-exclude-outbound-cidrs`.
pub const EXCLUDE_OUTBOUND_CIDRS_ANNOTATION: &str = "flock.io/capture-exclude-outbound-cidrs";
/// App ports (comma list) whose inbound connections are not captured, added to the
/// node's `--capture-exclude-inbound-ports`.
pub const EXCLUDE_INBOUND_PORTS_ANNOTATION: &str = "flock.io/capture-exclude-inbound-ports";

/// The capture annotations, in the order [`parse_annotations`] checks them.
pub const ANNOTATIONS: [&str; 4] = [
    CAPTURE_ANNOTATION,
    EXCLUDE_OUTBOUND_PORTS_ANNOTATION,
    EXCLUDE_OUTBOUND_CIDRS_ANNOTATION,
    EXCLUDE_INBOUND_PORTS_ANNOTATION,
];

/// Longest capture annotation value read (256 IPv6 prefixes fit).
pub const MAX_ANNOTATION_LEN: usize = 16 * 1024;

/// Whether (and how) a pod's traffic is captured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Setting {
    /// No capture: apps use Envoy's outbound listener explicitly (the default).
    #[default]
    Off,
    /// Captured, default deny ([`Mode::Strict`]): TCP from outside reaches only the
    /// inbound listeners, which take mTLS only (and the probe sources and excluded
    /// ports).
    Strict,
    /// Captured; plaintext callers still reach the app ([`Mode::Permissive`]).
    Permissive,
}

impl Setting {
    /// How much of a pod's traffic goes through Envoy: off < permissive < strict.
    fn strength(self) -> u8 {
        match self {
            Setting::Off => 0,
            Setting::Permissive => 1,
            Setting::Strict => 2,
        }
    }

    /// The rules' mode, `None` for [`Setting::Off`].
    pub fn mode(self) -> Option<Mode> {
        match self {
            Setting::Off => None,
            Setting::Strict => Some(Mode::Strict),
            Setting::Permissive => Some(Mode::Permissive),
        }
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Setting::Off => "off",
            Setting::Strict => "strict",
            Setting::Permissive => "permissive",
        })
    }
}

impl FromStr for Setting {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "off" => Ok(Setting::Off),
            "strict" => Ok(Setting::Strict),
            "permissive" => Ok(Setting::Permissive),
            other => Err(format!(
                "{:?} is not a capture mode (off, strict or permissive)",
                bounded(other)
            )),
        }
    }
}

/// The node's capture settings (the agent's flags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeCapture {
    /// `--capture`: the mode of pods that do not choose one.
    pub setting: Setting,
    /// The `SO_MARK` of Envoy's sockets in captured pods (not 0).
    pub mark: u32,
    /// `--capture-probe-source`: sources whose connections reach apps directly. Empty:
    /// [`default_probe_sources`], the link-local probe source the node gives
    /// kubelet's sockets only.
    pub probe_sources: Vec<Cidr>,
    /// `--capture-probe-cgroup`: the cgroups whose sockets (kubelet's) the node gives
    /// the probe source on their way to captured pods ([`super::probe`]). Empty: no
    /// socket is, and a strict pod's app ports refuse kubelet's probes.
    pub probe_cgroups: Vec<super::probe::CgroupMatch>,
    /// `--capture-exclude-outbound-ports`.
    pub exclude_outbound_ports: Vec<u16>,
    /// `--capture-exclude-outbound-cidrs`.
    pub exclude_outbound_cidrs: Vec<Cidr>,
    /// `--capture-exclude-inbound-ports`.
    pub exclude_inbound_ports: Vec<u16>,
    /// `--capture-allow-proxyless-ports`: the app ports a pod may mark proxyless
    /// (`grpc-xds`) on an enforcing node. Only those pods' ports are left to the app;
    /// other pods' same port stays captured.
    pub allow_proxyless_ports: Vec<u16>,
    /// `--capture-enforce`: a pod's annotations may raise the node's mode (permissive
    /// to strict) but never lower it, and may not add exclusions ([`resolve`] refuses
    /// the pod). Without it the annotations are the pod owner's to set, and anyone who
    /// can create a pod could opt it out of the mesh's default deny.
    pub enforce: bool,
}

/// The `SO_MARK` Envoy's sockets in a captured pod carry by default (the same value as
/// the xDS translation's default).
pub const DEFAULT_MARK: u32 = 0x539;

impl Default for NodeCapture {
    /// Capture off, the default mark, no probe sources or exclusions.
    fn default() -> Self {
        NodeCapture {
            setting: Setting::Off,
            mark: DEFAULT_MARK,
            probe_sources: Vec::new(),
            probe_cgroups: Vec::new(),
            exclude_outbound_ports: Vec::new(),
            exclude_outbound_cidrs: Vec::new(),
            exclude_inbound_ports: Vec::new(),
            allow_proxyless_ports: Vec::new(),
            enforce: false,
        }
    }
}

impl NodeCapture {
    /// Whether the node's settings can give rules: a nonzero mark and lists within
    /// [`MAX_SPEC_ENTRIES`] (the flags' own check, at start).
    pub fn validate(&self) -> Result<(), String> {
        if self.enforce && self.setting == Setting::Off {
            return Err(
                "--capture-enforce needs --capture strict or permissive (there is no capture \
                 to enforce with --capture off)"
                    .into(),
            );
        }
        if self.mark == 0 {
            return Err("the capture mark must not be 0 (unmarked packets carry mark 0)".into());
        }
        for (flag, len) in [
            ("--capture-probe-source", self.probe_sources.len()),
            (
                "--capture-exclude-outbound-ports",
                self.exclude_outbound_ports.len(),
            ),
            (
                "--capture-exclude-outbound-cidrs",
                self.exclude_outbound_cidrs.len(),
            ),
            (
                "--capture-exclude-inbound-ports",
                self.exclude_inbound_ports.len(),
            ),
            (
                "--capture-allow-proxyless-ports",
                self.allow_proxyless_ports.len(),
            ),
        ] {
            if len > MAX_SPEC_ENTRIES {
                return Err(format!(
                    "{flag}: {len} entries, more than {MAX_SPEC_ENTRIES}"
                ));
            }
        }
        if self
            .exclude_outbound_ports
            .iter()
            .chain(&self.exclude_inbound_ports)
            .chain(&self.allow_proxyless_ports)
            .any(|p| *p == 0)
        {
            return Err("capture exclusions: port 0 is not a port (1-65535)".into());
        }
        Ok(())
    }
}

/// What a pod's annotations say about its capture.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodOverrides {
    /// [`NAMESPACE_LABEL`] of the pod's Namespace, if present (kube mode): the admin's
    /// mode for the namespace, which replaces the node's as the pod's default and, on
    /// an enforcing node, as its floor.
    pub namespace: Option<Setting>,
    /// [`CAPTURE_ANNOTATION`], if present.
    pub setting: Option<Setting>,
    /// [`EXCLUDE_OUTBOUND_PORTS_ANNOTATION`].
    pub exclude_outbound_ports: Vec<u16>,
    /// [`EXCLUDE_OUTBOUND_CIDRS_ANNOTATION`].
    pub exclude_outbound_cidrs: Vec<Cidr>,
    /// [`EXCLUDE_INBOUND_PORTS_ANNOTATION`].
    pub exclude_inbound_ports: Vec<u16>,
}

/// Why a capture annotation (or flag value) was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{annotation}: {message}")]
pub struct CaptureRefused {
    /// The annotation at fault (or `flock.io/capture` when the node cannot capture).
    pub annotation: &'static str,
    /// What is wrong, quoting (a bounded prefix of) the value.
    pub message: String,
}

/// Reads the capture annotations of a pod (others are ignored); the first bad one is
/// the error.
pub fn parse_annotations(
    annotations: &BTreeMap<String, String>,
) -> Result<PodOverrides, CaptureRefused> {
    let get = |name: &'static str| -> Result<Option<&str>, CaptureRefused> {
        match annotations.get(name) {
            None => Ok(None),
            Some(v) if v.len() > MAX_ANNOTATION_LEN => Err(CaptureRefused {
                annotation: name,
                message: format!("{} bytes, more than {MAX_ANNOTATION_LEN}", v.len()),
            }),
            Some(v) => Ok(Some(v.as_str())),
        }
    };
    let refused = |annotation: &'static str| {
        move |message: String| CaptureRefused {
            annotation,
            message,
        }
    };
    let mut out = PodOverrides::default();
    if let Some(v) = get(CAPTURE_ANNOTATION)? {
        out.setting = Some(v.parse().map_err(refused(CAPTURE_ANNOTATION))?);
    }
    if let Some(v) = get(EXCLUDE_OUTBOUND_PORTS_ANNOTATION)? {
        out.exclude_outbound_ports =
            parse_port_list(v).map_err(refused(EXCLUDE_OUTBOUND_PORTS_ANNOTATION))?;
    }
    if let Some(v) = get(EXCLUDE_OUTBOUND_CIDRS_ANNOTATION)? {
        out.exclude_outbound_cidrs =
            parse_cidr_list(v).map_err(refused(EXCLUDE_OUTBOUND_CIDRS_ANNOTATION))?;
    }
    if let Some(v) = get(EXCLUDE_INBOUND_PORTS_ANNOTATION)? {
        out.exclude_inbound_ports =
            parse_port_list(v).map_err(refused(EXCLUDE_INBOUND_PORTS_ANNOTATION))?;
    }
    Ok(out)
}

/// A comma list of ports (`5432, 6379`; empty items and surrounding spaces ignored),
/// each 1-65535, at most [`MAX_SPEC_ENTRIES`].
pub fn parse_port_list(list: &str) -> Result<Vec<u16>, String> {
    let items = items(list)?;
    items
        .into_iter()
        .map(|item| {
            item.parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| format!("{:?} is not a port (1-65535)", bounded(item)))
        })
        .collect()
}

/// A comma list of prefixes (`10.96.0.0/12, fd00::/8`) or addresses, at most
/// [`MAX_SPEC_ENTRIES`].
pub fn parse_cidr_list(list: &str) -> Result<Vec<Cidr>, String> {
    items(list)?
        .into_iter()
        .map(|item| {
            item.parse::<Cidr>()
                .map_err(|_| format!("{:?} is not an IP address or prefix", bounded(item)))
        })
        .collect()
}

fn items(list: &str) -> Result<Vec<&str>, String> {
    let items: Vec<&str> = list
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items.len() > MAX_SPEC_ENTRIES {
        return Err(format!(
            "{} entries, more than {MAX_SPEC_ENTRIES}",
            items.len()
        ));
    }
    Ok(items)
}

/// A captured pod's settings as the agent stores them with the pod: what start-up
/// repair and CNI CHECK verify the netns against, and what the xDS translation
/// needs (mode, mark). Lists are sorted and deduplicated.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodCapture {
    /// Strict or permissive.
    pub mode: Mode,
    /// The `SO_MARK` of Envoy's sockets in the pod's netns.
    pub mark: u32,
    /// Sources whose connections reach the app directly (kubelet's probes).
    pub probe_sources: Vec<Cidr>,
    /// Destination ports the apps reach directly.
    pub exclude_outbound_ports: Vec<u16>,
    /// Destination prefixes the apps reach directly.
    pub exclude_outbound_cidrs: Vec<Cidr>,
    /// App ports not captured inbound.
    pub exclude_inbound_ports: Vec<u16>,
}

impl PodCapture {
    /// The rules for a pod at `pod_ip` with `ports`: outbound TCP to Envoy's
    /// [`OUTBOUND_PORT`], each app port to its inbound listener, and the route that
    /// brings the app's replies to its callers' own addresses back to Envoy (the app
    /// sees each caller's address: [`OriginalSrc`]; a pod without an address has no
    /// inbound listener, so no route).
    pub fn spec(&self, pod_ip: Option<IpAddr>, ports: &[PodPort]) -> CaptureSpec {
        CaptureSpec {
            outbound_port: OUTBOUND_PORT,
            inbound: ports
                .iter()
                // The mutant redirects a proxyless server's port to Envoy, which has no
                // listener for it.
                .filter(|p| {
                    !p.proxyless || crate::reintroduced!("capture-redirects-proxyless-port")
                })
                .map(|p| (p.app_port, p.listen_port))
                .collect(),
            envoy_mark: self.mark,
            exclude_outbound_ports: self.exclude_outbound_ports.clone(),
            exclude_outbound_cidrs: self.exclude_outbound_cidrs.clone(),
            // A proxyless port is the app's own mTLS server: its callers reach it
            // directly (it enforces the port's policy itself), as for an excluded port.
            exclude_inbound_ports: {
                let mut ports: Vec<u16> = self
                    .exclude_inbound_ports
                    .iter()
                    .copied()
                    .chain(
                        ports
                            .iter()
                            .filter(|p| {
                                p.proxyless
                                    && !crate::reintroduced!("capture-redirects-proxyless-port")
                            })
                            .map(|p| p.app_port),
                    )
                    .collect();
                ports.sort_unstable();
                ports.dedup();
                ports
            },
            probe_sources: self.probe_sources.clone(),
            mode: self.mode,
            original_src: pod_ip.map(|ip| OriginalSrc { ipv6: ip.is_ipv6() }),
        }
    }

    /// Whether the settings give rules for a pod with `ports` (a stored record is
    /// checked with this when it is loaded).
    pub fn check(&self, ports: &[PodPort]) -> Result<(), String> {
        self.spec(Some(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)), ports)
            .ruleset()
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

/// On a node with `--capture-enforce`: refuses annotations that would let traffic
/// around Envoy — a weaker mode than the node's, or any exclusion.
fn enforced(floor: Setting, pod: &PodOverrides) -> Result<(), CaptureRefused> {
    // The bug this check closes: a pod's own annotation lowered a strict node.
    if crate::reintroduced!("capture-annotation-lowers-enforced") {
        return Ok(());
    }
    if let Some(setting) = pod.setting.filter(|s| s.strength() < floor.strength()) {
        let whose = if pod.namespace.is_some() {
            "its namespace's"
        } else {
            "this node's"
        };
        return Err(CaptureRefused {
            annotation: CAPTURE_ANNOTATION,
            message: format!(
                "{setting} would lower {whose} {floor} capture, which the node enforces \
                 (--capture-enforce): remove the annotation; only the cluster's admins \
                 choose less capture (the node's --capture, the namespace's \
                 {NAMESPACE_LABEL} label)"
            ),
        });
    }
    for (annotation, present) in [
        (
            EXCLUDE_OUTBOUND_PORTS_ANNOTATION,
            !pod.exclude_outbound_ports.is_empty(),
        ),
        (
            EXCLUDE_OUTBOUND_CIDRS_ANNOTATION,
            !pod.exclude_outbound_cidrs.is_empty(),
        ),
        (
            EXCLUDE_INBOUND_PORTS_ANNOTATION,
            !pod.exclude_inbound_ports.is_empty(),
        ),
    ] {
        if present {
            return Err(CaptureRefused {
                annotation,
                message: "exclusions would let traffic around Envoy on a node that enforces \
                          capture (--capture-enforce): remove the annotation; the node's \
                          operator sets exclusions with the --capture-exclude-* flags"
                    .into(),
            });
        }
    }
    Ok(())
}

/// The probe sources of a node that names none: the link-local addresses
/// ([`super::probe::PROBE_SOURCE_V4`], [`super::probe::PROBE_SOURCE_V6`]) the node
/// gives kubelet's probe sockets, and nothing else.
pub fn default_probe_sources() -> Vec<Cidr> {
    vec![
        Cidr::host(IpAddr::V4(super::probe::PROBE_SOURCE_V4)),
        Cidr::host(IpAddr::V6(super::probe::PROBE_SOURCE_V6)),
    ]
}

/// A pod's capture: the node's settings, overridden and extended by the pod's
/// annotations, with [`default_probe_sources`] when the node names none.
/// `Ok(None)`: not captured.
///
/// The namespace's [`NAMESPACE_LABEL`] (kube mode), when present, replaces the node's
/// mode as the pod's default and as an enforcing node's floor.
///
/// Refused: the pod (or its namespace) asks for capture on a node whose capture is off;
/// a combined exclusion list over [`MAX_SPEC_ENTRIES`]; settings that give no rules for
/// `ports`; on a node that enforces capture, a mode below the floor or an exclusion in
/// the pod's annotations.
pub fn resolve(
    node: &NodeCapture,
    pod: &PodOverrides,
    ports: &[PodPort],
) -> Result<Option<PodCapture>, CaptureRefused> {
    // The namespace's label (the admin's) stands in for the node's mode, also as the
    // floor an enforcing node holds the pod's own annotation to.
    let floor = pod.namespace.unwrap_or(node.setting);
    if node.enforce {
        enforced(floor, pod)?;
    }
    let setting = pod.setting.unwrap_or(floor);
    let Some(mode) = setting.mode() else {
        return Ok(None);
    };
    // A proxyless port is reached around Envoy (the app's own mTLS and RBAC): on a
    // node that enforces capture only its operator lets a port around Envoy, or a pod
    // could name a port proxyless and serve it in plaintext. Its own list, not the
    // inbound exclusions: those open the port on every pod of the node.
    if node.enforce
        && let Some(p) = ports
            .iter()
            .find(|p| p.proxyless && !node.allow_proxyless_ports.contains(&p.app_port))
    {
        return Err(CaptureRefused {
            annotation: crate::pod::PORTS_ANNOTATION,
            message: format!(
                "port {} is a proxyless gRPC server's (grpc-xds), which callers reach around \
                 Envoy; on a node that enforces capture (--capture-enforce) only the node's \
                 operator lets a port around Envoy: list it in --capture-allow-proxyless-ports, \
                 or serve the port through Envoy (grpc)",
                p.app_port
            ),
        });
    }
    if node.setting == Setting::Off {
        return Err(CaptureRefused {
            annotation: CAPTURE_ANNOTATION,
            message: format!(
                "the pod asks for {setting} capture, but capture is off on this node (start \
                 the agent with --capture strict or permissive to capture pods)"
            ),
        });
    }
    // Nothing but the probe source is exempt by default: the node's address on the
    // pod network (the gateway) is also where every hostNetwork process and every
    // connection kube-proxy SNATs to the node comes from. The node gives kubelet's
    // sockets alone the probe source (`super::probe`).
    let probe_sources = if node.probe_sources.is_empty() {
        default_probe_sources()
    } else {
        sorted(node.probe_sources.iter().copied())
    };
    let capture = PodCapture {
        mode,
        mark: node.mark,
        probe_sources,
        exclude_outbound_ports: limit(
            EXCLUDE_OUTBOUND_PORTS_ANNOTATION,
            sorted(
                node.exclude_outbound_ports
                    .iter()
                    .chain(&pod.exclude_outbound_ports)
                    .copied(),
            ),
        )?,
        exclude_outbound_cidrs: limit(
            EXCLUDE_OUTBOUND_CIDRS_ANNOTATION,
            sorted(
                node.exclude_outbound_cidrs
                    .iter()
                    .chain(&pod.exclude_outbound_cidrs)
                    .copied(),
            ),
        )?,
        exclude_inbound_ports: limit(
            EXCLUDE_INBOUND_PORTS_ANNOTATION,
            sorted(
                node.exclude_inbound_ports
                    .iter()
                    .chain(&pod.exclude_inbound_ports)
                    .copied(),
            ),
        )?,
    };
    capture.check(ports).map_err(|message| CaptureRefused {
        annotation: CAPTURE_ANNOTATION,
        message,
    })?;
    Ok(Some(capture))
}

/// `list`, or an error naming `annotation` when it holds more than
/// [`MAX_SPEC_ENTRIES`] (the node's entries and the pod's together).
fn limit<T>(annotation: &'static str, list: Vec<T>) -> Result<Vec<T>, CaptureRefused> {
    if list.len() > MAX_SPEC_ENTRIES {
        return Err(CaptureRefused {
            annotation,
            message: format!(
                "with the node's list, {} entries, more than {MAX_SPEC_ENTRIES}",
                list.len()
            ),
        });
    }
    Ok(list)
}

fn sorted<T: Ord>(items: impl IntoIterator<Item = T>) -> Vec<T> {
    items
        .into_iter()
        .collect::<BTreeSet<T>>()
        .into_iter()
        .collect()
}

/// At most 64 characters of `s`, for quoting outside input in a message.
fn bounded(s: &str) -> String {
    s.chars().take(64).collect()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::pod::parse_ports;
    use proptest::prelude::*;

    fn node(setting: Setting) -> NodeCapture {
        NodeCapture {
            setting,
            ..NodeCapture::default()
        }
    }

    fn annotations(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn settings_parse_and_print_their_names() {
        for s in [Setting::Off, Setting::Strict, Setting::Permissive] {
            assert_eq!(s.to_string().parse::<Setting>(), Ok(s));
        }
        let e = "enforce".parse::<Setting>().unwrap_err();
        assert!(
            e.contains("\"enforce\"") && e.contains("off, strict or permissive"),
            "{e}"
        );
    }

    #[test]
    fn a_proxyless_port_is_left_to_the_app() {
        let ports = parse_ports("8080,50051/grpc-xds").unwrap();
        let c = resolve(&node(Setting::Strict), &PodOverrides::default(), &ports)
            .unwrap()
            .unwrap();
        let spec = c.spec(None, &ports);
        assert_eq!(spec.inbound, vec![(8080, ports[0].listen_port)]);
        assert!(spec.exclude_inbound_ports.contains(&50051));
        // An enforcing node refuses it unless its operator excluded the port.
        let mut enforcing = node(Setting::Strict);
        enforcing.enforce = true;
        let e = resolve(&enforcing, &PodOverrides::default(), &ports).unwrap_err();
        assert!(
            e.message.contains("50051") && e.message.contains("--capture-allow-proxyless-ports"),
            "{}",
            e.message
        );
        enforcing.allow_proxyless_ports = vec![50051];
        let c = resolve(&enforcing, &PodOverrides::default(), &ports)
            .unwrap()
            .unwrap();
        assert!(c.spec(None, &ports).exclude_inbound_ports.contains(&50051));
        // Another pod's port 50051 that is not proxyless stays captured.
        let plain = parse_ports("50051/grpc").unwrap();
        let c = resolve(&enforcing, &PodOverrides::default(), &plain)
            .unwrap()
            .unwrap();
        let spec = c.spec(None, &plain);
        assert_eq!(spec.inbound, vec![(50051, plain[0].listen_port)]);
        assert!(!spec.exclude_inbound_ports.contains(&50051));
        // Without capture there is nothing to go around.
        let off = PodOverrides {
            namespace: Some(Setting::Off),
            ..PodOverrides::default()
        };
        assert_eq!(resolve(&enforcing, &off, &ports), Ok(None));
    }

    #[test]
    fn without_annotations_the_node_decides() {
        let ports = parse_ports("8080").unwrap();
        let none = PodOverrides::default();
        assert_eq!(resolve(&node(Setting::Off), &none, &ports), Ok(None));
        let c = resolve(&node(Setting::Strict), &none, &ports)
            .unwrap()
            .unwrap();
        assert_eq!(c.mode, Mode::Strict);
        assert_eq!(c.mark, DEFAULT_MARK);
        let c = resolve(&node(Setting::Permissive), &none, &ports)
            .unwrap()
            .unwrap();
        assert_eq!(c.mode, Mode::Permissive);
    }

    #[test]
    fn the_annotation_overrides_the_nodes_mode() {
        let ports = parse_ports("8080").unwrap();
        let off = parse_annotations(&annotations(&[(CAPTURE_ANNOTATION, "off")])).unwrap();
        assert_eq!(resolve(&node(Setting::Strict), &off, &ports), Ok(None));
        let perm =
            parse_annotations(&annotations(&[(CAPTURE_ANNOTATION, " permissive ")])).unwrap();
        let c = resolve(&node(Setting::Strict), &perm, &ports)
            .unwrap()
            .unwrap();
        assert_eq!(c.mode, Mode::Permissive);
    }

    #[test]
    fn the_namespace_label_is_the_admins_default_and_floor() {
        let ports = parse_ports("8080").unwrap();
        let enforcing = NodeCapture {
            enforce: true,
            ..node(Setting::Strict)
        };
        // The admin's label takes a namespace out of an enforcing node's capture.
        let ns_off = PodOverrides {
            namespace: Some(Setting::Off),
            ..PodOverrides::default()
        };
        assert_eq!(resolve(&enforcing, &ns_off, &ports), Ok(None));
        // A pod there may still ask for more.
        let raised = PodOverrides {
            setting: Some(Setting::Strict),
            ..ns_off.clone()
        };
        let c = resolve(&enforcing, &raised, &ports).unwrap().unwrap();
        assert_eq!(c.mode, Mode::Strict);
        // In a permissive namespace, a pod's "off" is below the floor: refused, naming
        // the namespace.
        let lowered = PodOverrides {
            namespace: Some(Setting::Permissive),
            setting: Some(Setting::Off),
            ..PodOverrides::default()
        };
        let e = resolve(&enforcing, &lowered, &ports).unwrap_err();
        assert_eq!(e.annotation, CAPTURE_ANNOTATION);
        assert!(e.message.contains("its namespace's permissive"), "{e}");
        assert!(e.message.contains(NAMESPACE_LABEL), "{e}");
        // The label alone, on a node that does not enforce, is the pod's default.
        let ns_perm = PodOverrides {
            namespace: Some(Setting::Permissive),
            ..PodOverrides::default()
        };
        let c = resolve(&node(Setting::Strict), &ns_perm, &ports)
            .unwrap()
            .unwrap();
        assert_eq!(c.mode, Mode::Permissive);
        // A node without capture cannot give it to a namespace that asks.
        let ns_strict = PodOverrides {
            namespace: Some(Setting::Strict),
            ..PodOverrides::default()
        };
        assert!(resolve(&node(Setting::Off), &ns_strict, &ports).is_err());
    }

    #[test]
    fn a_pod_asking_for_capture_on_a_node_without_it_is_refused() {
        let strict = parse_annotations(&annotations(&[(CAPTURE_ANNOTATION, "strict")])).unwrap();
        let e = resolve(&node(Setting::Off), &strict, &[]).unwrap_err();
        assert_eq!(e.annotation, CAPTURE_ANNOTATION);
        assert!(e.message.contains("capture is off on this node"), "{e}");
        assert!(e.message.contains("--capture"), "{e}");
    }

    #[test]
    fn pod_exclusions_add_to_the_nodes_sorted_and_deduplicated() {
        let mut n = node(Setting::Strict);
        n.exclude_outbound_ports = vec![6379, 5432];
        n.exclude_outbound_cidrs = vec!["10.96.0.0/12".parse().unwrap()];
        n.exclude_inbound_ports = vec![9090];
        let pod = parse_annotations(&annotations(&[
            (EXCLUDE_OUTBOUND_PORTS_ANNOTATION, "5432,3306"),
            (EXCLUDE_OUTBOUND_CIDRS_ANNOTATION, "fd00::/8, 192.168.1.7"),
            (EXCLUDE_INBOUND_PORTS_ANNOTATION, "8081"),
        ]))
        .unwrap();
        let ports = parse_ports("8080,8081").unwrap();
        let c = resolve(&n, &pod, &ports).unwrap().unwrap();
        assert_eq!(c.exclude_outbound_ports, vec![3306, 5432, 6379]);
        assert_eq!(
            c.exclude_outbound_cidrs,
            ["10.96.0.0/12", "192.168.1.7", "fd00::/8"]
                .map(|s| s.parse::<Cidr>().unwrap())
                .to_vec()
        );
        assert_eq!(c.exclude_inbound_ports, vec![8081, 9090]);
        let spec = c.spec("10.88.0.5".parse().ok(), &ports);
        assert_eq!(spec.inbound, vec![(8080, 15006), (8081, 15007)]);
        assert_eq!(spec.outbound_port, OUTBOUND_PORT);
    }

    #[test]
    fn probe_sources_default_to_the_link_local_probe_source_unless_the_node_names_them() {
        let ports = parse_ports("8080").unwrap();
        let none = PodOverrides::default();
        let c = resolve(&node(Setting::Strict), &none, &ports)
            .unwrap()
            .unwrap();
        assert_eq!(
            c.probe_sources,
            vec![
                "169.254.7.127".parse::<Cidr>().unwrap(),
                "fd16:9254:7127:1337:ffff:ffff:ffff:ffff"
                    .parse::<Cidr>()
                    .unwrap()
            ]
        );
        let mut n = node(Setting::Strict);
        n.probe_sources = vec!["192.168.0.0/24".parse().unwrap()];
        let c = resolve(&n, &none, &ports).unwrap().unwrap();
        assert_eq!(c.probe_sources, n.probe_sources);
    }

    #[test]
    fn bad_annotation_values_name_the_annotation_and_the_value() {
        let cases = [
            (CAPTURE_ANNOTATION, "on", "\"on\" is not a capture mode"),
            (
                EXCLUDE_OUTBOUND_PORTS_ANNOTATION,
                "80,http",
                "\"http\" is not a port",
            ),
            (
                EXCLUDE_OUTBOUND_PORTS_ANNOTATION,
                "0",
                "\"0\" is not a port",
            ),
            (
                EXCLUDE_INBOUND_PORTS_ANNOTATION,
                "70000",
                "\"70000\" is not a port",
            ),
            (
                EXCLUDE_OUTBOUND_CIDRS_ANNOTATION,
                "10.0.0.0/33",
                "\"10.0.0.0/33\" is not an IP address or prefix",
            ),
            (
                EXCLUDE_OUTBOUND_CIDRS_ANNOTATION,
                "example.com",
                "\"example.com\" is not an IP address or prefix",
            ),
        ];
        for (annotation, value, expect) in cases {
            let e = parse_annotations(&annotations(&[(annotation, value)])).unwrap_err();
            assert_eq!(e.annotation, annotation);
            assert!(e.message.contains(expect), "{annotation}={value}: {e}");
        }
        let long = "1,".repeat(MAX_SPEC_ENTRIES + 1);
        let e = parse_annotations(&annotations(&[(EXCLUDE_INBOUND_PORTS_ANNOTATION, &long)]))
            .unwrap_err();
        assert!(e.message.contains("more than 256"), "{e}");
        let huge = "1".repeat(MAX_ANNOTATION_LEN + 1);
        let e = parse_annotations(&annotations(&[(EXCLUDE_OUTBOUND_PORTS_ANNOTATION, &huge)]))
            .unwrap_err();
        assert!(e.message.contains("bytes, more than"), "{e}");
        // Other annotations are not read.
        assert_eq!(
            parse_annotations(&annotations(&[("flock.io/captured", "x")])),
            Ok(PodOverrides::default())
        );
    }

    #[test]
    fn combined_lists_over_the_limit_are_refused() {
        let mut n = node(Setting::Strict);
        n.exclude_outbound_ports = (1..=MAX_SPEC_ENTRIES as u16).collect();
        assert_eq!(n.validate(), Ok(()));
        let pod = parse_annotations(&annotations(&[(
            EXCLUDE_OUTBOUND_PORTS_ANNOTATION,
            "60000",
        )]))
        .unwrap();
        let e = resolve(&n, &pod, &[]).unwrap_err();
        assert_eq!(e.annotation, EXCLUDE_OUTBOUND_PORTS_ANNOTATION);
        assert!(e.message.contains("257 entries"), "{e}");
    }

    #[test]
    fn node_settings_are_checked() {
        let mut n = node(Setting::Strict);
        n.mark = 0;
        assert!(n.validate().unwrap_err().contains("mark"));
        let mut n = node(Setting::Strict);
        n.exclude_inbound_ports = vec![0];
        assert!(n.validate().unwrap_err().contains("port 0"));
        let mut n = node(Setting::Strict);
        n.probe_sources = vec![Cidr::host("10.0.0.1".parse().unwrap()); MAX_SPEC_ENTRIES + 1];
        assert!(n.validate().unwrap_err().contains("--capture-probe-source"));
    }

    #[test]
    fn a_stored_capture_round_trips_and_rejects_unknown_fields() {
        let c = resolve(
            &node(Setting::Permissive),
            &PodOverrides::default(),
            &parse_ports("8080").unwrap(),
        )
        .unwrap()
        .unwrap();
        let json = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<PodCapture>(&json).unwrap(), c);
        let mut v: serde_json::Value = serde_json::from_str(&json).unwrap();
        v["surprise"] = serde_json::json!(1);
        assert!(serde_json::from_value::<PodCapture>(v).is_err());
    }

    #[test]
    fn an_enforcing_node_refuses_annotations_that_lower_or_exclude_and_allows_raising() {
        let enforcing = |setting| NodeCapture {
            enforce: true,
            ..node(setting)
        };
        let ports = parse_ports("8080").unwrap();
        let with = |setting| PodOverrides {
            setting: Some(setting),
            ..PodOverrides::default()
        };
        let strict = enforcing(Setting::Strict);
        for lower in [Setting::Off, Setting::Permissive] {
            let e = resolve(&strict, &with(lower), &ports).unwrap_err();
            assert_eq!(e.annotation, CAPTURE_ANNOTATION);
            assert!(
                e.message
                    .starts_with(&format!("{lower} would lower this node's strict capture")),
                "{e}"
            );
        }
        let excluded = PodOverrides {
            exclude_inbound_ports: vec![6060],
            ..PodOverrides::default()
        };
        let e = resolve(&strict, &excluded, &ports).unwrap_err();
        assert_eq!(e.annotation, EXCLUDE_INBOUND_PORTS_ANNOTATION);
        assert!(e.message.contains("--capture-enforce"), "{e}");
        // Raising and restating are the pod's to choose.
        let permissive = enforcing(Setting::Permissive);
        let raised = resolve(&permissive, &with(Setting::Strict), &ports).unwrap();
        assert_eq!(raised.unwrap().mode, Mode::Strict);
        assert!(resolve(&strict, &with(Setting::Strict), &ports).is_ok());
        // Without enforcement the annotation is the pod's (as before).
        assert_eq!(
            resolve(&node(Setting::Strict), &with(Setting::Off), &ports),
            Ok(None)
        );
        // Enforcing nothing is a flag error.
        let e = enforcing(Setting::Off).validate().unwrap_err();
        assert!(
            e.starts_with("--capture-enforce needs --capture strict"),
            "{e}"
        );
    }

    proptest! {
        /// Whatever the node's and the pod's lists, a resolved capture holds their
        /// union (each entry once, sorted) and gives rules for the pod's ports, or is
        /// refused for a list over the limit — never a capture whose rules would fail
        /// at apply time.
        #[test]
        fn resolved_captures_hold_the_union_and_always_give_rules(
            node_ports in proptest::collection::vec(1u16.., 0..40),
            pod_ports in proptest::collection::vec(1u16.., 0..40),
            inbound in proptest::collection::vec(1u16.., 0..40),
            app in proptest::collection::btree_set(1u16..15000, 0..8),
            strict in any::<bool>(),
        ) {
            let mut n = node(if strict { Setting::Strict } else { Setting::Permissive });
            n.exclude_outbound_ports = node_ports.clone();
            n.exclude_inbound_ports = inbound.clone();
            let pod = PodOverrides { exclude_outbound_ports: pod_ports.clone(), ..PodOverrides::default() };
            let spec = app.iter().map(u16::to_string).collect::<Vec<_>>().join(",");
            let ports = parse_ports(&spec).unwrap();
            let c = resolve(&n, &pod, &ports).unwrap().unwrap();
            let union: BTreeSet<u16> = node_ports.iter().chain(&pod_ports).copied().collect();
            prop_assert_eq!(&c.exclude_outbound_ports, &union.into_iter().collect::<Vec<_>>());
            prop_assert!(c.spec("10.88.0.5".parse().ok(), &ports).ruleset().is_ok());
        }

        /// On a node that enforces capture, whatever a pod's annotations say, the pod
        /// is captured at least as strongly as its namespace's label (the admin's) or,
        /// without one, the node says, and with no exclusion the node did not set — or
        /// it is refused.
        #[test]
        fn an_enforcing_node_is_never_lowered_by_a_pod(
            node_strict in any::<bool>(),
            namespace in proptest::option::of(prop_oneof![
                Just(Setting::Off), Just(Setting::Permissive), Just(Setting::Strict)
            ]),
            pod_setting in proptest::option::of(prop_oneof![
                Just(Setting::Off), Just(Setting::Permissive), Just(Setting::Strict)
            ]),
            out_ports in proptest::collection::vec(1u16.., 0..3),
            in_ports in proptest::collection::vec(1u16.., 0..3),
        ) {
            let setting = if node_strict { Setting::Strict } else { Setting::Permissive };
            let n = NodeCapture { enforce: true, ..node(setting) };
            let pod = PodOverrides {
                namespace,
                setting: pod_setting,
                exclude_outbound_ports: out_ports,
                exclude_inbound_ports: in_ports,
                ..PodOverrides::default()
            };
            let ports = parse_ports("8080").unwrap();
            let floor = namespace.unwrap_or(setting);
            if let Ok(c) = resolve(&n, &pod, &ports) {
                let got = c.as_ref().map_or(Setting::Off, |c| match c.mode {
                    Mode::Strict => Setting::Strict,
                    Mode::Permissive => Setting::Permissive,
                });
                prop_assert!(got.strength() >= floor.strength(), "{:?} below {:?}", got, floor);
                if let Some(c) = c {
                    prop_assert_eq!(c.exclude_outbound_ports, n.exclude_outbound_ports.clone());
                    prop_assert_eq!(c.exclude_inbound_ports, n.exclude_inbound_ports.clone());
                }
            }
        }
    }
}
