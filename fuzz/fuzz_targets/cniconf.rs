//! Fuzzes `flock_core::cniconf` with arbitrary bytes as a config file.
//!
//! For each kind the input parses as: patch → the output parses → patching it again
//! changes nothing (same bytes) → unpatching it gives back what unpatching the input
//! gives (the input itself when it held none of ours). `decide` runs on the raw bytes
//! under several file names, and a `Write` it returns is recognised as our own write
//! and as already patched. Nothing may panic.
#![no_main]

use flock_core::cniconf::{
    Action, ConfPolicy, ConfigKind, InstallPolicy, Ledger, OurPlugin, count_ours, decide, dropin,
    parse, parse_plugin_entry, patch, semantically_equal, unpatch, unpatch_to_conf,
};
use libfuzzer_sys::fuzz_target;

const ENTRY: &[u8] = br#"{"type": "flock-cni", "agent_socket": "/run/flock/cni.sock"}"#;

fn ours() -> OurPlugin {
    OurPlugin::from_bytes(ENTRY).expect("the fuzz target's own entry is valid")
}

fn check_patch_round_trip(data: &[u8], kind: ConfigKind, ours: &OurPlugin) {
    let Ok(input) = parse(data, kind) else { return };
    // Printing and re-parsing is lossless.
    let reprinted = parse(&input.to_bytes(), kind).expect("printed config parses");
    assert!(semantically_equal(&reprinted, &input));
    assert_eq!(reprinted.to_bytes(), input.to_bytes());

    let _ = dropin(&input, ours).map(|d| {
        assert_eq!(
            &parse_plugin_entry(&d.bytes).expect("drop-in parses"),
            ours.entry()
        );
    });

    let Ok(patched) = patch(&input, ours, ConfPolicy::ConvertToList) else {
        return;
    };
    let bytes = patched.config.to_bytes();
    let reread = parse(&bytes, ConfigKind::ConfList).expect("patched output parses");
    assert_eq!(count_ours(&reread, ours), 1);
    let again = patch(&reread, ours, ConfPolicy::ConvertToList).expect("patched output patches");
    assert!(!again.changed, "patching the patched output changed it");
    assert_eq!(
        again.config.to_bytes(),
        bytes,
        "patch is not byte-idempotent"
    );

    match (unpatch(&reread, ours), unpatch(&input, ours)) {
        (Ok(restored), Ok(expected)) => {
            assert!(semantically_equal(&restored.config, &expected.config));
            if count_ours(&input, ours) == 0 {
                assert!(semantically_equal(&restored.config, &input));
            }
        }
        // A list of nothing but ours: neither can be unpatched.
        (Err(_), Err(_)) => {}
        (a, b) => panic!("unpatch disagrees: {a:?} vs {b:?}"),
    }
    if patched.converted_from_conf {
        let back = unpatch_to_conf(&reread, ours)
            .expect("unpatch")
            .expect("a converted .conf");
        assert_eq!(back.to_bytes(), input.to_bytes());
    }
}

fn check_decide(data: &[u8], policy: &InstallPolicy) {
    for path in [
        "/etc/cni/net.d/10-x.conflist",
        "/etc/cni/net.d/10-x.conf",
        "/etc/cni/net.d/x.json",
        "/etc/cni/net.d/kubeconfig",
    ] {
        let mut ledger = Ledger::new();
        match decide(path, data, &ledger, policy) {
            Action::Write {
                bytes,
                file_name_change,
            } => {
                let written = file_name_change.map_or(path.to_owned(), |c| c.new_path);
                ledger.record(&written, &bytes);
                assert_eq!(
                    decide(&written, &bytes, &ledger, policy),
                    Action::IgnoreOwnWrite
                );
                assert_eq!(
                    decide(&written, &bytes, &Ledger::new(), policy),
                    Action::AlreadyPatched
                );
            }
            Action::AlreadyPatched => {
                ledger.record(path, data);
                assert_eq!(decide(path, data, &ledger, policy), Action::IgnoreOwnWrite);
            }
            Action::Skip(reason) => {
                let _ = reason.to_string();
            }
            Action::IgnoreOwnWrite => panic!("empty ledger but IgnoreOwnWrite"),
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let ours = ours();
    check_patch_round_trip(data, ConfigKind::Conf, &ours);
    check_patch_round_trip(data, ConfigKind::ConfList, &ours);
    let policy = InstallPolicy {
        ours,
        conf_policy: ConfPolicy::ConvertToList,
    };
    check_decide(data, &policy);
});
