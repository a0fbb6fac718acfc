//! The Kubernetes mapping (`flock_kube::map`), fed whatever JSON an API server (or a
//! tampered one) could serve as a Pod, a Service or an EndpointSlice: the first byte
//! picks the kind, the rest is the object. Any object gives facts or an error naming
//! a field, never a panic; mapped pod ports pass the pod validator's `check_ports`;
//! memberships only reach meshed pod ports; slice endpoints keep the slice's address
//! family and carry an identity exactly when the namespace is meshed; messages stay
//! short. A Service's connection-pool annotations give limits in range or an error
//! naming the annotation; an HTTPRoute (fourth kind) gets a status that keeps every
//! other controller's entry and is not written twice.
#![no_main]

use std::collections::BTreeMap;

use flock_core::pod::{INBOUND_BASE_PORT, PodPort, Protocol, check_ports};
use flock_kube::map::{
    MAX_POOL_LIMIT, MESH_LABEL, MapError, MeshDecision, PodFacts, ServiceInfo, ServicePortInfo,
    memberships, pod_facts, service_info, service_pool, slice_endpoints,
};
use flock_kube::route::{CONTROLLER_NAME, HttpRoute, RouteOutcome, desired_status};
use k8s_openapi::api::core::v1::{Pod, Service, ServicePort, ServiceSpec};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use libfuzzer_sys::fuzz_target;

/// Larger objects are not interesting here: the API server's request limit is far
/// above this, but every list the mapping walks is bounded well below it.
const MAX_INPUT: usize = 64 * 1024;

fn short(e: &MapError) {
    let shown = e.to_string();
    assert!(!e.field.is_empty());
    assert!(
        shown.len() < 4096,
        "an error must stay short: {} bytes",
        shown.len()
    );
}

fn pod(json: &[u8]) {
    let Ok(pod) = serde_json::from_slice::<Pod>(json) else {
        return;
    };
    let meshed_ns: BTreeMap<String, String> = [(MESH_LABEL.to_string(), "enabled".to_string())]
        .into_iter()
        .collect();
    for ns in [None, Some(&meshed_ns)] {
        let facts = match pod_facts(&pod, ns) {
            Ok(facts) => facts,
            Err(e) => {
                short(&e);
                continue;
            }
        };
        check_ports(&facts.ports).expect("mapped ports pass check_ports");
        assert!(!facts.service_account.is_empty());
        for number in facts.port_names.values() {
            assert!(facts.ports.iter().any(|p| p.app_port == *number));
        }
        // A Service selecting the pod by its own labels, targeting every named port
        // by name and every port by number.
        let ports = facts
            .port_names
            .keys()
            .map(|n| IntOrString::String(n.clone()))
            .chain(
                facts
                    .ports
                    .iter()
                    .map(|p| IntOrString::Int(p.app_port.into())),
            )
            .enumerate()
            .map(|(i, target)| ServicePort {
                port: 1 + i as i32,
                target_port: Some(target),
                ..Default::default()
            })
            .collect();
        let svc = Service {
            metadata: ObjectMeta {
                namespace: Some(facts.namespace.clone()),
                name: Some("fuzz".into()),
                ..Default::default()
            },
            spec: Some(ServiceSpec {
                selector: Some(facts.labels.clone()),
                ports: Some(ports),
                ..Default::default()
            }),
            ..Default::default()
        };
        for m in memberships(&facts, [&svc]) {
            assert!(facts.mesh.is_meshed());
            for p in &m.ports {
                assert!(
                    facts
                        .ports
                        .iter()
                        .any(|q| q.app_port == p.app_port && q.dialled_port() == p.listen_port)
                );
            }
        }
    }
}

fn service(json: &[u8]) {
    let Ok(svc) = serde_json::from_slice::<Service>(json) else {
        return;
    };
    match service_info(&svc) {
        Ok(info) => {
            assert!(info.ports.len() <= flock_core::pod::MAX_PORTS);
            assert!(info.cluster_ips.len() <= 2);
            if let Some(accounts) = &info.service_accounts {
                assert!(!accounts.is_empty());
            }
        }
        Err(e) => short(&e),
    }
    match service_pool(&svc) {
        Ok(Some(limits)) => {
            for v in [
                limits.max_connections,
                limits.max_pending_requests,
                limits.max_requests,
            ]
            .into_iter()
            .flatten()
            {
                assert!((1..=MAX_POOL_LIMIT).contains(&v));
            }
            assert!(limits.retry_budget_percent.is_none_or(|p| (1..=100).contains(&p)));
        }
        Ok(None) => {}
        Err(e) => {
            short(&e);
            assert!(e.field.starts_with("metadata.annotations[flock.io/"));
        }
    }
    // A meshed pod of the Service's namespace whose labels are its selector.
    let selector = svc
        .spec
        .as_ref()
        .and_then(|s| s.selector.clone())
        .unwrap_or_default();
    let facts = PodFacts {
        namespace: svc.metadata.namespace.clone().unwrap_or_default(),
        name: "fuzz".into(),
        uid: String::new(),
        node_name: None,
        service_account: "default".into(),
        ports: [80u16, 8080, 9090]
            .iter()
            .enumerate()
            .map(|(i, &app_port)| PodPort {
                app_port,
                listen_port: INBOUND_BASE_PORT + i as u16,
                protocol: Protocol::Http,
                proxyless: false,
            })
            .collect(),
        port_names: [("http".to_string(), 8080u16)].into_iter().collect(),
        labels: selector,
        host_network: false,
        terminating: false,
        mesh: MeshDecision::Meshed,
        capture: Default::default(),
    };
    for m in memberships(&facts, [&svc]) {
        assert!(!m.ports.is_empty());
        assert!(
            m.ports
                .iter()
                .all(|p| facts.ports.iter().any(|q| q.app_port == p.app_port))
        );
    }
}

fn slice(json: &[u8]) {
    let Ok(slice) = serde_json::from_slice::<EndpointSlice>(json) else {
        return;
    };
    // The Service the slice says it belongs to, with a port of each slice port name.
    let info = ServiceInfo {
        namespace: slice.metadata.namespace.clone().unwrap_or_default(),
        name: slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("kubernetes.io/service-name").cloned())
            .unwrap_or_default(),
        cluster_ips: Vec::new(),
        ports: slice
            .ports
            .iter()
            .flatten()
            .take(8)
            .enumerate()
            .map(|(i, p)| ServicePortInfo {
                name: p.name.clone().filter(|n| !n.is_empty()),
                port: 1 + i as u16,
                protocol: Protocol::Tcp,
            })
            .collect(),
        service_accounts: None,
    };
    let nodes = |node: &str| {
        Some(
            [("topology.kubernetes.io/zone".to_string(), node.to_string())]
                .into_iter()
                .collect(),
        )
    };
    for meshed in [false, true] {
        let (endpoints, errors) = slice_endpoints(&info, &slice, meshed, "cluster.local", &nodes);
        errors.iter().for_each(short);
        for e in &endpoints {
            assert_eq!(e.address.is_ipv6(), slice.address_type == "IPv6");
            assert_eq!(e.identity.is_some(), meshed);
            assert_eq!(e.identity.as_ref(), e.identities.first());
            assert_ne!(e.port, 0);
        }
    }
}

fn route(json: &[u8]) {
    let Ok(mut obj) = serde_json::from_slice::<HttpRoute>(json) else {
        return;
    };
    let controllers = |status: &serde_json::Value, ours: bool| -> usize {
        status
            .get("parents")
            .and_then(|p| p.as_array())
            .map_or(0, |ps| {
                ps.iter()
                    .filter(|p| {
                        (p.get("controllerName").and_then(|c| c.as_str()) == Some(CONTROLLER_NAME))
                            == ours
                    })
                    .count()
            })
    };
    let theirs = obj.status.as_ref().map_or(0, |s| controllers(s, false));
    for outcome in [
        RouteOutcome::Accepted { problems: vec![] },
        RouteOutcome::Accepted {
            problems: vec!["backend gone".into()],
        },
        RouteOutcome::Refused("x".repeat(5000)),
    ] {
        let Some(status) = desired_status(&obj, &outcome, "2026-12-07T00:00:00Z") else {
            continue;
        };
        assert_eq!(controllers(&status, false), theirs, "another controller's entry lost");
        // Written, the same outcome computes nothing more to write.
        let mut written = obj.clone();
        written.status = Some(status);
        assert_eq!(desired_status(&written, &outcome, "2026-12-07T01:00:00Z"), None);
    }
    obj.status = None;
    let _ = desired_status(&obj, &RouteOutcome::Refused(String::new()), "");
}

fuzz_target!(|data: &[u8]| {
    let Some((&kind, json)) = data.split_first() else {
        return;
    };
    if json.len() > MAX_INPUT {
        return;
    }
    match kind % 4 {
        0 => pod(json),
        1 => service(json),
        2 => slice(json),
        _ => route(json),
    }
});
