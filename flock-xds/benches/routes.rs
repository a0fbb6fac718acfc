//! Translation cost per route change: one service's `HTTPRoute` weights change among
//! 10, 100 and 1,000 routed services (each service routed 90/10 over the next two),
//! translated by the memo a control plane keeps ([`Memo::translate_shared`], the
//! agent's publish path), Envoy flavor, with callers that have an identity (their
//! own route configurations, as in a mesh with mTLS). Twice: with the virtual hosts
//! over VHDS (the agent's setting, `EnvoyOptions::vhds`) and with whole route
//! configurations (RDS only, what a state-of-the-world Envoy gets).
//!
//! Sizes are interleaved in rounds (one time window; ratios to the smallest size,
//! median of rounds), as the publish flatness benchmark does.
//!
//! Run: `cargo bench -p flock-xds --bench routes`.

use flock_core::route::{BackendRef, RouteRule};
use flock_xds::translate::{
    Endpoint, EnvoyOptions, Flavor, Health, Locality, Memo, Pod, Protocol, Service, ServicePort,
};
use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

const SIZES: [usize; 3] = [10, 100, 1_000];
/// Callers with an identity: each has its own route configuration.
const CALLERS: usize = 4;

fn service(i: usize, n: usize, v2_weight: u32) -> Service {
    let name = |k: usize| format!("svc-{:04}", k % n);
    let backend = |k: usize, weight: u32| BackendRef {
        subset: Default::default(),
        service: name(k),
        namespace: "default".into(),
        port: 8080,
        weight,
        mtls: true,
    };
    Service {
        name: name(i),
        namespace: "default".into(),
        ports: vec![ServicePort {
            name: None,
            port: 8080,
            protocol: Protocol::Http,
        }],
        endpoints: (0..2)
            .map(|e| Endpoint {
                address: IpAddr::V4(Ipv4Addr::new(10, (i >> 8) as u8, i as u8, e + 1)),
                port: 15006,
                locality: Locality::default(),
                health: Health::Healthy,
                weight: 1,
                service_port: None,
                identity: Some(format!("spiffe://td/ns/default/sa/{}", name(i))),
                also_accept: Vec::new(),
                labels: Default::default(),
            })
            .collect(),
        vips: Vec::new(),
        routes: vec![RouteRule {
            route: format!("default/{}", name(i)),
            port: Some(8080),
            matches: Vec::new(),
            backends: vec![backend(i + 1, 100 - v2_weight), backend(i + 2, v2_weight)],
            timeout_ms: Some(1000),
            retry: None,
        }],
        pool: None,
    }
}

struct World {
    n: usize,
    services: Vec<Arc<Service>>,
    pods: Vec<Arc<Pod>>,
    memo: Memo,
    opts: EnvoyOptions,
    changes: u64,
    weights: Vec<u32>,
}

impl World {
    fn new(n: usize, vhds: bool) -> Self {
        let services: Vec<Arc<Service>> = (0..n).map(|i| Arc::new(service(i, n, 10))).collect();
        let pods = (0..CALLERS)
            .map(|c| {
                Arc::new(
                    serde_json::from_value::<Pod>(serde_json::json!({
                        "name": format!("client-{c}"),
                        "ip": format!("10.200.0.{}", c + 1),
                        "identity": format!("spiffe://td/ns/default/sa/client-{c}"),
                    }))
                    .unwrap(),
                )
            })
            .collect();
        let mut w = World {
            n,
            services,
            pods,
            memo: Memo::new(Flavor::Envoy),
            opts: EnvoyOptions {
                vhds,
                ..EnvoyOptions::default()
            },
            changes: 0,
            weights: vec![10; n],
        };
        w.memo.translate_shared(&w.services, &w.pods, &[], &w.opts);
        w
    }

    /// The baseline: one route change translated whole, by a fresh memo (what a
    /// control plane without one pays).
    fn change_from_scratch(&mut self) {
        self.changes += 1;
        let k = (self.changes as usize * 7919) % self.n;
        self.weights[k] = 1 + (self.weights[k] % 98);
        self.services[k] = Arc::new(service(k, self.n, self.weights[k]));
        let t =
            Memo::new(Flavor::Envoy).translate_shared(&self.services, &self.pods, &[], &self.opts);
        std::hint::black_box(t);
    }

    /// One route change: service `k`'s v2 weight moves, and the memo translates.
    fn change(&mut self) {
        self.changes += 1;
        let k = (self.changes as usize * 7919) % self.n;
        // Every change of service k a weight it did not have just before.
        self.weights[k] = 1 + (self.weights[k] % 98);
        let weight = self.weights[k];
        self.services[k] = Arc::new(service(k, self.n, weight));
        let t = self
            .memo
            .translate_shared(&self.services, &self.pods, &[], &self.opts);
        std::hint::black_box(t);
    }
}

fn main() {
    // `cargo test --benches` runs this with --bench absent: a smoke run only.
    let smoke = !std::env::args().any(|a| a == "--bench");
    for vhds in [true, false] {
        run(smoke, vhds);
    }
}

fn run(smoke: bool, vhds: bool) {
    let (rounds, batch) = if smoke { (2, 5) } else { (30, 200) };
    let mut worlds: Vec<World> = SIZES.iter().map(|&n| World::new(n, vhds)).collect();
    for w in &mut worlds {
        for _ in 0..50 {
            w.change();
        }
    }
    let mut per_change = vec![Vec::new(); SIZES.len()];
    let mut ratios = vec![Vec::new(); SIZES.len()];
    for round in 0..rounds {
        let mut this = vec![0.0; SIZES.len()];
        for k in 0..SIZES.len() {
            let i = (round + k) % SIZES.len();
            let t = std::time::Instant::now();
            for _ in 0..batch {
                worlds[i].change();
            }
            this[i] = t.elapsed().as_secs_f64() * 1e6 / batch as f64;
        }
        for i in 0..SIZES.len() {
            per_change[i].push(this[i]);
            ratios[i].push(this[i] / this[0]);
        }
    }
    // The baseline, a few changes per size (a whole translation is slow at 1,000).
    let mut baseline = Vec::new();
    for &n in &SIZES {
        let mut w = World::new(n, vhds);
        let reps = if smoke { 1 } else { 20 };
        let t = std::time::Instant::now();
        for _ in 0..reps {
            w.change_from_scratch();
        }
        baseline.push(t.elapsed().as_secs_f64() * 1e6 / reps as f64);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "route change translation ({}): {rounds} rounds of {batch} changes per size, sizes interleaved, {CALLERS} callers with an identity",
        if vhds {
            "virtual hosts over VHDS"
        } else {
            "whole route configurations"
        }
    );
    println!(
        "| routed services | per change (median) | ratio to {} (median) | baseline: whole translation | flock / baseline |",
        SIZES[0]
    );
    println!("|---|---|---|---|---|");
    for i in 0..SIZES.len() {
        let m = median(&mut per_change[i]);
        println!(
            "| {} | {:.1} µs | {:.2}× | {:.1} µs | {:.3} |",
            SIZES[i],
            m,
            median(&mut ratios[i]),
            baseline[i],
            m / baseline[i]
        );
    }
}
