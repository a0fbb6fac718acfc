//! The mesh on one machine, end to end with every real peer:
//!
//! the real `flock-install-cni` patches a Debian `bridge` + `host-local` conflist; the
//! libcni driver (what containerd and CRI-O use) ADDs two pods in real network
//! namespaces, passing pod annotations as the `io.kubernetes.cri.pod-annotations`
//! capability; the chained real `flock-cni` reports them to the real `flock-agent`;
//! a real Envoy under `flock-supervisor` gets their listeners and clusters over Delta
//! ADS; an HTTP request from pod A to service `web` goes through A's outbound listener
//! (in A's netns), B's EDS endpoint and inbound listener (in B's netns) and the app
//! cluster to B's server on B's loopback. DEL of B removes it from Envoy's
//! `/config_dump`, the registry and the store: no ghost. `flockctl pods` / `snapshot`
//! (docs/walkthrough.md, "Trying the agent") run against the agent on the way. The
//! agent runs with every Linux capability but `CAP_SYS_ADMIN` dropped on every thread, and its
//! liveness probes (setns into B's netns) still work.
//!
//! Needs root, `FLOCK_ENVOY_BIN`, `FLOCK_CNI_PLUGIN_DIR`, `FLOCK_CNITOOL` (scripts/test
//! or scripts/prereqs/10-envoy.sh + 20-cni.sh) and the sibling binaries built (see
//! `common`).

mod common;

use common::*;
use flock_core::pod::PodKey;
use serde_json::{Value, json};
use std::time::Duration;

/// Outbound listener in every pod's netns (flock_bird::model::OUTBOUND_PORT).
const OUTBOUND: &str = "127.0.0.1:15001";
const BODY: &str = "hello from web-0";

/// `curl` inside `ns` to the outbound listener with `Host: host`: (HTTP status, body);
/// status 0 when curl could not connect.
fn request_via_outbound(ns: &NetNs, host: &str) -> (u16, String) {
    let out = ns
        .command("curl")
        .args(["-sS", "-m", "5", "-o", "-", "-w", "\n%{http_code}", "-H"])
        .arg(format!("Host: {host}"))
        .arg(format!("http://{OUTBOUND}/"))
        .output()
        .expect("curl is needed (apt-get install curl)");
    let text = String::from_utf8_lossy(&out.stdout);
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", &text));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

fn ip_of(add_result: &str) -> String {
    let v: Value = serde_json::from_str(add_result).unwrap();
    let cidr = v["ips"][0]["address"]
        .as_str()
        .expect("an IP in the ADD result");
    cidr.split('/').next().unwrap().to_owned()
}

fn registry_addresses(agent: &Agent) -> Vec<String> {
    let reg = agent.json("/debug/registry");
    let eps: Vec<Value> = match &reg["endpoints"] {
        Value::Array(a) => a.clone(),
        Value::Object(m) => m.values().cloned().collect(),
        other => panic!("/debug/registry endpoints: {other}"),
    };
    eps.iter()
        .map(|e| format!("{}:{}", e["address"].as_str().unwrap_or(""), e["port"]))
        .collect()
}

#[test]
fn two_pods_through_libcni_agent_and_supervised_envoy_then_del_leaves_no_ghost() {
    // Peers first: fail (never skip) with how to get them.
    let _ = required_env("FLOCK_CNI_PLUGIN_DIR");
    let _ = required_env("FLOCK_CNITOOL");
    let _ = envoy_bin();
    for b in [
        "flockctl",
        "flock-cni",
        "flock-install-cni",
        "flock-supervisor",
    ] {
        let _ = sibling_bin(b);
    }

    let agent = Agent::start(&[]);
    let envoy = SupervisedEnvoy::start(&agent);

    // The installer patches a bridge + host-local list; flock-cni declares the pod
    // annotations capability so libcni passes them in runtimeConfig.
    let work = tempfile::Builder::new()
        .prefix("flock-mesh-")
        .tempdir()
        .unwrap();
    let conf_dir = work.path().join("net.d");
    std::fs::create_dir(&conf_dir).unwrap();
    let bridge = Bridge::new();
    let network = format!("flockmesh{}", std::process::id());
    let list_path = conf_dir.join("10-mesh.conflist");
    let original = bridge_conflist(&bridge, &work.path().join("ipam"), &network);
    std::fs::write(&list_path, original.to_string()).unwrap();
    let plugin_config = json!({
        "type": "flock-cni",
        "agent_socket": agent.cni_socket,
        "timeout_ms": 5000,
        "capabilities": {"io.kubernetes.cri.pod-annotations": true}
    });
    let installer = Installer::start(&conf_dir, work.path(), &plugin_config);
    let patched: Value = wait_for("the conflist patched", WAIT, || {
        let v: Value = serde_json::from_str(&std::fs::read_to_string(&list_path).ok()?).ok()?;
        (v["plugins"][1]["type"] == "flock-cni").then_some(v)
    });
    assert_eq!(patched["plugins"].as_array().unwrap().len(), 2, "{patched}");
    assert_eq!(
        patched["plugins"][1]["capabilities"]["io.kubernetes.cri.pod-annotations"], true,
        "{patched}"
    );
    let cni = Cni::new(
        list_path.clone(),
        &installer.bin_dir,
        work.path().join("cache"),
    );

    // Pod B's app: a real HTTP server inside B's netns on 8080, up before the ADD (as
    // a pod's app would be soon after; the agent probes it).
    let ns_a = NetNs::new("a");
    let ns_b = NetNs::new("b");
    let mut server = http_server_in(&ns_b, 8080, BODY, work.path().join("web-0.log"));

    // ADD both through libcni.
    let pod_a = PodSpec {
        namespace: "default",
        name: "client-0",
        uid: "uid-a",
        annotations: json!({"flock.io/service": "client"}),
    };
    let pod_b = PodSpec {
        namespace: "default",
        name: "web-0",
        uid: "uid-b",
        annotations: json!({"flock.io/service": "web", "flock.io/ports": "8080/http"}),
    };
    let ip_a = ip_of(&cni.ok("add", &ns_a, "ctr-a", &pod_a));
    let ip_b = ip_of(&cni.ok("add", &ns_b, "ctr-b", &pod_b));
    assert_ne!(ip_a, ip_b);

    // The agent holds both, B's endpoint is registered, both are stored.
    let pods = agent.json("/debug/pods");
    let pods = pods["pods"].as_array().unwrap();
    assert_eq!(pods.len(), 2, "{pods:?}");
    let web = pods.iter().find(|p| p["pod"] == "default/web-0").unwrap();
    assert_eq!(web["service"], "web");
    assert_eq!(web["ips"][0], ip_b.as_str());
    assert_eq!(web["netns"], ns_b.path().as_str());
    assert_eq!(web["ports"][0]["app_port"], 8080);
    let client = pods
        .iter()
        .find(|p| p["pod"] == "default/client-0")
        .unwrap();
    assert_eq!(client["service"], "client");
    let b_endpoint = format!("{ip_b}:15006");
    wait_for("B's endpoint in /debug/registry", WAIT, || {
        registry_addresses(&agent).contains(&b_endpoint)
    });
    let key_b = PodKey::new("ctr-b", "eth0");
    let file_b = flock_bird::store::file_name_for(&key_b);
    let files = agent.store_files();
    assert_eq!(files.len(), 2, "{files:?}");
    assert!(files.contains(&file_b), "{files:?} lacks {file_b}");

    // Envoy got the listeners and clusters over Delta ADS.
    let inbound_b = "inbound|default/web-0|8080";
    let dump = wait_for(
        "Envoy's config_dump to hold both pods and web",
        WAIT,
        || {
            let d = envoy.config_dump();
            (d.contains("outbound|8080|web.default")
                && d.contains(inbound_b)
                && d.contains("outbound|default/client-0")
                && d.contains("outbound|default/web-0")
                && d.contains(&ip_b))
            .then_some(d)
        },
    );
    assert!(
        dump.contains(&ns_b.path()),
        "B's listener is not in B's netns"
    );

    // A → Host web → A's outbound listener → B_ip:15006 → app cluster → B's server.
    let (status, body) = wait_for("a request from A to web through Envoy", WAIT, || {
        let r = request_via_outbound(&ns_a, "web");
        (r.0 == 200).then_some(r)
    });
    assert_eq!((status, body.as_str()), (200, BODY));
    let (status, body) = request_via_outbound(&ns_a, "web.default.svc.cluster.local:8080");
    assert_eq!((status, body.as_str()), (200, BODY));

    // The agent runs with every capability but CAP_SYS_ADMIN dropped, on every thread
    // (effective, permitted, bounding; nothing inheritable or ambient), and its
    // liveness probes, which setns into B's netns, still decide B is healthy.
    const SYS_ADMIN: u64 = 1 << 21;
    wait_for("B's liveness to be decided healthy", WAIT, || {
        agent.json("/debug/pods")["pods"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pod"] == "default/web-0" && p["health"] == "healthy")
    });
    let threads = agent.thread_capabilities();
    assert!(threads.len() > 1, "{threads:?}");
    for (name, [inh, prm, eff, bnd, amb]) in &threads {
        assert_eq!((*inh, *amb), (0, 0), "thread {name}: {threads:x?}");
        for set in [prm, eff, bnd] {
            assert_eq!(*set & !SYS_ADMIN, 0, "thread {name}: {threads:x?}");
        }
    }

    // docs/walkthrough.md's "Trying the agent": flockctl against this agent.
    let out = agent.flockctl(&["pods"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "flockctl pods: {out:?}");
    assert!(
        text.contains("web-0") && text.contains("client-0") && text.contains(&ip_b),
        "flockctl pods:\n{text}"
    );
    let out = agent.flockctl(&["snapshot"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "flockctl snapshot: {out:?}");
    assert!(
        text.contains("outbound|8080|web.default") && text.contains(inbound_b),
        "flockctl snapshot:\n{text}"
    );

    // DEL B: gone from Envoy, the registry and the store.
    cni.ok("del", &ns_b, "ctr-b", &pod_b);
    let dump = wait_for("B gone from Envoy's config_dump", WAIT, || {
        let d = envoy.config_dump();
        (!d.is_empty()
            && !d.contains(inbound_b)
            && !d.contains("outbound|default/web-0")
            && !d.contains(&ip_b))
        .then_some(d)
    });
    assert!(dump.contains("outbound|default/client-0"), "A lost too");
    assert!(
        !registry_addresses(&agent).contains(&b_endpoint),
        "B still in /debug/registry"
    );
    let pods = agent.json("/debug/pods");
    assert_eq!(pods["pods"].as_array().unwrap().len(), 1, "{pods}");
    let files = agent.store_files();
    assert_eq!(files.len(), 1, "{files:?}");
    assert!(!files.contains(&file_b), "B's store file {file_b} is left");
    // B's server still runs, but nothing routes to it any more: Envoy answers itself.
    assert!(server.running());
    let (status, body) = wait_for("A's request to web to fail at Envoy", WAIT, || {
        let r = request_via_outbound(&ns_a, "web");
        matches!(r.0, 503 | 404).then_some(r)
    });
    assert_ne!(body, BODY, "status {status}");

    // DEL A too, then the agent stops cleanly.
    cni.ok("del", &ns_a, "ctr-a", &pod_a);
    wait_for("no pods left", WAIT, || {
        agent.json("/debug/pods")["pods"]
            .as_array()
            .is_some_and(|p| p.is_empty())
    });
    assert!(agent.store_files().is_empty());
    let mut agent = agent;
    assert_eq!(agent.proc.stop(Duration::from_secs(10)), Some(0));
    drop(envoy);
}
