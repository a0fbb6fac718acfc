//! The capture table in real network namespaces with the real `nft` (root; the peers
//! test tier): idempotent apply, check and repair, and real TCP flows redirected,
//! bypassing and dropped as the rules say, over IPv4 and IPv6.
//!
//! Each test builds two namespaces joined by a veth pair: `pod` (10.77.0.2,
//! fd77::2) where the rules go, and `peer` (10.77.0.1 and 10.77.0.3, fd77::1 and
//! fd77::3). Sockets are opened in a namespace by a thread that `setns`es into it (a
//! socket stays in the netns it was created in).

use std::fs::File;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use flock_capture::{CaptureError, Mode, Nft};
use flock_core::capture::{CaptureSpec, Drift, ORIGINAL_SRC_MARK, OriginalSrc};
use nix::sched::{CloneFlags, setns};
use nix::sys::socket::{self, AddressFamily, SockFlag, SockType, SockaddrStorage, sockopt};

const DEADLINE: Duration = Duration::from_secs(10);
const MARK: u32 = 0x539;

fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .expect("spawn");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

struct Ns(String);

impl Ns {
    fn new(role: &str) -> Ns {
        static N: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "flockcap-{}-{}-{role}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        sh(&["ip", "netns", "add", &name]);
        sh(&["ip", "-n", &name, "link", "set", "lo", "up"]);
        Ns(name)
    }

    fn path(&self) -> PathBuf {
        PathBuf::from(format!("/var/run/netns/{}", self.0))
    }

    fn nft(&self, args: &[&str]) -> String {
        let mut all = vec!["ip", "netns", "exec", &self.0, "nft"];
        all.extend_from_slice(args);
        sh(&all)
    }

    /// Runs `f` on a thread inside this netns.
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        let file = File::open(self.path()).unwrap();
        std::thread::spawn(move || {
            setns(file.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns");
            f()
        })
        .join()
        .unwrap()
    }

    /// Starts a connection from `src` to `dst` inside this netns on a thread of its own
    /// and returns at once: for a SYN the rules drop, whose `connect` would block
    /// through the kernel's retries. The test judges by the drop counter and the
    /// listener, never by waiting on the thread.
    fn connect_detached(&self, src: &str, dst: &str) {
        let src: SocketAddr = src.parse().unwrap();
        let dst: SocketAddr = dst.parse().unwrap();
        let file = File::open(self.path()).unwrap();
        std::thread::spawn(move || {
            setns(file.as_fd(), CloneFlags::CLONE_NEWNET).expect("setns");
            let fd = bound_socket(Some(src), dst, None);
            let _ = socket::connect(fd.as_fd().as_raw_fd_compat(), &SockaddrStorage::from(dst));
        });
    }

    fn listen(&self, addr: &str) -> TcpListener {
        let addr: SocketAddr = addr.parse().unwrap();
        let l = self.run(move || TcpListener::bind(addr)).unwrap();
        l.set_nonblocking(true).unwrap();
        l
    }

    /// Connects to `dst` from inside this netns, optionally from `src` and with `SO_MARK`.
    fn connect(&self, src: Option<&str>, dst: &str, mark: Option<u32>) -> TcpStream {
        let src: Option<SocketAddr> = src.map(|s| s.parse().unwrap());
        let dst: SocketAddr = dst.parse().unwrap();
        self.run(move || {
            let fd = bound_socket(src, dst, mark);
            socket::connect(fd.as_fd().as_raw_fd_compat(), &SockaddrStorage::from(dst)).unwrap();
            TcpStream::from(fd)
        })
    }
}

/// A TCP socket of `dst`'s family, with `SO_MARK` `mark`, bound to `src` if given.
fn bound_socket(
    src: Option<SocketAddr>,
    dst: SocketAddr,
    mark: Option<u32>,
) -> std::os::fd::OwnedFd {
    bound_socket_with(src, dst, mark, false)
}

/// [`bound_socket`], `IP_TRANSPARENT` if `transparent` (so `src` may be an address
/// this netns does not have, as Envoy's `original_src` binds the caller's).
fn bound_socket_with(
    src: Option<SocketAddr>,
    dst: SocketAddr,
    mark: Option<u32>,
    transparent: bool,
) -> std::os::fd::OwnedFd {
    let family = if dst.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket::socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None).unwrap();
    if let Some(mark) = mark {
        socket::setsockopt(&fd, sockopt::Mark, &mark).unwrap();
    }
    if transparent {
        // IP_TRANSPARENT: Linux sets the one transparency flag IPV6_TRANSPARENT sets
        // too, for either family.
        socket::setsockopt(&fd, sockopt::IpTransparent, &true).unwrap();
    }
    if let Some(src) = src {
        socket::bind(fd.as_fd().as_raw_fd_compat(), &SockaddrStorage::from(src)).unwrap();
    }
    fd
}

/// nix 0.32's bind/connect take a raw fd; the fd stays owned by the `OwnedFd`.
trait RawCompat {
    fn as_raw_fd_compat(&self) -> std::os::fd::RawFd;
}
impl RawCompat for std::os::fd::BorrowedFd<'_> {
    fn as_raw_fd_compat(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.as_raw_fd()
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

/// `pod` and `peer` joined by a veth pair, IPv4 and IPv6 addresses up.
fn pair() -> (Ns, Ns) {
    let (pod, peer) = (Ns::new("pod"), Ns::new("peer"));
    sh(&[
        "ip", "-n", &pod.0, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns",
        &peer.0,
    ]);
    for (ns, addrs) in [
        (&pod, ["10.77.0.2/24", "fd77::2/64"]),
        (&peer, ["10.77.0.1/24", "fd77::1/64"]),
    ] {
        for a in addrs {
            sh(&["ip", "-n", &ns.0, "addr", "add", a, "dev", "eth0", "nodad"]);
        }
        sh(&["ip", "-n", &ns.0, "link", "set", "eth0", "up"]);
    }
    for a in ["10.77.0.3/24", "fd77::3/64"] {
        sh(&[
            "ip", "-n", &peer.0, "addr", "add", a, "dev", "eth0", "nodad",
        ]);
    }
    (pod, peer)
}

fn spec(mode: Mode) -> CaptureSpec {
    CaptureSpec {
        outbound_port: 15001,
        inbound: vec![(8080, 15006)],
        envoy_mark: MARK,
        exclude_outbound_ports: vec![8443],
        exclude_outbound_cidrs: vec!["10.77.0.3".parse().unwrap(), "fd77::3".parse().unwrap()],
        exclude_inbound_ports: vec![],
        probe_sources: vec!["10.77.0.3".parse().unwrap(), "fd77::3".parse().unwrap()],
        mode,
        original_src: None,
    }
}

/// [`spec`] with the original-source route for a pod of `v6`'s family.
fn spec_original_src(mode: Mode, v6: bool) -> CaptureSpec {
    CaptureSpec {
        original_src: Some(OriginalSrc { ipv6: v6 }),
        ..spec(mode)
    }
}

/// Waits for `l` to accept a connection; its peer address.
fn accepted(l: &TcpListener) -> (TcpStream, SocketAddr) {
    let start = Instant::now();
    loop {
        match l.accept() {
            Ok(c) => return c,
            Err(e) if e.kind() == ErrorKind::WouldBlock && start.elapsed() < DEADLINE => {
                std::thread::sleep(Duration::from_millis(5))
            }
            Err(e) => panic!("no connection on {:?}: {e}", l.local_addr()),
        }
    }
}

fn nothing_queued(l: &TcpListener) {
    match l.accept() {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("unexpected connection on {:?}: {other:?}", l.local_addr()),
    }
}

/// The connection from `client` arrived on `on` (and so on no other listener).
fn lands_on(client: &TcpStream, on: &TcpListener, not: &[&TcpListener]) {
    let (_, from) = accepted(on);
    let local = client.local_addr().unwrap();
    assert_eq!(
        from.port(),
        local.port(),
        "accepted someone else's connection"
    );
    for l in not {
        nothing_queued(l);
    }
}

#[test]
fn apply_installs_one_table_idempotently() {
    let (pod, _peer) = pair();
    let nft = Nft::new();
    nft.apply(&pod.path(), &spec(Mode::Strict)).unwrap();
    let first = pod.nft(&["list", "ruleset"]);
    eprintln!("{first}");
    assert_eq!(first.matches("table ").count(), 1, "{first}");
    assert!(first.contains("table inet flock_capture"), "{first}");
    nft.apply(&pod.path(), &spec(Mode::Strict)).unwrap();
    assert_eq!(
        pod.nft(&["list", "ruleset"]),
        first,
        "a second apply changed the ruleset"
    );
    nft.check(&pod.path(), &spec(Mode::Strict)).unwrap();
    // Switching mode converges too (the filter chain goes).
    nft.apply(&pod.path(), &spec(Mode::Permissive)).unwrap();
    nft.check(&pod.path(), &spec(Mode::Permissive)).unwrap();
    assert!(!pod.nft(&["list", "ruleset"]).contains("input_filter"));
    nft.remove(&pod.path()).unwrap();
    assert_eq!(pod.nft(&["list", "ruleset"]), "");
    nft.remove(&pod.path()).unwrap();
}

/// With the original-source route: apply installs one rule and one route of table
/// 1338 for the pod's family (no second copy on a second apply), check names a
/// missing or changed rule and a missing route, apply repairs them, and remove takes
/// them away with the table.
#[test]
fn the_original_source_route_is_installed_once_checked_repaired_and_removed() {
    let (pod, _peer) = pair();
    let nft = Nft::new();
    let ip = |args: &[&str]| {
        let mut all = vec!["ip", "-n", &pod.0];
        all.extend_from_slice(args);
        sh(&all)
    };
    for v6 in [false, true] {
        let fam = if v6 { "-6" } else { "-4" };
        let spec = spec_original_src(Mode::Strict, v6);
        nft.apply(&pod.path(), &spec).unwrap();
        nft.apply(&pod.path(), &spec).unwrap();
        let rules = ip(&[fam, "rule", "show", "pref", "1338"]);
        assert_eq!(rules.lines().count(), 1, "{rules}");
        assert!(rules.contains("fwmark 0x53a lookup 1338"), "{rules}");
        let routes = ip(&[fam, "route", "show", "table", "1338"]);
        assert!(routes.starts_with("local default dev lo"), "{routes}");
        nft.check(&pod.path(), &spec).unwrap();

        ip(&[fam, "rule", "del", "pref", "1338"]);
        let e = nft.check(&pod.path(), &spec).unwrap_err();
        assert!(
            matches!(e, CaptureError::RouteDrifted { .. })
                && e.to_string().contains("fwmark 0x53a"),
            "{e}"
        );
        ip(&[
            fam, "rule", "add", "fwmark", "0x99", "lookup", "1338", "pref", "1338",
        ]);
        let e = nft.check(&pod.path(), &spec).unwrap_err();
        assert!(e.to_string().contains("0x99"), "{e}");
        nft.apply(&pod.path(), &spec).unwrap();
        nft.check(&pod.path(), &spec).unwrap();
        ip(&[fam, "route", "flush", "table", "1338"]);
        let e = nft.check(&pod.path(), &spec).unwrap_err();
        assert!(e.to_string().contains("local default dev lo"), "{e}");
        nft.apply(&pod.path(), &spec).unwrap();
        nft.check(&pod.path(), &spec).unwrap();

        nft.remove(&pod.path()).unwrap();
        assert_eq!(ip(&[fam, "rule", "show", "pref", "1338"]), "");
        assert_eq!(pod.nft(&["list", "ruleset"]), "");
        nft.remove(&pod.path()).unwrap();
    }
}

/// The policy route goes in over rtnetlink, not by `ip`: what the kernel then holds,
/// as `ip -j` lists it, is exactly what iproute2's own commands install (the
/// oracle, run in a second netns), for both families.
#[test]
fn the_policy_route_over_rtnetlink_equals_what_ip_installs() {
    let (pod, oracle) = pair();
    let nft = Nft::new();
    let ip = |ns: &Ns, args: &[&str]| {
        let mut all = vec!["ip", "-j", "-n", &ns.0];
        all.extend_from_slice(args);
        sh(&all)
    };
    for v6 in [false, true] {
        let fam = if v6 { "-6" } else { "-4" };
        nft.apply(&pod.path(), &spec_original_src(Mode::Strict, v6))
            .unwrap();
        let mut all = vec!["ip", "-n", &oracle.0, fam];
        all.extend([
            "rule", "add", "fwmark", "0x53a", "lookup", "1338", "pref", "1338",
        ]);
        sh(&all);
        let mut all = vec!["ip", "-n", &oracle.0, fam];
        all.extend([
            "route", "replace", "local", "default", "dev", "lo", "table", "1338",
        ]);
        sh(&all);
        for what in [
            &[fam, "rule", "show", "pref", "1338"][..],
            &[fam, "route", "show", "table", "1338"][..],
        ] {
            let got = ip(&pod, what);
            assert_eq!(got, ip(&oracle, what), "{what:?}");
            assert!(got.len() > 2, "{what:?} lists nothing: {got}");
        }
    }
}

/// What the route is for: a connection made inside the pod from the caller's address
/// (`IP_TRANSPARENT`, marked [`ORIGINAL_SRC_MARK`], as Envoy's `original_src` makes
/// it) to the app on the pod's address. The app sees the caller's address, and its
/// reply, addressed to the caller, comes back to that socket instead of leaving
/// through the pod's interface: without the route it leaves, and the connection never
/// completes.
fn original_source(v6: bool) {
    let (pod, _peer) = pair();
    let (caller, app_addr, listen) = if v6 {
        ("[fd77::1]:0", "[fd77::2]:8080", "[fd77::2]:8080")
    } else {
        ("10.77.0.1:0", "10.77.0.2:8080", "10.77.0.2:8080")
    };
    let app = pod.listen(listen);
    let connect_transparent = |pod: &Ns| {
        let src: SocketAddr = caller.parse().unwrap();
        let dst: SocketAddr = app_addr.parse().unwrap();
        pod.run(move || {
            let fd = bound_socket_with(Some(src), dst, Some(ORIGINAL_SRC_MARK), true);
            let sock = TcpStream::from(fd);
            // connect(2) through std for its timeout: a SYN-ACK that leaves the pod
            // never comes back.
            let raw = socket2_connect(&sock, dst);
            (sock, raw)
        })
    };
    // Without the route (capture rules alone): the reply leaves, no connection.
    Nft::new().apply(&pod.path(), &spec(Mode::Strict)).unwrap();
    let (first, connected) = connect_transparent(&pod);
    assert!(
        connected.is_err(),
        "without the policy route the app's reply still reached the caller's socket"
    );
    // That half-open attempt is closed: left open, the app's retransmitted SYN-ACK
    // would complete it once the route is in, and the app could accept it first.
    drop(first);
    // With it: the app sees the caller's own address and the connection works.
    Nft::new()
        .apply(&pod.path(), &spec_original_src(Mode::Strict, v6))
        .unwrap();
    let (mut sock, connected) = connect_transparent(&pod);
    connected.expect("the app's reply came back to the transparent socket");
    // The app's side of this very connection (a leftover of the first attempt that
    // got through is skipped).
    let mine = sock.local_addr().unwrap();
    let (mut server, peer) = loop {
        let (server, peer) = accepted(&app);
        if peer == mine {
            break (server, peer);
        }
    };
    assert_eq!(peer.ip(), caller.parse::<SocketAddr>().unwrap().ip());
    server.write_all(b"reply").unwrap();
    let mut buf = [0u8; 5];
    sock.set_read_timeout(Some(DEADLINE)).unwrap();
    sock.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"reply");
}

/// `connect(2)` on `sock` to `dst`, non-blocking, waiting at most two seconds for it
/// to complete.
fn socket2_connect(sock: &TcpStream, dst: SocketAddr) -> std::io::Result<()> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    use std::os::fd::AsRawFd;
    sock.set_nonblocking(true)?;
    match socket::connect(sock.as_raw_fd(), &SockaddrStorage::from(dst)) {
        Ok(()) => {}
        Err(nix::errno::Errno::EINPROGRESS) => {
            let mut fds = [PollFd::new(sock.as_fd(), PollFlags::POLLOUT)];
            let n = poll(&mut fds, PollTimeout::from(2000u16)).map_err(std::io::Error::from)?;
            if n == 0 {
                return Err(std::io::Error::new(ErrorKind::TimedOut, "no SYN-ACK"));
            }
            let err =
                socket::getsockopt(sock, sockopt::SocketError).map_err(std::io::Error::from)?;
            if err != 0 {
                return Err(std::io::Error::from_raw_os_error(err));
            }
        }
        Err(e) => return Err(e.into()),
    }
    sock.set_nonblocking(false)
}

#[test]
fn the_app_sees_the_callers_address_and_its_reply_returns_to_envoy_ipv4() {
    original_source(false);
}

#[test]
fn the_app_sees_the_callers_address_and_its_reply_returns_to_envoy_ipv6() {
    original_source(true);
}

#[test]
fn check_names_a_missing_table_and_a_drifted_rule_and_apply_repairs() {
    let (pod, _peer) = pair();
    let nft = Nft::new();
    let s = spec(Mode::Strict);
    let e = nft.check(&pod.path(), &s).unwrap_err();
    assert!(matches!(e, CaptureError::TableMissing(_)), "{e}");
    assert!(
        e.to_string().contains("inet flock_capture is missing"),
        "{e}"
    );

    nft.apply(&pod.path(), &s).unwrap();
    // Someone deletes the inbound redirect.
    let listing = pod.nft(&[
        "-a",
        "list",
        "chain",
        "inet",
        "flock_capture",
        "prerouting_nat",
    ]);
    let line = listing
        .lines()
        .find(|l| l.contains("redirect to :15006"))
        .expect(&listing);
    let handle = line.rsplit(' ').next().unwrap();
    pod.nft(&[
        "delete",
        "rule",
        "inet",
        "flock_capture",
        "prerouting_nat",
        "handle",
        handle,
    ]);
    match nft.check(&pod.path(), &s).unwrap_err() {
        CaptureError::Drifted {
            drift: Drift::MissingRule {
                chain, expected, ..
            },
            ..
        } => {
            assert_eq!(chain, "prerouting_nat");
            assert_eq!(expected, "tcp dport 8080 redirect to :15006");
        }
        e => panic!("{e}"),
    }
    nft.apply(&pod.path(), &s).unwrap();
    nft.check(&pod.path(), &s).unwrap();

    pod.nft(&["delete", "table", "inet", "flock_capture"]);
    assert!(matches!(
        nft.check(&pod.path(), &s),
        Err(CaptureError::TableMissing(_))
    ));
    nft.apply(&pod.path(), &s).unwrap();
    nft.check(&pod.path(), &s).unwrap();
}

#[test]
fn a_missing_netns_and_probe() {
    let e = Nft::new()
        .apply(
            &PathBuf::from("/var/run/netns/flockcap-none"),
            &spec(Mode::Strict),
        )
        .unwrap_err();
    assert!(matches!(e, CaptureError::Netns { .. }), "{e}");
    // A path that exists but is no network namespace: refused when entering it,
    // before any nft runs.
    let not_a_netns = std::env::temp_dir().join(format!("flockcap-file-{}", std::process::id()));
    std::fs::write(&not_a_netns, b"").unwrap();
    let e = Nft::new()
        .apply(&not_a_netns, &spec(Mode::Strict))
        .unwrap_err();
    let _ = std::fs::remove_file(&not_a_netns);
    assert!(
        matches!(&e, CaptureError::Netns { detail, .. } if detail.contains("cannot enter")),
        "{e}"
    );
    Nft::new().probe().unwrap();
}

/// A new pod's table is created by one transaction without a deletion; over an
/// existing table (drifted: a rule of someone else's added, one of ours deleted) the
/// apply falls back to replacing it whole. Both end with exactly the table.
#[test]
fn apply_creates_a_new_table_and_replaces_an_existing_one() {
    let (pod, _peer) = pair();
    let s = spec(Mode::Strict);
    let nft = Nft::new();
    nft.apply(&pod.path(), &s).unwrap();
    nft.check(&pod.path(), &s).unwrap();
    pod.nft(&["add", "chain", "inet", "flock_capture", "stray"]);
    assert!(nft.check(&pod.path(), &s).is_err());
    nft.apply(&pod.path(), &s).unwrap();
    nft.check(&pod.path(), &s).unwrap();
    nft.remove(&pod.path()).unwrap();
    nft.apply(&pod.path(), &s).unwrap();
    nft.check(&pod.path(), &s).unwrap();
}

/// nft runs in the pod's netns from a thread of its own: the caller's thread (in an
/// agent, a runtime's worker) stays in its own netns, and the table is in the pod's,
/// not in the caller's.
#[test]
fn applying_leaves_the_callers_thread_in_its_own_netns() {
    let (pod, _peer) = pair();
    let own = || std::fs::read_link("/proc/thread-self/ns/net").unwrap();
    let before = own();
    let s = spec(Mode::Strict);
    Nft::new().apply(&pod.path(), &s).unwrap();
    assert_eq!(own(), before);
    Nft::new().check(&pod.path(), &s).unwrap();
    assert_eq!(own(), before);
    let here = std::process::Command::new("nft")
        .args(["list", "table", "inet", "flock_capture"])
        .output()
        .unwrap();
    assert!(
        !here.status.success(),
        "the table is not in the caller's netns"
    );
}

fn outbound(v6: bool) {
    let (pod, peer) = pair();
    let (p1, p3) = if v6 {
        ("[fd77::1]", "[fd77::3]")
    } else {
        ("10.77.0.1", "10.77.0.3")
    };
    Nft::new().apply(&pod.path(), &spec(Mode::Strict)).unwrap();
    let envoy = pod.listen("[::]:15001");
    let remote = peer.listen(&format!("{p1}:80"));
    let remote_tls = peer.listen(&format!("{p1}:8443"));
    let remote3 = peer.listen(&format!("{p3}:80"));

    // The app's connection to a peer lands on Envoy's outbound port.
    let c = pod.connect(None, &format!("{p1}:80"), None);
    lands_on(&c, &envoy, &[&remote]);
    // Envoy's own marked socket reaches the peer.
    let c = pod.connect(None, &format!("{p1}:80"), Some(MARK));
    lands_on(&c, &remote, &[&envoy]);
    // An excluded port and an excluded address reach the peer.
    let c = pod.connect(None, &format!("{p1}:8443"), None);
    lands_on(&c, &remote_tls, &[&envoy]);
    let c = pod.connect(None, &format!("{p3}:80"), None);
    lands_on(&c, &remote3, &[&envoy]);
}

#[test]
fn outbound_tcp_is_redirected_marked_and_excluded_pass_ipv4() {
    outbound(false);
}

#[test]
fn outbound_tcp_is_redirected_marked_and_excluded_pass_ipv6() {
    outbound(true);
}

fn inbound(v6: bool) {
    let (pod, peer) = pair();
    let (p1, p3, me) = if v6 {
        ("[fd77::1]", "[fd77::3]", "[fd77::2]")
    } else {
        ("10.77.0.1", "10.77.0.3", "10.77.0.2")
    };
    Nft::new().apply(&pod.path(), &spec(Mode::Strict)).unwrap();
    let app = pod.listen("[::]:8080");
    let envoy_in = pod.listen("[::]:15006");
    // A caller's connection to the app port lands on Envoy's inbound listener.
    let c = peer.connect(Some(&format!("{p1}:0")), &format!("{me}:8080"), None);
    lands_on(&c, &envoy_in, &[&app]);
    // A probe source (kubelet) reaches the app itself.
    let c = peer.connect(Some(&format!("{p3}:0")), &format!("{me}:8080"), None);
    lands_on(&c, &app, &[&envoy_in]);
    // Envoy reaches the app over loopback.
    let lo = if v6 { "[::1]:8080" } else { "127.0.0.1:8080" };
    let c = pod.connect(None, lo, None);
    lands_on(&c, &app, &[&envoy_in]);
}

#[test]
fn inbound_is_redirected_and_probe_sources_reach_the_app_ipv4() {
    inbound(false);
}

#[test]
fn inbound_is_redirected_and_probe_sources_reach_the_app_ipv6() {
    inbound(true);
}

/// Packets the strict drop rule has counted.
fn dropped(pod: &Ns) -> u64 {
    let listing: serde_json::Value = serde_json::from_str(&pod.nft(&[
        "-j",
        "list",
        "chain",
        "inet",
        "flock_capture",
        "input_filter",
    ]))
    .unwrap();
    listing["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|i| {
            i.get("rule")?
                .get("expr")?
                .as_array()?
                .iter()
                .find_map(|s| s.get("counter")?.get("packets")?.as_u64())
        })
        .sum()
}

/// A plaintext connection opened while the app port was not captured (the rules were
/// there without it, so conntrack tracked the connection and recorded "no
/// translation"; nat sees only a connection's first packet, so capturing the port
/// later never redirects it).
///
/// Without conntrack running in the netns at all, a connection opened before the
/// rules is picked up mid-stream as a new one and redirected to Envoy, which resets
/// it: that path does not reach the app either, but is not what these tests are about.
fn preexisting(pod: &Ns, peer: &Ns, mode: Mode) -> (TcpStream, TcpStream) {
    let uncaptured = CaptureSpec {
        exclude_inbound_ports: vec![8080],
        ..spec(mode)
    };
    Nft::new().apply(&pod.path(), &uncaptured).unwrap();
    let app = pod.listen("[::]:8080");
    let client = peer.connect(Some("10.77.0.1:0"), "10.77.0.2:8080", None);
    let (server, _) = accepted(&app);
    Nft::new().apply(&pod.path(), &spec(mode)).unwrap();
    (client, server)
}

#[test]
fn strict_drops_plaintext_that_escaped_the_redirect() {
    let (pod, peer) = pair();
    let (mut client, mut server) = preexisting(&pod, &peer, Mode::Strict);
    let before = dropped(&pod);
    client.write_all(b"plaintext").unwrap();
    let start = Instant::now();
    while dropped(&pod) == before {
        assert!(
            start.elapsed() < DEADLINE,
            "the strict rule never counted the packet"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    // The counted packet was dropped before the socket: nothing to read.
    server.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 16];
    match server.read(&mut buf) {
        Err(e) if e.kind() == ErrorKind::WouldBlock => {}
        other => panic!("the app read plaintext around Envoy: {other:?}"),
    }
}

#[test]
fn permissive_lets_plaintext_that_escaped_the_redirect_reach_the_app() {
    let (pod, peer) = pair();
    let (mut client, mut server) = preexisting(&pod, &peer, Mode::Permissive);
    client.write_all(b"plaintext").unwrap();
    server.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut buf = [0u8; 9];
    server.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"plaintext");
}

/// Waits until the strict drop rule has counted more than `before` packets.
fn wait_dropped(pod: &Ns, before: u64, what: &str) {
    let start = Instant::now();
    while dropped(pod) <= before {
        assert!(
            start.elapsed() < DEADLINE,
            "the strict rule never dropped {what}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Strict capture is default deny: a port the pod never declared (a debug or JMX port
/// its app opens on all addresses) and Envoy's outbound listener, which would proxy a
/// caller's connection out with the pod's identity, are unreachable from outside; the
/// declared port still lands on Envoy and the pod's own outbound connections still get
/// their replies.
#[test]
fn strict_denies_every_undeclared_inbound_port_and_envoys_outbound_listener() {
    let (pod, peer) = pair();
    Nft::new().apply(&pod.path(), &spec(Mode::Strict)).unwrap();
    let debug = pod.listen("[::]:9090");
    let envoy_out = pod.listen("[::]:15001");
    let envoy_in = pod.listen("[::]:15006");
    for (p1, me) in [("10.77.0.1", "10.77.0.2"), ("[fd77::1]", "[fd77::2]")] {
        for (port, listener) in [(9090, &debug), (15001, &envoy_out)] {
            let before = dropped(&pod);
            peer.connect_detached(&format!("{p1}:0"), &format!("{me}:{port}"));
            wait_dropped(&pod, before, &format!("a SYN to undeclared port {port}"));
            assert!(
                matches!(listener.accept(), Err(e) if e.kind() == ErrorKind::WouldBlock),
                "a caller reached port {port} of a strict pod around Envoy"
            );
        }
        // The declared port is captured, not denied.
        let c = peer.connect(Some(&format!("{p1}:0")), &format!("{me}:8080"), None);
        lands_on(&c, &envoy_in, &[&debug]);
    }
    // Replies to the pod's own (marked, Envoy's) connection pass the filter.
    let remote = peer.listen("10.77.0.1:80");
    let mut c = pod.connect(None, "10.77.0.1:80", Some(MARK));
    let (mut server, _) = accepted(&remote);
    server.write_all(b"reply").unwrap();
    c.set_read_timeout(Some(DEADLINE)).unwrap();
    let mut buf = [0u8; 5];
    c.read_exact(&mut buf).unwrap();
    assert_eq!(&buf, b"reply");
}

/// Permissive capture leaves a port the pod never declared open: what strict closes.
#[test]
fn permissive_leaves_undeclared_ports_reachable() {
    let (pod, peer) = pair();
    Nft::new()
        .apply(&pod.path(), &spec(Mode::Permissive))
        .unwrap();
    let debug = pod.listen("[::]:9090");
    let c = peer.connect(Some("10.77.0.1:0"), "10.77.0.2:9090", None);
    lands_on(&c, &debug, &[]);
}
