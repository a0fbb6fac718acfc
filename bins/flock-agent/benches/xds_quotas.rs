//! The xDS quotas under load, against a running `flock-agent` (a release build of the
//! real binary, mTLS listener on, the default limits): 50 clients, each with its own
//! SPIFFE ID and connection, hold a subscription the size of the per-connection budget
//! (5,000 names of 100 bytes: 500,000 bytes, under the 512 KiB default), then 5,000
//! TLS connections without a client certificate are opened at once (each refused if it
//! asks for anything; the listener holds at most 1,024 of them, until the idle
//! timeout). While they are held, an ADS client on the unix socket — the node's Envoy
//! — connects and asks for its clusters. Printed: how long until it had them (goal
//! ≤ 1 s), and the agent's peak RSS (`VmHWM` of `/proc/<pid>/status`, goal < 256 MiB).
//!
//! The bench raises its own `RLIMIT_NOFILE` and the agent's (with `prlimit`, to 20,000).
//!
//! ```sh
//! cargo build --release -p flock-agent && cargo bench -p flock-agent --bench xds_quotas
//! ```

use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
use flock_cni::proto::v1::{AddPodRequest, IpConfig, Outcome, PodRef};
use flock_testkit::pki::TestCa;
use std::collections::HashMap;
use std::io::{Read, Write};
use std::os::unix::fs::DirBuilderExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

const NOFILE: u64 = 20_000;
const BUDGET_CLIENTS: usize = 50;
/// Names per budget client, and their length: 5,000 × 100 bytes = 500,000 bytes.
const NAMES: usize = 5_000;
const NAME_LEN: usize = 100;
const ANONYMOUS: usize = 5_000;
const WAIT: Duration = Duration::from_secs(60);

fn main() {
    let out = Command::new("prlimit")
        .args([
            "--pid",
            &std::process::id().to_string(),
            &format!("--nofile={NOFILE}:{NOFILE}"),
        ])
        .output()
        .expect("prlimit (util-linux)");
    assert!(
        out.status.success(),
        "raising RLIMIT_NOFILE: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
        .block_on(run());
}

fn http_get(addr: &str, path: &str) -> Option<String> {
    let mut s = std::net::TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.starts_with("HTTP/1.1 200").then_some(body)
}

fn metric(admin: &str, name: &str) -> Option<u64> {
    http_get(admin, "/metrics")?.lines().find_map(|l| {
        let (n, v) = l.split_once(' ')?;
        (n == name).then(|| v.trim().parse::<f64>().ok().map(|v| v as u64))?
    })
}

fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

async fn tls(port: u16, ca: &TestCa, identity: Option<(&str, &str)>) -> Result<Channel, String> {
    let mut cfg = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&ca.ca_pem))
        .domain_name("localhost");
    if let Some((cert, key)) = identity {
        cfg = cfg.identity(Identity::from_pem(cert, key));
    }
    Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
        .unwrap()
        .tls_config(cfg)
        .unwrap()
        .connect_timeout(Duration::from_secs(20))
        .connect()
        .await
        .map_err(|e| e.to_string())
}

async fn run() {
    let dir = tempfile::tempdir().unwrap();
    let run_dir = dir.path().join("run");
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&run_dir)
        .unwrap();
    let ca = TestCa::new("bench");
    let server = ca.server();
    let write = |name: &str, text: &str| {
        let p = dir.path().join(name);
        std::fs::write(&p, text).unwrap();
        p
    };
    let (cert, key, client_ca) = (
        write("server.pem", &server.cert_pem),
        write("server-key.pem", &server.key_pem),
        write("ca.pem", &ca.ca_pem),
    );
    let xds_socket = run_dir.join("xds.sock");
    let cni_socket = run_dir.join("cni.sock");
    let log_path = dir.path().join("agent.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut agent = Command::new("prlimit")
        .arg(format!("--nofile={NOFILE}:{NOFILE}"))
        .arg("--")
        .arg(env!("CARGO_BIN_EXE_flock-agent"))
        .args([
            "--node-name",
            "n1",
            "--registry",
            "memory",
            "--identity",
            "none",
        ])
        .arg("--state-dir")
        .arg(dir.path().join("state"))
        .arg("--cni-socket")
        .arg(&cni_socket)
        .arg("--xds-socket")
        .arg(&xds_socket)
        .args([
            "--admin-address",
            "127.0.0.1:0",
            "--xds-address",
            "127.0.0.1:0",
        ])
        .arg("--xds-tls-cert")
        .arg(&cert)
        .arg("--xds-tls-key")
        .arg(&key)
        .arg("--xds-tls-client-ca")
        .arg(&client_ca)
        .args([
            "--xds-envoy-spiffe-id",
            "spiffe://cluster.local/ns/flock/sa/envoy",
        ])
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("spawning flock-agent");
    let pid = agent.id();
    // The bound addresses, from the agent's "flock-agent listening" line.
    let started = Instant::now();
    let (admin, port) = loop {
        let text = std::fs::read_to_string(&log_path).unwrap_or_default();
        if let Some(line) = text.lines().find(|l| l.contains("flock-agent listening")) {
            let field = |f: &str| {
                line.split_whitespace()
                    .find_map(|w| w.strip_prefix(f))
                    .map(|v| {
                        v.trim_start_matches("Some(")
                            .trim_end_matches(')')
                            .to_string()
                    })
            };
            let admin = field("admin=").unwrap();
            let mtls = field("xds_mtls=").unwrap();
            let port: u16 = mtls.rsplit_once(':').unwrap().1.parse().unwrap();
            break (admin, port);
        }
        assert!(
            started.elapsed() < WAIT && agent.try_wait().unwrap().is_none(),
            "the agent did not start:\n{text}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    while http_get(&admin, "/readyz").is_none() {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // A meshed pod, so the node's Envoy has a cluster to get.
    let req = AddPodRequest {
        container_id: "bench-web".into(),
        netns: "/proc/1/ns/net".into(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: "web-0".into(),
            namespace: "default".into(),
            uid: "uid-web-0".into(),
        }),
        ips: vec![IpConfig {
            address: "10.7.0.2/16".into(),
            ..IpConfig::default()
        }],
        annotations: HashMap::from([
            ("flock.io/service".to_string(), "web".to_string()),
            ("flock.io/ports".to_string(), "8080".to_string()),
        ]),
        network_name: "net".into(),
        cni_version: "1.1.0".into(),
        prev_result_json: String::new(),
    };
    let resp = flock_cni::client::call(
        &cni_socket,
        WAIT,
        |mut c| async move { c.add_pod(req).await },
    )
    .await
    .expect("CNI ADD");
    assert_eq!(resp.outcome, Outcome::Success as i32, "{}", resp.message);

    // 50 budget-sized subscriptions, one client identity and connection each.
    let t = Instant::now();
    let mut held = Vec::new();
    for i in 0..BUDGET_CLIENTS {
        let leaf = ca.client(&format!("spiffe://cluster.local/ns/bench/sa/client-{i}"));
        let channel = tls(port, &ca, Some((&leaf.cert_pem, &leaf.key_pem)))
            .await
            .unwrap();
        let mut ads = flock_xds::client::delta(channel).await.unwrap();
        let names = (0..NAMES)
            .map(|n| format!("{:0>width$}", format!("c{i}-n{n}"), width = NAME_LEN))
            .collect();
        ads.send(DeltaDiscoveryRequest {
            node: Some(flock_xds::client::node(&format!("client-{i}"))),
            type_url: flock_xds::types::ENDPOINT.into(),
            resource_names_subscribe: names,
            ..DeltaDiscoveryRequest::default()
        })
        .unwrap();
        // The names do not exist: a response (if any) lists them as removed; a
        // refusal ends the stream with a status.
        if let Err(flock_xds::client::RecvError::Status(s)) =
            ads.recv(Duration::from_millis(500)).await
        {
            panic!("client {i}'s budget-sized subscription was refused: {s:?}");
        }
        held.push(ads);
    }
    println!(
        "{BUDGET_CLIENTS} clients hold {NAMES} names of {NAME_LEN} bytes each ({} MB in all), \
         subscribed in {:?}; agent RSS {} KiB",
        BUDGET_CLIENTS * NAMES * NAME_LEN / 1_000_000,
        t.elapsed(),
        status_kib(pid, "VmRSS:")
    );

    // 5,000 connections without a client certificate, opened 250 at a time.
    let flood_started = Instant::now();
    let mut channels = Vec::new();
    let mut refused = 0usize;
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..ANONYMOUS {
        let ca_pem = ca.ca_pem.clone();
        set.spawn(async move {
            let cfg = ClientTlsConfig::new()
                .ca_certificate(Certificate::from_pem(&ca_pem))
                .domain_name("localhost");
            Endpoint::from_shared(format!("https://127.0.0.1:{port}"))
                .unwrap()
                .tls_config(cfg)
                .unwrap()
                .connect_timeout(Duration::from_secs(20))
                .connect()
                .await
        });
        if set.len() >= 250 {
            match set.join_next().await.unwrap().unwrap() {
                Ok(c) => channels.push(c),
                Err(_) => refused += 1,
            }
        }
    }
    while let Some(r) = set.join_next().await {
        match r.unwrap() {
            Ok(c) => channels.push(c),
            Err(_) => refused += 1,
        }
    }
    let open = metric(&admin, "flock_xds_connections_open");
    println!(
        "{ANONYMOUS} connections without a certificate in {:?}: {} completed the handshake, \
         {refused} closed at the cap; flock_xds_connections_open {open:?}",
        flood_started.elapsed(),
        channels.len()
    );

    // The node's Envoy: an ADS client on the unix socket, while those are held.
    let t = Instant::now();
    let channel = flock_xds::client::connect(&format!("unix:{}", xds_socket.display()))
        .await
        .expect("the unix socket");
    let mut envoy = flock_xds::client::delta(channel).await.unwrap();
    envoy
        .send(DeltaDiscoveryRequest {
            node: Some(envoy_types::pb::envoy::config::core::v3::Node {
                id: "envoy-n1".into(),
                user_agent_name: "envoy".into(),
                ..Default::default()
            }),
            type_url: flock_xds::types::CLUSTER.into(),
            resource_names_subscribe: vec!["*".into()],
            ..DeltaDiscoveryRequest::default()
        })
        .unwrap();
    let cds = envoy.recv(WAIT).await.expect("the node's Envoy gets CDS");
    let to_clusters = t.elapsed();
    assert!(!cds.resources.is_empty());
    let hwm = status_kib(pid, "VmHWM:");
    println!(
        "node's Envoy (unix socket) had its {} clusters after {to_clusters:?} (goal <= 1 s)",
        cds.resources.len()
    );
    println!(
        "agent peak RSS (VmHWM) {hwm} KiB = {:.1} MiB (goal < 256 MiB)",
        hwm as f64 / 1024.0
    );
    drop((channels, held, envoy));
    let _ = agent.kill();
    let _ = agent.wait();
}
