//! Golden metrics end to end: the real agent with `--capture strict
//! --workload-metrics`, a real Envoy under `flock-supervisor`, pods on a libcni bridge
//! with unmodified `curl` clients (captured, mTLS), and a **real Prometheus** (Debian's
//! `prometheus`, `FLOCK_PROMETHEUS_BIN`) running the shipped
//! `deploy/prometheus/prometheus.yml` (its target pointed at this agent's admin
//! address, its intervals at 1 s) and recording rules `flock-rules.yml`.
//!
//! * `prometheus_sees_each_pairs_requests_and_success_rate`: requests from `client` to
//!   `web` (always 200) and to `flaky` (every tenth `/status/500`): PromQL
//!   `sum(rate(flock_requests_total{source="client",destination="web.default",code="200"}[1m])) > 0`
//!   answers, the recorded success rate of client → web is 1.0 and of client → flaky
//!   0.9 ± 0.02, and the p99 latency rule gives a number.
//!
//! * `a_calls_two_hops_share_one_trace_at_the_otlp_receiver`: `--trace-collector` on;
//!   an unmodified request from `client` to `web` carrying a W3C `traceparent`, and one
//!   without, each give an egress span (the caller's outbound listener, kind CLIENT)
//!   and an ingress span (the callee's inbound listener, kind SERVER) of one trace at
//!   an OTLP receiver, the ingress span the child of the egress one. The receiver is
//!   the OpenTelemetry project's own generated collector service (PyPI
//!   `opentelemetry-proto`) on grpcio, printing each span it is sent: a real OTLP
//!   endpoint, not an imitation of one.
//!
//! Needs root, nft, `FLOCK_ENVOY_BIN`, `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL`,
//! `FLOCK_PROMETHEUS_BIN`, `FLOCK_GRPC_PYTHON` and the sibling binaries (see
//! `common`).

mod capturekit;
mod common;

use capturekit::*;
use common::*;
use serde_json::Value;
use std::path::{Path, PathBuf};

const TRUST_DOMAIN: &str = "mesh.test";

/// A Prometheus of its own: the shipped config and rules, scraping `agent`.
struct Prometheus {
    _proc: ChildGuard,
    address: String,
    _port: flock_testkit::ChildPort,
}

fn deploy_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/prometheus")
        .join(name)
}

impl Prometheus {
    fn start(agent: &Agent, work: &Path) -> Self {
        let bin = required_env("FLOCK_PROMETHEUS_BIN");
        let shipped = std::fs::read_to_string(deploy_file("prometheus.yml")).unwrap();
        assert!(shipped.contains("127.0.0.1:18090"), "{shipped}");
        assert!(shipped.contains("scrape_interval: 15s"), "{shipped}");
        let config = shipped
            .replace("127.0.0.1:18090", &agent.admin)
            .replace("scrape_interval: 15s", "scrape_interval: 1s")
            .replace("evaluation_interval: 15s", "evaluation_interval: 1s");
        std::fs::write(work.join("prometheus.yml"), config).unwrap();
        std::fs::copy(deploy_file("flock-rules.yml"), work.join("flock-rules.yml")).unwrap();
        let port = flock_testkit::reserve_port_for_child();
        let address = format!("127.0.0.1:{}", port.port());
        let mut cmd = std::process::Command::new(bin);
        cmd.arg(format!(
            "--config.file={}",
            work.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            work.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address={address}"));
        let mut proc = ChildGuard::spawn(cmd, work.join("prometheus.log"));
        wait_for("Prometheus ready", WAIT, || {
            assert!(proc.running(), "prometheus exited: {}", proc.log_text());
            http_get(&address, "/-/ready").is_ok_and(|(s, _)| s == 200)
        });
        Self {
            _proc: proc,
            address,
            _port: port,
        }
    }

    /// An instant query's vector: (labels, value) per series.
    fn query(&self, promql: &str) -> Vec<(Value, f64)> {
        let out = std::process::Command::new("curl")
            .args(["-sS", "-m", "5", "-G"])
            .arg(format!("http://{}/api/v1/query", self.address))
            .arg("--data-urlencode")
            .arg(format!("query={promql}"))
            .output()
            .expect("curl");
        let v: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
        assert_eq!(v["status"], "success", "{promql}: {v}");
        v["data"]["result"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .map(|s| {
                let value = s["value"][1]
                    .as_str()
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(f64::NAN);
                (s["metric"].clone(), value)
            })
            .collect()
    }

    /// The single value of `promql`, once it has one.
    fn value(&self, promql: &str) -> f64 {
        wait_for(&format!("a value for {promql}"), WAIT, || {
            let r = self.query(promql);
            (r.len() == 1 && r[0].1.is_finite()).then(|| r[0].1)
        })
    }
}

/// `n` requests from `from` to `url_of(i)`, each asserted to get `expect(i)`.
fn requests(from: &Pod, n: usize, url_of: impl Fn(usize) -> String, expect: impl Fn(usize) -> u16) {
    for i in 0..n {
        let url = url_of(i);
        let (status, body) = curl_in(&from.ns, &url);
        assert_eq!(status, expect(i), "{url}: {body}");
    }
}

#[test]
fn prometheus_sees_each_pairs_requests_and_success_rate() {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let _ = required_env("FLOCK_PROMETHEUS_BIN");
    let _ = envoy_bin();
    let agent = Agent::start(&[
        "--capture",
        "strict",
        "--trust-domain",
        TRUST_DOMAIN,
        "--workload-metrics",
    ]);
    let _envoy = SupervisedEnvoy::start(&agent);
    let work = tempfile::Builder::new()
        .prefix("flock-telemetry-")
        .tempdir()
        .unwrap();
    let net = ChainedNetwork::start(work.path(), &agent, "tel", 8000);
    let log = |n: &str| work.path().join(format!("{n}.log"));
    let ns_web = NetNs::new("tw");
    let _web_app = peer_echo_server_in(&ns_web, 8080, "web-0", &log("web-0"));
    let ns_flaky = NetNs::new("tf");
    let _flaky_app = peer_echo_server_in(&ns_flaky, 8080, "flaky-0", &log("flaky-0"));
    let client = Pod::add_client(&net.cni, "tc", "client-0");
    let web = Pod::add_server(&net.cni, ns_web, "web-0", "web");
    let flaky = Pod::add_server(&net.cni, ns_flaky, "flaky-0", "flaky");
    let prom = Prometheus::start(&agent, work.path());
    let web_url = format!("http://{}:8080/", web.ip);
    wait_for("client → web answers 200", WAIT, || {
        curl_in(&client.ns, &web_url).0 == 200
    });
    // Every tenth request to flaky asks for a 500.
    let flaky_url = |i: usize| {
        if i % 10 == 9 {
            format!("http://{}:8080/status/500", flaky.ip)
        } else {
            format!("http://{}:8080/ok", flaky.ip)
        }
    };
    let flaky_code = |i: usize| if i % 10 == 9 { 500 } else { 200 };
    wait_for("client → flaky answers 200", WAIT, || {
        curl_in(&client.ns, &flaky_url(0)).0 == 200
    });

    // Every series exists in Prometheus before the measured traffic, so rate() counts
    // all of it (a counter's increase before its first scrape is not in any rate).
    requests(&client, 10, |_| web_url.clone(), |_| 200);
    requests(&client, 10, flaky_url, flaky_code);
    wait_for("the pairs' three series scraped", WAIT, || {
        prom.query(r#"flock_requests_total{source="client"}"#).len() == 3
    });
    let before = prom.value(r#"sum(flock_requests_total{source="client"})"#);

    // The measured traffic.
    requests(&client, 200, |_| web_url.clone(), |_| 200);
    requests(&client, 500, flaky_url, flaky_code);
    wait_for("Prometheus to scrape every request", WAIT, || {
        prom.value(r#"sum(flock_requests_total{source="client"})"#) >= before + 700.0
    });
    assert_eq!(
        prom.value(r#"sum(flock_requests_total{source="client"})"#),
        before + 700.0,
        "one count per request"
    );

    let rate = prom.query(
        r#"sum(rate(flock_requests_total{source="client",destination="web.default",code="200"}[1m])) > 0"#,
    );
    assert_eq!(rate.len(), 1, "{rate:?}");
    println!("client → web: {:.2} requests/s over 1m", rate[0].1);

    // The recording rules run every second: wait for one past the last scrape.
    let success = |dest: &str| {
        prom.value(&format!(
            r#"flock:request_success_rate:rate1m{{source_namespace="default",source="client",destination="{dest}"}}"#
        ))
    };
    let web_rate = wait_for("client → web's success rate 1.0", WAIT, || {
        let v = success("web.default");
        (v == 1.0).then_some(v)
    });
    let flaky_rate = wait_for("client → flaky's success rate near 0.9", WAIT, || {
        let v = success("flaky.default");
        ((v - 0.9).abs() <= 0.02).then_some(v)
    });
    let p99 = prom.value(
        r#"flock:request_duration_seconds:p99_1m{source="client",destination="web.default"}"#,
    );
    println!(
        "success rate: client → web {web_rate:.4}, client → flaky {flaky_rate:.4} (injected 0.9); \
         client → web p99 {:.1} ms",
        p99 * 1e3
    );
    assert!(p99 > 0.0 && p99 < 10.0, "{p99}");
    let (_, metrics) = agent.get("/metrics");
    assert!(
        metrics.contains("flock_workload_metrics_dropped_total 0"),
        "{metrics}"
    );
}

/// An OTLP/gRPC trace receiver (Python, `opentelemetry-proto` on grpcio) on `port`,
/// printing one JSON line per span it is sent.
fn otlp_receiver(port: u16, log: PathBuf) -> ChildGuard {
    const SRC: &str = r#"
import grpc, json, sys
from concurrent import futures
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        for rs in request.resource_spans:
            service = ""
            for a in rs.resource.attributes:
                if a.key == "service.name":
                    service = a.value.string_value
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    print(json.dumps({"trace_id": sp.trace_id.hex(), "span_id": sp.span_id.hex(),
                                      "parent": sp.parent_span_id.hex(), "kind": sp.kind,
                                      "name": sp.name, "service": service}), flush=True)
        return trace_service_pb2.ExportTraceServiceResponse()

server = grpc.server(futures.ThreadPoolExecutor(4))
trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
server.add_insecure_port("127.0.0.1:" + sys.argv[1])
server.start()
print("listening", flush=True)
server.wait_for_termination()
"#;
    let mut cmd = std::process::Command::new(required_env("FLOCK_GRPC_PYTHON"));
    cmd.args(["-u", "-c", SRC, &port.to_string()]);
    let mut proc = ChildGuard::spawn(cmd, log);
    wait_for("the OTLP receiver listening", WAIT, || {
        assert!(proc.running(), "receiver exited: {}", proc.log_text());
        proc.log_text().contains("listening")
    });
    proc
}

/// The spans a receiver printed.
fn spans(receiver: &ChildGuard) -> Vec<Value> {
    receiver
        .log_text()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .collect()
}

/// OTLP span kinds.
const SPAN_KIND_SERVER: u64 = 2;
const SPAN_KIND_CLIENT: u64 = 3;

/// The trace's egress (CLIENT) and ingress (SERVER) spans, once both arrived.
fn hops(receiver: &ChildGuard, trace_id: &str) -> Option<(Value, Value)> {
    let of_trace: Vec<Value> = spans(receiver)
        .into_iter()
        .filter(|s| s["trace_id"] == trace_id)
        .collect();
    let kind = |k| of_trace.iter().find(|s| s["kind"] == k).cloned();
    Some((kind(SPAN_KIND_CLIENT)?, kind(SPAN_KIND_SERVER)?))
}

#[test]
fn a_calls_two_hops_share_one_trace_at_the_otlp_receiver() {
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let _ = envoy_bin();
    let work = tempfile::Builder::new()
        .prefix("flock-tracing-")
        .tempdir()
        .unwrap();
    let port = flock_testkit::reserve_port_for_child();
    let receiver = otlp_receiver(port.port(), work.path().join("otlp.log"));
    let collector = format!("127.0.0.1:{}", port.port());
    let agent = Agent::start(&[
        "--capture",
        "strict",
        "--trust-domain",
        TRUST_DOMAIN,
        "--trace-collector",
        &collector,
        "--trace-sample-percent",
        "100",
    ]);
    let _envoy = SupervisedEnvoy::start(&agent);
    let net = ChainedNetwork::start(work.path(), &agent, "trc", 8000);
    let ns_web = NetNs::new("rw");
    let _web_app = peer_echo_server_in(&ns_web, 8080, "web-0", &work.path().join("web-0.log"));
    let client = Pod::add_client(&net.cni, "rc", "client-0");
    let web = Pod::add_server(&net.cni, ns_web, "web-0", "web");
    let url = format!("http://{}:8080/traced", web.ip);
    wait_for("client → web answers 200", WAIT, || {
        curl_in(&client.ns, &url).0 == 200
    });

    // A caller's own trace: its traceparent's trace ID and span as the egress parent.
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let caller_span = "00f067aa0ba902b7";
    let out = client
        .ns
        .command("curl")
        .args(["-sS", "-m", "5", "-o", "/dev/null", "-w", "%{http_code}"])
        .args([
            "-H",
            &format!("traceparent: 00-{trace_id}-{caller_span}-01"),
        ])
        .arg(&url)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&out.stdout), "200");
    let (egress, ingress) = wait_for("both hops of the caller's trace", WAIT, || {
        hops(&receiver, trace_id)
    });
    println!("egress span: {egress}\ningress span: {ingress}");
    assert_eq!(
        egress["parent"], caller_span,
        "the egress span continues the caller's"
    );
    assert_eq!(
        ingress["parent"], egress["span_id"],
        "the ingress span is the egress span's child"
    );
    assert_eq!(egress["service"], "flock-envoy");

    // Without a traceparent, Envoy starts the trace (100% sampled here) and the two
    // hops still share it.
    let before: std::collections::BTreeSet<String> = spans(&receiver)
        .iter()
        .filter_map(|s| s["trace_id"].as_str().map(str::to_string))
        .collect();
    assert_eq!(curl_in(&client.ns, &url).0, 200);
    let started = wait_for("a new trace with both hops", WAIT, || {
        spans(&receiver)
            .iter()
            .filter_map(|s| s["trace_id"].as_str())
            .filter(|t| !before.contains(*t))
            .find(|t| hops(&receiver, t).is_some())
            .map(str::to_string)
    });
    let (egress, ingress) = hops(&receiver, &started).unwrap();
    assert_eq!(egress["parent"], "", "a root span");
    assert_eq!(ingress["parent"], egress["span_id"]);
}
