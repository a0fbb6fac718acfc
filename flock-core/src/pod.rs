//! A meshed pod: its key, its ports, and the one validator of its fields.
//!
//! A pod's fields travel far: the CNI plugin reads them, the agent stores them in a
//! file, registers one endpoint per port in a registry other nodes read, and
//! translates the pod and its service into Envoy resources whose names are built
//! from them (`inbound|<ns>/<pod>|<port>`, `outbound|<port>|<svc>.<ns>`). A pod the
//! translation would refuse must therefore be refused at ADD, with a message that
//! says why: accepted there, it would be stored and registered but never served.
//! So there is one set of limits, here, and every stage checks against it:
//!
//! * the CNI plugin, before it calls the agent ([`admit`]);
//! * the agent, when it turns a request into a record ([`admit`]);
//! * the pod store, when it loads a record written by an earlier (or tampered)
//!   agent ([`validate`]), so a record that parses but could not be served (no IP,
//!   a service name with a dot) is quarantined instead of reaching the publisher;
//! * the translation model, whose pod and service checks use the same name rules
//!   ([`check_label`], [`check_subdomain`], [`check_uid`], [`check_netns`],
//!   [`check_ip`], [`MAX_PORTS`]).
//!
//! The annotations that mesh a pod are [`SERVICE_ANNOTATION`] (its service),
//! [`PORTS_ANNOTATION`] (its application ports, [`parse_ports`]) and
//! [`SERVICE_ACCOUNT_ANNOTATION`] ([`admit`]); a meshed pod's capture annotations
//! (`flock.io/capture*`, [`crate::capture::policy`]) are parsed by [`admit`] too. In
//! the agent's kube mode none of them is read from the CNI request: the service
//! account and ports come from the Kubernetes API ([`admit_api`]), and so do the
//! capture annotations (the Pod's `metadata.annotations`); the record's service is
//! empty (membership comes from the Services that select the pod, recomputed live),
//! which [`validate`] accepts; an empty [`SERVICE_ANNOTATION`] is still refused by
//! [`admit`].

use crate::capture::policy::{PodOverrides, parse_annotations};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

/// The annotation that meshes a pod: the service it belongs to (a DNS label). Pods
/// without it are not meshed.
pub const SERVICE_ANNOTATION: &str = "flock.io/service";
/// The annotation listing a pod's application ports: `8080`, `8080/http,50051/grpc`,
/// `5432/tcp`, `50051/grpc-xds` (a proxyless gRPC xDS server: the app terminates mTLS
/// and enforces the port's policy itself). Default protocol `http`. Absent: the pod
/// only calls out.
pub const PORTS_ANNOTATION: &str = "flock.io/ports";
/// The annotation naming the pod's service account (a DNS subdomain), which is part
/// of its workload identity.
pub const SERVICE_ACCOUNT_ANNOTATION: &str = "flock.io/service-account";

/// The annotation listing the pod labels a route subset may select on, as
/// `key=value` pairs: `version=v2,track=canary` ([`crate::labels::parse`]: at most
/// 8). Outside kube mode the runtime passes annotations, not labels, so a pod names
/// here the labels it is registered with; kube mode reads the pod's labels from the
/// API instead.
pub const LABELS_ANNOTATION: &str = "flock.io/labels";

/// First port of Envoy's inbound listeners on the pod IP (one per app port, in order).
pub const INBOUND_BASE_PORT: u16 = 15006;
/// Envoy's outbound HTTP listener on the pod's loopback.
pub const OUTBOUND_PORT: u16 = 15001;

/// Longest container ID (the CNI spec sets none; runtimes use 64 hex digits).
pub const MAX_CONTAINER_ID_LEN: usize = 256;
/// Longest interface name (Linux `IFNAMSIZ` minus the NUL).
pub const MAX_IFNAME_LEN: usize = 15;
/// Longest namespace or service name (a DNS label).
pub const MAX_LABEL_LEN: usize = 63;
/// Longest pod name, service account or network name (a DNS subdomain).
pub const MAX_NAME_LEN: usize = 253;
/// Longest pod UID (Kubernetes UIDs are 36-character UUIDs).
pub const MAX_UID_LEN: usize = 128;
/// Longest network namespace path (Linux `PATH_MAX`).
pub const MAX_NETNS_LEN: usize = 4096;
/// Most IPs of one pod.
pub const MAX_IPS: usize = 16;
/// Most application ports of one pod (each gets an inbound listener), and most ports
/// of one service.
pub const MAX_PORTS: usize = 32;

/// Identifies one pod attachment: the CNI container (sandbox) ID plus the interface
/// name.
///
/// This is exactly the pair the runtime names in a CNI `GC`'s
/// `cni.dev/valid-attachments` and passes on every `ADD`/`DEL`, so the store key,
/// the GC input and the CNI request agree without any translation. Keying on the
/// Kubernetes pod name instead would confuse a re-created pod (same name, new
/// sandbox) with its predecessor.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct PodKey {
    /// The CNI container ID (the pod sandbox ID).
    pub container_id: String,
    /// The interface name inside the pod's network namespace (`CNI_IFNAME`).
    pub ifname: String,
}

impl PodKey {
    /// Builds a key from a container ID and an interface name.
    pub fn new(container_id: impl Into<String>, ifname: impl Into<String>) -> Self {
        Self {
            container_id: container_id.into(),
            ifname: ifname.into(),
        }
    }
}

impl fmt::Display for PodKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.container_id, self.ifname)
    }
}

/// How an application port speaks.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Protocol {
    /// HTTP/1.1 or HTTP/2 (`"http"`, the default): routed by Envoy's HTTP connection
    /// manager.
    #[default]
    Http,
    /// gRPC (`"grpc"`): HTTP/2 to the upstream; also served to proxyless gRPC clients.
    Grpc,
    /// Opaque TCP (`"tcp"`): proxied byte for byte; no outbound route.
    Tcp,
}

impl Protocol {
    /// Whether Envoy routes this protocol with the HTTP connection manager.
    pub fn is_http(self) -> bool {
        matches!(self, Protocol::Http | Protocol::Grpc)
    }
}

/// Health of a pod or endpoint: what the agent's liveness tracker decides, what the
/// registry records and what xDS tells clients.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum Health {
    /// Serving (`"healthy"`, the default).
    #[default]
    Healthy,
    /// Not serving (`"unhealthy"`); clients skip it.
    Unhealthy,
    /// Shutting down (`"draining"`); no new requests.
    Draining,
    /// Not decided yet (`"unknown"`); Envoy and gRPC treat it as usable.
    Unknown,
}

/// One application port of a pod and Envoy's inbound listener port for it.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PodPort {
    /// The port the app listens on inside the pod (also the service port).
    pub app_port: u16,
    /// Envoy's inbound listener on the pod IP (`INBOUND_BASE_PORT + index`).
    pub listen_port: u16,
    /// How the port speaks.
    pub protocol: Protocol,
    /// The app serves this gRPC port itself as a proxyless xDS server (its own mTLS
    /// and the port's RBAC, from the agent's xDS): callers dial `app_port`, Envoy has
    /// no listener for it and capture leaves it alone. `listen_port` stays reserved.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub proxyless: bool,
}

impl PodPort {
    /// The port callers dial: Envoy's inbound listener, or for a proxyless port the
    /// app's own.
    pub fn dialled_port(&self) -> u16 {
        if self.proxyless {
            self.app_port
        } else {
            self.listen_port
        }
    }
}

/// Why a pod was refused: the field and what is wrong with it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct InvalidPod {
    /// The field or annotation at fault (`pod name`, `flock.io/ports`, …).
    pub field: &'static str,
    /// What is wrong, quoting (a bounded prefix of) the value.
    pub message: String,
}

fn invalid(field: &'static str, message: impl Into<String>) -> InvalidPod {
    InvalidPod {
        field,
        message: message.into(),
    }
}

/// The fields of a meshed pod, borrowed from wherever they are held (a record, a
/// request): what [`validate`] checks.
#[derive(Debug, Clone, Copy)]
pub struct PodFields<'a> {
    /// The CNI attachment.
    pub key: &'a PodKey,
    /// Kubernetes pod name.
    pub name: &'a str,
    /// Kubernetes namespace.
    pub namespace: &'a str,
    /// Kubernetes pod UID (may be empty).
    pub uid: &'a str,
    /// The network namespace path.
    pub netns: &'a str,
    /// The pod's IPs; the first is the one the mesh uses.
    pub ips: &'a [IpAddr],
    /// The service (empty: no annotation membership, the kube mode's record).
    pub service: &'a str,
    /// The service account (may be empty).
    pub service_account: &'a str,
    /// The application ports.
    pub ports: &'a [PodPort],
    /// The CNI network name (may be empty).
    pub network_name: &'a str,
    /// Labels for route subsets ([`LABELS_ANNOTATION`]).
    pub labels: &'a crate::labels::Labels,
}

/// Checks every field of a pod against the one set of limits. A pod that passes is
/// served: its record is storable, its registry keys are well formed, and the
/// translation model accepts the pod and the service its endpoints form.
pub fn validate(p: &PodFields<'_>) -> Result<(), InvalidPod> {
    check_container_id(&p.key.container_id).map_err(|m| invalid("container id", m))?;
    check_ifname(&p.key.ifname).map_err(|m| invalid("interface name", m))?;
    check_subdomain(p.name).map_err(|m| invalid("pod name", m))?;
    check_label(p.namespace).map_err(|m| invalid("pod namespace", m))?;
    check_uid(p.uid).map_err(|m| invalid("pod uid", m))?;
    check_netns(p.netns).map_err(|m| invalid("netns", m))?;
    crate::labels::check(p.labels).map_err(|m| invalid(LABELS_ANNOTATION, m))?;
    if p.ips.is_empty() {
        return Err(invalid(
            "IPs",
            "the pod has no IP (is flock-cni chained after the primary CNI plugin?)",
        ));
    }
    if p.ips.len() > MAX_IPS {
        return Err(invalid(
            "IPs",
            format!("{} IPs, more than {MAX_IPS}", p.ips.len()),
        ));
    }
    for ip in p.ips {
        check_ip(*ip).map_err(|m| invalid("IPs", m))?;
    }
    // Empty: no annotation membership. In kube mode the Services that select the pod
    // define its memberships, live, so the record names none.
    if !p.service.is_empty() {
        check_label(p.service).map_err(|m| invalid(SERVICE_ANNOTATION, m))?;
    }
    if !p.service_account.is_empty() {
        check_subdomain(p.service_account).map_err(|m| invalid(SERVICE_ACCOUNT_ANNOTATION, m))?;
    }
    check_ports(p.ports).map_err(|m| invalid(PORTS_ANNOTATION, m))?;
    if p.network_name.len() > MAX_NAME_LEN || p.network_name.chars().any(char::is_control) {
        return Err(invalid(
            "network name",
            format!("must be at most {MAX_NAME_LEN} bytes without control characters"),
        ));
    }
    Ok(())
}

/// What an AddPod request carries, as the CNI plugin and the agent both see it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AddRequest {
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_NETNS`.
    pub netns: String,
    /// `K8S_POD_NAME`.
    pub name: String,
    /// `K8S_POD_NAMESPACE`.
    pub namespace: String,
    /// `K8S_POD_UID`.
    pub uid: String,
    /// The primary CNI's IPs, CIDR (`10.0.0.5/24`) or plain.
    pub ips: Vec<String>,
    /// The gateways of those IPs in the CNI result (empty strings where none): the
    /// node's address on the pod network, the default probe sources of a captured pod
    /// ([`crate::capture::policy::resolve`]). Not validated here: only capture reads
    /// them.
    pub gateways: Vec<String>,
    /// Pod annotations.
    pub annotations: BTreeMap<String, String>,
    /// The CNI network name.
    pub network_name: String,
}

/// A pod [`admit`] accepted: every field parsed and [validated](validate).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdmittedPod {
    /// The CNI attachment.
    pub key: PodKey,
    /// Kubernetes pod name.
    pub name: String,
    /// Kubernetes namespace.
    pub namespace: String,
    /// Kubernetes pod UID (may be empty).
    pub uid: String,
    /// The network namespace path.
    pub netns: String,
    /// The pod's IPs, without prefix lengths.
    pub ips: Vec<IpAddr>,
    /// The service ([`SERVICE_ANNOTATION`]; empty from [`admit_api`]).
    pub service: String,
    /// The service account ([`SERVICE_ACCOUNT_ANNOTATION`], may be empty; from the
    /// pod's `spec.serviceAccountName` with [`admit_api`]).
    pub service_account: String,
    /// The application ports ([`PORTS_ANNOTATION`]; the containers' ports with
    /// [`admit_api`]).
    pub ports: Vec<PodPort>,
    /// The CNI network name.
    pub network_name: String,
    /// What the pod's capture annotations say
    /// ([`crate::capture::policy::parse_annotations`]; from [`admit_api`] none: the
    /// caller sets what the Kubernetes API's annotations say).
    pub capture: PodOverrides,
    /// The pod's own authorization policy, as written in its
    /// [`crate::authz::ANNOTATION`] (within [`crate::authz::check_annotation_size`]); it is
    /// parsed where it is enforced, and a policy that does not parse refuses the
    /// pod's inbound calls rather than the pod.
    pub authz: Option<String>,
    /// The labels of its [`LABELS_ANNOTATION`] (none from [`admit_api`]: kube mode
    /// reads the pod's labels live).
    pub labels: crate::labels::Labels,
}

impl AdmittedPod {
    /// The fields, for [`validate`].
    pub fn fields(&self) -> PodFields<'_> {
        PodFields {
            key: &self.key,
            name: &self.name,
            namespace: &self.namespace,
            uid: &self.uid,
            netns: &self.netns,
            ips: &self.ips,
            service: &self.service,
            service_account: &self.service_account,
            ports: &self.ports,
            network_name: &self.network_name,
            labels: &self.labels,
        }
    }
}

/// Decides an AddPod request: `Ok(None)` when the pod is not meshed (no
/// [`SERVICE_ANNOTATION`]), the parsed pod when every field is valid, else the first
/// problem.
pub fn admit(req: &AddRequest) -> Result<Option<AdmittedPod>, InvalidPod> {
    let Some(service) = req.annotations.get(SERVICE_ANNOTATION) else {
        return Ok(None);
    };
    // The validator accepts an empty service (a record without annotation membership,
    // kube mode's), so the annotation's own rule is checked here: an annotation that
    // is present must name a service.
    if service.is_empty() {
        return Err(invalid(
            SERVICE_ANNOTATION,
            "the annotation is empty: it must name the pod's service (a DNS label), or be \
             left out (the pod is then not meshed)",
        ));
    }
    let ips = parse_ips(&req.ips)?;
    let ports = parse_ports(
        req.annotations
            .get(PORTS_ANNOTATION)
            .map(String::as_str)
            .unwrap_or(""),
    )?;
    let capture =
        parse_annotations(&req.annotations).map_err(|e| invalid(e.annotation, e.message))?;
    let authz = req.annotations.get(crate::authz::ANNOTATION).cloned();
    if let Some(a) = &authz {
        crate::authz::check_annotation_size(a).map_err(|e| invalid(crate::authz::ANNOTATION, e))?;
    }
    let labels = match req.annotations.get(LABELS_ANNOTATION) {
        None => crate::labels::Labels::new(),
        Some(text) => crate::labels::parse(text).map_err(|e| invalid(LABELS_ANNOTATION, e))?,
    };
    let pod = AdmittedPod {
        key: PodKey::new(&req.container_id, &req.ifname),
        name: req.name.clone(),
        namespace: req.namespace.clone(),
        uid: req.uid.clone(),
        netns: req.netns.clone(),
        ips,
        service: service.clone(),
        service_account: req
            .annotations
            .get(SERVICE_ACCOUNT_ANNOTATION)
            .cloned()
            .unwrap_or_default(),
        ports,
        network_name: req.network_name.clone(),
        capture,
        authz,
        labels,
    };
    validate(&pod.fields())?;
    Ok(Some(pod))
}

/// Decides an AddPod request whose identity and ports come from the Kubernetes API
/// (the agent's kube mode), not from annotations: the CNI facts (container ID,
/// interface, netns, IPs, network name, and the pod's namespace, name and UID the
/// runtime passed) from `req`, `service_account` (the pod's
/// `spec.serviceAccountName`) and `ports` (its containers' ports) from the API. The
/// record names no service: the Services that select the pod define its memberships.
/// Annotations are not read. Validated by the same [`validate`] as [`admit`].
pub fn admit_api(
    req: &AddRequest,
    service_account: String,
    ports: Vec<PodPort>,
) -> Result<AdmittedPod, InvalidPod> {
    let pod = AdmittedPod {
        key: PodKey::new(&req.container_id, &req.ifname),
        name: req.name.clone(),
        namespace: req.namespace.clone(),
        uid: req.uid.clone(),
        netns: req.netns.clone(),
        ips: parse_ips(&req.ips)?,
        service: String::new(),
        service_account,
        ports,
        network_name: req.network_name.clone(),
        capture: PodOverrides::default(),
        authz: None,
        labels: crate::labels::Labels::new(),
    };
    // The same rules, but the message names where these values came from: an
    // operator reading "flock.io/ports" would look for an annotation the pod lacks.
    validate(&pod.fields()).map_err(|e| InvalidPod {
        field: match e.field {
            PORTS_ANNOTATION => "container ports",
            SERVICE_ACCOUNT_ANNOTATION => "spec.serviceAccountName",
            other => other,
        },
        message: e.message,
    })?;
    Ok(pod)
}

/// The primary CNI's IPs (CIDR or plain) without their prefix lengths.
fn parse_ips(raw: &[String]) -> Result<Vec<IpAddr>, InvalidPod> {
    if raw.len() > MAX_IPS {
        return Err(invalid(
            "IPs",
            format!("{} IPs, more than {MAX_IPS}", raw.len()),
        ));
    }
    let mut ips = Vec::with_capacity(raw.len());
    for ip in raw {
        let addr = ip.split_once('/').map_or(ip.as_str(), |(a, _)| a);
        let parsed: IpAddr = addr.parse().map_err(|_| {
            invalid(
                "IPs",
                format!(
                    "{:?} from the primary CNI is not an IP address",
                    bounded(ip)
                ),
            )
        })?;
        ips.push(parsed);
    }
    Ok(ips)
}

/// Parses [`PORTS_ANNOTATION`]: `8080`, `8080/http,50051/grpc`, `5432/tcp`,
/// `50051/grpc-xds`. The
/// `i`-th port gets the inbound listener `INBOUND_BASE_PORT + i`.
pub fn parse_ports(spec: &str) -> Result<Vec<PodPort>, InvalidPod> {
    let err = |m: String| invalid(PORTS_ANNOTATION, m);
    let parts: Vec<&str> = spec
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .collect();
    if parts.len() > MAX_PORTS {
        return Err(err(format!("{} ports, more than {MAX_PORTS}", parts.len())));
    }
    let mut ports = Vec::with_capacity(parts.len());
    for (i, part) in parts.into_iter().enumerate() {
        let (port, proto) = part.split_once('/').unwrap_or((part, "http"));
        let app_port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| err(format!("{:?} is not a port (1-65535)", bounded(port))))?;
        let (protocol, proxyless) = match proto {
            "http" => (Protocol::Http, false),
            "grpc" => (Protocol::Grpc, false),
            // The app is a proxyless gRPC xDS server on this port.
            "grpc-xds" => (Protocol::Grpc, true),
            "tcp" => (Protocol::Tcp, false),
            other => {
                return Err(err(format!(
                    "protocol {:?} of port {app_port} is not http, grpc, grpc-xds or tcp",
                    bounded(other)
                )));
            }
        };
        ports.push(PodPort {
            app_port,
            // In range: i < MAX_PORTS.
            listen_port: INBOUND_BASE_PORT + i as u16,
            protocol,
            proxyless,
        });
    }
    check_ports(&ports).map_err(err)?;
    Ok(ports)
}

/// A pod's port list: at most [`MAX_PORTS`], app ports nonzero and distinct, the
/// `i`-th listener on `INBOUND_BASE_PORT + i`, and no app port on one of Envoy's
/// ports in the pod (the outbound listener, an inbound listener).
pub fn check_ports(ports: &[PodPort]) -> Result<(), String> {
    if ports.len() > MAX_PORTS {
        return Err(format!("{} ports, more than {MAX_PORTS}", ports.len()));
    }
    let mut seen = BTreeSet::new();
    for (i, p) in ports.iter().enumerate() {
        if p.app_port == 0 {
            return Err("port 0 is not a port (1-65535)".into());
        }
        if !seen.insert(p.app_port) {
            return Err(format!("port {} is listed twice", p.app_port));
        }
        if p.proxyless && p.protocol != Protocol::Grpc {
            return Err(format!(
                "port {} is a proxyless xDS server but not gRPC",
                p.app_port
            ));
        }
        if usize::from(p.listen_port) != usize::from(INBOUND_BASE_PORT) + i {
            return Err(format!(
                "port {} has inbound listener {}, not {}",
                p.app_port,
                p.listen_port,
                usize::from(INBOUND_BASE_PORT) + i
            ));
        }
    }
    if let Some(p) = ports
        .iter()
        .find(|p| p.app_port == OUTBOUND_PORT || ports.iter().any(|q| q.listen_port == p.app_port))
    {
        return Err(format!(
            "port {} collides with Envoy's ports in the pod ({OUTBOUND_PORT}, {INBOUND_BASE_PORT}+)",
            p.app_port
        ));
    }
    Ok(())
}

/// A DNS label (namespaces, service names): `[a-z0-9]([-a-z0-9]*[a-z0-9])?`, at most
/// [`MAX_LABEL_LEN`]. Resource and host names join services and namespaces with `.`
/// and `|`, so neither may contain them.
pub fn check_label(s: &str) -> Result<(), String> {
    check_dns(s, MAX_LABEL_LEN, false).map_err(|why| {
        format!(
            "{:?} {why} (a DNS label: a-z 0-9 -, at most {MAX_LABEL_LEN})",
            bounded(s)
        )
    })
}

/// A DNS subdomain (pod names, service accounts): DNS labels joined by `.`, at most
/// [`MAX_NAME_LEN`].
pub fn check_subdomain(s: &str) -> Result<(), String> {
    check_dns(s, MAX_NAME_LEN, true).map_err(|why| {
        format!(
            "{:?} {why} (a DNS subdomain: a-z 0-9 - ., at most {MAX_NAME_LEN})",
            bounded(s)
        )
    })
}

/// A node name (`--node-name`, `$FLOCK_NODE_NAME`): a DNS-1123 subdomain, as
/// Kubernetes names nodes (lowercase letters, digits, `-` and `.`, each label starting
/// and ending with a letter or digit, at most [`MAX_NAME_LEN`]). The node name owns this
/// agent's registry endpoints and its GC scope, so two nodes must never share one: there
/// is no fallback (a default such as `node` made every unnamed agent collect the others'
/// endpoints as orphans). The error says what is wrong and how to set it.
pub fn check_node_name(s: &str) -> Result<(), String> {
    check_dns(s, MAX_NAME_LEN, true).map_err(|why| {
        format!(
            "node name {:?} {why}: it must be a DNS-1123 subdomain (a-z 0-9 - ., each \
             label starting and ending with a letter or digit, at most {MAX_NAME_LEN}); \
             set it with --node-name or $FLOCK_NODE_NAME (in Kubernetes: the downward \
             API's spec.nodeName)",
            bounded(s)
        )
    })
}

fn check_dns(s: &str, max: usize, dots: bool) -> Result<(), String> {
    if s.is_empty() {
        return Err("is empty".into());
    }
    if s.len() > max {
        return Err(format!("is {} characters long", s.len()));
    }
    if let Some(c) = s.chars().find(|&c| {
        !(c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || (dots && c == '.'))
    }) {
        return Err(format!("contains {c:?}"));
    }
    let alnum = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    let ok = if dots {
        s.split('.')
            .all(|part| alnum(part.chars().next()) && alnum(part.chars().last()))
    } else {
        alnum(s.chars().next()) && alnum(s.chars().last())
    };
    if !ok {
        return Err("must start and end (each label) with a letter or digit".into());
    }
    Ok(())
}

/// A pod UID: at most [`MAX_UID_LEN`] bytes without control characters (may be
/// empty: the runtime may not pass one).
pub fn check_uid(uid: &str) -> Result<(), String> {
    if uid.len() > MAX_UID_LEN || uid.chars().any(char::is_control) {
        return Err(format!(
            "must be at most {MAX_UID_LEN} bytes without control characters"
        ));
    }
    Ok(())
}

/// A network namespace path: absolute, at most [`MAX_NETNS_LEN`] bytes, no control
/// characters, no `..` component (Envoy opens it).
pub fn check_netns(netns: &str) -> Result<(), String> {
    if !netns.starts_with('/') {
        return Err(format!(
            "must be an absolute path, not {:?}",
            bounded(netns)
        ));
    }
    if netns.len() > MAX_NETNS_LEN || netns.chars().any(char::is_control) {
        return Err(format!(
            "must be at most {MAX_NETNS_LEN} bytes without control characters"
        ));
    }
    if netns.split('/').any(|c| c == "..") {
        return Err("must not contain `..`".into());
    }
    Ok(())
}

/// A network namespace as the kernel names it: the device and inode of its nsfs file
/// (what `stat` of `/proc/PID/ns/net` or a bind mount under `/var/run/netns` returns).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NetnsId {
    /// `st_dev` of the namespace file.
    pub dev: u64,
    /// `st_ino` of the namespace file.
    pub ino: u64,
}

/// Refuses an ADD whose network namespace `pod` is the node's own: the host's (`host`,
/// the namespace of pid 1) or the agent's (`agent`). Either is the namespace every host
/// process and every hostNetwork pod shares: meshing a "pod" there would install a
/// capture table over the node's own traffic and bind Envoy's pod listeners in the
/// host stack, so a forged or mistaken ADD could redirect or cut the node. `None` for
/// `host` or `agent` means it could not be read (an agent that is not root cannot stat
/// pid 1's namespace); only what was read is compared.
pub fn check_netns_not_the_nodes(
    pod: NetnsId,
    host: Option<NetnsId>,
    agent: Option<NetnsId>,
) -> Result<(), String> {
    if host == Some(pod) {
        return Err(
            "is the host's network namespace (pid 1's): a pod is never meshed in the node's \
             own network stack"
                .into(),
        );
    }
    if agent == Some(pod) {
        return Err(
            "is the agent's own network namespace: a pod is never meshed in the node's own \
             network stack"
                .into(),
        );
    }
    Ok(())
}

/// A pod or endpoint address: unicast (not unspecified, not multicast), judged on its
/// canonical form ([`canonical_ip`]).
pub fn check_ip(ip: IpAddr) -> Result<(), String> {
    let c = canonical_ip(ip);
    if c.is_unspecified() || c.is_multicast() {
        return Err(format!("{ip} is not a unicast address"));
    }
    Ok(())
}

/// The address every address check looks at: an IPv4-mapped IPv6 address
/// (`::ffff:a.b.c.d`) as the IPv4 address it reaches ([`IpAddr::to_canonical`]).
/// `Ipv6Addr::is_loopback` and the others are false for `::ffff:127.0.0.1`, yet a
/// dual-stack socket connecting there reaches 127.0.0.1: checked as written, a
/// mapped address slips past every rule about loopback, unspecified or multicast
/// addresses.
pub fn canonical_ip(ip: IpAddr) -> IpAddr {
    // The mutant judges the address as written, as the checks did before.
    if crate::reintroduced!("noncanonical-address") {
        return ip;
    }
    ip.to_canonical()
}

/// The CNI container ID rule (libcni's): 1 to [`MAX_CONTAINER_ID_LEN`] bytes, starting
/// with a letter or digit, then letters, digits, `_`, `.`, `-`.
pub fn check_container_id(id: &str) -> Result<(), String> {
    let ok = id.len() <= MAX_CONTAINER_ID_LEN
        && id.bytes().next().is_some_and(|b| b.is_ascii_alphanumeric())
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{:?} must be 1 to {MAX_CONTAINER_ID_LEN} bytes, start with a letter or digit \
             and hold only letters, digits, '_', '.' and '-'",
            bounded(id)
        ))
    }
}

/// The CNI interface name rule (libcni's): 1 to [`MAX_IFNAME_LEN`] bytes, not `.` or
/// `..`, no `/`, `:`, whitespace or control characters.
pub fn check_ifname(name: &str) -> Result<(), String> {
    let why = if name.is_empty() {
        Some("is empty")
    } else if name.len() > MAX_IFNAME_LEN {
        Some("is longer than 15 bytes")
    } else if name == "." || name == ".." {
        Some("'.' and '..' are not interface names")
    } else if name
        .chars()
        .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control())
    {
        Some("contains '/', ':', whitespace or a control character")
    } else {
        None
    };
    match why {
        None => Ok(()),
        Some(why) => Err(format!("{:?} {why}", bounded(name))),
    }
}

/// At most 64 characters of `s`, for quoting outside input in a message.
fn bounded(s: &str) -> String {
    s.chars().take(64).collect()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn request() -> AddRequest {
        AddRequest {
            container_id: "c1".into(),
            ifname: "eth0".into(),
            netns: "/var/run/netns/c1".into(),
            name: "web-0".into(),
            namespace: "default".into(),
            uid: "6f1c0b6e-0000-4000-8000-000000000001".into(),
            ips: vec!["10.0.0.5/24".into(), "fd00::5".into()],
            gateways: vec!["10.0.0.1".into(), String::new()],
            annotations: [
                (SERVICE_ANNOTATION.to_string(), "web".to_string()),
                (PORTS_ANNOTATION.to_string(), "8080,9090/grpc".to_string()),
            ]
            .into_iter()
            .collect(),
            network_name: "k8s-pod-network".into(),
        }
    }

    fn refused(edit: impl FnOnce(&mut AddRequest)) -> InvalidPod {
        let mut r = request();
        edit(&mut r);
        admit(&r).expect_err("must be refused")
    }

    #[test]
    fn a_well_formed_request_is_admitted_with_its_listener_ports() {
        let pod = admit(&request()).unwrap().unwrap();
        assert_eq!(pod.ips.len(), 2);
        assert_eq!(
            pod.ports,
            vec![
                PodPort {
                    app_port: 8080,
                    listen_port: INBOUND_BASE_PORT,
                    protocol: Protocol::Http,
                    proxyless: false,
                },
                PodPort {
                    app_port: 9090,
                    listen_port: INBOUND_BASE_PORT + 1,
                    protocol: Protocol::Grpc,
                    proxyless: false,
                },
            ]
        );
    }

    #[test]
    fn a_pod_without_the_service_annotation_is_not_meshed() {
        let mut r = request();
        r.annotations.remove(SERVICE_ANNOTATION);
        r.name = "NOT VALID".into();
        assert_eq!(admit(&r), Ok(None));
    }

    #[test]
    fn a_service_name_the_translation_cannot_use_is_refused() {
        // A dot would make `<svc>.<ns>` ambiguous in resource and host names.
        let e = refused(|r| {
            r.annotations
                .insert(SERVICE_ANNOTATION.into(), "web.v2".into());
        });
        assert_eq!(e.field, SERVICE_ANNOTATION);
        assert!(e.message.contains("'.'"), "{e}");
        refused(|r| {
            r.annotations
                .insert(SERVICE_ANNOTATION.into(), "-web".into());
        });
        refused(|r| {
            r.annotations
                .insert(SERVICE_ANNOTATION.into(), "a".repeat(MAX_LABEL_LEN + 1));
        });
    }

    #[test]
    fn each_field_has_one_limit() {
        assert_eq!(
            refused(|r| r.uid = "u".repeat(MAX_UID_LEN + 1)).field,
            "pod uid"
        );
        let mut r = request();
        r.uid = "u".repeat(MAX_UID_LEN);
        assert!(admit(&r).is_ok());
        assert_eq!(refused(|r| r.name = "Web".into()).field, "pod name");
        assert_eq!(
            refused(|r| r.namespace = "a.b".into()).field,
            "pod namespace"
        );
        assert_eq!(refused(|r| r.netns = "run/netns/x".into()).field, "netns");
        assert_eq!(refused(|r| r.netns = "/run/../x".into()).field, "netns");
        assert_eq!(
            refused(|r| r.ifname = "a".repeat(16)).field,
            "interface name"
        );
        assert_eq!(
            refused(|r| r.container_id = "-c".into()).field,
            "container id"
        );
        let spec = (1..=MAX_PORTS as u16 + 1)
            .map(|p| p.to_string())
            .collect::<Vec<_>>()
            .join(",");
        assert_eq!(
            refused(|r| {
                r.annotations.insert(PORTS_ANNOTATION.into(), spec);
            })
            .field,
            PORTS_ANNOTATION
        );
    }

    #[test]
    fn ips_must_be_present_parsable_and_unicast() {
        assert_eq!(refused(|r| r.ips.clear()).field, "IPs");
        assert_eq!(refused(|r| r.ips = vec!["nope".into()]).field, "IPs");
        assert_eq!(refused(|r| r.ips = vec!["0.0.0.0".into()]).field, "IPs");
        assert_eq!(refused(|r| r.ips = vec!["224.0.0.1".into()]).field, "IPs");
        assert_eq!(
            refused(|r| r.ips = vec!["10.0.0.1".into(); MAX_IPS + 1]).field,
            "IPs"
        );
    }

    #[test]
    fn an_empty_service_annotation_is_refused_but_an_empty_record_service_is_valid() {
        let e = refused(|r| {
            r.annotations
                .insert(SERVICE_ANNOTATION.into(), String::new());
        });
        assert_eq!(e.field, SERVICE_ANNOTATION);
        assert!(e.message.contains("empty"), "{e}");
        // The record kube mode stores: no annotation membership.
        let pod = admit_api(&request(), "web".into(), Vec::new()).unwrap();
        assert_eq!(pod.service, "");
        assert_eq!(validate(&pod.fields()), Ok(()));
    }

    #[test]
    fn admit_api_takes_identity_and_ports_from_its_arguments_not_annotations() {
        let mut r = request();
        r.annotations
            .insert(SERVICE_ACCOUNT_ANNOTATION.into(), "admin".into());
        let ports = parse_ports("9000/tcp").unwrap();
        let pod = admit_api(&r, "web-sa".into(), ports.clone()).unwrap();
        assert_eq!(pod.service_account, "web-sa");
        assert_eq!(pod.ports, ports);
        assert_eq!(pod.service, "");
        // The CNI facts come from the request, as with `admit`.
        assert_eq!(pod.key, PodKey::new("c1", "eth0"));
        assert_eq!(
            pod.ips,
            vec![
                "10.0.0.5".parse::<IpAddr>().unwrap(),
                "fd00::5".parse::<IpAddr>().unwrap()
            ]
        );
        assert_eq!(
            (
                pod.name.as_str(),
                pod.namespace.as_str(),
                pod.netns.as_str()
            ),
            ("web-0", "default", "/var/run/netns/c1")
        );
        assert_eq!(pod.uid, r.uid);
        assert_eq!(pod.network_name, "k8s-pod-network");
    }

    #[test]
    fn admit_api_validates_with_the_same_rules_and_names_the_api_field() {
        let e = admit_api(&request(), "Not_A_Name".into(), Vec::new()).unwrap_err();
        assert_eq!(e.field, "spec.serviceAccountName");
        let colliding = vec![PodPort {
            app_port: OUTBOUND_PORT,
            listen_port: INBOUND_BASE_PORT,
            protocol: Protocol::Tcp,
            proxyless: false,
        }];
        let e = admit_api(&request(), "web".into(), colliding).unwrap_err();
        assert_eq!(e.field, "container ports");
        let mut r = request();
        r.ips = vec!["nope".into()];
        assert_eq!(
            admit_api(&r, "web".into(), Vec::new()).unwrap_err().field,
            "IPs"
        );
        let mut r = request();
        r.netns = "relative".into();
        assert_eq!(
            admit_api(&r, "web".into(), Vec::new()).unwrap_err().field,
            "netns"
        );
        // An empty service account is allowed, as with `admit` (the identity layer
        // runs such a pod as `default`).
        assert!(admit_api(&request(), String::new(), Vec::new()).is_ok());
    }

    #[test]
    fn capture_annotations_are_parsed_for_a_meshed_pod_and_refused_precisely() {
        use crate::capture::policy::{
            CAPTURE_ANNOTATION, EXCLUDE_OUTBOUND_CIDRS_ANNOTATION, Setting,
        };
        let mut r = request();
        r.annotations
            .insert(CAPTURE_ANNOTATION.into(), "permissive".into());
        r.annotations.insert(
            EXCLUDE_OUTBOUND_CIDRS_ANNOTATION.into(),
            "10.96.0.0/12".into(),
        );
        let pod = admit(&r).unwrap().unwrap();
        assert_eq!(pod.capture.setting, Some(Setting::Permissive));
        assert_eq!(
            pod.capture.exclude_outbound_cidrs,
            vec!["10.96.0.0/12".parse().unwrap()]
        );
        assert_eq!(
            admit(&request()).unwrap().unwrap().capture,
            PodOverrides::default()
        );
        let e = refused(|r| {
            r.annotations
                .insert(CAPTURE_ANNOTATION.into(), "yes".into());
        });
        assert_eq!(e.field, CAPTURE_ANNOTATION);
        assert!(
            e.to_string()
                .starts_with("flock.io/capture: \"yes\" is not a capture mode"),
            "{e}"
        );
        // A pod that is not meshed is not judged on its capture annotations either.
        let mut r = request();
        r.annotations.remove(SERVICE_ANNOTATION);
        r.annotations
            .insert(CAPTURE_ANNOTATION.into(), "yes".into());
        assert_eq!(admit(&r), Ok(None));
        // admit_api leaves them to its caller (the API's annotations, not the CNI's).
        let mut r = request();
        r.annotations
            .insert(CAPTURE_ANNOTATION.into(), "yes".into());
        assert_eq!(
            admit_api(&r, "web".into(), Vec::new()).unwrap().capture,
            PodOverrides::default()
        );
    }

    #[test]
    fn ports_may_not_collide_with_envoys() {
        for spec in ["15001", "15006", "8080,8080", "0", "8080/udp", "x"] {
            assert!(parse_ports(spec).is_err(), "{spec}");
        }
        assert_eq!(parse_ports("").unwrap(), vec![]);
        // A stored list whose listener ports do not follow the rule is refused too.
        let mut ports = parse_ports("80,81").unwrap();
        ports.swap(0, 1);
        assert!(check_ports(&ports).is_err());
    }

    #[test]
    fn a_grpc_xds_port_is_proxyless_and_dialled_on_its_app_port() {
        let ports = parse_ports("8080,50051/grpc-xds").unwrap();
        assert!(!ports[0].proxyless);
        assert_eq!(ports[0].dialled_port(), INBOUND_BASE_PORT);
        assert!(ports[1].proxyless);
        assert_eq!(ports[1].protocol, Protocol::Grpc);
        // Its listener stays reserved (the i-th port's); callers dial the app.
        assert_eq!(ports[1].listen_port, INBOUND_BASE_PORT + 1);
        assert_eq!(ports[1].dialled_port(), 50051);
        // A stored proxyless port that is not gRPC is refused.
        let mut bad = ports.clone();
        bad[1].protocol = Protocol::Tcp;
        let e = check_ports(&bad).unwrap_err();
        assert!(e.contains("proxyless") && e.contains("50051"), "{e}");
        // An older record (no field) reads as Envoy-served; a served port writes none.
        let old: PodPort =
            serde_json::from_str(r#"{"app_port": 80, "listen_port": 15006, "protocol": "http"}"#)
                .unwrap();
        assert!(!old.proxyless);
        assert!(!serde_json::to_string(&old).unwrap().contains("proxyless"));
    }

    #[test]
    fn the_hosts_and_the_agents_network_namespaces_are_refused_and_others_pass() {
        let ns = |ino| NetnsId { dev: 4, ino };
        let host = Some(ns(1));
        let agent = Some(ns(2));
        let host_err = check_netns_not_the_nodes(ns(1), host, agent).unwrap_err();
        assert!(
            host_err.starts_with("is the host's network namespace"),
            "{host_err}"
        );
        let agent_err = check_netns_not_the_nodes(ns(2), host, agent).unwrap_err();
        assert!(agent_err.starts_with("is the agent's own"), "{agent_err}");
        assert_eq!(check_netns_not_the_nodes(ns(3), host, agent), Ok(()));
        // Same inode on another device is another namespace.
        let other_dev = NetnsId { dev: 5, ino: 1 };
        assert_eq!(check_netns_not_the_nodes(other_dev, host, agent), Ok(()));
        // What could not be read is not compared.
        assert_eq!(check_netns_not_the_nodes(ns(1), None, None), Ok(()));
    }
}
