//! The agent's incremental service table equals the from-scratch computation
//! (`served_services`) after every step of random change sequences: endpoints added,
//! changed, moved between services and removed in batches, views the table misses
//! (the watch channel keeps only the newest view, so the next one is applied from the
//! view's recent deltas, or by a rebuild when it missed more views than those), backends that do not count their changes, VIP sources that
//! change and VIPs two services claim.

use flock_bird::agent::services::{ServiceTable, served_services};
use flock_bird::model::{Endpoint, Health, Protocol};
use flock_bird::registry::{Delta, View};
use flock_core::pod::PodKey;
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

/// An endpoint from small domains, so keys collide, services share ports, ports
/// mix identities (the downgrade rule), protocols disagree (invalid services) and
/// one service can exceed the port cap.
fn endpoint() -> impl Strategy<Value = Endpoint> {
    (
        0..2usize,
        0..3usize,
        prop_oneof![4 => 0..3u16, 1 => 0..40u16],
        prop_oneof![6 => Just(Protocol::Http), 1 => Just(Protocol::Tcp)],
        0..6u8,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(
            |(ns, svc, port, protocol, host, identity, healthy)| Endpoint {
                service: format!("s{svc}"),
                namespace: format!("n{ns}"),
                service_port: 8000 + port,
                protocol,
                address: IpAddr::from([10, 0, 0, host + 1]),
                port: 15006,
                node: "other".into(),
                pod: format!("n{ns}/p{host}"),
                pod_key: PodKey::new(format!("c{host}"), "eth0"),
                region: String::new(),
                zone: String::new(),
                health: if healthy {
                    Health::Healthy
                } else {
                    Health::Unhealthy
                },
                identity: identity.then(|| format!("spiffe://cluster.local/ns/n{ns}/sa/s{svc}")),
                also_accept: Vec::new(),
                labels: Default::default(),
            },
        )
}

#[derive(Debug, Clone)]
enum Op {
    Put(u8, Box<Endpoint>),
    Delete(u8),
    /// Endpoints on `count` ports of service `n0/s0` (keys `k16`..), past the port
    /// cap when `count` is over `MAX_PORTS` (32): the random puts alone (16 keys)
    /// never reach it. Every other one has an identity (the downgrade rule per port).
    Spread(u8),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        12 => (0..16u8, endpoint()).prop_map(|(k, e)| Op::Put(k, Box::new(e))),
        4 => (0..16u8).prop_map(Op::Delete),
        1 => (28..40u8).prop_map(Op::Spread),
        1 => (16..56u8).prop_map(Op::Delete),
    ]
}

fn spread(port: u8) -> Endpoint {
    Endpoint {
        service: "s0".into(),
        namespace: "n0".into(),
        service_port: 9000 + u16::from(port),
        protocol: Protocol::Http,
        address: IpAddr::from([10, 0, 1, port + 1]),
        port: 15006,
        node: "other".into(),
        pod: format!("n0/q{port}"),
        pod_key: PodKey::new(format!("q{port}"), "eth0"),
        region: String::new(),
        zone: String::new(),
        health: Health::Healthy,
        identity: port
            .is_multiple_of(2)
            .then(|| "spiffe://cluster.local/ns/n0/sa/s0".to_string()),
        also_accept: Vec::new(),
        labels: Default::default(),
    }
}

/// One step: a batch of changes published as one view, whether the table sees that
/// view, and the VIP source's state (`None`: no Kubernetes).
#[derive(Debug, Clone)]
struct Step {
    ops: Vec<Op>,
    seen: bool,
    vips: Option<u8>,
}

fn step() -> impl Strategy<Value = Step> {
    (
        prop::collection::vec(op(), 1..6),
        prop_oneof![5 => Just(true), 1 => Just(false)],
        prop_oneof![3 => Just(None), 1 => (0..3u8).prop_map(Some)],
    )
        .prop_map(|(ops, seen, vips)| Step { ops, seen, vips })
}

/// Cluster IPs from a tiny pool, so two services often claim one; which service gets
/// which depends on the source's state.
fn vips_of(state: u8) -> impl Fn(&str, &str) -> Vec<IpAddr> {
    move |ns: &str, name: &str| {
        let h = ns.bytes().chain(name.bytes()).map(u32::from).sum::<u32>() + u32::from(state);
        if h % 4 == 0 {
            Vec::new()
        } else {
            vec![IpAddr::from([10, 96, 0, (h % 3) as u8])]
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn the_incremental_table_equals_a_from_scratch_computation(
        steps in prop::collection::vec(step(), 1..24),
        counting in prop_oneof![4 => Just(true), 1 => Just(false)],
    ) {
        let mut endpoints: BTreeMap<String, Endpoint> = BTreeMap::new();
        let mut seq = 0u64;
        let mut last_delta: Arc<Delta> = Arc::default();
        // The backend's recent deltas, kept short here (3) so that both a few missed
        // views (caught up from their deltas) and more (a rebuild) happen.
        let mut recent: flock_bird::registry::Vector<Arc<Delta>> = Default::default();
        let mut table = ServiceTable::new();
        for step in steps {
            let mut delta = Delta::default();
            let before = endpoints.clone();
            for op in &step.ops {
                match op {
                    Op::Put(k, e) => {
                        endpoints.insert(format!("k{k}"), (**e).clone());
                    }
                    Op::Delete(k) => {
                        endpoints.remove(&format!("k{k}"));
                    }
                    Op::Spread(count) => {
                        for port in 0..*count {
                            endpoints.insert(format!("k{}", 16 + port), spread(port));
                        }
                    }
                }
            }
            // The delta as a counting backend reports it: each key once, folded.
            for (k, e) in &endpoints {
                match before.get(k) {
                    None => delta.added.push(k.clone()),
                    Some(old) if old != e => delta.changed.push(k.clone()),
                    Some(_) => {}
                }
            }
            delta.removed.extend(before.keys().filter(|k| !endpoints.contains_key(*k)).cloned());
            // As the etcd backend: a view without an endpoint change keeps the seq and
            // the delta of the last view that had one.
            if counting && !delta.is_empty() {
                seq += 1;
                last_delta = Arc::new(delta);
                recent.push_back(Arc::clone(&last_delta));
                if recent.len() > 3 {
                    recent.pop_front();
                }
            }
            let view = Arc::new(View {
                endpoints: endpoints.clone().into_iter().collect(),
                seq: if counting { seq } else { 0 },
                delta: if counting { Arc::clone(&last_delta) } else { Arc::default() },
                recent: if counting { recent.clone() } else { Default::default() },
                ..View::default()
            });
            if !step.seen {
                continue;
            }
            let source = step.vips.map(vips_of);
            let vips = step
                .vips
                .zip(source.as_ref())
                .map(|(state, f)| (usize::from(state) + 1, f as &dyn Fn(&str, &str) -> Vec<IpAddr>));
            table.update(&view, vips);
            let (want, want_excluded) = served_services(&view, vips);
            let got: Vec<_> = table.services().iter().map(|s| (**s).clone()).collect();
            prop_assert_eq!(got, want, "the incremental services differ from a from-scratch computation");
            prop_assert_eq!(
                table.excluded(),
                &want_excluded,
                "the incremental exclusions differ from a from-scratch computation"
            );
        }
    }
}

/// A publish after one endpoint change hands the translation the very same `Arc` for
/// every service it did not touch (the memo then skips them by pointer), and a view
/// with no endpoint change leaves the table as it was.
#[test]
fn unchanged_services_stay_the_same_allocation() {
    let ep = |svc: &str, host: u8| Endpoint {
        service: svc.into(),
        namespace: "default".into(),
        service_port: 8080,
        protocol: Protocol::Http,
        address: IpAddr::from([10, 0, 0, host]),
        port: 15006,
        node: "other".into(),
        pod: format!("default/p{host}"),
        pod_key: PodKey::new(format!("c{host}"), "eth0"),
        region: String::new(),
        zone: String::new(),
        health: Health::Healthy,
        identity: None,
        also_accept: Vec::new(),
        labels: Default::default(),
    };
    let v1 = Arc::new(View {
        endpoints: [
            ("a".to_string(), ep("web", 1)),
            ("b".to_string(), ep("db", 2)),
        ]
        .into_iter()
        .collect(),
        seq: 1,
        ..View::default()
    });
    let mut table = ServiceTable::new();
    assert!(table.update(&v1, None));
    let first = Arc::clone(table.services());
    assert_eq!(first.len(), 2);
    let mut endpoints = v1.endpoints.clone();
    endpoints.insert("a".into(), ep("web", 3).into());
    let v2 = Arc::new(View {
        endpoints,
        seq: 2,
        delta: Arc::new(Delta {
            changed: vec!["a".into()],
            ..Delta::default()
        }),
        ..View::default()
    });
    assert!(table.update(&v2, None));
    let second = Arc::clone(table.services());
    // (namespace, name) order: db, web.
    assert!(Arc::ptr_eq(&first[0], &second[0]), "db untouched");
    assert!(!Arc::ptr_eq(&first[1], &second[1]), "web re-derived");
    // Same seq (only the revision moved): nothing to do.
    let v3 = Arc::new(View {
        revision: 9,
        ..(*v2).clone()
    });
    assert!(!table.update(&v3, None));
    assert!(Arc::ptr_eq(table.services(), &second));
}
