//! Per-service connection-pool limits (kube mode): a Service's `flock.io/max-*`
//! annotations ([`flock_kube::map::POOL_ANNOTATIONS`]) become the circuit breakers of
//! its mesh clusters ([`translate::Service::pool`]) at each publish.
//!
//! The annotations are read from the reflectors' snapshot, as the Services' cluster
//! IPs are: each node's agent serves the same limits for a Service, since every
//! caller's Envoy holds its own connections to it. A Service whose annotations are
//! malformed keeps the mesh's defaults (a guessed limit could stop its traffic) and is
//! reported in the traffic-policy status (`/debug/routes`, `flockctl routes`) and
//! logged once. The annotated set is re-read only when the snapshot changes, and a
//! service whose base value and limits are unchanged keeps its very value (`Arc`), so
//! the translation's memo does not translate it again.

use super::routes::RouteStatus;
use flock_kube::map::{PoolLimits, service_pool};
use flock_kube::watch::Snapshot;
use flock_xds::translate::{self, policy::ConnectionPool};
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

type ServiceId = (String, String);

/// What the last publish applied: the annotated Services of the snapshot it read,
/// and per limited service its base value and the limited one.
#[derive(Default)]
pub(super) struct PoolCache {
    /// The snapshot `wanted` was read from. Held, not just its address: a later
    /// snapshot could be allocated where a dropped one was, and an equal address
    /// would then hide its changes.
    read: Option<Arc<Snapshot>>,
    /// Per annotated Service: its limits, or why its annotations are refused.
    wanted: BTreeMap<ServiceId, Result<ConnectionPool, String>>,
    entries: HashMap<ServiceId, (Arc<translate::Service>, Arc<translate::Service>)>,
    /// The refused annotations, as traffic-policy status entries.
    pub(super) status: Vec<RouteStatus>,
}

/// The mesh's default limits overridden by those `limits` sets.
pub fn pool_of(limits: &PoolLimits) -> ConnectionPool {
    let d = ConnectionPool::default();
    ConnectionPool {
        max_connections: limits.max_connections.unwrap_or(d.max_connections),
        max_pending_requests: limits
            .max_pending_requests
            .unwrap_or(d.max_pending_requests),
        max_requests: limits.max_requests.unwrap_or(d.max_requests),
        retry_budget_percent: limits
            .retry_budget_percent
            .unwrap_or(d.retry_budget_percent),
    }
}

/// `services` with each service whose Service (in `snapshot`) sets limits replaced by
/// one carrying them; the same list when none does.
pub(super) fn apply(
    snapshot: Option<&Arc<Snapshot>>,
    services: Arc<Vec<Arc<translate::Service>>>,
    cache: &mut PoolCache,
) -> Arc<Vec<Arc<translate::Service>>> {
    let same = match (snapshot, &cache.read) {
        (Some(now), Some(read)) => Arc::ptr_eq(now, read),
        (None, None) => true,
        _ => false,
    };
    if !same {
        cache.read = snapshot.cloned();
        let mut wanted = BTreeMap::new();
        for (id, svc) in snapshot.map(|s| s.services.iter()).into_iter().flatten() {
            match service_pool(svc) {
                Ok(None) => {}
                Ok(Some(limits)) => {
                    wanted.insert(id.clone(), Ok(pool_of(&limits)));
                }
                Err(e) => {
                    let message = format!("{}: {}", e.field, e.message);
                    if cache.wanted.get(id) != Some(&Err(message.clone())) {
                        tracing::warn!(
                            namespace = %id.0, service = %id.1, error = %message,
                            "connection-pool annotations refused; the Service keeps the default limits"
                        );
                    }
                    wanted.insert(id.clone(), Err(message));
                }
            }
        }
        cache.status = wanted
            .iter()
            .filter_map(|((ns, name), w)| {
                let e = w.as_ref().err()?;
                Some(RouteStatus {
                    key: format!("Service {ns}/{name}"),
                    origin: "connection-pool annotations".to_string(),
                    route: None,
                    state: "Refused",
                    problems: vec![e.clone()],
                })
            })
            .collect();
        cache.wanted = wanted;
    }
    if !cache.wanted.values().any(Result::is_ok) {
        cache.entries.clear();
        return services;
    }
    let mut kept = HashMap::new();
    let mut changed = false;
    let out: Vec<Arc<translate::Service>> = services
        .iter()
        .map(|s| {
            let id = (s.namespace.clone(), s.name.clone());
            let Some(Ok(pool)) = cache.wanted.get(&id) else {
                return Arc::clone(s);
            };
            changed = true;
            let limited = match cache.entries.remove(&id) {
                Some((base, limited))
                    if Arc::ptr_eq(&base, s) && limited.pool.as_ref() == Some(pool) =>
                {
                    limited
                }
                _ => Arc::new(translate::Service {
                    pool: Some(pool.clone()),
                    ..(**s).clone()
                }),
            };
            kept.insert(id, (Arc::clone(s), Arc::clone(&limited)));
            limited
        })
        .collect();
    cache.entries = kept;
    if changed { Arc::new(out) } else { services }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Service;

    fn snapshot(annotations: &[(&str, &str, &str, &str)]) -> Arc<Snapshot> {
        let mut snap = Snapshot::default();
        for (ns, name, key, value) in annotations {
            let svc: Service = serde_json::from_value(serde_json::json!({
                "metadata": {"name": name, "namespace": ns, "annotations": {*key: value}},
            }))
            .unwrap();
            snap.services
                .insert((ns.to_string(), name.to_string()), Arc::new(svc));
        }
        Arc::new(snap)
    }

    fn services(names: &[&str]) -> Arc<Vec<Arc<translate::Service>>> {
        Arc::new(
            names
                .iter()
                .map(|n| {
                    Arc::new(
                        serde_json::from_value(serde_json::json!({
                            "name": n, "namespace": "shop",
                            "ports": [{"port": 80, "protocol": "http"}],
                        }))
                        .unwrap(),
                    )
                })
                .collect(),
        )
    }

    #[test]
    fn annotated_services_carry_their_limits_and_keep_their_value_while_unchanged() {
        let mut cache = PoolCache::default();
        let base = services(&["api", "web"]);
        let snap = snapshot(&[("shop", "web", "flock.io/max-requests", "7")]);
        let out = apply(Some(&snap), Arc::clone(&base), &mut cache);
        assert!(Arc::ptr_eq(&out[0], &base[0]), "api has no annotation");
        let web = out[1].pool.clone().unwrap();
        assert_eq!(web.max_requests, 7);
        assert_eq!(
            web.max_connections,
            ConnectionPool::default().max_connections
        );
        // The next publish, same base and snapshot: the same value.
        let again = apply(Some(&snap), Arc::clone(&base), &mut cache);
        assert!(Arc::ptr_eq(&again[1], &out[1]));
        // A new snapshot with other limits: a new value.
        let snap = snapshot(&[("shop", "web", "flock.io/max-requests", "8")]);
        let changed = apply(Some(&snap), Arc::clone(&base), &mut cache);
        assert_eq!(changed[1].pool.as_ref().unwrap().max_requests, 8);
        // No annotation any more: the very list it was given.
        let none = apply(Some(&snapshot(&[])), Arc::clone(&base), &mut cache);
        assert!(Arc::ptr_eq(&none, &base));
        assert!(
            apply(None, Arc::clone(&base), &mut cache)
                .iter()
                .all(|s| s.pool.is_none())
        );
    }

    #[test]
    fn a_new_snapshot_is_read_even_where_the_last_one_was_freed() {
        // Each snapshot is dropped before the next is made, as the reflectors do
        // between two publishes: the allocator is free to put the next one at the
        // same address, which an address kept as a token would take for "unchanged".
        let mut cache = PoolCache::default();
        let base = services(&["web"]);
        for limit in 1..=20u32 {
            let snap = snapshot(&[("shop", "web", "flock.io/max-requests", &limit.to_string())]);
            let out = apply(Some(&snap), Arc::clone(&base), &mut cache);
            drop(snap);
            assert_eq!(out[0].pool.as_ref().unwrap().max_requests, limit);
        }
    }

    #[test]
    fn malformed_annotations_keep_the_defaults_and_are_reported() {
        let mut cache = PoolCache::default();
        let base = services(&["web"]);
        let snap = snapshot(&[("shop", "web", "flock.io/max-connections", "0")]);
        let out = apply(Some(&snap), Arc::clone(&base), &mut cache);
        assert!(Arc::ptr_eq(&out, &base));
        assert_eq!(cache.status.len(), 1);
        let s = &cache.status[0];
        assert_eq!(s.key, "Service shop/web");
        assert_eq!(s.state, "Refused");
        assert!(
            s.problems[0].contains("metadata.annotations[flock.io/max-connections]"),
            "{s:?}"
        );
        let fixed = snapshot(&[("shop", "web", "flock.io/max-connections", "3")]);
        let out = apply(Some(&fixed), base, &mut cache);
        assert_eq!(out[0].pool.as_ref().unwrap().max_connections, 3);
        assert!(cache.status.is_empty());
    }
}
