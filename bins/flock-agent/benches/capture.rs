//! What transparent capture costs, printed as plain numbers (root and the real peers:
//! the agent with `--capture strict`, Envoy under `flock-supervisor`, libcni with
//! Debian's `bridge` + `host-local` chained with `flock-cni`, real netns and nft):
//!
//! 1. Request latency (p50/p99 over one keep-alive connection) and throughput (four
//!    keep-alive connections for a few seconds) to the same kind of app, three ways:
//!    * **captured**: an unmodified client in pod A dials B's pod address; capture
//!      sends it through A's outbound listener and mTLS to B's inbound listener;
//!    * **explicit**: a pod with `flock.io/capture: off` dials its outbound listener
//!      `127.0.0.1:15001` with `Host: web` (the mesh without capture: same Envoy
//!      path, no redirect and no original-destination match);
//!    * **direct**: plaintext from a pod outside the mesh to an app outside the mesh
//!      (no Envoy at all).
//!
//!    The client and the apps are Rust threads that entered the pods' netns (`setns`),
//!    so neither a process spawn nor a slow app is in what is measured.
//! 2. CNI ADD latency through libcni (`cnitool bench`: ADD then DEL, N times), with
//!    capture (`flock.io/capture: strict`: the agent installs the nft table in the
//!    pod's netns before answering) and without (`flock.io/capture: off`).
//!
//! ```sh
//! cargo build --release -p flock-agent -p flockctl -p flock-cni-plugin -p flock-install-cni -p flock-supervisor
//! cargo bench -p flock-agent --bench capture
//! ```
//!
//! Needs what `tests/capture.rs` needs (root, nft, `FLOCK_ENVOY_BIN`,
//! `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL`).

#[path = "../tests/common/mod.rs"]
mod common;

#[path = "../tests/capturekit/mod.rs"]
mod capturekit;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use capturekit::*;
use common::*;
use serde_json::{Value, json};

const LATENCY_REQUESTS: usize = 2000;
const THROUGHPUT_CONNS: usize = 4;
const THROUGHPUT_FOR: Duration = Duration::from_secs(4);
const CNI_ADDS: usize = 100;
const BODY: &[u8] = b"hello from the bench app";

/// Moves the calling thread into the netns at `path` (setns changes only this thread).
fn enter(path: &str) {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("setns {path}: {e}"));
}

/// A keep-alive HTTP/1.1 app answering every GET with [`BODY`], on `0.0.0.0:port` in
/// the netns at `netns`, one thread per connection. Runs until the process exits.
fn app_in(netns: &str, port: u16) {
    let netns = netns.to_owned();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        enter(&netns);
        let listener = TcpListener::bind(("0.0.0.0", port)).unwrap();
        tx.send(()).unwrap();
        for conn in listener.incoming().flatten() {
            std::thread::spawn(move || serve(conn));
        }
    });
    rx.recv().unwrap();
}

fn serve(conn: TcpStream) {
    let _ = conn.set_nodelay(true);
    let mut reader = BufReader::new(conn.try_clone().unwrap());
    let mut conn = conn;
    let head = format!(
        "HTTP/1.1 200 OK\r\ncontent-length: {}\r\ncontent-type: text/plain\r\n\r\n",
        BODY.len()
    );
    let mut response = head.into_bytes();
    response.extend_from_slice(BODY);
    let mut line = String::new();
    loop {
        // Read one request head (GETs only: no body).
        loop {
            line.clear();
            match reader.read_line(&mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) if line == "\r\n" => break,
                Ok(_) => {}
            }
        }
        if conn.write_all(&response).is_err() {
            return;
        }
    }
}

/// One keep-alive client connection (in the calling thread's netns).
struct Client {
    conn: TcpStream,
    request: Vec<u8>,
    buf: Vec<u8>,
}

impl Client {
    fn connect(addr: &str, host: &str) -> std::io::Result<Self> {
        let conn = TcpStream::connect(addr)?;
        conn.set_nodelay(true)?;
        conn.set_read_timeout(Some(Duration::from_secs(5)))?;
        Ok(Self {
            conn,
            request: format!("GET / HTTP/1.1\r\nHost: {host}\r\n\r\n").into_bytes(),
            buf: vec![0; 4096],
        })
    }

    /// One request; Ok when a 200 with the whole body came back.
    fn get(&mut self) -> std::io::Result<()> {
        self.conn.write_all(&self.request)?;
        let mut got = Vec::new();
        loop {
            let n = self.conn.read(&mut self.buf)?;
            if n == 0 {
                return Err(std::io::Error::other("closed"));
            }
            got.extend_from_slice(&self.buf[..n]);
            if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse().ok())
                    .ok_or_else(|| std::io::Error::other(format!("no length: {head}")))?;
                if got.len() >= end + 4 + len {
                    if !head.starts_with("http/1.1 200") || &got[end + 4..end + 4 + len] != BODY {
                        return Err(std::io::Error::other(format!("bad answer: {head}")));
                    }
                    return Ok(());
                }
            }
        }
    }
}

fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// (p50 µs, p99 µs, requests/s) for clients in the netns at `netns` dialling `addr`
/// with `Host: host`.
fn measure(netns: &str, addr: &str, host: &str) -> (f64, f64, f64) {
    let (netns_s, addr_s, host_s) = (netns.to_owned(), addr.to_owned(), host.to_owned());
    let latencies = std::thread::spawn(move || {
        enter(&netns_s);
        let mut c = wait_for(&format!("a 200 from {addr_s}"), WAIT, || {
            let mut c = Client::connect(&addr_s, &host_s).ok()?;
            c.get().ok().map(|()| c)
        });
        for _ in 0..200 {
            c.get().unwrap(); // warm-up
        }
        let mut us = Vec::with_capacity(LATENCY_REQUESTS);
        for _ in 0..LATENCY_REQUESTS {
            let t = Instant::now();
            c.get().unwrap();
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        us
    })
    .join()
    .unwrap();
    let mut sorted = latencies;
    sorted.sort_by(f64::total_cmp);

    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let workers: Vec<_> = (0..THROUGHPUT_CONNS)
        .map(|_| {
            let (netns, addr, host) = (netns.to_owned(), addr.to_owned(), host.to_owned());
            let (done, stop) = (done.clone(), stop.clone());
            std::thread::spawn(move || {
                enter(&netns);
                let mut c = Client::connect(&addr, &host).unwrap();
                while !stop.load(Ordering::Relaxed) {
                    c.get().unwrap();
                    done.fetch_add(1, Ordering::Relaxed);
                }
            })
        })
        .collect();
    let t = Instant::now();
    std::thread::sleep(THROUGHPUT_FOR); // the measurement window, not a synchronisation
    let n = done.load(Ordering::Relaxed);
    let secs = t.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        w.join().unwrap();
    }
    (pct(&sorted, 0.50), pct(&sorted, 0.99), n as f64 / secs)
}

/// (p50 ms, p99 ms) of `CNI_ADDS` ADDs (each followed by its DEL) through libcni.
fn add_latency(cni: &Cni, ns: &NetNs, prefix: &str, annotations: &Value) -> (f64, f64) {
    let mut ms = cnitool_adds(cni, &ns.path(), CNI_ADDS, prefix, annotations);
    ms.sort_by(f64::total_cmp);
    (pct(&ms, 0.50), pct(&ms, 0.99))
}

fn main() {
    // `cargo bench` passes --bench; nothing to parse.
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let agent = Agent::start(&["--capture", "strict", "--trust-domain", "mesh.test"]);
    let envoy = SupervisedEnvoy::start(&agent);
    let work = tempfile::Builder::new()
        .prefix("flock-capture-bench-")
        .tempdir()
        .unwrap();
    let net = ChainedNetwork::start(work.path(), &agent, "cbench", 8000);
    let cni = &net.cni;

    // The apps first (B's in the mesh, M's outside it), then the pods' ADDs.
    let ns_b = NetNs::new("bb");
    app_in(&ns_b.path(), 8080);
    let ns_m = NetNs::new("bm");
    app_in(&ns_m.path(), 8080);
    let b = Pod::add_in(
        cni,
        ns_b,
        "default",
        "web-0",
        json!({"flock.io/service": "web", "flock.io/ports": "8080/http",
               "flock.io/service-account": "web"}),
    );
    let a = Pod::add(
        cni,
        "ba",
        "client-0",
        json!({"flock.io/service": "client", "flock.io/service-account": "client"}),
    );
    let e = Pod::add(
        cni,
        "be",
        "explicit-0",
        json!({"flock.io/service": "client", "flock.io/service-account": "client",
               "flock.io/capture": "off"}),
    );
    let m = Pod::add_in(cni, ns_m, "default", "plain-0", json!({}));
    let n = Pod::add(cni, "bn", "outside-0", json!({}));
    assert_eq!(e.tables(), Vec::new(), "capture: off still got rules");

    let b_addr = format!("{}:8080", b.ip);
    let captured = measure(&a.ns.path(), &b_addr, "anything.example");
    let explicit = measure(&e.ns.path(), "127.0.0.1:15001", "web");
    let direct = measure(&n.ns.path(), &format!("{}:8080", m.ip), "plain");
    // Each way's requests went where it says: the captured and explicit ones through
    // the client's mTLS cluster of web.
    let stats = envoy_stats(&envoy.admin);
    let mtls = stat(
        &stats,
        &["outbound|8080|web.default|", "sa/client"],
        ".upstream_rq_total",
    );
    assert!(
        mtls > 2 * LATENCY_REQUESTS as u64,
        "mTLS cluster saw {mtls}"
    );

    println!(
        "A→B request latency ({LATENCY_REQUESTS} sequential GETs on one keep-alive connection) \
         and throughput ({THROUGHPUT_CONNS} keep-alive connections, {THROUGHPUT_FOR:?}):"
    );
    println!("| path | p50 | p99 | throughput |");
    println!("|---|---|---|---|");
    for (name, (p50, p99, rps)) in [
        (
            "captured: unmodified client → B's pod IP:8080 (Envoy, mTLS)",
            captured,
        ),
        (
            "explicit: client → 127.0.0.1:15001, Host: web (Envoy, mTLS, no capture)",
            explicit,
        ),
        (
            "direct: plaintext to an app outside the mesh (no Envoy)",
            direct,
        ),
    ] {
        println!("| {name} | {p50:.0} µs | {p99:.0} µs | {rps:.0} req/s |");
    }

    // ---------------------------------------------------------------- 2. CNI ADD
    let ns = NetNs::new("badd");
    let base = json!({"flock.io/service": "bench", "flock.io/ports": "8080"});
    let with = |mode: &str| {
        let mut a = base.clone();
        a["flock.io/capture"] = json!(mode);
        a
    };
    let (off50, off99) = add_latency(cni, &ns, "nocap-", &with("off"));
    let (on50, on99) = add_latency(cni, &ns, "cap-", &with("strict"));
    println!();
    println!(
        "CNI ADD through libcni ({CNI_ADDS} ADDs, each followed by its DEL; bridge + host-local + flock-cni):"
    );
    println!("| pod | p50 | p99 |");
    println!("|---|---|---|");
    println!("| `flock.io/capture: off` | {off50:.2} ms | {off99:.2} ms |");
    println!(
        "| `flock.io/capture: strict` (nft table installed before the answer) | {on50:.2} ms | {on99:.2} ms |"
    );

    drop((a, b, e, m, n, ns, net));
    drop(envoy);
    drop(agent);
}
