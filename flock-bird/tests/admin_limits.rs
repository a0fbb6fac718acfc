//! The admin server's bounds, through its public API: at the connection cap a client
//! waits for a slot (the cap is what `--admin-max-connections` sets), and accept errors
//! such as `EMFILE` back off instead of spinning (on tokio's paused clock, so the pauses
//! are measured exactly and take no real time).

use flock_bird::admin::Route;
use flock_bird::admin::api::{Pods, RegistryView, Snapshot, Status};
use flock_bird::admin::client::{AdminClient, ClientError};
use flock_bird::admin::server::{Accept, ServeOptions, Views, serve_with};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;
use tokio::net::{TcpListener, TcpStream};

/// A ready agent with nothing in it.
struct Fake;

impl Views for Fake {
    fn status(&self) -> Status {
        Status {
            ready: true,
            not_ready: None,
            node: "n1".into(),
            pods: 0,
            registry: "memory".into(),
            registry_synced: true,
            xds_version: None,
            policies_refused: Vec::new(),
        }
    }
    fn pods(&self) -> Pods {
        Pods { pods: vec![] }
    }
    fn snapshot(&self) -> Snapshot {
        Snapshot::default()
    }
    fn registry(&self) -> RegistryView {
        RegistryView {
            backend: "memory".into(),
            synced: true,
            revision: 1,
            generation: 1,
            endpoints: Default::default(),
        }
    }
    fn metrics(&self) -> String {
        String::new()
    }
}

/// Serves `views` on an ephemeral port; the server stops when the returned sender
/// is dropped.
async fn start(views: Arc<Fake>, opts: ServeOptions) -> (String, tokio::sync::oneshot::Sender<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(listener, views, opts, async {
        let _ = rx.await;
    }));
    (addr, tx)
}

#[tokio::test]
async fn at_the_connection_cap_a_client_waits_for_a_slot() {
    let views = Arc::new(Fake);
    let opts = ServeOptions {
        max_connections: 1,
        ..ServeOptions::default()
    };
    let (addr, _stop) = start(views, opts).await;
    // An idle client takes the one slot (it sends nothing: its header timeout is
    // 5 s away).
    let idle = TcpStream::connect(&addr).await.unwrap();
    let client = AdminClient::new(addr.clone()).request_timeout(Duration::from_millis(300));
    let e = client.get(Route::Healthz).await.unwrap_err();
    assert!(matches!(e, ClientError::Timeout { .. }), "{e}");
    // Once it leaves, the slot is free again.
    drop(idle);
    let r = AdminClient::new(addr).get(Route::Healthz).await.unwrap();
    assert_eq!(r.status, 200);
}

/// Fails every accept with `EMFILE` until it has been called `errors` times, then
/// reports the time of that call and never returns again.
struct Exhausted {
    calls: Arc<AtomicUsize>,
    errors: usize,
    done: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Accept for Exhausted {
    type Io = TcpStream;

    async fn accept(&mut self) -> std::io::Result<TcpStream> {
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        if n > self.errors {
            if let Some(done) = self.done.take() {
                let _ = done.send(());
            }
            std::future::pending::<()>().await;
        }
        Err(std::io::Error::from_raw_os_error(24)) // EMFILE
    }
}

/// The guard against a spin: with the backoff removed (mutant `admin-accept-spin`) the
/// twelve failures take no time at all.
#[tokio::test(start_paused = true)]
async fn accept_errors_back_off_instead_of_spinning() {
    let calls = Arc::new(AtomicUsize::new(0));
    let (done_tx, done_rx) = tokio::sync::oneshot::channel();
    let acceptor = Exhausted {
        calls: Arc::clone(&calls),
        errors: 12,
        done: Some(done_tx),
    };
    let start = tokio::time::Instant::now();
    let (_stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(serve_with(
        acceptor,
        Arc::new(Fake),
        ServeOptions::default(),
        async {
            let _ = stop_rx.await;
        },
    ));
    done_rx.await.unwrap();
    // After 12 failures: 5 + 10 + … + 640 ms, then 1 s four times.
    let expected: u64 = (0..12).map(|i| (5u64 << i).min(1000)).sum();
    assert_eq!(
        start.elapsed(),
        Duration::from_millis(expected),
        "accept errors were retried without the backoff (5 ms doubling to 1 s): a spin"
    );
    assert_eq!(calls.load(Ordering::Relaxed), 13);
}
