//! One etcd registry entry written by any node: arbitrary key and value bytes → an
//! endpoint or a closed-set reason, never a panic; and every endpoint it accepts forms
//! a service the translation model accepts (so no single entry can take its service
//! down), under its own key, with a bounded error message otherwise.
#![no_main]

use flock_core::registry::Trust;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first line is the key (relative to the prefix), the rest the value.
    let (key, value) = match data.iter().position(|b| *b == b'\n') {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &[][..]),
    };
    let Ok(key) = std::str::from_utf8(key) else {
        return;
    };
    let trust = Trust {
        local_node: "node-a",
        trust_domain: Some("cluster.local"),
        scope: None,
    };
    match flock_bird::registry::decode_entry(key, value, &trust) {
        Ok(ep) => {
            assert_eq!(ep.key(), key, "accepted under another key");
            let mesh = flock_xds::translate::Mesh {
                services: flock_bird::agent::mesh::service_models([&ep]),
                ..Default::default()
            };
            if let Err(e) = mesh.validate() {
                panic!("accepted entry {ep:?} forms an invalid service: {e:?}");
            }
        }
        Err(r) => assert!(r.detail.len() < 4096, "unbounded message: {}", r.detail),
    }
});
