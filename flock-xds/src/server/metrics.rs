//! Server counters, rendered in the Prometheus text format.

use crate::callbacks::StreamKind;
use crate::types::short_name;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counters of one [`Server`](super::Server). Cheap to update from every stream.
#[derive(Debug, Default)]
pub struct Metrics {
    streams_open: AtomicU64,
    streams_total: AtomicU64,
    stream_errors: AtomicU64,
    per_type: Mutex<BTreeMap<(String, &'static str), u64>>,
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
    fn metric(self) -> &'static str {
        match self {
            Event::Request => "flock_xds_requests_total",
            Event::Ack => "flock_xds_acks_total",
            Event::Nack => "flock_xds_nacks_total",
            Event::Stale => "flock_xds_stale_requests_total",
            Event::Response => "flock_xds_responses_total",
            Event::ResourcesSent => "flock_xds_resources_sent_total",
            Event::ResourcesRemoved => "flock_xds_resources_removed_total",
        }
    }

    fn help(self) -> &'static str {
        match self {
            Event::Request => "Discovery requests received, by type.",
            Event::Ack => "Responses the client accepted, by type.",
            Event::Nack => {
                "Responses the client rejected (NACK), by type; the client keeps its last good config."
            }
            Event::Stale => "Requests with a stale nonce (ACK/NACK part ignored), by type.",
            Event::Response => "Discovery responses sent, by type.",
            Event::ResourcesSent => "Resources carried by responses, by type.",
            Event::ResourcesRemoved => "Names sent in Delta removed_resources, by type.",
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

impl Metrics {
    pub(crate) fn stream_opened(&self, _kind: StreamKind) {
        self.streams_open.fetch_add(1, Ordering::Relaxed);
        self.streams_total.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn stream_closed(&self, error: bool) {
        self.streams_open.fetch_sub(1, Ordering::Relaxed);
        if error {
            self.stream_errors.fetch_add(1, Ordering::Relaxed);
        }
    }

    pub(crate) fn count(&self, type_url: &str, event: Event, n: u64) {
        if n == 0 {
            return;
        }
        let mut map = self.per_type.lock().unwrap_or_else(|e| e.into_inner());
        // Keyed by the short name: a client cannot grow this map beyond the types it
        // may open (the stream's type limit), and unknown types share their last path
        // segment.
        *map.entry((short_name(type_url).to_string(), event.metric()))
            .or_insert(0) += n;
    }

    /// Streams open now.
    pub fn streams_open(&self) -> u64 {
        self.streams_open.load(Ordering::Relaxed)
    }

    /// The value of a per-type counter (`"flock_xds_nacks_total"`, `"cds"`), for tests
    /// and embedding control planes.
    pub fn counter(&self, metric: &str, short_type: &str) -> u64 {
        let map = self.per_type.lock().unwrap_or_else(|e| e.into_inner());
        map.iter()
            .filter(|((t, m), _)| t == short_type && *m == metric)
            .map(|(_, v)| *v)
            .sum()
    }

    /// All counters in the Prometheus text exposition format.
    pub fn render_prometheus(&self) -> String {
        let mut out = String::new();
        let gauge = |out: &mut String, name: &str, kind: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}"
            );
        };
        gauge(
            &mut out,
            "flock_xds_streams_open",
            "gauge",
            "xDS streams open now.",
            self.streams_open(),
        );
        gauge(
            &mut out,
            "flock_xds_streams_total",
            "counter",
            "xDS streams opened since start.",
            self.streams_total.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "flock_xds_stream_errors_total",
            "counter",
            "xDS streams that ended with an error (bad request, transport error).",
            self.stream_errors.load(Ordering::Relaxed),
        );
        let map = self.per_type.lock().unwrap_or_else(|e| e.into_inner());
        for event in Event::ALL {
            let name = event.metric();
            let _ = writeln!(out, "# HELP {name} {}\n# TYPE {name} counter", event.help());
            for ((t, m), v) in map.iter() {
                if *m == name {
                    let _ = writeln!(out, "{name}{{type=\"{t}\"}} {v}");
                }
            }
        }
        out
    }
}
