//! SPIFFE IDs: the one read from a peer's client certificate
//! (`flock_xds::server::identity_of`, the bytes are the client's) and then judged by
//! the xDS access policy (`flock_core::access::decide`), and the trust-domain parsers
//! the policy, the translation and the identity providers use. Each input is read both
//! ways: as a DER certificate and as the text of an ID.
//!
//! Never a panic, and:
//! - a certificate yields a `spiffe://` ID or none, and a subject of at most 512
//!   characters;
//! - the policy admits a gRPC client only with an ID of its own trust domain, and an
//!   Envoy only with a listed ID;
//! - the two trust-domain parsers (`flock_core::access::spiffe_trust_domain` and
//!   `flock_xds::translate::model::trust_domain`) agree, and what they return is the
//!   non-empty authority of an ID of at most 2048 bytes with a non-empty path;
//! - a trust domain and path segment the identity providers accept
//!   (`validate_trust_domain`, `validate_path_segment`) make an ID whose trust domain
//!   parses back to the same one.
#![no_main]

use std::collections::BTreeSet;

use flock_bird::identity::{spiffe_id, validate_path_segment, validate_trust_domain};
use flock_core::access::{Access, AccessPolicy, PeerFacts, decide, spiffe_trust_domain};
use flock_xds::server::identity_of;
use flock_xds::translate::model::trust_domain;
use libfuzzer_sys::fuzz_target;

const TRUST_DOMAIN: &str = "cluster.local";
const ENVOY_ID: &str = "spiffe://cluster.local/ns/flock/sa/envoy";

fuzz_target!(|data: &[u8]| {
    certificate(data);
    let text = String::from_utf8_lossy(data);
    id_text(&text);
    // The text split in two at the first NUL: a trust domain and a path segment.
    let (td, segment) = text.split_once('\0').unwrap_or((&text, "sa"));
    parts(td, segment);
});

fn certificate(der: &[u8]) {
    let (id, subject) = identity_of(der);
    assert!(
        subject.chars().count() <= 512,
        "a subject is cut at 512 characters"
    );
    if let Some(id) = &id {
        assert!(id.starts_with("spiffe://"), "not a SPIFFE ID: {id:?}");
    }
    let policy = AccessPolicy {
        allow_uids: BTreeSet::new(),
        allow_gids: BTreeSet::new(),
        trust_domain: TRUST_DOMAIN.to_string(),
        envoy_spiffe_ids: [ENVOY_ID.to_string()].into(),
    };
    let facts = PeerFacts::Tls {
        spiffe_id: id.as_deref(),
        certificate: id.is_some() || !subject.is_empty(),
    };
    match decide(&policy, facts) {
        Access::Envoy { spiffe_id } => assert_eq!(spiffe_id, ENVOY_ID),
        Access::Grpc { spiffe_id } => {
            assert_eq!(id.as_deref(), Some(spiffe_id.as_str()));
            assert_eq!(spiffe_trust_domain(&spiffe_id), Some(TRUST_DOMAIN));
        }
        Access::Local { .. } => panic!("a TLS peer is never a local process"),
        Access::Denied(_) | Access::Unauthenticated(_) => {}
    }
}

fn id_text(id: &str) {
    let td = spiffe_trust_domain(id);
    assert_eq!(
        td,
        trust_domain(id),
        "the access policy and the translation read {id:?} differently"
    );
    if let Some(td) = td {
        assert!(!td.is_empty() && !td.contains('/'));
        assert!(id.len() <= 2048);
        let path = id
            .strip_prefix("spiffe://")
            .and_then(|rest| rest.strip_prefix(td))
            .and_then(|rest| rest.strip_prefix('/'))
            .expect("the trust domain is the ID's authority");
        assert!(!path.is_empty());
    }
}

fn parts(td: &str, segment: &str) {
    let td_ok = validate_trust_domain(td);
    let segment_ok = validate_path_segment(segment);
    for refusal in [&td_ok, &segment_ok]
        .into_iter()
        .filter_map(|r| r.as_ref().err())
    {
        assert!(!refusal.is_empty());
        assert!(
            refusal.len() < 256,
            "a refusal quotes one character at most"
        );
    }
    if td_ok.is_ok() {
        assert!(!td.is_empty() && td.len() <= 255);
    }
    if td_ok.is_ok() && segment_ok.is_ok() {
        assert!(segment != "." && segment != "..");
        let id = spiffe_id(td, segment, segment);
        assert_eq!(spiffe_trust_domain(&id), Some(td), "{id:?}");
        assert_eq!(trust_domain(&id), Some(td), "{id:?}");
    }
}
