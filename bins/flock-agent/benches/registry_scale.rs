//! The real agent against a real etcd holding many other nodes' endpoints, printed as
//! plain numbers. For 0, 500, 5,000 and 50,000 remote endpoints (100 per node, so 500
//! nodes at the top; one service per 25 endpoints, so 2,000 services at the top), with
//! 100 local pods:
//!
//! * start: from exec to `/readyz` 200 with every remote endpoint in the agent's
//!   registry view (`flock_agent_registry_endpoints`);
//! * agent CPU per remote endpoint change: one remote endpoint's address changes in
//!   etcd, the agent's snapshot changes (`flock_agent_publishes` moves), the next
//!   change follows; the agent's user+system CPU (`/proc/<pid>/stat`) over all changes
//!   divided by their number, less the CPU of the `/metrics` polls that saw them
//!   (measured on the idle agent in the same run);
//! * resident memory once settled, its peak (`VmHWM`: the initial list's transient),
//!   and the resident bytes per remote endpoint over the agent with none.
//!
//! * idle CPU: the agent's CPU over 3 s with no change and no poll, as a rate;
//! * marginal CPU per change: the same loop run again without the changes (the same
//!   sleeps, the same number of `/metrics` polls at the same moments), and the CPU the
//!   loop with changes took more, per change: what a change adds over an agent at
//!   rest (whose timers, watches and lease keep-alives run anyway) and over the
//!   measurement's own polls. Polls of an agent that parks between them cost more than
//!   the back-to-back polls the first figure subtracts (one run at 50,000: 1.59 ms
//!   with the polls subtracted, 1.07 ms marginal).
//!
//! A churn run at the largest size (`FLOCK_BENCH_CHURN_RATE` changes per second,
//! default 200, for `FLOCK_BENCH_CHURN_SECS`, default 30; `FLOCK_BENCH_CHURN=0`
//! skips it): remote endpoints change address at that rate, each a different one,
//! while a Delta ADS client in the Envoy node group (on the agent's xDS socket,
//! subscribed to every ClusterLoadAssignment, ACKing each response) waits for each
//! new address; reported: the agent's user+system CPU seconds over the run, the
//! p50/p99/max time from the etcd write to the client holding the change, changes
//! not seen within 30 s of the last write, and the RSS after.
//!
//! Each size runs twice: the agent as it is (its service table re-derives only the
//! services a change touches), and the baseline, the same agent rebuilding the whole
//! mesh on every publish: every service from the whole registry view, every pod's
//! model, and the translation and encoding of everything
//! (`FLOCK_PUBLISH_FROM_SCRATCH=1`, what it did before it was incremental).
//!
//! Each size gets a fresh etcd (`FLOCK_ETCD_BIN`), filled before the agent starts with
//! valid entries written in transactions of 128 puts (etcd's default
//! `--max-txn-ops`), 8 in flight.
//!
//! ```sh
//! cargo build --release -p flock-agent && cargo bench -p flock-agent --bench registry_scale
//! ```
//!
//! `FLOCK_BENCH_SIZES=500,5000` runs other sizes; `FLOCK_BENCH_CHANGES` sets the changes
//! per size (default 40); `FLOCK_BENCH_WRAP="heaptrack -o /tmp/agent"` runs the agent
//! under a profiler (its figures are then the wrapper's).

use flock_bird::model::{Endpoint, Health, Protocol};
use flock_core::pod::PodKey;
use flock_testkit::{ChildPort, reserve_port_for_child, wait_for};
use std::io::Read as _;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const PREFIX: &str = "/flock/endpoints/";

fn agent_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_flock-agent"))
}

fn etcd_bin() -> PathBuf {
    let p = std::env::var_os("FLOCK_ETCD_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/usr/bin/etcd"));
    assert!(
        p.is_file(),
        "etcd not found at {}: source scripts/prereqs/40-etcd.sh (sets FLOCK_ETCD_BIN)",
        p.display()
    );
    p
}

/// `/proc/<pid>/status` field `name` in KiB.
fn status_kib(pid: u32, name: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn http_get(addr: &str, path: &str) -> Option<(u16, String)> {
    use std::io::Write as _;
    let mut s = TcpStream::connect(addr).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    let status = out.split(' ').nth(1)?.parse().ok()?;
    let body = out.split_once("\r\n\r\n").map(|x| x.1).unwrap_or("");
    Some((status, body.to_string()))
}

/// Killed and reaped on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// etcd on a reserved client port (returned: keep it while etcd runs).
fn start_etcd(dir: &Path) -> (Proc, String, ChildPort) {
    let port = reserve_port_for_child();
    let client = format!("http://127.0.0.1:{port}");
    // One member: nobody dials its peer URL, so port 0 (the kernel's pick) will do.
    let peer = "http://127.0.0.1:0";
    let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
    let child = Command::new(etcd_bin())
        .args(["--name", "b1", "--data-dir"])
        .arg(dir.join("etcd"))
        .args(["--listen-client-urls", &client])
        .args(["--advertise-client-urls", &client])
        .args(["--listen-peer-urls", peer])
        .args(["--initial-advertise-peer-urls", peer])
        .args(["--initial-cluster", &format!("b1={peer}")])
        .args(["--heartbeat-interval", "50", "--election-timeout", "250"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("starting etcd");
    let proc = Proc(child);
    let addr = format!("127.0.0.1:{port}");
    wait_for(
        "etcd /health true",
        Duration::from_secs(20),
        || matches!(http_get(&addr, "/health"), Some((200, b)) if b.contains("true")),
    );
    (proc, addr, port)
}

/// Services among `n` remote endpoints: one per 25 endpoints.
fn services(n: usize) -> usize {
    (n / 25).max(1)
}

/// Remote endpoint `i` of `n`: node `node-<i/100>`, service `svc-<i % services(n)>`, a
/// distinct pod and address (`version` moves the address: a change).
fn remote(i: usize, n: usize, version: usize) -> Endpoint {
    let pod = format!("p{i}");
    Endpoint {
        service: format!("svc-{}", i % services(n)),
        namespace: "default".into(),
        service_port: 8080,
        protocol: Protocol::Http,
        address: format!(
            "10.{}.{}.{}",
            // Version 0 (the fill) and every later version differ: a change always
            // moves the address (a put of the same value changes nothing to publish).
            64 + if version == 0 {
                0
            } else {
                1 + (version - 1) % 3
            } * 4
                + i / 65536,
            (i / 256) % 256,
            i % 256
        )
        .parse()
        .unwrap(),
        port: 15006,
        node: format!("node-{}", i / 100),
        pod: format!("default/{pod}"),
        pod_key: PodKey::new(format!("{i:064x}"), "eth0"),
        region: "region-1".into(),
        zone: format!("zone-{}", (i / 100) % 3),
        health: Health::Healthy,
        // With an identity, as every agent registers its pods: the local pods of the
        // same services are mTLS, and an identity-less entry of an mTLS service port is
        // never served (no downgrade), so its changes would not reach the snapshot.
        identity: Some(format!(
            "spiffe://cluster.local/ns/default/sa/svc-{}",
            i % services(n)
        )),
        also_accept: Vec::new(),
        labels: Default::default(),
    }
}

fn entry(ep: &Endpoint) -> (String, Vec<u8>) {
    (
        format!("{PREFIX}{}", ep.key()),
        serde_json::to_vec(ep).unwrap(),
    )
}

async fn fill(addr: &str, n: usize) -> Duration {
    let client = etcd_client::Client::connect([format!("http://{addr}")], None)
        .await
        .unwrap();
    let start = Instant::now();
    let batches: Vec<Vec<usize>> = (0..n)
        .collect::<Vec<_>>()
        .chunks(128)
        .map(<[usize]>::to_vec)
        .collect();
    for wave in batches.chunks(8) {
        let mut set = tokio::task::JoinSet::new();
        for batch in wave {
            let mut kv = client.kv_client();
            let ops: Vec<etcd_client::TxnOp> = batch
                .iter()
                .map(|&i| {
                    let (k, v) = entry(&remote(i, n, 0));
                    etcd_client::TxnOp::put(k, v, None)
                })
                .collect();
            set.spawn(async move { kv.txn(etcd_client::Txn::new().and_then(ops)).await });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap().expect("txn of puts");
        }
    }
    start.elapsed()
}

struct Sample {
    n: usize,
    /// The agent rebuilt the whole mesh and its translation on every publish
    /// (`FLOCK_PUBLISH_FROM_SCRATCH=1`, the agent before it was incremental): the
    /// baseline.
    baseline: bool,
    fill: Duration,
    ready: Duration,
    /// Agent CPU per remote change (ms), and the wall time from the etcd write to the
    /// agent's publish (ms; includes the refresher's 100 ms debounce). `None` with no
    /// remote endpoints.
    change: Option<(f64, f64)>,
    rss_kib: u64,
    hwm_kib: u64,
    /// The idle agent's CPU, ms per second.
    idle_ms_per_s: f64,
    /// Agent CPU per change less the idle rate over the changes' wall time.
    marginal: Option<f64>,
    churn: Option<Churn>,
}

/// What a churn run measured.
struct Churn {
    rate: usize,
    secs: u64,
    changes: usize,
    cpu_s: f64,
    p50_ms: f64,
    p99_ms: f64,
    max_ms: f64,
    unseen: usize,
    rss_kib: u64,
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// The outbound ClusterLoadAssignment of remote endpoint `i`'s service.
fn cla_name(i: usize, n: usize) -> String {
    format!("outbound|8080|svc-{}.default", i % services(n))
}

/// `rate` remote changes per second for `secs` against the agent whose xDS socket is
/// `xds`, starting at change number `first` (each change moves a different endpoint);
/// a raw Delta ADS client in the Envoy group times each until it holds it.
async fn churn(
    etcd_addr: &str,
    xds: &Path,
    pid: u32,
    n: usize,
    first: usize,
    rate: usize,
    secs: u64,
) -> Churn {
    use envoy_types::pb::envoy::config::core::v3::{Node, address};
    use envoy_types::pb::envoy::config::endpoint::v3::{ClusterLoadAssignment, lb_endpoint};
    use envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest;
    use prost::Message as _;
    use std::collections::{HashMap, HashSet};
    use std::sync::{Arc, Mutex};
    const ENDPOINT: &str = "type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment";

    let channel = flock_xds::client::connect(&format!("unix:{}", xds.display()))
        .await
        .expect("connecting to the agent's xDS socket");
    let mut ads = flock_xds::client::delta(channel)
        .await
        .expect("opening Delta ADS");
    let node = Node {
        id: "envoy-bench".into(),
        cluster: "bench".into(),
        user_agent_name: "envoy".into(),
        ..Node::default()
    };
    let request = move |subscribe: Vec<String>, nonce: String| DeltaDiscoveryRequest {
        node: Some(node.clone()),
        type_url: ENDPOINT.into(),
        resource_names_subscribe: subscribe,
        response_nonce: nonce,
        ..DeltaDiscoveryRequest::default()
    };
    ads.send(request(vec!["*".into()], String::new())).unwrap();
    // (cluster, address) → when it was written.
    let pending: Arc<Mutex<HashMap<(String, String), Instant>>> = Arc::default();
    let seen: Arc<Mutex<Vec<f64>>> = Arc::default();
    let held: Arc<Mutex<HashSet<String>>> = Arc::default();
    let reader = {
        let (pending, seen, held) = (Arc::clone(&pending), Arc::clone(&seen), Arc::clone(&held));
        tokio::spawn(async move {
            while let Ok(resp) = ads.recv(Duration::from_secs(3600)).await {
                let now = Instant::now();
                ads.send(request(Vec::new(), resp.nonce.clone())).unwrap();
                for r in resp.resources {
                    let Some(any) = r.resource else { continue };
                    let cla = ClusterLoadAssignment::decode(any.value.as_slice())
                        .expect("a ClusterLoadAssignment");
                    held.lock().unwrap().insert(r.name.clone());
                    let mut pending = pending.lock().unwrap();
                    if pending.is_empty() {
                        continue;
                    }
                    for ep in cla.endpoints.iter().flat_map(|g| &g.lb_endpoints) {
                        let Some(lb_endpoint::HostIdentifier::Endpoint(e)) = &ep.host_identifier
                        else {
                            continue;
                        };
                        let Some(address::Address::SocketAddress(sa)) =
                            e.address.as_ref().and_then(|a| a.address.as_ref())
                        else {
                            continue;
                        };
                        if let Some(t) = pending.remove(&(r.name.clone(), sa.address.clone())) {
                            seen.lock()
                                .unwrap()
                                .push(now.duration_since(t).as_secs_f64() * 1e3);
                        }
                    }
                }
            }
        })
    };
    // The client holds the whole initial state before the churn starts.
    let deadline = Instant::now() + Duration::from_secs(120);
    while held.lock().unwrap().len() < services(n) {
        assert!(
            Instant::now() < deadline,
            "the xDS client did not get every CLA"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let client = etcd_client::Client::connect([format!("http://{etcd_addr}")], None)
        .await
        .unwrap();
    let total = rate * secs as usize;
    let cpu_before = cpu_ms(pid);
    let start = Instant::now();
    let mut kv = client.kv_client();
    for k in 0..total {
        let at = start + Duration::from_secs_f64(k as f64 / rate as f64);
        tokio::time::sleep_until(at.into()).await;
        let i = ((first + k) * 7919 + 13) % n;
        let ep = remote(i, n, first + k + 1);
        let (key, value) = entry(&ep);
        pending
            .lock()
            .unwrap()
            .insert((cla_name(i, n), ep.address.to_string()), Instant::now());
        kv.put(key, value, None).await.unwrap();
    }
    let written = Instant::now();
    while !pending.lock().unwrap().is_empty() && written.elapsed() < Duration::from_secs(30) {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let cpu_s = (cpu_ms(pid) - cpu_before) / 1e3;
    reader.abort();
    let mut lat = seen.lock().unwrap().clone();
    lat.sort_by(f64::total_cmp);
    let unseen = pending.lock().unwrap().len();
    Churn {
        rate,
        secs,
        changes: total,
        cpu_s,
        p50_ms: pct(&lat, 0.5),
        p99_ms: pct(&lat, 0.99),
        max_ms: pct(&lat, 1.0),
        unseen,
        rss_kib: status_kib(pid, "VmRSS:"),
    }
}

/// The agent's user+system CPU in ms (`/proc/<pid>/stat` fields 14 and 15, in
/// USER_HZ = 100 ticks per second on Linux).
fn cpu_ms(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let after = stat.rsplit_once(')').map(|x| x.1).unwrap_or("");
    let f: Vec<u64> = after
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // After the command: state is field 3, utime field 14, stime field 15.
    (f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0)) as f64 * 10.0
}

/// Counter (without `_total`) or gauge `name` from the agent's `/metrics`.
fn metric(admin: &str, name: &str) -> Option<u64> {
    let (status, body) = http_get(admin, "/metrics")?;
    if status != 200 {
        return None;
    }
    body.lines()
        .find_map(|l| {
            let rest = l.strip_prefix(name)?;
            // Counters carry the `_total` suffix.
            rest.strip_prefix(' ')
                .or_else(|| rest.strip_prefix("_total "))
        })
        .and_then(|v| v.trim().parse::<f64>().ok())
        .map(|v| v as u64)
}

fn wait_metric(admin: &str, name: &str, what: &str, cond: impl Fn(u64) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(120);
    while !metric(admin, name).is_some_and(&cond) {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Local pod `i` through the agent's CNI service, as the plugin would add it.
async fn add_local_pod(socket: &Path, i: usize, services: usize) {
    use flock_cni::proto::v1::{AddPodRequest, IpConfig, Outcome, PodRef};
    let req = AddPodRequest {
        container_id: format!("local-{i}"),
        netns: flock_testkit::netns::pods_netns().into(),
        ifname: "eth0".into(),
        pod: Some(PodRef {
            name: format!("local-{i}"),
            namespace: "default".into(),
            uid: String::new(),
        }),
        ips: vec![IpConfig {
            address: format!("10.200.{}.{}/16", i / 256, i % 256),
            ..IpConfig::default()
        }],
        annotations: std::collections::HashMap::from([
            (
                "flock.io/service".to_string(),
                format!("svc-{}", i % services),
            ),
            ("flock.io/ports".to_string(), "8080".to_string()),
        ]),
        network_name: "net".into(),
        ..AddPodRequest::default()
    };
    let resp = flock_cni::client::call(socket, Duration::from_secs(30), |mut c| async move {
        c.add_pod(req).await
    })
    .await
    .expect("AddPod");
    assert_eq!(resp.outcome, Outcome::Success as i32, "{}", resp.message);
}

fn run(
    n: usize,
    local: usize,
    changes: usize,
    baseline: bool,
    churn_at: Option<(usize, u64)>,
) -> Sample {
    let dir = tempfile::Builder::new()
        .prefix("flock-bench-registry-")
        .tempdir()
        .unwrap();
    let (_etcd, etcd_addr, _etcd_port) = start_etcd(dir.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fill = rt.block_on(fill(&etcd_addr, n));
    // Reserved, not port 0: the agent runs with RUST_LOG=warn, so it does not log the
    // address it bound.
    let admin_port = reserve_port_for_child();
    let admin = format!("127.0.0.1:{admin_port}");
    let socket = dir.path().join("cni.sock");
    let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
    let start = Instant::now();
    // `FLOCK_BENCH_WRAP` (e.g. `heaptrack -o /tmp/agent`) runs the agent under a
    // profiler for the explanation of a figure; the CPU and RSS figures are then the
    // wrapper's process, not comparable to an unwrapped run.
    let mut cmd = match std::env::var("FLOCK_BENCH_WRAP") {
        Ok(wrap) if !wrap.trim().is_empty() => {
            let mut words = wrap.split_whitespace();
            let mut cmd = Command::new(words.next().unwrap_or_default());
            cmd.args(words).arg(agent_bin());
            cmd
        }
        _ => Command::new(agent_bin()),
    };
    let child = cmd
        .args(["--node-name", "bench-node", "--state-dir"])
        .arg(dir.path().join("state"))
        .arg("--cni-socket")
        .arg(&socket)
        .arg("--xds-socket")
        .arg(dir.path().join("run/xds.sock"))
        .args(["--admin-address", &admin])
        .args(["--registry", &format!("etcd://{etcd_addr}")])
        // No liveness probes in the measurement.
        .args(["--probe-interval-ms", "600000"])
        .env("RUST_LOG", "warn")
        .env(
            "FLOCK_PUBLISH_FROM_SCRATCH",
            if baseline { "1" } else { "0" },
        )
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("starting flock-agent");
    let mut agent = Proc(child);
    let pid = agent.0.id();
    let want = format!("flock_agent_registry_endpoints {n}\n");
    let deadline = start + Duration::from_secs(120);
    loop {
        if let Ok(Some(status)) = agent.0.try_wait() {
            let log = std::fs::read_to_string(dir.path().join("agent.log")).unwrap_or_default();
            panic!("flock-agent exited ({status}) with {n} remote endpoints:\n{log}");
        }
        let ready = matches!(http_get(&admin, "/readyz"), Some((200, _)))
            && matches!(http_get(&admin, "/metrics"), Some((200, m)) if m.contains(&want));
        if ready {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "flock-agent not ready with {n} endpoints"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let ready = start.elapsed();

    rt.block_on(async {
        for i in 0..local {
            add_local_pod(&socket, i, services(n)).await;
        }
    });
    wait_metric(
        &admin,
        "flock_agent_registry_endpoints",
        "the local pods in the registry view",
        |v| v == (n + local) as u64,
    );

    // The publishes after the view is in: let the resident size settle (no change
    // over 1 s, at most 15 s).
    let mut last = status_kib(pid, "VmRSS:");
    let settle = Instant::now();
    loop {
        std::thread::sleep(Duration::from_secs(1));
        let now = status_kib(pid, "VmRSS:");
        if now.abs_diff(last) * 100 <= last || settle.elapsed() > Duration::from_secs(15) {
            last = now;
            break;
        }
        last = now;
    }

    // The idle agent: timers, watches and lease keep-alives, no change, no poll.
    const IDLE: Duration = Duration::from_secs(3);
    let before = cpu_ms(pid);
    std::thread::sleep(IDLE);
    let idle_ms_per_s = (cpu_ms(pid) - before) / IDLE.as_secs_f64();

    let change = (n > 0 && changes > 0).then(|| {
        // What one `/metrics` poll costs the agent, to take out of the change figure.
        const POLLS: usize = 300;
        let before = cpu_ms(pid);
        for _ in 0..POLLS {
            metric(&admin, "flock_agent_publishes");
        }
        let per_poll = (cpu_ms(pid) - before) / POLLS as f64;

        let client = rt
            .block_on(etcd_client::Client::connect(
                [format!("http://{etcd_addr}")],
                None,
            ))
            .unwrap();
        let mut polls = 0usize;
        // The polls of each change, replayed by the loop without changes below.
        let mut polls_of = Vec::with_capacity(changes);
        let mut wall = Duration::ZERO;
        let cpu_before = cpu_ms(pid);
        for k in 0..changes {
            let publishes = metric(&admin, "flock_agent_publishes").unwrap();
            let mut these = 1;
            let (key, value) = entry(&remote((k * 7919 + 13) % n, n, k + 1));
            let t = Instant::now();
            rt.block_on(client.kv_client().put(key, value, None))
                .unwrap();
            // Nothing is published before the refresher's 100 ms debounce.
            std::thread::sleep(Duration::from_millis(100));
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                these += 1;
                if metric(&admin, "flock_agent_publishes").unwrap() > publishes {
                    break;
                }
                assert!(Instant::now() < deadline, "change {k} was not published");
                std::thread::sleep(Duration::from_millis(2));
            }
            wall += t.elapsed();
            polls += these;
            polls_of.push(these);
        }
        let with_changes = cpu_ms(pid) - cpu_before;
        let cpu = with_changes - polls as f64 * per_poll;
        // The same loop without the changes: the same sleeps and the same number of
        // polls at the same moments. What the loop with changes cost more is what
        // the changes cost (the polls of an agent that parks between them cost more
        // than the back-to-back polls `per_poll` measures).
        let before = cpu_ms(pid);
        for these in &polls_of {
            metric(&admin, "flock_agent_publishes").unwrap();
            std::thread::sleep(Duration::from_millis(100));
            for _ in 1..*these {
                metric(&admin, "flock_agent_publishes").unwrap();
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let without_changes = cpu_ms(pid) - before;
        (
            cpu / changes as f64,
            wall.as_secs_f64() * 1e3 / changes as f64,
            (with_changes - without_changes) / changes as f64,
        )
    });
    let marginal = change.map(|(_, _, marginal)| marginal);
    let change = change.map(|(cpu, wall, _)| (cpu, wall));
    let churn = churn_at.filter(|_| n > 0).map(|(rate, secs)| {
        rt.block_on(churn(
            &etcd_addr,
            &dir.path().join("run/xds.sock"),
            pid,
            n,
            changes,
            rate,
            secs,
        ))
    });
    Sample {
        n,
        baseline,
        fill,
        ready,
        change,
        rss_kib: last,
        hwm_kib: status_kib(pid, "VmHWM:"),
        idle_ms_per_s,
        marginal,
        churn,
    }
}

fn env_num<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .map(|s| {
            s.trim()
                .parse()
                .unwrap_or_else(|_| panic!("{name}: a number"))
        })
        .unwrap_or(default)
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is not supported.
    let sizes: Vec<usize> = std::env::var("FLOCK_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').map(|x| x.trim().parse().unwrap()).collect())
        .unwrap_or_else(|| vec![500, 5_000, 50_000]);
    let changes: usize = env_num("FLOCK_BENCH_CHANGES", 40);
    let churn_rate: usize = env_num("FLOCK_BENCH_CHURN_RATE", 200);
    let churn_secs: u64 = env_num("FLOCK_BENCH_CHURN_SECS", 30);
    let churn_on = std::env::var("FLOCK_BENCH_CHURN").map_or(true, |v| v != "0");
    let largest = sizes.iter().copied().max().unwrap_or(0);
    const LOCAL: usize = 100;
    let base = run(0, LOCAL, 0, false, None);
    println!(
        "registry_scale: agent (--registry etcd://, {LOCAL} local pods) with N other nodes' \
         endpoints in a real etcd; {changes} remote changes per size"
    );
    println!(
        "| publish | N | fill | start | CPU/change | marginal CPU/change | idle CPU | change→publish | RSS | peak | bytes/endpoint |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    let mut churns = Vec::new();
    let mut row = |s: &Sample| {
        let per = if s.n == 0 {
            "-".to_string()
        } else {
            format!(
                "{}",
                (s.rss_kib.saturating_sub(base.rss_kib) * 1024) / s.n as u64
            )
        };
        let (cpu, wall) = match s.change {
            Some((c, w)) => (format!("{c:.2} ms"), format!("{w:.1} ms")),
            None => ("-".to_string(), "-".to_string()),
        };
        let marginal = s.marginal.map_or("-".to_string(), |m| format!("{m:.2} ms"));
        let publish = if s.baseline {
            "from scratch"
        } else {
            "incremental"
        };
        println!(
            "| {publish} | {} | {:.1} s | {:.2} s | {cpu} | {marginal} | {:.1} ms/s | {wall} | {:.1} MiB | {:.1} MiB | {per} |",
            s.n,
            s.fill.as_secs_f64(),
            s.ready.as_secs_f64(),
            s.idle_ms_per_s,
            s.rss_kib as f64 / 1024.0,
            s.hwm_kib as f64 / 1024.0,
        );
        if let Some(c) = &s.churn {
            churns.push((
                publish, s.n, c.rate, c.secs, c.changes, c.cpu_s, c.p50_ms, c.p99_ms, c.max_ms,
                c.unseen, c.rss_kib,
            ));
        }
    };
    row(&base);
    // Each size twice in the same run: the incremental agent, and the baseline
    // (`FLOCK_BENCH_BASELINE=0` skips the baseline).
    let baseline = std::env::var("FLOCK_BENCH_BASELINE").map_or(true, |v| v != "0");
    for n in sizes {
        let churn_at = (churn_on && n == largest).then_some((churn_rate, churn_secs));
        row(&run(n, LOCAL, changes, false, churn_at));
        if baseline {
            row(&run(n, LOCAL, changes, true, churn_at));
        }
    }
    if !churns.is_empty() {
        println!();
        println!(
            "churn: remote endpoint changes at a fixed rate, each timed from the etcd write until a Delta ADS client (Envoy group) holds it"
        );
        println!(
            "| publish | N | rate | changes | agent CPU (user+sys) | p50 | p99 | max | not seen | RSS after |"
        );
        println!("|---|---|---|---|---|---|---|---|---|---|");
        for (publish, n, rate, secs, total, cpu, p50, p99, max, unseen, rss) in churns {
            println!(
                "| {publish} | {n} | {rate}/s for {secs} s | {total} | {cpu:.2} s | {p50:.0} ms | {p99:.0} ms | {max:.0} ms | {unseen} | {:.1} MiB |",
                rss as f64 / 1024.0
            );
        }
    }
}
