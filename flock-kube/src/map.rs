//! Kubernetes API objects → the facts the mesh runs on (pure: no I/O, no clock).
//!
//! * [`pod_facts`]: a Pod (and its namespace's labels) → whether it is meshed, its
//!   identity (service account), its application ports and the names of those ports.
//! * [`memberships`]: the Services of its namespace that select the pod, each with the
//!   Service ports that resolve to one of the pod's meshed ports.
//! * [`service_info`] and [`slice_endpoints`]: a Service and its EndpointSlices → the
//!   remote endpoints of `--registry kubernetes`, with health, locality and the
//!   identity callers must verify.
//!
//! # Decisions
//!
//! **Opt-in.** A pod is meshed when its namespace has label [`MESH_LABEL`]`=enabled`
//! or the pod itself has it; a pod label [`MESH_LABEL`]`=disabled` opts out (it wins
//! over the namespace). Other values of the label count as absent. Pods with
//! `hostNetwork: true` are never meshed: they share the node's network namespace,
//! where an inbound listener or a traffic redirect would catch the node's own
//! traffic. A terminating pod (`deletionTimestamp` set) or a pod bound to another
//! node is the caller's refusal ([`PodFacts::refusal`]): the facts only report it.
//!
//! **Identity** is `spec.serviceAccountName` (the deprecated `spec.serviceAccount` if
//! that is absent; both empty → `default`, the account the API server assigns).
//!
//! **Ports** are the TCP ports of the pod's containers and of its sidecar init
//! containers (`initContainers` with `restartPolicy: Always`, which keep running next
//! to the app; a plain init container has exited before the pod serves). UDP and SCTP
//! are skipped (Envoy's inbound listeners are TCP). Ports are deduplicated by number
//! (the first declaration's name and protocol win, containers before sidecars) and
//! sorted by number; the `i`-th gets the inbound listener `INBOUND_BASE_PORT + i`, as
//! for annotated pods. The protocol comes from [`infer_protocol`]: container ports
//! have no `appProtocol`, so their name decides, else opaque TCP (never break a
//! protocol the mesh cannot see).
//!
//! **Capture** of a meshed pod's traffic is chosen by its `flock.io/capture*`
//! annotations ([`PodFacts::capture`]; the agent resolves them against its node's
//! `--capture` flags): in kube mode these are read from the API's Pod, never from the
//! CNI request. A bad value refuses a meshed pod, naming the annotation.
//!
//! **Membership** follows Kubernetes' Service rule: a Service of the pod's namespace
//! whose non-empty `spec.selector` is a subset of the pod's labels ([`selects`]). An
//! absent or empty selector selects nothing (such a Service's endpoints are managed by
//! hand, not by the endpoints controller).
//!
//! **Remote identity** (EndpointSlices): a Service in a meshed namespace is reached
//! over mTLS. Callers accept exactly `spiffe://<td>/ns/<ns>/sa/<sa>` for each account
//! of the Service's [`SERVICE_ACCOUNTS_ANNOTATION`], else any account of the
//! namespace, written `spiffe://<td>/ns/<ns>/sa/*` (a trailing `/*` is a SAN prefix
//! match). Services of other namespaces are plaintext.
//!
//! Limitation: a slice port is the app's own port, which reaches the callee's Envoy
//! only when the callee's capture rules redirect it (`flock-capture`; not for a caller
//! on the callee's own node, whose connections come from the probe source); mesh
//! traffic between pods uses `--kube` with an etcd registry (docs/kubernetes.md,
//! "Ports and capture").
//!
//! # Size limits
//!
//! The API server already bounds what it stores, but these objects are outside input
//! to the agent (and the fuzz target feeds arbitrary ones), so every list is bounded
//! here too, with the API server's limit where it has one: [`MAX_LABELS`],
//! [`MAX_CONTAINERS`], [`MAX_CONTAINER_PORTS`], [`MAX_SERVICE_ACCOUNTS`],
//! [`MAX_CLUSTER_IPS`], [`MAX_SLICE_ENDPOINTS`], [`MAX_SLICE_PORTS`],
//! [`MAX_ENDPOINT_ADDRESSES`], and `flock_core::pod::MAX_PORTS` for the meshed ports
//! of a pod and the TCP ports of a Service. Errors name the field at fault in the
//! API's own path syntax (`spec.containers[1].ports[0].containerPort`) and quote
//! values by a bounded prefix.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use flock_core::capture::policy::{NAMESPACE_LABEL, PodOverrides, Setting, parse_annotations};
pub use flock_core::pod::Health;
use flock_core::pod::{
    INBOUND_BASE_PORT, MAX_PORTS, PodPort, Protocol, check_ip, check_label, check_ports,
    check_subdomain, check_uid,
};
use k8s_openapi::api::core::v1::{Container, Pod, Service};
use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointSlice};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

/// The label that opts a namespace or a pod in (`enabled`) or a pod out (`disabled`).
pub const MESH_LABEL: &str = "flock.io/mesh";
/// [`MESH_LABEL`]'s value that meshes a namespace's pods or one pod.
pub const MESH_ENABLED: &str = "enabled";
/// [`MESH_LABEL`]'s value that keeps a pod out of a meshed namespace.
pub const MESH_DISABLED: &str = "disabled";
/// The Service annotation listing the service accounts its pods run as (`a,b`): the
/// exact identities callers accept. Absent: any account of the namespace.
pub const SERVICE_ACCOUNTS_ANNOTATION: &str = "flock.io/service-accounts";
/// The Service annotations that set its connection-pool limits (the circuit
/// breakers of every mesh cluster of the Service, on every node): most connections
/// to its endpoints, most requests waiting for one, most requests in flight, and the
/// share (percent) of those in flight that retries may add. Each is optional; an
/// absent one keeps the mesh's default. Like Istio's `DestinationRule`
/// `connectionPool`, on the destination: every caller's Envoy holds the Service to
/// the same limits.
pub const POOL_ANNOTATIONS: [&str; 4] = [
    MAX_CONNECTIONS_ANNOTATION,
    MAX_PENDING_REQUESTS_ANNOTATION,
    MAX_REQUESTS_ANNOTATION,
    RETRY_BUDGET_ANNOTATION,
];
/// See [`POOL_ANNOTATIONS`].
pub const MAX_CONNECTIONS_ANNOTATION: &str = "flock.io/max-connections";
/// See [`POOL_ANNOTATIONS`].
pub const MAX_PENDING_REQUESTS_ANNOTATION: &str = "flock.io/max-pending-requests";
/// See [`POOL_ANNOTATIONS`].
pub const MAX_REQUESTS_ANNOTATION: &str = "flock.io/max-requests";
/// See [`POOL_ANNOTATIONS`].
pub const RETRY_BUDGET_ANNOTATION: &str = "flock.io/retry-budget-percent";
/// Largest value of a limit in [`POOL_ANNOTATIONS`] (the retry budget is 1-100).
pub const MAX_POOL_LIMIT: u32 = 1_000_000;
/// The label of an EndpointSlice naming its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";
/// The Node label of its zone.
pub const ZONE_LABEL: &str = "topology.kubernetes.io/zone";
/// The Node label of its region.
pub const REGION_LABEL: &str = "topology.kubernetes.io/region";
/// The service account of a pod that names none (the API server's default).
pub const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// Most labels of a pod (and keys of a Service selector). The API server limits only
/// their total size; 256 is far above what workloads carry and bounds the work of
/// matching every Service against every pod.
pub const MAX_LABELS: usize = 256;
/// Longest label key: a DNS-subdomain prefix (253), `/`, a name (63), as the API
/// server validates it.
pub const MAX_LABEL_KEY_LEN: usize = 253 + 1 + 63;
/// Longest label value (the API server's limit).
pub const MAX_LABEL_VALUE_LEN: usize = 63;
/// Most containers in `spec.containers`, and separately in `spec.initContainers`.
/// The API server sets no number; pods with more than a handful are rare.
pub const MAX_CONTAINERS: usize = 64;
/// Most declared ports of one container, of any protocol (the meshed TCP ports of the
/// whole pod are further limited to `MAX_PORTS`).
pub const MAX_CONTAINER_PORTS: usize = 128;
/// Longest port name (the API server's IANA service-name rule: at most 15).
pub const MAX_PORT_NAME_LEN: usize = 15;
/// Most accounts in [`SERVICE_ACCOUNTS_ANNOTATION`].
pub const MAX_SERVICE_ACCOUNTS: usize = 32;
/// Most cluster IPs of a Service (the API server's limit: one per IP family).
pub const MAX_CLUSTER_IPS: usize = 2;
/// Most endpoints of one EndpointSlice (the API server's limit).
pub const MAX_SLICE_ENDPOINTS: usize = 1000;
/// Most ports of one EndpointSlice (the API server's limit).
pub const MAX_SLICE_PORTS: usize = 100;
/// Most addresses of one slice endpoint (the API server's limit; only the first is
/// used, as the API documents and kube-proxy does).
pub const MAX_ENDPOINT_ADDRESSES: usize = 100;
/// Longest trust domain accepted to build identities (the SPIFFE limit).
pub const MAX_TRUST_DOMAIN_LEN: usize = 255;

/// Whether a pod is meshed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeshDecision {
    /// Opted in, by its namespace or its own label.
    Meshed,
    /// Not meshed, and why (for logs and the CNI result).
    NotMeshed(String),
}

impl MeshDecision {
    /// Whether the pod is meshed.
    pub fn is_meshed(&self) -> bool {
        matches!(self, MeshDecision::Meshed)
    }
}

/// What the mesh needs to know about a pod, taken from the API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodFacts {
    /// `metadata.namespace` (a DNS label).
    pub namespace: String,
    /// `metadata.name` (a DNS subdomain).
    pub name: String,
    /// `metadata.uid` (may be empty).
    pub uid: String,
    /// `spec.nodeName`: the caller compares it with its own node.
    pub node_name: Option<String>,
    /// The service account (never empty: `default` when the pod names none).
    pub service_account: String,
    /// The meshed ports: TCP, deduplicated, sorted, listeners from
    /// `INBOUND_BASE_PORT`; they pass `check_ports`. Empty for a pod that is not
    /// meshed and whose ports the mesh could not serve.
    pub ports: Vec<PodPort>,
    /// Names of the meshed ports → their number, for a Service's `targetPort` by name.
    pub port_names: BTreeMap<String, u16>,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `spec.hostNetwork`.
    pub host_network: bool,
    /// What the pod's `flock.io/capture*` annotations (`metadata.annotations`) say
    /// about its transparent capture (`flock_core::capture::policy::parse_annotations`),
    /// with its Namespace's `flock.io/capture` label (the admin's mode for it); empty
    /// for a pod that is not meshed.
    pub capture: PodOverrides,
    /// `metadata.deletionTimestamp` is set.
    pub terminating: bool,
    /// Whether the pod is meshed.
    pub mesh: MeshDecision,
}

impl PodFacts {
    /// Why a pod that would be meshed must be refused on `node` (a CNI ADD fails, the
    /// agent records nothing): it is terminating (its sandbox is being torn down; a
    /// record made now would outlive it), or the API binds it to another node (the
    /// request cannot be for this node's pod). `None` for a pod that is not meshed:
    /// the agent leaves it alone.
    pub fn refusal(&self, node: &str) -> Option<String> {
        if !self.mesh.is_meshed() {
            return None;
        }
        if self.terminating {
            return Some(format!(
                "pod {}/{} is terminating (deletionTimestamp is set)",
                self.namespace, self.name
            ));
        }
        match &self.node_name {
            Some(n) if n == node => None,
            Some(n) => Some(format!(
                "pod {}/{} is bound to node {:?}, not this node {node:?}",
                self.namespace,
                self.name,
                bounded(n)
            )),
            None => Some(format!(
                "pod {}/{} is not bound to a node yet",
                self.namespace, self.name
            )),
        }
    }
}

/// Why an API object could not be mapped: the field (in the API's path syntax) and
/// what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct MapError {
    /// The field at fault: `spec.containers[1].ports[0].containerPort`,
    /// `metadata.annotations[flock.io/service-accounts]`, `endpoints[3].addresses[0]`.
    pub field: String,
    /// What is wrong, quoting (a bounded prefix of) the value.
    pub message: String,
}

fn map_err(field: impl Into<String>, message: impl Into<String>) -> MapError {
    MapError {
        field: field.into(),
        message: message.into(),
    }
}

/// At most 64 characters of `s`, for quoting outside input in a message.
fn bounded(s: &str) -> String {
    s.chars().take(64).collect()
}

/// A port's protocol: `appProtocol` first (`http`, `http2`, `kubernetes.io/h2c`,
/// `grpc-web` → http; `grpc` → grpc; anything else → tcp), else the port name's
/// prefix (`http`/`http-*`, `http2`/`http2-*`, `grpc-web`/`grpc-web-*` → http;
/// `grpc`/`grpc-*` → grpc; `tcp`/`tcp-*` → tcp), else tcp: an unknown protocol is
/// proxied byte for byte rather than broken by an HTTP proxy.
pub fn infer_protocol(app_protocol: Option<&str>, name: Option<&str>) -> Protocol {
    declared_protocol(app_protocol, name).unwrap_or(Protocol::Tcp)
}

/// The protocol `appProtocol` or the name convention declares, `None` when neither
/// says anything (see [`infer_protocol`]).
fn declared_protocol(app_protocol: Option<&str>, name: Option<&str>) -> Option<Protocol> {
    if let Some(ap) = app_protocol.filter(|a| !a.is_empty()) {
        return Some(match ap.to_ascii_lowercase().as_str() {
            "http" | "http2" | "kubernetes.io/h2c" | "grpc-web" => Protocol::Http,
            "grpc" => Protocol::Grpc,
            _ => Protocol::Tcp,
        });
    }
    let name = name?;
    let is = |p: &str| name == p || name.strip_prefix(p).is_some_and(|r| r.starts_with('-'));
    if is("grpc-web") || is("http") || is("http2") {
        Some(Protocol::Http)
    } else if is("grpc") {
        Some(Protocol::Grpc)
    } else if is("tcp") {
        Some(Protocol::Tcp)
    } else {
        None
    }
}

/// Whether a container port's name marks the app as a proxyless gRPC xDS server on
/// it: `grpc-xds` or `grpc-xds-<suffix>` (a `grpc` name, so the port is gRPC too). The
/// pod spec is what the API's admission governs, as for the port itself.
pub fn is_proxyless_name(name: &str) -> bool {
    name == "grpc-xds" || name.starts_with("grpc-xds-")
}

/// Whether a port's `protocol` field is TCP (absent means TCP, the API's default).
fn is_tcp(protocol: Option<&str>) -> bool {
    protocol.is_none_or(|p| p == "TCP")
}

/// A port number from the API's `int32`: 1 to 65535.
fn port_number(n: i32) -> Option<u16> {
    u16::try_from(n).ok().filter(|p| *p != 0)
}

/// Whether `namespace_labels` or the pod's own labels mesh it (see the module docs).
fn decide(
    labels: &BTreeMap<String, String>,
    namespace_labels: Option<&BTreeMap<String, String>>,
    host_network: bool,
) -> MeshDecision {
    if host_network {
        return MeshDecision::NotMeshed(
            "hostNetwork pod: it shares the node's network namespace, which the mesh never \
             captures"
                .into(),
        );
    }
    match labels.get(MESH_LABEL).map(String::as_str) {
        Some(MESH_DISABLED) => {
            return MeshDecision::NotMeshed(format!(
                "pod label {MESH_LABEL}={MESH_DISABLED} opts it out"
            ));
        }
        Some(MESH_ENABLED) => return MeshDecision::Meshed,
        _ => {}
    }
    if namespace_labels
        .and_then(|l| l.get(MESH_LABEL))
        .map(String::as_str)
        == Some(MESH_ENABLED)
    {
        return MeshDecision::Meshed;
    }
    MeshDecision::NotMeshed(format!(
        "neither the pod nor its namespace has label {MESH_LABEL}={MESH_ENABLED}"
    ))
}

/// Checks a label map's size and its keys' and values' lengths.
fn check_labels(field: &str, labels: &BTreeMap<String, String>) -> Result<(), MapError> {
    if labels.len() > MAX_LABELS {
        return Err(map_err(
            field,
            format!("{} labels, more than {MAX_LABELS}", labels.len()),
        ));
    }
    for (k, v) in labels {
        if k.is_empty() || k.len() > MAX_LABEL_KEY_LEN {
            return Err(map_err(
                format!("{field}[{}]", bounded(k)),
                format!("a label key must be 1 to {MAX_LABEL_KEY_LEN} characters"),
            ));
        }
        if v.len() > MAX_LABEL_VALUE_LEN {
            return Err(map_err(
                format!("{field}[{}]", bounded(k)),
                format!("a label value must be at most {MAX_LABEL_VALUE_LEN} characters"),
            ));
        }
    }
    Ok(())
}

/// A port name as the API server validates it (IANA service name): 1 to 15 of
/// `a-z 0-9 -`, at least one letter, no `-` at either end or twice in a row.
fn check_port_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= MAX_PORT_NAME_LEN
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && name.bytes().any(|b| b.is_ascii_lowercase())
        && !name.starts_with('-')
        && !name.ends_with('-')
        && !name.contains("--");
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{:?} is not a port name (1 to {MAX_PORT_NAME_LEN} of a-z 0-9 -, at least one \
             letter, no leading, trailing or double -)",
            bounded(name)
        ))
    }
}

/// The meshed ports of a pod and their names.
type MeshedPorts = (Vec<PodPort>, BTreeMap<String, u16>);

/// The TCP ports of `spec.containers` and the sidecar `spec.initContainers`.
fn container_ports(
    containers: &[Container],
    init_containers: &[Container],
) -> Result<MeshedPorts, MapError> {
    if containers.len() > MAX_CONTAINERS {
        return Err(map_err(
            "spec.containers",
            format!(
                "{} containers, more than {MAX_CONTAINERS}",
                containers.len()
            ),
        ));
    }
    if init_containers.len() > MAX_CONTAINERS {
        return Err(map_err(
            "spec.initContainers",
            format!(
                "{} init containers, more than {MAX_CONTAINERS}",
                init_containers.len()
            ),
        ));
    }
    let sidecars = init_containers
        .iter()
        .enumerate()
        .filter(|(_, c)| c.restart_policy.as_deref() == Some("Always"))
        .map(|(i, c)| ("spec.initContainers", i, c));
    let all = containers
        .iter()
        .enumerate()
        .map(|(i, c)| ("spec.containers", i, c))
        .chain(sidecars);
    // Number → (protocol, proxyless), first declaration wins.
    let mut by_number: BTreeMap<u16, (Protocol, bool)> = BTreeMap::new();
    let mut names = BTreeMap::new();
    for (list, i, c) in all {
        let declared = c.ports.as_deref().unwrap_or_default();
        if declared.len() > MAX_CONTAINER_PORTS {
            return Err(map_err(
                format!("{list}[{i}].ports"),
                format!("{} ports, more than {MAX_CONTAINER_PORTS}", declared.len()),
            ));
        }
        for (j, p) in declared.iter().enumerate() {
            if !is_tcp(p.protocol.as_deref()) {
                continue;
            }
            let field = format!("{list}[{i}].ports[{j}]");
            let number = port_number(p.container_port).ok_or_else(|| {
                map_err(
                    format!("{field}.containerPort"),
                    format!("{} is not a port (1-65535)", p.container_port),
                )
            })?;
            let name = p.name.as_deref().filter(|n| !n.is_empty());
            if let Some(n) = name {
                check_port_name(n).map_err(|m| map_err(format!("{field}.name"), m))?;
                names.entry(n.to_string()).or_insert(number);
            }
            if !by_number.contains_key(&number) {
                if by_number.len() == MAX_PORTS {
                    return Err(map_err(
                        format!("{field}.containerPort"),
                        format!(
                            "port {number} is the pod's TCP port number {}; the mesh serves at \
                             most {MAX_PORTS}",
                            MAX_PORTS + 1
                        ),
                    ));
                }
                by_number.insert(
                    number,
                    (
                        infer_protocol(None, name),
                        name.is_some_and(is_proxyless_name),
                    ),
                );
            }
        }
    }
    let ports: Vec<PodPort> = by_number
        .into_iter()
        .enumerate()
        .map(|(i, (app_port, (protocol, proxyless)))| PodPort {
            app_port,
            // In range: i < MAX_PORTS.
            listen_port: INBOUND_BASE_PORT + i as u16,
            protocol,
            proxyless,
        })
        .collect();
    check_ports(&ports).map_err(|m| map_err("spec.containers[*].ports", m))?;
    Ok((ports, names))
}

/// Whether `pod` is a pod the agent on `node` should have meshed and must have seen
/// (a CNI ADD stores it before the sandbox is up, so before any container runs): it is
/// opted in, bound to `node`, `Running`, not hostNetwork and not terminating. A pod
/// like that without a record in the agent's store started without the mesh (the
/// plugin was not in the node's chain yet) and is reachable around Envoy. `None` when
/// its facts do not map (the agent then cannot tell; it does not report it).
pub fn should_be_meshed_on(
    pod: &Pod,
    namespace_labels: Option<&BTreeMap<String, String>>,
    node: &str,
) -> Option<PodFacts> {
    let running = pod
        .status
        .as_ref()
        .and_then(|s| s.phase.as_deref())
        .is_some_and(|p| p == "Running");
    if !running {
        return None;
    }
    let facts = pod_facts(pod, namespace_labels).ok()?;
    (facts.mesh.is_meshed()
        && !facts.host_network
        && !facts.terminating
        && facts.node_name.as_deref() == Some(node))
    .then_some(facts)
}

/// Maps a Pod. `namespace_labels` are its Namespace's labels (`None`: the namespace is
/// not known, so only the pod's own label can mesh it).
///
/// Errors: the pod's name, namespace or UID are malformed, or — for a pod that would
/// be meshed — its labels, service account or ports are beyond what the mesh serves.
/// A pod that is not meshed is never refused for its ports, labels or account (the
/// agent leaves it alone): its `ports` and `port_names` are then empty.
pub fn pod_facts(
    pod: &Pod,
    namespace_labels: Option<&BTreeMap<String, String>>,
) -> Result<PodFacts, MapError> {
    let meta = &pod.metadata;
    let namespace = meta.namespace.clone().unwrap_or_default();
    check_label(&namespace).map_err(|m| map_err("metadata.namespace", m))?;
    let name = meta.name.clone().unwrap_or_default();
    check_subdomain(&name).map_err(|m| map_err("metadata.name", m))?;
    let uid = meta.uid.clone().unwrap_or_default();
    check_uid(&uid).map_err(|m| map_err("metadata.uid", m))?;
    let spec = pod
        .spec
        .as_ref()
        .ok_or_else(|| map_err("spec", "the pod has no spec"))?;
    let labels = meta.labels.clone().unwrap_or_default();
    let host_network = spec.host_network == Some(true);
    let mesh = decide(&labels, namespace_labels, host_network);

    let account = spec
        .service_account_name
        .as_deref()
        .filter(|s| !s.is_empty())
        .map(|s| ("spec.serviceAccountName", s))
        .or_else(|| {
            spec.service_account
                .as_deref()
                .filter(|s| !s.is_empty())
                .map(|s| ("spec.serviceAccount", s))
        });
    let service_account = account
        .map_or(DEFAULT_SERVICE_ACCOUNT, |(_, s)| s)
        .to_string();
    let checked = (|| {
        check_labels("metadata.labels", &labels)?;
        if let Some((field, s)) = account {
            check_subdomain(s).map_err(|m| map_err(field, m))?;
        }
        let ports = container_ports(
            &spec.containers,
            spec.init_containers.as_deref().unwrap_or_default(),
        )?;
        let mut capture = meta
            .annotations
            .as_ref()
            .map(parse_annotations)
            .transpose()
            .map_err(|e| map_err(format!("metadata.annotations[{}]", e.annotation), e.message))?
            .unwrap_or_default();
        // The admin's mode for the whole namespace; a bad value refuses the pod (fails
        // closed) rather than meshing it with a capture nobody chose.
        capture.namespace = namespace_labels
            .and_then(|l| l.get(NAMESPACE_LABEL))
            .map(|v| {
                v.parse::<Setting>().map_err(|m| {
                    map_err(
                        format!("namespace {namespace:?} metadata.labels[{NAMESPACE_LABEL}]"),
                        m,
                    )
                })
            })
            .transpose()?;
        Ok((ports, capture))
    })();
    let ((ports, port_names), capture) = match checked {
        Ok(p) => p,
        Err(e) if mesh.is_meshed() => return Err(e),
        Err(_) => ((Vec::new(), BTreeMap::new()), PodOverrides::default()),
    };
    Ok(PodFacts {
        namespace,
        name,
        uid,
        node_name: spec.node_name.clone(),
        service_account,
        ports,
        port_names,
        labels,
        host_network,
        capture,
        terminating: meta.deletion_timestamp.is_some(),
        mesh,
    })
}

/// Whether a Service selector selects a pod with `labels`: every key of `selector` has
/// the same value in `labels`. An empty selector selects nothing, as for Services
/// (unlike a `LabelSelector`, where empty means everything).
pub fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    !selector.is_empty() && selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// A pod's membership in one Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Membership {
    /// The namespace (the pod's and the Service's).
    pub namespace: String,
    /// The Service's name.
    pub service: String,
    /// The Service ports that reach one of the pod's meshed ports, by `service_port`.
    pub ports: Vec<MemberPort>,
}

/// One Service port of a membership and the pod port it reaches.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberPort {
    /// The Service's `port`.
    pub service_port: u16,
    /// The Service port's `name`.
    pub name: Option<String>,
    /// The pod's port it targets (`targetPort`, resolved).
    pub app_port: u16,
    /// Envoy's inbound listener for that pod port (a proxyless port: the app's own).
    pub listen_port: u16,
    /// The Service port's protocol ([`infer_protocol`] of its `appProtocol` and name);
    /// when neither says anything, the pod port's protocol.
    pub protocol: Protocol,
}

/// The Services that select a meshed pod, each with the Service ports that resolve to
/// a meshed pod port; sorted by Service name. A pod that is not meshed is a member of
/// nothing. Services of other namespaces, Services with an absent or empty selector,
/// Services [`service_info`] refuses, and memberships with no port left (all their
/// ports UDP, or targeting ports the pod does not mesh) are left out.
///
/// `targetPort`: a number is the pod port; a name is looked up in the pod's
/// [`PodFacts::port_names`]; absent means the Service's `port`.
pub fn memberships<'a>(
    facts: &PodFacts,
    services: impl IntoIterator<Item = &'a Service>,
) -> Vec<Membership> {
    if !facts.mesh.is_meshed() {
        return Vec::new();
    }
    let mut out: Vec<Membership> = services
        .into_iter()
        .filter(|svc| svc.metadata.namespace.as_deref() == Some(facts.namespace.as_str()))
        .filter_map(|svc| membership(facts, svc))
        .collect();
    out.sort_by(|a, b| a.service.cmp(&b.service));
    out.dedup_by(|a, b| a.service == b.service);
    out
}

fn membership(facts: &PodFacts, svc: &Service) -> Option<Membership> {
    let spec = svc.spec.as_ref()?;
    let selector = spec.selector.as_ref()?;
    if selector.len() > MAX_LABELS || !selects(selector, &facts.labels) {
        return None;
    }
    let info = service_info(svc).ok()?;
    let mut ports = Vec::new();
    for sp in spec.ports.as_deref().unwrap_or_default() {
        let Some(service_port) = port_number(sp.port) else {
            continue;
        };
        if !is_tcp(sp.protocol.as_deref()) {
            continue;
        }
        let target = match &sp.target_port {
            None => Some(service_port),
            Some(IntOrString::Int(n)) => port_number(*n),
            Some(IntOrString::String(name)) => facts.port_names.get(name).copied(),
        };
        let Some(pod_port) = target.and_then(|t| facts.ports.iter().find(|p| p.app_port == t))
        else {
            continue;
        };
        let name = sp.name.clone().filter(|n| !n.is_empty());
        let protocol = declared_protocol(sp.app_protocol.as_deref(), name.as_deref())
            .unwrap_or(pod_port.protocol);
        ports.push(MemberPort {
            service_port,
            name,
            app_port: pod_port.app_port,
            listen_port: pod_port.dialled_port(),
            protocol,
        });
    }
    ports.sort_by_key(|p| p.service_port);
    ports.dedup_by_key(|p| p.service_port);
    (!ports.is_empty()).then_some(Membership {
        namespace: info.namespace,
        service: info.name,
        ports,
    })
}

/// What the mesh uses of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceInfo {
    /// `metadata.namespace` (a DNS label).
    pub namespace: String,
    /// `metadata.name` (a DNS label).
    pub name: String,
    /// `spec.clusterIPs` (else `spec.clusterIP`) without `None` and empty entries.
    pub cluster_ips: Vec<IpAddr>,
    /// The TCP ports, in the Service's order.
    pub ports: Vec<ServicePortInfo>,
    /// [`SERVICE_ACCOUNTS_ANNOTATION`]: sorted, distinct; `None` when absent.
    pub service_accounts: Option<Vec<String>>,
}

/// One TCP port of a Service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServicePortInfo {
    /// The port's `name` (`None` when absent or empty).
    pub name: Option<String>,
    /// The port's `port`.
    pub port: u16,
    /// [`infer_protocol`] of its `appProtocol` and name.
    pub protocol: Protocol,
}

/// Maps a Service. Errors name the field: a malformed name or namespace, a cluster IP
/// that is not an IP, more than `MAX_PORTS` TCP ports, a port out of range, a
/// malformed [`SERVICE_ACCOUNTS_ANNOTATION`]. UDP and SCTP ports are skipped.
pub fn service_info(svc: &Service) -> Result<ServiceInfo, MapError> {
    let meta = &svc.metadata;
    let namespace = meta.namespace.clone().unwrap_or_default();
    check_label(&namespace).map_err(|m| map_err("metadata.namespace", m))?;
    let name = meta.name.clone().unwrap_or_default();
    check_label(&name).map_err(|m| map_err("metadata.name", m))?;
    let spec = svc.spec.clone().unwrap_or_default();

    let (ips_field, raw_ips) = match (&spec.cluster_ips, &spec.cluster_ip) {
        (Some(ips), _) if !ips.is_empty() => ("spec.clusterIPs", ips.clone()),
        (_, Some(ip)) => ("spec.clusterIP", vec![ip.clone()]),
        _ => ("spec.clusterIPs", Vec::new()),
    };
    if raw_ips.len() > MAX_CLUSTER_IPS {
        return Err(map_err(
            ips_field,
            format!("{} cluster IPs, more than {MAX_CLUSTER_IPS}", raw_ips.len()),
        ));
    }
    let mut cluster_ips = Vec::new();
    for (i, raw) in raw_ips.iter().enumerate() {
        if raw.is_empty() || raw == "None" {
            continue;
        }
        let field = format!("{ips_field}[{i}]");
        let ip: IpAddr = raw
            .parse()
            .map_err(|_| map_err(&field, format!("{:?} is not an IP address", bounded(raw))))?;
        check_ip(ip).map_err(|m| map_err(&field, m))?;
        cluster_ips.push(ip);
    }

    let mut ports = Vec::new();
    for (i, sp) in spec.ports.as_deref().unwrap_or_default().iter().enumerate() {
        if !is_tcp(sp.protocol.as_deref()) {
            continue;
        }
        let port = port_number(sp.port).ok_or_else(|| {
            map_err(
                format!("spec.ports[{i}].port"),
                format!("{} is not a port (1-65535)", sp.port),
            )
        })?;
        if ports.len() == MAX_PORTS {
            return Err(map_err(
                format!("spec.ports[{i}]"),
                format!("more than {MAX_PORTS} TCP ports; the mesh serves at most {MAX_PORTS}"),
            ));
        }
        let name = sp.name.clone().filter(|n| !n.is_empty());
        if let Some(n) = &name {
            // Service port names are DNS labels (up to 63), unlike container port
            // names (IANA service names, up to 15).
            check_label(n).map_err(|m| map_err(format!("spec.ports[{i}].name"), m))?;
        }
        ports.push(ServicePortInfo {
            protocol: infer_protocol(sp.app_protocol.as_deref(), name.as_deref()),
            name,
            port,
        });
    }

    let service_accounts = meta
        .annotations
        .as_ref()
        .and_then(|a| a.get(SERVICE_ACCOUNTS_ANNOTATION))
        .map(|v| parse_service_accounts(v))
        .transpose()?;
    Ok(ServiceInfo {
        namespace,
        name,
        cluster_ips,
        ports,
        service_accounts,
    })
}

/// A Service's [`POOL_ANNOTATIONS`]: each limit it sets, `None` for the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolLimits {
    /// [`MAX_CONNECTIONS_ANNOTATION`].
    pub max_connections: Option<u32>,
    /// [`MAX_PENDING_REQUESTS_ANNOTATION`].
    pub max_pending_requests: Option<u32>,
    /// [`MAX_REQUESTS_ANNOTATION`].
    pub max_requests: Option<u32>,
    /// [`RETRY_BUDGET_ANNOTATION`].
    pub retry_budget_percent: Option<u32>,
}

/// The connection-pool limits a Service's [`POOL_ANNOTATIONS`] set: `None` when it
/// carries none of them. Each value is a whole number from 1 to [`MAX_POOL_LIMIT`]
/// (the retry budget 1 to 100); a zero would refuse every request and is an error,
/// as is anything else, naming the annotation. The caller keeps the mesh's defaults
/// for a Service whose annotations are malformed (limits that stop traffic are not
/// guessed at) and reports it.
pub fn service_pool(svc: &Service) -> Result<Option<PoolLimits>, MapError> {
    let Some(annotations) = svc.metadata.annotations.as_ref() else {
        return Ok(None);
    };
    let value = |key: &str, max: u32| -> Result<Option<u32>, MapError> {
        let Some(raw) = annotations.get(key) else {
            return Ok(None);
        };
        match raw.trim().parse::<u32>() {
            Ok(v) if (1..=max).contains(&v) => Ok(Some(v)),
            _ => Err(map_err(
                format!("metadata.annotations[{key}]"),
                format!("{:?} is not a whole number from 1 to {max}", bounded(raw)),
            )),
        }
    };
    let limits = PoolLimits {
        max_connections: value(MAX_CONNECTIONS_ANNOTATION, MAX_POOL_LIMIT)?,
        max_pending_requests: value(MAX_PENDING_REQUESTS_ANNOTATION, MAX_POOL_LIMIT)?,
        max_requests: value(MAX_REQUESTS_ANNOTATION, MAX_POOL_LIMIT)?,
        retry_budget_percent: value(RETRY_BUDGET_ANNOTATION, 100)?,
    };
    Ok((limits != PoolLimits::default()).then_some(limits))
}

/// Parses [`SERVICE_ACCOUNTS_ANNOTATION`]: comma-separated service accounts (DNS
/// subdomains, blanks around commas allowed), at least one, at most
/// [`MAX_SERVICE_ACCOUNTS`]; sorted and deduplicated. An annotation naming no account
/// is an error, not "any account": it would otherwise widen what callers accept.
pub fn parse_service_accounts(value: &str) -> Result<Vec<String>, MapError> {
    let field = format!("metadata.annotations[{SERVICE_ACCOUNTS_ANNOTATION}]");
    let parts: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .take(MAX_SERVICE_ACCOUNTS + 1)
        .collect();
    if parts.is_empty() {
        return Err(map_err(field, "names no service account"));
    }
    if parts.len() > MAX_SERVICE_ACCOUNTS {
        return Err(map_err(
            field,
            format!("more than {MAX_SERVICE_ACCOUNTS} service accounts"),
        ));
    }
    let mut accounts = BTreeSet::new();
    for p in parts {
        check_subdomain(p).map_err(|m| map_err(&field, m))?;
        accounts.insert(p.to_string());
    }
    Ok(accounts.into_iter().collect())
}

/// One endpoint of a remote Service port, from an EndpointSlice.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RemoteEndpoint {
    /// The Service's namespace.
    pub namespace: String,
    /// The Service's name.
    pub service: String,
    /// The Service port this endpoint serves.
    pub service_port: u16,
    /// That Service port's protocol.
    pub protocol: Protocol,
    /// The endpoint's address (the first of its `addresses`).
    pub address: IpAddr,
    /// The slice port: the pod's own app port.
    pub port: u16,
    /// The endpoint's `nodeName` (empty when absent).
    pub node: String,
    /// `<namespace>/<name>` of the pod its `targetRef` names, if it names a Pod.
    pub pod: Option<String>,
    /// The Node's [`REGION_LABEL`] (empty when unknown).
    pub region: String,
    /// The endpoint's `zone`, else its Node's [`ZONE_LABEL`] (empty when unknown).
    pub zone: String,
    /// From the endpoint's conditions ([`endpoint_health`]).
    pub health: Health,
    /// The first of [`identities`](Self::identities): `None` means plaintext.
    pub identity: Option<String>,
    /// Every SPIFFE ID a caller accepts for this endpoint (one per account of the
    /// Service's [`SERVICE_ACCOUNTS_ANNOTATION`], or the namespace-wide
    /// `spiffe://<td>/ns/<ns>/sa/*`); empty when plaintext. A slice does not say which
    /// account each endpoint runs as, so a caller's verification of a Service port
    /// must accept all of them.
    pub identities: Vec<String>,
}

/// Health from an endpoint's conditions: `ready: true` → healthy; `ready` unset →
/// unknown (the API says to treat it as ready); `serving: true` and `terminating:
/// true` → draining (still serving, takes no new requests); otherwise unhealthy.
pub fn endpoint_health(conditions: Option<&EndpointConditions>) -> Health {
    let (ready, serving, terminating) =
        conditions.map_or((None, None, None), |c| (c.ready, c.serving, c.terminating));
    match ready {
        Some(true) => Health::Healthy,
        None => Health::Unknown,
        Some(false) if serving == Some(true) && terminating == Some(true) => Health::Draining,
        Some(false) => Health::Unhealthy,
    }
}

/// A trust domain to build SPIFFE IDs from: 1 to [`MAX_TRUST_DOMAIN_LEN`] of
/// `a-z 0-9 . - _` (the SPIFFE rule).
fn check_trust_domain(td: &str) -> Result<(), String> {
    let ok = !td.is_empty()
        && td.len() <= MAX_TRUST_DOMAIN_LEN
        && td.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'-' | b'_')
        });
    if ok {
        Ok(())
    } else {
        Err(format!(
            "trust domain {:?} is not 1 to {MAX_TRUST_DOMAIN_LEN} of a-z 0-9 . - _",
            bounded(td)
        ))
    }
}

/// A topology label value worth keeping: a label value (at most
/// [`MAX_LABEL_VALUE_LEN`], no control characters); anything else counts as unknown.
fn topology(value: Option<&str>) -> Option<String> {
    value
        .filter(|v| {
            !v.is_empty() && v.len() <= MAX_LABEL_VALUE_LEN && !v.chars().any(char::is_control)
        })
        .map(str::to_string)
}

/// The remote endpoints of one EndpointSlice of `svc`: every endpoint × every slice
/// port that matches one of the Service's TCP ports by name, in the slice's order.
///
/// Returns the endpoints and the problems found. A bad endpoint (no address, an
/// address that is not an IP of the slice's family, a malformed node or pod name) is
/// left out alone, with an error naming it (`endpoints[3].addresses[0]`); a bad slice
/// port is left out alone likewise. A slice that is not `svc`'s (another namespace or
/// `kubernetes.io/service-name`), that is over the API's size limits, or for whose
/// meshed namespace no identity can be built (a malformed `trust_domain`, a
/// hand-built `svc` with malformed names or an empty account list) gives no endpoint
/// and one error. `FQDN` slices (and any address type but `IPv4` and `IPv6`)
/// give nothing and no error: the mesh routes to IPs only. Slice ports with no number
/// (the API's "all ports") or not TCP, and ports the Service no longer has (the slice
/// lags a Service update), are skipped.
///
/// `meshed_namespace`: the Service's namespace is meshed, so its endpoints carry the
/// identities callers verify (see the module docs); otherwise they are plaintext.
/// `node_labels` gives a Node's labels (zone and region) by name.
pub fn slice_endpoints(
    svc: &ServiceInfo,
    slice: &EndpointSlice,
    meshed_namespace: bool,
    trust_domain: &str,
    node_labels: &dyn Fn(&str) -> Option<BTreeMap<String, String>>,
) -> (Vec<RemoteEndpoint>, Vec<MapError>) {
    match slice_checked(svc, slice, meshed_namespace, trust_domain, node_labels) {
        Ok(found) => found,
        Err(e) => (Vec::new(), vec![e]),
    }
}

fn slice_checked(
    svc: &ServiceInfo,
    slice: &EndpointSlice,
    meshed_namespace: bool,
    trust_domain: &str,
    node_labels: &dyn Fn(&str) -> Option<BTreeMap<String, String>>,
) -> Result<(Vec<RemoteEndpoint>, Vec<MapError>), MapError> {
    // A ServiceInfo is plain data a caller may build by hand: its names go into
    // SPIFFE IDs, so they are checked here too, not only in `service_info`.
    check_label(&svc.namespace).map_err(|m| map_err("service namespace", m))?;
    check_label(&svc.name).map_err(|m| map_err("service name", m))?;
    for a in svc.service_accounts.iter().flatten() {
        check_subdomain(a).map_err(|m| map_err("service accounts", m))?;
    }
    let meta = &slice.metadata;
    let ns = meta.namespace.as_deref().unwrap_or_default();
    if ns != svc.namespace {
        return Err(map_err(
            "metadata.namespace",
            format!(
                "slice of namespace {:?}, not the Service's {:?}",
                bounded(ns),
                svc.namespace
            ),
        ));
    }
    let owner = meta
        .labels
        .as_ref()
        .and_then(|l| l.get(SERVICE_NAME_LABEL))
        .map(String::as_str)
        .unwrap_or_default();
    if owner != svc.name {
        return Err(map_err(
            format!("metadata.labels[{SERVICE_NAME_LABEL}]"),
            format!("slice of Service {:?}, not {:?}", bounded(owner), svc.name),
        ));
    }
    let v6 = match slice.address_type.as_str() {
        "IPv4" => false,
        "IPv6" => true,
        _ => return Ok((Vec::new(), Vec::new())),
    };
    if slice.endpoints.len() > MAX_SLICE_ENDPOINTS {
        return Err(map_err(
            "endpoints",
            format!(
                "{} endpoints, more than {MAX_SLICE_ENDPOINTS}",
                slice.endpoints.len()
            ),
        ));
    }
    let slice_ports = slice.ports.as_deref().unwrap_or_default();
    if slice_ports.len() > MAX_SLICE_PORTS {
        return Err(map_err(
            "ports",
            format!("{} ports, more than {MAX_SLICE_PORTS}", slice_ports.len()),
        ));
    }
    let identities: Vec<String> = if meshed_namespace {
        check_trust_domain(trust_domain).map_err(|m| map_err("trust domain", m))?;
        let prefix = format!("spiffe://{trust_domain}/ns/{}/sa/", svc.namespace);
        match &svc.service_accounts {
            // Never plaintext to a meshed Service: an empty list would leave the
            // endpoints without identity.
            Some(accounts) if accounts.is_empty() => {
                return Err(map_err("service accounts", "names no service account"));
            }
            Some(accounts) => accounts.iter().map(|a| format!("{prefix}{a}")).collect(),
            None => vec![format!("{prefix}*")],
        }
    } else {
        Vec::new()
    };

    let mut errors = Vec::new();
    // (service port, protocol, slice port)
    let mut ports: Vec<(u16, Protocol, u16)> = Vec::new();
    for (j, p) in slice_ports.iter().enumerate() {
        let Some(raw) = p.port else { continue };
        if !is_tcp(p.protocol.as_deref()) {
            continue;
        }
        let Some(number) = port_number(raw) else {
            errors.push(map_err(
                format!("ports[{j}].port"),
                format!("{raw} is not a port (1-65535)"),
            ));
            continue;
        };
        let name = p.name.as_deref().filter(|n| !n.is_empty());
        if let Some(sp) = svc.ports.iter().find(|sp| sp.name.as_deref() == name) {
            ports.push((sp.port, sp.protocol, number));
        }
    }

    let mut out = Vec::new();
    for (i, ep) in slice.endpoints.iter().enumerate() {
        let field = format!("endpoints[{i}]");
        let endpoint = (|| {
            if ep.addresses.len() > MAX_ENDPOINT_ADDRESSES {
                return Err(map_err(
                    format!("{field}.addresses"),
                    format!(
                        "{} addresses, more than {MAX_ENDPOINT_ADDRESSES}",
                        ep.addresses.len()
                    ),
                ));
            }
            let raw = ep
                .addresses
                .first()
                .ok_or_else(|| map_err(format!("{field}.addresses"), "no address"))?;
            let address: IpAddr = raw
                .parse()
                .ok()
                .filter(|ip: &IpAddr| ip.is_ipv6() == v6)
                .ok_or_else(|| {
                    map_err(
                        format!("{field}.addresses[0]"),
                        format!(
                            "{:?} is not an {} address",
                            bounded(raw),
                            slice.address_type
                        ),
                    )
                })?;
            check_ip(address).map_err(|m| map_err(format!("{field}.addresses[0]"), m))?;
            let node = ep.node_name.clone().unwrap_or_default();
            if !node.is_empty() {
                check_subdomain(&node).map_err(|m| map_err(format!("{field}.nodeName"), m))?;
            }
            let pod = match &ep.target_ref {
                Some(r) if r.kind.as_deref() == Some("Pod") => {
                    let pod_ns = r.namespace.as_deref().unwrap_or(ns);
                    let name = r.name.as_deref().unwrap_or_default();
                    check_label(pod_ns)
                        .map_err(|m| map_err(format!("{field}.targetRef.namespace"), m))?;
                    check_subdomain(name)
                        .map_err(|m| map_err(format!("{field}.targetRef.name"), m))?;
                    Some(format!("{pod_ns}/{name}"))
                }
                _ => None,
            };
            let labels = (!node.is_empty()).then(|| node_labels(&node)).flatten();
            let label =
                |key: &str| topology(labels.as_ref().and_then(|l| l.get(key)).map(String::as_str));
            let zone = topology(ep.zone.as_deref())
                .or_else(|| label(ZONE_LABEL))
                .unwrap_or_default();
            let region = label(REGION_LABEL).unwrap_or_default();
            Ok((address, node, pod, zone, region))
        })();
        let (address, node, pod, zone, region) = match endpoint {
            Ok(e) => e,
            Err(e) => {
                errors.push(e);
                continue;
            }
        };
        let health = endpoint_health(ep.conditions.as_ref());
        for &(service_port, protocol, port) in &ports {
            out.push(RemoteEndpoint {
                namespace: svc.namespace.clone(),
                service: svc.name.clone(),
                service_port,
                protocol,
                address,
                port,
                node: node.clone(),
                pod: pod.clone(),
                region: region.clone(),
                zone: zone.clone(),
                health,
                identity: identities.first().cloned(),
                identities: identities.clone(),
            });
        }
    }
    Ok((out, errors))
}

impl fmt::Display for MeshDecision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MeshDecision::Meshed => f.write_str("meshed"),
            MeshDecision::NotMeshed(why) => write!(f, "not meshed: {why}"),
        }
    }
}
