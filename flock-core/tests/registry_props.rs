//! What a reader believes of another node's registry entry: only exact workload
//! identities, only accounts the writing node may host (the operator's scope), only
//! addresses that are not loopback, unspecified or multicast in any spelling, and at
//! most a bounded number of entries per node. Each refusal here has a mutant that
//! switches it off (`scripts/test`).

use flock_core::issuance::{Scope, parse_scope};
use flock_core::registry::{
    EntryFields, NodeCap, Reject, Trust, check_entry, check_scope, identity_account,
};
use proptest::prelude::*;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};

const TD: &str = "cluster.local";

fn fields<'a>(node: &'a str, key: &'a str, identity: Option<&'a str>) -> EntryFields<'a> {
    EntryFields {
        key,
        node,
        namespace: "shop",
        service: "web",
        service_port: 80,
        address: "10.0.0.7".parse().unwrap(),
        port: 15006,
        pod: "shop/web-0",
        container_id: "c1",
        ifname: "eth0",
        region: "",
        zone: "",
        identity,
        also_accept: &[],
        labels: &flock_core::labels::NONE,
    }
}

fn trust(scope: Option<&Scope>) -> Trust<'_> {
    Trust {
        local_node: "node-a",
        trust_domain: Some(TD),
        scope,
    }
}

fn key_of(node: &str) -> String {
    format!("{node}/shop/web/c1/eth0/80")
}

fn reason(e: &EntryFields<'_>, t: &Trust<'_>) -> Option<Reject> {
    check_entry(e, t).err().map(|r| r.reason)
}

/// An identity must be exactly `spiffe://<td>/ns/<ns>/sa/<sa>`: an ID prefix
/// (`.../sa/*`, `.../ns/shop/*`), any other `*`, a path longer or shorter than
/// `ns/<ns>/sa/<sa>`, is refused, as the identity and as a further accepted ID, while
/// the exact ID passes. With the old rule (mutant `registry-wildcard-identity`) one
/// entry of `spiffe://td/ns/shop/sa/*` made every caller accept any account of the
/// namespace, and this test fails on "a wildcard or non-workload identity was
/// accepted".
#[test]
fn only_exact_workload_identities_are_accepted() {
    let key = key_of("node-b");
    let t = trust(None);
    let exact = "spiffe://cluster.local/ns/shop/sa/web";
    assert_eq!(reason(&fields("node-b", &key, Some(exact)), &t), None);
    for bad in [
        "spiffe://cluster.local/ns/shop/sa/*",
        "spiffe://cluster.local/ns/shop/*",
        "spiffe://cluster.local/ns/shop/sa/w*",
        "spiffe://cluster.local/ns/shop/sa/web/extra",
        "spiffe://cluster.local/ns/shop/sa",
        "spiffe://cluster.local/ns/shop/pod/web-0",
        "spiffe://cluster.local/ns/shop",
        "spiffe://cluster.local/ns/shop/sa/Web",
    ] {
        assert_eq!(
            reason(&fields("node-b", &key, Some(bad)), &t),
            Some(Reject::Identity),
            "a wildcard or non-workload identity was accepted: {bad}"
        );
        let also = [bad.to_string()];
        let e = EntryFields {
            also_accept: &also,
            ..fields("node-b", &key, Some(exact))
        };
        assert_eq!(
            reason(&e, &t),
            Some(Reject::Identity),
            "a wildcard or non-workload identity was accepted: also_accept {bad}"
        );
    }
}

/// An IPv4-mapped IPv6 address is judged as the IPv4 address a dual-stack socket
/// reaches through it: `::ffff:127.0.0.1` from another node is refused like
/// `127.0.0.1`, `::ffff:0.0.0.0` and `::ffff:224.0.0.1` like their IPv4 forms; a
/// mapped loopback listen address is loopback. Judged as written (mutant
/// `noncanonical-address`) they passed, and this test fails on "a mapped address
/// passed a check its IPv4 form fails".
#[test]
fn mapped_addresses_are_checked_as_their_ipv4_form() {
    let key = key_of("node-b");
    let t = trust(None);
    for (mapped, v4) in [
        ("::ffff:127.0.0.1", "127.0.0.1"),
        ("::ffff:0.0.0.0", "0.0.0.0"),
        ("::ffff:224.0.0.1", "224.0.0.1"),
    ] {
        let at = |a: &str| {
            reason(
                &EntryFields {
                    address: a.parse().unwrap(),
                    ..fields("node-b", &key, None)
                },
                &t,
            )
        };
        assert_eq!(at(v4), Some(Reject::Address), "{v4}");
        assert_eq!(
            at(mapped),
            Some(Reject::Address),
            "a mapped address passed a check its IPv4 form fails: {mapped}"
        );
    }
    let listen: SocketAddr = "[::ffff:127.0.0.1]:15010".parse().unwrap();
    assert_eq!(
        flock_core::access::check_listen_addr("--xds-address", listen, false),
        Ok(()),
        "a mapped address passed a check its IPv4 form fails: a mapped loopback listener"
    );
}

/// With the operator's scope, another node's entry may carry only identities of
/// accounts that node may host: node-b writing an endpoint as node-a's account
/// (`shop/web`), as identity or further accepted ID, is refused with `Scope`; its own
/// account passes; a node absent from the scope may claim none. Without the check
/// (mutant `registry-any-scope`) a node could advertise endpoints as any other
/// node's pods, and this test fails on "an identity outside the writer's scope was
/// accepted".
#[test]
fn identities_outside_the_writers_scope_are_refused() {
    let scope = parse_scope("node-a: shop/web\nnode-b: shop/cart\n").unwrap();
    let t = trust(Some(&scope));
    let web = "spiffe://cluster.local/ns/shop/sa/web";
    let cart = "spiffe://cluster.local/ns/shop/sa/cart";
    let kb = key_of("node-b");
    let kc = key_of("node-c");
    assert_eq!(reason(&fields("node-b", &kb, Some(cart)), &t), None);
    assert_eq!(
        reason(&fields("node-b", &kb, None), &t),
        None,
        "no identity, nothing claimed"
    );
    let also = [web.to_string()];
    for (what, e) in [
        ("node-b as web", fields("node-b", &kb, Some(web))),
        (
            "node-c (no line) as cart",
            fields("node-c", &kc, Some(cart)),
        ),
        (
            "node-b's cart also accepting web",
            EntryFields {
                also_accept: &also,
                ..fields("node-b", &kb, Some(cart))
            },
        ),
    ] {
        assert_eq!(
            reason(&e, &t),
            Some(Reject::Scope),
            "an identity outside the writer's scope was accepted: {what}"
        );
    }
}

/// A node's entries beyond the cap are refused and the other nodes' are not; a
/// released entry makes room for one more. Without the cap (mutant
/// `registry-uncapped-node`) this test fails on "a node's entry beyond the cap was
/// admitted".
#[test]
fn a_node_beyond_its_cap_is_refused_and_others_are_not() {
    let mut cap = NodeCap::new(3);
    for _ in 0..3 {
        cap.admit("node-b").unwrap();
    }
    let over = cap.admit("node-b");
    assert_eq!(
        over.as_ref().map_err(|r| r.reason),
        Err(Reject::NodeCap),
        "a node's entry beyond the cap was admitted"
    );
    assert!(over.unwrap_err().detail.contains("node-b"));
    assert_eq!(cap.admit("node-c"), Ok(()), "another node is not capped");
    cap.release("node-b");
    assert_eq!(cap.admit("node-b"), Ok(()), "room after a release");
    assert_eq!(cap.held("node-b"), 3);
}

fn account() -> impl Strategy<Value = (String, String)> {
    (
        prop::sample::select(vec!["shop", "db", "kube-system"]),
        prop::sample::select(vec!["web", "cart", "admin"]),
    )
        .prop_map(|(n, s)| (n.to_string(), s.to_string()))
}

fn scope_strategy() -> impl Strategy<Value = Scope> {
    prop::collection::btree_map(
        prop::sample::select(vec!["node-a", "node-b", "node-c"]).prop_map(str::to_string),
        prop::collection::btree_set(account(), 0..4),
        0..3,
    )
    .prop_map(|nodes| Scope { nodes })
}

proptest! {
    /// The scope decision is exactly membership: node N may carry
    /// `spiffe://<td>/ns/<ns>/sa/<sa>` iff the scope lists `<ns>/<sa>` for N.
    #[test]
    fn the_scope_check_is_exactly_membership(
        scope in scope_strategy(),
        node in prop::sample::select(vec!["node-a", "node-b", "node-c", "node-d"]),
        (ns, sa) in account(),
    ) {
        let id = format!("spiffe://{TD}/ns/{ns}/sa/{sa}");
        let listed = scope
            .nodes
            .get(node)
            .is_some_and(|a| a.contains(&(ns.clone(), sa.clone())));
        prop_assert_eq!(check_scope(node, &id, &scope).is_ok(), listed);
        prop_assert_eq!(identity_account(&id), Some((ns.as_str(), sa.as_str())));
    }

    /// Every IPv4 address and its IPv4-mapped IPv6 form get the same verdict from
    /// `check_entry`, for an entry of this node and of another.
    #[test]
    fn an_address_and_its_mapped_form_get_one_verdict(
        octets in any::<[u8; 4]>(),
        own in any::<bool>(),
    ) {
        let v4 = Ipv4Addr::from(octets);
        let node = if own { "node-a" } else { "node-b" };
        let key = key_of(node);
        let t = trust(None);
        let at = |a: IpAddr| reason(&EntryFields { address: a, ..fields(node, &key, None) }, &t);
        prop_assert_eq!(at(IpAddr::V4(v4)), at(IpAddr::V6(v4.to_ipv6_mapped())));
    }

    /// Over any sequence of admits and releases, no node ever holds more than the
    /// cap, and an admit is refused only when its node holds the cap.
    #[test]
    fn the_cap_holds_over_any_sequence(
        max in 0usize..5,
        ops in prop::collection::vec(
            (prop::sample::select(vec!["node-a", "node-b"]), any::<bool>()),
            0..64,
        ),
    ) {
        let mut cap = NodeCap::new(max);
        let mut model = std::collections::BTreeMap::<&str, usize>::new();
        for (node, admit) in ops {
            let held = model.entry(node).or_default();
            if admit {
                let r = cap.admit(node);
                prop_assert_eq!(r.is_ok(), *held < max);
                if r.is_ok() {
                    *held += 1;
                }
            } else if *held > 0 {
                cap.release(node);
                *held -= 1;
            }
            prop_assert!(cap.held(node) <= max);
            prop_assert_eq!(cap.held(node), *held);
        }
    }
}
