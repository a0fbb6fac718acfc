//! Server counters on `prometheus-client`, with a closed set of type labels.
//!
//! The type URL of a request is chosen by the client. Used as a label value it would
//! let any client create series without bound (one per distinct URL it sends, kept
//! for the life of the process) and, written unescaped, inject lines into the
//! exposition. So a type is labelled only by [`TypeLabel`]: the six types flock
//! serves by their short names, everything else as `other`. Escaping of whatever
//! does reach a label is `prometheus-client`'s encoder's.

use crate::callbacks::StreamKind;
use crate::types;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    DescriptorEncoder, EncodeLabelSet, EncodeLabelValue, EncodeMetric as _, LabelSetEncoder,
};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::Arc;

/// The `type` label of the per-type counters: a known xDS type or `other`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TypeLabel {
    /// Listeners.
    Lds,
    /// Route configurations.
    Rds,
    /// Clusters.
    Cds,
    /// Cluster load assignments.
    Eds,
    /// Secrets.
    Sds,
    /// Virtual hosts of route configurations (VHDS).
    Vhds,
    /// Any type URL flock does not serve, whatever the client sent.
    Other,
}

impl TypeLabel {
    /// Every label value: the bound on the series of one per-type metric.
    pub const ALL: [TypeLabel; 7] = [
        TypeLabel::Lds,
        TypeLabel::Rds,
        TypeLabel::Cds,
        TypeLabel::Eds,
        TypeLabel::Sds,
        TypeLabel::Vhds,
        TypeLabel::Other,
    ];

    /// The label for a type URL as a client sent it.
    pub fn of(type_url: &str) -> Self {
        match type_url {
            types::LISTENER => TypeLabel::Lds,
            types::ROUTE => TypeLabel::Rds,
            types::CLUSTER => TypeLabel::Cds,
            types::ENDPOINT => TypeLabel::Eds,
            types::SECRET => TypeLabel::Sds,
            types::VIRTUAL_HOST => TypeLabel::Vhds,
            _ => TypeLabel::Other,
        }
    }

    /// The rendered value (`"cds"`, `"other"`…).
    pub fn as_str(self) -> &'static str {
        match self {
            TypeLabel::Lds => "lds",
            TypeLabel::Rds => "rds",
            TypeLabel::Cds => "cds",
            TypeLabel::Eds => "eds",
            TypeLabel::Sds => "sds",
            TypeLabel::Vhds => "vhds",
            TypeLabel::Other => "other",
        }
    }
}

impl EncodeLabelValue for TypeLabel {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelValueEncoder<'_>,
    ) -> Result<(), std::fmt::Error> {
        EncodeLabelValue::encode(&self.as_str(), encoder)
    }
}

/// The label set `{type="…"}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ByType(TypeLabel);

impl EncodeLabelSet for ByType {
    fn encode(&self, encoder: &mut LabelSetEncoder<'_>) -> Result<(), std::fmt::Error> {
        [("type", self.0)].encode(encoder)
    }
}

/// Why a stream was ended by a server limit rather than by the protocol: the `reason`
/// label of `flock_xds_streams_refused_total`, a closed set like [`TypeLabel`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Refusal {
    /// `max_open_streams` was reached when the stream opened.
    OpenStreams,
    /// No request within `first_request_timeout`.
    FirstRequestTimeout,
    /// A request would go over `max_subscribed_names_per_stream`.
    SubscribedNames,
    /// A `Node` field over its length limit.
    NodeField,
    /// A request would go over a subscription budget (per connection, per client or
    /// total).
    SubscriptionBudget,
}

impl Refusal {
    const ALL: [Refusal; 5] = [
        Refusal::OpenStreams,
        Refusal::FirstRequestTimeout,
        Refusal::SubscribedNames,
        Refusal::NodeField,
        Refusal::SubscriptionBudget,
    ];

    fn as_str(self) -> &'static str {
        match self {
            Refusal::OpenStreams => "max_open_streams",
            Refusal::FirstRequestTimeout => "first_request_timeout",
            Refusal::SubscribedNames => "max_subscribed_names",
            Refusal::NodeField => "node_field_too_long",
            Refusal::SubscriptionBudget => "subscription_budget",
        }
    }
}

/// The `flock_xds_streams_refused_total{reason}` family, every series from the start.
#[derive(Debug, Default)]
struct Refusals([Counter; Refusal::ALL.len()]);

impl Collector for Refusals {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "flock_xds_streams_refused",
            "xDS streams ended by a server limit, by the limit's name.",
            None,
            MetricType::Counter,
        )?;
        for r in Refusal::ALL {
            let labels = [("reason", r.as_str())];
            self.0[r as usize].encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

/// The `flock_xds_streams_nacked{type}` family: streams whose latest answer for a
/// type is a NACK, so the client runs an older config of that type than the one it
/// was sent. The count per type says how many proxies are stuck; the NACK counter
/// alone cannot (one proxy NACKing every push and many NACKing once look alike).
#[derive(Debug, Default)]
struct Nacked([Gauge; TypeLabel::ALL.len()]);

impl Collector for Nacked {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let mut family = encoder.encode_descriptor(
            "flock_xds_streams_nacked",
            "Streams whose latest answer for a type is a NACK (the client keeps an older config of that type), by type.",
            None,
            MetricType::Gauge,
        )?;
        for t in TypeLabel::ALL {
            self.0[t as usize].encode(family.encode_family(&ByType(t))?)?;
        }
        Ok(())
    }
}

/// Which types one stream has NACKed, kept by the stream's task. A type stays NACKed
/// until the client ACKs a response of it that carries resources: rejected resources
/// are not resent until they change, so an ACK of a Delta response that only removes
/// names says nothing about them. The stream's end clears every type (on drop,
/// whatever way it ends), so the gauge counts open streams only.
#[derive(Debug)]
pub(crate) struct StreamNacks {
    metrics: Metrics,
    nacked: [bool; TypeLabel::ALL.len()],
    /// Whether the latest response of each type carried resources (one response per
    /// type is in flight at a time, so an ACK answers this one).
    carried: [bool; TypeLabel::ALL.len()],
}

impl StreamNacks {
    pub(crate) fn new(metrics: &Metrics) -> Self {
        Self {
            metrics: metrics.clone(),
            nacked: [false; TypeLabel::ALL.len()],
            carried: [false; TypeLabel::ALL.len()],
        }
    }

    /// A response of `type_url` was sent, with `resources` resources.
    pub(crate) fn sent(&mut self, type_url: &str, resources: usize) {
        self.carried[TypeLabel::of(type_url) as usize] = resources > 0;
    }

    /// The client answered the latest response of `type_url` with a NACK (`true`) or
    /// an ACK.
    pub(crate) fn answered(&mut self, type_url: &str, nack: bool) {
        let t = TypeLabel::of(type_url) as usize;
        if !nack && !self.carried[t] {
            return; // a removal-only ACK: whatever was rejected is still missing
        }
        if std::mem::replace(&mut self.nacked[t], nack) != nack {
            let gauge = &self.metrics.nacked.0[t];
            if nack {
                gauge.inc();
            } else {
                gauge.dec();
            }
        }
    }
}

impl Drop for StreamNacks {
    fn drop(&mut self) {
        for (t, nacked) in self.nacked.iter().enumerate() {
            if *nacked {
                self.metrics.nacked.0[t].dec();
            }
        }
    }
}

/// Per-type event counted by [`Metrics`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Event {
    Request,
    Ack,
    Nack,
    Stale,
    Response,
    ResourcesSent,
    ResourcesRemoved,
}

impl Event {
    /// The family name as registered (counters get `_total` when rendered).
    fn name(self) -> &'static str {
        match self {
            Event::Request => "flock_xds_requests",
            Event::Ack => "flock_xds_acks",
            Event::Nack => "flock_xds_nacks",
            Event::Stale => "flock_xds_stale_requests",
            Event::Response => "flock_xds_responses",
            Event::ResourcesSent => "flock_xds_resources_sent",
            Event::ResourcesRemoved => "flock_xds_resources_removed",
        }
    }

    fn help(self) -> &'static str {
        match self {
            Event::Request => "Discovery requests received, by type",
            Event::Ack => "Responses the client accepted, by type",
            Event::Nack => {
                "Responses the client rejected (NACK), by type; the client keeps its last good config"
            }
            Event::Stale => "Requests with a stale nonce (ACK/NACK part ignored), by type",
            Event::Response => "Discovery responses sent, by type",
            Event::ResourcesSent => "Resources carried by responses, by type",
            Event::ResourcesRemoved => "Names sent in Delta removed_resources, by type",
        }
    }

    const ALL: [Event; 7] = [
        Event::Request,
        Event::Ack,
        Event::Nack,
        Event::Stale,
        Event::Response,
        Event::ResourcesSent,
        Event::ResourcesRemoved,
    ];
}

/// Counters of one [`Server`](super::Server). Cheap to update from every stream; the
/// handles are shared, so a registry they are [registered](Self::register) with sees
/// live values.
#[derive(Debug, Clone, Default)]
pub struct Metrics {
    streams_open: Gauge,
    streams_total: Counter,
    stream_errors: Counter,
    per_type: Arc<PerType>,
    refusals: Arc<Refusals>,
    nacked: Arc<Nacked>,
    /// Connection and authorization counters (kept by `listen.rs` and `auth.rs`).
    pub(crate) transport: super::listen::TransportMetrics,
}

/// One counter per [`Event`] and [`TypeLabel`], indexed by their discriminants: the
/// label set is closed, so every series exists from the start (a rate over a counter
/// that appears at its first increment misses that increment), an update is an
/// index and an atomic add (no map, no lock), and the rendering order is fixed.
#[derive(Debug, Default)]
struct PerType([[Counter; TypeLabel::ALL.len()]; Event::ALL.len()]);

impl Collector for PerType {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        for event in Event::ALL {
            // `Registry::register` ends help texts with a period; so do we.
            let help = format!("{}.", event.help());
            let mut family =
                encoder.encode_descriptor(event.name(), &help, None, MetricType::Counter)?;
            for t in TypeLabel::ALL {
                let counter = &self.0[event as usize][t as usize];
                counter.encode(family.encode_family(&ByType(t))?)?;
            }
        }
        Ok(())
    }
}

impl Metrics {
    pub(crate) fn stream_opened(&self, _kind: StreamKind) {
        self.streams_open.inc();
        self.streams_total.inc();
    }

    pub(crate) fn stream_closed(&self, error: bool) {
        self.streams_open.dec();
        if error {
            self.stream_errors.inc();
        }
    }

    pub(crate) fn refused(&self, reason: Refusal) {
        self.refusals.0[reason as usize].inc();
    }

    /// Streams ended by a server limit, by the `reason` label value
    /// (`"max_open_streams"`, `"first_request_timeout"`, `"max_subscribed_names"`,
    /// `"node_field_too_long"`, `"subscription_budget"`); 0 for any other.
    pub fn refused_streams(&self, reason: &str) -> u64 {
        Refusal::ALL
            .into_iter()
            .find(|r| r.as_str() == reason)
            .map_or(0, |r| self.refusals.0[r as usize].get())
    }

    pub(crate) fn count(&self, type_url: &str, event: Event, n: u64) {
        if n == 0 {
            return;
        }
        self.per_type_counter(event, TypeLabel::of(type_url))
            .inc_by(n);
    }

    fn per_type_counter(&self, event: Event, t: TypeLabel) -> &Counter {
        &self.per_type.0[event as usize][t as usize]
    }

    /// Open streams whose latest answer for a type is a NACK, by the type's short
    /// label (`"cds"`, `"lds"`…, `"other"`); 0 for a label that does not exist.
    pub fn streams_nacked(&self, short_type: &str) -> u64 {
        TypeLabel::ALL
            .into_iter()
            .find(|t| t.as_str() == short_type)
            .map_or(0, |t| {
                u64::try_from(self.nacked.0[t as usize].get()).unwrap_or(0)
            })
    }

    /// Streams open now.
    pub fn streams_open(&self) -> u64 {
        u64::try_from(self.streams_open.get()).unwrap_or(0)
    }

    /// The value of a per-type counter by its rendered name and label
    /// (`"flock_xds_nacks_total"`, `"cds"`), for tests and embedding control planes;
    /// 0 for a name or label that does not exist.
    pub fn counter(&self, metric: &str, short_type: &str) -> u64 {
        let Some(event) = Event::ALL
            .into_iter()
            .find(|e| metric.strip_suffix("_total") == Some(e.name()))
        else {
            return 0;
        };
        let Some(t) = TypeLabel::ALL
            .into_iter()
            .find(|t| t.as_str() == short_type)
        else {
            return 0;
        };
        self.per_type_counter(event, t).get()
    }

    /// Adds every metric of this server to `registry` (the handles are shared: the
    /// registry renders live values).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flock_xds_streams_open",
            "xDS streams open now",
            self.streams_open.clone(),
        );
        registry.register(
            "flock_xds_streams",
            "xDS streams opened since start",
            self.streams_total.clone(),
        );
        registry.register(
            "flock_xds_stream_errors",
            "xDS streams that ended with an error (bad request, transport error)",
            self.stream_errors.clone(),
        );
        registry.register_collector(Box::new(Arc::clone(&self.per_type)));
        registry.register_collector(Box::new(Arc::clone(&self.refusals)));
        registry.register_collector(Box::new(Arc::clone(&self.nacked)));
        self.transport.register(registry);
    }

    /// All counters in the Prometheus text exposition format.
    pub fn render_prometheus(&self) -> String {
        let mut registry = Registry::default();
        self.register(&mut registry);
        flock_telemetry::metrics::render(&registry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every non-comment line of a Prometheus text exposition is one sample of a
    /// family announced by `# TYPE`: `name{labels} value` or `name value`.
    fn samples(text: &str) -> Vec<&str> {
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        let lines: Vec<&str> = text.lines().filter(|l| !l.starts_with('#')).collect();
        for l in &lines {
            let name = l.split(['{', ' ']).next().unwrap();
            assert!(families.contains(&name), "line of no family: {l:?}\n{text}");
        }
        lines
    }

    #[test]
    fn a_client_type_url_cannot_inject_a_metric_line() {
        let m = Metrics::default();
        let evil = "type.googleapis.com/x\"} 1\nflock_xds_injected_total{type=\"cds\"} 99\n#";
        m.count(evil, Event::Request, 1);
        m.count(evil, Event::Nack, 2);
        m.count(types::CLUSTER, Event::Nack, 1);
        let text = m.render_prometheus();
        assert!(!text.contains("injected"), "{text}");
        let lines = samples(&text);
        assert!(
            lines.contains(&"flock_xds_requests_total{type=\"other\"} 1"),
            "{text}"
        );
        assert!(
            lines.contains(&"flock_xds_nacks_total{type=\"other\"} 2"),
            "{text}"
        );
        assert!(
            lines.contains(&"flock_xds_nacks_total{type=\"cds\"} 1"),
            "{text}"
        );
        assert_eq!(m.counter("flock_xds_nacks_total", "other"), 2);
        assert_eq!(m.counter("flock_xds_nacks_total", "cds"), 1);
    }

    #[test]
    fn cardinality_is_bounded_whatever_clients_send() {
        let m = Metrics::default();
        let before = m.render_prometheus().lines().count();
        for i in 0..1000 {
            m.count(&format!("type.googleapis.com/t{i}"), Event::Request, 1);
            m.count(&format!("garbage {i}"), Event::Ack, 1);
        }
        m.count(types::ENDPOINT, Event::Request, 1);
        let text = m.render_prometheus();
        assert_eq!(text.lines().count(), before, "no series added:\n{text}");
        let per_type = samples(&text)
            .into_iter()
            .filter(|l| l.starts_with("flock_xds_requests_total"))
            .count();
        assert_eq!(per_type, TypeLabel::ALL.len());
        // In a fixed order, so two scrapes diff cleanly.
        let order: Vec<&str> = samples(&text)
            .into_iter()
            .filter_map(|l| l.strip_prefix("flock_xds_acks_total{type=\""))
            .map(|l| l.split('"').next().unwrap())
            .collect();
        assert_eq!(order, TypeLabel::ALL.map(TypeLabel::as_str));
        assert_eq!(m.counter("flock_xds_requests_total", "other"), 1000);
        assert_eq!(m.counter("flock_xds_acks_total", "other"), 1000);
        assert_eq!(m.counter("flock_xds_requests_total", "eds"), 1);
    }

    #[test]
    fn refusals_are_counted_by_a_closed_reason_label() {
        let m = Metrics::default();
        m.refused(Refusal::OpenStreams);
        m.refused(Refusal::OpenStreams);
        m.refused(Refusal::FirstRequestTimeout);
        let text = m.render_prometheus();
        let lines: Vec<&str> = samples(&text)
            .into_iter()
            .filter(|l| l.starts_with("flock_xds_streams_refused_total"))
            .collect();
        assert_eq!(
            lines,
            [
                "flock_xds_streams_refused_total{reason=\"max_open_streams\"} 2",
                "flock_xds_streams_refused_total{reason=\"first_request_timeout\"} 1",
                "flock_xds_streams_refused_total{reason=\"max_subscribed_names\"} 0",
                "flock_xds_streams_refused_total{reason=\"node_field_too_long\"} 0",
                "flock_xds_streams_refused_total{reason=\"subscription_budget\"} 0",
            ]
        );
        assert_eq!(m.refused_streams("max_open_streams"), 2);
        assert_eq!(m.refused_streams("nonsense"), 0);
    }

    #[test]
    fn nacked_streams_follow_the_latest_answer_and_the_stream_end() {
        let m = Metrics::default();
        let mut a = StreamNacks::new(&m);
        let mut b = StreamNacks::new(&m);
        a.sent(types::CLUSTER, 3);
        a.answered(types::CLUSTER, true);
        a.sent(types::CLUSTER, 1);
        a.answered(types::CLUSTER, true); // a second NACK: still one stream
        b.sent(types::CLUSTER, 1);
        b.answered(types::CLUSTER, true);
        b.sent(types::LISTENER, 1);
        b.answered(types::LISTENER, true);
        assert_eq!(m.streams_nacked("cds"), 2);
        assert_eq!(m.streams_nacked("lds"), 1);
        b.sent(types::CLUSTER, 0);
        b.answered(types::CLUSTER, false); // ACKed a removal only: still missing
        assert_eq!(m.streams_nacked("cds"), 2);
        b.sent(types::CLUSTER, 2);
        b.answered(types::CLUSTER, false); // ACKed a later response with resources
        assert_eq!(m.streams_nacked("cds"), 1);
        drop(b); // the stream ended with LDS NACKed
        assert_eq!(m.streams_nacked("lds"), 0);
        let text = m.render_prometheus();
        assert!(
            samples(&text).contains(&"flock_xds_streams_nacked{type=\"cds\"} 1"),
            "{text}"
        );
        drop(a);
        assert_eq!(m.streams_nacked("cds"), 0);
        assert_eq!(m.streams_nacked("nonsense"), 0);
    }

    #[test]
    fn stream_gauges_follow_open_and_close() {
        let m = Metrics::default();
        m.stream_opened(StreamKind::SotwAds);
        m.stream_opened(StreamKind::DeltaAds);
        m.stream_closed(true);
        assert_eq!(m.streams_open(), 1);
        let text = m.render_prometheus();
        assert!(text.contains("\nflock_xds_streams_open 1\n"), "{text}");
        assert!(text.contains("\nflock_xds_streams_total 2\n"), "{text}");
        assert!(
            text.contains("\nflock_xds_stream_errors_total 1\n"),
            "{text}"
        );
    }
}
