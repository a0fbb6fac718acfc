#![cfg(not(loom))]
//! Properties of `cniconf` over generated configs.
//!
//! The generators build arbitrary valid `.conflist`s and `.conf`s: random plugin types
//! (sometimes ours, sometimes stale copies of ours, duplicated, anywhere), random extra
//! fields with nested values (strings with escapes and non-ASCII, integers, exact
//! floats, booleans, nulls, arrays, objects), random key order.

use flock_core::cniconf::{
    CniConfig, ConfPolicy, ConfigKind, OurPlugin, count_ours, is_patched, parse, patch,
    semantically_equal, unpatch, unpatch_to_conf,
};
use proptest::prelude::*;
use serde_json::{Map, Value, json};

const OURS: &str = "flock-cni";

fn ours() -> OurPlugin {
    OurPlugin::new(
        json!({"type": OURS, "agent_socket": "/run/flock/cni.sock", "log": {"level": "info"}}),
    )
    .unwrap()
}

fn leaf() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|n| json!(n)),
        any::<u64>().prop_map(|n| json!(n)),
        // Exactly representable floats (quarters) and some classic decimals.
        (-1_000_000i32..1_000_000).prop_map(|n| json!(f64::from(n) / 4.0)),
        prop::sample::select(vec![0.1, 1e-7, 2.5e300, -0.0, 1e20]).prop_map(|f| json!(f)),
        "[a-zA-Z0-9 _./\\-\"\\\\\n\t\u{1}é✓]{0,10}".prop_map(Value::String),
    ]
}

fn nested() -> impl Strategy<Value = Value> {
    leaf().prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::vec(("[a-z]{1,6}", inner), 0..4)
                .prop_map(|kv| Value::Object(kv.into_iter().collect())),
        ]
    })
}

/// Extra fields whose keys do not collide with the ones the spec types.
fn extras() -> impl Strategy<Value = Vec<(String, Value)>> {
    prop::collection::vec(("x[a-z]{0,6}", nested()), 0..4)
}

fn plugin_type() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::sample::select(vec!["calico", "cilium-cni", "portmap", "bandwidth", "aws-cni", "egress-cni"]).prop_map(str::to_owned),
        1 => Just(OURS.to_owned()),
    ]
}

/// A plugin object; `type` at a random position among the extras.
fn plugin(types: impl Strategy<Value = String>) -> impl Strategy<Value = Map<String, Value>> {
    (types, extras(), any::<prop::sample::Index>()).prop_map(|(ty, extra, at)| {
        let mut fields: Vec<(String, Value)> = extra;
        let pos = at.index(fields.len() + 1);
        fields.insert(pos, ("type".to_owned(), Value::String(ty)));
        fields.into_iter().collect()
    })
}

fn version() -> impl Strategy<Value = &'static str> {
    prop::sample::select(vec!["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
}

fn conflist() -> impl Strategy<Value = CniConfig> {
    (
        version(),
        "[a-z][a-z0-9-]{0,10}",
        prop::collection::vec(plugin(plugin_type()), 1..6),
        extras(),
        any::<Option<bool>>(),
        any::<bool>(),
    )
        .prop_map(|(v, name, plugins, extra, disable_check, name_first)| {
            let mut o = Map::new();
            if name_first {
                o.insert("name".into(), json!(name));
                o.insert("cniVersion".into(), json!(v));
            } else {
                o.insert("cniVersion".into(), json!(v));
                o.insert("name".into(), json!(name));
            }
            if let Some(b) = disable_check {
                o.insert("disableCheck".into(), json!(b));
            }
            for (k, val) in extra {
                o.insert(k, val);
            }
            o.insert(
                "plugins".into(),
                Value::Array(plugins.into_iter().map(Value::Object).collect()),
            );
            CniConfig::from_object(ConfigKind::ConfList, o).unwrap()
        })
}

fn conf() -> impl Strategy<Value = CniConfig> {
    let not_ours =
        prop::sample::select(vec!["bridge", "flannel", "ptp", "macvlan"]).prop_map(str::to_owned);
    (version(), "[a-z][a-z0-9-]{0,10}", plugin(not_ours)).prop_map(|(v, name, mut o)| {
        o.insert("cniVersion".into(), json!(v));
        o.insert("name".into(), json!(name));
        CniConfig::from_object(ConfigKind::Conf, o).unwrap()
    })
}

fn primary() -> impl Strategy<Value = CniConfig> {
    prop_oneof![3 => conflist(), 1 => conf()]
}

fn non_ours(config: &CniConfig) -> Vec<Value> {
    config
        .plugins()
        .into_iter()
        .filter(|p| p.get("type").and_then(Value::as_str) != Some(OURS))
        .map(|p| Value::Object(p.clone()))
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    /// patch∘patch = patch, byte for byte, through the file: patching the written bytes
    /// again reports "unchanged" and serialises to the same bytes.
    #[test]
    fn patch_is_idempotent(x in primary()) {
        let first = patch(&x, &ours(), ConfPolicy::ConvertToList).unwrap();
        let bytes = first.config.to_bytes();
        let reread = parse(&bytes, ConfigKind::ConfList).unwrap();
        let second = patch(&reread, &ours(), ConfPolicy::ConvertToList).unwrap();
        prop_assert!(!second.changed);
        prop_assert_eq!(second.config.to_bytes(), bytes.clone());
        // And the in-memory result is already patched too.
        let third = patch(&first.config, &ours(), ConfPolicy::ConvertToList).unwrap();
        prop_assert!(!third.changed);
        prop_assert_eq!(third.config.to_bytes(), bytes);
    }

    /// Exactly one of ours, last, equal to the desired entry; the other plugins are kept
    /// in order; top-level keys keep their order.
    #[test]
    fn patch_puts_exactly_one_of_ours_last(x in primary()) {
        let patched = patch(&x, &ours(), ConfPolicy::ConvertToList).unwrap();
        let p = &patched.config;
        prop_assert_eq!(p.kind(), ConfigKind::ConfList);
        prop_assert_eq!(count_ours(p, &ours()), 1);
        prop_assert!(is_patched(p, &ours()));
        let plugins = p.plugins();
        let our = ours();
        prop_assert_eq!(plugins.last().copied(), Some(our.entry()));
        let kept: Vec<Value> = plugins[..plugins.len() - 1].iter().map(|m| Value::Object((*m).clone())).collect();
        prop_assert_eq!(kept, non_ours(&x));
        prop_assert_eq!(patched.converted_from_conf, x.kind() == ConfigKind::Conf);
        prop_assert_eq!(patched.changed, patched.converted_from_conf || !is_patched(&x, &ours()));
        let x_list = x.to_conflist();
        let original_keys: Vec<&String> = x_list.as_object().keys().collect();
        let keys: Vec<&String> = p.as_object().keys().collect();
        prop_assert_eq!(keys, original_keys);
        for (k, v) in x_list.as_object() {
            if k != "plugins" {
                prop_assert_eq!(p.as_object().get(k), Some(v));
            }
        }
    }

    /// unpatch(patch(x)) ≡ unpatch(x), and ≡ x when x holds none of ours; through the
    /// written bytes as well.
    #[test]
    fn unpatch_restores_the_original(x in primary()) {
        let patched = patch(&x, &ours(), ConfPolicy::ConvertToList).unwrap();
        let reread = parse(&patched.config.to_bytes(), ConfigKind::ConfList).unwrap();
        let expected = match unpatch(&x, &ours()) {
            Ok(u) => u.config,
            Err(_) => {
                // Only possible when x is nothing but ours.
                prop_assert!(non_ours(&x).is_empty());
                prop_assert!(unpatch(&reread, &ours()).is_err());
                return Ok(());
            }
        };
        for candidate in [&patched.config, &reread] {
            let restored = unpatch(candidate, &ours()).unwrap();
            prop_assert!(restored.changed);
            prop_assert!(semantically_equal(&restored.config, &expected));
            prop_assert_eq!(count_ours(&restored.config, &ours()), 0);
        }
        if count_ours(&x, &ours()) == 0 {
            prop_assert!(semantically_equal(&unpatch(&reread, &ours()).unwrap().config, &x));
        }
    }

    /// A converted .conf comes back as the very same .conf.
    #[test]
    fn converted_conf_comes_back(x in conf()) {
        let patched = patch(&x, &ours(), ConfPolicy::ConvertToList).unwrap();
        let reread = parse(&patched.config.to_bytes(), ConfigKind::ConfList).unwrap();
        let back = unpatch_to_conf(&reread, &ours()).unwrap().unwrap();
        prop_assert_eq!(back.kind(), ConfigKind::Conf);
        prop_assert_eq!(back.to_bytes(), x.to_bytes());
        prop_assert!(semantically_equal(&back, &x));
        prop_assert!(semantically_equal(&x, &x.to_conflist()));
    }

    /// Serialisation: serde_json's pretty format plus a newline, and parse∘print is the
    /// identity (same bytes again).
    #[test]
    fn printing_is_deterministic_and_round_trips(x in primary()) {
        let bytes = x.to_bytes();
        let mut want = serde_json::to_string_pretty(x.as_object()).unwrap();
        want.push('\n');
        prop_assert_eq!(String::from_utf8(bytes.clone()).unwrap(), want);
        let reread = parse(&bytes, x.kind()).unwrap();
        prop_assert!(semantically_equal(&reread, &x));
        prop_assert_eq!(reread.to_bytes(), bytes);
    }

    /// semantically_equal ignores key order but not content.
    #[test]
    fn semantic_equality_ignores_key_order(x in conflist()) {
        let mut reversed = Map::new();
        for (k, v) in x.as_object().iter().rev() {
            reversed.insert(k.clone(), v.clone());
        }
        let y = CniConfig::from_object(ConfigKind::ConfList, reversed).unwrap();
        prop_assert!(semantically_equal(&x, &y));
        let mut changed = x.as_object().clone();
        changed.insert("name".into(), json!("another-name-that-the-generator-never-makes"));
        let z = CniConfig::from_object(ConfigKind::ConfList, changed).unwrap();
        prop_assert!(!semantically_equal(&x, &z));
    }
}
