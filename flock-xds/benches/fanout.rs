//! Fan-out of one change to many Delta ADS streams on loopback, server and clients in
//! separate processes so each side's memory is measured on its own.
//!
//! For each stream count N (`FLOCK_FANOUT_STREAMS`, a comma-separated list, default
//! `1000,10000`) the bench runs, each in a fresh process:
//!
//! * a **server** process: the real server (`Server::serve_tcp` on 127.0.0.1:0) over a
//!   cache of `FLOCK_FANOUT_RESOURCES` (default 10) `ClusterLoadAssignment`s;
//! * a **client** process: N raw ADS clients (`flock_xds::client`), each one Delta
//!   stream subscribed to all EDS (`*`) that ACKs every response, spread over
//!   `FLOCK_FANOUT_CONNECTIONS` HTTP/2 connections (default N/100: the server's default
//!   `max_concurrent_streams_per_connection` is 100).
//!
//! Each stream count runs twice (`FLOCK_FANOUT_CLIENTS`, default
//! `one-thread,multi-thread`): the client process on a current-thread runtime and on
//! tokio's multi-thread runtime. The clients stand in for Envoys on other machines but
//! share this machine's cores with the server; on one thread they cost less (one write
//! per connection for a publish's ACKs, not one per stream), so more of the figure is
//! the server's. The server always runs on the multi-thread runtime, as in the agent.
//!
//! Both raise `RLIMIT_NOFILE` to its hard limit first (one connection per stream, N =
//! 10,000, needs 10,000 descriptors on each side).
//!
//! Memory per idle stream: each process measures its resident set size before any
//! connection (server: serving, no client yet; client: runtime up, nothing connected)
//! and once every stream has its initial response ACKed and has been idle for 500 ms;
//! the difference over N is that side's cost per stream, connections included (they
//! are amortized over the streams they carry). "With the client" is the sum.
//!
//! CPU: each process's user + system time over the publishes, per publish.
//!
//! Latency: `FLOCK_FANOUT_PUBLISHES` (default 20) publishes of one changed CLA, one at a
//! time; each client stamps the wall clock (`SystemTime`, the one clock both processes
//! share) when a response is decoded, and the server subtracts the stamp it took just
//! before `Cache::update`. Reported: p50/p99 over publishes of the time until the
//! slowest stream had it, and p50/p99 over every receipt.
//!
//! Not a criterion bench: `cargo bench -p flock-xds --bench fanout`.

use envoy_types::pb::envoy::config::core::v3::{Address, SocketAddress, address, socket_address};
use envoy_types::pb::envoy::config::endpoint::v3::{
    ClusterLoadAssignment, Endpoint, LbEndpoint, LocalityLbEndpoints, lb_endpoint,
};
use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use envoy_types::pb::google::protobuf::Any;
use flock_core::ContentHash;
use flock_xds::cache::Cache;
use flock_xds::client;
use flock_xds::server::{ConnectionLimits, Limits, Server};
use flock_xds::types::ENDPOINT;
use prost::Message;
use std::collections::HashMap;
use std::io::Write as _;
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::sync::mpsc;

const NODE: &str = "fanout";
const WAIT: Duration = Duration::from_secs(60);
/// The process role, set by the parent: `server` or `client`.
const ROLE: &str = "FLOCK_FANOUT_ROLE";

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

/// CPU time (user + system) this process has used so far.
fn cpu_time() -> Duration {
    use nix::sys::resource::{UsageWho, getrusage};
    let usage = getrusage(UsageWho::RUSAGE_SELF).expect("getrusage");
    let time =
        |t: nix::sys::time::TimeVal| Duration::new(t.tv_sec() as u64, t.tv_usec() as u32 * 1000);
    time(usage.user_time()) + time(usage.system_time())
}

/// Wall clock in nanoseconds: comparable between the server and client processes.
fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .expect("clock after 1970")
        .as_nanos() as u64
}

/// Raises the soft descriptor limit to the hard one: each side holds one socket per
/// connection.
fn raise_nofile() {
    use nix::sys::resource::{Resource, getrlimit, setrlimit};
    let (_, hard) = getrlimit(Resource::RLIMIT_NOFILE).expect("getrlimit");
    setrlimit(Resource::RLIMIT_NOFILE, hard, hard).expect("setrlimit");
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

/// Nearest-rank percentile of sorted values.
fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = ((p / 100.0) * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

/// What one server run measured.
struct Outcome {
    /// How the clients ran ([`CLIENT_RUNTIME`]).
    client: String,
    streams: usize,
    connections: usize,
    server_kib_per_stream: f64,
    client_kib_per_stream: f64,
    /// CPU time per publish, server and client process (the publish phase only).
    server_cpu: Duration,
    client_cpu: Duration,
    opened: Duration,
    slowest: Vec<Duration>,
    all: Vec<Duration>,
}

/// How the client process runs its streams (`FLOCK_FANOUT_CLIENTS`, set per run by the
/// driver): `one-thread` (a current-thread runtime) or `multi-thread` (one worker per
/// core, tokio's default).
const CLIENT_RUNTIME: &str = "FLOCK_FANOUT_CLIENT_RUNTIME";

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// The client process's runtime. The clients stand in for Envoys on other machines;
/// here they share the server's two cores, so every cycle they spend is taken from the
/// server. On one thread tokio runs each connection's stream tasks before the
/// connection's own task, and one write carries a whole connection's ACKs; on the
/// multi-thread runtime the connection task runs right after each stream that wakes it
/// (the scheduler's LIFO slot), and every ACK is a write of its own: 10,000 writes per
/// publish at 10,000 streams, against about 100. Both are measured.
fn client_runtime() -> tokio::runtime::Runtime {
    match std::env::var(CLIENT_RUNTIME).as_deref() {
        Ok("multi-thread") => runtime(),
        Ok("one-thread") | Err(_) => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime"),
        Ok(other) => panic!("{CLIENT_RUNTIME}={other:?}: one-thread or multi-thread"),
    }
}

fn main() {
    // `cargo bench` passes `--bench` (and maybe a filter): nothing to parse.
    raise_nofile();
    match std::env::var(ROLE).as_deref() {
        Ok("client") => client_runtime().block_on(client_process()),
        Ok("server") => {
            let outcome = runtime().block_on(server_process());
            // One line for the parent.
            println!(
                "result {} {} {} {} {} {} {} {} | {}",
                outcome.streams,
                outcome.connections,
                outcome.server_kib_per_stream,
                outcome.client_kib_per_stream,
                outcome.server_cpu.as_nanos(),
                outcome.client_cpu.as_nanos(),
                outcome.opened.as_nanos(),
                join(&outcome.slowest),
                join(&outcome.all),
            );
        }
        Ok(other) => panic!("{ROLE}={other:?}"),
        Err(_) => driver(),
    }
}

fn join(ds: &[Duration]) -> String {
    ds.iter()
        .map(|d| d.as_nanos().to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn split(s: &str) -> Vec<Duration> {
    s.split(',')
        .map(|n| Duration::from_nanos(n.parse().expect("nanoseconds")))
        .collect()
}

/// Runs one server process (which runs its client process) per stream count and
/// prints the table.
fn driver() {
    let sizes: Vec<usize> = std::env::var("FLOCK_FANOUT_STREAMS")
        .unwrap_or_else(|_| "1000,10000".into())
        .split(',')
        .map(|s| s.trim().parse().expect("FLOCK_FANOUT_STREAMS: numbers"))
        .collect();
    let resources = env_usize("FLOCK_FANOUT_RESOURCES", 10).max(1);
    let publishes = env_usize("FLOCK_FANOUT_PUBLISHES", 20).max(1);
    let clients: Vec<String> = std::env::var("FLOCK_FANOUT_CLIENTS")
        .unwrap_or_else(|_| "one-thread,multi-thread".into())
        .split(',')
        .map(|s| s.trim().to_string())
        .collect();
    let mut outcomes = Vec::new();
    for (streams, client) in sizes
        .iter()
        .flat_map(|&n| clients.iter().map(move |c| (n, c.clone())))
    {
        let exe = std::env::current_exe().expect("own executable");
        let out = std::process::Command::new(exe)
            .env(ROLE, "server")
            .env("FLOCK_FANOUT_N", streams.to_string())
            .env(CLIENT_RUNTIME, &client)
            .stderr(Stdio::inherit())
            .output()
            .expect("run the server process");
        assert!(out.status.success(), "server process: {}", out.status);
        let stdout = String::from_utf8(out.stdout).expect("utf-8");
        let line = stdout
            .lines()
            .find_map(|l| l.strip_prefix("result "))
            .expect("a result line");
        let (head, all) = line.split_once(" | ").expect("result format");
        let f: Vec<&str> = head.split(' ').collect();
        outcomes.push(Outcome {
            client,
            streams: f[0].parse().expect("streams"),
            connections: f[1].parse().expect("connections"),
            server_kib_per_stream: f[2].parse().expect("server KiB"),
            client_kib_per_stream: f[3].parse().expect("client KiB"),
            server_cpu: Duration::from_nanos(f[4].parse().expect("server CPU")),
            client_cpu: Duration::from_nanos(f[5].parse().expect("client CPU")),
            opened: Duration::from_nanos(f[6].parse().expect("opened")),
            slowest: split(f[7]),
            all: split(all),
        });
    }
    println!();
    println!(
        "fan-out: Delta ADS streams on loopback, {resources} ClusterLoadAssignments, wildcard EDS,"
    );
    println!(
        "         {publishes} publishes of one change; server and clients in separate processes"
    );
    println!();
    println!(
        "| streams | clients on | connections | opened in | all have it p50 | all have it p99 | one has it p50 | one has it p99 | CPU/publish, server | CPU/publish, client | RSS/idle stream, server | RSS/idle stream, server + client |"
    );
    println!("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    for o in &outcomes {
        println!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1} KiB | {:.1} KiB |",
            o.streams,
            o.client,
            o.connections,
            ms(o.opened),
            ms(percentile(&o.slowest, 50.0)),
            ms(percentile(&o.slowest, 99.0)),
            ms(percentile(&o.all, 50.0)),
            ms(percentile(&o.all, 99.0)),
            ms(o.server_cpu),
            ms(o.client_cpu),
            o.server_kib_per_stream,
            o.server_kib_per_stream + o.client_kib_per_stream,
        );
    }
    println!();
}

async fn server_process() -> Outcome {
    let streams = env_usize("FLOCK_FANOUT_N", 1000).max(1);
    let resources = env_usize("FLOCK_FANOUT_RESOURCES", 10).max(1);
    let publishes = env_usize("FLOCK_FANOUT_PUBLISHES", 20).max(1);
    let connections = env_usize("FLOCK_FANOUT_CONNECTIONS", streams.div_ceil(100)).max(1);
    let started = std::time::Instant::now();
    let cache = Arc::new(Cache::by_node_id());
    cache.update(NODE, |prev| {
        let mut b = prev.edit();
        for i in 0..resources {
            let (hash, any) = cla_any(i, 0);
            b.upsert(ENDPOINT, &name(i), hash, any);
        }
        b.build()
    });
    let server = Server::builder(Arc::clone(&cache))
        // The defaults cap a server at 4,096 streams and 1,024 connections.
        .limits(Limits {
            max_open_streams: streams.max(4096),
            ..Limits::default()
        })
        .connection_limits(ConnectionLimits {
            max_connections: connections.max(1024),
            max_concurrent_streams_per_connection: streams.div_ceil(connections).max(100) as u32,
            ..ConnectionLimits::default()
        })
        .build();
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
    // Let the runtime and allocator settle, then the 0-stream baseline.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_before = rss_kib();

    let exe = std::env::current_exe().expect("own executable");
    let mut child = tokio::process::Command::new(exe)
        .env(ROLE, "client")
        .env("FLOCK_FANOUT_TARGET", &target)
        .env("FLOCK_FANOUT_N", streams.to_string())
        .env("FLOCK_FANOUT_CONNECTIONS", connections.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn the client process");
    let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
    let idle = next_line(&mut lines).await;
    let client: Vec<u64> = idle
        .strip_prefix("idle ")
        .expect("idle line")
        .split(' ')
        .map(|v| v.parse().expect("KiB"))
        .collect();
    let opened = started.elapsed();
    // The clients waited 500 ms after their last ACK: the server has processed them.
    let rss_idle = rss_kib();
    assert_eq!(server.metrics().streams_open(), streams as u64);

    // Publish one change at a time; wait for every stream to receive it.
    let mut slowest = Vec::with_capacity(publishes);
    let mut all = Vec::with_capacity(publishes * streams);
    let cpu_before = cpu_time();
    for round in 0..publishes {
        let i = round % resources;
        let (hash, any) = cla_any(i, round as u32 + 1);
        let t0 = now_ns();
        let snap = cache.update(NODE, |prev| {
            prev.edit().upsert(ENDPOINT, &name(i), hash, any).build()
        });
        let line = next_line(&mut lines).await;
        let (version, stamps) = line
            .strip_prefix("got ")
            .and_then(|l| l.split_once(' '))
            .expect("got line");
        assert_eq!(version.parse::<u64>().ok(), Some(snap.version()));
        let latencies: Vec<Duration> = stamps
            .split(',')
            .map(|s| Duration::from_nanos(s.parse::<u64>().expect("ns").saturating_sub(t0)))
            .collect();
        assert_eq!(latencies.len(), streams);
        slowest.push(*latencies.iter().max().expect("streams"));
        all.extend(latencies);
        // Let ACKs drain before the next publish.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let server_cpu = (cpu_time() - cpu_before) / publishes as u32;
    slowest.sort();
    all.sort();
    drop(child.stdin.take());
    // The client's last line: its CPU time over the publishes.
    let client_cpu = next_line(&mut lines)
        .await
        .strip_prefix("cpu ")
        .and_then(|ns| ns.parse::<u64>().ok())
        .map(|ns| Duration::from_nanos(ns) / publishes as u32)
        .expect("cpu line");
    let _ = tokio::time::timeout(WAIT, child.wait()).await;
    let _ = stop.send(());
    let _ = serving.await;
    let per_stream = |before: u64, idle: u64| (idle as f64 - before as f64) / streams as f64;
    Outcome {
        client: std::env::var(CLIENT_RUNTIME).unwrap_or_default(),
        streams,
        connections,
        server_kib_per_stream: per_stream(rss_before, rss_idle),
        client_kib_per_stream: per_stream(client[0], client[1]),
        server_cpu,
        client_cpu,
        opened,
        slowest,
        all,
    }
}

/// The next line from the client process.
async fn next_line(lines: &mut tokio::io::Lines<BufReader<tokio::process::ChildStdout>>) -> String {
    tokio::time::timeout(WAIT * 2, lines.next_line())
        .await
        .expect("the client process answers in time")
        .expect("read from the client process")
        .expect("the client process ended early")
}

async fn client_process() {
    let target = std::env::var("FLOCK_FANOUT_TARGET").expect("FLOCK_FANOUT_TARGET");
    let streams = env_usize("FLOCK_FANOUT_N", 1000).max(1);
    let resources = env_usize("FLOCK_FANOUT_RESOURCES", 10).max(1);
    let connections = env_usize("FLOCK_FANOUT_CONNECTIONS", 1).max(1);
    tokio::time::sleep(Duration::from_millis(200)).await;
    let rss_before = rss_kib();
    let mut channels = Vec::new();
    for _ in 0..connections {
        channels.push(client::connect(&target).await.expect("connect"));
    }
    // Each stream reports when its initial response is ACKed, then every later
    // response's version and receipt time.
    let (receipts_tx, mut receipts) = mpsc::unbounded_channel::<(u64, u64)>();
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
                let at = now_ns();
                ads.send(delta_req(&[], &resp.nonce)).expect("ack");
                let version = resp.system_version_info.parse().expect("version");
                if receipts_tx.send((version, at)).is_err() {
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
    // Idle: ACKs processed, nothing in flight.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let rss_idle = rss_kib();
    let mut out = std::io::stdout().lock();
    writeln!(out, "idle {rss_before} {rss_idle}").expect("stdout");
    out.flush().expect("stdout");
    drop(out);
    let cpu_before = cpu_time();

    // Until the server closes stdin: one line per version once every stream has it.
    let mut stdin = BufReader::new(tokio::io::stdin()).lines();
    let mut got: HashMap<u64, Vec<u64>> = HashMap::new();
    loop {
        tokio::select! {
            r = receipts.recv() => {
                let Some((version, at)) = r else { break };
                let stamps = got.entry(version).or_default();
                stamps.push(at);
                if stamps.len() == streams {
                    let stamps = got.remove(&version).expect("present");
                    let line = stamps.iter().map(u64::to_string).collect::<Vec<_>>().join(",");
                    let mut out = std::io::stdout().lock();
                    writeln!(out, "got {version} {line}").expect("stdout");
                    out.flush().expect("stdout");
                }
            }
            l = stdin.next_line() => {
                if !matches!(l, Ok(Some(_))) {
                    break;
                }
            }
        }
    }
    let cpu = cpu_time() - cpu_before;
    let mut out = std::io::stdout().lock();
    writeln!(out, "cpu {}", cpu.as_nanos()).expect("stdout");
    out.flush().expect("stdout");
    drop(out);
    tasks.abort_all();
    while tasks.join_next().await.is_some() {}
}
