//! The plugin's stdin parser: any bytes → a `NetConf` or a CNI error with a code, never
//! a panic; accepted configs go through the result helpers ADD uses.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = flock_cni::cni::declared_version(data);
    match flock_cni::cni::parse_netconf(data) {
        Ok(conf) => {
            let _ = conf.annotations();
            if let Some(prev) = &conf.prev_result {
                let _ = flock_cni::cni::result_ips(prev);
                for v in flock_cni::cni::SUPPORTED_VERSIONS {
                    if let Ok(out) = flock_cni::cni::result_at_version(prev, v) {
                        assert_eq!(out.get("cniVersion").and_then(|x| x.as_str()), Some(v));
                    }
                }
            }
        }
        Err(e) => {
            let json = e.to_json("1.1.0");
            assert!(serde_json::from_slice::<serde_json::Value>(&json).is_ok());
        }
    }
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = flock_cni::cni::parse_cni_args(s);
        let _ = flock_cni::cni::validate_container_id(s);
        let _ = flock_cni::cni::validate_ifname(s);
    }
});
