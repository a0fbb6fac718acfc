//! The node-name validator (`flock_core::pod::check_node_name`): what the agent accepts
//! as `--node-name` / `$FLOCK_NODE_NAME`, and that every refusal says how to set it.
#![cfg(not(loom))]

use flock_core::pod::{MAX_NAME_LEN, check_node_name};
use proptest::prelude::*;

#[test]
fn kubernetes_style_node_names_are_accepted() {
    for name in [
        "n1",
        "flock-dev",
        "ip-10-0-0-1.ec2.internal",
        "worker-3",
        "a",
        "0",
        &"a".repeat(MAX_NAME_LEN),
    ] {
        assert_eq!(check_node_name(name), Ok(()), "{name:?}");
    }
}

#[test]
fn malformed_node_names_are_refused_with_the_reason_and_how_to_set_it() {
    for (name, why) in [
        ("", "is empty"),
        ("Node1", "contains 'N'"),
        ("node_1", "contains '_'"),
        ("node 1", "contains ' '"),
        ("-node", "must start and end"),
        ("node-", "must start and end"),
        ("a..b", "must start and end"),
        (".a", "must start and end"),
        ("a.", "must start and end"),
        ("a\nb", "contains '\\n'"),
        (&"a".repeat(MAX_NAME_LEN + 1), "is 254 characters long"),
    ] {
        let err = check_node_name(name).expect_err(name);
        assert!(err.contains(why), "{name:?}: {err}");
        assert!(err.contains("--node-name"), "{err}");
        assert!(err.contains("FLOCK_NODE_NAME"), "{err}");
    }
}

#[test]
fn a_refusal_never_echoes_more_than_64_characters_of_the_name() {
    let name = format!("{}X", "b".repeat(10_000));
    let err = check_node_name(&name).unwrap_err();
    assert!(err.len() < 600, "{} bytes", err.len());
    assert!(!err.contains(&"b".repeat(65)));
}

/// One DNS label: `[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?`.
fn label() -> impl Strategy<Value = String> {
    "[a-z0-9]([-a-z0-9]{0,20}[a-z0-9])?"
}

proptest! {
    /// Labels joined by dots (within the length bound) are exactly what is accepted.
    #[test]
    fn dotted_labels_are_accepted(labels in prop::collection::vec(label(), 1..8)) {
        let name = labels.join(".");
        prop_assert_eq!(check_node_name(&name), Ok(()));
    }

    /// Any string: accepted iff it matches the DNS-1123 subdomain grammar; never panics.
    #[test]
    fn acceptance_matches_the_grammar(name in "[a-zA-Z0-9._ -]{0,40}|\\PC{0,300}") {
        let grammar = !name.is_empty()
            && name.len() <= MAX_NAME_LEN
            && name.split('.').all(|l| {
                !l.is_empty()
                    && l.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                    && !l.starts_with('-')
                    && !l.ends_with('-')
            });
        prop_assert_eq!(check_node_name(&name).is_ok(), grammar, "{:?}", name);
    }
}
