//! Fan-out of one change to many Delta ADS streams on loopback.
//!
//! The real server (`Server::serve_tcp` on 127.0.0.1:0) and N raw ADS clients run in
//! one tokio multi-thread runtime. Every client opens a Delta stream on one of a few
//! shared HTTP/2 connections, subscribes to all EDS (`*`) and ACKs every response.
//!
//! Prints:
//! * resident memory per idle stream: (RSS with N streams open and idle − RSS with the
//!   server and the connections up but no stream) / N. Client and server run in this
//!   process, so this is **both sides** of a stream (server task, protocol machine,
//!   h2 state on both ends, client task and its channel);
//! * for 20 publishes of one changed `ClusterLoadAssignment`, one at a time, the
//!   latency from the `Cache::update` call to the moment each client has the response
//!   decoded: p50/p99 of the slowest stream per publish, and p50/p99 over all receipts.
//!
//! Not a criterion bench: `cargo bench -p flock-xds --bench fanout`.
//! `FLOCK_FANOUT_STREAMS` (default 1000) sets N, `FLOCK_FANOUT_RESOURCES` (default 10)
//! the number of CLAs in the set, `FLOCK_FANOUT_PUBLISHES` (default 20) the rounds.

use envoy_types::pb::envoy::config::core::v3::{Address, SocketAddress, address, socket_address};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_xds::cache::Cache;
use flock_xds::client;
use flock_xds::server::Server;
use flock_xds::types::ENDPOINT;
use prost::Message;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;

const NODE: &str = "fanout";
const WAIT: Duration = Duration::from_secs(30);

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(v) => v
            .parse()
            .unwrap_or_else(|_| panic!("{name}={v:?} is not a number")),
        Err(_) => default,
    }
}

/// Resident set size of this process, in KiB.
fn rss_kib() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc/self/status")
}

fn cla_any(i: usize, generation: u32) -> (ContentHash, Any) {
    let lb_endpoints = (0..4u32)
        .map(|e| {
            let host = if e == 0 { 10 + generation % 200 } else { e };
            LbEndpoint {
                host_identifier: Some(lb_endpoint::HostIdentifier::Endpoint(Endpoint {
                    address: Some(Address {
                        address: Some(address::Address::SocketAddress(SocketAddress {
                            protocol: socket_address::Protocol::Tcp as i32,
                            address: format!("10.0.{}.{host}", i % 250),
                            port_specifier: Some(socket_address::PortSpecifier::PortValue(8080)),
                            ..Default::default()
                        })),
                    }),
                    ..Default::default()
                })),
                ..Default::default()
            }
        })
        .collect();
    let cla = ClusterLoadAssignment {
        cluster_name: name(i),
        endpoints: vec![LocalityLbEndpoints {
            lb_endpoints,
            ..Default::default()
        }],
        ..Default::default()
    };
    let any = Any {
        type_url: ENDPOINT.into(),
        value: cla.encode_to_vec(),
    };
    (ContentHash::of(&any.value), any)
}

fn name(i: usize) -> String {
    format!("outbound|8080||svc-{i}.default.svc.cluster.local")
}

fn delta_req(subscribe: &[&str], nonce: &str) -> DeltaDiscoveryRequest {
    DeltaDiscoveryRequest {
        node: Some(client::node(NODE)),
        type_url: ENDPOINT.into(),
        resource_names_subscribe: subscribe.iter().map(|s| s.to_string()).collect(),
        response_nonce: nonce.into(),
        ..DeltaDiscoveryRequest::default()
    }
}

/// One response received by one stream.
struct Receipt {
    version: u64,
    at: Instant,
}

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.3} ms", d.as_secs_f64() * 1e3)
}

fn main() {
    // `cargo bench` passes `--bench` (and maybe a filter): nothing to parse.
    let streams = env_usize("FLOCK_FANOUT_STREAMS", 1000).max(1);
    let resources = env_usize("FLOCK_FANOUT_RESOURCES", 10).max(1);
    let publishes = env_usize("FLOCK_FANOUT_PUBLISHES", 20).max(1);
    let connections = streams.div_ceil(125).clamp(1, 64).max(8.min(streams));
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    runtime.block_on(run(streams, resources, publishes, connections));
}

async fn run(streams: usize, resources: usize, publishes: usize, connections: usize) {
    let started = Instant::now();
    let cache = Arc::new(Cache::by_node_id());
    cache.update(NODE, |prev| {
        let mut b = prev.edit();
        for i in 0..resources {
            let (hash, any) = cla_any(i, 0);
            b.upsert(ENDPOINT, &name(i), hash, any);
        }
        b.build()
    });
    let server = Server::new(Arc::clone(&cache));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let target = format!("http://{}", listener.local_addr().expect("addr"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let serving = {
        let server = server.clone();
        tokio::spawn(async move {
            server
                .serve_tcp(listener, async {
                    let _ = stopped.await;
                })
                .await
        })
    };
    let mut channels = Vec::new();
    for _ in 0..connections {
        channels.push(client::connect(&target).await.expect("connect"));
    }
    // Let the runtime and allocator settle, then the 0-stream baseline.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_before = rss_kib();

    // Open every stream; each reports its first response, then every later one.
    let (receipts_tx, mut receipts) = mpsc::unbounded_channel::<Receipt>();
    let (ready_tx, mut ready) = mpsc::unbounded_channel::<()>();
    let mut tasks = tokio::task::JoinSet::new();
    for s in 0..streams {
        let channel = channels[s % connections].clone();
        let receipts_tx = receipts_tx.clone();
        let ready_tx = ready_tx.clone();
        tasks.spawn(async move {
            let mut ads = client::delta(channel).await.expect("open stream");
            ads.send(delta_req(&["*"], "")).expect("send");
            let first = ads.recv(WAIT).await.expect("initial response");
            assert_eq!(first.resources.len(), resources);
            ads.send(delta_req(&[], &first.nonce)).expect("ack");
            drop(first);
            let _ = ready_tx.send(());
            drop(ready_tx);
            loop {
                let resp = match ads.recv(Duration::from_secs(3600)).await {
                    Ok(resp) => resp,
                    Err(_) => return,
                };
                let at = Instant::now();
                ads.send(delta_req(&[], &resp.nonce)).expect("ack");
                let version = resp.system_version_info.parse().expect("version");
                if receipts_tx.send(Receipt { version, at }).is_err() {
                    return;
                }
            }
        });
    }
    drop(receipts_tx);
    drop(ready_tx);
    for _ in 0..streams {
        tokio::time::timeout(WAIT, ready.recv())
            .await
            .expect("every stream gets its initial response in time")
            .expect("a stream task failed");
    }
    let opened = started.elapsed();
    // Idle: ACKs processed, nothing in flight.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_idle = rss_kib();
    assert_eq!(server.metrics().streams_open(), streams as u64);

    // Publish one change at a time; wait for every stream to receive it.
    let mut slowest = Vec::with_capacity(publishes);
    let mut all = Vec::with_capacity(publishes * streams);
    for round in 0..publishes {
        let i = round % resources;
        let (hash, any) = cla_any(i, round as u32 + 1);
        let t0 = Instant::now();
        let snap = cache.update(NODE, |prev| {
            prev.edit().upsert(ENDPOINT, &name(i), hash, any).build()
        });
        let version = snap.version();
        let mut got = 0;
        let mut max = Duration::ZERO;
        while got < streams {
            let r = tokio::time::timeout(WAIT, receipts.recv())
                .await
                .expect("every stream receives the change in time")
                .expect("a stream task failed");
            assert_eq!(r.version, version, "one change at a time");
            let latency = r.at.saturating_duration_since(t0);
            max = max.max(latency);
            all.push(latency);
            got += 1;
        }
        slowest.push(max);
        // Let ACKs drain before the next publish.
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    slowest.sort();
    all.sort();

    let per_stream = (rss_idle as f64 - rss_before as f64) * 1024.0 / streams as f64;
    println!();
    println!(
        "fan-out: {streams} Delta ADS streams on {connections} HTTP/2 connections (loopback),"
    );
    println!(
        "         {resources} ClusterLoadAssignments, wildcard EDS, {publishes} publishes of one change"
    );
    println!("         (opened and initialized in {})", ms(opened));
    println!();
    let row = |label: String, value: String| println!("| {label:<42} | {value:>12} |");
    println!("| {:<42} | {:>12} |", "measure", "value");
    println!("|{}|{}|", "-".repeat(44), "-".repeat(14));
    row(
        "RSS, server + connections, 0 streams".into(),
        format!("{rss_before} KiB"),
    );
    row(
        format!("RSS, {streams} idle streams"),
        format!("{rss_idle} KiB"),
    );
    row(
        "RSS per idle stream (client + server)".into(),
        format!("{:.1} KiB", per_stream / 1024.0),
    );
    row(
        "publish -> all streams have it, p50".into(),
        ms(percentile(&slowest, 50.0)),
    );
    row(
        "publish -> all streams have it, p99".into(),
        ms(percentile(&slowest, 99.0)),
    );
    row(
        "publish -> a stream has it (all), p50".into(),
        ms(percentile(&all, 50.0)),
    );
    row(
        "publish -> a stream has it (all), p99".into(),
        ms(percentile(&all, 99.0)),
    );
    println!();

    let _ = stop.send(());
    let _ = serving.await;
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
}
