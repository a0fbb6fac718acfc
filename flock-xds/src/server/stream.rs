//! One gRPC stream: a task that feeds requests and snapshots to a protocol machine and
//! writes what it polls, one response at a time.
//!
//! The loop's `select!` is biased in this order, which is what the protocol layer's
//! guarantees rest on:
//! 1. **shutdown**;
//! 2. **requests**: every request the client has sent is fed before anything is
//!    polled, so requests sent together (a reconnect's `initial_resource_versions` for
//!    every type) are all known before the first response is chosen (make-before-break
//!    across a reconnect), and an unsubscribe that arrived is applied before a
//!    response for the old subscription could be built;
//! 3. **snapshots**: the group's publisher hands each new snapshot to a
//!    `watch` channel under its publish lock, so the stream sees versions in content
//!    order and only the newest one waits (a slow stream coalesces; no queue);
//! 4. **send**: a slot in the outbound channel (capacity 1) is reserved *before* the
//!    machine is polled, so a response is built only when it can be written at once,
//!    from the newest snapshot and subscription.
//!
//! A stream is bounded before it costs anything: it takes one of the server's
//! [`max_open_streams`](super::Limits::max_open_streams) slots when it opens (none
//! free: `RESOURCE_EXHAUSTED` at once), holds it until it ends, and must send its
//! first request within [`first_request_timeout`](super::Limits::first_request_timeout)
//! (`DEADLINE_EXCEEDED`), so streams that never speak cannot hold the slots; its
//! node's fields are length-checked before they are kept, and every request is checked
//! against the names the stream may subscribe to in total, then against the
//! subscription budget of its connection, its client and its pool (`budget.rs`).

use super::Inner;
use super::auth::{GroupChoice, Principal};
use super::budget::{StreamBudget, Usage};
use super::conn::StreamGuard;
use super::convert;
use super::metrics::{Event, Refusal, StreamNacks};
use crate::callbacks::{NodeInfo, ResponseInfo, StreamId, StreamKind};
use crate::protocol::{DeltaAds, RequestKind, RequestOutcome, SotwAds, StreamStats};
use envoy_types::pb::envoy::config::core::v3::Node;
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse,
};
use envoy_types::pb::google::protobuf::Any;
use flock_core::resources::ResourceSet;
use flock_core::snapshot::Snapshot;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tokio::sync::{mpsc, watch};
use tonic::{Status, Streaming};

/// What a stream loop needs from SotW or Delta.
pub(crate) trait Flavor: Send + 'static {
    type Req: prost::Message + Default + Send + 'static;
    type Resp: Send + 'static;

    fn new() -> Self;
    fn node(req: &Self::Req) -> Option<&Node>;
    /// The type URL as the client sent it (empty on a per-type service).
    fn type_url(req: &Self::Req) -> &str;
    /// Checks and feeds one request; `admit` is asked about what the stream would hold
    /// once it is applied (the subscription budget), after the stream's own limits.
    fn on_request(
        &mut self,
        req: &Self::Req,
        fixed_type: Option<&str>,
        limits: &convert::Limits,
        admit: &mut dyn FnMut(Usage) -> Result<(), Status>,
    ) -> Result<RequestOutcome, Status>;
    fn on_snapshot(&mut self, set: &ResourceSet<Any>, version: u64) -> bool;
    fn poll(&mut self, identifier: &str) -> Option<(Self::Resp, Summary)>;
    fn stats(&self) -> StreamStats;
}

/// What callbacks and metrics learn of a response.
pub(crate) struct Summary {
    type_url: String,
    version: u64,
    nonce: String,
    resources: usize,
    removed: usize,
}

/// One flavor (SotW or Delta): its ADS machine, the request conversion, and the
/// response conversion; everything else about a stream is shared.
macro_rules! flavor {
    ($name:ident, $ads:ident, $req:ty, $resp:ty, $convert_req:path, $convert_resp:path, $removed:expr) => {
        pub(crate) struct $name {
            ads: $ads<Any>,
            types: std::collections::BTreeSet<String>,
        }

        impl Flavor for $name {
            type Req = $req;
            type Resp = $resp;

            fn new() -> Self {
                Self {
                    ads: $ads::new(),
                    types: Default::default(),
                }
            }
            fn node(req: &$req) -> Option<&Node> {
                req.node.as_ref()
            }
            fn type_url(req: &$req) -> &str {
                &req.type_url
            }
            fn on_request(
                &mut self,
                req: &$req,
                fixed_type: Option<&str>,
                limits: &convert::Limits,
                admit: &mut dyn FnMut(Usage) -> Result<(), Status>,
            ) -> Result<RequestOutcome, Status> {
                let req = $convert_req(req, fixed_type, limits)?;
                admit_type(&mut self.types, &req.type_url, limits)?;
                let names = self.ads.subscribed_names_after(&req);
                check_subscribed(names, limits)?;
                admit(Usage {
                    names,
                    bytes: self.ads.subscribed_bytes_after(&req),
                })?;
                Ok(self.ads.on_request(&req))
            }
            fn on_snapshot(&mut self, set: &ResourceSet<Any>, version: u64) -> bool {
                self.ads.on_snapshot(set, version)
            }
            fn poll(&mut self, identifier: &str) -> Option<($resp, Summary)> {
                let resp = self.ads.poll_response()?;
                let summary = Summary {
                    type_url: resp.type_url.to_string(),
                    version: resp.version,
                    nonce: resp.nonce.clone(),
                    resources: resp.resources.len(),
                    removed: $removed(&resp),
                };
                Some(($convert_resp(&resp, identifier), summary))
            }
            fn stats(&self) -> StreamStats {
                self.ads.stats()
            }
        }
    };
}

flavor!(
    Sotw,
    SotwAds,
    DiscoveryRequest,
    DiscoveryResponse,
    convert::sotw_request,
    convert::sotw_response,
    |_: &crate::protocol::SotwResponse<Any>| 0
);
flavor!(
    Delta,
    DeltaAds,
    DeltaDiscoveryRequest,
    DeltaDiscoveryResponse,
    convert::delta_request,
    convert::delta_response,
    |r: &crate::protocol::DeltaResponse<Any>| r.removed_resources.len()
);

fn admit_type(
    types: &mut std::collections::BTreeSet<String>,
    type_url: &str,
    limits: &convert::Limits,
) -> Result<(), Status> {
    if !types.contains(type_url) {
        if types.len() >= limits.max_types_per_stream {
            return Err(Status::invalid_argument(format!(
                "stream already uses {} type URLs, the limit; refusing {}",
                types.len(),
                convert::preview(type_url)
            )));
        }
        types.insert(type_url.to_string());
    }
    Ok(())
}

/// Refuses a request that would leave the stream subscribed to more names than the
/// limit allows (checked before the request is fed, so nothing of it is kept).
fn check_subscribed(after: usize, limits: &convert::Limits) -> Result<(), Status> {
    let after = if flock_core::reintroduced!("xds-unbounded-stream") {
        0
    } else {
        after
    };
    if after > limits.max_subscribed_names_per_stream {
        return Err(Status::resource_exhausted(format!(
            "this request would subscribe the stream to {after} resource names (all types), \
             more than the limit of {} (max_subscribed_names_per_stream)",
            limits.max_subscribed_names_per_stream
        )));
    }
    Ok(())
}

/// One of the server's open-stream slots, given back on drop (however the stream ends).
struct StreamSlot(Arc<Inner>);

impl StreamSlot {
    /// A slot, if fewer than `max_open_streams` are taken.
    fn acquire(inner: &Arc<Inner>) -> Option<Self> {
        let max = inner.limits.max_open_streams;
        inner
            .open_streams
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| StreamSlot(Arc::clone(inner)))
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        self.0.open_streams.fetch_sub(1, Ordering::AcqRel);
    }
}

type SnapshotRx = watch::Receiver<Arc<Snapshot<ResourceSet<Any>>>>;

/// Runs one stream to its end. `out` has capacity 1 (see the module docs).
pub(crate) async fn run<F: Flavor>(
    inner: Arc<Inner>,
    kind: StreamKind,
    fixed_type: Option<&'static str>,
    principal: Principal,
    (_active, mut budget): (Option<StreamGuard>, StreamBudget),
    mut requests: Streaming<F::Req>,
    out: mpsc::Sender<Result<F::Resp, Status>>,
) {
    let id = StreamId(inner.next_stream_id());
    let Some(_slot) = StreamSlot::acquire(&inner) else {
        let limit = inner.limits.max_open_streams;
        inner.metrics.refused(Refusal::OpenStreams);
        tracing::debug!(
            stream = id.0,
            limit,
            "xDS stream refused: too many open streams"
        );
        let _ = out.try_send(Err(Status::resource_exhausted(format!(
            "the xDS server has {limit} streams open, its limit (max_open_streams); retry later"
        ))));
        return;
    };
    let mut shutdown = inner.shutdown.subscribe();
    // The first request names the node, and so the snapshot group.
    let timeout = inner.limits.first_request_timeout;
    let timeout = if flock_core::reintroduced!("xds-unbounded-stream") {
        std::time::Duration::MAX
    } else {
        timeout
    };
    let first = tokio::select! {
        biased;
        _ = shutdown.wait_for(|stop| *stop) => return,
        first = requests.message() => first,
        _ = tokio::time::sleep(timeout) => {
            inner.metrics.refused(Refusal::FirstRequestTimeout);
            tracing::debug!(stream = id.0, ?timeout, "xDS stream sent no request in time");
            let _ = out.try_send(Err(Status::deadline_exceeded(format!(
                "no request within {timeout:?} of opening the stream (first_request_timeout)"
            ))));
            return;
        }
    };
    let first = match first {
        Ok(Some(req)) => req,
        Ok(None) => return,
        Err(status) => {
            tracing::debug!(stream = id.0, %status, "xDS stream ended before its first request");
            return;
        }
    };
    let node = match F::node(&first).map(|n| convert::checked_node(n, &inner.limits)) {
        Some(Ok(node)) => node,
        refused => {
            let status = match refused {
                Some(Err(status)) => {
                    inner.metrics.refused(Refusal::NodeField);
                    status
                }
                _ => Status::invalid_argument(
                    "the first request of an xDS stream must carry the node (Node.id)",
                ),
            };
            tracing::warn!(stream = id.0, %status, "xDS stream refused its first request");
            let _ = out.send(Err(status)).await;
            inner.metrics.stream_opened(kind);
            inner.metrics.stream_closed(true);
            return;
        }
    };
    // The group comes from the authenticated principal; the client's Node chooses it
    // only for a principal trusted to name its own node (ByNode).
    let group = match &principal.group {
        GroupChoice::Fixed(group) => group.clone(),
        GroupChoice::ByNode => inner.cache.group_of(&node),
    };
    let publisher = inner.cache.publisher(&group);
    let (snap_tx, snap_rx) = watch::channel(publisher.latest());
    let sink = publisher.add_sink(move |snapshot| {
        // Runs under the publish lock, in version order; keep only the newest.
        snap_tx.send_if_modified(|held| {
            if snapshot.version() > held.version() {
                *held = Arc::clone(snapshot);
                true
            } else {
                false
            }
        });
    });
    inner.metrics.stream_opened(kind);
    inner.callbacks.on_stream_open(id, kind, &node);
    tracing::debug!(stream = id.0, node = ?node.id, %group, ?kind, "xDS stream opened");

    let mut machine = F::new();
    let mut nacks = StreamNacks::new(&inner.metrics);
    let result = drive(
        &inner,
        id,
        &node,
        &principal,
        &mut budget,
        fixed_type,
        &mut machine,
        &mut nacks,
        first,
        &mut requests,
        snap_rx,
        &out,
        &mut shutdown,
    )
    .await;

    publisher.remove_sink(sink);
    let error = match result {
        Ok(()) => false,
        Err(status) => {
            let client_error = matches!(
                status.code(),
                tonic::Code::InvalidArgument | tonic::Code::ResourceExhausted
            );
            if client_error {
                tracing::warn!(stream = id.0, node = ?node.id, %status, "xDS stream refused a request");
            } else {
                tracing::debug!(stream = id.0, node = ?node.id, %status, "xDS stream ended");
            }
            let _ = out.try_send(Err(status));
            client_error
        }
    };
    inner.metrics.stream_closed(error);
    inner.callbacks.on_stream_closed(id, &node);
    tracing::debug!(stream = id.0, node = ?node.id, stats = ?machine.stats(), "xDS stream closed");
}

#[allow(clippy::too_many_arguments)]
async fn drive<F: Flavor>(
    inner: &Inner,
    id: StreamId,
    node: &NodeInfo,
    principal: &Principal,
    budget: &mut StreamBudget,
    fixed_type: Option<&'static str>,
    machine: &mut F,
    nacks: &mut StreamNacks,
    first: F::Req,
    requests: &mut Streaming<F::Req>,
    mut snapshots: SnapshotRx,
    out: &mpsc::Sender<Result<F::Resp, Status>>,
    shutdown: &mut watch::Receiver<bool>,
) -> Result<(), Status> {
    let current = Arc::clone(&snapshots.borrow_and_update());
    machine.on_snapshot(current.state(), current.version());
    drop(current);
    on_request(
        inner, id, node, principal, budget, machine, nacks, &first, fixed_type,
    )?;
    // Whether polling may find something: set by every event, cleared when a poll
    // comes back empty, so an idle stream does not hold an outbound slot.
    let mut maybe_work = true;
    loop {
        tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => {
                return Err(Status::unavailable("xDS server shutting down; reconnect"));
            }
            req = requests.message() => {
                match req {
                    Ok(Some(req)) => {
                        on_request(inner, id, node, principal, budget, machine, nacks, &req, fixed_type)?;
                        maybe_work = true;
                    }
                    Ok(None) => return Ok(()),
                    Err(status) => return Err(status),
                }
            }
            changed = snapshots.changed() => {
                if changed.is_err() {
                    // The sink (and so the publisher) is gone: cannot happen while
                    // this task holds the publisher, but end cleanly if it does.
                    return Ok(());
                }
                let snapshot = Arc::clone(&snapshots.borrow_and_update());
                if machine.on_snapshot(snapshot.state(), snapshot.version()) {
                    maybe_work = true;
                }
            }
            permit = out.reserve(), if maybe_work => {
                let Ok(permit) = permit else {
                    return Ok(()); // the transport dropped the response stream
                };
                match machine.poll(&inner.identifier) {
                    Some((resp, summary)) => {
                        nacks.sent(&summary.type_url, summary.resources);
                        inner.metrics.count(&summary.type_url, Event::Response, 1);
                        inner.metrics.count(&summary.type_url, Event::ResourcesSent, summary.resources as u64);
                        inner.metrics.count(&summary.type_url, Event::ResourcesRemoved, summary.removed as u64);
                        inner.callbacks.on_response(id, node, &ResponseInfo {
                            type_url: &summary.type_url,
                            version: summary.version,
                            nonce: &summary.nonce,
                            resources: summary.resources,
                            removed: summary.removed,
                        });
                        tracing::trace!(
                            stream = id.0, node = ?node.id, r#type = ?crate::types::short_name(&summary.type_url),
                            version = summary.version, nonce = %summary.nonce,
                            resources = summary.resources, removed = summary.removed,
                            "xDS response"
                        );
                        permit.send(Ok(resp));
                    }
                    None => maybe_work = false,
                }
            }
            _ = out.closed() => return Ok(()),
        }
    }
}

#[allow(clippy::too_many_arguments)]
fn on_request<F: Flavor>(
    inner: &Inner,
    id: StreamId,
    node: &NodeInfo,
    principal: &Principal,
    budget: &mut StreamBudget,
    machine: &mut F,
    nacks: &mut StreamNacks,
    req: &F::Req,
    fixed_type: Option<&'static str>,
) -> Result<(), Status> {
    // A principal without secrets never subscribes to SDS (named or wildcard, SotW or
    // Delta): refused before the machine learns of the request, so no response of
    // that type is ever built for it.
    if fixed_type.unwrap_or_else(|| F::type_url(req)) == crate::types::SECRET && !principal.secrets
    {
        let status = super::auth::secrets_denied(principal);
        inner
            .metrics
            .transport
            .refusals
            .refuse_secrets(principal, &status);
        return Err(status);
    }
    let mut over_budget = false;
    let mut admit = |after: Usage| budget.adjust(after).inspect_err(|_| over_budget = true);
    let outcome = machine
        .on_request(req, fixed_type, &inner.limits, &mut admit)
        .inspect_err(|status| {
            if over_budget {
                inner.metrics.refused(Refusal::SubscriptionBudget);
            } else if status.code() == tonic::Code::ResourceExhausted {
                inner.metrics.refused(Refusal::SubscribedNames);
            }
        })?;
    let type_url = &outcome.type_url;
    inner.metrics.count(type_url, Event::Request, 1);
    match &outcome.kind {
        RequestKind::Ack { .. } => {
            inner.metrics.count(type_url, Event::Ack, 1);
            nacks.answered(type_url, false);
        }
        RequestKind::Stale => inner.metrics.count(type_url, Event::Stale, 1),
        RequestKind::Nack {
            version,
            kept_version,
            error,
        } => {
            inner.metrics.count(type_url, Event::Nack, 1);
            nacks.answered(type_url, true);
            // An operator must see this: the client runs an older config than ours.
            // Every client string here is bounded by the limits (node ID, type URL,
            // error detail) and written escaped (`?`), so a NACK cannot forge log lines.
            tracing::warn!(
                stream = id.0,
                node = ?node.id,
                r#type = ?crate::types::short_name(type_url),
                rejected_version = version,
                kept_version = ?kept_version,
                error = ?error,
                "xDS client rejected a response (NACK); it keeps its last accepted config"
            );
            inner
                .callbacks
                .on_nack(id, node, type_url, *version, *kept_version, error);
        }
        RequestKind::Initial | RequestKind::Update => {}
    }
    inner.callbacks.on_request(id, node, &outcome);
    Ok(())
}
