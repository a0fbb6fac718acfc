//! The registry endpoint the registry test binaries build their cases from.

use flock_bird::model::{Endpoint, Health, Protocol};
use flock_core::pod::PodKey;

/// Pod `default/<pod>`'s endpoint of service `web.default`, port 8080 (HTTP), on `node`:
/// 10.0.0.7, inbound listener 15006, region `r`, zone `z`, healthy, no identity. A case
/// changes what it tests with struct update syntax (`Endpoint { identity, ..web(n, p) }`).
pub fn web(node: &str, pod: &str) -> Endpoint {
    Endpoint {
        service: "web".into(),
        namespace: "default".into(),
        service_port: 8080,
        protocol: Protocol::Http,
        address: "10.0.0.7".parse().expect("a literal address"),
        port: 15006,
        node: node.into(),
        pod: format!("default/{pod}"),
        pod_key: PodKey {
            container_id: pod.into(),
            ifname: "eth0".into(),
        },
        region: "r".into(),
        zone: "z".into(),
        health: Health::Healthy,
        identity: None,
        also_accept: Vec::new(),
        labels: Default::default(),
    }
}
