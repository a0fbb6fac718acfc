//! Bad input on every API of the real agent process — the CNI socket (malformed,
//! oversized, unknown pods), the admin endpoint (wrong method, oversized head,
//! unknown path) and the xDS port (no node, junk bytes) — gets a clear error, and
//! the agent keeps serving with its state untouched.

mod common;

use common::{Agent, http_get, web_add_request};
use flock_cni::client;
use flock_cni::proto::v1::{
    AddPodRequest, CheckRequest, GarbageCollectRequest, IpConfig, Outcome, Refusal,
    RemovePodRequest, StatusRequest,
};
use std::collections::HashMap;
use std::io::{Read, Write};
use std::time::Duration;

const T: Duration = Duration::from_secs(5);

/// A pod's namespace path that does not exist: this test needs no network namespace
/// (no Envoy serves the pod), and the node's own (`/proc/1/ns/net`) is refused.
const NETNS: &str = "/var/run/netns/flock-bad-input-absent";

fn add(container_id: &str) -> AddPodRequest {
    web_add_request(container_id, "web-0", "10.7.0.2/24", NETNS)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_api_refuses_bad_input_clearly_and_keeps_serving() {
    let agent = Agent::start(&[]);
    let sock = agent.cni_socket.clone();

    // A good pod first: bad input later must not disturb it.
    let ok = client::call(
        &sock,
        T,
        |mut c| async move { c.add_pod(add("good")).await },
    )
    .await
    .unwrap();
    assert_eq!(ok.outcome, Outcome::Success as i32, "{}", ok.message);

    // CNI: malformed and oversized fields → ERROR with the reason, as INVALID_POD (the
    // plugin's CNI error 102: the agent is the one judge of a pod, the plugin does not
    // pre-check).
    let cases: Vec<(AddPodRequest, &str)> = vec![
        (
            AddPodRequest {
                container_id: "x".repeat(300),
                ..add("")
            },
            "must be 1 to 256 bytes",
        ),
        (
            AddPodRequest {
                ips: vec![],
                ..add("c2")
            },
            "has no IP",
        ),
        (
            AddPodRequest {
                ips: vec![IpConfig {
                    address: "not-an-ip".into(),
                    ..IpConfig::default()
                }],
                ..add("c3")
            },
            "is not an IP address",
        ),
        (
            AddPodRequest {
                netns: String::new(),
                ..add("c4")
            },
            "netns: must be an absolute path",
        ),
        (
            AddPodRequest {
                annotations: (0..300)
                    .map(|i| (format!("k{i}"), "v".to_string()))
                    .collect(),
                ..add("c5")
            },
            "more than 256 annotations",
        ),
        (
            AddPodRequest {
                annotations: HashMap::from([
                    ("flock.io/service".to_string(), "web".to_string()),
                    ("flock.io/ports".to_string(), "http".to_string()),
                ]),
                ..add("c6")
            },
            "flock.io/ports: \"http\" is not a port",
        ),
        // The node's own network stack is never a pod's: the agent's namespace by any
        // path to it (here `/proc/self`, resolved by the agent), and pid 1's where it
        // may be read (root with the capabilities of pid 1: not in every sandbox).
        (
            AddPodRequest {
                netns: "/proc/self/ns/net".into(),
                ..add("c8")
            },
            "a pod is never meshed in the node's own network stack",
        ),
    ];
    let host_netns = std::fs::metadata("/proc/1/ns/net").is_ok().then(|| {
        (
            AddPodRequest {
                netns: "/proc/1/ns/net".into(),
                ..add("c9")
            },
            "is the host's network namespace (pid 1's)",
        )
    });
    // Each refused ADD counts once as a pod error (the oversized one below is refused by
    // the gRPC layer, before the agent sees it).
    let refused_adds = cases.len() + usize::from(host_netns.is_some());
    for (req, want) in cases.into_iter().chain(host_netns) {
        let resp = client::call(&sock, T, |mut c| async move { c.add_pod(req).await })
            .await
            .unwrap();
        assert_eq!(resp.outcome, Outcome::Error as i32, "{want}: {resp:?}");
        assert_eq!(resp.refusal, Refusal::InvalidPod as i32, "{want}: {resp:?}");
        assert!(
            resp.message.contains(want),
            "{:?} should contain {want:?}",
            resp.message
        );
    }
    // A request above the 1 MiB limit is refused by the gRPC layer.
    let huge = AddPodRequest {
        prev_result_json: "x".repeat(2 * 1024 * 1024),
        ..add("c7")
    };
    let err = client::call(&sock, T, |mut c| async move { c.add_pod(huge).await })
        .await
        .unwrap_err();
    assert!(
        err.to_string().to_lowercase().contains("message") || err.to_string().contains("size"),
        "{err}"
    );

    // Unknown pods: DEL is IGNORED (idempotent), CHECK is an error; malformed keys
    // are INVALID_ARGUMENT.
    let del = client::call(&sock, T, |mut c| async move {
        c.remove_pod(RemovePodRequest {
            container_id: "nope".into(),
            ifname: "eth0".into(),
            ..Default::default()
        })
        .await
    })
    .await
    .unwrap();
    assert_eq!(del.outcome, Outcome::Ignored as i32, "{del:?}");
    let check = client::call(&sock, T, |mut c| async move {
        c.check(CheckRequest {
            container_id: "nope".into(),
            ifname: "eth0".into(),
            ..Default::default()
        })
        .await
    })
    .await
    .unwrap();
    assert_eq!(check.outcome, Outcome::Error as i32);
    assert!(check.message.contains("not known"), "{check:?}");
    let err = client::call(&sock, T, |mut c| async move {
        c.remove_pod(RemovePodRequest::default()).await
    })
    .await
    .unwrap_err();
    assert!(err.to_string().contains("container_id must be"), "{err}");
    let gc = client::call(&sock, T, |mut c| async move {
        c.garbage_collect(GarbageCollectRequest {
            network_name: "other-net".into(),
            valid_attachments: vec![],
        })
        .await
    })
    .await
    .unwrap();
    assert_eq!(
        gc.removed, 0,
        "a GC for another network removes nothing of ours"
    );

    // Junk bytes on the CNI socket: the connection fails, the agent does not.
    {
        let mut s = std::os::unix::net::UnixStream::connect(&sock).unwrap();
        let _ = s.write_all(&[0xff; 4096]);
        let _ = s.set_read_timeout(Some(T));
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
    }

    // Admin: wrong method, oversized head, unknown path.
    let raw = |bytes: &[u8]| -> String {
        let mut s = std::net::TcpStream::connect(&agent.admin).unwrap();
        s.set_read_timeout(Some(T)).unwrap();
        let _ = s.write_all(bytes);
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        out
    };
    assert!(raw(b"POST /healthz HTTP/1.1\r\n\r\n").starts_with("HTTP/1.1 405"));
    let big = format!("GET / HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(20_000));
    assert!(raw(big.as_bytes()).starts_with("HTTP/1.1 431"));
    let (status, body) = http_get(&agent.admin, "/../../etc/passwd").unwrap();
    assert_eq!(status, 404, "{body}");
    assert!(
        body.contains("/debug/pods"),
        "the 404 says what exists: {body}"
    );

    // xDS: a stream without a node is refused with a status; junk bytes are dropped.
    let channel = flock_xds::client::connect(&agent.xds_target())
        .await
        .unwrap();
    let mut ads = flock_xds::client::delta(channel).await.unwrap();
    ads.send(
        envoy_types::pb::envoy::service::discovery::v3::DeltaDiscoveryRequest {
            type_url: flock_xds::types::CLUSTER.into(),
            ..Default::default()
        },
    )
    .unwrap();
    match ads.recv(T).await {
        Err(flock_xds::client::RecvError::Status(s)) => {
            assert_eq!(s.code(), tonic::Code::InvalidArgument);
            assert!(s.message().contains("must carry the node"), "{s}");
        }
        other => panic!("expected INVALID_ARGUMENT, got {other:?}"),
    }
    {
        let mut s = std::os::unix::net::UnixStream::connect(&agent.xds_socket).unwrap();
        let _ = s.write_all(b"GET / HTTP/1.1\r\n\r\n\x00\x01\x02junk");
        let _ = s.set_read_timeout(Some(T));
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf);
    }

    // Still serving, state untouched: the good pod and only it.
    let st = client::call(&sock, T, |mut c| async move {
        c.status(StatusRequest::default()).await
    })
    .await
    .unwrap();
    assert!(st.message.contains("ready"), "{st:?}");
    assert_eq!(agent.get("/readyz").0, 200);
    let pods = agent.json("/debug/pods");
    let names: Vec<&str> = pods["pods"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["container_id"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["good"]);
    assert_eq!(agent.store_files().len(), 1);
    let metrics = agent.get("/metrics").1;
    let errors = format!("flock_agent_pod_errors_total {refused_adds}");
    assert!(metrics.contains(&errors), "{errors} expected: {metrics}");
}
