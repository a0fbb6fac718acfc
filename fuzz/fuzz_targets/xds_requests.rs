//! Fuzzes flock-xds's protocol layer: one SotW and one Delta ADS stream (the pure
//! state machines, no gRPC) are fed an input-chosen sequence of requests (known and
//! junk type URLs, names from a small alphabet with `*` and "", latest/stale/junk
//! nonces, NACKs, initial versions, and raw bytes decoded as Envoy's
//! `DiscoveryRequest`/`DeltaDiscoveryRequest`), new and out-of-order snapshots of a
//! `ResourceSet<u32>`, and polls. After every step it checks:
//!
//! * only newer snapshots are taken (R1 per stream);
//! * nonces are decimal and strictly increasing on a stream (never reused);
//! * versions per type never decrease, and a response is at the stream's snapshot;
//! * SotW: resources in name order, each subscribed, each at the snapshot's content or
//!   (a change withheld by the ADS ordering gate) at the content the client holds;
//! * Delta: the machine's subscription follows the documented rules (an independent
//!   model); each resource subscribed and at the snapshot's hash; removals are
//!   subscribed names absent from the snapshot and not also upserted;
//! * at the end, once the client ACKs everything, both streams go quiet and the client
//!   holds exactly the subscribed resources of its stream's snapshot, for every type.
//!
//! `XDS_FUZZ_TRACE=1` prints every step when replaying an input.

#![no_main]

use envoy_types::pb::envoy::service::discovery::v3::{DeltaDiscoveryRequest, DiscoveryRequest};
use flock_core::ContentHash;
use flock_core::resources::{Name, ResourceSet};
use flock_xds::protocol::{DeltaAds, DeltaRequest, SotwAds, SotwRequest, Subscription};
use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, SECRET, WILDCARD};
use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use prost::Message;
use std::collections::{BTreeMap, BTreeSet};

/// `XDS_FUZZ_TRACE=1` prints every step (to read a crash input).
fn tracing() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("XDS_FUZZ_TRACE").is_some())
}

macro_rules! trace {
    ($($arg:tt)*) => {
        if tracing() {
            eprintln!($($arg)*);
        }
    };
}

const JUNK_TYPE: &str = "type.googleapis.com/junk.v3.Thing";
const TYPES: [&str; 7] = [LISTENER, ROUTE, CLUSTER, ENDPOINT, SECRET, JUNK_TYPE, ""];
/// Names resources may have.
const RESOURCE_NAMES: [&str; 5] = ["a", "b", "c", "d", ""];
/// Names requests may carry: the above, the wildcard, and one that never exists.
const REQUEST_NAMES: [&str; 7] = ["a", "b", "c", "d", "", WILDCARD, "zz"];
const JUNK_NONCES: [&str; 6] = ["x", "0", "-1", " 1", "18446744073709551616", "1e3"];

fn hash(v: u32) -> ContentHash {
    ContentHash::of(&v.to_le_bytes())
}

fn pick<'a>(u: &mut Unstructured<'_>, from: &[&'a str]) -> Result<&'a str> {
    Ok(*u.choose(from)?)
}

fn names(u: &mut Unstructured<'_>, max: u8) -> Result<Vec<String>> {
    let n = u.int_in_range(0..=max)?;
    (0..n)
        .map(|_| Ok(pick(u, &REQUEST_NAMES)?.to_string()))
        .collect()
}

/// What one stream sent, per type and overall.
#[derive(Default)]
struct Sent {
    last_nonce: u64,
    /// The type of the last response.
    last_type: String,
    /// Per type: every nonce sent (in order) and the last version.
    per_type: BTreeMap<String, (Vec<String>, u64)>,
}

impl Sent {
    /// A nonce for a request of `type_url`: none, the latest of the type, an older one
    /// of the type, the stream's latest (maybe another type's), the next one, or junk.
    fn nonce(&self, u: &mut Unstructured<'_>, type_url: &str) -> Result<String> {
        let of_type = self.per_type.get(type_url).map(|(n, _)| n.as_slice());
        Ok(match u.int_in_range(0..=5u8)? {
            0 => String::new(),
            1 => of_type.and_then(|n| n.last().cloned()).unwrap_or_default(),
            2 => match of_type {
                Some(n) if !n.is_empty() => n[u.choose_index(n.len())?].clone(),
                _ => String::new(),
            },
            3 => self.last_nonce.to_string(),
            4 => (self.last_nonce + 1).to_string(),
            _ => pick(u, &JUNK_NONCES)?.to_string(),
        })
    }

    /// Checks and records one response's nonce and version.
    fn record(&mut self, type_url: &str, nonce: &str, version: u64, stream_version: u64) {
        let n: u64 = nonce.parse().expect("nonces are decimal");
        assert!(n > self.last_nonce, "nonce {n} after {}", self.last_nonce);
        self.last_nonce = n;
        assert!(version >= 1, "version 0 is never sent");
        assert_eq!(
            version, stream_version,
            "a response is built at the stream's snapshot"
        );
        let entry = self.per_type.entry(type_url.to_string()).or_default();
        assert!(
            version >= entry.1,
            "{type_url}: version {version} after {}",
            entry.1
        );
        entry.1 = version;
        entry.0.push(nonce.to_string());
        self.last_type = type_url.to_string();
    }
}

/// The Delta subscription rules of the crate docs, kept independently of the machine.
#[derive(Default, Debug)]
struct DeltaModel {
    requested: bool,
    wildcard: bool,
    legacy: bool,
    names: BTreeSet<String>,
}

impl DeltaModel {
    fn apply(&mut self, req: &DeltaRequest) {
        if !self.requested
            && req.resource_names_subscribe.is_empty()
            && (req.type_url == LISTENER || req.type_url == CLUSTER)
        {
            self.legacy = true;
        }
        self.requested = true;
        for n in &req.resource_names_subscribe {
            if n == WILDCARD {
                self.wildcard = true;
            } else {
                self.names.insert(n.clone());
            }
        }
        for n in &req.resource_names_unsubscribe {
            if n == WILDCARD {
                self.wildcard = false;
                self.legacy = false;
            } else {
                self.names.remove(n);
            }
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.wildcard || self.legacy || self.names.contains(name)
    }

    fn check(&self, type_url: &str, sub: &Subscription) {
        assert_eq!(
            (self.wildcard || self.legacy, &self.names),
            (
                sub.is_wildcard(),
                &sub.names().iter().map(|n| n.to_string()).collect()
            ),
            "{type_url}: Delta subscription differs from the documented rules"
        );
    }
}

fn dump(set: &ResourceSet<u32>) -> Vec<(String, &str, u32)> {
    TYPES
        .iter()
        .flat_map(|t| {
            set.iter_type(t).map(move |(n, e)| {
                (
                    flock_xds::types::short_name(t).to_string(),
                    &**n,
                    **e.value(),
                )
            })
        })
        .collect()
}

struct Harness {
    /// Every published set; index = version (0: the empty "not set" one).
    sets: Vec<ResourceSet<u32>>,
    sotw: SotwAds<u32>,
    delta: DeltaAds<u32>,
    sotw_sent: Sent,
    delta_sent: Sent,
    delta_model: BTreeMap<String, DeltaModel>,
    /// What the SotW client holds per type: the content of the last response.
    sotw_client: BTreeMap<String, BTreeMap<String, u32>>,
    /// What the Delta client holds per type: name -> version string.
    delta_client: BTreeMap<String, BTreeMap<String, String>>,
}

impl Harness {
    fn new() -> Self {
        Self {
            sets: vec![ResourceSet::new()],
            sotw: SotwAds::new(),
            delta: DeltaAds::new(),
            sotw_sent: Sent::default(),
            delta_sent: Sent::default(),
            delta_model: BTreeMap::new(),
            sotw_client: BTreeMap::new(),
            delta_client: BTreeMap::new(),
        }
    }

    fn latest(&self) -> u64 {
        (self.sets.len() - 1) as u64
    }

    fn publish(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        let prev = self.sets.last().expect("never empty");
        let mut b = if u.ratio(1, 8)? {
            // Not derived from the previous set: streams diff by the full walk.
            let mut b = ResourceSet::new().edit();
            for t in TYPES {
                for (n, e) in prev.iter_type(t) {
                    b.upsert_shared(t, n, e.hash(), e.value().clone());
                }
            }
            b
        } else {
            prev.edit()
        };
        for _ in 0..u.int_in_range(0..=4u8)? {
            let t = pick(u, &TYPES)?;
            let n = pick(u, &RESOURCE_NAMES)?;
            if u.ratio(1, 3)? {
                b.remove(t, n);
            } else {
                let v = u.int_in_range(0..=3u32)?;
                b.upsert(t, n, hash(v), v);
            }
        }
        let set = b.build();
        trace!("publish v{}: {:?}", self.sets.len(), dump(&set));
        self.sets.push(set);
        Ok(())
    }

    /// Feeds a snapshot to a stream: usually the latest, sometimes an older one (the
    /// server's tasks may deliver out of order; the stream must ignore it).
    fn deliver(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        let version = if u.ratio(3, 4)? {
            self.latest()
        } else {
            u.int_in_range(0..=self.latest())?
        };
        let set = &self.sets[version as usize];
        let sotw = u.ratio(1, 2)?;
        trace!(
            "deliver v{version} to {}",
            if sotw { "sotw" } else { "delta" }
        );
        if sotw {
            let before = self.sotw.version();
            let taken = self.sotw.on_snapshot(set, version);
            assert_eq!(taken, version > before, "only newer snapshots are taken");
        } else {
            let before = self.delta.version();
            let taken = self.delta.on_snapshot(set, version);
            assert_eq!(taken, version > before, "only newer snapshots are taken");
        }
        Ok(())
    }

    fn sotw_request(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        let type_url = pick(u, &TYPES)?.to_string();
        let req = SotwRequest {
            resource_names: names(u, 4)?,
            response_nonce: self.sotw_sent.nonce(u, &type_url)?,
            version_info: if u.ratio(1, 2)? {
                self.sotw.version().to_string()
            } else {
                String::new()
            },
            error_detail: if u.ratio(1, 4)? {
                Some(pick(u, &["bad", "", "rejected: x"])?.to_string())
            } else {
                None
            },
            type_url,
        };
        self.feed_sotw(&req);
        Ok(())
    }

    fn feed_sotw(&mut self, req: &SotwRequest) {
        let outcome = self.sotw.on_request(req);
        trace!("sotw <- {req:?}: {:?}", outcome.kind);
        // The client drops what it no longer subscribes to: the server forgets such
        // names without a response (see the crate docs).
        let sub = self
            .sotw
            .get(&req.type_url)
            .expect("machine of a requested type")
            .subscription();
        if let Some(held) = self.sotw_client.get_mut(&req.type_url) {
            held.retain(|n, _| sub.contains(n));
        }
        assert_eq!(&*outcome.type_url, req.type_url.as_str());
    }

    fn delta_request(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        let type_url = pick(u, &TYPES)?.to_string();
        let mut initial = BTreeMap::new();
        if u.ratio(1, 4)? {
            for _ in 0..u.int_in_range(1..=3u8)? {
                let n = pick(u, &REQUEST_NAMES)?.to_string();
                let version = match u.int_in_range(0..=2u8)? {
                    0 => hash(u.int_in_range(0..=3u32)?).to_hex(),
                    1 => String::new(),
                    _ => "junk".to_string(),
                };
                initial.insert(n, version);
            }
        }
        let req = DeltaRequest {
            resource_names_subscribe: names(u, 3)?,
            resource_names_unsubscribe: names(u, 2)?,
            initial_resource_versions: initial,
            response_nonce: self.delta_sent.nonce(u, &type_url)?,
            error_detail: if u.ratio(1, 4)? {
                Some("rejected".to_string())
            } else {
                None
            },
            type_url,
        };
        self.feed_delta(&req);
        Ok(())
    }

    fn feed_delta(&mut self, req: &DeltaRequest) {
        let outcome = self.delta.on_request(req);
        trace!("delta <- {req:?}: {:?}", outcome.kind);
        assert_eq!(&*outcome.type_url, req.type_url.as_str());
        let model = self.delta_model.entry(req.type_url.clone()).or_default();
        let first = !model.requested;
        model.apply(req);
        // The client: announces what it holds on its first request, and drops what it
        // no longer subscribes to.
        let held = self.delta_client.entry(req.type_url.clone()).or_default();
        if first {
            held.extend(req.initial_resource_versions.clone());
        }
        held.retain(|n, _| model.contains(n));
        let machine = self
            .delta
            .get(&req.type_url)
            .expect("machine of a requested type");
        model.check(&req.type_url, machine.subscription());
    }

    /// Raw bytes through prost, converted field by field as a server would.
    fn raw_request(&mut self, u: &mut Unstructured<'_>) -> Result<()> {
        let delta = u.ratio(1, 2)?;
        let len = u.int_in_range(0..=64usize)?;
        let bytes = u.bytes(len)?;
        if delta {
            if let Ok(r) = DeltaDiscoveryRequest::decode(bytes) {
                let req = DeltaRequest {
                    type_url: r.type_url,
                    resource_names_subscribe: r.resource_names_subscribe,
                    resource_names_unsubscribe: r.resource_names_unsubscribe,
                    initial_resource_versions: r.initial_resource_versions.into_iter().collect(),
                    response_nonce: r.response_nonce,
                    error_detail: r.error_detail.map(|e| e.message),
                };
                self.feed_delta(&req);
            }
        } else if let Ok(r) = DiscoveryRequest::decode(bytes) {
            let req = SotwRequest {
                type_url: r.type_url,
                version_info: r.version_info,
                resource_names: r.resource_names,
                response_nonce: r.response_nonce,
                error_detail: r.error_detail.map(|e| e.message),
            };
            self.feed_sotw(&req);
        }
        Ok(())
    }

    fn poll_sotw(&mut self) -> bool {
        let Some(resp) = self.sotw.poll_response() else {
            return false;
        };
        trace!("sotw -> {resp:?}");
        let t: &str = &resp.type_url;
        self.sotw_sent
            .record(t, &resp.nonce, resp.version, self.sotw.version());
        assert_eq!(resp.version_info, resp.version.to_string());
        let sub = self
            .sotw
            .get(t)
            .expect("a response of a requested type")
            .subscription();
        let set = &self.sets[resp.version as usize];
        let got: Vec<(&str, u32)> = resp.resources.iter().map(|(n, v)| (&**n, **v)).collect();
        for w in got.windows(2) {
            assert!(
                w[0].0 < w[1].0,
                "{t}: SotW resources not in name order: {got:?}"
            );
        }
        for (n, _) in &got {
            assert!(
                sub.contains(n),
                "{t}: SotW sent unsubscribed {n:?} ({sub:?})"
            );
        }
        // Under the ADS ordering gate a change may be withheld: the name is then sent
        // at the content the client holds (or left out), a removal not yet sent keeps
        // the held content. Everything else is the snapshot's content.
        let held = self.sotw_client.entry(t.to_string()).or_default();
        for (n, v) in &got {
            let current = set.get(t, n).map(|e| **e.value());
            assert!(
                current == Some(*v) || held.get(*n) == Some(v),
                "{t}: SotW sent {n:?}={v} at v{}: neither the snapshot's {current:?} nor held {:?}",
                resp.version,
                held.get(*n)
            );
        }
        for (n, e) in set.iter_type(t).filter(|(n, _)| sub.contains(n)) {
            if !got.iter().any(|(g, _)| g == &&**n) {
                assert!(
                    !held.contains_key(&**n) || held[&**n] != **e.value(),
                    "{t}: SotW left out {n:?}, which the client holds at the current content"
                );
            }
        }
        *held = got.iter().map(|(n, v)| (n.to_string(), *v)).collect();
        true
    }

    /// The client ACKs everything until both streams are quiet (which must happen:
    /// each ACK releases at most the pending work), then holds exactly the subscribed
    /// resources of its stream's snapshot, for every type it requested.
    fn drain_and_check(&mut self) {
        // First answer every response still in flight (the input may have left some).
        let types: Vec<String> = self.sotw_sent.per_type.keys().cloned().collect();
        for t in types {
            self.ack_sotw(t);
        }
        let types: Vec<String> = self.delta_sent.per_type.keys().cloned().collect();
        for t in types {
            self.ack_delta(t);
        }
        let mut quiet = false;
        for _ in 0..256 {
            let mut any = false;
            if self.poll_sotw() {
                any = true;
                self.ack_sotw(self.sotw_sent.last_type.clone());
            }
            if self.poll_delta() {
                any = true;
                self.ack_delta(self.delta_sent.last_type.clone());
            }
            if !any {
                quiet = true;
                break;
            }
        }
        assert!(quiet, "streams still sending after 256 ACKed responses");
        let version = self.sotw.version();
        if version > 0 {
            let set = &self.sets[version as usize];
            for (t, held) in &self.sotw_client {
                let sub = self.sotw.get(t).expect("requested").subscription();
                let want: BTreeMap<String, u32> = set
                    .iter_type(t)
                    .filter(|(n, _)| sub.contains(n))
                    .map(|(n, e)| (n.to_string(), **e.value()))
                    .collect();
                assert_eq!(
                    held, &want,
                    "{t}: SotW client does not converge to v{version}"
                );
            }
        }
        let version = self.delta.version();
        if version > 0 {
            let set = &self.sets[version as usize];
            for (t, held) in &self.delta_client {
                let model = &self.delta_model[t];
                let want: BTreeMap<String, String> = set
                    .iter_type(t)
                    .filter(|(n, _)| model.contains(n))
                    .map(|(n, e)| (n.to_string(), e.hash().to_hex()))
                    .collect();
                if !self.delta_sent.per_type.contains_key(t) {
                    continue; // requested, never answered: checked below
                }
                assert_eq!(
                    held, &want,
                    "{t}: Delta client does not converge to v{version}"
                );
            }
        }
        for t in self.delta_model.keys() {
            if version > 0 {
                assert!(
                    self.delta_sent.per_type.contains_key(t),
                    "{t}: requested on a stream with a snapshot but never answered"
                );
            }
        }
    }

    /// ACKs the latest response of `t` on the SotW stream, repeating the subscription.
    fn ack_sotw(&mut self, t: String) {
        let sub = self.sotw.get(&t).expect("requested").subscription();
        let mut names: Vec<String> = sub.names().iter().map(|n| n.to_string()).collect();
        if sub.is_wildcard() {
            names.push(WILDCARD.to_string());
        }
        let nonce = self.sotw_sent.per_type[&t]
            .0
            .last()
            .cloned()
            .unwrap_or_default();
        let req = SotwRequest {
            type_url: t,
            resource_names: names,
            response_nonce: nonce,
            ..SotwRequest::default()
        };
        self.feed_sotw(&req);
    }

    /// ACKs the latest response of `t` on the Delta stream.
    fn ack_delta(&mut self, t: String) {
        let nonce = self.delta_sent.per_type[&t]
            .0
            .last()
            .cloned()
            .unwrap_or_default();
        let req = DeltaRequest {
            type_url: t,
            response_nonce: nonce,
            ..DeltaRequest::default()
        };
        self.feed_delta(&req);
    }

    fn poll_delta(&mut self) -> bool {
        let Some(resp) = self.delta.poll_response() else {
            return false;
        };
        trace!("delta -> {resp:?}");
        let t: &str = &resp.type_url;
        self.delta_sent
            .record(t, &resp.nonce, resp.version, self.delta.version());
        assert_eq!(resp.system_version_info, resp.version.to_string());
        let sub = self
            .delta
            .get(t)
            .expect("a response of a requested type")
            .subscription();
        let model = self.delta_model.get(t).expect("a requested type");
        let set = &self.sets[resp.version as usize];
        let mut seen: BTreeSet<&Name> = BTreeSet::new();
        for r in &resp.resources {
            assert!(
                seen.insert(&r.name),
                "{t}: {:?} twice in one response",
                r.name
            );
            assert!(
                sub.contains(&r.name) && model.contains(&r.name),
                "{t}: Delta sent unsubscribed {:?} ({sub:?})",
                r.name
            );
            let entry = set
                .get(t, &r.name)
                .unwrap_or_else(|| panic!("{t}: sent {:?}, absent at v{}", r.name, resp.version));
            assert_eq!(
                r.hash,
                entry.hash(),
                "{t}: {:?} not at its snapshot hash",
                r.name
            );
            assert_eq!(*r.value, **entry.value());
            assert_eq!(r.version(), r.hash.to_hex());
        }
        for n in &resp.removed_resources {
            assert!(
                seen.insert(n),
                "{t}: {n:?} both sent and removed, or removed twice"
            );
            assert!(
                sub.contains(n) && model.contains(n),
                "{t}: removal of unsubscribed {n:?} ({sub:?})"
            );
            assert!(
                set.get(t, n).is_none(),
                "{t}: removal of {n:?}, which exists at v{}",
                resp.version
            );
        }
        let held = self.delta_client.entry(t.to_string()).or_default();
        for r in &resp.resources {
            held.insert(r.name.to_string(), r.version());
        }
        for n in &resp.removed_resources {
            held.remove(&**n);
        }
        true
    }
}

fuzz_target!(|data: &[u8]| {
    let mut u = Unstructured::new(data);
    let mut h = Harness::new();
    let mut steps = 0;
    while !u.is_empty() && steps < 256 {
        steps += 1;
        let op = match u.int_in_range(0..=9u8) {
            Ok(op) => op,
            Err(_) => break,
        };
        let result = match op {
            0 => h.publish(&mut u).and_then(|()| h.deliver(&mut u)),
            1 => h.deliver(&mut u),
            2 | 3 => h.sotw_request(&mut u),
            4 | 5 => h.delta_request(&mut u),
            6 => h.raw_request(&mut u),
            7 => {
                for _ in 0..8 {
                    if !h.poll_sotw() {
                        break;
                    }
                }
                Ok(())
            }
            8 => {
                for _ in 0..8 {
                    if !h.poll_delta() {
                        break;
                    }
                }
                Ok(())
            }
            _ => h.publish(&mut u),
        };
        if result.is_err() {
            break;
        }
    }
    h.drain_and_check();
});
