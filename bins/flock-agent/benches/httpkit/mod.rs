//! The request-latency kit of the capture and telemetry benchmarks: a keep-alive
//! HTTP/1.1 app and client on Rust threads that entered a pod's netns (`setns`), so
//! neither a process spawn nor a slow app is in what is measured.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::common::{WAIT, wait_for};

/// Sequential requests of one latency measurement.
pub const LATENCY_REQUESTS: usize = 2000;
/// Connections of one throughput measurement.
pub const THROUGHPUT_CONNS: usize = 4;
/// The throughput window.
pub const THROUGHPUT_FOR: Duration = Duration::from_secs(4);
/// What the app answers.
pub const BODY: &[u8] = b"hello from the bench app";

/// Moves the calling thread into the netns at `path` (setns changes only this thread).
pub fn enter(path: &str) {
    let file = std::fs::File::open(path).unwrap_or_else(|e| panic!("{path}: {e}"));
    nix::sched::setns(&file, nix::sched::CloneFlags::CLONE_NEWNET)
        .unwrap_or_else(|e| panic!("setns {path}: {e}"));
}

/// A keep-alive HTTP/1.1 app answering every GET with [`BODY`], on `0.0.0.0:port` in
/// the netns at `netns`, one thread per connection. Runs until the process exits.
pub fn app_in(netns: &str, port: u16) {
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
pub struct Client {
    conn: TcpStream,
    request: Vec<u8>,
    buf: Vec<u8>,
}

impl Client {
    pub fn connect(addr: &str, host: &str) -> std::io::Result<Self> {
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
    pub fn get(&mut self) -> std::io::Result<()> {
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

pub fn pct(sorted: &[f64], p: f64) -> f64 {
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// (p50 µs, p99 µs, requests/s) for clients in the netns at `netns` dialling `addr`
/// with `Host: host`.
pub fn measure(netns: &str, addr: &str, host: &str) -> (f64, f64, f64) {
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
