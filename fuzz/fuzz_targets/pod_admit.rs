//! The one pod validator (`flock_core::pod::admit`), fed what a container runtime and
//! the pod's annotations can put in a CNI ADD: any fields give a pod or a reason, never
//! a panic. An admitted pod passes `validate` (what the store and the translation
//! check later), and a refusal names its field with a bounded message (values are
//! quoted by prefix, so a huge annotation cannot make a huge CNI error).
//!
//! The capture annotations (`flock.io/capture`, `flock.io/capture-exclude-*`) are among
//! them, and an admitted pod's capture is resolved against a node's settings (never
//! exempting the CNI result's gateways) as the agent does (`flock_core::capture::policy::resolve`,
//! after `admit`): a resolved capture gives rules for the pod's ports, holds the pod's
//! and the node's exclusions within the limit, and its mode is the pod's choice or the
//! node's; a refusal names a capture annotation, briefly.
#![no_main]

use std::collections::BTreeMap;

use flock_core::capture::policy::{
    ANNOTATIONS, NodeCapture, Setting, default_probe_sources, resolve,
};
use flock_core::capture::{Cidr, MAX_SPEC_ENTRIES};
use flock_core::pod::{
    AddRequest, PORTS_ANNOTATION, SERVICE_ACCOUNT_ANNOTATION, SERVICE_ANNOTATION, admit, validate,
};
use libfuzzer_sys::fuzz_target;

/// A capture annotation field holding just this (SOH) is an absent annotation.
const ABSENT: &str = "\u{1}";

fuzz_target!(|data: &[u8]| {
    // Fields are NUL-separated, in AddRequest order; the IPs field is comma-separated.
    // After the network name: the four capture annotations (in `ANNOTATIONS` order; a
    // missing field or one of `ABSENT` is an absent annotation, an empty one an empty
    // annotation), the CNI result's gateways (comma-separated) and the node's settings
    // (one byte, `node_capture`).
    let text = String::from_utf8_lossy(data);
    let mut f = text.split('\0').map(str::to_string);
    let mut next = || f.next().unwrap_or_default();
    let (container_id, ifname, netns, name, namespace, uid) =
        (next(), next(), next(), next(), next(), next());
    let ips = next();
    let mut annotations = BTreeMap::new();
    annotations.insert(SERVICE_ANNOTATION.to_string(), next());
    let ports = next();
    if !ports.is_empty() {
        annotations.insert(PORTS_ANNOTATION.to_string(), ports);
    }
    let account = next();
    if !account.is_empty() {
        annotations.insert(SERVICE_ACCOUNT_ANNOTATION.to_string(), account);
    }
    let mut req = AddRequest {
        container_id,
        ifname,
        netns,
        name,
        namespace,
        uid,
        ips: if ips.is_empty() {
            Vec::new()
        } else {
            ips.split(',').map(str::to_string).collect()
        },
        gateways: Vec::new(),
        annotations,
        network_name: next(),
    };
    for name in ANNOTATIONS {
        if let Some(value) = f.next().filter(|v| v != ABSENT) {
            req.annotations.insert(name.to_string(), value);
        }
    }
    let gateways = f.next().unwrap_or_default();
    if !gateways.is_empty() {
        req.gateways = gateways.split(',').map(str::to_string).collect();
    }
    let node = node_capture(f.next().and_then(|n| n.bytes().next()).unwrap_or(0));
    match admit(&req) {
        Ok(Some(pod)) => {
            if let Err(e) = validate(&pod.fields()) {
                panic!("admit accepted a pod that validate refuses: {e}");
            }
            match resolve(&node, &pod.capture, &pod.ports) {
                Ok(None) => assert_eq!(pod.capture.setting.unwrap_or(node.setting), Setting::Off),
                Ok(Some(capture)) => {
                    let setting = pod.capture.setting.unwrap_or(node.setting);
                    assert_eq!(Some(capture.mode), setting.mode());
                    assert_ne!(node.setting, Setting::Off, "captured on a node that cannot");
                    if let Err(e) = capture.check(&pod.ports) {
                        panic!("resolved a capture that gives no rules: {e}");
                    }
                    for list in [
                        capture.exclude_outbound_ports.len(),
                        capture.exclude_outbound_cidrs.len(),
                        capture.exclude_inbound_ports.len(),
                        capture.probe_sources.len(),
                    ] {
                        assert!(list <= MAX_SPEC_ENTRIES);
                    }
                    for port in node
                        .exclude_outbound_ports
                        .iter()
                        .chain(&pod.capture.exclude_outbound_ports)
                    {
                        assert!(capture.exclude_outbound_ports.contains(port));
                    }
                    for cidr in &pod.capture.exclude_outbound_cidrs {
                        assert!(capture.exclude_outbound_cidrs.contains(cidr));
                    }
                    for port in &pod.capture.exclude_inbound_ports {
                        assert!(capture.exclude_inbound_ports.contains(port));
                    }
                    if node.probe_sources.is_empty() {
                        // Never the gateways: only the link-local probe source.
                        assert_eq!(capture.probe_sources, default_probe_sources());
                    } else {
                        assert_eq!(capture.probe_sources, node.probe_sources);
                    }
                }
                Err(e) => {
                    assert!(ANNOTATIONS.contains(&e.annotation), "{}", e.annotation);
                    let shown = e.to_string();
                    assert!(
                        shown.len() < 4096,
                        "a refusal must stay short: {} bytes",
                        shown.len()
                    );
                }
            }
        }
        Ok(None) => {}
        Err(e) => {
            let shown = e.to_string();
            assert!(!shown.is_empty());
            assert!(
                shown.len() < 4096,
                "a refusal must stay short: {} bytes",
                shown.len()
            );
        }
    }
});

/// A node's capture settings from one byte: the mode (off, strict, permissive), whether
/// it names a probe source, and whether its outbound port exclusions are near the
/// limit (so a pod's own can exceed it), and whether it enforces its capture.
fn node_capture(b: u8) -> NodeCapture {
    let mut node = NodeCapture {
        setting: [Setting::Off, Setting::Strict, Setting::Permissive][usize::from(b % 3)],
        ..NodeCapture::default()
    };
    if (b / 3) % 2 == 1 {
        node.probe_sources = vec![Cidr::host("10.0.0.1".parse().unwrap())];
    }
    if (b / 6) % 2 == 1 {
        node.exclude_outbound_ports = (1..=250).collect();
    }
    node.enforce = (b / 12) % 2 == 1 && node.setting != Setting::Off;
    node.validate().expect("the fuzz node's settings are valid");
    node
}
