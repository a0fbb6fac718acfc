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
//! Each size runs twice: the agent as it is (its service table re-derives only the
//! services a change touches), and the baseline, the same agent recomputing every
//! service from the whole registry view on every publish
//! (`FLOCK_PUBLISH_FROM_SCRATCH=1`, what it did before the table).
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
//! per size (default 40).

use flock_bird::model::{Endpoint, Health, Protocol};
use flock_core::pod::PodKey;
use flock_testkit::free_port;
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

fn start_etcd(dir: &Path) -> (Proc, String) {
    let port = free_port();
    let client = format!("http://127.0.0.1:{port}");
    let peer = format!("http://127.0.0.1:{}", free_port());
    let log = std::fs::File::create(dir.join("etcd.log")).unwrap();
    let child = Command::new(etcd_bin())
        .args(["--name", "b1", "--data-dir"])
        .arg(dir.join("etcd"))
        .args(["--listen-client-urls", &client])
        .args(["--advertise-client-urls", &client])
        .args(["--listen-peer-urls", &peer])
        .args(["--initial-advertise-peer-urls", &peer])
        .args(["--initial-cluster", &format!("b1={peer}")])
        .args(["--heartbeat-interval", "50", "--election-timeout", "250"])
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .expect("starting etcd");
    let proc = Proc(child);
    let addr = format!("127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !matches!(http_get(&addr, "/health"), Some((200, b)) if b.contains("true")) {
        assert!(Instant::now() < deadline, "etcd did not become healthy");
        std::thread::sleep(Duration::from_millis(50));
    }
    (proc, addr)
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
    /// The agent recomputed the registry's services from the whole view on every
    /// publish (`FLOCK_PUBLISH_FROM_SCRATCH=1`, the agent before its incremental
    /// service table): the baseline.
    baseline: bool,
    fill: Duration,
    ready: Duration,
    /// Agent CPU per remote change (ms), and the wall time from the etcd write to the
    /// agent's publish (ms; includes the refresher's 100 ms debounce). `None` with no
    /// remote endpoints.
    change: Option<(f64, f64)>,
    rss_kib: u64,
    hwm_kib: u64,
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
        netns: "/proc/self/ns/net".into(),
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

fn run(n: usize, local: usize, changes: usize, baseline: bool) -> Sample {
    let dir = tempfile::Builder::new()
        .prefix("flock-bench-registry-")
        .tempdir()
        .unwrap();
    let (_etcd, etcd_addr) = start_etcd(dir.path());
    let rt = tokio::runtime::Runtime::new().unwrap();
    let fill = rt.block_on(fill(&etcd_addr, n));
    let admin = format!("127.0.0.1:{}", free_port());
    let socket = dir.path().join("cni.sock");
    let log = std::fs::File::create(dir.path().join("agent.log")).unwrap();
    let start = Instant::now();
    let child = Command::new(agent_bin())
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
        let mut wall = Duration::ZERO;
        let cpu_before = cpu_ms(pid);
        for k in 0..changes {
            let publishes = metric(&admin, "flock_agent_publishes").unwrap();
            polls += 1;
            let (key, value) = entry(&remote((k * 7919 + 13) % n, n, k + 1));
            let t = Instant::now();
            rt.block_on(client.kv_client().put(key, value, None))
                .unwrap();
            // Nothing is published before the refresher's 100 ms debounce.
            std::thread::sleep(Duration::from_millis(100));
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                polls += 1;
                if metric(&admin, "flock_agent_publishes").unwrap() > publishes {
                    break;
                }
                assert!(Instant::now() < deadline, "change {k} was not published");
                std::thread::sleep(Duration::from_millis(2));
            }
            wall += t.elapsed();
        }
        let cpu = cpu_ms(pid) - cpu_before - polls as f64 * per_poll;
        (
            cpu / changes as f64,
            wall.as_secs_f64() * 1e3 / changes as f64,
        )
    });
    Sample {
        n,
        baseline,
        fill,
        ready,
        change,
        rss_kib: last,
        hwm_kib: status_kib(pid, "VmHWM:"),
    }
}

fn main() {
    // `cargo bench` passes `--bench`; a filter argument is not supported.
    let sizes: Vec<usize> = std::env::var("FLOCK_BENCH_SIZES")
        .ok()
        .map(|s| s.split(',').map(|x| x.trim().parse().unwrap()).collect())
        .unwrap_or_else(|| vec![500, 5_000, 50_000]);
    let changes: usize = std::env::var("FLOCK_BENCH_CHANGES")
        .ok()
        .map(|s| s.trim().parse().unwrap())
        .unwrap_or(40);
    const LOCAL: usize = 100;
    let base = run(0, LOCAL, 0, false);
    println!(
        "registry_scale: agent (--registry etcd://, {LOCAL} local pods) with N other nodes' \
         endpoints in a real etcd; {changes} remote changes per size"
    );
    println!(
        "{:>13} {:>8} {:>9} {:>10} {:>14} {:>15} {:>10} {:>10} {:>14}",
        "publish",
        "N",
        "fill",
        "start",
        "CPU/change ms",
        "change→publish",
        "RSS MiB",
        "peak MiB",
        "bytes/endpoint"
    );
    let row = |s: &Sample| {
        let per = if s.n == 0 {
            "-".to_string()
        } else {
            format!(
                "{}",
                (s.rss_kib.saturating_sub(base.rss_kib) * 1024) / s.n as u64
            )
        };
        let (cpu, wall) = match s.change {
            Some((c, w)) => (format!("{c:.2}"), format!("{w:.1} ms")),
            None => ("-".to_string(), "-".to_string()),
        };
        println!(
            "{:>13} {:>8} {:>8.1}s {:>9.2}s {:>14} {:>15} {:>10.1} {:>10.1} {:>14}",
            if s.baseline {
                "from scratch"
            } else {
                "incremental"
            },
            s.n,
            s.fill.as_secs_f64(),
            s.ready.as_secs_f64(),
            cpu,
            wall,
            s.rss_kib as f64 / 1024.0,
            s.hwm_kib as f64 / 1024.0,
            per
        );
    };
    row(&base);
    // Each size twice in the same run: the incremental agent, and the baseline
    // (`FLOCK_BENCH_BASELINE=0` skips the baseline).
    let baseline = std::env::var("FLOCK_BENCH_BASELINE").map_or(true, |v| v != "0");
    for n in sizes {
        row(&run(n, LOCAL, changes, false));
        if baseline {
            row(&run(n, LOCAL, changes, true));
        }
    }
}
