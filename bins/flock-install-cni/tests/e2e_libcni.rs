//! End to end through libcni (the library containerd and CRI-O use).
//!
//! Debian's `bridge` and `host-local` form the primary list in a temp conf dir; the real
//! installer patches it; the libcni driver runs it on a real network namespace with the
//! real `flock-cni` chained and talking to the in-test agent double. GC and STATUS
//! (which this libcni lacks) are run by exec'ing the plugin as the spec describes.

mod common;

use std::fs;
use std::io::Write;
use std::process::{Command, Stdio};

use common::e2e::*;
use common::*;
use flock_cni::testing::{Call, TestAgent};
use serde_json::{Value, json};

#[test]
fn libcni_add_check_del_with_flock_chained_on_a_real_netns() {
    let plugin_dir = required_env("FLOCK_CNI_PLUGIN_DIR");
    let plugin = plugin_binary();
    let mut inst = Installer::prepare();
    inst.plugin = plugin.clone();
    let ns = NetNs::new();
    let network = format!("flocke2e{}", std::process::id());
    let list_path = inst.path("10-bridge.conflist");
    let original = bridge_conflist(&ns, inst.tmp.path(), &network);
    fs::write(&list_path, &original).unwrap();
    let agent_sock = inst.tmp.path().join("agent.sock");
    let agent = TestAgent::start(&agent_sock).unwrap();
    let ours =
        json!({"type": "flock-cni", "agent_socket": agent_sock, "timeout_ms": 3000}).to_string();
    let mut inst = inst.start(&["--plugin-config", &ours]);
    wait_for("ready", WAIT, || inst.is_ready());
    let patched: Value = serde_json::from_str(&inst.read("10-bridge.conflist")).unwrap();
    assert_eq!(patched["plugins"][1]["type"], "flock-cni");

    let cni_path = format!("{}:{}", inst.bin.display(), plugin_dir.display());
    let cache = inst.tmp.path().join("cache");
    let list = list_path.to_str().unwrap();
    let netns = ns.path();
    let run = |args: &[&str]| {
        let out = cnitool(args, &cni_path, &cache);
        assert!(
            out.status.success(),
            "cnitool {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };

    // ADD: the chain's result is host-local's IP, unchanged by flock-cni.
    let result: Value =
        serde_json::from_str(&run(&["add", list, &netns, "ctr-1", "eth0"])).unwrap();
    let ip = result["ips"][0]["address"].as_str().unwrap().to_owned();
    assert!(
        ip.starts_with(&ns.subnet[..ns.subnet.len() - 4]),
        "{ip} not in {}",
        ns.subnet
    );
    assert!(
        ns.addresses().contains(ip.split('/').next().unwrap()),
        "IP not configured in the netns"
    );
    let calls = agent.calls();
    let Some(Call::Add(add)) = calls.first() else {
        panic!("no AddPod: {calls:?}")
    };
    assert_eq!(add.container_id, "ctr-1");
    assert_eq!(add.netns, netns);
    assert_eq!(add.ifname, "eth0");
    assert_eq!(add.ips[0].address, ip);
    assert_eq!(add.ips[0].interface_name, "eth0");
    let pod = add.pod.clone().unwrap();
    assert_eq!(
        (pod.name.as_str(), pod.namespace.as_str()),
        ("cart-1", "shop")
    );
    let prev: Value = serde_json::from_str(&add.prev_result_json).unwrap();
    assert_eq!(
        result, prev,
        "flock-cni must return the primary's result unchanged"
    );

    // CHECK through libcni (cniVersion 1.0.0 >= 0.4.0).
    run(&["check", list, &netns, "ctr-1", "eth0"]);
    assert!(
        agent
            .calls()
            .iter()
            .any(|c| matches!(c, Call::Check(r) if r.container_id == "ctr-1"))
    );

    // DEL twice.
    run(&["del", list, &netns, "ctr-1", "eth0"]);
    assert!(agent.pods().is_empty());
    run(&["del", list, &netns, "ctr-1", "eth0"]);

    // GC by exec (spec 1.1.0): a pod the runtime no longer lists is collected.
    run(&["add", list, &netns, "ctr-2", "eth0"]);
    assert_eq!(agent.pods().len(), 1);
    let gc_conf = json!({
        "cniVersion": "1.1.0", "name": network, "type": "flock-cni",
        "agent_socket": agent_sock, "cni.dev/valid-attachments": []
    });
    let exec = |command: &str, conf: &Value| {
        let mut child = Command::new(&plugin)
            .env_clear()
            .env("CNI_COMMAND", command)
            .env("CNI_PATH", &cni_path)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(conf.to_string().as_bytes())
            .unwrap();
        child.wait_with_output().unwrap()
    };
    let out = exec("GC", &gc_conf);
    assert!(
        out.status.success(),
        "GC: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(agent.pods().is_empty(), "GC did not collect ctr-2");
    run(&["del", list, &netns, "ctr-2", "eth0"]);

    // STATUS by exec: 0 with the agent, 50 without.
    let status_conf = json!({"cniVersion": "1.1.0", "name": network, "type": "flock-cni", "agent_socket": agent_sock});
    assert!(exec("STATUS", &status_conf).status.success());
    drop(agent);
    let out = exec("STATUS", &status_conf);
    let err: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        (out.status.code(), err["code"].as_u64()),
        (Some(1), Some(50))
    );

    // The installer leaves no trace.
    assert_eq!(inst.stop().code(), Some(0));
    let restored: Value = serde_json::from_str(&inst.read("10-bridge.conflist")).unwrap();
    assert_eq!(restored, serde_json::from_str::<Value>(&original).unwrap());
    assert!(!inst.bin.join("flock-cni").exists());
}
