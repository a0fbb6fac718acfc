//! Golden metrics per workload pair, from the same access log entries the node's
//! Envoy streams to the agent: requests by response code and their latency, TCP
//! connections and bytes, each per (source workload, destination service), on the
//! agent's `/metrics`.
//!
//! | metric | labels |
//! |---|---|
//! | `flock_requests_total` | `source_namespace`, `source`, `destination`, `code` |
//! | `flock_request_duration_seconds` (histogram) | `source_namespace`, `source`, `destination` |
//! | `flock_tcp_connections_total` | `source_namespace`, `source`, `destination` |
//! | `flock_tcp_bytes_total` | `source_namespace`, `source`, `destination`, `direction` (`received`/`sent`, from the callee's side) |
//! | `flock_workload_metrics_dropped_total` | — |
//!
//! `source` is the caller's service account and `source_namespace` its namespace, from
//! its verified SPIFFE ID (`spiffe://<td>/ns/<ns>/sa/<sa>`); a caller without one (a
//! plaintext caller of a permissive pod) is `source="unknown"`. `destination` is the
//! callee's service, `<service>.<namespace>` (`unknown` when no registry entry names
//! the port). **Cardinality is capped**: at most [`MAX_SERIES`] label sets over all
//! four families; an observation that would add one more is not recorded and counts in
//! `flock_workload_metrics_dropped_total` (the label values come from certificates and
//! the registry, not from the caller's request, except `code`, which Envoy bounds).

use flock_telemetry::prometheus_client::metrics::counter::Counter;
use flock_telemetry::prometheus_client::metrics::family::Family;
use flock_telemetry::prometheus_client::metrics::histogram::Histogram;
use flock_telemetry::prometheus_client::registry::Registry;
use std::collections::HashSet;

/// Label sets kept over all the families.
pub const MAX_SERIES: usize = 10_000;

/// Latency buckets, seconds: 1 ms to 10 s.
const BUCKETS: [f64; 13] = [
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

type Labels = Vec<(&'static str, String)>;

fn histogram() -> Histogram {
    Histogram::new(BUCKETS)
}

/// The families, shared between `/metrics` and the recorder.
#[derive(Clone)]
pub struct WorkloadMetrics {
    requests: Family<Labels, Counter>,
    duration: Family<Labels, Histogram, fn() -> Histogram>,
    tcp_connections: Family<Labels, Counter>,
    tcp_bytes: Family<Labels, Counter>,
    dropped: Counter,
}

impl std::fmt::Debug for WorkloadMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkloadMetrics")
            .field("dropped", &self.dropped.get())
            .finish_non_exhaustive()
    }
}

impl Default for WorkloadMetrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            duration: Family::new_with_constructor(histogram),
            tcp_connections: Family::default(),
            tcp_bytes: Family::default(),
            dropped: Counter::default(),
        }
    }
}

impl WorkloadMetrics {
    /// Registers the families (see the module docs).
    pub fn register(&self, registry: &mut Registry) {
        registry.register(
            "flock_requests",
            "HTTP requests meshed pods received, by caller workload, destination service and response code",
            self.requests.clone(),
        );
        registry.register(
            "flock_request_duration_seconds",
            "Time from a request's first byte to its response's last byte, at the callee's Envoy",
            self.duration.clone(),
        );
        registry.register(
            "flock_tcp_connections",
            "TCP connections meshed pods received (counted at close), by caller workload and destination service",
            self.tcp_connections.clone(),
        );
        registry.register(
            "flock_tcp_bytes",
            "Bytes of TCP connections meshed pods received, by direction as the callee sees it",
            self.tcp_bytes.clone(),
        );
        registry.register(
            "flock_workload_metrics_dropped",
            "Observations not recorded because they would have passed the label-set cap",
            self.dropped.clone(),
        );
    }

    /// Observations dropped by the cap so far.
    pub fn dropped(&self) -> u64 {
        self.dropped.get()
    }
}

/// A call's workload pair.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pair {
    /// The caller's namespace (empty when unknown).
    pub source_namespace: String,
    /// The caller's service account, or `unknown`.
    pub source: String,
    /// `<service>.<namespace>`, or `unknown`.
    pub destination: String,
}

impl Pair {
    /// The pair of a call from `source_spiffe_id` to `destination_service`.
    pub fn of(source_spiffe_id: Option<&str>, destination_service: Option<&str>) -> Self {
        let (source_namespace, source) = source_spiffe_id
            .and_then(|id| {
                let path = id.strip_prefix("spiffe://")?.split_once('/')?.1;
                let mut parts = path.split('/');
                match (
                    parts.next(),
                    parts.next(),
                    parts.next(),
                    parts.next(),
                    parts.next(),
                ) {
                    (Some("ns"), Some(ns), Some("sa"), Some(sa), None)
                        if !ns.is_empty() && !sa.is_empty() =>
                    {
                        Some((ns.to_string(), sa.to_string()))
                    }
                    _ => None,
                }
            })
            .unwrap_or_else(|| (String::new(), "unknown".to_string()));
        Self {
            source_namespace,
            source,
            destination: destination_service.unwrap_or("unknown").to_string(),
        }
    }

    fn labels(&self) -> Labels {
        vec![
            ("source_namespace", self.source_namespace.clone()),
            ("source", self.source.clone()),
            ("destination", self.destination.clone()),
        ]
    }
}

/// Records observations into [`WorkloadMetrics`] under the cap; owned by the one
/// thread that records (the access log writer).
#[derive(Debug)]
pub struct Recorder {
    metrics: WorkloadMetrics,
    seen: HashSet<(u8, Labels)>,
    cap: usize,
}

impl Recorder {
    /// A recorder into `metrics` keeping at most `cap` label sets.
    pub fn new(metrics: WorkloadMetrics, cap: usize) -> Self {
        Self {
            metrics,
            seen: HashSet::new(),
            cap,
        }
    }

    /// Whether the label set `(family, labels)` may be written: known, or room left.
    fn admit(&mut self, family: u8, labels: &Labels) -> bool {
        let key = (family, labels.clone());
        if self.seen.contains(&key) {
            return true;
        }
        if self.seen.len() >= self.cap {
            self.metrics.dropped.inc();
            return false;
        }
        self.seen.insert(key);
        true
    }

    /// One HTTP request: its status (0: none sent) and duration in seconds.
    pub fn request(&mut self, pair: &Pair, status: u32, seconds: f64) {
        let base = pair.labels();
        let mut with_code = base.clone();
        with_code.push(("code", status.to_string()));
        // Both series or neither: a request counted without its latency (or the
        // reverse) would skew the ratios built from them.
        let new_count = !self.seen.contains(&(0, with_code.clone()));
        let new_latency = !self.seen.contains(&(1, base.clone()));
        if self.seen.len() + usize::from(new_count) + usize::from(new_latency) > self.cap {
            self.metrics.dropped.inc();
            return;
        }
        if self.admit(0, &with_code) && self.admit(1, &base) {
            self.metrics.requests.get_or_create(&with_code).inc();
            self.metrics.duration.get_or_create(&base).observe(seconds);
        }
    }

    /// One TCP connection, at its close, with its bytes as the callee saw them.
    pub fn connection(&mut self, pair: &Pair, received: u64, sent: u64) {
        let base = pair.labels();
        let mut rx = base.clone();
        rx.push(("direction", "received".to_string()));
        let mut tx = base.clone();
        tx.push(("direction", "sent".to_string()));
        let new = [(2, &base), (3, &rx), (3, &tx)]
            .iter()
            .filter(|(f, l)| !self.seen.contains(&(*f, (*l).clone())))
            .count();
        if self.seen.len() + new > self.cap {
            self.metrics.dropped.inc();
            return;
        }
        for (f, l) in [(2, &base), (3, &rx), (3, &tx)] {
            self.admit(f, l);
        }
        self.metrics.tcp_connections.get_or_create(&base).inc();
        self.metrics.tcp_bytes.get_or_create(&rx).inc_by(received);
        self.metrics.tcp_bytes.get_or_create(&tx).inc_by(sent);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn text(m: &WorkloadMetrics) -> String {
        let mut registry = Registry::default();
        m.register(&mut registry);
        let mut out = String::new();
        flock_telemetry::prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    }

    #[test]
    fn the_pair_comes_from_the_spiffe_id_and_the_service() {
        let p = Pair::of(Some("spiffe://mesh.test/ns/shop/sa/a"), Some("web.default"));
        assert_eq!(
            (
                p.source_namespace.as_str(),
                p.source.as_str(),
                p.destination.as_str()
            ),
            ("shop", "a", "web.default")
        );
        for bad in [
            None,
            Some("spiffe://mesh.test/ns/shop"),
            Some("spiffe://mesh.test/ns//sa/a"),
            Some("spiffe://mesh.test/ns/shop/sa/a/extra"),
            Some("https://mesh.test/ns/shop/sa/a"),
        ] {
            let p = Pair::of(bad, None);
            assert_eq!(
                (p.source.as_str(), p.destination.as_str()),
                ("unknown", "unknown"),
                "{bad:?}"
            );
        }
    }

    #[test]
    fn requests_and_connections_are_counted_per_pair_and_code() {
        let m = WorkloadMetrics::default();
        let mut r = Recorder::new(m.clone(), MAX_SERIES);
        let pair = Pair::of(Some("spiffe://t/ns/default/sa/a"), Some("web.default"));
        for _ in 0..9 {
            r.request(&pair, 200, 0.003);
        }
        r.request(&pair, 503, 0.2);
        r.connection(&pair, 10, 2000);
        let out = text(&m);
        let labels = r#"source_namespace="default",source="a",destination="web.default""#;
        assert!(
            out.contains(&format!(r#"flock_requests_total{{{labels},code="200"}} 9"#)),
            "{out}"
        );
        assert!(
            out.contains(&format!(r#"flock_requests_total{{{labels},code="503"}} 1"#)),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                r#"flock_request_duration_seconds_count{{{labels}}} 10"#
            )),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                r#"flock_request_duration_seconds_bucket{{le="0.005",{labels}}} 9"#
            )),
            "{out}"
        );
        assert!(
            out.contains(&format!(r#"flock_tcp_connections_total{{{labels}}} 1"#)),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                r#"flock_tcp_bytes_total{{{labels},direction="sent"}} 2000"#
            )),
            "{out}"
        );
    }

    /// Every name the shipped rules and dashboard use: recorded by a rule, or exported
    /// by the agent (after one observation of each kind).
    #[test]
    fn the_shipped_rules_and_dashboard_name_only_what_exists() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        let rules = std::fs::read_to_string(root.join("prometheus/flock-rules.yml")).unwrap();
        let dashboard = std::fs::read_to_string(root.join("grafana/flock-golden.json")).unwrap();
        let dashboard: serde_json::Value = serde_json::from_str(&dashboard).unwrap();
        let recorded: HashSet<&str> = rules
            .lines()
            .filter_map(|l| l.trim().strip_prefix("- record: "))
            .collect();
        assert!(recorded.len() >= 6, "{recorded:?}");
        let m = WorkloadMetrics::default();
        let mut r = Recorder::new(m.clone(), MAX_SERIES);
        let pair = Pair::of(Some("spiffe://t/ns/default/sa/a"), Some("web.default"));
        r.request(&pair, 200, 0.01);
        r.connection(&pair, 1, 1);
        let mut exported = text(&m);
        exported.push_str("flock_access_log_dropped_total ");
        let mut exprs: Vec<String> = rules
            .lines()
            .filter_map(|l| l.trim().strip_prefix("expr:").map(str::to_string))
            .collect();
        // Multi-line expressions: their lines follow `expr: |`.
        exprs.extend(
            rules
                .lines()
                .filter(|l| l.starts_with("          "))
                .map(str::to_string),
        );
        for panel in dashboard["panels"].as_array().unwrap() {
            for t in panel["targets"].as_array().unwrap() {
                exprs.push(t["expr"].as_str().unwrap().to_string());
            }
        }
        let mut checked = 0;
        for expr in &exprs {
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')) {
                if word.starts_with("flock:") {
                    assert!(
                        recorded.contains(word),
                        "{word} is recorded by no rule: {expr}"
                    );
                    checked += 1;
                } else if word.starts_with("flock_") {
                    assert!(
                        exported.contains(&format!("{word}{{"))
                            || exported.contains(&format!("{word} ")),
                        "{word} is not exported: {expr}"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 12, "{checked} names checked");
    }

    #[test]
    fn past_the_cap_observations_are_dropped_and_counted_not_added() {
        let m = WorkloadMetrics::default();
        // Room for one pair's request series (its count and its latency).
        let mut r = Recorder::new(m.clone(), 2);
        let a = Pair::of(Some("spiffe://t/ns/default/sa/a"), Some("web.default"));
        let b = Pair::of(Some("spiffe://t/ns/default/sa/b"), Some("web.default"));
        r.request(&a, 200, 0.001);
        r.request(&b, 200, 0.001);
        r.request(&a, 500, 0.001);
        r.connection(&a, 1, 1);
        r.request(&a, 200, 0.001);
        assert_eq!(m.dropped(), 3);
        let out = text(&m);
        assert!(!out.contains(r#"source="b""#), "{out}");
        assert!(!out.contains(r#"code="500""#), "{out}");
        assert!(out.contains(r#"code="200"} 2"#), "{out}");
    }
}
