//! Prometheus helpers on [`prometheus_client`]: rendering, closed label sets, and a
//! collector over counters kept elsewhere.
//!
//! Label values are escaped by `prometheus_client`'s encoder. Cardinality is the
//! caller's to bound: a label whose value comes from a client must map that value
//! into a closed set first (see [`closed_label`]), or every distinct value a client
//! sends becomes a series kept for the life of the process.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// The `Content-Type` of [`render`]'s output: the Prometheus text format 0.0.4.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Renders every metric of `registry` in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Writing to a String cannot fail; an error here would be a collector's own.
    if let Err(e) = prometheus_client::encoding::prometheus_text::encode(&mut out, registry) {
        tracing::warn!("encoding metrics: {e}");
    }
    out
}

/// `value` if it is one of `known`, else `other`: the way to turn a client-supplied
/// string into a label value without letting the client create series.
pub fn closed_label<'a>(value: &str, known: &[&'a str], other: &'a str) -> &'a str {
    known
        .iter()
        .find(|k| **k == value)
        .copied()
        .unwrap_or(other)
}

/// What one sample is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up; rendered with a `_total` suffix.
    Counter,
    /// Goes up and down.
    Gauge,
}

/// One metric read at scrape time.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// The metric name; a counter's without its `_total` suffix (the encoder adds it).
    pub name: &'static str,
    /// The `# HELP` text, without a final period (the encoder adds one).
    pub help: &'static str,
    /// Counter or gauge.
    pub kind: Kind,
    /// The value now.
    pub value: u64,
}

/// The samples one scrape collects (see [`Sampled`]).
#[derive(Debug, Default)]
pub struct Samples(Vec<Sample>);

impl Samples {
    /// Adds a counter (`name` without `_total`).
    pub fn counter(&mut self, name: &'static str, help: &'static str, value: u64) {
        self.0.push(Sample {
            name,
            help,
            kind: Kind::Counter,
            value,
        });
    }

    /// Adds a gauge.
    pub fn gauge(&mut self, name: &'static str, help: &'static str, value: u64) {
        self.0.push(Sample {
            name,
            help,
            kind: Kind::Gauge,
            value,
        });
    }

    /// The samples collected so far.
    pub fn as_slice(&self) -> &[Sample] {
        &self.0
    }
}

/// A [`Collector`] that calls `read` on every scrape: for counters a library already
/// keeps (atomics, a map's length) and should not have to mirror into
/// `prometheus_client` types on its hot path.
pub struct Sampled<F>(F);

impl<F> Sampled<F>
where
    F: Fn(&mut Samples) + Send + Sync + 'static,
{
    /// A collector reading through `read`.
    pub fn new(read: F) -> Self {
        Self(read)
    }

    /// The samples a scrape would render now.
    pub fn sample(&self) -> Samples {
        let mut s = Samples::default();
        (self.0)(&mut s);
        s
    }
}

impl<F> std::fmt::Debug for Sampled<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sampled").finish_non_exhaustive()
    }
}

impl<F> Collector for Sampled<F>
where
    F: Fn(&mut Samples) + Send + Sync + 'static,
{
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        for s in self.sample().0 {
            // `Registry::register` ends help texts with a period; do the same here so
            // sampled and registered metrics read alike.
            let help = format!("{}.", s.help);
            match s.kind {
                Kind::Counter => {
                    let m = ConstCounter::new(s.value);
                    m.encode(encoder.encode_descriptor(s.name, &help, None, m.metric_type())?)?;
                }
                Kind::Gauge => {
                    let m = ConstGauge::new(s.value);
                    m.encode(encoder.encode_descriptor(s.name, &help, None, m.metric_type())?)?;
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::metrics::family::Family;

    #[test]
    fn sampled_values_are_read_at_each_scrape() {
        use std::sync::Arc;
        use std::sync::atomic::{AtomicU64, Ordering};
        let n = Arc::new(AtomicU64::new(0));
        let mut registry = Registry::default();
        let read = Arc::clone(&n);
        registry.register_collector(Box::new(Sampled::new(move |s: &mut Samples| {
            s.counter("x_events", "Events seen", read.load(Ordering::Relaxed));
            s.gauge("x_open", "Open now", 7);
        })));
        n.store(3, Ordering::Relaxed);
        let text = render(&registry);
        assert!(text.contains("# TYPE x_events_total counter\n"), "{text}");
        assert!(text.contains("\nx_events_total 3\n"), "{text}");
        assert!(text.contains("# HELP x_open Open now.\n"), "{text}");
        assert!(text.contains("\nx_open 7\n"), "{text}");
        n.store(4, Ordering::Relaxed);
        assert!(render(&registry).contains("\nx_events_total 4\n"));
    }

    #[test]
    fn a_client_string_becomes_one_of_a_closed_set() {
        let known = ["a", "b"];
        assert_eq!(closed_label("b", &known, "other"), "b");
        assert_eq!(closed_label("a\"} 1\nevil 1", &known, "other"), "other");

        // And when a label must carry free text, the encoder escapes it: the value
        // stays inside its quotes on its own line.
        let family = Family::<Vec<(String, String)>, Counter>::default();
        let mut registry = Registry::default();
        registry.register("y", "Y", family.clone());
        family
            .get_or_create(&vec![("k".into(), "v\"} 1\nevil_metric 1".into())])
            .inc();
        let text = render(&registry);
        assert!(!text.lines().any(|l| l.starts_with("evil")), "{text}");
        assert!(
            text.contains(r#"y_total{k="v\"} 1\nevil_metric 1"} 1"#),
            "{text}"
        );
    }
}
