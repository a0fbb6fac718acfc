//! Shared fixtures of the agent's in-process test binaries.

use std::collections::BTreeMap;

use flock_bird::agent::AddPodInput;

/// A network namespace file that exists on every Linux machine (the agent serves a
/// pod only if its netns exists; these tests do not start Envoy).
pub const NETNS: &str = "/proc/self/ns/net";

/// An AddPod request for container `id`, annotated with `service` (if any) and the
/// `ports` annotation (if not empty).
pub fn input(id: &str, service: Option<&str>, ports: &str) -> AddPodInput {
    let mut annotations = BTreeMap::new();
    if let Some(s) = service {
        annotations.insert("flock.io/service".to_string(), s.to_string());
    }
    if !ports.is_empty() {
        annotations.insert("flock.io/ports".to_string(), ports.to_string());
    }
    AddPodInput {
        container_id: id.into(),
        ifname: "eth0".into(),
        netns: NETNS.into(),
        name: format!("pod-{id}"),
        namespace: "default".into(),
        uid: "u-1".into(),
        ips: vec!["10.1.0.5/24".into()],
        gateways: Vec::new(),
        annotations,
        network_name: "net".into(),
    }
}
