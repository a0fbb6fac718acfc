//! Transparent capture in the agent, in process over a real pod store (tempdir) and
//! the embedded registry, without root: which pods get a capture (node flags, pod
//! annotations, CNI gateways), the record it is stored in, the xDS pod model, refusals,
//! and AddPod failing at `CaptureApply` with nothing left behind. The rules in real
//! network namespaces are `capture_netns`'s (root, the peers tier).

mod common;

use common::input;
use envoy_types::pb::google::protobuf::Any;
use flock_bird::agent::{Agent, AgentConfig, ENVOY_GROUP, PodError, group_of, mesh};
use flock_bird::registry::{self, Registry, RegistryOptions, RegistrySpec};
use flock_bird::store::PodStore;
use flock_core::capture::Mode;
use flock_core::capture::policy::{NodeCapture, Setting};
use flock_core::lifecycle::steps::Step;
use flock_xds::cache::Cache;
use flock_xds::translate::{CaptureMode, DEFAULT_CAPTURE_MARK};
use flock_xds::types::{CLUSTER, LISTENER};
use std::sync::Arc;
use std::sync::atomic::Ordering;

async fn agent_with(dir: &std::path::Path, setting: Setting) -> Arc<Agent> {
    agent_with_node(
        dir,
        NodeCapture {
            setting,
            exclude_outbound_ports: vec![5432],
            ..NodeCapture::default()
        },
    )
    .await
}

async fn agent_with_node(dir: &std::path::Path, capture: NodeCapture) -> Arc<Agent> {
    let reg: Arc<dyn Registry> = registry::connect(
        &RegistrySpec::Memory,
        RegistryOptions {
            node: "n1".into(),
            ..RegistryOptions::default()
        },
    )
    .await
    .unwrap();
    let store = Arc::new(PodStore::open(dir).unwrap());
    let cache: Arc<Cache<Any>> = Arc::new(Cache::new(group_of));
    let mut cfg = AgentConfig::new("n1");
    cfg.capture = capture;
    let agent = Arc::new(Agent::new(cfg, store, reg, cache));
    agent.load().await.unwrap();
    agent
}

fn names(agent: &Agent, type_url: &str) -> Vec<String> {
    let snap = agent.cache().snapshot(ENVOY_GROUP).unwrap();
    snap.state()
        .iter_type(type_url)
        .map(|(n, _)| n.to_string())
        .collect()
}

/// The default (`--capture off`): the pod's record has no capture, its file is the
/// same bytes as before capture existed (no `capture` key), and its xDS pod model has
/// none, so the translation's output is unchanged; `flock.io/capture: off` is accepted.
#[tokio::test]
async fn capture_off_leaves_the_record_the_file_and_the_xds_pod_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_with(dir.path(), Setting::Off).await;
    let mut req = input("c1", Some("web"), "8080");
    req.annotations
        .insert("flock.io/capture".into(), "off".into());
    agent.add_pod(&req).await.unwrap();
    let rec = agent.pods().into_values().next().unwrap();
    assert_eq!(rec.capture, None);
    assert_eq!(
        mesh::pod_model(&rec, None, &Default::default())
            .unwrap()
            .capture,
        None
    );
    let file = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|e| e == "json"))
        .unwrap();
    let text = std::fs::read_to_string(file).unwrap();
    assert!(!text.contains("capture"), "{text}");
    assert!(
        !names(agent.as_ref(), CLUSTER)
            .iter()
            .any(|n| n.starts_with("passthrough|")),
        "no passthrough cluster without capture"
    );
    assert_eq!(agent.metrics.capture.applied.load(Ordering::Relaxed), 0);
}

/// A pod asking for capture on a node that does not capture is refused (INVALID_POD
/// at the CNI), naming the annotation and the flag, and nothing is stored.
#[tokio::test]
async fn a_pod_asking_for_capture_on_a_node_without_it_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_with(dir.path(), Setting::Off).await;
    let mut req = input("c1", Some("web"), "8080");
    req.annotations
        .insert("flock.io/capture".into(), "strict".into());
    match agent.add_pod(&req).await {
        Err(PodError::Invalid(m)) => assert!(
            m.contains("flock.io/capture")
                && m.contains("capture is off on this node")
                && m.contains("default/pod-c1"),
            "{m}"
        ),
        other => panic!("expected INVALID, got {other:?}"),
    }
    assert!(agent.pods().is_empty());
    assert!(
        PodStore::open(dir.path())
            .unwrap()
            .load_all()
            .unwrap()
            .pods
            .is_empty()
    );
}

/// On a node started with `--capture strict --capture-enforce`, a pod's own
/// `flock.io/capture: off` (or `permissive`, or an exclusion) fails the ADD (INVALID_POD
/// at the CNI: error 102 with this message), naming the annotation and the flag, and
/// nothing is stored: the pod's owner cannot opt out of the node's default deny.
#[tokio::test]
async fn an_enforcing_node_refuses_a_pod_that_lowers_its_capture() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_with_node(
        dir.path(),
        NodeCapture {
            setting: Setting::Strict,
            enforce: true,
            ..NodeCapture::default()
        },
    )
    .await;
    for (annotation, value) in [
        ("flock.io/capture", "off"),
        ("flock.io/capture", "permissive"),
        ("flock.io/capture-exclude-inbound-ports", "6060"),
    ] {
        let mut req = input("c1", Some("web"), "8080");
        req.annotations.insert(annotation.into(), value.into());
        match agent.add_pod(&req).await {
            Err(PodError::Invalid(m)) => assert!(
                m.contains(annotation) && m.contains("--capture-enforce"),
                "{annotation}: {value}: {m}"
            ),
            other => {
                panic!("{annotation}: {value} on an enforcing node was not refused: {other:?}")
            }
        }
    }
    assert!(agent.pods().is_empty());
    assert!(
        PodStore::open(dir.path())
            .unwrap()
            .load_all()
            .unwrap()
            .pods
            .is_empty()
    );
}

/// Bad capture annotations are refused before anything is done, naming the
/// annotation and quoting the value.
#[tokio::test]
async fn bad_capture_annotations_are_refused_precisely() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_with(dir.path(), Setting::Strict).await;
    for (annotation, value, expect) in [
        (
            "flock.io/capture",
            "enforcing",
            "\"enforcing\" is not a capture mode",
        ),
        (
            "flock.io/capture-exclude-outbound-ports",
            "5432,mysql",
            "\"mysql\" is not a port",
        ),
        (
            "flock.io/capture-exclude-outbound-cidrs",
            "10.0.0.0/40",
            "\"10.0.0.0/40\" is not an IP address or prefix",
        ),
        (
            "flock.io/capture-exclude-inbound-ports",
            "0",
            "\"0\" is not a port",
        ),
    ] {
        let mut req = input("c1", Some("web"), "8080");
        req.annotations.insert(annotation.into(), value.into());
        match agent.add_pod(&req).await {
            Err(PodError::Invalid(m)) => {
                assert!(m.contains(annotation) && m.contains(expect), "{m}")
            }
            other => panic!("{annotation}={value}: expected INVALID, got {other:?}"),
        }
    }
    assert!(agent.pods().is_empty());
}

/// A captured pod whose rules cannot be installed (its netns path does not exist)
/// fails AddPod at `CaptureApply` — the step right after the store write — and the
/// rollback leaves nothing: no record stored or held, no registration, no xDS.
#[tokio::test]
async fn a_failing_capture_apply_fails_add_at_its_step_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let agent = agent_with(dir.path(), Setting::Strict).await;
    let mut req = input("c1", Some("web"), "8080");
    req.netns = "/nonexistent/flock-test/netns".into();
    match agent.add_pod(&req).await {
        Err(PodError::Step { step, message }) => {
            assert_eq!(step, Step::CaptureApply);
            assert!(
                message.contains("/nonexistent/flock-test/netns"),
                "{message}"
            );
        }
        other => panic!("expected a CaptureApply failure, got {other:?}"),
    }
    assert!(agent.pods().is_empty());
    assert!(
        PodStore::open(dir.path())
            .unwrap()
            .load_all()
            .unwrap()
            .pods
            .is_empty(),
        "the rollback deletes the stored record"
    );
    assert!(agent.registry().view().borrow().endpoints.is_empty());
    assert!(
        !names(agent.as_ref(), LISTENER)
            .iter()
            .any(|n| n.contains("pod-c1")),
        "no listener of the failed pod"
    );
    assert_eq!(agent.metrics.capture.errors.load(Ordering::Relaxed), 1);
    assert_eq!(agent.metrics.capture.applied.load(Ordering::Relaxed), 0);
    assert_eq!(agent.metrics.pod_errors.load(Ordering::Relaxed), 1);
}

/// The xDS pod model of a captured record carries its mode and the mark; the record's
/// capture is the node's settings with the pod's annotations and the CNI gateways.
#[test]
fn a_captured_records_pod_model_carries_mode_and_mark() {
    let cfg = NodeCapture {
        setting: Setting::Strict,
        exclude_outbound_ports: vec![5432],
        ..NodeCapture::default()
    };
    let mut req = input("c1", Some("web"), "8080");
    req.gateways = vec!["10.1.0.1".into()];
    req.annotations
        .insert("flock.io/capture".into(), "permissive".into());
    req.annotations.insert(
        "flock.io/capture-exclude-outbound-ports".into(),
        "6379".into(),
    );
    let pod = flock_core::pod::admit(&req).unwrap().unwrap();
    let capture = flock_core::capture::policy::resolve(&cfg, &pod.capture, &pod.ports)
        .unwrap()
        .unwrap();
    assert_eq!(capture.mode, Mode::Permissive);
    assert_eq!(capture.exclude_outbound_ports, vec![5432, 6379]);
    // The gateway is never a probe source: only the link-local one kubelet is given.
    assert_eq!(
        capture.probe_sources,
        flock_core::capture::policy::default_probe_sources()
    );
    let mut rec = flock_bird::model::PodRecord::admitted(pod, flock_core::UnixMs::ZERO);
    rec.capture = Some(capture);
    let model = mesh::pod_model(&rec, None, &Default::default())
        .unwrap()
        .capture
        .unwrap();
    assert_eq!(model.mode, CaptureMode::Permissive);
    assert_eq!(model.mark, DEFAULT_CAPTURE_MARK);
    // The record round-trips through the store's encoding with its capture.
    let bytes = flock_bird::store::encode_record(&rec).unwrap();
    let name = flock_bird::store::file_name_for(&rec.key);
    let back = flock_bird::store::decode_record(&name, &bytes).unwrap();
    assert_eq!(back, rec);
}
