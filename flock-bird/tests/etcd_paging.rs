//! The etcd registry backend against a REAL etcd (`FLOCK_ETCD_BIN`, installed by
//! scripts/prereqs/40-etcd.sh) holding more of other nodes' endpoints than one gRPC
//! answer may carry (the client decodes at most 4 MiB per message):
//!
//! * the backend starts and its view holds every valid entry (the list is paged);
//!   invalid entries, and entries far over the size limit that do not fit a page or
//!   even a message on their own, are left out alone;
//! * with the backend cut off from etcd (a TCP proxy in between that the test opens and
//!   closes), entries are deleted, changed and added and etcd is compacted past the
//!   backend's watch revision: once the proxy lets it through again, the backend cannot
//!   resume its watch and re-lists, and its view is exactly what etcd holds, reached
//!   in one published change whose delta names exactly the deleted, moved and added
//!   keys (a diff against what the backend held, not a replacement).
//!
//! Entries are plain-mode (`etcd://`, no trust domain) entries that pass
//! `check_entry`, written by a plain etcd client in transactions of 128 puts.

#[path = "common/endpoint.rs"]
mod endpoint;

use flock_bird::model::Endpoint;
use flock_bird::registry::etcd::EtcdRegistry;
use flock_bird::registry::{Registry, RegistryOptions, View};
use flock_core::registry::Reject;
use flock_testkit::{ChildPort, eventually, reserve_port_for_child};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::watch;

const PREFIX: &str = "/flock-test/endpoints/";
/// Valid entries of other nodes: about 5.6 MB of keys and values, more than one 4 MiB
/// gRPC message.
const REMOTE: usize = 12_000;

/// One etcd process; killed (SIGKILL) and reaped on drop.
struct Etcd {
    dir: tempfile::TempDir,
    /// Reserved while this etcd runs.
    client_port: ChildPort,
    child: Child,
}

impl Etcd {
    /// Starts etcd accepting requests up to 8 MiB (`--max-request-bytes`; the default
    /// is 1.5 MiB), so the test can write one value larger than a gRPC message.
    fn start() -> Self {
        let bin = std::env::var_os("FLOCK_ETCD_BIN")
            .map(PathBuf::from)
            .or_else(|| {
                let p = PathBuf::from("/usr/bin/etcd");
                p.exists().then_some(p)
            })
            .expect("etcd not found: run scripts/prereqs/40-etcd.sh or set FLOCK_ETCD_BIN");
        let dir = tempfile::tempdir().unwrap();
        let client_port = reserve_port_for_child();
        let client = format!("http://127.0.0.1:{client_port}");
        // One member: nobody dials its peer URL, so port 0 (the kernel's pick) will do.
        let peer = "http://127.0.0.1:0";
        let log = std::fs::File::create(dir.path().join("etcd.log")).unwrap();
        let child = Command::new(bin)
            .args(["--name", "t1", "--data-dir"])
            .arg(dir.path().join("data"))
            .args(["--listen-client-urls", &client])
            .args(["--advertise-client-urls", &client])
            .args(["--listen-peer-urls", peer])
            .args(["--initial-advertise-peer-urls", peer])
            .args(["--initial-cluster", &format!("t1={peer}")])
            .args(["--heartbeat-interval", "50", "--election-timeout", "250"])
            .args(["--max-request-bytes", &(8 << 20).to_string()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("starting etcd");
        Etcd {
            dir,
            client_port,
            child,
        }
    }

    fn endpoint(&self) -> String {
        format!("127.0.0.1:{}", self.client_port)
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
                Ok(Err(e)) => Err(format!(
                    "{e}; log: {}",
                    std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
                )),
                Err(_) => Err(format!(
                    "no answer in 2 s; log: {}",
                    std::fs::read_to_string(self.dir.path().join("etcd.log")).unwrap_or_default()
                )),
            }
        })
        .await
    }
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A TCP proxy to etcd that the test can close: [`Proxy::cut`] ends every open
/// connection and refuses new ones (accepts and closes them) until [`Proxy::restore`].
struct Proxy {
    addr: String,
    open: Arc<AtomicBool>,
    cut: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl Proxy {
    async fn start(target: String) -> Self {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let open = Arc::new(AtomicBool::new(true));
        let (cut, _) = watch::channel(0u64);
        let (open2, cut2) = (open.clone(), cut.clone());
        let task = tokio::spawn(async move {
            loop {
                let Ok((mut inbound, _)) = listener.accept().await else {
                    return;
                };
                if !open2.load(Ordering::SeqCst) {
                    continue;
                }
                let mut cut = cut2.subscribe();
                let target = target.clone();
                tokio::spawn(async move {
                    let Ok(mut outbound) = tokio::net::TcpStream::connect(&target).await else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                        _ = cut.changed() => {}
                    }
                });
            }
        });
        Proxy {
            addr,
            open,
            cut,
            task,
        }
    }

    fn cut(&self) {
        self.open.store(false, Ordering::SeqCst);
        self.cut.send_modify(|g| *g += 1);
    }

    fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Other node `node-<i/100>`'s endpoint `i` of service `web` (a 64-hex container ID,
/// like a real sandbox ID).
fn remote(i: usize) -> Endpoint {
    let mut e = endpoint::web(&format!("node-{}", i / 100), &format!("p{i}"));
    e.pod_key.container_id = format!("{i:064x}");
    e.address = addr(i, 0);
    e
}

fn addr(i: usize, version: u8) -> IpAddr {
    format!("10.{}.{}.{}", 64 + version, (i / 256) % 256, i % 256)
        .parse()
        .unwrap()
}

/// Puts `entries` (full key, value) in transactions of 128 (etcd's `--max-txn-ops`).
async fn put_all(client: &etcd_client::Client, entries: Vec<(String, Vec<u8>)>) {
    let mut set = tokio::task::JoinSet::new();
    for chunk in entries.chunks(128) {
        let ops: Vec<etcd_client::TxnOp> = chunk
            .iter()
            .map(|(k, v)| etcd_client::TxnOp::put(k.clone(), v.clone(), None))
            .collect();
        let mut kv = client.kv_client();
        set.spawn(async move { kv.txn(etcd_client::Txn::new().and_then(ops)).await });
        while set.len() >= 8 {
            set.join_next()
                .await
                .unwrap()
                .unwrap()
                .expect("txn of puts");
        }
    }
    while let Some(r) = set.join_next().await {
        r.unwrap().expect("txn of puts");
    }
}

fn entry(e: &Endpoint) -> (String, Vec<u8>) {
    (
        format!("{PREFIX}{}", e.key()),
        serde_json::to_vec(e).unwrap(),
    )
}

fn opts() -> RegistryOptions {
    RegistryOptions {
        prefix: PREFIX.into(),
        lease_ttl_secs: 30,
        node: "me".into(),
        reconnect_initial: Duration::from_millis(100),
        reconnect_max: Duration::from_millis(300),
        op_timeout: Duration::from_secs(5),
        ..RegistryOptions::default()
    }
}

/// The view as key → address.
fn addresses(v: &View) -> BTreeMap<String, IpAddr> {
    v.endpoints
        .iter()
        .map(|(k, e)| (k.clone(), e.address))
        .collect()
}

/// Asserts two key → address maps are equal; on failure names how many keys differ
/// and the first few (the maps hold thousands of keys).
fn assert_same(got: &BTreeMap<String, IpAddr>, want: &BTreeMap<String, IpAddr>, what: &str) {
    let missing: Vec<&String> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    let extra: Vec<&String> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    let wrong: Vec<&String> = want
        .iter()
        .filter(|(k, a)| got.get(*k).is_some_and(|g| g != *a))
        .map(|(k, _)| k)
        .collect();
    assert!(
        missing.is_empty() && extra.is_empty() && wrong.is_empty(),
        "{what}: {} keys missing (first {:?}), {} extra (first {:?}), {} with another \
         address (first {:?})",
        missing.len(),
        missing.iter().take(3).collect::<Vec<_>>(),
        extra.len(),
        extra.iter().take(3).collect::<Vec<_>>(),
        wrong.len(),
        wrong.iter().take(3).collect::<Vec<_>>(),
    );
}

async fn wait_view(reg: &dyn Registry, what: &str, cond: impl Fn(&View) -> bool) -> Arc<View> {
    let mut rx = reg.view();
    let res = tokio::time::timeout(Duration::from_secs(20), async {
        loop {
            let v = rx.borrow_and_update().clone();
            if cond(&v) {
                return v;
            }
            rx.changed().await.expect("view sender dropped");
        }
    })
    .await;
    res.unwrap_or_else(|_| panic!("timed out waiting for {what}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lists_more_than_one_message_and_relists_after_compaction() {
    let etcd = Etcd::start();
    let mut operator = etcd.client().await;
    let started = Instant::now();

    let mut entries: Vec<(String, Vec<u8>)> = (0..REMOTE).map(|i| entry(&remote(i))).collect();
    let bytes: usize = entries.iter().map(|(k, v)| k.len() + v.len()).sum();
    assert!(
        bytes > 5 << 20,
        "the valid entries must not fit one 4 MiB message: {bytes} bytes"
    );
    // Refused alone: a node mismatch, and entries far over the 16 KiB entry limit: four
    // of 1.2 MB next to each other (a page holding them is over a message and must be
    // split) and one of 5 MB (over a message on its own).
    let forged = {
        let mut e = remote(7);
        e.node = "someone-else".into();
        (
            format!("{PREFIX}{}", remote(7_000_000).key()),
            serde_json::to_vec(&e).unwrap(),
        )
    };
    let huge = |n: usize, size: usize| {
        let e = remote(5_000_000 + n);
        (format!("{PREFIX}{}", e.key()), vec![b'x'; size])
    };
    entries.push(forged);
    put_all(&operator, entries).await;
    for n in 0..4 {
        let (k, v) = huge(n, 1_200_000);
        operator.put(k, v, None).await.unwrap();
    }
    let (k, v) = huge(9, 5 << 20);
    operator.put(k, v, None).await.unwrap();
    eprintln!(
        "filled etcd with {REMOTE} valid entries ({bytes} bytes) and 6 refused in {:?}",
        started.elapsed()
    );

    // What the agent met before lists were paged: one answer over the client's limit.
    let unpaged = operator
        .get(PREFIX, Some(etcd_client::GetOptions::new().with_prefix()))
        .await;
    match unpaged {
        Err(e) => assert!(
            e.to_string().contains("too large"),
            "unexpected error of the unpaged list: {e}"
        ),
        Ok(r) => panic!("one unpaged list answer decoded ({} keys)", r.kvs().len()),
    }

    let proxy = Proxy::start(etcd.endpoint()).await;
    let connect = Instant::now();
    let reg = EtcdRegistry::connect(std::slice::from_ref(&proxy.addr), opts())
        .await
        .expect("the backend starts with a registry larger than one message");
    eprintln!("connected and listed in {:?}", connect.elapsed());
    let mut expected: BTreeMap<String, IpAddr> =
        (0..REMOTE).map(|i| (remote(i).key(), addr(i, 0))).collect();
    let v = reg.view().borrow().clone();
    assert!(v.synced);
    assert_eq!(v.endpoints.len(), REMOTE);
    assert_same(&addresses(&v), &expected, "the listed view");
    assert_eq!(*v.endpoints[&remote(4321).key()], remote(4321));
    let rejections = reg.rejections().unwrap();
    assert_eq!(rejections.count(Reject::Node), 1);
    assert_eq!(rejections.count(Reject::Oversized), 5);

    // Cut off: the backend notices (its streams break) and marks the view unsynced.
    let generation = v.generation;
    let seq = v.seq;
    proxy.cut();
    wait_view(&reg, "the view unsynced", |v| !v.synced).await;

    // Meanwhile: 1,000 deleted, 1,000 moved, 1,000 added, one refused, and etcd
    // compacted to the latest revision, past the backend's watch revision.
    let mut changes = Vec::new();
    let (mut added, mut changed, mut removed) = (Vec::new(), Vec::new(), vec![remote(2).key()]);
    for i in 0..1_000 {
        let gone = remote(i * 3);
        removed.push(gone.key());
        changed.push(remote(i * 3 + 1).key());
        added.push(remote(REMOTE + i).key());
        operator
            .delete(format!("{PREFIX}{}", gone.key()), None)
            .await
            .unwrap();
        expected.remove(&gone.key());
        let mut moved = remote(i * 3 + 1);
        moved.address = addr(i * 3 + 1, 1);
        expected.insert(moved.key(), moved.address);
        changes.push(entry(&moved));
        let added = remote(REMOTE + i);
        expected.insert(added.key(), added.address);
        changes.push(entry(&added));
    }
    let mut bad = remote(2);
    bad.service_port = 0;
    changes.push((
        format!("{PREFIX}{}", remote(2).key()),
        serde_json::to_vec(&bad).unwrap(),
    ));
    expected.remove(&remote(2).key());
    put_all(&operator, changes).await;
    let latest = operator
        .get("x", None)
        .await
        .unwrap()
        .header()
        .unwrap()
        .revision();
    assert!(
        latest > i64::try_from(reg.view().borrow().revision).unwrap(),
        "the compaction must pass the backend's watch revision"
    );
    operator
        .compact(
            latest,
            Some(etcd_client::CompactionOptions::new().with_physical()),
        )
        .await
        .unwrap();

    let relist = Instant::now();
    proxy.restore();
    let v = wait_view(&reg, "the view synced again", |v| {
        v.synced && v.generation > generation
    })
    .await;
    eprintln!("re-listed after the compaction in {:?}", relist.elapsed());
    assert_same(&addresses(&v), &expected, "the re-list converged to etcd");
    // Subscribers see what changed while the watch was down, not a new registry: the
    // re-list is one change of exactly the deleted, moved and added keys.
    assert_eq!(v.seq, seq + 1, "the re-list is one change of the view");
    for keys in [&mut added, &mut changed, &mut removed] {
        keys.sort();
    }
    assert_eq!(
        v.delta.added, added,
        "the re-list is not a diff of the view: its added keys"
    );
    assert_eq!(
        v.delta.changed, changed,
        "the re-list is not a diff of the view: its changed keys"
    );
    assert_eq!(
        v.delta.removed, removed,
        "the re-list is not a diff of the view: its removed keys"
    );
    assert_eq!(rejections.count(Reject::Port), 1);
    assert!(
        rejections.refused().contains_key(&remote(2).key()),
        "the refused value is listed as refused"
    );
    let at = i64::try_from(v.revision).unwrap();
    assert!(
        at >= latest,
        "view revision {at} is the re-list's, at least {latest}"
    );

    // And the watch runs again from the list.
    let late = remote(REMOTE + 5_000);
    operator
        .put(entry(&late).0, entry(&late).1, None)
        .await
        .unwrap();
    wait_view(&reg, "a put after the re-list", |v| {
        v.endpoints.contains_key(&late.key())
    })
    .await;
    eprintln!("whole test {:?}", started.elapsed());
}
