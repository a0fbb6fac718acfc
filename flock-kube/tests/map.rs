//! The pure mapping of Kubernetes objects to mesh facts, on objects in the JSON shape
//! the API server serves (`kubectl get -o json`, under `tests/fixtures/`). No API
//! server and no double is involved: every function here is pure.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use flock_core::pod::{Health, INBOUND_BASE_PORT, MAX_PORTS, PodPort, Protocol, check_ports};
use flock_kube::map::{
    MAX_POOL_LIMIT, MESH_LABEL, MapError, MemberPort, Membership, MeshDecision, PodFacts,
    PoolLimits, RemoteEndpoint, SERVICE_ACCOUNTS_ANNOTATION, ServiceInfo, ServicePortInfo,
    endpoint_health, infer_protocol, memberships, pod_facts, selects, service_info, service_pool,
    slice_endpoints,
};
use k8s_openapi::api::core::v1::{Container, ContainerPort, Pod, Service};
use k8s_openapi::api::discovery::v1::{EndpointConditions, EndpointSlice};
use proptest::prelude::*;

fn fixture<T: serde::de::DeserializeOwned>(name: &str) -> T {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}"));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"))
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn meshed_ns() -> BTreeMap<String, String> {
    labels(&[
        ("kubernetes.io/metadata.name", "shop"),
        (MESH_LABEL, "enabled"),
    ])
}

fn port(app_port: u16, index: u16, protocol: Protocol) -> PodPort {
    PodPort {
        app_port,
        listen_port: INBOUND_BASE_PORT + index,
        protocol,
        proxyless: false,
    }
}

fn web_pod_facts() -> PodFacts {
    pod_facts(&fixture::<Pod>("pod-web.json"), Some(&meshed_ns())).expect("the web pod maps")
}

fn services() -> Vec<Service> {
    [
        "service-web.json",
        "service-frontend.json",
        "service-web-headless.json",
        "service-external-db.json",
    ]
    .into_iter()
    .map(fixture)
    .collect()
}

/// A container port named `grpc-xds` (or `grpc-xds-<suffix>`) is a proxyless gRPC
/// xDS server's: gRPC, dialled on the port itself.
#[test]
fn a_grpc_xds_named_port_is_proxyless() {
    assert!(flock_kube::map::is_proxyless_name("grpc-xds-api"));
    assert!(!flock_kube::map::is_proxyless_name("grpc-xdsx"));
    let mut pod = fixture::<Pod>("pod-web.json");
    let container = &mut pod.spec.as_mut().unwrap().containers[0];
    container.ports = Some(vec![
        ContainerPort {
            container_port: 8080,
            name: Some("http".into()),
            ..Default::default()
        },
        ContainerPort {
            container_port: 50051,
            name: Some("grpc-xds".into()),
            ..Default::default()
        },
    ]);
    pod.spec.as_mut().unwrap().init_containers = None;
    pod.spec.as_mut().unwrap().containers.truncate(1);
    let facts = pod_facts(&pod, Some(&meshed_ns())).unwrap();
    let xds = facts.ports.iter().find(|p| p.app_port == 50051).unwrap();
    assert!(xds.proxyless);
    assert_eq!(xds.protocol, Protocol::Grpc);
    assert_eq!(xds.dialled_port(), 50051);
    let http = facts.ports.iter().find(|p| p.app_port == 8080).unwrap();
    assert!(!http.proxyless);
    assert_eq!(http.dialled_port(), http.listen_port);
}

/// The web pod: numeric and named ports of two containers, a plain init container
/// (its port is not the pod's), a sidecar init container (its ports are), a UDP port
/// (skipped), a port declared twice (once); sorted by number with listeners from
/// the inbound base.
#[test]
fn pod_ports_from_containers_and_sidecars_sorted_and_deduplicated() {
    let facts = web_pod_facts();
    assert_eq!(facts.namespace, "shop");
    assert_eq!(facts.name, "web-7d9c6b5f4-x2k8p");
    assert_eq!(facts.uid, "6f1c0b6e-8d2a-4c3b-9e4f-5a6b7c8d9e0f");
    assert_eq!(facts.node_name.as_deref(), Some("node-a"));
    assert_eq!(facts.service_account, "web");
    assert_eq!(facts.mesh, MeshDecision::Meshed);
    assert!(!facts.host_network);
    assert!(!facts.terminating);
    assert_eq!(
        facts.ports,
        vec![
            port(6379, 0, Protocol::Tcp),  // cache, unnamed
            port(8080, 1, Protocol::Http), // web "http" (the sidecar's "http-alt" too)
            port(9090, 2, Protocol::Grpc), // web "grpc-api"
            port(9100, 3, Protocol::Tcp),  // web "metrics": no convention
            port(24224, 4, Protocol::Tcp), // sidecar "tcp-forward"
        ]
    );
    check_ports(&facts.ports).expect("mapped ports pass the pod validator");
    assert_eq!(
        facts.port_names,
        [
            ("grpc-api", 9090),
            ("http", 8080),
            ("http-alt", 8080),
            ("metrics", 9100),
            ("tcp-forward", 24224),
        ]
        .into_iter()
        .map(|(n, p)| (n.to_string(), p))
        .collect::<BTreeMap<_, _>>()
    );
    assert_eq!(facts.labels.get("app").map(String::as_str), Some("web"));
}

/// UDP ports are neither meshed ports nor names a Service can target.
#[test]
fn udp_ports_are_skipped() {
    let facts = web_pod_facts();
    assert!(!facts.ports.iter().any(|p| p.app_port == 8125));
    assert!(!facts.port_names.contains_key("statsd"));
}

/// A plain init container has exited before the pod serves: its port is not meshed.
/// Turned into a sidecar (`restartPolicy: Always`), the same port is.
#[test]
fn plain_init_container_ports_are_skipped_sidecar_ports_are_not() {
    let mut pod: Pod = fixture("pod-web.json");
    assert!(!web_pod_facts().ports.iter().any(|p| p.app_port == 5000));
    pod.spec.as_mut().unwrap().init_containers.as_mut().unwrap()[0].restart_policy =
        Some("Always".into());
    let facts = pod_facts(&pod, Some(&meshed_ns())).unwrap();
    let p = facts
        .ports
        .iter()
        .find(|p| p.app_port == 5000)
        .expect("sidecar port");
    assert_eq!(p.protocol, Protocol::Http, "named http-migrate");
    assert_eq!(facts.port_names.get("http-migrate"), Some(&5000));
}

/// A pod naming no service account runs as `default`, as the API server assigns.
#[test]
fn service_account_defaults_to_default() {
    let facts = pod_facts(&fixture::<Pod>("pod-terminating.json"), Some(&meshed_ns())).unwrap();
    assert_eq!(facts.service_account, "default");
    let mut pod: Pod = fixture("pod-web.json");
    let spec = pod.spec.as_mut().unwrap();
    spec.service_account_name = Some(String::new());
    spec.service_account = None;
    assert_eq!(pod_facts(&pod, None).unwrap().service_account, "default");
}

/// Opt-in: the namespace label or the pod label meshes the pod; the pod's
/// `disabled` wins over the namespace; without either (or with an unknown value)
/// the pod is not meshed.
#[test]
fn mesh_opt_in_by_namespace_or_pod_label_and_opt_out() {
    let base: Pod = fixture("pod-web.json");
    let with_pod_label = |value: Option<&str>| {
        let mut pod = base.clone();
        let l = pod.metadata.labels.as_mut().unwrap();
        match value {
            Some(v) => l.insert(MESH_LABEL.into(), v.into()),
            None => l.remove(MESH_LABEL),
        };
        pod
    };
    let plain_ns = labels(&[("kubernetes.io/metadata.name", "shop")]);
    let cases = [
        (None, Some(&meshed_ns()), true),
        (None, Some(&plain_ns), false),
        (None, None, false),
        (Some("enabled"), Some(&plain_ns), true),
        (Some("enabled"), None, true),
        (Some("disabled"), Some(&meshed_ns()), false),
        (Some("disabled"), None, false),
        (Some("yes"), Some(&plain_ns), false),
        (Some("yes"), Some(&meshed_ns()), true),
    ];
    for (pod_label, ns, meshed) in cases {
        let facts = pod_facts(&with_pod_label(pod_label), ns).unwrap();
        assert_eq!(
            facts.mesh.is_meshed(),
            meshed,
            "pod label {pod_label:?}, namespace labels {ns:?}: {}",
            facts.mesh
        );
        if let MeshDecision::NotMeshed(why) = &facts.mesh {
            assert!(
                why.contains(MESH_LABEL),
                "the reason names the label: {why}"
            );
        }
    }
}

/// A hostNetwork pod is never meshed, whatever its and its namespace's labels, and is
/// a member of no Service.
#[test]
fn host_network_pods_are_never_meshed() {
    let pod: Pod = fixture("pod-hostnet.json");
    let facts = pod_facts(&pod, Some(&meshed_ns())).unwrap();
    assert!(facts.host_network);
    match &facts.mesh {
        MeshDecision::NotMeshed(why) => assert!(why.contains("hostNetwork"), "{why}"),
        MeshDecision::Meshed => panic!("a hostNetwork pod was meshed"),
    }
    assert_eq!(facts.refusal("node-a"), None, "left alone, not refused");
    let mut svc: Service = fixture("service-web.json");
    svc.metadata.namespace = Some("monitoring".into());
    svc.spec.as_mut().unwrap().selector =
        Some(labels(&[("app.kubernetes.io/name", "node-exporter")]));
    assert!(memberships(&facts, [&svc]).is_empty());
}

/// A terminating pod is reported (and refused by `refusal`); so is a pod on another
/// node or on none; a live pod on this node is not refused.
#[test]
fn terminating_and_foreign_node_pods_are_refused() {
    let facts = pod_facts(&fixture::<Pod>("pod-terminating.json"), Some(&meshed_ns())).unwrap();
    assert!(facts.terminating);
    assert!(facts.mesh.is_meshed());
    let why = facts.refusal("node-a").expect("terminating pod refused");
    assert!(why.contains("terminating"), "{why}");

    let mut facts = web_pod_facts();
    assert_eq!(facts.refusal("node-a"), None);
    let why = facts
        .refusal("node-b")
        .expect("pod of another node refused");
    assert!(why.contains("node-a") && why.contains("node-b"), "{why}");
    facts.node_name = None;
    assert!(facts.refusal("node-a").is_some());
}

fn many_ports_pod(n: usize) -> Pod {
    let mut pod: Pod = fixture("pod-terminating.json");
    pod.metadata.deletion_timestamp = None;
    let spec = pod.spec.as_mut().unwrap();
    spec.containers = vec![Container {
        name: "many".into(),
        ports: Some(
            (0..n)
                .map(|i| ContainerPort {
                    container_port: 20000 + i as i32,
                    ..Default::default()
                })
                .collect(),
        ),
        ..Default::default()
    }];
    pod
}

/// More TCP ports than the mesh serves: a meshed pod is refused, the error naming
/// the first port over the limit; at the limit it maps.
#[test]
fn too_many_ports_is_an_error_naming_the_field() {
    let facts = pod_facts(&many_ports_pod(MAX_PORTS), Some(&meshed_ns())).unwrap();
    assert_eq!(facts.ports.len(), MAX_PORTS);
    let err = pod_facts(&many_ports_pod(MAX_PORTS + 1), Some(&meshed_ns())).unwrap_err();
    assert_eq!(
        err.field,
        format!("spec.containers[0].ports[{MAX_PORTS}].containerPort")
    );
    assert!(err.message.contains(&MAX_PORTS.to_string()), "{err}");
    assert!(
        err.to_string()
            .starts_with("spec.containers[0].ports[32].containerPort: ")
    );
}

/// Port numbers out of range and ports on Envoy's own listeners are refused with the
/// field; a pod that is not meshed is never refused for its ports (flock leaves it
/// alone) and has no meshed ports.
#[test]
fn bad_ports_refuse_only_meshed_pods() {
    let mut pod: Pod = fixture("pod-web.json");
    pod.spec.as_mut().unwrap().containers[1]
        .ports
        .as_mut()
        .unwrap()[0]
        .container_port = 70000;
    let err = pod_facts(&pod, Some(&meshed_ns())).unwrap_err();
    assert_eq!(err.field, "spec.containers[1].ports[0].containerPort");
    assert!(err.message.contains("70000"), "{err}");

    let not_meshed = pod_facts(&pod, None).unwrap();
    assert!(!not_meshed.mesh.is_meshed());
    assert!(not_meshed.ports.is_empty() && not_meshed.port_names.is_empty());

    let mut pod: Pod = fixture("pod-web.json");
    pod.spec.as_mut().unwrap().containers[1]
        .ports
        .as_mut()
        .unwrap()[0]
        .container_port = 15001;
    let err = pod_facts(&pod, Some(&meshed_ns())).unwrap_err();
    assert_eq!(err.field, "spec.containers[*].ports");
    assert!(err.message.contains("15001"), "{err}");

    let mut pod: Pod = fixture("pod-web.json");
    pod.spec.as_mut().unwrap().containers[0]
        .ports
        .as_mut()
        .unwrap()[1]
        .name = Some("Not_A_Name".into());
    let err = pod_facts(&pod, Some(&meshed_ns())).unwrap_err();
    assert_eq!(err.field, "spec.containers[0].ports[1].name");
}

/// A malformed service account of a meshed pod is refused naming its field.
#[test]
fn bad_service_account_names_the_field() {
    let mut pod: Pod = fixture("pod-web.json");
    pod.spec.as_mut().unwrap().service_account_name = Some("Web/Admin".into());
    let err: MapError = pod_facts(&pod, Some(&meshed_ns())).unwrap_err();
    assert_eq!(err.field, "spec.serviceAccountName");
}

/// One pod, several Services: each Service whose selector is a subset of the pod's
/// labels is a membership with the ports that resolve (targetPort by name, by
/// number, absent); ports resolving to no meshed pod port are left out; the Service
/// without a selector selects nothing. Sorted by Service name.
#[test]
fn memberships_of_a_pod_selected_by_several_services() {
    let facts = web_pod_facts();
    let svcs = services();
    let got = memberships(&facts, &svcs);
    let mp = |service_port, name: &str, app_port, listen_index, protocol| MemberPort {
        service_port,
        name: Some(name.to_string()),
        app_port,
        listen_port: INBOUND_BASE_PORT + listen_index,
        protocol,
    };
    let member = |service: &str, ports| Membership {
        namespace: "shop".into(),
        service: service.into(),
        ports,
    };
    assert_eq!(
        got,
        vec![
            member(
                "frontend",
                vec![
                    // No targetPort: the Service port; "cache" says nothing, the pod's tcp.
                    mp(6379, "cache", 6379, 0, Protocol::Tcp),
                    // targetPort 8080 by number; "web" says nothing, the pod's http.
                    mp(8443, "web", 8080, 1, Protocol::Http),
                    // "admin-console-legacy" (a Service port name may be a 63-long
                    // DNS label) targets http-migrate, a plain init container's
                    // port: left out.
                ]
            ),
            member(
                "web",
                vec![
                    // targetPort "http" by name.
                    mp(80, "http", 8080, 1, Protocol::Http),
                    // appProtocol grpc; the UDP statsd port is left out.
                    mp(9090, "api", 9090, 2, Protocol::Grpc),
                ]
            ),
            member(
                "web-headless",
                vec![mp(24224, "tcp-log", 24224, 4, Protocol::Tcp)]
            ),
        ]
    );
}

/// Only Services of the pod's own namespace select it; an empty selector selects
/// nothing; a Service whose ports all miss is no membership.
#[test]
fn memberships_only_same_namespace_and_nonempty_selectors() {
    let facts = web_pod_facts();
    let mut other_ns: Service = fixture("service-web.json");
    other_ns.metadata.namespace = Some("billing".into());
    let mut empty: Service = fixture("service-web.json");
    empty.metadata.name = Some("empty".into());
    empty.spec.as_mut().unwrap().selector = Some(BTreeMap::new());
    let mut misses: Service = fixture("service-web.json");
    misses.metadata.name = Some("misses".into());
    for p in misses.spec.as_mut().unwrap().ports.as_mut().unwrap() {
        p.target_port = Some(k8s_openapi::apimachinery::pkg::util::intstr::IntOrString::Int(4444));
    }
    let mut bad: Service = fixture("service-web.json");
    bad.metadata.name = Some("Bad.Name".into());
    assert!(memberships(&facts, [&other_ns, &empty, &misses, &bad]).is_empty());
    assert!(!selects(&BTreeMap::new(), &facts.labels));
}

/// A pod that is not meshed is a member of nothing, even where selectors match.
#[test]
fn unmeshed_pods_have_no_memberships() {
    let facts = pod_facts(&fixture::<Pod>("pod-web.json"), None).unwrap();
    assert!(!facts.mesh.is_meshed());
    assert!(memberships(&facts, &services()).is_empty());
}

/// A Service's cluster IPs (both families), its TCP ports with their protocols, and
/// the accounts of its annotation (sorted, blanks trimmed).
#[test]
fn service_info_of_a_dual_stack_service() {
    let info = service_info(&fixture("service-web.json")).unwrap();
    assert_eq!(
        info,
        ServiceInfo {
            namespace: "shop".into(),
            name: "web".into(),
            cluster_ips: vec![
                "10.96.12.34".parse::<IpAddr>().unwrap(),
                "fd00:10:96::1234".parse().unwrap(),
            ],
            ports: vec![
                ServicePortInfo {
                    name: Some("http".into()),
                    port: 80,
                    protocol: Protocol::Http,
                },
                ServicePortInfo {
                    name: Some("api".into()),
                    port: 9090,
                    protocol: Protocol::Grpc,
                },
            ],
            service_accounts: Some(vec!["web".into(), "web-canary".into()]),
        }
    );
    let headless = service_info(&fixture("service-web-headless.json")).unwrap();
    assert!(headless.cluster_ips.is_empty(), "None is not a cluster IP");
    assert_eq!(headless.service_accounts, None);
    assert_eq!(headless.ports[0].protocol, Protocol::Tcp);
}

/// A malformed accounts annotation, cluster IP or port is an error naming its field.
#[test]
fn service_info_errors_name_the_field() {
    let annotated = |value: &str| {
        let mut svc: Service = fixture("service-web.json");
        svc.metadata
            .annotations
            .as_mut()
            .unwrap()
            .insert(SERVICE_ACCOUNTS_ANNOTATION.into(), value.into());
        service_info(&svc)
    };
    let field = format!("metadata.annotations[{SERVICE_ACCOUNTS_ANNOTATION}]");
    for bad in ["Web", "web,sa/evil", " , ,", "a..b"] {
        let err = annotated(bad).unwrap_err();
        assert_eq!(err.field, field, "{bad:?}: {err}");
    }
    assert_eq!(
        annotated("b,a,b").unwrap().service_accounts,
        Some(vec!["a".to_string(), "b".to_string()])
    );
    let many = (0..40)
        .map(|i| format!("sa{i}"))
        .collect::<Vec<_>>()
        .join(",");
    assert_eq!(annotated(&many).unwrap_err().field, field);

    let mut svc: Service = fixture("service-web.json");
    svc.spec.as_mut().unwrap().cluster_ips = Some(vec!["10.96.12.34".into(), "nope".into()]);
    assert_eq!(service_info(&svc).unwrap_err().field, "spec.clusterIPs[1]");

    let mut svc: Service = fixture("service-web.json");
    svc.spec.as_mut().unwrap().ports.as_mut().unwrap()[1].port = 0;
    assert_eq!(service_info(&svc).unwrap_err().field, "spec.ports[1].port");

    let mut svc: Service = fixture("service-web.json");
    svc.spec.as_mut().unwrap().ports.as_mut().unwrap()[0].name = Some("Bad_Name".into());
    assert_eq!(service_info(&svc).unwrap_err().field, "spec.ports[0].name");
}

fn node_labels(node: &str) -> Option<BTreeMap<String, String>> {
    match node {
        "node-a" => Some(labels(&[
            ("topology.kubernetes.io/region", "eu-west-1"),
            ("topology.kubernetes.io/zone", "eu-west-1a"),
        ])),
        "node-b" => Some(labels(&[
            ("topology.kubernetes.io/region", "eu-west-1"),
            ("topology.kubernetes.io/zone", "eu-west-1b"),
        ])),
        _ => None,
    }
}

fn web_info() -> ServiceInfo {
    service_info(&fixture("service-web.json")).unwrap()
}

fn endpoints_of(slice: &str, meshed: bool) -> (Vec<RemoteEndpoint>, Vec<MapError>) {
    slice_endpoints(
        &web_info(),
        &fixture::<EndpointSlice>(slice),
        meshed,
        "cluster.local",
        &node_labels,
    )
}

/// The web Service's endpoints split across two slices: both map, each endpoint ×
/// each TCP port matched to the Service's by name (slice ports in another order in
/// the second slice), health from the conditions, zone from the endpoint else its
/// Node, region from its Node; the one bad address is dropped alone with an error
/// naming it.
#[test]
fn a_service_split_across_two_slices_maps_both() {
    let (first, first_errors) = endpoints_of("endpointslice-web-8kx2p.json", true);
    let (second, second_errors) = endpoints_of("endpointslice-web-t7m4d.json", true);
    assert!(first_errors.is_empty(), "{first_errors:?}");
    assert_eq!(second_errors.len(), 1, "{second_errors:?}");
    assert_eq!(second_errors[0].field, "endpoints[2].addresses[0]");
    assert!(second_errors[0].message.contains("10.244.3.256"));

    let summary = |e: &RemoteEndpoint| {
        (
            e.address.to_string(),
            e.service_port,
            e.port,
            e.protocol,
            e.health,
            e.zone.clone(),
            e.region.clone(),
            e.node.clone(),
        )
    };
    let mut all: Vec<_> = first.iter().chain(&second).map(summary).collect();
    all.sort();
    let row = |a: &str, sp, p, proto, h, z: &str, r: &str, n: &str| {
        (
            a.to_string(),
            sp,
            p,
            proto,
            h,
            z.to_string(),
            r.to_string(),
            n.to_string(),
        )
    };
    use Health::*;
    use Protocol::{Grpc, Http};
    assert_eq!(
        all,
        vec![
            row(
                "10.244.1.17",
                80,
                8080,
                Http,
                Healthy,
                "eu-west-1a",
                "eu-west-1",
                "node-a"
            ),
            row(
                "10.244.1.17",
                9090,
                9090,
                Grpc,
                Healthy,
                "eu-west-1a",
                "eu-west-1",
                "node-a"
            ),
            // No zone of its own: its Node's.
            row(
                "10.244.2.9",
                80,
                8080,
                Http,
                Draining,
                "eu-west-1b",
                "eu-west-1",
                "node-b"
            ),
            row(
                "10.244.2.9",
                9090,
                9090,
                Grpc,
                Draining,
                "eu-west-1b",
                "eu-west-1",
                "node-b"
            ),
            // Conditions without `ready`: unknown. Node unknown: no region.
            row(
                "10.244.3.4",
                80,
                8080,
                Http,
                Unknown,
                "eu-west-1c",
                "",
                "node-c"
            ),
            row(
                "10.244.3.4",
                9090,
                9090,
                Grpc,
                Unknown,
                "eu-west-1c",
                "",
                "node-c"
            ),
            row(
                "10.244.3.5",
                80,
                8080,
                Http,
                Unhealthy,
                "eu-west-1c",
                "",
                "node-c"
            ),
            row(
                "10.244.3.5",
                9090,
                9090,
                Grpc,
                Unhealthy,
                "eu-west-1c",
                "",
                "node-c"
            ),
        ]
    );
    let e = &first[0];
    assert_eq!(e.namespace, "shop");
    assert_eq!(e.service, "web");
    assert_eq!(e.pod.as_deref(), Some("shop/web-7d9c6b5f4-x2k8p"));
}

/// Health from conditions, as the design fixes it: ready → healthy; ready unset →
/// unknown; serving and terminating → draining; anything else → unhealthy.
#[test]
fn conditions_to_health() {
    let c = |ready, serving, terminating| EndpointConditions {
        ready,
        serving,
        terminating,
    };
    let cases = [
        (
            Some(c(Some(true), Some(true), Some(false))),
            Health::Healthy,
        ),
        (Some(c(Some(true), None, None)), Health::Healthy),
        (Some(c(None, None, None)), Health::Unknown),
        (None, Health::Unknown),
        (Some(c(None, Some(true), Some(true))), Health::Unknown),
        (
            Some(c(Some(false), Some(true), Some(true))),
            Health::Draining,
        ),
        (
            Some(c(Some(false), Some(false), Some(true))),
            Health::Unhealthy,
        ),
        (
            Some(c(Some(false), Some(true), Some(false))),
            Health::Unhealthy,
        ),
        (Some(c(Some(false), None, None)), Health::Unhealthy),
    ];
    for (conditions, want) in cases {
        assert_eq!(endpoint_health(conditions.as_ref()), want, "{conditions:?}");
    }
}

/// Identity: a meshed namespace's Service with the accounts annotation → those
/// exact IDs; without it → any account of the namespace (`/*`); a Service of a
/// namespace that is not meshed → plaintext.
#[test]
fn slice_identity_per_the_namespace_and_the_annotation() {
    let (eps, _) = endpoints_of("endpointslice-web-8kx2p.json", true);
    for e in &eps {
        assert_eq!(
            e.identities,
            vec![
                "spiffe://cluster.local/ns/shop/sa/web".to_string(),
                "spiffe://cluster.local/ns/shop/sa/web-canary".to_string(),
            ]
        );
        assert_eq!(
            e.identity.as_deref(),
            Some("spiffe://cluster.local/ns/shop/sa/web")
        );
    }
    let mut info = web_info();
    info.service_accounts = None;
    let slice: EndpointSlice = fixture("endpointslice-web-8kx2p.json");
    let (eps, errors) = slice_endpoints(&info, &slice, true, "cluster.local", &node_labels);
    assert!(errors.is_empty() && !eps.is_empty());
    for e in &eps {
        assert_eq!(
            e.identity.as_deref(),
            Some("spiffe://cluster.local/ns/shop/sa/*")
        );
        assert_eq!(e.identities.len(), 1);
    }
    let (eps, _) = endpoints_of("endpointslice-web-8kx2p.json", false);
    assert!(!eps.is_empty());
    assert!(
        eps.iter()
            .all(|e| e.identity.is_none() && e.identities.is_empty())
    );

    // Never plaintext to a meshed Service: where no identity can be built (no trust
    // domain, an empty account list, a name that cannot go into a SPIFFE ID), no
    // endpoints and one error.
    let (eps, errors) = slice_endpoints(&web_info(), &slice, true, "", &node_labels);
    assert!(eps.is_empty());
    assert_eq!(errors.len(), 1);
    let mut info = web_info();
    info.service_accounts = Some(Vec::new());
    let (eps, errors) = slice_endpoints(&info, &slice, true, "cluster.local", &node_labels);
    assert!(eps.is_empty());
    assert_eq!(errors[0].field, "service accounts");
    let mut info = web_info();
    info.service_accounts = Some(vec!["web/../admin".into()]);
    let (eps, errors) = slice_endpoints(&info, &slice, true, "cluster.local", &node_labels);
    assert!(eps.is_empty());
    assert_eq!(errors[0].field, "service accounts");
}

/// An FQDN slice gives nothing and no error: the mesh routes to IPs only.
#[test]
fn fqdn_slices_are_skipped() {
    let info = service_info(&fixture("service-external-db.json")).unwrap();
    let slice: EndpointSlice = fixture("endpointslice-external-db-fqdn.json");
    let (eps, errors) = slice_endpoints(&info, &slice, true, "cluster.local", &node_labels);
    assert!(eps.is_empty());
    assert!(errors.is_empty(), "{errors:?}");
}

/// An IPv6 slice maps its IPv6 endpoint; an IPv4 address in it is dropped alone.
#[test]
fn ipv6_slice_keeps_its_family() {
    let (eps, errors) = endpoints_of("endpointslice-web-ipv6-r5s6t.json", true);
    assert_eq!(eps.len(), 1);
    assert_eq!(
        eps[0].address,
        "fd00:10:244:1::17".parse::<IpAddr>().unwrap()
    );
    assert_eq!((eps[0].service_port, eps[0].port), (80, 8080));
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0].field, "endpoints[1].addresses[0]");
}

/// A slice of another Service or namespace is refused whole, naming the field.
#[test]
fn a_slice_of_another_service_is_refused() {
    let slice: EndpointSlice = fixture("endpointslice-web-8kx2p.json");
    let mut info = web_info();
    info.name = "frontend".into();
    let (eps, errors) = slice_endpoints(&info, &slice, true, "cluster.local", &node_labels);
    assert!(eps.is_empty());
    assert_eq!(
        errors.iter().map(|e| e.field.as_str()).collect::<Vec<_>>(),
        ["metadata.labels[kubernetes.io/service-name]"]
    );
    let mut info = web_info();
    info.namespace = "billing".into();
    let (eps, errors) = slice_endpoints(&info, &slice, true, "cluster.local", &node_labels);
    assert!(eps.is_empty());
    assert_eq!(errors[0].field, "metadata.namespace");
}

/// The protocol conventions: appProtocol first, then the name prefix, else tcp.
#[test]
fn protocol_inference() {
    let cases = [
        (Some("http"), Some("grpc"), Protocol::Http),
        (Some("kubernetes.io/h2c"), None, Protocol::Http),
        (Some("HTTP2"), None, Protocol::Http),
        (Some("grpc"), Some("http"), Protocol::Grpc),
        (Some("kubernetes.io/ws"), Some("http"), Protocol::Tcp),
        (None, Some("http"), Protocol::Http),
        (None, Some("http-web"), Protocol::Http),
        (None, Some("http2-api"), Protocol::Http),
        (None, Some("grpc"), Protocol::Grpc),
        (None, Some("grpc-api"), Protocol::Grpc),
        (None, Some("grpc-web"), Protocol::Http),
        (None, Some("tcp-db"), Protocol::Tcp),
        (None, Some("https"), Protocol::Tcp),
        (None, Some("httpx"), Protocol::Tcp),
        (None, Some("metrics"), Protocol::Tcp),
        (Some(""), Some("grpc"), Protocol::Grpc),
        (None, None, Protocol::Tcp),
    ];
    for (app, name, want) in cases {
        assert_eq!(infer_protocol(app, name), want, "{app:?} {name:?}");
    }
}

/// The reference matcher: the selector's pairs, as a set, are a subset of the
/// labels' pairs, and the selector is not empty.
fn reference_selects(
    selector: &BTreeMap<String, String>,
    labels: &BTreeMap<String, String>,
) -> bool {
    let wanted: BTreeSet<(&String, &String)> = selector.iter().collect();
    let have: BTreeSet<(&String, &String)> = labels.iter().collect();
    !wanted.is_empty() && wanted.is_subset(&have)
}

fn small_map() -> impl Strategy<Value = BTreeMap<String, String>> {
    // Few keys and values so that overlaps (the interesting cases) are common.
    proptest::collection::btree_map("[abc]", "[xy]{0,1}", 0..4)
}

proptest! {
    /// `selects` agrees with the set-inclusion reference on arbitrary maps, and a
    /// selector built from a subset of the labels always selects.
    #[test]
    fn selects_matches_reference(selector in small_map(), labels in small_map(), take in 0usize..4) {
        prop_assert_eq!(selects(&selector, &labels), reference_selects(&selector, &labels));
        let sub: BTreeMap<String, String> = labels.iter().take(take).map(|(k, v)| (k.clone(), v.clone())).collect();
        prop_assert_eq!(selects(&sub, &labels), !sub.is_empty());
    }

    /// `pod_facts` never panics on arbitrary labels and ports, and the ports it
    /// gives always pass the pod validator's `check_ports`.
    #[test]
    fn pod_facts_never_panics_and_ports_pass_check_ports(
        pod_labels in proptest::collection::btree_map(".{0,8}", ".{0,8}", 0..6),
        ns_enabled in any::<bool>(),
        host_network in any::<bool>(),
        containers in proptest::collection::vec(
            (
                proptest::collection::vec(
                    (prop_oneof![any::<i32>(), 15000i32..15040, 1i32..40],
                     proptest::option::of("(http|grpc|tcp|x)(-[a-z]{0,3})?|.{0,4}"),
                     proptest::option::of(prop_oneof!["TCP", "UDP", "SCTP", ".{0,3}"])),
                    0..12),
                proptest::option::of(prop_oneof!["Always", "Never"]),
                any::<bool>(),
            ),
            0..5),
    ) {
        let mut pod: Pod = fixture("pod-terminating.json");
        pod.metadata.labels = Some(pod_labels);
        let spec = pod.spec.as_mut().unwrap();
        spec.host_network = Some(host_network);
        spec.containers.clear();
        let mut inits = Vec::new();
        for (i, (ports, restart, init)) in containers.into_iter().enumerate() {
            let c = Container {
                name: format!("c{i}"),
                restart_policy: restart,
                ports: Some(ports.into_iter().map(|(n, name, protocol)| ContainerPort {
                    container_port: n,
                    name,
                    protocol,
                    ..Default::default()
                }).collect()),
                ..Default::default()
            };
            if init { inits.push(c) } else { spec.containers.push(c) }
        }
        spec.init_containers = Some(inits);
        let ns = ns_enabled.then(meshed_ns);
        match pod_facts(&pod, ns.as_ref()) {
            Ok(facts) => {
                prop_assert!(check_ports(&facts.ports).is_ok(), "{:?}", facts.ports);
                prop_assert!(facts.port_names.values().all(|p| facts.ports.iter().any(|q| q.app_port == *p)));
                if host_network { prop_assert!(!facts.mesh.is_meshed()); }
            }
            Err(e) => {
                prop_assert!(ns_enabled || pod.metadata.labels.as_ref().unwrap().get(MESH_LABEL).map(String::as_str) == Some("enabled"),
                    "a pod that is not meshed was refused: {}", e);
                prop_assert!(!e.field.is_empty() && e.to_string().len() < 1024);
            }
        }
    }
}

proptest! {
    /// A meshed pod with valid ports maps to exactly the distinct TCP port numbers of
    /// its containers and sidecars (not of plain init containers), sorted, listeners
    /// numbered from the inbound base: compared with a reference that collects the
    /// numbers into a set.
    #[test]
    fn meshed_pod_ports_are_the_sorted_distinct_tcp_ports(
        containers in proptest::collection::vec(
            (
                proptest::collection::vec((1i32..15000, any::<bool>()), 0..6),
                0u8..3, // 0: container, 1: sidecar init container, 2: plain init container
            ),
            1..4),
    ) {
        let mut pod: Pod = fixture("pod-terminating.json");
        let spec = pod.spec.as_mut().unwrap();
        spec.containers.clear();
        let mut inits = Vec::new();
        let mut want = BTreeSet::new();
        for (i, (ports, kind)) in containers.into_iter().enumerate() {
            for (n, tcp) in &ports {
                if *tcp && kind < 2 {
                    want.insert(*n as u16);
                }
            }
            let c = Container {
                name: format!("c{i}"),
                restart_policy: (kind == 1).then(|| "Always".to_string()),
                ports: Some(ports.into_iter().map(|(n, tcp)| ContainerPort {
                    container_port: n,
                    protocol: Some(if tcp { "TCP" } else { "UDP" }.into()),
                    ..Default::default()
                }).collect()),
                ..Default::default()
            };
            if kind == 0 { spec.containers.push(c) } else { inits.push(c) }
        }
        spec.init_containers = Some(inits);
        let facts = pod_facts(&pod, Some(&meshed_ns())).expect("valid ports map");
        let got: Vec<u16> = facts.ports.iter().map(|p| p.app_port).collect();
        prop_assert_eq!(got, want.into_iter().collect::<Vec<_>>());
        for (i, p) in facts.ports.iter().enumerate() {
            prop_assert_eq!(usize::from(p.listen_port), usize::from(INBOUND_BASE_PORT) + i);
            prop_assert_eq!(p.protocol, Protocol::Tcp, "unnamed ports are opaque");
        }
    }
}

fn annotated_service(annotations: &[(&str, &str)]) -> Service {
    let mut svc: Service = fixture("service-web.json");
    svc.metadata.annotations = Some(
        annotations
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
    );
    svc
}

#[test]
fn pool_annotations_set_only_the_limits_they_name() {
    assert_eq!(service_pool(&annotated_service(&[])).unwrap(), None);
    assert_eq!(
        service_pool(&annotated_service(&[("flock.io/service-accounts", "web")])).unwrap(),
        None
    );
    let limits = service_pool(&annotated_service(&[
        ("flock.io/max-connections", "100"),
        ("flock.io/retry-budget-percent", " 5 "),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(
        limits,
        PoolLimits {
            max_connections: Some(100),
            max_pending_requests: None,
            max_requests: None,
            retry_budget_percent: Some(5),
        }
    );
    let all = service_pool(&annotated_service(&[
        ("flock.io/max-connections", "1"),
        ("flock.io/max-pending-requests", "2"),
        ("flock.io/max-requests", "1000000"),
        ("flock.io/retry-budget-percent", "100"),
    ]))
    .unwrap()
    .unwrap();
    assert_eq!(all.max_pending_requests, Some(2));
    assert_eq!(all.max_requests, Some(MAX_POOL_LIMIT));
}

#[test]
fn malformed_pool_annotations_are_errors_naming_the_annotation() {
    for (key, value) in [
        ("flock.io/max-connections", "0"),
        ("flock.io/max-connections", "-1"),
        ("flock.io/max-pending-requests", "ten"),
        ("flock.io/max-requests", "1000001"),
        ("flock.io/max-requests", ""),
        ("flock.io/retry-budget-percent", "101"),
        ("flock.io/retry-budget-percent", "0"),
        ("flock.io/max-connections", "1.5"),
    ] {
        let err = service_pool(&annotated_service(&[
            ("flock.io/max-requests", "10"),
            (key, value),
        ]))
        .unwrap_err();
        assert_eq!(
            err.field,
            format!("metadata.annotations[{key}]"),
            "{key}={value}"
        );
        assert!(err.message.contains(&format!("{value:?}")), "{err:?}");
    }
    // A long value is quoted bounded.
    let long = "9".repeat(10_000);
    let err = service_pool(&annotated_service(&[("flock.io/max-connections", &long)])).unwrap_err();
    assert!(err.message.len() < 200, "{}", err.message);
}
