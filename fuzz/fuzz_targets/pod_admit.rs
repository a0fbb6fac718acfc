//! The one pod validator (`flock_core::pod::admit`), fed what a container runtime and
//! the pod's annotations can put in a CNI ADD: any fields give a pod or a reason, never
//! a panic. An admitted pod passes `validate` (what the store and the translation
//! check later), and a refusal names its field with a bounded message (values are
//! quoted by prefix, so a huge annotation cannot make a huge CNI error).
#![no_main]

use std::collections::BTreeMap;

use flock_core::pod::{
    AddRequest, PORTS_ANNOTATION, SERVICE_ACCOUNT_ANNOTATION, SERVICE_ANNOTATION, admit, validate,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Fields are NUL-separated, in AddRequest order; the IPs field is comma-separated.
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
    let req = AddRequest {
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
    match admit(&req) {
        Ok(Some(pod)) => {
            if let Err(e) = validate(&pod.fields()) {
                panic!("admit accepted a pod that validate refuses: {e}");
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
