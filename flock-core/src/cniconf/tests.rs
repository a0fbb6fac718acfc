//! Unit tests: one per installer scenario of docs/cni.md that is a pure decision, plus the
//! building blocks.

use serde_json::{Value, json};

use super::*;

const DIR: &str = "/etc/cni/net.d";

fn ours() -> OurPlugin {
    OurPlugin::new(json!({"type": "flock-cni", "agent_socket": "/run/flock/cni.sock"})).unwrap()
}

fn policy(conf_policy: ConfPolicy) -> InstallPolicy {
    InstallPolicy {
        ours: ours(),
        conf_policy,
    }
}

fn calico() -> Vec<u8> {
    br#"{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {"type": "calico", "log_level": "info", "mtu": 1440, "ipam": {"type": "calico-ipam"}},
    {"type": "portmap", "snat": true, "capabilities": {"portMappings": true}}
  ],
  "x-extra": {"nested": [1, 2.5, null, "s"]}
}
"#
    .to_vec()
}

fn list(bytes: &[u8]) -> CniConfig {
    parse(bytes, ConfigKind::ConfList).unwrap()
}

fn path(name: &str) -> String {
    format!("{DIR}/{name}")
}

fn skip_reason(action: Action) -> SkipReason {
    match action {
        Action::Skip(reason) => reason,
        other => panic!("expected Skip, got {other:?}"),
    }
}

fn write_bytes(action: Action) -> (Vec<u8>, Option<FileNameChange>) {
    match action {
        Action::Write {
            bytes,
            file_name_change,
        } => (bytes, file_name_change),
        other => panic!("expected Write, got {other:?}"),
    }
}

// ---- file names -------------------------------------------------------------------

#[test]
fn file_names_follow_libcni_conf_files() {
    use ConfigKind::*;
    let cases = [
        ("10-calico.conflist", Some(ConfList)),
        ("10-flannel.conf", Some(Conf)),
        ("99-bridge.json", Some(Conf)),
        ("/etc/cni/net.d/05-cilium.conflist", Some(ConfList)),
        (".conf", Some(Conf)), // Go's filepath.Ext(".conf") is ".conf"
        ("ZZZ-flock-kubeconfig", None),
        ("flock-kubeconfig", None),
        ("10-calico.conflist.tmp", None),
        ("10-calico.conf.tmp", None),
        (".10-calico.conflist.flock-tmp", None),
        ("10-calico.CONF", None),
        ("10-calico.conflist~", None),
        ("10-calico.conf.bak", None),
        ("calico", None),
        ("dir.conf/file", None),
        ("", None),
    ];
    for (name, want) in cases {
        assert_eq!(kind_for_file_name(name), want, "{name}");
    }
}

#[test]
fn conf_names_convert_to_conflist_names() {
    assert_eq!(
        conflist_file_name_for("10-flannel.conf").as_deref(),
        Some("10-flannel.conflist")
    );
    assert_eq!(
        conflist_file_name_for("/d/99-x.json").as_deref(),
        Some("/d/99-x.conflist")
    );
    assert_eq!(conflist_file_name_for("10-calico.conflist"), None);
    assert_eq!(conflist_file_name_for("kubeconfig"), None);
    // <stem>.conf sorts right before <stem>.conflist: the network keeps its priority.
    assert!("10-flannel.conf" < "10-flannel.conflist");
}

#[test]
fn temp_names_are_never_loaded() {
    for name in [
        "10-calico.conflist",
        "10-flannel.conf",
        "x.json",
        DROPIN_FILE_NAME,
    ] {
        let tmp = temp_file_name_for(name);
        assert_eq!(kind_for_file_name(&tmp), None, "{tmp}");
        assert!(tmp.starts_with('.'));
    }
    assert_eq!(temp_file_name_for("/d/a.conf"), ".a.conf.flock-tmp");
}

// ---- versions -----------------------------------------------------------------------

#[test]
fn versions_parse_like_libcni() {
    assert_eq!(CniVersion::parse(""), Some(CniVersion::new(0, 1, 0)));
    assert_eq!(CniVersion::parse("1.0.0"), Some(CniVersion::new(1, 0, 0)));
    assert_eq!(CniVersion::parse("0.4"), Some(CniVersion::new(0, 4, 0)));
    assert_eq!(CniVersion::parse("1"), Some(CniVersion::new(1, 0, 0)));
    for bad in ["1.0.0.0", "a.b", "1..0", "1.0.", "v1", "-1", " 1"] {
        assert_eq!(CniVersion::parse(bad), None, "{bad}");
    }
    assert!(CniVersion::new(0, 3, 0) > CniVersion::new(0, 2, 9));
    assert_eq!(CniVersion::new(1, 1, 0).to_string(), "1.1.0");
}

#[test]
fn cni_versions_pick_the_highest_supported() {
    let c = list(br#"{"name":"n","cniVersion":"0.2.0","cniVersions":["0.4.0","1.0.0","9.9.9"],"plugins":[{"type":"a"}]}"#);
    assert_eq!(c.effective_cni_version().unwrap(), CniVersion::new(1, 0, 0));
    let c = list(br#"{"name":"n","cniVersions":["0.1.0"],"plugins":[{"type":"a"}]}"#);
    assert_eq!(c.effective_cni_version().unwrap(), CniVersion::new(0, 1, 0));
    let err = parse(
        br#"{"name":"n","cniVersions":["x"],"plugins":[{"type":"a"}]}"#,
        ConfigKind::ConfList,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "cniVersions[0] is not a valid CNI version: \"x\""
    );
}

// ---- parse errors: precise messages -------------------------------------------------

#[test]
fn error_messages_say_what_and_where() {
    let cases: Vec<(&[u8], ConfigKind, &str)> = vec![
        (
            br#"{"name":"n","cniVersion":"1.0.0","plugins":[{"type":"a"},{"type":"b"},"c"]}"#,
            ConfigKind::ConfList,
            "plugins[2] is a string, not a JSON object",
        ),
        (
            br#"{"cniVersion":"1.0.0","plugins":[{"type":"a"}]}"#,
            ConfigKind::ConfList,
            "missing network \"name\"",
        ),
        (
            br#"{"cniVersion":"1.0.0","type":"bridge"}"#,
            ConfigKind::Conf,
            "missing network \"name\"",
        ),
        (
            br#"{"name":"n","plugins":[{"type":7}]}"#,
            ConfigKind::ConfList,
            "plugins[0].type is a number, not a string",
        ),
        (
            br#"{"name":"n","plugins":[{"x":1}]}"#,
            ConfigKind::ConfList,
            "plugins[0] is missing \"type\" (a non-empty string naming the plugin binary)",
        ),
        (
            br#"{"name":"n","plugins":[{"type":""}]}"#,
            ConfigKind::ConfList,
            "plugins[0] is missing \"type\" (a non-empty string naming the plugin binary)",
        ),
        (
            br#"{"name":"n","plugins":{}}"#,
            ConfigKind::ConfList,
            "\"plugins\" is an object, not a JSON array",
        ),
        (
            br#"{"name":"n","plugins":[]}"#,
            ConfigKind::ConfList,
            "\"plugins\" is an empty array",
        ),
        (
            br#"{"name":"n","cniVersion":1,"plugins":[{"type":"a"}]}"#,
            ConfigKind::ConfList,
            "\"cniVersion\" is a number, not a string",
        ),
        (
            br#"{"name":"n","disableCheck":"yes","plugins":[{"type":"a"}]}"#,
            ConfigKind::ConfList,
            "\"disableCheck\" is the string \"yes\", not a boolean (or \"true\"/\"false\", as libcni accepts)",
        ),
        (
            br#"{"name":"n","plugins":[{"type":"a","capabilities":{"portMappings":"yes"}}]}"#,
            ConfigKind::ConfList,
            "plugins[0].capabilities.portMappings is a string, not a boolean (or \"true\"/\"false\", as libcni accepts)",
        ),
        (
            br#"{"name":"n","plugins":[{"type":"a","ipam":[]}]}"#,
            ConfigKind::ConfList,
            "plugins[0].ipam is an array, not a JSON object",
        ),
        (
            br#"[1,2]"#,
            ConfigKind::ConfList,
            "the top level is an array, not a JSON object",
        ),
        (
            br#"{"name":"n","type":"bridge","cniVersion":"1.0.0","name2":1,"ipam":{"type":3}}"#,
            ConfigKind::Conf,
            "\"ipam\".type is a number, not a string",
        ),
    ];
    for (bytes, kind, want) in cases {
        let err = parse(bytes, kind).unwrap_err();
        assert_eq!(err.to_string(), want, "{}", String::from_utf8_lossy(bytes));
    }
}

#[test]
fn size_limit_is_enforced_before_parsing() {
    let mut big = b"{\"name\":\"n\",\"plugins\":[{\"type\":\"a\"}],\"pad\":\"".to_vec();
    big.resize(MAX_CONFIG_BYTES - 2, b'x');
    big.extend_from_slice(b"\"}");
    assert_eq!(big.len(), MAX_CONFIG_BYTES);
    assert!(parse(&big, ConfigKind::ConfList).is_ok());
    big.insert(big.len() - 2, b'x');
    assert_eq!(
        parse(&big, ConfigKind::ConfList).unwrap_err().to_string(),
        "config is 1048577 bytes; the limit is 1048576"
    );
}

#[test]
fn byte_order_mark_is_rejected() {
    let mut bytes = vec![0xEF, 0xBB, 0xBF];
    bytes.extend_from_slice(&calico());
    assert_eq!(
        parse(&bytes, ConfigKind::ConfList).unwrap_err(),
        CniConfError::ByteOrderMark
    );
}

#[test]
fn inexact_numbers_are_refused_not_rounded() {
    let big = br#"{"name":"n","cniVersion":"1.0.0","plugins":[{"type":"a","id":123456789012345678901234567890}]}"#;
    let err = parse(big, ConfigKind::ConfList).unwrap_err();
    assert!(
        matches!(err, CniConfError::InexactNumber { ref token, .. } if token == "123456789012345678901234567890"),
        "{err}"
    );
    // Ordinary numbers, including u64 and negative i64 extremes, are fine.
    let ok = br#"{"name":"n","plugins":[{"type":"a","a":18446744073709551615,"b":-9223372036854775808,"c":0.1,"d":1e-7,"e":-0.0,"f":"1e999"}]}"#;
    let c = parse(ok, ConfigKind::ConfList).unwrap();
    let again = parse(&c.to_bytes(), ConfigKind::ConfList).unwrap();
    assert_eq!(again.to_bytes(), c.to_bytes());
}

#[test]
fn printer_matches_serde_json_pretty() {
    let v = json!({
        "a": [], "b": {}, "c": [1, -2, 3.5, 1e20, true, false, null],
        "d": "quote\" back\\ nl\n tab\t ctl\u{1} del\u{7f} é ✓",
        "e": {"f": [{"g": {}}]}
    });
    let Value::Object(object) = v.clone() else {
        unreachable!()
    };
    let config = CniConfig::from_object(ConfigKind::Conf, {
        let mut o = object;
        o.insert("type".into(), json!("t"));
        o.insert("name".into(), json!("n"));
        o
    })
    .unwrap();
    let mut want = serde_json::to_string_pretty(config.as_object()).unwrap();
    want.push('\n');
    assert_eq!(String::from_utf8(config.to_bytes()).unwrap(), want);
}

// ---- scenario 6: invalid files are skipped with a reason, never written ------------

#[test]
fn scenario6_invalid_files_are_skipped_with_a_reason() {
    let p = policy(ConfPolicy::ConvertToList);
    let ledger = Ledger::new();
    let cases: Vec<(&str, &[u8], &str)> = vec![
        (
            "10-a.conflist",
            b"{\"name\": \"n\", \"plugins\": [",
            "config is truncated",
        ),
        (
            "10-a.conflist",
            b"{\"name\": n}",
            "invalid CNI config, left untouched: config is not valid JSON",
        ),
        ("10-a.conflist", b"", "config is empty"),
        ("10-a.conflist", b"  \n", "config is empty"),
        (
            "10-a.conflist",
            br#"{"cniVersion":"1.0.0","name":"n"}"#,
            "invalid CNI config, left untouched: missing \"plugins\"",
        ),
        (
            "10-a.conf",
            br#"{"cniVersion":"1.0.0","name":"n"}"#,
            "invalid CNI config, left untouched: the config is missing \"type\"",
        ),
        (
            "10-a.conflist",
            br#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"},42]}"#,
            "invalid CNI config, left untouched: plugins[1] is a number, not a JSON object",
        ),
        (
            "10-a.json",
            br#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"}]}"#,
            "has \"plugins\" but no \"type\"",
        ),
    ];
    for (name, bytes, want) in cases {
        let reason = skip_reason(decide(&path(name), bytes, &ledger, &p));
        let text = reason.to_string();
        assert!(
            text.contains(want),
            "{name}: {text:?} should contain {want:?}"
        );
    }
    // Partial and empty files are "incomplete" (wait), the rest "invalid" (warn).
    assert!(matches!(
        skip_reason(decide(&path("a.conflist"), b"", &ledger, &p)),
        SkipReason::Incomplete(_)
    ));
    assert!(matches!(
        skip_reason(decide(&path("a.conflist"), b"{\"na", &ledger, &p)),
        SkipReason::Incomplete(_)
    ));
    assert!(matches!(
        skip_reason(decide(&path("a.conflist"), b"{]", &ledger, &p)),
        SkipReason::Invalid(_)
    ));
}

#[test]
fn literal_config_without_plugin_types_is_skipped() {
    // A config seen in the wild: its plugins have no "type", so libcni would
    // reject it; flock leaves it alone instead of chaining into it.
    let bytes = br#"{"cniVersion": "0.4.0", "name": "aws-cni", "disableCheck": true, "plugins": [{"name": "foo"}]}"#;
    let reason = skip_reason(decide(
        &path("01-foo.conflist"),
        bytes,
        &Ledger::new(),
        &policy(ConfPolicy::Skip),
    ));
    assert_eq!(
        reason,
        SkipReason::Invalid(CniConfError::MissingType {
            at: "plugins[0]".into()
        })
    );
}

#[test]
fn non_config_names_are_never_touched() {
    let p = policy(ConfPolicy::ConvertToList);
    for name in [
        "ZZZ-flock-kubeconfig",
        "10-calico.conflist.tmp",
        ".10-calico.conflist.flock-tmp",
    ] {
        assert_eq!(
            decide(&path(name), &calico(), &Ledger::new(), &p),
            Action::Skip(SkipReason::NotAConfigFile),
            "{name}"
        );
    }
}

// ---- scenario 5: non-atomic writers ----------------------------------------------

#[test]
fn scenario5_truncated_prefixes_never_write_and_the_complete_file_does() {
    let p = policy(ConfPolicy::ConvertToList);
    let full = calico();
    let complete_len = full.trim_ascii_end().len();
    for cut in 0..complete_len {
        let action = decide(
            &path("10-calico.conflist"),
            &full[..cut],
            &Ledger::new(),
            &p,
        );
        assert!(
            matches!(action, Action::Skip(_)),
            "prefix of {cut} bytes gave {action:?}"
        );
    }
    for cut in complete_len..=full.len() {
        let action = decide(
            &path("10-calico.conflist"),
            &full[..cut],
            &Ledger::new(),
            &p,
        );
        assert!(
            matches!(action, Action::Write { .. }),
            "complete at {cut} bytes gave {action:?}"
        );
    }
}

// ---- scenario 7: .conf primaries and cniVersion ----------------------------------

#[test]
fn scenario7_conf_converts_like_conf_list_from_conf() {
    let conf = br#"{"type":"bridge","cniVersion":"1.0.0","name":"mynet","bridge":"cni0","ipam":{"type":"host-local","subnet":"10.22.0.0/16"}}"#;
    let action = decide(
        &path("10-bridge.conf"),
        conf,
        &Ledger::new(),
        &policy(ConfPolicy::ConvertToList),
    );
    let (bytes, change) = write_bytes(action);
    assert_eq!(
        change,
        Some(FileNameChange {
            new_path: path("10-bridge.conflist")
        })
    );
    let written: Value = serde_json::from_slice(&bytes).unwrap();
    let original: Value = serde_json::from_slice(conf).unwrap();
    let want = json!({
        "cniVersion": "1.0.0",
        "name": "mynet",
        "plugins": [original, {"type": "flock-cni", "agent_socket": "/run/flock/cni.sock"}],
    });
    assert_eq!(written, want);
    // Key order is libcni's (Go sorts map keys): cniVersion, name, plugins; the original
    // object keeps its own order.
    let text = String::from_utf8(bytes.clone()).unwrap();
    assert!(text.starts_with("{\n  \"cniVersion\": \"1.0.0\",\n  \"name\": \"mynet\",\n  \"plugins\": [\n    {\n      \"type\": \"bridge\","));
    // The result is a valid .conflist, already patched, and converts back to the .conf.
    let converted = list(&bytes);
    assert!(is_patched(&converted, &ours()));
    let restored = unpatch_to_conf(&converted, &ours()).unwrap().unwrap();
    assert_eq!(restored.kind(), ConfigKind::Conf);
    assert_eq!(
        Value::Object(restored.as_object().clone()),
        serde_json::from_slice::<Value>(conf).unwrap()
    );
    assert_eq!(
        restored.to_bytes(),
        parse(conf, ConfigKind::Conf).unwrap().to_bytes()
    );
    assert!(semantically_equal(
        &restored,
        &parse(conf, ConfigKind::Conf).unwrap()
    ));
}

#[test]
fn scenario7_conf_skip_policy_is_explicit() {
    let conf = br#"{"type":"bridge","cniVersion":"1.0.0","name":"mynet"}"#;
    let reason = skip_reason(decide(
        &path("10-bridge.conf"),
        conf,
        &Ledger::new(),
        &policy(ConfPolicy::Skip),
    ));
    assert_eq!(reason, SkipReason::Refused(CniConfError::ConfSkipped));
}

#[test]
fn scenario7_cni_version_is_never_downgraded_and_old_versions_are_refused() {
    for v in ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0", "2.0.0"] {
        let bytes = format!(r#"{{"cniVersion":"{v}","name":"n","plugins":[{{"type":"a"}}]}}"#);
        let patched = patch(&list(bytes.as_bytes()), &ours(), ConfPolicy::Skip).unwrap();
        assert_eq!(patched.config.cni_version(), Some(v));
        let conf = format!(r#"{{"cniVersion":"{v}","name":"n","type":"a"}}"#);
        let conf = parse(conf.as_bytes(), ConfigKind::Conf).unwrap();
        let patched = patch(&conf, &ours(), ConfPolicy::ConvertToList).unwrap();
        assert_eq!(patched.config.cni_version(), Some(v));
    }
    for (v, declared) in [
        ("\"cniVersion\":\"0.2.0\",", "0.2.0"),
        ("\"cniVersion\":\"0.1.0\",", "0.1.0"),
        ("", ""),
    ] {
        let bytes = format!(r#"{{{v}"name":"n","plugins":[{{"type":"a"}}]}}"#);
        let err = patch(&list(bytes.as_bytes()), &ours(), ConfPolicy::Skip).unwrap_err();
        assert!(
            matches!(err, CniConfError::VersionTooOld { declared: ref d, .. } if d == declared),
            "{err}"
        );
        assert!(err.to_string().contains("older than 0.3.0"), "{err}");
    }
    let err = patch(
        &list(br#"{"cniVersion":"one","name":"n","plugins":[{"type":"a"}]}"#),
        &ours(),
        ConfPolicy::Skip,
    )
    .unwrap_err();
    assert_eq!(
        err.to_string(),
        "\"cniVersion\" is not a valid CNI version: \"one\""
    );
}

#[test]
fn scenario7_conf_that_is_our_own_plugin_is_refused() {
    let conf = parse(
        br#"{"type":"flock-cni","cniVersion":"1.0.0","name":"n"}"#,
        ConfigKind::Conf,
    )
    .unwrap();
    let err = patch(&conf, &ours(), ConfPolicy::ConvertToList).unwrap_err();
    assert!(matches!(err, CniConfError::PrimaryIsOurs { .. }));
}

// ---- scenario 8: duplicates and wrong positions ------------------------------------

#[test]
fn scenario8_duplicates_and_wrong_positions_become_exactly_one_last() {
    let entry = r#"{"type":"flock-cni","agent_socket":"/run/flock/cni.sock"}"#;
    let stale = r#"{"type":"flock-cni","agent_socket":"/old.sock"}"#;
    let shapes = [
        format!(r#"[{entry},{{"type":"calico"}},{{"type":"portmap"}}]"#),
        format!(r#"[{{"type":"calico"}},{entry},{{"type":"portmap"}}]"#),
        format!(r#"[{{"type":"calico"}},{entry},{{"type":"portmap"}},{entry}]"#),
        format!(r#"[{{"type":"calico"}},{{"type":"portmap"}},{entry},{entry}]"#),
        format!(r#"[{{"type":"calico"}},{{"type":"portmap"}},{stale}]"#),
        format!(r#"[{stale},{{"type":"calico"}},{stale},{{"type":"portmap"}},{stale}]"#),
    ];
    for plugins in shapes {
        let bytes = format!(r#"{{"cniVersion":"1.0.0","name":"n","plugins":{plugins}}}"#);
        let (out, change) = write_bytes(decide(
            &path("10-c.conflist"),
            bytes.as_bytes(),
            &Ledger::new(),
            &policy(ConfPolicy::Skip),
        ));
        assert_eq!(change, None);
        let patched = list(&out);
        assert_eq!(
            patched.plugin_types(),
            [Some("calico"), Some("portmap"), Some("flock-cni")],
            "{plugins}"
        );
        assert!(is_patched(&patched, &ours()));
        assert_eq!(count_ours(&patched, &ours()), 1);
    }
}

#[test]
fn already_patched_is_a_semantic_check() {
    // Our entry with its keys in another order and other formatting: still patched.
    let bytes = br#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"calico"},{"agent_socket":"/run/flock/cni.sock","type":"flock-cni"}]}"#;
    let c = list(bytes);
    assert!(is_patched(&c, &ours()));
    let p = patch(&c, &ours(), ConfPolicy::Skip).unwrap();
    assert!(!p.changed);
    assert_eq!(
        decide(
            &path("10-c.conflist"),
            bytes,
            &Ledger::new(),
            &policy(ConfPolicy::Skip)
        ),
        Action::AlreadyPatched
    );
}

#[test]
fn patch_keeps_everything_else_in_order() {
    let original = list(&calico());
    let patched = patch(&original, &ours(), ConfPolicy::Skip).unwrap();
    assert!(patched.changed && !patched.converted_from_conf);
    let keys: Vec<_> = patched.config.as_object().keys().collect();
    assert_eq!(keys, ["name", "cniVersion", "plugins", "x-extra"]);
    let text = String::from_utf8(patched.config.to_bytes()).unwrap();
    assert!(
        text.contains("\"type\": \"calico\",\n      \"log_level\": \"info\",\n      \"mtu\": 1440"),
        "{text}"
    );
    let again = patch(&list(text.as_bytes()), &ours(), ConfPolicy::Skip).unwrap();
    assert!(!again.changed);
    assert_eq!(again.config.to_bytes(), text.as_bytes());
    let restored = unpatch(&patched.config, &ours()).unwrap();
    assert!(restored.changed);
    assert!(semantically_equal(&restored.config, &original));
    assert!(!unpatch(&original, &ours()).unwrap().changed);
}

#[test]
fn unpatch_of_only_ours_is_an_error_and_lists_stay_lists() {
    let only = list(br#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"flock-cni"}]}"#);
    assert_eq!(unpatch(&only, &ours()).unwrap_err(), CniConfError::OnlyOurs);
    // A list that was not converted from a .conf is not turned into one.
    let edited = list(br#"{"cniVersion":"1.0.0","name":"n","disableCheck":true,"plugins":[{"type":"a","name":"n","cniVersion":"1.0.0"},{"type":"flock-cni"}]}"#);
    assert!(unpatch_to_conf(&edited, &ours()).unwrap().is_none());
    let two = list(br#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"a"},{"type":"b"}]}"#);
    assert!(unpatch_to_conf(&two, &ours()).unwrap().is_none());
}

#[test]
fn semantic_equality_ignores_key_order_and_number_spelling() {
    let a = list(br#"{"name":"n","cniVersion":"1.0.0","plugins":[{"type":"a","mtu":1500,"x":{"p":1,"q":2}}]}"#);
    let b = list(br#"{"plugins":[{"x":{"q":2,"p":1.0},"mtu":1500.0,"type":"a"}],"cniVersion":"1.0.0","name":"n"}"#);
    assert!(semantically_equal(&a, &b));
    let c = list(br#"{"name":"n","cniVersion":"1.0.0","plugins":[{"type":"a","mtu":1501,"x":{"p":1,"q":2}}]}"#);
    assert!(!semantically_equal(&a, &c));
    // Plugin order matters.
    let d = list(br#"{"name":"n","plugins":[{"type":"a"},{"type":"b"}]}"#);
    let e = list(br#"{"name":"n","plugins":[{"type":"b"},{"type":"a"}]}"#);
    assert!(!semantically_equal(&d, &e));
    // A .conf equals its ConfListFromConf form.
    let conf = parse(
        br#"{"type":"a","name":"n","cniVersion":"1.0.0"}"#,
        ConfigKind::Conf,
    )
    .unwrap();
    let as_list = list(br#"{"cniVersion":"1.0.0","name":"n","plugins":[{"cniVersion":"1.0.0","name":"n","type":"a"}]}"#);
    assert!(semantically_equal(&conf, &as_list));
}

// ---- our entry ---------------------------------------------------------------------

#[test]
fn our_entry_is_validated() {
    for bad in [
        json!("x"),
        json!({}),
        json!({"type": ""}),
        json!({"type": "../bin/sh"}),
        json!({"type": ".."}),
        json!({"type": 3}),
    ] {
        assert!(
            matches!(
                OurPlugin::new(bad.clone()),
                Err(CniConfError::InvalidOurEntry { .. })
            ),
            "{bad}"
        );
    }
    assert!(OurPlugin::from_bytes(b"{\"type\": \"flock-cni\"").is_err());
    assert_eq!(
        OurPlugin::from_bytes(b"{\"type\": \"flock-cni\"}")
            .unwrap()
            .plugin_type(),
        "flock-cni"
    );
}

// ---- ledger and decide ------------------------------------------------------------

#[test]
fn ledger_keeps_one_hash_per_file() {
    let mut ledger = Ledger::new();
    let a = ledger.record("/d/a.conflist", b"A");
    let b = ledger.record("/d/b.conflist", b"B");
    assert_eq!(ledger.get("/d/a.conflist"), Some(a));
    assert_eq!(ledger.get("/d/b.conflist"), Some(b));
    assert!(ledger.is_own_write("/d/a.conflist", b"A"));
    assert!(!ledger.is_own_write("/d/a.conflist", b"B"));
    assert_eq!(ledger.len(), 2);
    assert_eq!(ledger.forget("/d/a.conflist"), Some(a));
    assert_eq!(ledger.get("/d/a.conflist"), None);
    assert_eq!(ledger.get("/d/b.conflist"), Some(b));
}

#[test]
fn decide_recognises_own_writes_and_adopts_patched_files() {
    let p = policy(ConfPolicy::Skip);
    let name = path("10-calico.conflist");
    let mut ledger = Ledger::new();
    let (ours_bytes, _) = write_bytes(decide(&name, &calico(), &ledger, &p));
    ledger.record(&name, &ours_bytes);
    assert_eq!(
        decide(&name, &ours_bytes, &ledger, &p),
        Action::IgnoreOwnWrite
    );
    // The same content under another file is an external change, already patched.
    assert_eq!(
        decide(&path("20-other.conflist"), &ours_bytes, &ledger, &p),
        Action::AlreadyPatched
    );
    // An external rewrite of our file with the primary's content is re-patched.
    assert!(matches!(
        decide(&name, &calico(), &ledger, &p),
        Action::Write { .. }
    ));
}

// ---- scenario 17: drop-ins ----------------------------------------------------------

#[test]
fn dropin_is_named_after_the_network_and_loads_as_a_plugin() {
    let d = dropin(&list(&calico()), &ours()).unwrap();
    assert_eq!(d.dir_name, "k8s-pod-network");
    assert_eq!(d.file_name, "zz-flock.conf");
    assert_eq!(kind_for_file_name(&d.temp_file_name()), None);
    let entry = parse_plugin_entry(&d.bytes).unwrap();
    assert_eq!(&entry, ours().entry());
    assert!(d.bytes.ends_with(b"}\n"));
    assert!(d.sorts_last_among([
        "10-bandwidth.conf",
        "50-x.conf",
        "zz-flock.conf",
        "~backup",
        "zzz.conf.tmp"
    ]));
    assert!(!d.sorts_last_among(["zzz.conf"]));
    assert!(!d.sorts_last_among(["~late.conf"]));
}

#[test]
fn dropin_is_refused_when_libcni_would_not_run_it() {
    let inlined_only = list(br#"{"cniVersion":"1.0.0","name":"n","loadOnlyInlinedPlugins":true,"plugins":[{"type":"a"}]}"#);
    assert_eq!(
        dropin(&inlined_only, &ours()).unwrap_err(),
        CniConfError::LoadOnlyInlinedPlugins
    );
    let inlined_only = list(br#"{"cniVersion":"1.0.0","name":"n","loadOnlyInlinedPlugins":"TRUE","plugins":[{"type":"a"}]}"#);
    assert_eq!(
        dropin(&inlined_only, &ours()).unwrap_err(),
        CniConfError::LoadOnlyInlinedPlugins
    );
    let not_inlined_only = list(br#"{"cniVersion":"1.0.0","name":"n","loadOnlyInlinedPlugins":"false","plugins":[{"type":"a"}]}"#);
    assert!(dropin(&not_inlined_only, &ours()).is_ok());
    let conf = parse(
        br#"{"cniVersion":"1.0.0","name":"n","type":"a"}"#,
        ConfigKind::Conf,
    )
    .unwrap();
    assert_eq!(
        dropin(&conf, &ours()).unwrap_err(),
        CniConfError::DropInNeedsConfList
    );
    let inlined = patch(&list(&calico()), &ours(), ConfPolicy::Skip)
        .unwrap()
        .config;
    assert_eq!(
        dropin(&inlined, &ours()).unwrap_err(),
        CniConfError::AlreadyInlined
    );
    let old = list(br#"{"cniVersion":"0.2.0","name":"n","plugins":[{"type":"a"}]}"#);
    assert!(matches!(
        dropin(&old, &ours()).unwrap_err(),
        CniConfError::VersionTooOld { .. }
    ));
}

#[test]
fn dropin_directory_names_are_single_safe_components() {
    let long = "a".repeat(256);
    for bad in [
        "",
        ".",
        "..",
        "../etc",
        "a/b",
        "/abs",
        "a\0b",
        "-x",
        ".hidden",
        "a b",
        "é",
        long.as_str(),
    ] {
        let err = check_network_dir_name(bad).unwrap_err();
        assert!(
            matches!(err, CniConfError::UnsafeNetworkName { .. }),
            "{bad:?}"
        );
        let bytes =
            serde_json::to_vec(&json!({"cniVersion":"1.0.0","name": bad,"plugins":[{"type":"a"}]}))
                .unwrap();
        assert!(dropin(&list(&bytes), &ours()).is_err(), "{bad:?}");
    }
    for good in [
        "k8s-pod-network",
        "cbr0",
        "a",
        "aws-cni",
        "net_1.2",
        &"a".repeat(255),
    ] {
        check_network_dir_name(good).unwrap();
    }
}

#[test]
fn negative_zero_and_exponents_are_kept() {
    let c = list(br#"{"name":"n","plugins":[{"type":"a","z":-0,"e":1E5,"f":-1.5e-3}]}"#);
    let again = list(&c.to_bytes());
    assert!(semantically_equal(&c, &again));
    assert_eq!(again.to_bytes(), c.to_bytes());
}
