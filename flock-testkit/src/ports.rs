//! Ports for servers a test cannot hand a bound socket to.
//!
//! Code under test that accepts a listener gets one bound to port 0 (`TcpListener::bind
//! ("127.0.0.1:0")`): no race. A child process (Envoy, etcd, the agent, a Python peer)
//! binds its ports itself, and often must know them before it starts (Envoy's listeners
//! come from a mesh model that names them; a restarted agent or a hot-restarted Envoy
//! binds the same admin port again). For those, [`reserve_port_for_child`].
//!
//! The race it closes: "bind port 0, read the number, close the socket, hand the
//! number to the child" leaves a window in which anything on the machine may be given
//! that port, because the kernel hands out ephemeral ports (every `bind(0)` and every
//! outgoing `connect`) from exactly that range, and the suite's own parallel tests
//! do both all the time. A reserved port is instead taken from *below* the kernel's
//! ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), which the kernel never
//! hands out, and held by an exclusive `flock(2)` on a per-port file in the temp dir
//! for as long as the [`ChildPort`] lives, so no other test process reserves it
//! meanwhile (the lock goes with the process, so a crashed test leaks nothing). What
//! remains is a process outside the suite binding that exact number explicitly, the
//! same as for any fixed port.

use std::fs::{File, OpenOptions};
use std::net::TcpListener;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};

use nix::fcntl::{Flock, FlockArg};

/// The lowest port handed out: clear of the well-known ports and of the registered
/// ports the peers use by default (etcd's 2379/2380, Envoy's 9901, 15000/15001...).
const LOWEST: u16 = 20_000;

/// A port reserved for a child process to bind; see the module docs. Keep it alive for
/// as long as the child may (re)bind the port: dropping it lets another test reserve
/// the number.
#[derive(Debug)]
pub struct ChildPort {
    port: u16,
    _lock: Flock<File>,
}

impl ChildPort {
    /// The port number.
    pub fn port(&self) -> u16 {
        self.port
    }
}

impl std::fmt::Display for ChildPort {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.port)
    }
}

/// The ports reservations are drawn from: [`LOWEST`, the start of the kernel's
/// ephemeral range).
fn reservable_range() -> (u16, u16) {
    let text = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .expect("reading /proc/sys/net/ipv4/ip_local_port_range");
    let first: u16 = text
        .split_whitespace()
        .next()
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("ip_local_port_range is {text:?}"));
    assert!(
        first > LOWEST + 1_000,
        "the kernel's ephemeral ports start at {first}: fewer than 1,000 ports between \
         {LOWEST} and that to reserve for tests' children"
    );
    (LOWEST, first)
}

fn lock_dir() -> PathBuf {
    let dir = std::env::temp_dir().join("flock-test-ports");
    std::fs::create_dir_all(&dir).expect("creating the port lock directory");
    dir
}

/// Reserves a TCP port, free on every IPv4 address right now, for a child process to
/// bind (see the module docs for why this is not a race). Panics if none is free.
pub fn reserve_port_for_child() -> ChildPort {
    // Where this process starts looking: spread over the range by pid, then onwards,
    // so parallel test processes rarely contend for the same lock.
    static NEXT: AtomicU32 = AtomicU32::new(0);
    let (lo, hi) = reservable_range();
    let span = u32::from(hi - lo);
    let start = std::process::id().wrapping_mul(7_919) % span;
    let dir = lock_dir();
    for _ in 0..span {
        let offset = (start + NEXT.fetch_add(1, Ordering::Relaxed)) % span;
        let port = lo + offset as u16;
        let Ok(file) = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join(format!("{port}.lock")))
        else {
            continue;
        };
        let Ok(lock) = Flock::lock(file, FlockArg::LockExclusiveNonblock) else {
            continue; // another test process holds it
        };
        // Free now? (A server outside the suite may sit on it.) std sets SO_REUSEADDR,
        // so a connection of a previous holder still in TIME_WAIT does not count.
        if TcpListener::bind(("0.0.0.0", port)).is_ok() {
            return ChildPort { port, _lock: lock };
        }
    }
    panic!("no port free to reserve in {lo}..{hi}")
}

/// [`reserve_port_for_child`] `N` times: the reservations, which must be kept alive
/// (bind them to a named variable such as `_held`, not to `_`), and their numbers.
pub fn reserve_ports_for_child<const N: usize>() -> ([ChildPort; N], [u16; N]) {
    let held: [ChildPort; N] = std::array::from_fn(|_| reserve_port_for_child());
    let numbers = std::array::from_fn(|i| held[i].port());
    (held, numbers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserved_ports_are_distinct_below_the_ephemeral_range_and_bindable() {
        let (_, ephemeral) = reservable_range();
        let ports: Vec<ChildPort> = (0..20).map(|_| reserve_port_for_child()).collect();
        let mut numbers: Vec<u16> = ports.iter().map(ChildPort::port).collect();
        numbers.sort_unstable();
        numbers.dedup();
        assert_eq!(numbers.len(), 20);
        for p in &numbers {
            assert!((LOWEST..ephemeral).contains(p), "{p}");
            TcpListener::bind(("127.0.0.1", *p)).expect("the child can bind it");
        }
    }

    #[test]
    fn a_port_stays_reserved_while_its_guard_lives() {
        let held = reserve_port_for_child();
        // A second lock on the same file, as another test process would try it.
        let file = OpenOptions::new()
            .write(true)
            .open(lock_dir().join(format!("{}.lock", held.port())))
            .unwrap();
        let file = match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(_) => panic!("port {} was lockable twice", held.port()),
            Err((file, _)) => file,
        };
        drop(held);
        assert!(Flock::lock(file, FlockArg::LockExclusiveNonblock).is_ok());
    }
}
