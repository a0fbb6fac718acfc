//! One pod validator for every stage: whatever it admits at ADD, the store keeps and
//! the translation serves. Requests are drawn mostly from the edges of each rule
//! (dots in a service name, upper case, `..` in a path, multicast IPs, Envoy's
//! ports), so both outcomes occur; for the admitted ones, the pod and the service its
//! endpoints form go through the same conversions the agent's publish uses, and the
//! translation model must accept them.

use flock_bird::agent::AgentConfig;
use flock_bird::agent::mesh::{endpoints, pod_model, service_models};
use flock_bird::identity::spiffe_id;
use flock_bird::model::{Health, PodRecord};
use flock_bird::store;
use flock_core::UnixMs;
use flock_core::pod::{self, AddRequest};
use flock_xds::translate::Mesh;
use proptest::prelude::*;

fn edge_or(valid: &'static str, edges: &'static [&'static str]) -> BoxedStrategy<String> {
    prop_oneof![
        20 => valid.prop_map(|s: String| s),
        1 => proptest::sample::select(edges).prop_map(str::to_string),
    ]
    .boxed()
}

fn request() -> impl Strategy<Value = AddRequest> {
    let label = || {
        edge_or(
            "[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?",
            &["a.b", "A", "-a", "a-", "", "a_b", "a|b", "a/b", "é"],
        )
    };
    let subdomain = edge_or(
        "[a-z0-9]([a-z0-9.-]{0,30}[a-z0-9])?",
        &["a..b", ".a", "a.", "A.b", "", "a_b"],
    );
    let ip = edge_or(
        "10\\.[0-9]{1,2}\\.[0-9]{1,2}\\.[0-9]{1,2}(/24)?|fd00::[0-9a-f]{1,4}",
        &[
            "0.0.0.0",
            "::",
            "224.0.0.1",
            "ff02::1",
            "banana",
            "10.0.0.1/33x",
        ],
    );
    let port = prop_oneof![
        30 => (1u16..20000).prop_map(|p| p.to_string()),
        1 => proptest::sample::select(&["0", "15001", "15006", "15007", "65536", "x"][..])
            .prop_map(str::to_string),
    ];
    let proto = proptest::sample::select(&["", "/http", "/grpc", "/tcp", "/udp"][..]);
    let ports = proptest::collection::vec((port, proto), 0..5).prop_map(|ps| {
        ps.into_iter()
            .map(|(p, proto)| format!("{p}{proto}"))
            .collect::<Vec<_>>()
            .join(",")
    });
    (
        (
            edge_or("[a-f0-9]{1,64}", &["-c", "c/1", ""]),
            edge_or("eth[0-9]", &["..", "a:b", "0123456789abcdef"]),
        ),
        edge_or(
            "/var/run/netns/[a-z0-9-]{1,20}",
            &["relative", "/a/../b", "/"],
        ),
        (subdomain, label(), edge_or("[a-f0-9-]{0,36}", &["\u{1}"])),
        prop_oneof![
            20 => proptest::collection::vec(ip, 1..3),
            1 => Just(Vec::new()),
        ],
        (label(), ports, edge_or("([a-z0-9]{1,10})?", &["A", "a..b"])),
    )
        .prop_map(
            |((container_id, ifname), netns, (name, namespace, uid), ips, (svc, ports, sa))| {
                let mut annotations = std::collections::BTreeMap::new();
                annotations.insert(pod::SERVICE_ANNOTATION.to_string(), svc);
                annotations.insert(pod::PORTS_ANNOTATION.to_string(), ports);
                if !sa.is_empty() {
                    annotations.insert(pod::SERVICE_ACCOUNT_ANNOTATION.to_string(), sa);
                }
                AddRequest {
                    container_id,
                    ifname,
                    netns,
                    name,
                    namespace,
                    uid,
                    ips,
                    gateways: Vec::new(),
                    annotations,
                    network_name: "k8s-pod-network".into(),
                }
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn whatever_the_validator_admits_is_stored_and_translated(req in request()) {
        let Ok(Some(admitted)) = pod::admit(&req) else {
            return Ok(());
        };
        let rec = PodRecord::admitted(admitted, UnixMs(1_700_000_000_000));
        // The store keeps it (put and load both validate with the same rules).
        prop_assert_eq!(store::validate_record(&rec), Ok(()));
        let sa = if rec.service_account.is_empty() { "default" } else { &rec.service_account };
        let identity = spiffe_id("cluster.local", &rec.namespace, sa);
        let node = AgentConfig::new("node-1");
        let eps = endpoints(&rec, &node, Health::Healthy, Some(&identity));
        prop_assert_eq!(eps.len(), rec.ports.len());
        let pod = pod_model(&rec, Some(identity.clone()), &Default::default());
        prop_assert!(pod.is_some(), "an admitted pod has an IP");
        let mesh = Mesh {
            services: service_models(&eps),
            pods: pod.into_iter().collect(),
            ..Mesh::default()
        };
        let problems = mesh.validate().err().unwrap_or_default();
        prop_assert!(problems.is_empty(), "{:?} admitted but the translation refuses: {:?}", req, problems);
    }
}

/// The generator reaches both sides of the validator (else the property above would
/// hold vacuously).
#[test]
fn the_generator_yields_admitted_and_refused_requests() {
    use proptest::strategy::ValueTree;
    let mut runner = proptest::test_runner::TestRunner::deterministic();
    let (mut admitted, mut refused) = (0, 0);
    for _ in 0..500 {
        let req = request().new_tree(&mut runner).unwrap().current();
        match pod::admit(&req) {
            Ok(Some(_)) => admitted += 1,
            Err(_) => refused += 1,
            Ok(None) => {}
        }
    }
    assert!(
        admitted >= 25 && refused >= 25,
        "admitted {admitted}, refused {refused}"
    );
}
