//! Per-change publish cost: one endpoint of one service changes among 100, 1,000 and
//! 10,000 `ClusterLoadAssignment`s, beside a full-rebuild baseline in the same run.
//!
//! * **flock**: build the one new CLA (encode + hash), `Cache::update` with an `edit()`
//!   of the previous set, and a subscribed Delta ADS stream (wildcard EDS, previous
//!   response ACKed) takes the snapshot, polls its response and ACKs it.
//! * **flock, named**: the same with the stream subscribed to every CLA by name, as
//!   Envoy subscribes to its EDS clusters' endpoints.
//! * **baseline**: what go-control-plane's delta snapshot does per change: re-encode
//!   and re-hash every resource, build a fresh set from scratch and diff it against
//!   the previous one with a full merge walk.
//!
//! The `breakdown` group splits the flock path into its parts at each size, to show
//! where any growth with the set size comes from.
//!
//! Run: `cargo bench -p flock-xds --bench publish -- --warm-up-time 1 --measurement-time 3`.
//!
//! Flatness in one time window, the sizes interleaved (see `flatness_mode`):
//! `FLOCK_PUBLISH_FLATNESS=1 cargo bench -p flock-xds --bench publish`.
//!
//! Instruction counts (repeatable on a busy machine), per 1,000 changes at n resources:
//! `FLOCK_PUBLISH_COUNT=<n> valgrind --tool=callgrind --toggle-collect='*counted_changes*'
//! target/release/deps/publish-<hash>` (see `count_mode`).

use criterion::{BenchmarkId, Criterion, criterion_group};
use envoy_types::pb::envoy::config::core::v3::{
    Address, Locality, SocketAddress, address, socket_address,
};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::google::protobuf::{Any, UInt32Value};
use flock_core::ContentHash;
use flock_core::resources::{ResourceSet, diff_full};
use flock_xds::cache::Cache;
use flock_xds::protocol::{DeltaAds, DeltaRequest};
use flock_xds::types::ENDPOINT;
use prost::Message;
use std::hint::black_box;

const SIZES: [usize; 3] = [100, 1_000, 10_000];
const GROUP: &str = "node-1";
/// Endpoints per `ClusterLoadAssignment`.
const ENDPOINTS: u32 = 4;

fn name(i: usize) -> String {
    format!("outbound|8080||svc-{i:05}.default.svc.cluster.local")
}

/// A realistic CLA: one locality, a few endpoints; each `generation` replaces the first
/// endpoint by a new pod (new address and hostname), so no two generations encode alike.
fn cla(i: usize, generation: u64) -> ClusterLoadAssignment {
    let lb_endpoints = (0..ENDPOINTS)
        .map(|e| {
            let host = if e == 0 { (generation % 250) as u32 } else { e };
            LbEndpoint {
                health_status: 1, // HEALTHY
                load_balancing_weight: Some(UInt32Value { value: 1 }),
                host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                    address: Some(Address {
                        address: Some(address::Address::SocketAddress(SocketAddress {
                            protocol: socket_address::Protocol::Tcp as i32,
                            address: format!("10.{}.{}.{}", (i >> 8) & 255, i & 255, host + 1),
                            port_specifier: Some(socket_address::PortSpecifier::PortValue(8080)),
                            ..Default::default()
                        })),
                    }),
                    hostname: if e == 0 {
                        format!("svc-{i:05}-pod-{generation}")
                    } else {
                        format!("svc-{i:05}-pod-s{e}")
                    },
                    ..Default::default()
                })),
                ..Default::default()
            }
        })
        .collect();
    ClusterLoadAssignment {
        cluster_name: name(i),
        endpoints: vec![LocalityLbEndpoints {
            locality: Some(Locality {
                region: "eu-west-1".into(),
                zone: "eu-west-1a".into(),
                sub_zone: String::new(),
            }),
            load_balancing_weight: Some(UInt32Value { value: ENDPOINTS }),
            lb_endpoints,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// Encodes and hashes one resource, as a control plane does when it builds it.
fn encode(i: usize, generation: u64) -> (ContentHash, Any) {
    let any = Any {
        type_url: ENDPOINT.to_string(),
        value: cla(i, generation).encode_to_vec(),
    };
    (ContentHash::of(&any.value), any)
}

fn dreq(sub: &[&str], nonce: &str) -> DeltaRequest {
    DeltaRequest {
        type_url: ENDPOINT.into(),
        resource_names_subscribe: sub.iter().map(|s| s.to_string()).collect(),
        response_nonce: nonce.into(),
        ..DeltaRequest::default()
    }
}

/// A cache with `n` CLAs and one Delta stream subscribed to all EDS (by wildcard, or
/// to each name) that has received and ACKed its initial response.
struct Flock {
    n: usize,
    names: Vec<String>,
    cache: Cache<Any>,
    stream: DeltaAds<Any>,
    changes: usize,
}

impl Flock {
    fn new(n: usize) -> Self {
        Self::subscribed(n, false)
    }

    fn subscribed(n: usize, by_name: bool) -> Self {
        let cache = Cache::by_node_id();
        let names: Vec<String> = (0..n).map(name).collect();
        let snap = cache.update(GROUP, |prev| {
            let mut b = prev.edit();
            for (i, nm) in names.iter().enumerate() {
                let (hash, any) = encode(i, 0);
                b.upsert(ENDPOINT, nm, hash, any);
            }
            b.build()
        });
        let mut stream = DeltaAds::new();
        stream.on_snapshot(snap.state(), snap.version());
        let names_ref: Vec<&str> = names.iter().map(String::as_str).collect();
        let subscribe: &[&str] = if by_name { &names_ref } else { &["*"] };
        stream.on_request(&dreq(subscribe, ""));
        let first = stream.poll_response().expect("initial response");
        assert_eq!(first.resources.len(), n);
        stream.on_request(&dreq(&[], &first.nonce));
        assert!(stream.poll_response().is_none());
        Self {
            n,
            names,
            cache,
            stream,
            changes: 0,
        }
    }

    /// The next change: which resource and its new generation (never a no-op).
    fn next_change(&mut self) -> (usize, u64) {
        self.changes += 1;
        let i = (self.changes * 7919) % self.n;
        (i, self.changes as u64)
    }

    /// One change through the whole flock path.
    fn change(&mut self) {
        let (i, generation) = self.next_change();
        let (hash, any) = encode(i, generation);
        let name = &self.names[i];
        let snap = self.cache.update(GROUP, |prev| {
            prev.edit().upsert(ENDPOINT, name, hash, any).build()
        });
        self.stream.on_snapshot(snap.state(), snap.version());
        let resp = self.stream.poll_response().expect("a response");
        debug_assert_eq!(resp.resources.len(), 1);
        self.stream.on_request(&dreq(&[], &resp.nonce));
        black_box(resp);
    }
}

/// go-control-plane's way: every change re-encodes and re-hashes everything and diffs
/// a fresh set against the previous one.
struct Baseline {
    names: Vec<String>,
    generations: Vec<u64>,
    prev: ResourceSet<Any>,
    changes: usize,
}

impl Baseline {
    fn new(n: usize) -> Self {
        let mut me = Self {
            names: (0..n).map(name).collect(),
            generations: vec![0; n],
            prev: ResourceSet::new(),
            changes: 0,
        };
        me.prev = me.rebuild();
        me
    }

    fn rebuild(&self) -> ResourceSet<Any> {
        let mut b = ResourceSet::new().edit();
        for (i, (nm, generation)) in self.names.iter().zip(&self.generations).enumerate() {
            let (hash, any) = encode(i, *generation);
            b.upsert(ENDPOINT, nm, hash, any);
        }
        b.build()
    }

    fn change(&mut self) {
        self.changes += 1;
        let i = (self.changes * 7919) % self.names.len();
        self.generations[i] = self.changes as u64;
        let next = self.rebuild();
        let d = diff_full(&self.prev, &next);
        debug_assert_eq!(d.types[ENDPOINT].changed.len(), 1);
        black_box(&d);
        self.prev = next;
    }
}

fn publish(c: &mut Criterion) {
    let mut g = c.benchmark_group("publish one endpoint change");
    for n in SIZES {
        g.sample_size(100);
        let mut flock = Flock::new(n);
        g.bench_with_input(BenchmarkId::new("flock", n), &n, |b, _| {
            b.iter(|| flock.change())
        });
        drop(flock);
        let mut named = Flock::subscribed(n, true);
        g.bench_with_input(BenchmarkId::new("flock, named", n), &n, |b, _| {
            b.iter(|| named.change())
        });
        drop(named);
        // A full rebuild of 10,000 CLAs takes milliseconds: fewer samples keep the run short.
        g.sample_size(if n >= 10_000 { 10 } else { 30 });
        let mut baseline = Baseline::new(n);
        g.bench_with_input(BenchmarkId::new("baseline full rebuild", n), &n, |b, _| {
            b.iter(|| baseline.change())
        });
    }
    g.finish();
}

/// The parts of the flock path, to locate growth with the set size.
fn breakdown(c: &mut Criterion) {
    let mut g = c.benchmark_group("flock breakdown");
    for n in SIZES {
        let mut flock = Flock::new(n);
        g.bench_with_input(BenchmarkId::new("encode+hash one CLA", n), &n, |b, _| {
            b.iter(|| {
                let (i, generation) = flock.next_change();
                black_box(encode(i, generation))
            })
        });
        // Derive the next set from the published one (the stream still shares it, as
        // it would in the server) without publishing it.
        let (hash, any) = encode(0, 1_000_000);
        let latest = flock.cache.snapshot(GROUP).expect("set");
        g.bench_with_input(BenchmarkId::new("edit+upsert+build", n), &n, |b, _| {
            b.iter(|| {
                black_box(
                    latest
                        .state()
                        .edit()
                        .upsert(ENDPOINT, &flock.names[0], hash, any.clone())
                        .build(),
                )
            })
        });
        drop(latest);
        g.bench_with_input(BenchmarkId::new("whole change", n), &n, |b, _| {
            b.iter(|| flock.change())
        });
    }
    g.finish();
}

/// `changes` whole changes, not inlined, so `callgrind --toggle-collect=*counted_changes*`
/// counts exactly them (set-up, warm-up and criterion excluded).
#[inline(never)]
fn counted_changes(flock: &mut Flock, changes: usize) {
    for _ in 0..changes {
        flock.change();
    }
}

/// Instruction-count mode, for callgrind: `FLOCK_PUBLISH_COUNT=<resources>` builds the
/// set and stream, warms up with as many changes as are counted (so every name has
/// been changed before), then runs `FLOCK_PUBLISH_CHANGES` (default 1,000) changes in
/// [`counted_changes`]. `FLOCK_PUBLISH_NAMED=1` subscribes by name instead of `*`.
fn count_mode(resources: &str) {
    let n: usize = resources
        .parse()
        .unwrap_or_else(|_| panic!("FLOCK_PUBLISH_COUNT={resources:?} is not a number"));
    let changes: usize = std::env::var("FLOCK_PUBLISH_CHANGES")
        .map(|v| v.parse().expect("FLOCK_PUBLISH_CHANGES is a number"))
        .unwrap_or(1_000);
    let named = std::env::var("FLOCK_PUBLISH_NAMED").is_ok_and(|v| v == "1");
    let mut flock = Flock::subscribed(n, named);
    for _ in 0..changes.max(n) {
        flock.change();
    }
    counted_changes(&mut flock, changes);
    println!("{changes} changes at {n} resources (named: {named})");
}

/// Flatness in one time window (`FLOCK_PUBLISH_FLATNESS=1`): criterion measures the
/// sizes one after the other, minutes apart, and on a shared host the machine's speed
/// drifts by more than the growth being measured (the full rebuild at 10,000 moved from
/// 35 to 57 ms between two runs of one session). Here one stream per size runs in
/// rounds: each round times a batch of `BATCH` changes at every size, the first size
/// rotating, so the batches a ratio compares ran within milliseconds of each other.
/// Prints each size's median per-change time over the rounds and the median over rounds
/// of each round's ratio to the smallest size.
fn flatness_mode() {
    const ROUNDS: usize = 100;
    // Large enough that the cache misses of switching sizes are a small part of a
    // batch (with 200, the 100-resource stream ran 1.5x slower than alone).
    const BATCH: usize = 2_000;
    let mut flocks: Vec<Flock> = SIZES.iter().map(|&n| Flock::new(n)).collect();
    for f in &mut flocks {
        // Every name changed once, as in the other modes.
        for _ in 0..f.n.max(1_000) {
            f.change();
        }
    }
    let mut per_change = vec![Vec::with_capacity(ROUNDS); SIZES.len()];
    let mut ratios = vec![Vec::with_capacity(ROUNDS); SIZES.len()];
    for round in 0..ROUNDS {
        let mut this = vec![0.0; SIZES.len()];
        for k in 0..SIZES.len() {
            let i = (round + k) % SIZES.len();
            let t = std::time::Instant::now();
            counted_changes(&mut flocks[i], BATCH);
            this[i] = t.elapsed().as_secs_f64() * 1e9 / BATCH as f64;
        }
        for i in 0..SIZES.len() {
            per_change[i].push(this[i]);
            ratios[i].push(this[i] / this[0]);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "publish flatness, one window: {ROUNDS} rounds of {BATCH} changes per size, sizes interleaved"
    );
    println!(
        "| resources | per change (median of rounds) | ratio to {} (median of rounds) |",
        SIZES[0]
    );
    println!("|---|---|---|");
    for i in 0..SIZES.len() {
        println!(
            "| {} | {:.2} µs | {:.2}× |",
            SIZES[i],
            median(&mut per_change[i]) / 1000.0,
            median(&mut ratios[i])
        );
    }
}

criterion_group!(benches, publish, breakdown);

fn main() {
    if let Ok(n) = std::env::var("FLOCK_PUBLISH_COUNT") {
        count_mode(&n);
        return;
    }
    if std::env::var("FLOCK_PUBLISH_FLATNESS").is_ok_and(|v| v == "1") {
        flatness_mode();
        return;
    }
    benches();
    Criterion::default().configure_from_args().final_summary();
}
