//! Protocol unit tests: each name states the behaviour it proves.

use flock_core::ContentHash;
use flock_core::resources::{Name, ResourceSet};
use flock_xds::protocol::{
    DeltaAds, DeltaRequest, DeltaResponse, DeltaState, RequestKind, SotwAds, SotwRequest,
    SotwResponse, SotwState,
};
use flock_xds::types::{CLUSTER, ENDPOINT, LISTENER, ROUTE, VIRTUAL_HOST};
use std::collections::BTreeMap;

type V = String;

fn set(items: &[(&str, &str, &str)]) -> ResourceSet<V> {
    let mut b = ResourceSet::new().edit();
    for (t, n, v) in items {
        b.upsert(t, n, ContentHash::of(v.as_bytes()), v.to_string());
    }
    b.build()
}

fn edit(prev: &ResourceSet<V>, up: &[(&str, &str, &str)], rm: &[(&str, &str)]) -> ResourceSet<V> {
    let mut b = prev.edit();
    for (t, n, v) in up {
        b.upsert(t, n, ContentHash::of(v.as_bytes()), v.to_string());
    }
    for (t, n) in rm {
        b.remove(t, n);
    }
    b.build()
}

fn sreq(type_url: &str, names: &[&str], nonce: &str) -> SotwRequest {
    SotwRequest {
        type_url: type_url.into(),
        resource_names: names.iter().map(|n| n.to_string()).collect(),
        response_nonce: nonce.into(),
        ..SotwRequest::default()
    }
}

fn snack(type_url: &str, names: &[&str], nonce: &str, error: &str) -> SotwRequest {
    SotwRequest {
        error_detail: Some(error.into()),
        ..sreq(type_url, names, nonce)
    }
}

fn dreq(type_url: &str, sub: &[&str], unsub: &[&str], nonce: &str) -> DeltaRequest {
    DeltaRequest {
        type_url: type_url.into(),
        resource_names_subscribe: sub.iter().map(|n| n.to_string()).collect(),
        resource_names_unsubscribe: unsub.iter().map(|n| n.to_string()).collect(),
        response_nonce: nonce.into(),
        ..DeltaRequest::default()
    }
}

fn names_of(r: &SotwResponse<V>) -> Vec<(&str, &str)> {
    r.resources
        .iter()
        .map(|(n, v)| (n.as_ref(), v.as_str()))
        .collect()
}

fn delta_names(r: &DeltaResponse<V>) -> Vec<(&str, &str)> {
    r.resources
        .iter()
        .map(|r| (r.name.as_ref(), r.value.as_str()))
        .collect()
}

fn removed(r: &DeltaResponse<V>) -> Vec<&str> {
    r.removed_resources.iter().map(|n| n.as_ref()).collect()
}

// ------------------------------------------------------------------ SotW

#[test]
fn sotw_first_wildcard_request_gets_the_full_set_with_version_and_nonce() {
    let mut s = SotwState::new(CLUSTER);
    s.on_snapshot(&set(&[(CLUSTER, "a", "a1"), (CLUSTER, "b", "b1")]), 1);
    let out = s.on_request(&sreq(CLUSTER, &[], ""));
    assert_eq!(out.kind, RequestKind::Initial);
    assert!(s.subscription().is_wildcard());
    let r = s.poll_response().unwrap();
    assert_eq!(names_of(&r), [("a", "a1"), ("b", "b1")]);
    assert_eq!((r.version_info.as_str(), r.nonce.as_str()), ("1", "1"));
}

#[test]
fn sotw_nothing_is_sent_before_the_first_snapshot() {
    let mut s = SotwState::<V>::new(CLUSTER);
    s.on_request(&sreq(CLUSTER, &[], ""));
    assert!(s.poll_response().is_none(), "version 0 means not set yet");
    s.on_snapshot(&ResourceSet::new(), 1);
    let r = s
        .poll_response()
        .expect("the first response is due even when empty");
    assert!(r.resources.is_empty());
}

#[test]
fn sotw_ack_of_the_latest_nonce_releases_the_next_response() {
    let mut s = SotwState::new(CLUSTER);
    let v1 = set(&[(CLUSTER, "a", "a1")]);
    s.on_snapshot(&v1, 1);
    s.on_request(&sreq(CLUSTER, &[], ""));
    let r1 = s.poll_response().unwrap();
    s.on_snapshot(&edit(&v1, &[(CLUSTER, "a", "a2")], &[]), 2);
    assert!(
        s.poll_response().is_none(),
        "one response in flight per type"
    );
    let out = s.on_request(&sreq(CLUSTER, &[], &r1.nonce));
    assert_eq!(out.kind, RequestKind::Ack { version: 1 });
    assert_eq!(s.acked_version(), Some(1));
    let r2 = s.poll_response().unwrap();
    assert_eq!(names_of(&r2), [("a", "a2")]);
    assert!(r2.nonce.parse::<u64>().unwrap() > r1.nonce.parse::<u64>().unwrap());
}

#[test]
fn sotw_nack_keeps_the_last_good_version_and_the_rejected_content_is_not_resent() {
    let mut s = SotwState::new(CLUSTER);
    let v1 = set(&[(CLUSTER, "a", "a1")]);
    s.on_snapshot(&v1, 1);
    s.on_request(&sreq(CLUSTER, &[], ""));
    let r1 = s.poll_response().unwrap();
    s.on_request(&sreq(CLUSTER, &[], &r1.nonce));
    let v2 = edit(&v1, &[(CLUSTER, "a", "bad")], &[]);
    s.on_snapshot(&v2, 2);
    let r2 = s.poll_response().unwrap();
    let out = s.on_request(&snack(CLUSTER, &[], &r2.nonce, "invalid cluster a"));
    assert_eq!(
        out.kind,
        RequestKind::Nack {
            version: 2,
            kept_version: Some(1),
            error: "invalid cluster a".into()
        }
    );
    assert_eq!(s.acked_version(), Some(1), "the last good version stays");
    assert!(
        s.poll_response().is_none(),
        "the rejected content is not resent"
    );
    // The fix goes out.
    s.on_snapshot(&edit(&v2, &[(CLUSTER, "a", "a3")], &[]), 3);
    assert_eq!(names_of(&s.poll_response().unwrap()), [("a", "a3")]);
}

/// Guards the stale-nonce fix: building with
/// `reintroduced!("xds-stale-nonce")` (any ACK/NACK matched to the latest
/// response, the go-control-plane bug class) makes this test fail.
#[test]
fn sotw_stale_nonce_is_ignored_and_does_not_ack_or_nack_the_newer_response() {
    let mut s = SotwState::new(ENDPOINT);
    let v1 = set(&[(ENDPOINT, "a", "a1"), (ENDPOINT, "b", "b1")]);
    s.on_snapshot(&v1, 1);
    s.on_request(&sreq(ENDPOINT, &["a"], ""));
    let r1 = s.poll_response().unwrap();
    s.on_request(&sreq(ENDPOINT, &["a"], &r1.nonce));
    s.on_snapshot(&edit(&v1, &[(ENDPOINT, "a", "a2")], &[]), 2);
    let r2 = s.poll_response().unwrap();
    // The client, before reading r2, NACKs r1 again and subscribes to "b".
    let out = s.on_request(&snack(ENDPOINT, &["a", "b"], &r1.nonce, "late"));
    assert_eq!(
        out.kind,
        RequestKind::Stale,
        "a NACK carrying the stale nonce of r1 was matched to the newer response"
    );
    assert!(
        !out.subscription_changed,
        "SotW ignores a stale request entirely"
    );
    assert!(s.awaiting_ack(), "r2 is still in flight");
    assert_eq!(s.acked_version(), Some(1));
    assert!(s.poll_response().is_none());
    // Its ACK of r2 carries the full subscription again.
    let out = s.on_request(&sreq(ENDPOINT, &["a", "b"], &r2.nonce));
    assert_eq!(out.kind, RequestKind::Ack { version: 2 });
    assert!(out.subscription_changed);
    assert_eq!(
        names_of(&s.poll_response().unwrap()),
        [("a", "a2"), ("b", "b1")]
    );
}

#[test]
fn sotw_nothing_is_sent_when_the_client_already_has_exactly_this_set() {
    let mut s = SotwState::new(ENDPOINT);
    let v1 = set(&[(ENDPOINT, "a", "a1"), (ENDPOINT, "b", "b1")]);
    s.on_snapshot(&v1, 1);
    s.on_request(&sreq(ENDPOINT, &["a"], ""));
    let r1 = s.poll_response().unwrap();
    s.on_request(&sreq(ENDPOINT, &["a"], &r1.nonce));
    // Unsubscribed resource changes; same content re-upserted; other type changes.
    let v2 = edit(
        &v1,
        &[
            (ENDPOINT, "b", "b2"),
            (ENDPOINT, "a", "a1"),
            (CLUSTER, "x", "x"),
        ],
        &[],
    );
    s.on_snapshot(&v2, 2);
    assert!(s.poll_response().is_none());
    // A duplicate request on the latest nonce is an update, and changes nothing.
    let out = s.on_request(&sreq(ENDPOINT, &["a"], &r1.nonce));
    assert_eq!(out.kind, RequestKind::Update);
    assert!(!out.subscription_changed);
    assert!(s.poll_response().is_none());
}

/// A response suppressed because it would change nothing must not lose the watch (the
/// client would stay on stale endpoints until it reconnects).
#[test]
fn sotw_a_suppressed_response_never_loses_the_watch() {
    let mut s = SotwState::new(ENDPOINT);
    let v1 = set(&[(ENDPOINT, "a", "a1")]);
    s.on_snapshot(&v1, 1);
    s.on_request(&sreq(ENDPOINT, &["a"], ""));
    let r1 = s.poll_response().unwrap();
    s.on_request(&sreq(ENDPOINT, &["a"], &r1.nonce));
    // A publish that changes nothing for this client: suppressed.
    let v2 = edit(&v1, &[(ENDPOINT, "z", "z")], &[]);
    s.on_snapshot(&v2, 2);
    assert!(s.poll_response().is_none());
    // The next real change is still delivered, without any new request.
    s.on_snapshot(&edit(&v2, &[(ENDPOINT, "a", "a3")], &[]), 3);
    let r = s.poll_response().expect("watch kept");
    assert_eq!((names_of(&r), r.version), (vec![("a", "a3")], 3));
}

/// After an unsubscribe, a response prepared for the old subscription is never sent
/// (SotW). Guards the fix: building with
/// `reintroduced!("xds-unsubscribed-response")` makes this test fail.
#[test]
fn sotw_unsubscribe_drops_a_pending_response_for_the_old_subscription() {
    let mut s = SotwState::new(ENDPOINT);
    let v1 = set(&[(ENDPOINT, "a", "a1"), (ENDPOINT, "b", "b1")]);
    s.on_snapshot(&v1, 1);
    s.on_request(&sreq(ENDPOINT, &["a", "b"], ""));
    let r1 = s.poll_response().unwrap();
    // b changes while r1 is in flight: a response for {a, b} is pending.
    s.on_snapshot(&edit(&v1, &[(ENDPOINT, "b", "b2")], &[]), 2);
    // The client ACKs r1 and drops b.
    s.on_request(&sreq(ENDPOINT, &["a"], &r1.nonce));
    assert!(
        s.poll_response().is_none(),
        "nothing is sent for the dropped name"
    );
    assert_eq!(s.stats().pending, 0);
}

#[test]
fn sotw_legacy_wildcard_ends_with_explicit_names_and_star_keeps_it() {
    let mut s = SotwState::new(LISTENER);
    s.on_snapshot(&set(&[(LISTENER, "l1", "1"), (LISTENER, "l2", "2")]), 1);
    s.on_request(&sreq(LISTENER, &[], ""));
    assert!(s.subscription().is_wildcard());
    let r = s.poll_response().unwrap();
    s.on_request(&sreq(LISTENER, &["l1"], &r.nonce));
    assert!(!s.subscription().is_wildcard());
    // l2 is forgotten (the client narrowed its own subscription): nothing to send.
    assert!(s.poll_response().is_none());
    s.on_snapshot(&set(&[(LISTENER, "l1", "1b"), (LISTENER, "l2", "2b")]), 2);
    assert_eq!(names_of(&s.poll_response().unwrap()), [("l1", "1b")]);
    let mut e = SotwState::new(ENDPOINT);
    e.on_snapshot(&set(&[(ENDPOINT, "a", "1")]), 1);
    e.on_request(&sreq(ENDPOINT, &[], ""));
    assert!(
        !e.subscription().is_wildcard(),
        "EDS is never a legacy wildcard"
    );
    e.poll_response();
    e.on_request(&sreq(ENDPOINT, &["*"], "1"));
    assert!(e.subscription().is_wildcard());
    assert_eq!(names_of(&e.poll_response().unwrap()), [("a", "1")]);
}

/// R1 at the stream level. Guards the fix: building with
/// `reintroduced!("xds-snapshot-regress")` makes this test fail.
#[test]
fn sotw_an_older_snapshot_never_replaces_a_newer_one() {
    let mut s = SotwState::new(CLUSTER);
    let v1 = set(&[(CLUSTER, "a", "a1")]);
    let v2 = edit(&v1, &[(CLUSTER, "a", "a2")], &[]);
    s.on_request(&sreq(CLUSTER, &[], ""));
    assert!(s.on_snapshot(&v2, 2));
    assert!(
        !s.on_snapshot(&v1, 1),
        "late delivery of version 1 is ignored"
    );
    let r = s.poll_response().unwrap();
    assert_eq!((names_of(&r), r.version), (vec![("a", "a2")], 2));
}

#[test]
fn sotw_a_reconnecting_client_with_an_old_nonce_is_initial() {
    let mut s = SotwState::new(CLUSTER);
    s.on_snapshot(&set(&[(CLUSTER, "a", "a1")]), 3);
    let out = s.on_request(&sreq(CLUSTER, &[], "17"));
    assert_eq!(out.kind, RequestKind::Initial);
    assert!(s.poll_response().is_some());
}

// ------------------------------------------------------------------ Delta

#[test]
fn delta_initial_resource_versions_are_honoured() {
    let v1 = set(&[
        (CLUSTER, "a", "a1"),
        (CLUSTER, "b", "b1"),
        (CLUSTER, "c", "c1"),
    ]);
    let mut s = DeltaState::new(CLUSTER);
    s.on_snapshot(&v1, 5);
    let mut req = dreq(CLUSTER, &[], &[], "");
    req.initial_resource_versions = BTreeMap::from([
        ("a".into(), ContentHash::of(b"a1").to_hex()), // same: not resent
        ("b".into(), ContentHash::of(b"b0").to_hex()), // older: resent
        ("gone".into(), "v9".into()),                  // no longer exists: removed
    ]);
    assert_eq!(s.on_request(&req).kind, RequestKind::Initial);
    let r = s.poll_response().unwrap();
    assert_eq!(delta_names(&r), [("b", "b1"), ("c", "c1")]);
    assert_eq!(removed(&r), ["gone"]);
    assert_eq!(r.resources[0].version(), ContentHash::of(b"b1").to_hex());
}

#[test]
fn delta_reconnect_holding_everything_gets_an_empty_initial_response() {
    let v1 = set(&[(CLUSTER, "a", "a1")]);
    let mut s = DeltaState::new(CLUSTER);
    s.on_snapshot(&v1, 5);
    let mut req = dreq(CLUSTER, &[], &[], "");
    req.initial_resource_versions = BTreeMap::from([("a".into(), ContentHash::of(b"a1").to_hex())]);
    s.on_request(&req);
    let r = s.poll_response().expect("the first response is due");
    assert!(r.resources.is_empty() && r.removed_resources.is_empty());
}

#[test]
fn delta_wildcard_and_explicit_subscriptions() {
    let v1 = set(&[(ENDPOINT, "a", "a1"), (ENDPOINT, "b", "b1")]);
    let mut s = DeltaState::new(ENDPOINT);
    s.on_snapshot(&v1, 1);
    s.on_request(&dreq(ENDPOINT, &[], &[], ""));
    assert!(
        !s.subscription().is_wildcard(),
        "empty first EDS request subscribes to nothing"
    );
    let r = s.poll_response().unwrap();
    assert!(r.resources.is_empty());
    s.on_request(&dreq(ENDPOINT, &["*"], &[], &r.nonce));
    let r = s.poll_response().unwrap();
    assert_eq!(delta_names(&r), [("a", "a1"), ("b", "b1")]);
    // Unsubscribing a name under a wildcard keeps it; dropping the wildcard
    // forgets what was not named, without removals.
    s.on_request(&dreq(ENDPOINT, &["a"], &["*"], &r.nonce));
    assert!(!s.subscription().is_wildcard());
    assert!(s.poll_response().is_none());
    s.on_snapshot(&edit(&v1, &[(ENDPOINT, "b", "b2")], &[]), 2);
    assert!(s.poll_response().is_none(), "b is no longer subscribed");
}

#[test]
fn delta_removals_only_for_subscribed_names_and_unsubscribed_names_are_forgotten() {
    let v1 = set(&[(ROUTE, "a", "a1"), (ROUTE, "b", "b1")]);
    let mut s = DeltaState::new(ROUTE);
    s.on_snapshot(&v1, 1);
    s.on_request(&dreq(ROUTE, &["a", "b"], &[], ""));
    let r = s.poll_response().unwrap();
    s.on_request(&dreq(ROUTE, &[], &["b"], &r.nonce));
    let v2 = edit(&v1, &[], &[(ROUTE, "a"), (ROUTE, "b")]);
    s.on_snapshot(&v2, 2);
    let r = s.poll_response().unwrap();
    assert_eq!(
        removed(&r),
        ["a"],
        "b was unsubscribed: forgotten, not removed"
    );
    assert!(r.resources.is_empty());
}

#[test]
fn delta_unchanged_resources_are_never_resent() {
    let v1 = set(&[(CLUSTER, "a", "a1"), (CLUSTER, "b", "b1")]);
    let mut s = DeltaState::new(CLUSTER);
    s.on_snapshot(&v1, 1);
    s.on_request(&dreq(CLUSTER, &[], &[], ""));
    let r = s.poll_response().unwrap();
    s.on_request(&dreq(CLUSTER, &[], &[], &r.nonce));
    let v2 = edit(&v1, &[(CLUSTER, "a", "a1"), (CLUSTER, "b", "b2")], &[]);
    s.on_snapshot(&v2, 2);
    assert_eq!(delta_names(&s.poll_response().unwrap()), [("b", "b2")]);
}

/// Guards the stale-nonce fix for Delta: with
/// `reintroduced!("xds-stale-nonce")` this test fails.
#[test]
fn delta_stale_request_applies_its_subscription_but_not_its_ack() {
    let v1 = set(&[(ENDPOINT, "a", "a1"), (ENDPOINT, "b", "b1")]);
    let mut s = DeltaState::new(ENDPOINT);
    s.on_snapshot(&v1, 1);
    s.on_request(&dreq(ENDPOINT, &["a"], &[], ""));
    let r1 = s.poll_response().unwrap();
    s.on_request(&dreq(ENDPOINT, &[], &[], &r1.nonce));
    s.on_snapshot(&edit(&v1, &[(ENDPOINT, "a", "a2")], &[]), 2);
    let r2 = s.poll_response().unwrap();
    let out = s.on_request(&dreq(ENDPOINT, &["b"], &[], &r1.nonce));
    assert_eq!(
        out.kind,
        RequestKind::Stale,
        "a request carrying the stale nonce of r1 was matched to the newer response"
    );
    assert!(
        out.subscription_changed,
        "Delta never repeats a subscription"
    );
    assert_eq!(s.acked_version(), Some(1));
    assert!(s.poll_response().is_none(), "r2 is still in flight");
    s.on_request(&dreq(ENDPOINT, &[], &[], &r2.nonce));
    assert_eq!(delta_names(&s.poll_response().unwrap()), [("b", "b1")]);
}

#[test]
fn delta_nack_keeps_the_last_good_version_then_the_fix_is_sent() {
    let v1 = set(&[(CLUSTER, "a", "a1")]);
    let mut s = DeltaState::new(CLUSTER);
    s.on_snapshot(&v1, 1);
    s.on_request(&dreq(CLUSTER, &[], &[], ""));
    let r1 = s.poll_response().unwrap();
    s.on_request(&dreq(CLUSTER, &[], &[], &r1.nonce));
    let v2 = edit(&v1, &[(CLUSTER, "a", "bad")], &[]);
    s.on_snapshot(&v2, 2);
    let r2 = s.poll_response().unwrap();
    let mut nack = dreq(CLUSTER, &[], &[], &r2.nonce);
    nack.error_detail = Some("bad cluster".into());
    assert!(matches!(
        s.on_request(&nack).kind,
        RequestKind::Nack { version: 2, kept_version: Some(1), ref error } if error == "bad cluster"
    ));
    assert!(s.poll_response().is_none());
    s.on_snapshot(&edit(&v2, &[(CLUSTER, "a", "a3")], &[]), 3);
    assert_eq!(delta_names(&s.poll_response().unwrap()), [("a", "a3")]);
}

/// After an unsubscribe, a response prepared for the old subscription is never sent
/// (Delta). Guards the fix: with
/// `reintroduced!("xds-unsubscribed-response")` this test fails.
#[test]
fn delta_unsubscribe_drops_a_pending_response() {
    let v1 = set(&[(ENDPOINT, "a", "a1"), (ENDPOINT, "b", "b1")]);
    let mut s = DeltaState::new(ENDPOINT);
    s.on_snapshot(&v1, 1);
    s.on_request(&dreq(ENDPOINT, &["a", "b"], &[], ""));
    let r1 = s.poll_response().unwrap();
    s.on_snapshot(&edit(&v1, &[(ENDPOINT, "b", "b2")], &[]), 2);
    s.on_request(&dreq(ENDPOINT, &[], &["b"], &r1.nonce));
    assert!(
        s.poll_response().is_none(),
        "a response prepared for b went out after b was unsubscribed"
    );
}

// ------------------------------------------------------------------ ADS ordering

/// A cluster's endpoints never arrive before the cluster (Envoy can drop them and never
/// recover): a wildcard EDS subscriber, which gets endpoints it did not ask for, gets a
/// new cluster's endpoints only after the cluster, also while an earlier CDS response
/// awaits its ACK. Guards the ordering: with
/// `reintroduced!("xds-eds-before-cds")` this test fails.
#[test]
fn ads_a_changed_cluster_goes_out_before_its_endpoints() {
    let mut ads: DeltaAds<V> = DeltaAds::new();
    let v1 = set(&[(CLUSTER, "c", "c1"), (ENDPOINT, "c", "e1")]);
    ads.on_snapshot(&v1, 1);
    ads.on_request(&dreq(CLUSTER, &[], &[], ""));
    ads.on_request(&dreq(ENDPOINT, &["*"], &[], ""));
    let cds1 = ads.poll_response().unwrap();
    assert_eq!(cds1.type_url.as_ref(), CLUSTER);
    let eds1 = ads.poll_response().unwrap();
    ads.on_request(&dreq(ENDPOINT, &[], &[], &eds1.nonce));
    // A cluster and its endpoints appear while the CDS response is unacknowledged.
    ads.on_snapshot(
        &edit(&v1, &[(CLUSTER, "d", "d1"), (ENDPOINT, "d", "f1")], &[]),
        2,
    );
    assert!(
        ads.poll_response().is_none(),
        "wildcard EDS waits for the CDS change to go out"
    );
    ads.on_request(&dreq(CLUSTER, &[], &[], &cds1.nonce));
    let next = ads.poll_response().unwrap();
    assert_eq!(
        (next.type_url.as_ref(), delta_names(&next)),
        (CLUSTER, vec![("d", "d1")])
    );
    let next = ads.poll_response().unwrap();
    assert_eq!(
        (next.type_url.as_ref(), delta_names(&next)),
        (ENDPOINT, vec![("d", "f1")])
    );
}

/// Endpoints a client asked for by name go out while a CDS response awaits its ACK:
/// Envoy withholds a CDS ACK while the clusters it added warm, and they warm on their
/// endpoints, so holding EDS behind CDS's next change stalls both until Envoy's
/// initial fetch timeout (seen against real Envoy under churn: new services
/// unreachable for 15 s). Guards the fix: with
/// `reintroduced!("xds-eds-behind-unacked-cds")` this test fails.
#[test]
fn ads_endpoints_asked_for_by_name_go_out_while_cds_awaits_its_ack() {
    for sotw in [false, true] {
        let v1 = set(&[(CLUSTER, "c", "c1"), (ENDPOINT, "c", "e1")]);
        let v2 = edit(&v1, &[(CLUSTER, "d", "d1"), (ENDPOINT, "d", "f1")], &[]);
        // The client got cluster c and, warming it, asks for its endpoints without
        // ACKing the CDS response; meanwhile cluster d appears (a CDS change that
        // cannot go out before that ACK).
        let got = if sotw {
            let mut ads: SotwAds<V> = SotwAds::new();
            ads.on_snapshot(&v1, 1);
            ads.on_request(&sreq(CLUSTER, &[], ""));
            let cds1 = ads.poll_response().unwrap();
            assert_eq!(cds1.type_url.as_ref(), CLUSTER);
            ads.on_snapshot(&v2, 2);
            ads.on_request(&sreq(ENDPOINT, &["c"], ""));
            ads.poll_response()
                .map(|r| (r.type_url.to_string(), format!("{:?}", names_of(&r))))
        } else {
            let mut ads: DeltaAds<V> = DeltaAds::new();
            ads.on_snapshot(&v1, 1);
            ads.on_request(&dreq(CLUSTER, &[], &[], ""));
            let cds1 = ads.poll_response().unwrap();
            assert_eq!(cds1.type_url.as_ref(), CLUSTER);
            ads.on_snapshot(&v2, 2);
            ads.on_request(&dreq(ENDPOINT, &["c"], &[], ""));
            ads.poll_response()
                .map(|r| (r.type_url.to_string(), format!("{:?}", delta_names(&r))))
        };
        assert_eq!(
            got,
            Some((ENDPOINT.to_string(), format!("{:?}", vec![("c", "e1")]))),
            "sotw={sotw}: the warming cluster's endpoints go out before the CDS ACK"
        );
    }
}

#[test]
fn ads_delta_new_cluster_goes_out_before_its_endpoints_under_wildcard_eds() {
    let mut ads: DeltaAds<V> = DeltaAds::new();
    ads.on_request(&dreq(ENDPOINT, &["*"], &[], ""));
    ads.on_request(&dreq(CLUSTER, &[], &[], ""));
    ads.on_snapshot(&set(&[(CLUSTER, "c", "c1"), (ENDPOINT, "c", "e1")]), 1);
    let first = ads.poll_response().unwrap();
    assert_eq!(first.type_url.as_ref(), CLUSTER);
    let second = ads.poll_response().unwrap();
    assert_eq!(second.type_url.as_ref(), ENDPOINT);
    let n1: u64 = first.nonce.parse().unwrap();
    let n2: u64 = second.nonce.parse().unwrap();
    assert!(n2 > n1, "nonces increase across types on one stream");
}

#[test]
fn ads_a_listener_goes_out_before_its_route_configuration() {
    let mut ads: SotwAds<V> = SotwAds::new();
    let v1 = set(&[(LISTENER, "l", "l1"), (ROUTE, "r", "r1")]);
    ads.on_snapshot(&v1, 1);
    ads.on_request(&sreq(LISTENER, &[], ""));
    let lds1 = ads.poll_response().unwrap();
    ads.on_request(&sreq(ROUTE, &["r"], ""));
    let rds1 = ads.poll_response().unwrap();
    ads.on_request(&sreq(ROUTE, &["r"], &rds1.nonce));
    ads.on_snapshot(
        &edit(&v1, &[(LISTENER, "l", "l2"), (ROUTE, "r", "r2")], &[]),
        2,
    );
    assert!(ads.poll_response().is_none(), "RDS waits for LDS");
    ads.on_request(&sreq(LISTENER, &[], &lds1.nonce));
    assert_eq!(ads.poll_response().unwrap().type_url.as_ref(), LISTENER);
    assert_eq!(ads.poll_response().unwrap().type_url.as_ref(), ROUTE);
}

fn mbb_start() -> ResourceSet<V> {
    // Route r sends to cluster "old"; the next version moves it to "new" and
    // removes "old".
    set(&[
        (CLUSTER, "old", "old"),
        (LISTENER, "l", "l"),
        (ROUTE, "r", "r->old"),
    ])
}

fn mbb_next(v1: &ResourceSet<V>) -> ResourceSet<V> {
    edit(
        v1,
        &[(CLUSTER, "new", "new"), (ROUTE, "r", "r->new")],
        &[(CLUSTER, "old")],
    )
}

/// Make-before-break, SotW: the CDS response after the change still carries "old"
/// (at the content the client holds) until the RDS update that drops the reference
/// is out. Guards the rule: with `reintroduced!("xds-break-before-make")`
/// this test fails.
#[test]
fn ads_sotw_make_before_break_removes_a_cluster_after_the_route_that_used_it() {
    let mut ads: SotwAds<V> = SotwAds::new();
    let v1 = mbb_start();
    ads.on_snapshot(&v1, 1);
    ads.on_request(&sreq(CLUSTER, &[], ""));
    let cds = ads.poll_response().unwrap();
    ads.on_request(&sreq(CLUSTER, &[], &cds.nonce));
    ads.on_request(&sreq(LISTENER, &[], ""));
    let lds = ads.poll_response().unwrap();
    ads.on_request(&sreq(LISTENER, &[], &lds.nonce));
    ads.on_request(&sreq(ROUTE, &["r"], ""));
    let rds = ads.poll_response().unwrap();
    ads.on_request(&sreq(ROUTE, &["r"], &rds.nonce));

    ads.on_snapshot(&mbb_next(&v1), 2);
    let make = ads.poll_response().unwrap();
    assert_eq!(make.type_url.as_ref(), CLUSTER);
    assert_eq!(
        names_of(&make),
        [("new", "new"), ("old", "old")],
        "old stays while a route may use it"
    );
    let route = ads.poll_response().unwrap();
    assert_eq!(
        (route.type_url.as_ref(), names_of(&route)),
        (ROUTE, vec![("r", "r->new")])
    );
    assert!(ads.poll_response().is_none());
    ads.on_request(&sreq(CLUSTER, &[], &make.nonce));
    let brk = ads.poll_response().unwrap();
    assert_eq!(
        (brk.type_url.as_ref(), names_of(&brk)),
        (CLUSTER, vec![("new", "new")])
    );
    assert_eq!(brk.version, 2);
}

/// Make-before-break, Delta: the removal of "old" waits for the RDS update. Guards
/// the rule: with `reintroduced!("xds-break-before-make")` this test fails.
#[test]
fn ads_delta_make_before_break_removes_a_cluster_after_the_route_that_used_it() {
    let mut ads: DeltaAds<V> = DeltaAds::new();
    let v1 = mbb_start();
    ads.on_snapshot(&v1, 1);
    for (t, sub) in [(CLUSTER, &[][..]), (LISTENER, &[][..]), (ROUTE, &["r"][..])] {
        ads.on_request(&dreq(t, sub, &[], ""));
        let r = ads.poll_response().unwrap();
        ads.on_request(&dreq(t, &[], &[], &r.nonce));
    }
    ads.on_snapshot(&mbb_next(&v1), 2);
    let make = ads.poll_response().unwrap();
    assert_eq!(make.type_url.as_ref(), CLUSTER);
    assert_eq!(delta_names(&make), [("new", "new")]);
    assert!(make.removed_resources.is_empty(), "old is not removed yet");
    let route = ads.poll_response().unwrap();
    assert_eq!(route.type_url.as_ref(), ROUTE);
    ads.on_request(&dreq(CLUSTER, &[], &[], &make.nonce));
    let brk = ads.poll_response().unwrap();
    assert_eq!(
        (brk.type_url.as_ref(), removed(&brk)),
        (CLUSTER, vec!["old"])
    );
    assert!(brk.resources.is_empty());
    let _ = Name::from("unused");
}

/// Found by the model test: the client unsubscribes and resubscribes a name while a
/// response carrying it is in flight, and the resource is deleted meanwhile. The
/// server forgot the name at the unsubscribe; without the "does not exist" removal
/// on resubscribe, the client would keep the deleted resource forever.
#[test]
fn delta_resubscribing_a_missing_name_gets_a_removal() {
    let v1 = set(&[(ROUTE, "r", "r1")]);
    let mut s = DeltaState::new(ROUTE);
    s.on_snapshot(&v1, 1);
    s.on_request(&dreq(ROUTE, &["r"], &[], ""));
    let r1 = s.poll_response().unwrap(); // in flight, carrying r
    s.on_snapshot(&edit(&v1, &[], &[(ROUTE, "r")]), 2);
    s.on_request(&dreq(ROUTE, &[], &["r"], ""));
    s.on_request(&dreq(ROUTE, &["r"], &[], ""));
    s.on_request(&dreq(ROUTE, &[], &[], &r1.nonce));
    let r2 = s.poll_response().unwrap();
    assert_eq!(removed(&r2), ["r"]);
    assert!(s.poll_response().is_none());
}

// ------------------------------------------------------------------ VHDS

/// Envoy subscribes to a route configuration's virtual hosts by the configuration's
/// name (a namespace): every `<name>/<host>` is sent, including hosts added later, and
/// their changes and removals; nothing of another configuration (also not one whose
/// name only starts the same, nor a deeper path), and no "does not exist" removal of
/// the namespace itself.
#[test]
fn delta_vhds_a_route_configuration_name_subscribes_to_its_virtual_hosts() {
    let cfg = "outbound|http|spiffe://td/ns/a/sa/b";
    let v1 = set(&[
        (VIRTUAL_HOST, &format!("{cfg}/web.default:80"), "w1"),
        (VIRTUAL_HOST, &format!("{cfg}/db.default:80"), "d1"),
        (VIRTUAL_HOST, "outbound|http/web.default:80", "shared"),
        (VIRTUAL_HOST, &format!("{cfg}x/web.default:80"), "other"),
    ]);
    let mut s = DeltaState::new(VIRTUAL_HOST);
    s.on_snapshot(&v1, 1);
    s.on_request(&dreq(VIRTUAL_HOST, &[cfg], &[], ""));
    let r = s.poll_response().unwrap();
    let web = format!("{cfg}/web.default:80");
    let db = format!("{cfg}/db.default:80");
    let mut got = delta_names(&r);
    got.sort();
    assert_eq!(got, [(db.as_str(), "d1"), (web.as_str(), "w1")]);
    assert!(removed(&r).is_empty(), "{:?}", removed(&r));
    s.on_request(&dreq(VIRTUAL_HOST, &[], &[], &r.nonce));
    // A host added, one changed, one removed: only the namespace's.
    let api = format!("{cfg}/api.default:80");
    let v2 = edit(
        &v1,
        &[
            (VIRTUAL_HOST, &api, "a1"),
            (VIRTUAL_HOST, &web, "w2"),
            (VIRTUAL_HOST, "outbound|http/web.default:80", "shared2"),
        ],
        &[(VIRTUAL_HOST, &db)],
    );
    s.on_snapshot(&v2, 2);
    let r = s.poll_response().unwrap();
    let mut got = delta_names(&r);
    got.sort();
    assert_eq!(got, [(api.as_str(), "a1"), (web.as_str(), "w2")]);
    assert_eq!(removed(&r), [db.as_str()]);
    s.on_request(&dreq(VIRTUAL_HOST, &[], &[], &r.nonce));
    // Unsubscribed: forgotten, nothing more sent for it.
    s.on_request(&dreq(VIRTUAL_HOST, &[], &[cfg], ""));
    s.on_snapshot(&edit(&v2, &[(VIRTUAL_HOST, &web, "w3")], &[]), 3);
    assert!(s.poll_response().is_none());
}

/// A reconnecting Envoy announces the virtual hosts it holds: only what changed, and
/// what went away meanwhile, is sent.
#[test]
fn delta_vhds_a_reconnect_gets_only_what_changed_in_the_namespace() {
    let v1 = set(&[
        (VIRTUAL_HOST, "r/a:80", "a1"),
        (VIRTUAL_HOST, "r/b:80", "b2"),
    ]);
    let mut s = DeltaState::new(VIRTUAL_HOST);
    s.on_snapshot(&v1, 1);
    let mut req = dreq(VIRTUAL_HOST, &["r"], &[], "");
    for (name, value) in [("r/a:80", "a1"), ("r/b:80", "b1"), ("r/gone:80", "g1")] {
        req.initial_resource_versions
            .insert(name.into(), ContentHash::of(value.as_bytes()).to_hex());
    }
    s.on_request(&req);
    let r = s.poll_response().unwrap();
    assert_eq!(delta_names(&r), [("r/b:80", "b2")]);
    assert_eq!(removed(&r), ["r/gone:80"]);
}

/// A virtual host is a part of its route configuration: a new one goes out after
/// the route configuration and after the cluster it routes to; a removed cluster
/// goes out only after the virtual host that routed to it has moved off it.
#[test]
fn ads_delta_vhds_virtual_hosts_are_made_after_clusters_and_broken_before_them() {
    let mut ads: DeltaAds<V> = DeltaAds::new();
    let v1 = set(&[
        (CLUSTER, "old", "old"),
        (ROUTE, "r", "r"),
        (VIRTUAL_HOST, "r/web:80", "to-old"),
    ]);
    ads.on_snapshot(&v1, 1);
    for (t, sub) in [
        (CLUSTER, &[][..]),
        (ROUTE, &["r"][..]),
        (VIRTUAL_HOST, &["r"][..]),
    ] {
        ads.on_request(&dreq(t, sub, &[], ""));
        let r = ads.poll_response().unwrap();
        ads.on_request(&dreq(t, &[], &[], &r.nonce));
    }
    let v2 = edit(
        &v1,
        &[
            (CLUSTER, "new", "new"),
            (VIRTUAL_HOST, "r/web:80", "to-new"),
        ],
        &[(CLUSTER, "old")],
    );
    ads.on_snapshot(&v2, 2);
    let make = ads.poll_response().unwrap();
    assert_eq!(make.type_url.as_ref(), CLUSTER);
    assert_eq!(delta_names(&make), [("new", "new")]);
    assert!(make.removed_resources.is_empty(), "old is not removed yet");
    let vh = ads.poll_response().unwrap();
    assert_eq!(vh.type_url.as_ref(), VIRTUAL_HOST);
    assert_eq!(delta_names(&vh), [("r/web:80", "to-new")]);
    ads.on_request(&dreq(CLUSTER, &[], &[], &make.nonce));
    let brk = ads.poll_response().unwrap();
    assert_eq!(
        (brk.type_url.as_ref(), removed(&brk)),
        (CLUSTER, vec!["old"])
    );
}

/// Envoy (1.40, Delta ADS) opens its virtual host subscription naming nothing and
/// adds each route configuration's VHDS watch without a request: the route
/// configurations the stream subscribes to are its VHDS namespaces. A configuration's
/// virtual hosts go out after the configuration itself (before it, Envoy has no watch
/// for them and drops them), and those of a configuration it did not ask for never.
#[test]
fn ads_delta_vhds_follows_the_route_configurations_the_stream_subscribes_to() {
    let mut ads: DeltaAds<V> = DeltaAds::new();
    let v1 = set(&[
        (ROUTE, "r", "r"),
        (ROUTE, "s", "s"),
        (VIRTUAL_HOST, "r/a:80", "a1"),
        (VIRTUAL_HOST, "s/b:80", "b1"),
    ]);
    ads.on_snapshot(&v1, 1);
    ads.on_request(&dreq(ROUTE, &["r"], &[], ""));
    let rds = ads.poll_response().unwrap();
    ads.on_request(&dreq(ROUTE, &[], &[], &rds.nonce));
    ads.on_request(&dreq(VIRTUAL_HOST, &[], &[], ""));
    let vh = ads.poll_response().unwrap();
    assert_eq!(vh.type_url.as_ref(), VIRTUAL_HOST);
    assert_eq!(delta_names(&vh), [("r/a:80", "a1")]);
    ads.on_request(&dreq(VIRTUAL_HOST, &[], &[], &vh.nonce));
    // A second configuration: its virtual hosts after it, never before.
    ads.on_request(&dreq(ROUTE, &["s"], &[], ""));
    let rds = ads.poll_response().unwrap();
    assert_eq!(
        (rds.type_url.as_ref(), delta_names(&rds)),
        (ROUTE, vec![("s", "s")])
    );
    let vh = ads.poll_response().unwrap();
    assert_eq!(delta_names(&vh), [("s/b:80", "b1")]);
    // Unsubscribing the configuration forgets its virtual hosts: no more updates.
    ads.on_request(&dreq(VIRTUAL_HOST, &[], &[], &vh.nonce));
    ads.on_request(&dreq(ROUTE, &[], &["s"], &rds.nonce));
    ads.on_snapshot(&edit(&v1, &[(VIRTUAL_HOST, "s/b:80", "b2")], &[]), 2);
    assert!(ads.poll_response().is_none());
}

/// A reconnecting Envoy subscribes its route configurations, then announces the
/// virtual hosts it holds in its first VHDS request (naming nothing): only what
/// changed meanwhile is sent, and what went away is removed, not kept forever.
#[test]
fn ads_delta_vhds_a_reconnect_gets_what_changed_and_the_removal_of_what_went_away() {
    let mut ads: DeltaAds<V> = DeltaAds::new();
    let v1 = set(&[
        (ROUTE, "r", "r"),
        (VIRTUAL_HOST, "r/a:80", "a2"),
        (VIRTUAL_HOST, "r/b:80", "b1"),
    ]);
    ads.on_snapshot(&v1, 1);
    let mut rds = dreq(ROUTE, &["r"], &[], "");
    rds.initial_resource_versions
        .insert("r".into(), ContentHash::of(b"r").to_hex());
    ads.on_request(&rds);
    let mut vhds = dreq(VIRTUAL_HOST, &[], &[], "");
    for (name, value) in [("r/a:80", "a1"), ("r/b:80", "b1"), ("r/gone:80", "g1")] {
        vhds.initial_resource_versions
            .insert(name.into(), ContentHash::of(value.as_bytes()).to_hex());
    }
    ads.on_request(&vhds);
    let mut sent = Vec::new();
    while let Some(r) = ads.poll_response() {
        if r.type_url.as_ref() == VIRTUAL_HOST {
            sent.push((
                delta_names(&r)
                    .into_iter()
                    .map(|(n, v)| (n.to_string(), v.to_string()))
                    .collect::<Vec<_>>(),
                removed(&r)
                    .into_iter()
                    .map(str::to_string)
                    .collect::<Vec<_>>(),
            ));
        }
        let nonce = r.nonce.clone();
        ads.on_request(&dreq(r.type_url.as_ref(), &[], &[], &nonce));
    }
    assert_eq!(
        sent,
        [(
            vec![("r/a:80".to_string(), "a2".to_string())],
            vec!["r/gone:80".to_string()]
        )]
    );
}

/// A host name moving between services (one virtual host removed, another added with
/// its domain) while a listener's removal waits for the listener type's ACK: the old
/// virtual host's removal goes out with the new one, not after it. Envoy rejects a
/// route table with two virtual hosts sharing a domain (with whole route
/// configurations the move was one update).
#[test]
fn ads_delta_vhds_a_removed_virtual_host_is_not_held_behind_a_listeners_removal() {
    let mut ads: DeltaAds<V> = DeltaAds::new();
    let v1 = set(&[
        (LISTENER, "l1", "l1"),
        (LISTENER, "l2", "l2"),
        (ROUTE, "r", "r"),
        (VIRTUAL_HOST, "r/web.a:80", "web-a"),
    ]);
    ads.on_snapshot(&v1, 1);
    for (t, sub) in [
        (LISTENER, &[][..]),
        (ROUTE, &["r"][..]),
        (VIRTUAL_HOST, &[][..]),
    ] {
        ads.on_request(&dreq(t, sub, &[], ""));
        let r = ads.poll_response().unwrap();
        assert_eq!(r.type_url.as_ref(), t);
        ads.on_request(&dreq(t, &[], &[], &r.nonce));
    }
    // A listener change goes out and is not ACKed yet.
    let v2 = edit(&v1, &[(LISTENER, "l1", "l1b")], &[]);
    ads.on_snapshot(&v2, 2);
    let lds = ads.poll_response().unwrap();
    assert_eq!(lds.type_url.as_ref(), LISTENER);
    // Then a listener goes away (waiting for that ACK) and the host name moves.
    let v3 = edit(
        &v2,
        &[(VIRTUAL_HOST, "r/web.b:80", "web-b")],
        &[(LISTENER, "l2"), (VIRTUAL_HOST, "r/web.a:80")],
    );
    ads.on_snapshot(&v3, 3);
    let vh = ads.poll_response().unwrap();
    assert_eq!(vh.type_url.as_ref(), VIRTUAL_HOST);
    assert_eq!(delta_names(&vh), [("r/web.b:80", "web-b")]);
    assert_eq!(removed(&vh), ["r/web.a:80"]);
}
