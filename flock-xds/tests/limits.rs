//! The server's bounds on what one client can make it hold, over real gRPC streams
//! (tonic client and server on loopback TCP, in this process): the cap on names
//! subscribed per stream, the `Node` field lengths, the first-request timeout, the
//! server-wide cap on open streams, and the closed label set of `/metrics` under
//! client-chosen type URLs.

mod common;

use common::xds::{NODE, cache_with, delta_req, sotw_req, start_tcp};
use envoy_types::pb::envoy::config::core::v3::Node;
use flock_xds::client::{self, RecvError, SotwStream};
use flock_xds::protocol::{DeltaAds, DeltaRequest, SotwAds, SotwRequest};
use flock_xds::server::{ConnectionLimits, Limits, Server};
use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER};
use proptest::prelude::*;
use std::sync::Arc;
use std::time::Duration;
use tonic::Code;

const WAIT: Duration = Duration::from_secs(10);

/// The status a stream ended with, or a panic naming what came instead.
async fn ended_with<Req, Resp: std::fmt::Debug>(
    stream: &mut client::AdsStream<Req, Resp>,
) -> tonic::Status {
    loop {
        match stream.recv(WAIT).await {
            Ok(_) => continue, // a response to an earlier, admitted request
            Err(RecvError::Status(status)) => return status,
            Err(other) => panic!("expected the stream to end with a status, got {other}"),
        }
    }
}

/// The process's resident set size, from /proc/self/status (for the report only).
fn vm_rss() -> String {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .map(|l| l["VmRSS:".len()..].trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

fn sotw(type_url: &str, names: &[&str]) -> SotwRequest {
    SotwRequest {
        type_url: type_url.into(),
        resource_names: names.iter().map(|s| s.to_string()).collect(),
        ..SotwRequest::default()
    }
}

fn delta(type_url: &str, subscribe: &[&str], unsubscribe: &[&str]) -> DeltaRequest {
    DeltaRequest {
        type_url: type_url.into(),
        resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
        resource_names_unsubscribe: unsubscribe.iter().map(|s| s.to_string()).collect(),
        ..DeltaRequest::default()
    }
}

/// What the cap is checked against: SotW replaces a type's names (duplicates and `*`
/// not counted), Delta accumulates them over requests (a name subscribed and
/// unsubscribed in one request ends up unsubscribed), and both sum over types.
#[test]
fn subscribed_names_are_counted_across_types_and_requests() {
    let mut sotw_ads = SotwAds::<()>::new();
    let eds = sotw(ENDPOINT, &["a", "b", "b", "*"]);
    assert_eq!(sotw_ads.subscribed_names_after(&eds), 2);
    sotw_ads.on_request(&eds);
    assert_eq!(sotw_ads.subscribed_names(), 2);
    assert_eq!(
        sotw_ads.subscribed_names_after(&sotw(CLUSTER, &["x", "y", "z"])),
        5
    );
    // A type's new list replaces its old one.
    assert_eq!(
        sotw_ads.subscribed_names_after(&sotw(ENDPOINT, &["c"])),
        1,
        "SotW replaces"
    );

    let mut delta_ads = DeltaAds::<()>::new();
    let first = delta(ENDPOINT, &["a", "b", "*"], &[]);
    assert_eq!(delta_ads.subscribed_names_after(&first), 2);
    delta_ads.on_request(&first);
    let more = delta(ENDPOINT, &["c", "c", "a"], &[]);
    assert_eq!(
        delta_ads.subscribed_names_after(&more),
        3,
        "Delta accumulates"
    );
    delta_ads.on_request(&more);
    assert_eq!(delta_ads.subscribed_names(), 3);
    let churn = delta(ENDPOINT, &["d", "e"], &["a", "e", "nope", "*"]);
    assert_eq!(delta_ads.subscribed_names_after(&churn), 3, "b c d");
    delta_ads.on_request(&churn);
    assert_eq!(
        delta_ads.subscribed_names(),
        3,
        "the count matches the machine"
    );
    assert_eq!(
        delta_ads.subscribed_names_after(&delta(CLUSTER, &["x"], &[])),
        4
    );
}

/// A request from a small alphabet of types and names (with `*` and repeats), so
/// subscribe/unsubscribe overlap often.
fn arb_names() -> impl Strategy<Value = Vec<String>> {
    proptest::collection::vec(
        prop_oneof![Just("*".to_string()), "[a-e]".prop_map(String::from)],
        0..6,
    )
}

fn arb_type() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(ENDPOINT.to_string()),
        Just(CLUSTER.to_string()),
        Just("x".to_string())
    ]
}

proptest! {
    /// The count a request is checked against before it is fed is exactly the count
    /// the machines hold after it is fed, for any sequence of Delta requests: the
    /// check neither lets a stream past the cap nor refuses one under it.
    #[test]
    fn delta_count_before_a_request_matches_the_machines_after_it(
        reqs in proptest::collection::vec((arb_type(), arb_names(), arb_names()), 1..20)
    ) {
        let mut ads = DeltaAds::<()>::new();
        for (t, sub, unsub) in reqs {
            let req = DeltaRequest {
                type_url: t,
                resource_names_subscribe: sub,
                resource_names_unsubscribe: unsub,
                ..DeltaRequest::default()
            };
            let predicted = ads.subscribed_names_after(&req);
            ads.on_request(&req);
            prop_assert_eq!(predicted, ads.subscribed_names());
            let by_type: usize = [ENDPOINT, CLUSTER, "x"]
                .iter()
                .filter_map(|t| ads.get(t))
                .map(|m| m.subscription().names().len())
                .sum();
            prop_assert_eq!(by_type, ads.subscribed_names());
        }
    }

    /// The same for SotW, where each request replaces its type's names.
    #[test]
    fn sotw_count_before_a_request_matches_the_machines_after_it(
        reqs in proptest::collection::vec((arb_type(), arb_names()), 1..20)
    ) {
        let mut ads = SotwAds::<()>::new();
        for (t, names) in reqs {
            let req = SotwRequest {
                type_url: t,
                resource_names: names,
                ..SotwRequest::default()
            };
            let predicted = ads.subscribed_names_after(&req);
            ads.on_request(&req);
            prop_assert_eq!(predicted, ads.subscribed_names());
        }
    }
}

/// The cap on names per stream, over the wire: a Delta stream that keeps adding names
/// (each request under the per-request limit) and a SotW stream that spreads names
/// over types both end with `RESOURCE_EXHAUSTED` naming the limit; a stream that
/// churns under the cap is served. (Mutant `xds-unbounded-stream` removes the check.)
#[tokio::test]
async fn a_stream_over_its_subscribed_names_cap_ends_with_resource_exhausted() {
    let cache = cache_with(&[(ENDPOINT, "e0", "E0"), (CLUSTER, "c0", "C0")]);
    let server = Server::builder(Arc::clone(&cache))
        .limits(Limits {
            max_names_per_request: 4,
            max_subscribed_names_per_stream: 6,
            ..Limits::default()
        })
        .build();
    let running = start_tcp(server).await;

    let mut growing = running.delta().await;
    growing
        .send(delta_req(ENDPOINT, &["e0", "e1", "e2", "e3"], &[], ""))
        .unwrap();
    let first = growing.recv(WAIT).await.unwrap();
    growing
        .send(delta_req(ENDPOINT, &["e4", "e5"], &[], &first.nonce))
        .unwrap(); // 6 names: at the cap, allowed
    growing.send(delta_req(CLUSTER, &["c0"], &[], "")).unwrap(); // 7: over it
    let status = ended_with(&mut growing).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(
        status.message().contains("7 resource names")
            && status
                .message()
                .contains("limit of 6 (max_subscribed_names_per_stream)"),
        "{status:?}"
    );

    let mut spread = running.sotw().await;
    spread
        .send(sotw_req(ENDPOINT, &["e0", "e1", "e2", "e3"], "", ""))
        .unwrap();
    spread
        .send(sotw_req(CLUSTER, &["c0", "c1", "c2"], "", ""))
        .unwrap();
    let status = ended_with(&mut spread).await;
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("limit of 6"), "{status:?}");

    // Unsubscribing makes room: 4 + 2 - 2 + 2 stays at 6 all along.
    let mut churn = running.delta().await;
    churn
        .send(delta_req(ENDPOINT, &["e0", "e1", "e2", "e3"], &[], ""))
        .unwrap();
    churn
        .send(delta_req(CLUSTER, &["c0", "c1"], &[], ""))
        .unwrap();
    churn
        .send(delta_req(ENDPOINT, &["e4", "e5"], &["e2", "e3"], ""))
        .unwrap();
    let mut seen = std::collections::BTreeSet::new();
    while seen.len() < 2 {
        let resp = churn.recv(WAIT).await.unwrap();
        seen.insert(resp.type_url.clone());
        churn
            .send(delta_req(&resp.type_url, &[], &[], &resp.nonce))
            .unwrap();
    }
    assert_eq!(
        running
            .server
            .metrics()
            .refused_streams("max_subscribed_names"),
        2
    );
    running.stop().await;
}

/// `Node` fields over their limits end the stream at its first request with
/// `INVALID_ARGUMENT` naming the field and the limit, quoting at most 64 characters of
/// the value, escaped; fields at the limit are served.
#[tokio::test]
async fn node_fields_over_their_limits_are_refused_with_invalid_argument() {
    let cache = cache_with(&[(CLUSTER, "c0", "C0")]);
    let running = start_tcp(Server::new(Arc::clone(&cache))).await;
    let channel = client::connect(&running.target).await.unwrap();
    let evil = format!("\"\n{}", "x".repeat(1 << 16));
    for (field, node) in [
        (
            "node.id",
            Node {
                id: evil.clone(),
                ..Node::default()
            },
        ),
        (
            "node.cluster",
            Node {
                id: NODE.into(),
                cluster: evil.clone(),
                ..Node::default()
            },
        ),
        (
            "node.user_agent_name",
            Node {
                id: NODE.into(),
                user_agent_name: evil.clone(),
                ..Node::default()
            },
        ),
    ] {
        let mut ads = client::sotw(channel.clone()).await.unwrap();
        let mut req = sotw_req(CLUSTER, &[], "", "");
        req.node = Some(node);
        ads.send(req).unwrap();
        let status = ended_with(&mut ads).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{field}: {status:?}");
        let msg = status.message();
        assert!(
            msg.starts_with(&format!("{field} is {} bytes long", evil.len())),
            "{msg}"
        );
        assert!(msg.contains("more than the limit of"), "{msg}");
        assert!(!msg.contains('\n'), "escaped: {msg:?}");
        assert!(msg.len() < 200, "the value is cut: {} bytes", msg.len());
    }
    assert_eq!(
        running
            .server
            .metrics()
            .refused_streams("node_field_too_long"),
        3
    );
    // At the limits: served.
    let mut ok = client::sotw(channel).await.unwrap();
    let mut req = sotw_req(CLUSTER, &[], "", "");
    req.node = Some(Node {
        id: NODE.into(),
        cluster: "c".repeat(256),
        user_agent_name: "u".repeat(128),
        ..Node::default()
    });
    ok.send(req).unwrap();
    assert_eq!(ok.recv(WAIT).await.unwrap().type_url, CLUSTER);
    running.stop().await;
}

/// A stream that sends nothing ends with `DEADLINE_EXCEEDED` when the first-request
/// timeout runs out (not before), and a stream whose first request comes just in time
/// is served and lives on past it. Paused clock: the timeout is the server's timer.
/// (Mutant `xds-unbounded-stream` removes the timeout.)
#[tokio::test(start_paused = true)]
async fn a_stream_without_a_first_request_ends_at_the_first_request_timeout() {
    let timeout = Duration::from_secs(10);
    let cache = cache_with(&[(CLUSTER, "c0", "C0")]);
    let server = Server::builder(Arc::clone(&cache))
        .limits(Limits {
            first_request_timeout: timeout,
            ..Limits::default()
        })
        .build();
    let running = start_tcp(server).await;
    let start = tokio::time::Instant::now();
    let mut silent = running.sotw().await;
    let mut late = running.sotw().await;

    tokio::time::sleep(timeout - Duration::from_secs(1)).await;
    late.send(sotw_req(CLUSTER, &[], "", "")).unwrap();
    let resp = late.recv(WAIT).await.unwrap();
    assert_eq!(resp.type_url, CLUSTER);
    late.send(sotw_req(CLUSTER, &[], &resp.version_info, &resp.nonce))
        .unwrap();

    match silent.recv(Duration::from_secs(3600)).await {
        Err(RecvError::Status(status)) => {
            assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
            assert!(
                status.message().contains("first_request_timeout"),
                "{status:?}"
            );
        }
        other => panic!("expected DEADLINE_EXCEEDED, got {other:?}"),
    }
    assert!(
        start.elapsed() >= timeout,
        "ended after {:?}",
        start.elapsed()
    );
    assert!(
        start.elapsed() < timeout + Duration::from_secs(1),
        "ended after {:?}",
        start.elapsed()
    );
    assert_eq!(
        running
            .server
            .metrics()
            .refused_streams("first_request_timeout"),
        1
    );

    // The served stream is not subject to it: an update still arrives much later.
    tokio::time::sleep(timeout * 3).await;
    common::xds::upsert(&cache, &[(CLUSTER, "c1", "C1")]);
    let update = late.recv(WAIT).await.unwrap();
    assert_eq!(update.resources.len(), 2);
    running.stop().await;
}

/// A `tracing` writer into a shared buffer, to read what the server logged.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The NACK warning carries the client's node ID, type URL and error message: each is
/// written escaped, so a newline in any of them cannot start a forged log line, and
/// the error is cut to `max_error_detail_len`. (Single-threaded runtime: the server's
/// stream tasks log through this test's subscriber.)
#[tokio::test]
async fn a_nack_cannot_forge_log_lines() {
    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    let _guard = tracing::subscriber::set_default(subscriber);

    let evil_type = "type.googleapis.com/x\nFORGED type line";
    let evil_node = "n1\nFORGED node line";
    let cache = Arc::new(flock_xds::cache::Cache::by_node_id());
    cache.update(evil_node, |s| s.edit().build()); // version 1, empty
    let server = Server::builder(Arc::clone(&cache))
        .limits(Limits {
            max_error_detail_len: 40,
            ..Limits::default()
        })
        .build();
    let running = start_tcp(server).await;
    let mut ads = running.sotw().await;
    let mut req = sotw_req(evil_type, &[], "", "");
    req.node = Some(Node {
        id: evil_node.into(),
        ..Node::default()
    });
    ads.send(req.clone()).unwrap();
    let resp = ads.recv(WAIT).await.unwrap();
    req.response_nonce = resp.nonce.clone();
    req.error_detail = Some(envoy_types::pb::google::rpc::Status {
        code: 3,
        message: format!("bad\nFORGED error line{}", "!".repeat(1000)),
        details: vec![],
    });
    ads.send(req).unwrap();
    // The NACK is handled before the stream looks at the next request.
    ads.send(sotw_req("", &[], "", "")).unwrap();
    let _ = ended_with(&mut ads).await;
    running.stop().await;

    let text = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let nack = text
        .lines()
        .find(|l| l.contains("rejected a response (NACK)"))
        .unwrap_or_else(|| panic!("no NACK warning in:\n{text}"));
    assert!(
        nack.contains(r#"node="n1\nFORGED node line""#),
        "node escaped: {nack}"
    );
    assert!(
        nack.contains(r#"\nFORGED type line""#),
        "type escaped: {nack}"
    );
    assert!(
        nack.contains(&format!(
            r#"error="bad\nFORGED error line{}""#,
            "!".repeat(40 - "bad\nFORGED error line".len())
        )),
        "error escaped and cut to 40 bytes: {nack}"
    );
    assert!(
        !text.lines().any(|l| l.starts_with("FORGED")),
        "no forged line:\n{text}"
    );
}

/// Sends every type URL of `urls` on SotW ADS streams of `channel`, as many per stream
/// as the per-stream type limit allows, and reads each type's initial response; each
/// stream is then ended by a request without a type, which the server refuses after
/// it has handled (and counted) every request before it.
async fn send_types(channel: tonic::transport::Channel, urls: Vec<String>, per_stream: usize) {
    for chunk in urls.chunks(per_stream) {
        let mut ads: SotwStream = client::sotw(channel.clone()).await.unwrap();
        for url in chunk {
            ads.send(sotw_req(url, &[], "", "")).unwrap();
        }
        for _ in chunk {
            let resp = ads.recv(WAIT).await.unwrap();
            assert!(resp.resources.is_empty(), "{}", resp.type_url);
        }
        ads.send(sotw_req("", &[], "", "")).unwrap();
        let status = ended_with(&mut ads).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().contains("must set type_url"), "{status:?}");
    }
}

/// The sample lines of a Prometheus text exposition (its series).
fn series(text: &str) -> Vec<&str> {
    text.lines().filter(|l| !l.starts_with('#')).collect()
}

/// 10,000 distinct type URLs chosen by clients, sent over real streams on several
/// connections, add no series to the server's metrics and none of them appears in the
/// exposition: they are all counted under `type="other"`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_client_type_urls_add_no_metric_series() {
    const URLS: usize = 10_000;
    const CONNECTIONS: usize = 4;
    let cache = cache_with(&[(CLUSTER, "c0", "C0")]);
    let running = start_tcp(Server::new(Arc::clone(&cache))).await;
    let metrics = running.server.metrics().clone();
    let before = metrics.render_prometheus();
    let per_stream = Limits::default().max_types_per_stream;

    let urls: Vec<String> = (0..URLS)
        .map(|i| format!("type.googleapis.com/bogus.T{i}"))
        .collect();
    let mut tasks = Vec::new();
    for part in urls.chunks(URLS.div_ceil(CONNECTIONS)) {
        let channel = client::connect(&running.target).await.unwrap();
        tasks.push(tokio::spawn(send_types(channel, part.to_vec(), per_stream)));
    }
    for t in tasks {
        t.await.unwrap();
    }

    let after = metrics.render_prometheus();
    assert_eq!(
        series(&after).len(),
        series(&before).len(),
        "no series added:\n{after}"
    );
    assert!(!after.contains("bogus"), "{after}");
    assert_eq!(
        metrics.counter("flock_xds_requests_total", "other"),
        URLS as u64
    );
    assert_eq!(
        metrics.counter("flock_xds_responses_total", "other"),
        URLS as u64,
        "each type got its (empty) initial response"
    );
    running.stop().await;
}

/// A type URL with a quote and newlines, sent over the wire, cannot end the label
/// value or start a metric line of its own.
#[tokio::test]
async fn a_type_url_with_a_quote_and_newline_cannot_inject_a_metric_line() {
    let cache = cache_with(&[(CLUSTER, "c0", "C0")]);
    let running = start_tcp(Server::new(Arc::clone(&cache))).await;
    let metrics = running.server.metrics().clone();
    let before = metrics.render_prometheus();
    let evil =
        "x\"} 1\nflock_xds_injected_total{type=\"cds\"} 99\n# TYPE flock_xds_injected counter";
    let mut ads = running.sotw().await;
    ads.send(sotw_req(evil, &[], "", "")).unwrap();
    let resp = ads.recv(WAIT).await.unwrap();
    assert_eq!(resp.type_url, evil);
    let after = metrics.render_prometheus();
    assert!(!after.contains("injected"), "{after}");
    assert_eq!(series(&after).len(), series(&before).len(), "{after}");
    assert!(
        series(&after).contains(&"flock_xds_requests_total{type=\"other\"} 1"),
        "{after}"
    );
    running.stop().await;
}

/// 5,000 streams that never send a request, over 5 connections (1,000 streams each,
/// the per-connection stream limit raised to let them) with a cap of 4,000 open
/// streams on the server: the ones
/// over the cap end at once with `RESOURCE_EXHAUSTED` naming the limit, a client whose
/// stream was open before keeps being served, every admitted silent stream ends with
/// `DEADLINE_EXCEEDED` at the first-request timeout, and then a new client is served.
/// The process's RSS (client and server: both are in this process) is reported
/// (eprintln), not asserted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_thousand_silent_streams_are_capped_and_time_out() {
    const STREAMS: usize = 5_000;
    const CONNECTIONS: usize = 5;
    const CAP: usize = 4_000;
    // Long enough for all 5,000 to open on a loaded 2-core machine (about 2 s here)
    // before the first admitted ones time out and free their slots.
    let timeout = Duration::from_secs(10);
    let cache = cache_with(&[(CLUSTER, "c0", "C0")]);
    let server = Server::builder(Arc::clone(&cache))
        .limits(Limits {
            max_open_streams: CAP,
            first_request_timeout: timeout,
            ..Limits::default()
        })
        .connection_limits(ConnectionLimits {
            max_concurrent_streams_per_connection: (STREAMS / CONNECTIONS) as u32,
            ..ConnectionLimits::default()
        })
        .build();
    let running = start_tcp(server).await;
    eprintln!("RSS before: {}", vm_rss());

    // The well-behaved client, connected before the flood: it holds one slot.
    let mut good = running.sotw().await;
    good.send(sotw_req(CLUSTER, &[], "", "")).unwrap();
    let resp = good.recv(WAIT).await.unwrap();
    good.send(sotw_req(CLUSTER, &[], &resp.version_info, &resp.nonce))
        .unwrap();

    let flood_start = std::time::Instant::now();
    let mut tasks = Vec::with_capacity(STREAMS);
    for _ in 0..CONNECTIONS {
        let channel = client::connect(&running.target).await.unwrap();
        for _ in 0..STREAMS / CONNECTIONS {
            let channel = channel.clone();
            tasks.push(tokio::spawn(async move {
                let t0 = std::time::Instant::now();
                let status = match client::sotw(channel).await {
                    // Refused before the response headers: the call itself fails.
                    Err(status) => status,
                    Ok(mut ads) => {
                        // Sends nothing; waits for the server to end the stream.
                        match ads.recv(Duration::from_secs(60)).await {
                            Err(RecvError::Status(status)) => status,
                            other => panic!("expected a status, got {other:?}"),
                        }
                    }
                };
                (status, t0.elapsed())
            }));
        }
    }

    // While the flood holds its slots, the connected client still gets updates.
    common::xds::upsert(&cache, &[(CLUSTER, "c1", "C1")]);
    let update = good.recv(WAIT).await.unwrap();
    assert_eq!(update.resources.len(), 2);
    good.send(sotw_req(CLUSTER, &[], &update.version_info, &update.nonce))
        .unwrap();
    eprintln!(
        "RSS during the flood (client and server, one process): {} ({} server streams past their first request)",
        vm_rss(),
        running.server.metrics().streams_open()
    );

    let mut exhausted = 0;
    let mut timed_out = 0;
    let mut slowest_refusal = Duration::ZERO;
    for t in tasks {
        let (status, elapsed) = t.await.unwrap();
        match status.code() {
            Code::ResourceExhausted => {
                assert!(
                    status.message().contains(&format!("{CAP} streams open"))
                        && status.message().contains("max_open_streams"),
                    "{status:?}"
                );
                slowest_refusal = slowest_refusal.max(elapsed);
                exhausted += 1;
            }
            Code::DeadlineExceeded => {
                assert!(elapsed >= timeout, "timed out after only {elapsed:?}");
                timed_out += 1;
            }
            _ => panic!("unexpected status {status:?}"),
        }
    }
    let flood_took = flood_start.elapsed();
    eprintln!(
        "RSS after {STREAMS} silent streams ended: {} ({exhausted} refused at the cap, \
         the slowest refusal after {slowest_refusal:?}; {timed_out} timed out; \
         {flood_took:?} in all)",
        vm_rss()
    );
    // Opening every stream took less than the timeout, so none of the admitted ones
    // had ended (and freed its slot) before the last one opened.
    assert!(
        slowest_refusal < timeout,
        "refusals are at once, not at the timeout: {slowest_refusal:?}"
    );
    assert_eq!(
        exhausted,
        STREAMS - (CAP - 1),
        "the good client holds one slot"
    );
    assert_eq!(timed_out, CAP - 1);
    let metrics = running.server.metrics();
    assert_eq!(
        metrics.refused_streams("max_open_streams"),
        exhausted as u64
    );
    assert_eq!(
        metrics.refused_streams("first_request_timeout"),
        timed_out as u64
    );

    // The slots are free again: a new client is served.
    let mut next = running.delta().await;
    next.send(delta_req(CLUSTER, &["*"], &[], "")).unwrap();
    let resp = next.recv(WAIT).await.unwrap();
    assert_eq!(resp.resources.len(), 2);
    // And the first client is still served.
    common::xds::upsert(&cache, &[(LISTENER, "l0", "L0"), (CLUSTER, "c2", "C2")]);
    let update = good.recv(WAIT).await.unwrap();
    assert_eq!(update.resources.len(), 3);
    running.stop().await;
}

#[test]
fn the_default_limits_are_the_documented_ones() {
    let l = Limits::default();
    assert_eq!(l.max_subscribed_names_per_stream, 10_000);
    assert_eq!(
        (
            l.max_node_id_len,
            l.max_node_cluster_len,
            l.max_user_agent_len
        ),
        (256, 256, 128)
    );
    assert_eq!(l.first_request_timeout, Duration::from_secs(10));
    assert_eq!(l.max_open_streams, 4096);
}
