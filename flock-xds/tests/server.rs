//! The gRPC server over real sockets (TCP and unix), driven by the raw ADS client in
//! `flock_xds::client`: protocol edge cases on the wire, many streams, and the ordering
//! and R1 stress test.

mod common;

use common::xds::{any, cache_with, delta_req, names, serve, sotw_req, start_tcp, upsert};
use envoy_types::pb::google::protobuf::Any;
use envoy_types::pb::google::rpc;
use flock_core::ContentHash;
use flock_xds::cache::Cache;
use flock_xds::callbacks::{Callbacks, NodeInfo, StreamId};
use flock_xds::client::{self, RecvError};
use flock_xds::server::{Limits, Server};
use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(10);
/// How long to wait for a response that must NOT come.
const QUIET: Duration = Duration::from_millis(300);

#[tokio::test]
async fn sotw_ads_over_tcp_serves_acks_and_follows_updates() {
    let cache = cache_with(&[
        (CLUSTER, "web", "cluster web v1"),
        (ENDPOINT, "web", "10.0.0.1"),
    ]);
    let running = serve(&cache).await;
    let mut ads = running.sotw().await;
    ads.send(sotw_req(CLUSTER, &[], "", "")).unwrap();
    let cds = ads.recv(WAIT).await.unwrap();
    assert_eq!(
        (cds.type_url.as_str(), cds.version_info.as_str()),
        (CLUSTER, "1")
    );
    assert_eq!(cds.resources, vec![any(CLUSTER, "cluster web v1")]);
    assert_eq!(cds.control_plane.unwrap().identifier, "flock-xds");
    ads.send(sotw_req(CLUSTER, &[], "1", &cds.nonce)).unwrap();
    ads.send(sotw_req(ENDPOINT, &["web"], "", "")).unwrap();
    let eds = ads.recv(WAIT).await.unwrap();
    assert_eq!(eds.type_url, ENDPOINT);
    assert_eq!(eds.resources, vec![any(ENDPOINT, "10.0.0.1")]);
    ads.send(sotw_req(ENDPOINT, &["web"], "1", &eds.nonce))
        .unwrap();

    // An endpoint update reaches the client as a new version of EDS only.
    upsert(&cache, &[(ENDPOINT, "web", "10.0.0.2")]);
    let eds2 = ads.recv(WAIT).await.unwrap();
    assert_eq!(
        (eds2.type_url.as_str(), eds2.version_info.as_str()),
        (ENDPOINT, "2")
    );
    assert_eq!(eds2.resources, vec![any(ENDPOINT, "10.0.0.2")]);
    ads.send(sotw_req(ENDPOINT, &["web"], "2", &eds2.nonce))
        .unwrap();
    assert!(
        matches!(ads.recv(QUIET).await, Err(RecvError::Timeout(_))),
        "CDS did not change"
    );
    assert_eq!(
        running
            .server
            .metrics()
            .counter("flock_xds_acks_total", "eds"),
        2
    );
    running.stop().await;
}

#[tokio::test]
async fn delta_ads_over_a_0600_unix_socket_subscribes_updates_and_removes() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("xds.sock");
    let cache = cache_with(&[(CLUSTER, "a", "A"), (CLUSTER, "b", "B")]);
    let server = Server::new(Arc::clone(&cache));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let s = server.clone();
    let p = path.clone();
    let task = tokio::spawn(async move {
        s.serve_unix(&p, async {
            let _ = stopped.await;
        })
        .await
    });
    // The socket exists once bound; connect retries until then.
    let channel = loop {
        if let Ok(c) = client::connect(&format!("unix:{}", path.display())).await {
            break c;
        }
        tokio::task::yield_now().await;
    };
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "the xDS socket is owner-only");
    let mut ads = client::delta(channel).await.unwrap();
    ads.send(delta_req(CLUSTER, &["*"], &[], "")).unwrap();
    let first = ads.recv(WAIT).await.unwrap();
    assert_eq!(names(&first), vec!["a", "b"]);
    assert_eq!(first.resources[0].version, ContentHash::of(b"A").to_hex());
    ads.send(delta_req(CLUSTER, &[], &[], &first.nonce))
        .unwrap();

    cache.update("n1", |s| s.edit().remove(CLUSTER, "a").build());
    let removal = ads.recv(WAIT).await.unwrap();
    assert_eq!(removal.removed_resources, vec!["a".to_string()]);
    assert!(
        removal.resources.is_empty(),
        "b did not change, so it is not resent"
    );
    ads.send(delta_req(CLUSTER, &[], &[], &removal.nonce))
        .unwrap();

    let _ = stop.send(());
    task.await.unwrap().unwrap();
    assert!(!path.exists(), "the socket is removed on shutdown");
}

/// One NACK as the callbacks saw it: type, rejected version, kept version, error.
type Nack = (String, u64, Option<u64>, String);

/// Records NACKs as the callbacks see them.
#[derive(Default)]
struct NackLog(Mutex<Vec<Nack>>);

impl Callbacks for NackLog {
    fn on_nack(
        &self,
        _stream: StreamId,
        _node: &NodeInfo,
        type_url: &str,
        rejected: u64,
        kept: Option<u64>,
        error: &str,
    ) {
        self.0
            .lock()
            .unwrap()
            .push((type_url.to_string(), rejected, kept, error.to_string()));
    }
}

#[tokio::test]
async fn a_nack_reaches_callbacks_and_metrics_and_the_fix_is_sent() {
    let cache = cache_with(&[(CLUSTER, "c", "good")]);
    let log = Arc::new(NackLog::default());
    let running = start_tcp(
        Server::builder(Arc::clone(&cache))
            .callbacks_arc(Arc::clone(&log) as Arc<dyn Callbacks>)
            .build(),
    )
    .await;
    let mut ads = running.sotw().await;
    ads.send(sotw_req(CLUSTER, &[], "", "")).unwrap();
    let v1 = ads.recv(WAIT).await.unwrap();
    ads.send(sotw_req(CLUSTER, &[], "1", &v1.nonce)).unwrap();
    upsert(&cache, &[(CLUSTER, "c", "bad")]);
    let v2 = ads.recv(WAIT).await.unwrap();
    assert_eq!(v2.version_info, "2");
    // NACK: previous version and an error_detail.
    let mut nack = sotw_req(CLUSTER, &[], "1", &v2.nonce);
    nack.error_detail = Some(rpc::Status {
        code: 3,
        message: "cluster c: invalid".into(),
        details: vec![],
    });
    ads.send(nack).unwrap();
    assert!(
        matches!(ads.recv(QUIET).await, Err(RecvError::Timeout(_))),
        "the rejected content is not resent"
    );
    upsert(&cache, &[(CLUSTER, "c", "fixed")]);
    let v3 = ads.recv(WAIT).await.unwrap();
    assert_eq!(v3.resources, vec![any(CLUSTER, "fixed")]);
    assert_eq!(
        *log.0.lock().unwrap(),
        vec![(
            CLUSTER.to_string(),
            2,
            Some(1),
            "cluster c: invalid".to_string()
        )]
    );
    assert_eq!(
        running
            .server
            .metrics()
            .counter("flock_xds_nacks_total", "cds"),
        1
    );
    let text = running.server.metrics().render_prometheus();
    assert!(
        text.contains("flock_xds_nacks_total{type=\"cds\"} 1"),
        "{text}"
    );
    running.stop().await;
}

#[tokio::test]
async fn a_stale_ack_is_ignored_on_the_wire() {
    let cache = cache_with(&[(CLUSTER, "c", "v1")]);
    let running = serve(&cache).await;
    let mut ads = running.sotw().await;
    ads.send(sotw_req(CLUSTER, &[], "", "")).unwrap();
    let v1 = ads.recv(WAIT).await.unwrap();
    ads.send(sotw_req(CLUSTER, &[], "1", &v1.nonce)).unwrap();
    upsert(&cache, &[(CLUSTER, "c", "v2")]);
    let v2 = ads.recv(WAIT).await.unwrap();
    // A late request still carrying v1's nonce must not count as ACKing v2.
    ads.send(sotw_req(CLUSTER, &[], "1", &v1.nonce)).unwrap();
    upsert(&cache, &[(CLUSTER, "c", "v3")]);
    assert!(
        matches!(ads.recv(QUIET).await, Err(RecvError::Timeout(_))),
        "v2 is still in flight (not ACKed), so v3 waits"
    );
    ads.send(sotw_req(CLUSTER, &[], "2", &v2.nonce)).unwrap();
    let v3 = ads.recv(WAIT).await.unwrap();
    assert_eq!(
        (v3.version_info.as_str(), v3.resources[0].value.as_slice()),
        ("3", &b"v3"[..])
    );
    assert_eq!(
        running
            .server
            .metrics()
            .counter("flock_xds_stale_requests_total", "cds"),
        1
    );
    running.stop().await;
}

#[tokio::test]
async fn a_delta_reconnect_with_initial_versions_gets_only_what_changed() {
    let cache = cache_with(&[(CLUSTER, "same", "S"), (CLUSTER, "changed", "C2")]);
    let running = serve(&cache).await;
    let mut ads = running.delta().await;
    let mut req = delta_req(CLUSTER, &["*"], &[], "");
    req.initial_resource_versions = [
        ("same".to_string(), ContentHash::of(b"S").to_hex()),
        ("changed".to_string(), ContentHash::of(b"C1").to_hex()),
        ("gone".to_string(), ContentHash::of(b"G").to_hex()),
    ]
    .into_iter()
    .collect();
    ads.send(req).unwrap();
    let resp = ads.recv(WAIT).await.unwrap();
    assert_eq!(names(&resp), vec!["changed"]);
    assert_eq!(resp.removed_resources, vec!["gone".to_string()]);
    running.stop().await;
}

#[tokio::test]
async fn an_unsubscribe_sent_before_the_ack_drops_the_name_from_the_next_response() {
    let cache = cache_with(&[(ENDPOINT, "a", "A1"), (ENDPOINT, "b", "B1")]);
    let running = serve(&cache).await;
    let mut ads = running.delta().await;
    ads.send(delta_req(ENDPOINT, &["a", "b"], &[], "")).unwrap();
    let first = ads.recv(WAIT).await.unwrap();
    // Both change while the first response is in flight; the client unsubscribes
    // from "a" in the same breath as its ACK.
    upsert(&cache, &[(ENDPOINT, "a", "A2"), (ENDPOINT, "b", "B2")]);
    ads.send(delta_req(ENDPOINT, &[], &["a"], &first.nonce))
        .unwrap();
    let next = ads.recv(WAIT).await.unwrap();
    assert_eq!(
        names(&next),
        vec!["b"],
        "nothing is sent for an unsubscribed name"
    );
    assert!(next.removed_resources.is_empty());
    running.stop().await;
}

#[tokio::test]
async fn bad_requests_end_the_stream_with_a_clear_status() {
    let cache = Arc::new(Cache::<Any>::by_node_id());
    let server = Server::builder(Arc::clone(&cache))
        .limits(Limits {
            max_names_per_request: 3,
            ..Limits::default()
        })
        .build();
    let running = start_tcp(server).await;
    let channel = client::connect(&running.target).await.unwrap();

    let mut no_node = client::sotw(channel.clone()).await.unwrap();
    let mut req = sotw_req(CLUSTER, &[], "", "");
    req.node = None;
    no_node.send(req).unwrap();
    match no_node.recv(WAIT).await {
        Err(RecvError::Status(s)) => assert!(s.message().contains("must carry the node"), "{s}"),
        other => panic!("expected a status, got {other:?}"),
    }

    let mut too_many = client::delta(channel.clone()).await.unwrap();
    too_many
        .send(delta_req(ENDPOINT, &["a", "b", "c", "d"], &[], ""))
        .unwrap();
    match too_many.recv(WAIT).await {
        Err(RecvError::Status(s)) => {
            assert_eq!(s.code(), tonic::Code::InvalidArgument);
            assert!(s.message().contains("limit of 3"), "{s}");
        }
        other => panic!("expected a status, got {other:?}"),
    }

    let mut no_type = client::sotw(channel).await.unwrap();
    no_type.send(sotw_req("", &[], "", "")).unwrap();
    match no_type.recv(WAIT).await {
        Err(RecvError::Status(s)) => assert!(s.message().contains("must set type_url"), "{s}"),
        other => panic!("expected a status, got {other:?}"),
    }
    running.stop().await;
}

#[tokio::test]
async fn per_type_services_and_fetch_serve_one_type() {
    use envoy_types::pb::envoy::service::cluster::v3::cluster_discovery_service_client::ClusterDiscoveryServiceClient;
    let cache = cache_with(&[(CLUSTER, "c", "C"), (LISTENER, "l", "L")]);
    let running = serve(&cache).await;
    let channel = client::connect(&running.target).await.unwrap();
    let mut cds = ClusterDiscoveryServiceClient::new(channel);
    // Per-type streams may leave type_url empty.
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    tx.send(sotw_req("", &[], "", "")).unwrap();
    let mut stream = cds
        .stream_clusters(tokio_stream::wrappers::UnboundedReceiverStream::new(rx))
        .await
        .unwrap()
        .into_inner();
    let resp = tokio::time::timeout(WAIT, stream.message())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((resp.type_url.as_str(), resp.resources.len()), (CLUSTER, 1));
    let fetched = cds
        .fetch_clusters(sotw_req("", &["c"], "", ""))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fetched.resources, vec![any(CLUSTER, "C")]);
    assert_eq!(fetched.version_info, "1");
    let err = cds
        .fetch_clusters(sotw_req(LISTENER, &[], "", ""))
        .await
        .unwrap_err();
    assert!(err.message().contains("this service serves"), "{err}");
    running.stop().await;
}

/// 1,000 streams open, each receives its first response, and all close: the server
/// ends with no open stream and no sink left on the group's publisher.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_streams_open_and_close_without_leaks() {
    let cache = cache_with(&[(CLUSTER, "c", "C")]);
    let running = serve(&cache).await;
    // A few connections carry many streams each, as HTTP/2 clients do.
    let mut channels = Vec::new();
    for _ in 0..4 {
        channels.push(client::connect(&running.target).await.unwrap());
    }
    let mut tasks = tokio::task::JoinSet::new();
    for i in 0..1000 {
        let channel = channels[i % channels.len()].clone();
        tasks.spawn(async move {
            let mut ads = client::delta(channel).await.unwrap();
            ads.send(delta_req(CLUSTER, &["*"], &[], "")).unwrap();
            let resp = ads.recv(WAIT).await.unwrap();
            assert_eq!(names(&resp), vec!["c"]);
            drop(ads.close());
        });
    }
    while let Some(r) = tasks.join_next().await {
        r.unwrap();
    }
    // Stream tasks notice the closed request side and clean up.
    let deadline = tokio::time::Instant::now() + WAIT;
    while running.server.metrics().streams_open() > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "streams still open: {}",
            running.server.metrics().streams_open()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let publisher = cache.publisher("n1");
    assert!(
        format!("{publisher:?}").contains("sinks: 0"),
        "{publisher:?}"
    );
    running.stop().await;
}

/// What one recording client saw, for the ordering checks.
#[derive(Default)]
struct Seen {
    /// Per type, every system version received, in order.
    versions: BTreeMap<String, Vec<u64>>,
    /// Clusters the client holds (as far as responses said).
    clusters: BTreeSet<String>,
    /// Endpoints the client holds.
    endpoints: BTreeSet<String>,
    /// Violations, described.
    violations: Vec<String>,
}

/// Ordering and R1 under stress: 8 updater threads each add 150 (cluster, endpoints)
/// pairs, each in one publish, while 4 Delta clients (CDS and EDS wildcard) record
/// every response and ACK it. Every client must see strictly increasing versions per
/// type, never an endpoint before its cluster, never a resource disappear (updates
/// only add), and end holding exactly the last published set — which contains every
/// pair added (a lost update, as with R1's version taken outside the lock, fails it:
/// `scripts/test` reintroduces that bug and checks this test catches it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordering_and_r1_under_concurrent_updaters() {
    const UPDATERS: usize = 8;
    const PER_UPDATER: usize = 150;
    const CLIENTS: usize = 4;
    let cache = cache_with(&[(CLUSTER, "seed", "seed"), (ENDPOINT, "seed", "seed")]);
    let running = serve(&cache).await;
    let mut clients = tokio::task::JoinSet::new();
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);
    for _ in 0..CLIENTS {
        let channel = client::connect(&running.target).await.unwrap();
        let done = done_rx.clone();
        let cache = Arc::clone(&cache);
        clients.spawn(async move {
            let mut ads = client::delta(channel).await.unwrap();
            ads.send(delta_req(CLUSTER, &["*"], &[], "")).unwrap();
            ads.send(delta_req(ENDPOINT, &["*"], &[], "")).unwrap();
            let mut seen = Seen::default();
            let mut done_at = None;
            loop {
                let resp = match ads.recv(Duration::from_millis(500)).await {
                    Ok(resp) => resp,
                    Err(RecvError::Timeout(_)) => {
                        // Quiet: finished once the updaters are done and we hold the
                        // latest version of both types (or, with a broken publisher
                        // whose latest can go back, after a deadline: the checks
                        // below then fail on content).
                        if !*done.borrow() {
                            continue;
                        }
                        let latest = cache.snapshot("n1").unwrap().version();
                        let caught_up = [CLUSTER, ENDPOINT].iter().all(|t| {
                            seen.versions.get(*t).and_then(|v| v.last()).copied() >= Some(latest)
                        });
                        let deadline = *done_at.get_or_insert_with(|| {
                            tokio::time::Instant::now() + Duration::from_secs(20)
                        });
                        if caught_up || tokio::time::Instant::now() > deadline {
                            return seen;
                        }
                        continue;
                    }
                    Err(e) => panic!("stream failed: {e}"),
                };
                let version: u64 = resp.system_version_info.parse().unwrap();
                let list = seen.versions.entry(resp.type_url.clone()).or_default();
                if list.last().is_some_and(|&last| version <= last) {
                    seen.violations.push(format!(
                        "{} version {version} after {list:?}",
                        resp.type_url
                    ));
                }
                list.push(version);
                if !resp.removed_resources.is_empty() {
                    seen.violations.push(format!(
                        "removal of {:?}: content went back",
                        resp.removed_resources
                    ));
                }
                for r in &resp.resources {
                    if resp.type_url == CLUSTER {
                        seen.clusters.insert(r.name.clone());
                    } else {
                        if !seen.clusters.contains(&r.name) {
                            seen.violations
                                .push(format!("endpoints {} before their cluster", r.name));
                        }
                        seen.endpoints.insert(r.name.clone());
                    }
                }
                ads.send(delta_req(&resp.type_url, &[], &[], &resp.nonce))
                    .unwrap();
            }
        });
    }
    let updaters: Vec<_> = (0..UPDATERS)
        .map(|u| {
            let cache = Arc::clone(&cache);
            std::thread::spawn(move || {
                for i in 0..PER_UPDATER {
                    let name = format!("c-{u}-{i}");
                    upsert(&cache, &[(CLUSTER, &name, &name), (ENDPOINT, &name, &name)]);
                }
            })
        })
        .collect();
    for u in updaters {
        u.join().unwrap();
    }
    done_tx.send(true).unwrap();
    let last = cache.snapshot("n1").unwrap();
    let published: BTreeSet<String> = last
        .state()
        .iter_type(CLUSTER)
        .map(|(n, _)| n.to_string())
        .collect();
    let expected: BTreeSet<String> = std::iter::once("seed".to_string())
        .chain((0..UPDATERS).flat_map(|u| (0..PER_UPDATER).map(move |i| format!("c-{u}-{i}"))))
        .collect();
    while let Some(seen) = clients.join_next().await {
        let seen = seen.unwrap();
        assert!(
            seen.violations.is_empty(),
            "violations: {:?}",
            &seen.violations[..seen.violations.len().min(5)]
        );
        assert_eq!(
            seen.clusters, published,
            "a client ends holding the last published clusters"
        );
        assert_eq!(seen.endpoints, published, "… and their endpoints");
    }
    let missing: Vec<_> = expected.difference(&published).take(5).collect();
    assert!(
        missing.is_empty(),
        "updates lost by the publisher (R1): {missing:?}…"
    );
    let _ = ROUTE;
    running.stop().await;
}
