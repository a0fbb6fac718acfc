//! The etcd registry backend against a REAL etcd (Debian `etcd-server`, binary from
//! `FLOCK_ETCD_BIN`, installed by scripts/prereqs/40-etcd.sh). Each test starts its own
//! single-member etcd in a temp data dir, on a client port reserved for it
//! (`flock_testkit::reserve_port_for_child`: restarts bind it again); a guard kills it on
//! drop, also when the test fails.
//!
//! Two `EtcdRegistry` instances play two nodes. Waits are on the view channel with a
//! timeout; the two fixed sleeps are the test's subject (a lease kept alive across
//! several TTLs), not a wait.

#[path = "common/endpoint.rs"]
mod endpoint;

use endpoint::web as ep;
use flock_bird::model::{Endpoint, Health};
use flock_bird::registry::etcd::EtcdRegistry;
use flock_bird::registry::{Registry, RegistryOptions, View};
use flock_testkit::{ChildPort, eventually, reserve_port_for_child};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

const TTL: i64 = 2;

/// One etcd process; killed (SIGKILL) and reaped on drop.
struct Etcd {
    bin: PathBuf,
    dir: tempfile::TempDir,
    /// Reserved for as long as this etcd (and each restart of it, on the same port)
    /// may bind it.
    client_port: ChildPort,
    child: Option<Child>,
    /// More etcd flags.
    extra: Vec<String>,
}

impl Etcd {
    fn start() -> Self {
        Self::start_with(&[])
    }

    fn start_with(extra: &[&str]) -> Self {
        let bin = std::env::var_os("FLOCK_ETCD_BIN")
            .map(PathBuf::from)
            .or_else(|| {
                let p = PathBuf::from("/usr/bin/etcd");
                p.exists().then_some(p)
            })
            .expect("etcd not found: run scripts/prereqs/40-etcd.sh or set FLOCK_ETCD_BIN");
        let mut etcd = Etcd {
            bin,
            dir: tempfile::tempdir().unwrap(),
            client_port: reserve_port_for_child(),
            child: None,
            extra: extra.iter().map(|s| s.to_string()).collect(),
        };
        etcd.spawn();
        etcd
    }

    fn spawn(&mut self) {
        let client = format!("http://127.0.0.1:{}", self.client_port);
        // One member: nobody dials its peer URL, so port 0 (the kernel's pick) will do.
        let peer = "http://127.0.0.1:0";
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.path().join("etcd.log"))
            .unwrap();
        let child = Command::new(&self.bin)
            .args(["--name", "t1", "--data-dir"])
            .arg(self.dir.path().join("data"))
            .args([
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
            ])
            .args([
                "--listen-peer-urls",
                peer,
                "--initial-advertise-peer-urls",
                peer,
            ])
            .args(["--initial-cluster", &format!("t1={peer}")])
            // A fast election makes the single member leader quickly after a restart.
            .args(["--heartbeat-interval", "50", "--election-timeout", "250"])
            .args(&self.extra)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting etcd");
        self.child = Some(child);
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
    }

    fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// A plain etcd client (the "operator"), once etcd answers.
    async fn client(&self) -> etcd_client::Client {
        eventually("etcd to answer", Duration::from_secs(15), async || {
            let attempt = async {
                let mut c =
                    etcd_client::Client::connect([format!("http://{}", self.endpoint())], None)
                        .await?;
                c.status().await?;
                Ok::<_, etcd_client::Error>(c)
            };
            match tokio::time::timeout(Duration::from_secs(2), attempt).await {
                Ok(Ok(c)) => Ok(c),
                Ok(Err(e)) => Err(format!("{e}; log: {}", self.log())),
                Err(_) => Err(format!("no answer in 2 s; log: {}", self.log())),
            }
        })
        .await
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        self.kill9();
    }
}

fn opts(node: &str) -> RegistryOptions {
    RegistryOptions {
        prefix: "/flock-test/endpoints/".into(),
        lease_ttl_secs: TTL,
        node: node.into(),
        reconnect_initial: Duration::from_millis(100),
        reconnect_max: Duration::from_millis(500),
        op_timeout: Duration::from_secs(2),
        ..RegistryOptions::default()
    }
}

async fn node(etcd: &Etcd, name: &str) -> Arc<EtcdRegistry> {
    Arc::new(
        EtcdRegistry::connect(&[etcd.endpoint()], opts(name))
            .await
            .unwrap(),
    )
}

/// Waits until `cond` holds for `reg`'s view; returns the view and how long it took.
async fn wait_view(
    reg: &dyn Registry,
    what: &str,
    within: Duration,
    cond: impl Fn(&View) -> bool,
) -> (Arc<View>, Duration) {
    let start = Instant::now();
    let mut rx = reg.view();
    let res = tokio::time::timeout(within, async {
        loop {
            let v = rx.borrow_and_update().clone();
            if cond(&v) {
                return v;
            }
            rx.changed().await.expect("view sender dropped");
        }
    })
    .await;
    match res {
        Ok(v) => (v, start.elapsed()),
        Err(_) => panic!(
            "{}: timed out after {within:?} waiting for {what}; view: {:?}",
            reg.describe(),
            reg.view().borrow()
        ),
    }
}

/// Retries `put` until it succeeds (after a restart the registry is reconnecting).
async fn put_retry(reg: &dyn Registry, e: &Endpoint) -> u64 {
    eventually("a put to succeed", Duration::from_secs(15), async || {
        reg.put(e).await.map_err(|err| err.to_string())
    })
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_nodes_see_each_other_and_deletes_propagate() {
    let etcd = Etcd::start();
    etcd.client().await;
    let (a, b) = (node(&etcd, "a").await, node(&etcd, "b").await);
    assert_eq!(a.describe(), format!("etcd://{}", etcd.endpoint()));
    for r in [&a, &b] {
        let v = r.view().borrow().clone();
        assert!(v.synced && v.generation == 1, "{v:?}");
    }
    let (ea, eb) = (ep("a", "pa"), ep("b", "pb"));
    a.put(&ea).await.unwrap();
    // Own writes are in the own view when put returns.
    assert!(a.view().borrow().endpoints.contains_key(&ea.key()));
    b.put(&eb).await.unwrap();
    let within = Duration::from_secs(5);
    wait_view(b.as_ref(), "a's endpoint", within, |v| {
        v.endpoints.get(&ea.key()).map(|e| &**e) == Some(&ea)
    })
    .await;
    wait_view(a.as_ref(), "b's endpoint", within, |v| {
        v.endpoints.get(&eb.key()).map(|e| &**e) == Some(&eb)
    })
    .await;

    // An update propagates.
    let mut ea2 = ea.clone();
    ea2.health = Health::Unhealthy;
    a.put(&ea2).await.unwrap();
    wait_view(b.as_ref(), "a's update", within, |v| {
        v.endpoints.get(&ea.key()).map(|e| &**e) == Some(&ea2)
    })
    .await;

    // Delete propagates.
    assert!(a.delete(&ea.key()).await.unwrap());
    assert!(!a.view().borrow().endpoints.contains_key(&ea.key()));
    assert!(!a.delete(&ea.key()).await.unwrap());
    wait_view(b.as_ref(), "a's endpoint gone", within, |v| {
        !v.endpoints.contains_key(&ea.key())
    })
    .await;
    // A new instance lists what is there.
    let c = node(&etcd, "c").await;
    let v = c.view().borrow().clone();
    assert_eq!(
        v.endpoints.keys().cloned().collect::<Vec<_>>(),
        vec![eb.key()]
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_if_revision_only_deletes_that_revision() {
    let etcd = Etcd::start();
    etcd.client().await;
    let (a, b) = (node(&etcd, "a").await, node(&etcd, "b").await);
    let e = ep("a", "pa");
    let r1 = a.put(&e).await.unwrap();
    let mut e2 = e.clone();
    e2.zone = "z2".into();
    let r2 = a.put(&e2).await.unwrap();
    assert!(r2 > r1);
    // The undo of the first registration does not delete the newer one.
    assert!(!a.delete_if_revision(&e.key(), r1).await.unwrap());
    assert_eq!(
        a.view().borrow().endpoints.get(&e.key()).map(|e| &**e),
        Some(&e2)
    );
    wait_view(
        b.as_ref(),
        "the newer registration",
        Duration::from_secs(5),
        |v| v.endpoints.get(&e.key()).map(|e| &**e) == Some(&e2),
    )
    .await;
    assert!(a.delete_if_revision(&e.key(), r2).await.unwrap());
    assert!(!a.view().borrow().endpoints.contains_key(&e.key()));
    assert!(!a.delete_if_revision(&e.key(), r2).await.unwrap());
    wait_view(
        b.as_ref(),
        "the conditional delete",
        Duration::from_secs(5),
        |v| !v.endpoints.contains_key(&e.key()),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_agents_endpoints_expire_after_the_lease_ttl() {
    let etcd = Etcd::start();
    etcd.client().await;
    let (a, b) = (node(&etcd, "a").await, node(&etcd, "b").await);
    let (ea, eb) = (ep("a", "pa"), ep("b", "pb"));
    a.put(&ea).await.unwrap();
    b.put(&eb).await.unwrap();
    wait_view(b.as_ref(), "a's endpoint", Duration::from_secs(5), |v| {
        v.endpoints.contains_key(&ea.key())
    })
    .await;
    // Keep-alives continue across several TTLs while a lives.
    tokio::time::sleep(Duration::from_secs(TTL as u64 + 1)).await;
    assert!(
        b.view().borrow().endpoints.contains_key(&ea.key()),
        "a's endpoint expired while a was alive"
    );

    // "SIGKILL" a: no more keep-alives, no revoke.
    a.shutdown_without_revoke();
    assert!(!a.view().borrow().synced);
    assert!(
        a.put(&ep("a", "late")).await.is_err(),
        "put on a stopped instance fails"
    );
    let (v, took) = wait_view(
        b.as_ref(),
        "a's endpoint to expire",
        Duration::from_secs(TTL as u64 + 5),
        |v| !v.endpoints.contains_key(&ea.key()),
    )
    .await;
    eprintln!(
        "lease expiry: a's endpoint vanished from b's view {took:?} after a stopped (TTL {TTL} s)"
    );
    assert!(
        took <= Duration::from_millis(TTL as u64 * 1000 + 1500),
        "expired too late: {took:?}"
    );
    assert!(
        took >= Duration::from_millis(TTL as u64 * 1000 / 2),
        "expired too early: {took:?}"
    );
    // b's own endpoint is untouched.
    assert!(v.endpoints.contains_key(&eb.key()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconnects_and_resyncs_after_etcd_restart() {
    let mut etcd = Etcd::start();
    etcd.client().await;
    // a reconnects slowly (1.5-3 s after a failure), so b's put below most likely lands
    // while a is still disconnected and reaches a through the resumed watch's replay.
    let slow = RegistryOptions {
        reconnect_initial: Duration::from_secs(3),
        reconnect_max: Duration::from_secs(3),
        ..opts("a")
    };
    let a = Arc::new(
        EtcdRegistry::connect(&[etcd.endpoint()], slow)
            .await
            .unwrap(),
    );
    let b = node(&etcd, "b").await;
    let ea = ep("a", "pa");
    a.put(&ea).await.unwrap();
    wait_view(b.as_ref(), "a's endpoint", Duration::from_secs(5), |v| {
        v.endpoints.contains_key(&ea.key())
    })
    .await;
    let gen_before = a.view().borrow().generation;

    etcd.kill9();
    wait_view(a.as_ref(), "a unsynced", Duration::from_secs(10), |v| {
        !v.synced
    })
    .await;
    assert!(
        a.put(&ep("a", "while-down")).await.is_err(),
        "put while disconnected fails"
    );
    etcd.spawn();
    // b puts as soon as it can; a may or may not have reconnected by then: either the
    // resumed watch replays the put or the live watch delivers it.
    let eb = ep("b", "pb");
    put_retry(b.as_ref(), &eb).await;
    let a_was_synced = a.view().borrow().synced;
    let (v, took) = wait_view(
        a.as_ref(),
        "a resynced with b's put",
        Duration::from_secs(15),
        |v| v.synced && v.generation > gen_before && v.endpoints.contains_key(&eb.key()),
    )
    .await;
    eprintln!(
        "etcd restart: a resynced (generation {gen_before} -> {}) {took:?} after b's put; a was {} when b put",
        v.generation,
        if a_was_synced {
            "already reconnected"
        } else {
            "still disconnected"
        }
    );
    // a's own endpoint survived the restart (the lease is persisted by etcd).
    assert!(v.endpoints.contains_key(&ea.key()));
    // And a works again.
    let ea2 = ep("a", "pa2");
    put_retry(a.as_ref(), &ea2).await;
    wait_view(
        b.as_ref(),
        "a's new endpoint",
        Duration::from_secs(5),
        |v| v.endpoints.contains_key(&ea2.key()),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lease_is_replaced_and_own_endpoints_reput() {
    let etcd = Etcd::start();
    let mut operator = etcd.client().await;
    let (a, b) = (node(&etcd, "a").await, node(&etcd, "b").await);
    let (e1, e2, gone) = (ep("a", "p1"), ep("a", "p2"), ep("a", "deleted"));
    for e in [&e1, &e2, &gone] {
        a.put(e).await.unwrap();
    }
    a.delete(&gone.key()).await.unwrap();
    wait_view(b.as_ref(), "a's endpoints", Duration::from_secs(5), |v| {
        v.endpoints.contains_key(&e1.key()) && v.endpoints.contains_key(&e2.key())
    })
    .await;
    let old = a.lease_id().await.unwrap();
    let gen_before = a.view().borrow().generation;

    // The operator revokes a's lease: etcd deletes a's keys at once.
    let start = Instant::now();
    operator.lease_revoke(old).await.unwrap();
    wait_view(
        b.as_ref(),
        "a's endpoints deleted by the revoke",
        Duration::from_secs(5),
        |v| !v.endpoints.contains_key(&e1.key()),
    )
    .await;
    // a notices on its next keep-alive (TTL/3), grants a new lease and re-puts.
    let (v, _) = wait_view(
        b.as_ref(),
        "a's endpoints re-put",
        Duration::from_secs(10),
        |v| v.endpoints.contains_key(&e1.key()) && v.endpoints.contains_key(&e2.key()),
    )
    .await;
    eprintln!(
        "lease loss: a's endpoints back in b's view {:?} after the revoke",
        start.elapsed()
    );
    assert!(
        !v.endpoints.contains_key(&gone.key()),
        "a deleted endpoint must not be re-put"
    );
    let new = a.lease_id().await.unwrap();
    assert_ne!(new, old);
    assert_on_lease(&mut operator, [&e1, &e2], new).await;
    // Replacing the lease did not need a reconnect.
    assert_eq!(a.view().borrow().generation, gen_before);
    // And the new lease is kept alive.
    tokio::time::sleep(Duration::from_secs(TTL as u64 + 1)).await;
    assert!(b.view().borrow().endpoints.contains_key(&e1.key()));
}

/// The re-put after a lease loss goes in transactions (one disk sync for many puts);
/// an etcd whose `--max-txn-ops` is below the agent's batch refuses them, and every
/// endpoint is re-put one at a time instead: none is left out.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_is_reput_whole_by_an_etcd_refusing_large_transactions() {
    let etcd = Etcd::start_with(&["--max-txn-ops", "2"]);
    let mut operator = etcd.client().await;
    let (a, b) = (node(&etcd, "a").await, node(&etcd, "b").await);
    let eps: Vec<Endpoint> = (0..5).map(|i| ep("a", &format!("p{i}"))).collect();
    for e in &eps {
        a.put(e).await.unwrap();
    }
    let all = |v: &View| eps.iter().all(|e| v.endpoints.contains_key(&e.key()));
    wait_view(b.as_ref(), "a's endpoints", Duration::from_secs(5), all).await;
    let old = a.lease_id().await.unwrap();
    operator.lease_revoke(old).await.unwrap();
    wait_view(
        b.as_ref(),
        "a's endpoints deleted by the revoke",
        Duration::from_secs(5),
        |v| !v.endpoints.contains_key(&eps[0].key()),
    )
    .await;
    wait_view(
        b.as_ref(),
        "every endpoint of a re-put",
        Duration::from_secs(10),
        all,
    )
    .await;
    let new = a.lease_id().await.unwrap();
    assert_ne!(new, old);
    assert_on_lease(&mut operator, &eps, new).await;
}

/// Each of `eps` is stored in etcd under `lease`.
async fn assert_on_lease<'a>(
    operator: &mut etcd_client::Client,
    eps: impl IntoIterator<Item = &'a Endpoint>,
    lease: i64,
) {
    for e in eps {
        let resp = operator
            .get(format!("/flock-test/endpoints/{}", e.key()), None)
            .await
            .unwrap();
        assert_eq!(
            resp.kvs()[0].lease(),
            lease,
            "{} is on the new lease",
            e.key()
        );
    }
}
