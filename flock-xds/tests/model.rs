//! Property test: a model xDS client (Envoy-like) against one ADS stream, SotW and
//! Delta, under random interleavings of publishes, (un)subscriptions, ACKs, NACKs
//! (of invalid resources), stale and duplicated requests, late snapshot deliveries
//! and reconnects with `initial_resource_versions`. Messages travel through two FIFO
//! queues, so any number of responses and requests can be in flight.
//!
//! Checked after every step:
//! * nonces increase on a stream; versions a client receives per type never go back
//!   (R1 at the stream level; fails under `xds-snapshot-regress`);
//! * Delta never resends a resource the client holds at the same hash;
//! * an EDS resource only arrives once the client received its cluster at the
//!   content of the snapshot the EDS came from — unless a CDS response awaited its
//!   ACK when the EDS one was produced (Envoy withholds that ACK while clusters warm
//!   on their endpoints) — and new/changed RDS only after LDS is complete (fails
//!   under `xds-eds-before-cds`);
//! * a removal only goes out once the types that may refer to it are complete
//!   (make-before-break; fails under `xds-break-before-make`);
//! * the server's ACKed version per type is one the client actually ACKed (fails
//!   under `xds-stale-nonce`);
//! * the stream's state stays bounded by the resource universe, whatever the number
//!   of publishes, and at most one response per type is in flight.
//!
//! At the end, after a last publish that fixes every invalid resource, the stream is
//! drained: the client's accepted view equals the latest snapshot restricted to its
//! subscription, for every type.

use flock_core::ContentHash;
use flock_core::resources::{Name, ResourceSet};
use flock_xds::protocol::{DeltaAds, DeltaRequest, SotwAds, SotwRequest, StreamStats};
use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet, VecDeque};

const TYPES: [&str; 4] = [CLUSTER, ENDPOINT, LISTENER, ROUTE];
const CLUSTERS: [&str; 4] = ["c0", "c1", "c2", "c3"];
const LISTENERS: [&str; 2] = ["l0", "l1"];
const ROUTES: [&str; 3] = ["r0", "r1", "r2"];
/// Values at or above this are invalid: the client rejects them (and NACKs).
const INVALID: u32 = 100;

fn h(v: u32) -> ContentHash {
    ContentHash::of(&v.to_le_bytes())
}

fn make_rank(t: &str) -> usize {
    [CLUSTER, ENDPOINT, LISTENER, ROUTE]
        .iter()
        .position(|x| *x == t)
        .unwrap()
}

fn break_rank(t: &str) -> usize {
    [LISTENER, ROUTE, CLUSTER, ENDPOINT]
        .iter()
        .position(|x| *x == t)
        .unwrap()
}

#[derive(Debug, Clone)]
enum Edit {
    Cluster(usize, Option<u32>),
    Endpoint(usize, u32),
    Listener(usize, Option<u32>),
    Route(usize, Option<u32>),
}

#[derive(Debug, Clone)]
enum Op {
    Publish(Vec<Edit>),
    /// Deliver an older snapshot late (must be ignored).
    LateSnapshot,
    Deliver,
    Poll,
    ClientRead,
    SubscribeRoutes([bool; 3]),
    Duplicate,
    Reconnect,
}

fn value() -> impl Strategy<Value = u32> {
    prop_oneof![9 => 1u32..20, 1 => INVALID..INVALID + 3]
}

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (0..4usize, proptest::option::weighted(0.8, value()))
            .prop_map(|(i, v)| Edit::Cluster(i, v)),
        (0..4usize, value()).prop_map(|(i, v)| Edit::Endpoint(i, v)),
        (0..2usize, proptest::option::weighted(0.8, value()))
            .prop_map(|(i, v)| Edit::Listener(i, v)),
        (0..3usize, proptest::option::weighted(0.8, value())).prop_map(|(i, v)| Edit::Route(i, v)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => proptest::collection::vec(edit(), 1..4).prop_map(Op::Publish),
        1 => Just(Op::LateSnapshot),
        5 => Just(Op::Deliver),
        5 => Just(Op::Poll),
        5 => Just(Op::ClientRead),
        1 => any::<[bool; 3]>().prop_map(Op::SubscribeRoutes),
        1 => Just(Op::Duplicate),
        1 => Just(Op::Reconnect),
    ]
}

fn apply(prev: &ResourceSet<u32>, edits: &[Edit]) -> ResourceSet<u32> {
    let mut b = prev.edit();
    for e in edits {
        match *e {
            Edit::Cluster(i, Some(v)) => {
                b.upsert(CLUSTER, CLUSTERS[i], h(v), v);
            }
            Edit::Cluster(i, None) => {
                // Consistency: a cluster's endpoints go with it.
                b.remove(CLUSTER, CLUSTERS[i]).remove(ENDPOINT, CLUSTERS[i]);
            }
            Edit::Endpoint(i, v) => {
                b.upsert(ENDPOINT, CLUSTERS[i], h(v), v);
            }
            Edit::Listener(i, Some(v)) => {
                b.upsert(LISTENER, LISTENERS[i], h(v), v);
            }
            Edit::Listener(i, None) => {
                b.remove(LISTENER, LISTENERS[i]);
            }
            Edit::Route(i, Some(v)) => {
                b.upsert(ROUTE, ROUTES[i], h(v), v);
            }
            Edit::Route(i, None) => {
                b.remove(ROUTE, ROUTES[i]);
            }
        }
    }
    let mut set = b.build();
    // Endpoints only for existing clusters.
    let orphans: Vec<Name> = set
        .iter_type(ENDPOINT)
        .filter(|(n, _)| set.get(CLUSTER, n).is_none())
        .map(|(n, _)| n.clone())
        .collect();
    if !orphans.is_empty() {
        let mut b = set.edit();
        for n in orphans {
            b.remove(ENDPOINT, &n);
        }
        set = b.build();
    }
    set
}

/// A normalized response.
#[derive(Debug, Clone)]
struct Resp {
    type_url: Name,
    version: u64,
    nonce: u64,
    resources: Vec<(Name, ContentHash, u32)>,
    removed: Vec<Name>,
    /// A CDS response awaited its ACK when the server produced this one: endpoints
    /// asked for by name may then go out before CDS's next change (Envoy withholds
    /// that ACK while clusters warm on their endpoints; see flock-xds's ordering docs).
    cds_awaiting_ack: bool,
}

enum Server {
    Sotw(SotwAds<u32>),
    Delta(DeltaAds<u32>),
}

#[derive(Debug, Clone)]
enum Req {
    Sotw(SotwRequest),
    Delta(DeltaRequest),
}

impl Server {
    fn new(delta: bool) -> Self {
        if delta {
            Server::Delta(DeltaAds::new())
        } else {
            Server::Sotw(SotwAds::new())
        }
    }
    fn snapshot(&mut self, set: &ResourceSet<u32>, v: u64) {
        match self {
            Server::Sotw(s) => s.on_snapshot(set, v),
            Server::Delta(s) => s.on_snapshot(set, v),
        };
    }
    fn deliver(&mut self, req: &Req) {
        match (self, req) {
            (Server::Sotw(s), Req::Sotw(r)) => {
                s.on_request(r);
            }
            (Server::Delta(s), Req::Delta(r)) => {
                s.on_request(r);
            }
            _ => unreachable!(),
        }
    }
    fn poll(&mut self) -> Option<Resp> {
        let cds_awaiting_ack = match self {
            Server::Sotw(s) => s.get(CLUSTER).is_some_and(|m| m.awaiting_ack()),
            Server::Delta(s) => s.get(CLUSTER).is_some_and(|m| m.awaiting_ack()),
        };
        match self {
            Server::Sotw(s) => s.poll_response().map(|r| Resp {
                type_url: r.type_url,
                version: r.version,
                nonce: r.nonce.parse().unwrap(),
                resources: r
                    .resources
                    .iter()
                    .map(|(n, v)| (n.clone(), h(**v), **v))
                    .collect(),
                removed: Vec::new(),
                cds_awaiting_ack,
            }),
            Server::Delta(s) => s.poll_response().map(|r| Resp {
                type_url: r.type_url,
                version: r.version,
                nonce: r.nonce.parse().unwrap(),
                resources: r
                    .resources
                    .iter()
                    .map(|x| (x.name.clone(), x.hash, *x.value))
                    .collect(),
                removed: r.removed_resources,
                cds_awaiting_ack,
            }),
        }
    }
    fn acked(&self, t: &str) -> Option<u64> {
        match self {
            Server::Sotw(s) => s.get(t).and_then(|m| m.acked_version()),
            Server::Delta(s) => s.get(t).and_then(|m| m.acked_version()),
        }
    }
    fn stats(&self) -> StreamStats {
        match self {
            Server::Sotw(s) => s.stats(),
            Server::Delta(s) => s.stats(),
        }
    }
}

#[derive(Default)]
struct TypeView {
    /// Accepted resources.
    view: BTreeMap<Name, u32>,
    /// Last content received per name (accepted or rejected), this stream or announced.
    received: BTreeMap<Name, ContentHash>,
    /// Explicit subscription (EDS, RDS); CDS/LDS are wildcard.
    sub: BTreeSet<Name>,
    last_nonce: Option<u64>,
    acked: BTreeSet<u64>,
    last_request: Option<Req>,
    /// Names (re)subscribed on this stream: a response already in flight may have
    /// delivered them after the client subscribed again, so the server, which
    /// forgot them at the unsubscribe, may legitimately send them once more.
    fresh: BTreeSet<Name>,
}

struct World {
    delta: bool,
    snapshots: Vec<ResourceSet<u32>>, // index = version
    server: Server,
    c2s: VecDeque<Req>,
    s2c: VecDeque<Resp>,
    client: BTreeMap<&'static str, TypeView>,
    stream_nonce: u64,
    max_version: BTreeMap<&'static str, u64>,
    route_sub: BTreeSet<Name>,
}

fn wildcard(t: &str) -> bool {
    t == CLUSTER || t == LISTENER
}

impl World {
    fn new(delta: bool) -> Self {
        let mut w = World {
            delta,
            snapshots: vec![ResourceSet::new()],
            server: Server::new(delta),
            c2s: VecDeque::new(),
            s2c: VecDeque::new(),
            client: TYPES.iter().map(|t| (*t, TypeView::default())).collect(),
            stream_nonce: 0,
            max_version: BTreeMap::new(),
            route_sub: BTreeSet::from([Name::from("r0")]),
        };
        w.connect();
        w
    }

    fn latest(&self) -> (&ResourceSet<u32>, u64) {
        let v = self.snapshots.len() - 1;
        (&self.snapshots[v], v as u64)
    }

    fn connect(&mut self) {
        self.server = Server::new(self.delta);
        let (set, v) = self.latest();
        let set = set.clone();
        if v > 0 {
            self.server.snapshot(&set, v);
        }
        self.c2s.clear();
        self.s2c.clear();
        self.stream_nonce = 0;
        let clusters: BTreeSet<Name> = self.client[CLUSTER].view.keys().cloned().collect();
        let routes = self.route_sub.clone();
        for t in TYPES {
            let tv = self.client.get_mut(t).unwrap();
            tv.last_nonce = None;
            tv.acked.clear();
            tv.fresh.clear();
            // Delta: the server learns what the client holds from
            // `initial_resource_versions`. SotW: it knows nothing, and its first
            // response of each type is the complete set (so make-before-break cannot
            // span a SotW reconnect; see the crate docs).
            tv.received = if self.delta {
                tv.view.iter().map(|(n, v)| (n.clone(), h(*v))).collect()
            } else {
                BTreeMap::new()
            };
            tv.sub = match t {
                ENDPOINT => clusters.clone(),
                ROUTE => routes.clone(),
                _ => BTreeSet::new(),
            };
            // Explicit types: only keep what is subscribed.
            if !wildcard(t) {
                let sub = tv.sub.clone();
                tv.view.retain(|n, _| sub.contains(n));
                tv.received.retain(|n, _| sub.contains(n));
            }
        }
        for t in TYPES {
            let req = if self.delta {
                let tv = &self.client[t];
                Req::Delta(DeltaRequest {
                    type_url: t.into(),
                    resource_names_subscribe: tv.sub.iter().map(|n| n.to_string()).collect(),
                    initial_resource_versions: tv
                        .view
                        .iter()
                        .map(|(n, v)| (n.to_string(), h(*v).to_hex()))
                        .collect(),
                    ..DeltaRequest::default()
                })
            } else {
                self.sotw_request(t, None)
            };
            self.send(t, req);
        }
        // The server drains the requests a reconnecting client sends together before
        // it polls (the async server's rule), so it knows every type the client held.
        while let Some(req) = self.c2s.pop_front() {
            self.server.deliver(&req);
        }
    }

    fn sotw_request(&self, t: &str, error: Option<String>) -> Req {
        let tv = &self.client[t];
        Req::Sotw(SotwRequest {
            type_url: t.into(),
            version_info: tv.acked.last().map(|v| v.to_string()).unwrap_or_default(),
            resource_names: tv.sub.iter().map(|n| n.to_string()).collect(),
            response_nonce: tv.last_nonce.map(|n| n.to_string()).unwrap_or_default(),
            error_detail: error,
        })
    }

    fn send(&mut self, t: &'static str, req: Req) {
        self.client.get_mut(t).unwrap().last_request = Some(req.clone());
        self.c2s.push_back(req);
    }

    /// Changes an explicit subscription (EDS or RDS) and tells the server.
    fn resubscribe(&mut self, t: &'static str, next: BTreeSet<Name>) {
        let tv = self.client.get_mut(t).unwrap();
        if tv.sub == next {
            return;
        }
        let added: Vec<String> = next.difference(&tv.sub).map(|n| n.to_string()).collect();
        let dropped: Vec<String> = tv.sub.difference(&next).map(|n| n.to_string()).collect();
        for n in &dropped {
            tv.view.remove(n.as_str());
            tv.received.remove(n.as_str());
        }
        tv.fresh.extend(next.difference(&tv.sub).cloned());
        tv.sub = next;
        let req = if self.delta {
            Req::Delta(DeltaRequest {
                type_url: t.into(),
                resource_names_subscribe: added,
                resource_names_unsubscribe: dropped,
                response_nonce: tv.last_nonce.map(|n| n.to_string()).unwrap_or_default(),
                ..DeltaRequest::default()
            })
        } else {
            self.sotw_request(t, None)
        };
        self.send(t, req);
    }

    fn client_read(&mut self) -> Result<(), TestCaseError> {
        let Some(r) = self.s2c.pop_front() else {
            return Ok(());
        };
        let t: &'static str = TYPES.into_iter().find(|t| **t == *r.type_url).unwrap();
        let snap = self.snapshots[r.version as usize].clone();
        // Nonces increase; versions never go back.
        prop_assert!(
            r.nonce > self.stream_nonce,
            "nonce {} after {}",
            r.nonce,
            self.stream_nonce
        );
        self.stream_nonce = r.nonce;
        let max = self.max_version.entry(t).or_default();
        prop_assert!(
            r.version >= *max,
            "{t}: version {} after {}",
            r.version,
            *max
        );
        *max = r.version;

        let tv = &self.client[t];
        let arriving: Vec<&(Name, ContentHash, u32)> = r
            .resources
            .iter()
            .filter(|(n, hash, _)| tv.received.get(n) != Some(hash))
            .filter(|(n, _, _)| wildcard(t) || tv.sub.contains(n))
            .collect();
        if self.delta {
            let resent: Vec<&Name> = r
                .resources
                .iter()
                .filter(|(n, hash, _)| tv.received.get(n) == Some(hash))
                .filter(|(n, _, _)| !tv.fresh.contains(n))
                .map(|(n, _, _)| n)
                .collect();
            prop_assert!(
                resent.is_empty(),
                "Delta resent {:?} unchanged: {:?}",
                resent,
                r
            );
        }
        // Removals: Delta's removed list; SotW names held but absent and gone.
        let removals: Vec<Name> = if self.delta {
            r.removed.clone()
        } else {
            tv.received
                .keys()
                .filter(|n| !r.resources.iter().any(|(x, _, _)| x == *n))
                .filter(|n| snap.get(t, n).is_none())
                .cloned()
                .collect()
        };
        // Ordering: a response that brings new content needs every earlier type
        // complete — except endpoints (asked for by name: EDS is never wildcard here)
        // produced while a CDS response awaited its ACK.
        let eds_while_cds_unacked = t == ENDPOINT && r.cds_awaiting_ack;
        if !arriving.is_empty() && !eds_while_cds_unacked {
            for u in [CLUSTER, LISTENER] {
                if make_rank(u) < make_rank(t) {
                    self.complete(u, &snap)
                        .map_err(|e| TestCaseError::fail(format!("{t} make before {u}: {e}")))?;
                }
            }
            if t == ENDPOINT {
                for (n, _, _) in &arriving {
                    let want = snap.get(CLUSTER, n).map(|e| e.hash());
                    prop_assert_eq!(
                        self.client[CLUSTER].received.get(n).copied(),
                        want,
                        "EDS {} arrived before its cluster",
                        n
                    );
                }
            }
        }
        if !removals.is_empty() {
            for u in [LISTENER, ROUTE, CLUSTER] {
                if break_rank(u) < break_rank(t) {
                    self.no_stale_referrer(u, &snap).map_err(|e| {
                        TestCaseError::fail(format!("{t} removal {removals:?} before {u}: {e}"))
                    })?;
                }
            }
        }

        // Apply: valid resources are accepted, invalid ones rejected individually.
        let tv = self.client.get_mut(t).unwrap();
        for (n, hash, _) in &r.resources {
            if tv.received.get(n) == Some(hash) {
                tv.fresh.remove(n);
            }
        }
        let mut rejected = Vec::new();
        if !self.delta {
            let present: BTreeSet<&Name> = r.resources.iter().map(|(n, _, _)| n).collect();
            tv.view.retain(|n, _| present.contains(n));
            tv.received.retain(|n, _| present.contains(n));
        }
        for n in &r.removed {
            tv.view.remove(n);
            tv.received.remove(n);
        }
        for (n, hash, v) in &r.resources {
            if !wildcard(t) && !tv.sub.contains(n) {
                continue;
            }
            tv.received.insert(n.clone(), *hash);
            if *v >= INVALID {
                rejected.push(n.to_string());
            } else {
                tv.view.insert(n.clone(), *v);
            }
        }
        tv.last_nonce = Some(r.nonce);
        let error = (!rejected.is_empty()).then(|| format!("rejected {rejected:?}"));
        if error.is_none() {
            tv.acked.insert(r.version);
        }
        let req = if self.delta {
            Req::Delta(DeltaRequest {
                type_url: t.into(),
                response_nonce: r.nonce.to_string(),
                error_detail: error,
                ..DeltaRequest::default()
            })
        } else {
            self.sotw_request(t, error)
        };
        self.send(t, req);
        if t == CLUSTER {
            let clusters = self.client[CLUSTER].view.keys().cloned().collect();
            self.resubscribe(ENDPOINT, clusters);
        }
        Ok(())
    }

    /// Whether the client received (wildcard) type `u` completely at `snap`.
    fn complete(&self, u: &str, snap: &ResourceSet<u32>) -> Result<(), String> {
        let tv = &self.client[u];
        for (n, e) in snap.iter_type(u) {
            if tv.received.get(n) != Some(&e.hash()) {
                return Err(format!("{n} not received at the snapshot's content"));
            }
        }
        Ok(())
    }

    /// Whether every resource of `u` the client holds is at `snap`'s content: no
    /// referrer that the snapshot changed or removed is still held.
    fn no_stale_referrer(&self, u: &str, snap: &ResourceSet<u32>) -> Result<(), String> {
        for (n, hash) in &self.client[u].received {
            if snap.get(u, n).map(|e| e.hash()) != Some(*hash) {
                return Err(format!("{n} still held at older content"));
            }
        }
        Ok(())
    }

    fn check_server(&self) -> Result<(), TestCaseError> {
        for t in TYPES {
            if let Some(v) = self.server.acked(t) {
                prop_assert!(
                    self.client[t].acked.contains(&v),
                    "{t}: server counts version {v} as ACKed; the client ACKed {:?}",
                    self.client[t].acked
                );
            }
        }
        let stats = self.server.stats();
        let universe = 2 * CLUSTERS.len() + LISTENERS.len() + ROUTES.len();
        prop_assert!(
            stats.held <= universe && stats.pending <= universe,
            "{stats:?}"
        );
        prop_assert!(
            self.s2c.len() <= TYPES.len(),
            "more than one response per type in flight"
        );
        Ok(())
    }

    fn step(&mut self, op: &Op) -> Result<(), TestCaseError> {
        match op {
            Op::Publish(edits) => {
                let (prev, _) = self.latest();
                let next = apply(prev, edits);
                self.snapshots.push(next.clone());
                let v = self.snapshots.len() as u64 - 1;
                self.server.snapshot(&next, v);
            }
            Op::LateSnapshot => {
                let v = self.snapshots.len() / 2;
                if v > 0 {
                    let old = self.snapshots[v].clone();
                    self.server.snapshot(&old, v as u64);
                }
            }
            Op::Deliver => {
                if let Some(req) = self.c2s.pop_front() {
                    self.server.deliver(&req);
                }
            }
            Op::Poll => {
                if let Some(r) = self.server.poll() {
                    self.s2c.push_back(r);
                }
            }
            Op::ClientRead => self.client_read()?,
            Op::SubscribeRoutes(mask) => {
                let next = ROUTES
                    .iter()
                    .zip(mask)
                    .filter(|(_, m)| **m)
                    .map(|(r, _)| Name::from(*r))
                    .collect::<BTreeSet<_>>();
                self.route_sub = next.clone();
                self.resubscribe(ROUTE, next);
            }
            Op::Duplicate => {
                let last = TYPES
                    .iter()
                    .filter_map(|t| self.client[t].last_request.clone())
                    .next_back();
                if let Some(req) = last {
                    // Duplicated ACK/NACK or subscription change, with its old nonce.
                    let req = match req {
                        Req::Delta(mut d) => {
                            d.resource_names_subscribe.clear();
                            d.resource_names_unsubscribe.clear();
                            d.initial_resource_versions.clear();
                            Req::Delta(d)
                        }
                        sotw => sotw,
                    };
                    self.c2s.push_back(req);
                }
            }
            Op::Reconnect => self.connect(),
        }
        self.check_server()
    }

    /// Fixes every invalid resource, then runs the stream until nothing moves.
    fn finish(&mut self) -> Result<(), TestCaseError> {
        let (prev, _) = self.latest();
        let mut fix = Vec::new();
        for (t, names) in [
            (CLUSTER, &CLUSTERS[..]),
            (ENDPOINT, &CLUSTERS[..]),
            (LISTENER, &LISTENERS[..]),
            (ROUTE, &ROUTES[..]),
        ] {
            for (i, n) in names.iter().enumerate() {
                if prev.get(t, n).is_some_and(|e| **e.value() >= INVALID) {
                    let v = 50 + i as u32;
                    fix.push(match t {
                        CLUSTER => Edit::Cluster(i, Some(v)),
                        ENDPOINT => Edit::Endpoint(i, v),
                        LISTENER => Edit::Listener(i, Some(v)),
                        _ => Edit::Route(i, Some(v)),
                    });
                }
            }
        }
        self.step(&Op::Publish(fix))?;
        for _ in 0..1000 {
            let before = (self.c2s.len(), self.s2c.len());
            while let Some(req) = self.c2s.pop_front() {
                self.server.deliver(&req);
                self.check_server()?;
            }
            while let Some(r) = self.server.poll() {
                self.s2c.push_back(r);
            }
            self.check_server()?;
            let read = !self.s2c.is_empty();
            while !self.s2c.is_empty() {
                self.client_read()?;
            }
            if !read && before == (0, 0) && self.c2s.is_empty() {
                break;
            }
        }
        let (set, _) = self.latest();
        for t in TYPES {
            let tv = &self.client[t];
            let want: BTreeMap<Name, u32> = set
                .iter_type(t)
                .filter(|(n, _)| wildcard(t) || tv.sub.contains(*n))
                .map(|(n, e)| (n.clone(), **e.value()))
                .collect();
            prop_assert_eq!(&tv.view, &want, "{} did not converge", t);
        }
        let clusters: BTreeSet<Name> = set.iter_type(CLUSTER).map(|(n, _)| n.clone()).collect();
        prop_assert_eq!(&self.client[ENDPOINT].sub, &clusters);
        Ok(())
    }
}

fn run(delta: bool, ops: &[Op]) -> Result<(), TestCaseError> {
    let mut w = World::new(delta);
    for op in ops {
        w.step(op)?;
    }
    w.finish()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    /// SotW ADS against the model client. Fails under the mutants `xds-stale-nonce`,
    /// `xds-eds-before-cds`, `xds-break-before-make` and `xds-snapshot-regress`
    /// (`xds-unsubscribed-response` is caught by the protocol unit tests).
    #[test]
    fn sotw_stream_matches_the_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(false, &ops)?;
    }

    /// Delta ADS against the model client. Fails under the same mutants as the SotW one.
    #[test]
    fn delta_stream_matches_the_model(ops in proptest::collection::vec(op(), 1..80)) {
        run(true, &ops)?;
    }
}

/// Memory is bounded whatever the publish rate: a stream that never reads sees
/// thousands of publishes and keeps only the latest state.
#[test]
fn a_stream_that_does_not_read_stays_bounded_under_many_publishes() {
    for delta in [false, true] {
        let mut w = World::new(delta);
        for i in 0..2000u32 {
            let v = 1 + i % 19;
            w.step(&Op::Publish(vec![
                Edit::Cluster((i % 4) as usize, Some(v)),
                Edit::Endpoint((i % 4) as usize, v),
                Edit::Route((i % 3) as usize, Some(v)),
            ]))
            .unwrap();
            if i < 8 {
                w.step(&Op::Deliver).unwrap();
                w.step(&Op::Poll).unwrap();
            }
        }
        let stats = w.server.stats();
        assert!(stats.held + stats.pending <= 26, "{stats:?}");
        w.finish().unwrap();
    }
}
