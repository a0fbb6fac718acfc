//! The one publish point: both node groups' snapshots, built inside the publish
//! closure (R1).

use super::{Agent, ENVOY_GROUP, GRPC_GROUP};
use envoy_types::pb::google::protobuf::Any;
use flock_core::resources::ResourceSet;
use flock_core::sync::lock;
use flock_xds::translate::{Entries, EnvoyOptions, Flavor, Locality, Memo};
use std::sync::atomic::Ordering;

/// What the publish keeps between publishes, behind the agent's one publish lock.
pub(super) struct PublishState {
    /// Each node group's translation memo.
    envoy_memo: Memo,
    grpc_memo: Memo,
    /// The registry's services, kept from the view's deltas.
    pub(super) services: super::services::ServiceTable,
    /// The identity view's secrets, kept per view.
    pub(super) secrets: Option<super::mesh::SecretsOf>,
    /// The pod models, kept per pod.
    pub(super) pods: super::mesh::PodsOf,
    /// The services with traffic-policy routes, resolved, and the routes' status.
    pub(super) routed: super::routes::RoutedCache,
    /// The services with connection-pool limits, and the refused annotations.
    pub(super) pools: super::pools::PoolCache,
    /// The reflectors' snapshot the last publish read (see `mesh_parts`).
    pub(super) kube_seen: Option<std::sync::Arc<flock_kube::watch::Snapshot>>,
}

impl PublishState {
    pub(super) fn new() -> Self {
        Self {
            envoy_memo: Memo::new(Flavor::Envoy),
            grpc_memo: Memo::new(Flavor::Grpc),
            services: super::services::ServiceTable::new(),
            secrets: None,
            pods: super::mesh::PodsOf::default(),
            routed: super::routes::RoutedCache::default(),
            pools: super::pools::PoolCache::default(),
            kube_seen: None,
        }
    }
}

/// `prev` with each type replaced by the translation's whole list.
fn replace_all(prev: &ResourceSet<Any>, entries: &Entries) -> ResourceSet<Any> {
    let mut b = prev.edit();
    for (type_url, list) in entries {
        b.replace_type(type_url, list.iter().cloned());
    }
    b.build()
}

impl Agent {
    /// Publishes the current state to both node groups; returns the Envoy group's
    /// version. The state is read inside the publish closure (R1). Publishes nothing
    /// (no version consumed) when nothing changed.
    pub fn publish(&self) -> u64 {
        // Endpoints in this node's zone, then region, are preferred (EDS priorities);
        // with neither set every endpoint is equal.
        let config = self.config();
        let opts = EnvoyOptions {
            local_locality: Some(Locality {
                region: config.region.clone(),
                zone: config.zone.clone(),
                sub_zone: String::new(),
            }),
            // With capture on, a captured pod's mTLS connections are made from its
            // own netns, so the callee's app sees the caller's pod address.
            capture_mark: (config.capture.setting != flock_core::capture::policy::Setting::Off)
                .then_some(config.capture.mark),
            denial_log_cluster: config.denial_log_cluster.clone(),
            access_log: config.access_log.clone(),
            tracing: config.tracing.clone(),
            // The agent's Envoy is on Delta ADS (its bootstrap): each outbound virtual
            // host is its own VHDS resource, so a route change replaces one service's
            // virtual hosts instead of every caller's whole route configuration.
            vhds: true,
            ..EnvoyOptions::default()
        };
        let mut version = 0;
        // Held for the whole publish: the memos, the service table and the pod models
        // each follow one line of snapshots.
        let mut state = lock(&self.publish);
        let state = &mut *state;
        for group in [ENVOY_GROUP, GRPC_GROUP] {
            let publisher = self.cache.publisher(group);
            // The very first snapshot is published even if empty: clients wait for
            // it, and readiness needs it.
            let first = publisher.latest().version() == 0;
            let published = publisher.try_publish(|prev| {
                let view = self.registry.view().borrow().clone();
                let parts = self.mesh_parts(state, &view);
                let memo = if group == ENVOY_GROUP {
                    &mut state.envoy_memo
                } else {
                    &mut state.grpc_memo
                };
                if self.config().publish_from_scratch {
                    // The benchmarks' baseline: a fresh memo translates and encodes
                    // every service and pod again, as every publish did before the
                    // translation was incremental.
                    *memo = Memo::new(if group == ENVOY_GROUP {
                        Flavor::Envoy
                    } else {
                        Flavor::Grpc
                    });
                }
                let translation =
                    memo.translate_shared(&parts.services, &parts.pods, &parts.secrets, &opts);
                #[allow(unused_mut)]
                let mut changes = memo.take_changes();
                #[cfg(feature = "fault-injection")]
                let poisoned = if group == ENVOY_GROUP
                    && super::fault::armed()
                    && self.store.dir().join(super::fault::SWITCH).exists()
                {
                    // What is published is not what the memo translated: the next
                    // publish starts from the whole lists again.
                    memo.forget_output();
                    changes = None;
                    Some(super::fault::poison_if_armed(
                        translation.entries(),
                        self.store.dir(),
                    ))
                } else {
                    None
                };
                #[cfg(not(feature = "fault-injection"))]
                let poisoned: Option<Entries> = None;
                let next = match (changes, poisoned) {
                    (_, Some(entries)) => replace_all(prev, &entries),
                    // O(changed entities): the memo's changes applied to the set its
                    // previous translation built.
                    (Some(changes), None) => {
                        let next = changes.apply(prev);
                        // A cheap check that the two agree (every entry list of a valid
                        // mesh names each resource once): else the whole lists.
                        if translation.counts_match(&next) {
                            next
                        } else {
                            tracing::debug!(
                                group,
                                "incremental publish disagreed with the whole lists; replacing every type"
                            );
                            replace_all(prev, &translation.entries())
                        }
                    }
                    (None, None) => replace_all(prev, &translation.entries()),
                };
                let changed = !flock_core::resources::diff(prev, &next).is_empty();
                (changed || first).then_some(next)
            });
            let v = match published {
                Some(s) => {
                    if group == ENVOY_GROUP {
                        self.metrics.publishes.fetch_add(1, Ordering::Relaxed);
                    }
                    s.version()
                }
                None => publisher.latest().version(),
            };
            if group == ENVOY_GROUP {
                version = v;
            }
        }
        self.first_published.store(true, Ordering::Release);
        version
    }
}
