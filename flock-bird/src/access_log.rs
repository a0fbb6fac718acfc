//! Access logs as the agent writes them: one JSON line per HTTP request or TCP
//! connection a meshed pod received, from the entries the node's Envoy streams over
//! the gRPC access log service (flock-xds `translate::telemetry` configures each
//! inbound port to send them; `server::accesslog` takes them from the node's Envoy
//! only).
//!
//! Why through the agent and not an Envoy file logger: the agent knows what Envoy does
//! not — which pod a caller's address belongs to and which service a pod port serves
//! (the registry view) — and it bounds, rotates and counts in one place, for every
//! Envoy epoch of a hot restart.
//!
//! The gRPC task only copies the fields into a record and hands it to a bounded queue
//! ([`QUEUE`]); one writer thread enriches, encodes and writes lines, flushing when
//! the queue runs dry. A full queue (a disk slower than the traffic) drops the record
//! and counts it (`flock_access_log_dropped_total`): the data path never waits on the
//! log. The file is created 0600 (lines name callers and paths), opened without
//! following a symlink, and rotated to `<path>.1` past `max_bytes`. A path's query is
//! never written (queries carry tokens).

use crate::workload_metrics::{Pair, Recorder, WorkloadMetrics};
use envoy_types::pb::envoy::config::core::v3::{RequestMethod, address, socket_address};
use envoy_types::pb::envoy::data::accesslog::v3::{
    AccessLogCommon, HttpAccessLogEntry, TcpAccessLogEntry,
    tls_properties::certificate_properties::subject_alt_name::San,
};
use envoy_types::pb::google::protobuf::StringValue;
use flock_telemetry::prometheus_client::metrics::counter::Counter;
use flock_telemetry::prometheus_client::registry::Registry;
use flock_xds::server::accesslog::AccessLogSink;
use flock_xds::translate::telemetry::{ACCESS_LOG_NAME, ACCESS_PORT_KEY, parse_access_port_tag};
use prost::Message as _;
use serde::Serialize;
use std::collections::HashMap;
use std::io::Write as _;
use std::net::IpAddr;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, TrySendError, sync_channel};

/// Records waiting for the writer; past this they are dropped and counted.
pub const QUEUE: usize = 16_384;
/// Bytes of a path, authority or SPIFFE ID a line keeps.
pub const MAX_FIELD: usize = 512;

/// Where the lines go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Destination {
    /// The agent's standard output (`--access-log -`): for a container runtime's log
    /// collection, which rotates itself.
    Stdout,
    /// A file, rotated to `<path>.1` once it passes `max_bytes`.
    File {
        /// The file.
        path: PathBuf,
        /// Rotation size.
        max_bytes: u64,
    },
}

/// One line, as written (field names are the documented schema: docs/telemetry.md).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Line {
    /// Start of the request or connection, RFC 3339 UTC with milliseconds.
    pub start_time: String,
    /// `http` or `tcp`.
    pub protocol: &'static str,
    /// The caller's SPIFFE ID (its verified certificate); absent for a plaintext
    /// caller (permissive capture).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_spiffe_id: Option<String>,
    /// The callee pod's own SPIFFE ID (the certificate its listener presented).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destination_spiffe_id: Option<String>,
    /// The caller's address as the callee saw it.
    pub source_address: String,
    /// The caller's pod (`<namespace>/<name>`), when its address is a meshed pod's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_pod: Option<String>,
    /// The caller's service (`<service>.<namespace>`), when its pod names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source_service: Option<String>,
    /// The callee pod.
    pub destination_pod: String,
    /// The service the callee's port serves, when the registry names one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub destination_service: Option<String>,
    /// The callee's app port.
    pub destination_port: u16,
    /// HTTP method.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub method: Option<String>,
    /// HTTP `:authority`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub authority: Option<String>,
    /// HTTP path without its query.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
    /// HTTP status (0: no response was sent).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<u32>,
    /// Why Envoy answered as it did (`via_upstream`, `rbac_access_denied…`) or, for
    /// TCP, how the connection ended (empty: normally).
    pub details: String,
    /// Milliseconds from the first byte received to the last byte sent (TCP: the
    /// connection's lifetime).
    pub duration_ms: f64,
    /// Body bytes received from the caller (TCP: all bytes).
    pub bytes_received: u64,
    /// Body bytes sent to the caller (TCP: all bytes).
    pub bytes_sent: u64,
    /// The app address Envoy forwarded to, when it connected.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upstream_host: Option<String>,
}

/// A record before the writer enriches it: the line and the caller's IP.
struct Record {
    line: Line,
    source_ip: Option<IpAddr>,
}

/// A pod as a line names it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodName {
    /// `<namespace>/<name>`.
    pub pod: String,
    /// `<service>.<namespace>`, when the pod names a service.
    pub service: Option<String>,
}

/// This node's meshed pods by address.
pub type LocalPods = Box<dyn Fn() -> Vec<(IpAddr, PodName)> + Send + Sync>;

/// The access log sink (see the module docs).
pub struct AccessLogs {
    tx: SyncSender<Record>,
    dropped: Counter,
    written: Counter,
    local_pods: Arc<std::sync::OnceLock<LocalPods>>,
    metrics: Option<WorkloadMetrics>,
}

/// What the writer does with the entries.
#[derive(Debug, Clone)]
pub struct Outputs {
    /// Where the lines go (`None`: no lines, metrics only).
    pub lines: Option<Destination>,
    /// Percentage of entries written as lines, when Envoy does not sample them
    /// (it sends every entry when the metrics need them all): 100 keeps all.
    pub line_percent: u32,
    /// The golden metrics to record every entry into.
    pub metrics: Option<WorkloadMetrics>,
}

impl std::fmt::Debug for AccessLogs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AccessLogs")
            .field("written", &self.written.get())
            .field("dropped", &self.dropped.get())
            .finish_non_exhaustive()
    }
}

/// The registry's view, as the writer reads it for source pods and services.
pub type ViewSource = tokio::sync::watch::Receiver<Arc<crate::registry::View>>;

impl AccessLogs {
    /// Starts the writer thread for `dest`; lines are enriched from `view`. Fails when
    /// the file cannot be opened (it is opened here, so a bad path stops the agent at
    /// start, not at its first request).
    pub fn start(outputs: Outputs, view: ViewSource) -> std::io::Result<Arc<Self>> {
        let out = outputs.lines.map(Output::open).transpose()?;
        let (tx, rx) = sync_channel(QUEUE);
        let logs = Arc::new(Self {
            tx,
            dropped: Counter::default(),
            written: Counter::default(),
            local_pods: Arc::default(),
            metrics: outputs.metrics.clone(),
        });
        let writer = Writer {
            out,
            line_percent: outputs.line_percent.min(100),
            recorder: outputs
                .metrics
                .map(|m| Recorder::new(m, crate::workload_metrics::MAX_SERIES)),
            written: logs.written.clone(),
            local_pods: Arc::clone(&logs.local_pods),
        };
        std::thread::Builder::new()
            .name("access-log".into())
            .spawn(move || writer.run(rx, view))?;
        Ok(logs)
    }

    /// Where the writer finds this node's pods by address (callers that serve no port
    /// are in no registry entry). Set once; later calls are ignored.
    pub fn set_local_pods(&self, pods: LocalPods) {
        let _ = self.local_pods.set(pods);
    }

    /// Registers `flock_access_log_lines_total` and `flock_access_log_dropped_total`.
    pub fn register(&self, registry: &mut Registry) {
        if let Some(m) = &self.metrics {
            m.register(registry);
        }
        registry.register(
            "flock_access_log_lines",
            "Access log lines written",
            self.written.clone(),
        );
        registry.register(
            "flock_access_log_dropped",
            "Access log entries dropped because the writer's queue was full (the log's disk is slower than the traffic)",
            self.dropped.clone(),
        );
    }

    /// Lines written so far.
    pub fn written(&self) -> u64 {
        self.written.get()
    }

    fn send(&self, record: Record) {
        match self.tx.try_send(record) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                self.dropped.inc();
            }
        }
    }
}

/// The port an entry's tag names: `None` for another log or an untagged entry.
fn tagged_port(common: Option<&AccessLogCommon>) -> Option<(String, u16)> {
    // `envoy.string` objects are sent as a `google.protobuf.StringValue`.
    let any = common?.filter_state_objects.get(ACCESS_PORT_KEY)?;
    let tag = StringValue::decode(any.value.as_slice()).ok()?.value;
    parse_access_port_tag(&tag).map(|(pod, port)| (pod.to_string(), port))
}

fn bounded(s: &str) -> String {
    let mut end = s.len().min(MAX_FIELD);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

fn uri_san(
    props: Option<
        &envoy_types::pb::envoy::data::accesslog::v3::tls_properties::CertificateProperties,
    >,
) -> Option<String> {
    props?.subject_alt_name.iter().find_map(|s| match &s.san {
        Some(San::Uri(uri)) => Some(bounded(uri)),
        _ => None,
    })
}

fn socket(a: Option<&envoy_types::pb::envoy::config::core::v3::Address>) -> Option<(String, u32)> {
    match a?.address.as_ref()? {
        address::Address::SocketAddress(s) => {
            let port = match s.port_specifier {
                Some(socket_address::PortSpecifier::PortValue(p)) => p,
                _ => 0,
            };
            Some((bounded(&s.address), port))
        }
        _ => None,
    }
}

fn rfc3339(t: Option<&envoy_types::pb::google::protobuf::Timestamp>) -> String {
    let Some(t) = t else {
        return String::new();
    };
    let ms = t.seconds.saturating_mul(1000) + i64::from(t.nanos / 1_000_000);
    flock_core::UnixMs(u64::try_from(ms).unwrap_or(0)).to_rfc3339()
}

fn millis(d: Option<&envoy_types::pb::google::protobuf::Duration>) -> f64 {
    d.map_or(0.0, |d| d.seconds as f64 * 1e3 + f64::from(d.nanos) / 1e6)
}

/// The line's common part and the caller's IP, for an entry of the access log.
fn common_line(
    log_name: &str,
    common: Option<&AccessLogCommon>,
    protocol: &'static str,
) -> Option<Record> {
    if log_name != ACCESS_LOG_NAME {
        return None;
    }
    let (pod, port) = tagged_port(common)?;
    let c = common?;
    let source = socket(c.downstream_remote_address.as_ref());
    let tls = c.tls_properties.as_ref();
    let line = Line {
        start_time: rfc3339(c.start_time.as_ref()),
        protocol,
        source_spiffe_id: uri_san(tls.and_then(|t| t.peer_certificate_properties.as_ref())),
        destination_spiffe_id: uri_san(tls.and_then(|t| t.local_certificate_properties.as_ref())),
        source_address: source
            .as_ref()
            .map(|(ip, port)| format!("{ip}:{port}"))
            .unwrap_or_default(),
        destination_pod: pod,
        destination_port: port,
        upstream_host: socket(c.upstream_remote_address.as_ref())
            .map(|(ip, port)| format!("{ip}:{port}")),
        ..Line::default()
    };
    Some(Record {
        line,
        source_ip: source.and_then(|(ip, _)| ip.parse().ok()),
    })
}

impl AccessLogSink for AccessLogs {
    fn http(&self, log_name: &str, entry: &HttpAccessLogEntry) {
        let common = entry.common_properties.as_ref();
        let Some(mut record) = common_line(log_name, common, "http") else {
            return;
        };
        let line = &mut record.line;
        if let Some(r) = &entry.request {
            line.method = RequestMethod::try_from(r.request_method)
                .ok()
                .map(|m| m.as_str_name().to_string());
            line.authority = Some(bounded(&r.authority));
            line.path = Some(bounded(r.path.split('?').next().unwrap_or_default()));
            line.bytes_received = r.request_body_bytes;
        }
        if let Some(r) = &entry.response {
            line.status = Some(r.response_code.as_ref().map_or(0, |c| c.value));
            line.details = bounded(&r.response_code_details);
            line.bytes_sent = r.response_body_bytes;
        }
        line.duration_ms = millis(common.and_then(|c| c.time_to_last_downstream_tx_byte.as_ref()));
        self.send(record);
    }

    fn tcp(&self, log_name: &str, entry: &TcpAccessLogEntry) {
        let common = entry.common_properties.as_ref();
        let Some(mut record) = common_line(log_name, common, "tcp") else {
            return;
        };
        let line = &mut record.line;
        if let Some(c) = &entry.connection_properties {
            line.bytes_received = c.received_bytes;
            line.bytes_sent = c.sent_bytes;
        }
        line.details = common
            .map(|c| bounded(&c.connection_termination_details))
            .unwrap_or_default();
        line.duration_ms = millis(common.and_then(|c| c.duration.as_ref()));
        self.send(record);
    }
}

/// Where the writer thread writes.
enum Output {
    Stdout(std::io::Stdout),
    File {
        path: PathBuf,
        /// `u64::MAX` for anything but a regular file (`/dev/stdout`, a pipe): those are
        /// never renamed.
        max_bytes: u64,
        file: std::io::BufWriter<std::fs::File>,
        size: u64,
    },
}

/// Opens `path` for appending: created 0600, never through a symlink. Also says
/// whether it is a regular file (only those are rotated).
fn open_log(path: &Path) -> std::io::Result<(std::fs::File, u64, bool)> {
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(|e| {
            std::io::Error::new(e.kind(), format!("access log {}: {e}", path.display()))
        })?;
    let meta = file.metadata()?;
    Ok((file, meta.len(), meta.is_file()))
}

impl Output {
    fn open(dest: Destination) -> std::io::Result<Self> {
        Ok(match dest {
            Destination::Stdout => Output::Stdout(std::io::stdout()),
            Destination::File { path, max_bytes } => {
                let (file, size, regular) = open_log(&path)?;
                Output::File {
                    path,
                    max_bytes: if regular { max_bytes } else { u64::MAX },
                    file: std::io::BufWriter::new(file),
                    size,
                }
            }
        })
    }

    fn write_line(&mut self, line: &[u8]) -> std::io::Result<()> {
        match self {
            Output::Stdout(out) => {
                let mut out = out.lock();
                out.write_all(line)?;
                out.write_all(b"\n")
            }
            Output::File {
                path,
                max_bytes,
                file,
                size,
            } => {
                if *size > 0 && size.saturating_add(line.len() as u64 + 1) > *max_bytes {
                    file.flush()?;
                    let rotated = PathBuf::from(format!("{}.1", path.display()));
                    std::fs::rename(&*path, rotated)?;
                    let (f, s, _) = open_log(path)?;
                    *file = std::io::BufWriter::new(f);
                    *size = s;
                }
                file.write_all(line)?;
                file.write_all(b"\n")?;
                *size = size.saturating_add(line.len() as u64 + 1);
                Ok(())
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        match self {
            Output::Stdout(out) => out.flush(),
            Output::File { file, .. } => file.flush(),
        }
    }
}

/// How often at most the writer re-reads this node's pods for an address it does not
/// know (a pod that just started calls at once; a caller from outside the node never
/// becomes known, and must not cost a read per line).
const LOCAL_REFRESH: std::time::Duration = std::time::Duration::from_secs(1);

/// Pods by address and services by (pod, port), from the registry view and this
/// node's pods.
#[derive(Default)]
struct Names {
    seq: Option<u64>,
    pods: HashMap<IpAddr, PodName>,
    services: HashMap<(String, u16), String>,
    local: HashMap<IpAddr, PodName>,
    local_read: Option<std::time::Instant>,
}

impl Names {
    fn source_pod(
        &mut self,
        ip: IpAddr,
        local_pods: &std::sync::OnceLock<LocalPods>,
    ) -> Option<PodName> {
        if let Some(pod) = self.pods.get(&ip).or_else(|| self.local.get(&ip)) {
            return Some(pod.clone());
        }
        let read = local_pods.get()?;
        if self.local_read.is_some_and(|t| t.elapsed() < LOCAL_REFRESH) {
            return None;
        }
        self.local_read = Some(std::time::Instant::now());
        self.local = read().into_iter().collect();
        self.local.get(&ip).cloned()
    }

    fn refresh(&mut self, view: &ViewSource) {
        let v = view.borrow();
        if self.seq == Some(v.seq) {
            return;
        }
        self.seq = Some(v.seq);
        self.pods.clear();
        self.services.clear();
        for r in v.endpoints.values() {
            let e = &r.endpoint;
            self.pods.insert(
                e.address,
                PodName {
                    pod: e.pod.clone(),
                    service: Some(format!("{}.{}", e.service, e.namespace)),
                },
            );
            self.services
                .entry((e.pod.clone(), e.service_port))
                .or_insert_with(|| format!("{}.{}", e.service, e.namespace));
        }
    }

    fn enrich(&mut self, record: Record, local_pods: &std::sync::OnceLock<LocalPods>) -> Line {
        let mut line = record.line;
        if let Some(who) = record
            .source_ip
            .and_then(|ip| self.source_pod(ip, local_pods))
        {
            line.source_pod = Some(who.pod);
            line.source_service = who.service;
        }
        line.destination_service = self
            .services
            .get(&(line.destination_pod.clone(), line.destination_port))
            .cloned();
        line
    }
}

/// The writer thread's state.
struct Writer {
    out: Option<Output>,
    line_percent: u32,
    recorder: Option<Recorder>,
    written: Counter,
    local_pods: Arc<std::sync::OnceLock<LocalPods>>,
}

impl Writer {
    fn run(mut self, rx: Receiver<Record>, view: ViewSource) {
        let mut names = Names::default();
        let mut failing = false;
        // Lines kept so far in hundredths: a line is written each time this passes 100
        // (exactly `line_percent` of the entries, interleaved over every caller).
        let mut credit = 0u32;
        while let Ok(first) = rx.recv() {
            names.refresh(&view);
            let mut next = Some(first);
            while let Some(record) = next {
                let line = names.enrich(record, &self.local_pods);
                if let Some(r) = &mut self.recorder {
                    let pair = Pair::of(
                        line.source_spiffe_id.as_deref(),
                        line.destination_service.as_deref(),
                    );
                    if line.protocol == "tcp" {
                        r.connection(&pair, line.bytes_received, line.bytes_sent);
                    } else {
                        r.request(&pair, line.status.unwrap_or(0), line.duration_ms / 1e3);
                    }
                }
                credit += self.line_percent;
                if let Some(out) = &mut self.out
                    && credit >= 100
                {
                    credit -= 100;
                    let result = serde_json::to_vec(&line)
                        .map_err(std::io::Error::other)
                        .and_then(|bytes| out.write_line(&bytes));
                    match result {
                        Ok(()) => {
                            self.written.inc();
                            failing = false;
                        }
                        Err(e) if !failing => {
                            failing = true;
                            tracing::error!(error = %e, "access log: cannot write a line (lines are lost until a write succeeds)");
                        }
                        Err(_) => {}
                    }
                }
                credit %= 100;
                next = rx.try_recv().ok();
            }
            if let Some(out) = &mut self.out
                && let Err(e) = out.flush()
                && !failing
            {
                failing = true;
                tracing::error!(error = %e, "access log: cannot flush");
            }
        }
    }
}

/// Several sinks as one: every entry goes to each (each keeps the entries of its own
/// log name).
pub struct Sinks(pub Vec<Arc<dyn AccessLogSink>>);

impl AccessLogSink for Sinks {
    fn http(&self, log_name: &str, entry: &HttpAccessLogEntry) {
        self.0.iter().for_each(|s| s.http(log_name, entry));
    }

    fn tcp(&self, log_name: &str, entry: &TcpAccessLogEntry) {
        self.0.iter().for_each(|s| s.tcp(log_name, entry));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use envoy_types::pb::envoy::config::core::v3::{Address, SocketAddress};
    use envoy_types::pb::envoy::data::accesslog::v3::{
        ConnectionProperties, HttpRequestProperties, HttpResponseProperties, TlsProperties,
        tls_properties::CertificateProperties,
        tls_properties::certificate_properties::SubjectAltName,
    };
    use envoy_types::pb::google::protobuf::{Any, Duration as PbDuration, Timestamp, UInt32Value};
    use flock_xds::translate::telemetry::access_port_tag;

    fn view() -> ViewSource {
        tokio::sync::watch::channel(Arc::new(crate::registry::View::default())).1
    }

    fn addr(ip: &str, port: u32) -> Option<Address> {
        Some(Address {
            address: Some(address::Address::SocketAddress(SocketAddress {
                address: ip.into(),
                port_specifier: Some(socket_address::PortSpecifier::PortValue(port)),
                ..Default::default()
            })),
        })
    }

    fn cert(uri: &str) -> Option<CertificateProperties> {
        Some(CertificateProperties {
            subject_alt_name: vec![SubjectAltName {
                san: Some(San::Uri(uri.into())),
            }],
            ..Default::default()
        })
    }

    fn common(tag: Option<&str>) -> AccessLogCommon {
        let mut c = AccessLogCommon {
            downstream_remote_address: addr("10.0.0.7", 40000),
            upstream_remote_address: addr("10.0.0.9", 8080),
            tls_properties: Some(TlsProperties {
                peer_certificate_properties: cert("spiffe://t/ns/default/sa/a"),
                local_certificate_properties: cert("spiffe://t/ns/default/sa/web"),
                ..Default::default()
            }),
            start_time: Some(Timestamp {
                seconds: 1_796_599_845,
                nanos: 123_000_000,
            }),
            time_to_last_downstream_tx_byte: Some(PbDuration {
                seconds: 0,
                nanos: 2_500_000,
            }),
            duration: Some(PbDuration {
                seconds: 1,
                nanos: 0,
            }),
            connection_termination_details: "rbac_access_denied_matched_policy[none]".into(),
            ..Default::default()
        };
        if let Some(tag) = tag {
            c.filter_state_objects.insert(
                ACCESS_PORT_KEY.into(),
                Any {
                    type_url: "type.googleapis.com/google.protobuf.StringValue".into(),
                    value: StringValue { value: tag.into() }.encode_to_vec(),
                },
            );
        }
        c
    }

    fn http(tag: Option<&str>) -> HttpAccessLogEntry {
        HttpAccessLogEntry {
            common_properties: Some(common(tag)),
            request: Some(HttpRequestProperties {
                request_method: RequestMethod::Post as i32,
                authority: "web".into(),
                path: "/orders?token=s3cret".into(),
                request_body_bytes: 11,
                ..Default::default()
            }),
            response: Some(HttpResponseProperties {
                response_code: Some(UInt32Value { value: 201 }),
                response_body_bytes: 5,
                response_code_details: "via_upstream".into(),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    /// A sink whose queue nobody reads: what it accepted is in the receiver.
    fn unread(queue: usize) -> (AccessLogs, Receiver<Record>) {
        let (tx, rx) = sync_channel(queue);
        let logs = AccessLogs {
            tx,
            dropped: Counter::default(),
            written: Counter::default(),
            local_pods: Arc::default(),
            metrics: None,
        };
        (logs, rx)
    }

    #[test]
    fn an_http_entry_becomes_a_line_with_both_identities_and_no_query() {
        let (logs, rx) = unread(8);
        let tag = access_port_tag("default", "web-0", 8080);
        logs.http(ACCESS_LOG_NAME, &http(Some(&tag)));
        // Another log's entries and untagged ones are not access log lines.
        logs.http("flock.authz.denied", &http(Some(&tag)));
        logs.http(ACCESS_LOG_NAME, &http(None));
        logs.http(ACCESS_LOG_NAME, &http(Some("not a tag")));
        let records: Vec<Record> = rx.try_iter().collect();
        assert_eq!(records.len(), 1);
        let r = &records[0];
        assert_eq!(r.source_ip, Some("10.0.0.7".parse().unwrap()));
        let json = serde_json::to_value(&r.line).unwrap();
        assert_eq!(
            json,
            serde_json::json!({
                "start_time": "2026-12-06T23:30:45.123Z",
                "protocol": "http",
                "source_spiffe_id": "spiffe://t/ns/default/sa/a",
                "destination_spiffe_id": "spiffe://t/ns/default/sa/web",
                "source_address": "10.0.0.7:40000",
                "destination_pod": "default/web-0",
                "destination_port": 8080,
                "method": "POST",
                "authority": "web",
                "path": "/orders",
                "status": 201,
                "details": "via_upstream",
                "duration_ms": 2.5,
                "bytes_received": 11,
                "bytes_sent": 5,
                "upstream_host": "10.0.0.9:8080",
            })
        );
    }

    #[test]
    fn a_tcp_entry_says_how_the_connection_ended() {
        let (logs, rx) = unread(8);
        let entry = TcpAccessLogEntry {
            common_properties: Some(common(Some(&access_port_tag("db", "pg-0", 5432)))),
            connection_properties: Some(ConnectionProperties {
                received_bytes: 100,
                sent_bytes: 2000,
            }),
        };
        logs.tcp(ACCESS_LOG_NAME, &entry);
        let line = rx.try_recv().unwrap().line;
        assert_eq!(line.protocol, "tcp");
        assert_eq!((line.bytes_received, line.bytes_sent), (100, 2000));
        assert_eq!(line.duration_ms, 1000.0);
        assert_eq!(line.details, "rbac_access_denied_matched_policy[none]");
        assert_eq!(line.status, None);
        assert_eq!(line.destination_pod, "db/pg-0");
    }

    #[test]
    fn a_full_queue_drops_and_counts_instead_of_waiting() {
        let (logs, rx) = unread(2);
        let tag = access_port_tag("default", "web-0", 8080);
        for _ in 0..5 {
            logs.http(ACCESS_LOG_NAME, &http(Some(&tag)));
        }
        assert_eq!(rx.try_iter().count(), 2);
        assert_eq!(logs.dropped.get(), 3);
    }

    fn wait_written(logs: &AccessLogs, n: u64) {
        flock_testkit::wait_for(
            "the writer's lines",
            std::time::Duration::from_secs(10),
            || logs.written() >= n,
        );
    }

    #[test]
    fn the_file_is_private_rotated_once_past_its_size_and_enriched_from_the_registry() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.log");
        let mut v = crate::registry::View::default();
        let ep = crate::model::Endpoint {
            service: "web".into(),
            namespace: "default".into(),
            service_port: 8080,
            protocol: flock_core::pod::Protocol::Http,
            address: "10.0.0.9".parse().unwrap(),
            port: 15006,
            node: "n1".into(),
            pod: "default/web-0".into(),
            pod_key: flock_core::pod::PodKey::new("ctr", "eth0"),
            region: String::new(),
            zone: String::new(),
            health: flock_core::pod::Health::Healthy,
            identity: None,
            also_accept: Vec::new(),
            labels: Default::default(),
        };
        v.endpoints.insert(
            "k".into(),
            crate::registry::Registered {
                endpoint: Arc::new(ep),
                revision: 1,
            },
        );
        v.seq = 1;
        let (_tx, rx) = tokio::sync::watch::channel(Arc::new(v));
        let logs = AccessLogs::start(
            Outputs {
                lines: Some(Destination::File {
                    path: path.clone(),
                    // About five lines of these (some 460 bytes each): eight lines
                    // rotate once.
                    max_bytes: 2500,
                }),
                line_percent: 100,
                metrics: None,
            },
            rx,
        )
        .unwrap();
        logs.set_local_pods(Box::new(|| {
            vec![(
                "10.0.0.7".parse().unwrap(),
                PodName {
                    pod: "default/a-0".into(),
                    service: Some("a.default".into()),
                },
            )]
        }));
        let tag = access_port_tag("default", "web-0", 8080);
        for _ in 0..8 {
            logs.http(ACCESS_LOG_NAME, &http(Some(&tag)));
        }
        wait_written(&logs, 8);
        let rotated = dir.path().join("access.log.1");
        let (now, old) = (
            std::fs::read_to_string(&path).unwrap(),
            std::fs::read_to_string(&rotated).unwrap(),
        );
        assert_eq!(now.lines().count() + old.lines().count(), 8);
        assert!(
            !now.is_empty() && old.len() <= 2500,
            "{} {}",
            now.len(),
            old.len()
        );
        let line: serde_json::Value = serde_json::from_str(now.lines().next().unwrap()).unwrap();
        assert_eq!(line["destination_service"], "web.default");
        assert_eq!(line["source_pod"], "default/a-0");
        assert_eq!(line["source_service"], "a.default");
        use std::os::unix::fs::PermissionsExt as _;
        for p in [&path, &rotated] {
            assert_eq!(
                std::fs::metadata(p).unwrap().permissions().mode() & 0o777,
                0o600
            );
        }
    }

    #[test]
    fn with_metrics_every_entry_is_counted_and_the_lines_sampled() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("access.log");
        let metrics = WorkloadMetrics::default();
        let logs = AccessLogs::start(
            Outputs {
                lines: Some(Destination::File {
                    path: path.clone(),
                    max_bytes: 1 << 20,
                }),
                line_percent: 10,
                metrics: Some(metrics.clone()),
            },
            view(),
        )
        .unwrap();
        let tag = access_port_tag("default", "web-0", 8080);
        for _ in 0..40 {
            logs.http(ACCESS_LOG_NAME, &http(Some(&tag)));
        }
        wait_written(&logs, 4);
        let mut registry = Registry::default();
        logs.register(&mut registry);
        let count = r#"flock_requests_total{source_namespace="default",source="a",destination="unknown",code="201"} 40"#;
        flock_testkit::wait_for(
            "40 requests counted",
            std::time::Duration::from_secs(10),
            || {
                let mut out = String::new();
                flock_telemetry::prometheus_client::encoding::text::encode(&mut out, &registry)
                    .unwrap();
                out.contains(count)
            },
        );
        assert_eq!(logs.written(), 4, "one line in ten");
        assert_eq!(std::fs::read_to_string(&path).unwrap().lines().count(), 4);
    }

    #[test]
    fn a_symlink_is_not_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("elsewhere");
        std::fs::write(&target, "").unwrap();
        let link = dir.path().join("access.log");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let err = AccessLogs::start(
            Outputs {
                lines: Some(Destination::File {
                    path: link.clone(),
                    max_bytes: 1 << 20,
                }),
                line_percent: 100,
                metrics: None,
            },
            view(),
        )
        .unwrap_err();
        assert!(err.to_string().contains("access.log"), "{err}");
    }
}
