//! An AddPod request: the CNI fields and annotations, checked into a pod record.

use super::{Agent, PodError};
use crate::model::{
    INBOUND_BASE_PORT, OUTBOUND_PORT, PORTS_ANNOTATION, PodPort, PodRecord, Protocol,
    SERVICE_ANNOTATION,
};
use flock_core::gc::PodKey;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

/// Parses [`PORTS_ANNOTATION`]: `8080`, `8080/http,50051/grpc`, `5432/tcp`.
pub fn parse_ports(spec: &str) -> Result<Vec<PodPort>, String> {
    let mut ports = Vec::new();
    let mut seen = BTreeSet::new();
    for (i, part) in spec
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .enumerate()
    {
        if i >= 32 {
            return Err(format!("{PORTS_ANNOTATION}: more than 32 ports"));
        }
        let (port, proto) = part.split_once('/').unwrap_or((part, "http"));
        let app_port: u16 = port
            .parse()
            .ok()
            .filter(|p| *p > 0)
            .ok_or_else(|| format!("{PORTS_ANNOTATION}: {port:?} is not a port (1-65535)"))?;
        let protocol = match proto {
            "http" => Protocol::Http,
            "grpc" => Protocol::Grpc,
            "tcp" => Protocol::Tcp,
            other => {
                return Err(format!(
                    "{PORTS_ANNOTATION}: protocol {other:?} of port {app_port} is not http, grpc or tcp"
                ));
            }
        };
        if !seen.insert(app_port) {
            return Err(format!(
                "{PORTS_ANNOTATION}: port {app_port} is listed twice"
            ));
        }
        let listen_port = INBOUND_BASE_PORT + i as u16;
        if seen.contains(&listen_port) || app_port == OUTBOUND_PORT {
            return Err(format!(
                "{PORTS_ANNOTATION}: port {app_port} collides with Envoy's ports ({OUTBOUND_PORT}, {INBOUND_BASE_PORT}+)"
            ));
        }
        ports.push(PodPort {
            app_port,
            listen_port,
            protocol,
        });
    }
    if let Some(p) = ports
        .iter()
        .find(|p| ports.iter().any(|q| q.listen_port == p.app_port))
    {
        return Err(format!(
            "{PORTS_ANNOTATION}: app port {} collides with an inbound listener port",
            p.app_port
        ));
    }
    Ok(ports)
}

/// A DNS-label-like name check for the parts of registry keys and resource names.
fn check_name(what: &str, value: &str, max: usize) -> Result<(), String> {
    if value.is_empty() {
        return Err(format!("{what} is empty"));
    }
    if value.len() > max {
        return Err(format!(
            "{what} is {} bytes long, more than {max}",
            value.len()
        ));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
        || value.starts_with(['-', '.'])
    {
        return Err(format!(
            "{what} {value:?} must be lowercase letters, digits, '-' and '.' (a Kubernetes name)"
        ));
    }
    Ok(())
}

fn check_id(what: &str, value: &str, max: usize) -> Result<(), String> {
    if value.is_empty() || value.len() > max {
        return Err(format!("{what} must be 1 to {max} bytes"));
    }
    if !value
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
    {
        return Err(format!(
            "{what} {:?} may only hold letters, digits, '-', '_' and '.'",
            value.chars().take(64).collect::<String>()
        ));
    }
    Ok(())
}

/// What AddPod needs from the CNI request, decoupled from the proto.
#[derive(Debug, Clone, Default)]
pub struct AddPodInput {
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
    /// The primary CNI's IPs, CIDR or plain.
    pub ips: Vec<String>,
    /// Pod annotations.
    pub annotations: BTreeMap<String, String>,
    /// The CNI network name.
    pub network_name: String,
}

impl Agent {
    /// Validates an AddPod request into a record (no I/O).
    pub fn record_for(&self, input: &AddPodInput) -> Result<Option<PodRecord>, PodError> {
        let invalid = PodError::Invalid;
        let Some(service) = input.annotations.get(SERVICE_ANNOTATION) else {
            return Ok(None);
        };
        check_id("container id", &input.container_id, 256).map_err(invalid)?;
        check_id("interface name", &input.ifname, 64).map_err(invalid)?;
        check_name("pod name", &input.name, 253).map_err(invalid)?;
        check_name("pod namespace", &input.namespace, 63).map_err(invalid)?;
        check_name(SERVICE_ANNOTATION, service, 63).map_err(invalid)?;
        if input.netns.is_empty() || input.netns.len() > 4096 || !input.netns.starts_with('/') {
            return Err(invalid("netns must be an absolute path".into()));
        }
        if input.uid.len() > 128 {
            return Err(invalid("pod uid is longer than 128 bytes".into()));
        }
        let mut ips = Vec::new();
        for ip in input.ips.iter().take(16) {
            let addr = ip.split('/').next().unwrap_or("");
            let parsed: IpAddr = addr.parse().map_err(|_| {
                invalid(format!("IP {ip:?} from the primary CNI is not an address"))
            })?;
            ips.push(parsed);
        }
        if ips.is_empty() {
            return Err(invalid(
                "the primary CNI's result has no IP (is flock-cni chained after it?)".into(),
            ));
        }
        let ports = parse_ports(
            input
                .annotations
                .get(PORTS_ANNOTATION)
                .map(String::as_str)
                .unwrap_or(""),
        )
        .map_err(invalid)?;
        let service_account = input
            .annotations
            .get("flock.io/service-account")
            .cloned()
            .unwrap_or_default();
        if !service_account.is_empty() {
            check_name("flock.io/service-account", &service_account, 253).map_err(invalid)?;
        }
        Ok(Some(PodRecord {
            key: PodKey::new(&input.container_id, &input.ifname),
            name: input.name.clone(),
            namespace: input.namespace.clone(),
            uid: input.uid.clone(),
            netns: input.netns.clone(),
            ips,
            service: service.clone(),
            service_account,
            ports,
            network_name: input.network_name.clone(),
            added_at_ms: flock_clock::unix_now().as_millis(),
        }))
    }
}
