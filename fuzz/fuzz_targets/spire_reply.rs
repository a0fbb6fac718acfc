//! A SPIRE agent's replies on the Delegated Identity API, decoded with prost from the
//! spire-api types and converted by the SPIRE bridge's own pure functions
//! (`svid_of_response` for `SubscribeToX509SVIDs`, `bundles_of_response` for
//! `SubscribeToX509Bundles`). Each input is decoded as both messages.
//!
//! Never a panic, and:
//! - an SVID is the message's first one: its SPIFFE ID is `spiffe://` + the message's
//!   trust domain + a path, and its trust domain parses back (as the translation
//!   reads it); its PEM chain decodes to exactly the message's DER chain and its PEM
//!   key to the message's key; its serial is hex;
//! - every bundle is under a valid trust domain and its PEM decodes to the
//!   certificates whose concatenation the message sent; every entry is either a bundle
//!   or a refusal;
//! - refusals are short (a bounded message; names cut to 64 characters).
#![no_main]

use flock_bird::identity::spire::{bundles_of_response, svid_of_response};
use flock_bird::identity::validate_trust_domain;
use flock_core::access::spiffe_trust_domain;
use libfuzzer_sys::fuzz_target;
use prost::Message as _;
use rustls_pki_types::pem::PemObject as _;
use rustls_pki_types::{CertificateDer, PrivatePkcs8KeyDer};
use spire_api::pb::spire::api::agent::delegatedidentity::v1 as pb;

fuzz_target!(|data: &[u8]| {
    if let Ok(resp) = pb::SubscribeToX509sviDsResponse::decode(data) {
        svids(resp);
    }
    if let Ok(resp) = pb::SubscribeToX509BundlesResponse::decode(data) {
        bundles(resp);
    }
});

fn svids(resp: pb::SubscribeToX509sviDsResponse) {
    let first = resp.x509_svids.first().cloned();
    match svid_of_response(resp) {
        Ok(None) => assert!(first.is_none()),
        Ok(Some(svid)) => {
            let sent = first.expect("an SVID from a message with one");
            let x = sent.x509_svid.expect("an SVID has its certificate");
            let td = x.id.expect("an SVID has its ID").trust_domain;
            let path = svid
                .spiffe_id
                .strip_prefix(&format!("spiffe://{td}/"))
                .expect("the ID is the message's trust domain and a path");
            assert!(!path.is_empty());
            assert_eq!(spiffe_trust_domain(&svid.spiffe_id), Some(td.as_str()));
            let chain = CertificateDer::pem_slice_iter(svid.cert_chain_pem.as_bytes())
                .collect::<Result<Vec<_>, _>>()
                .expect("the chain is PEM certificates");
            assert_eq!(chain.len(), x.cert_chain.len());
            for (pem, der) in chain.iter().zip(&x.cert_chain) {
                assert_eq!(pem.as_ref(), der.as_ref());
            }
            let key = PrivatePkcs8KeyDer::from_pem_slice(svid.private_key_pem.expose().as_bytes())
                .expect("the key is a PKCS#8 PEM block");
            assert_eq!(key.secret_pkcs8_der(), sent.x509_svid_key.as_ref());
            assert!(!svid.serial.is_empty());
            assert!(svid.serial.bytes().all(|b| b.is_ascii_hexdigit()));
        }
        Err(e) => {
            assert!(!e.is_empty());
            assert!(e.len() < 256, "a refusal must stay short: {e:?}");
        }
    }
}

fn bundles(resp: pb::SubscribeToX509BundlesResponse) {
    let sent = resp.ca_certificates.clone();
    let (bundles, refused) = bundles_of_response(resp);
    // `spiffe://td` and `td` are one trust domain: two entries may make one bundle.
    assert!(bundles.len() + refused.len() <= sent.len());
    assert!(bundles.len() + refused.len() >= sent.len().min(1));
    for (td, bundle) in &bundles {
        assert_eq!(&bundle.trust_domain, td);
        assert!(validate_trust_domain(td).is_ok(), "{td:?}");
        let certs = CertificateDer::pem_slice_iter(bundle.ca_pem.as_bytes())
            .collect::<Result<Vec<_>, _>>()
            .expect("the bundle is PEM certificates");
        assert!(!certs.is_empty());
        let der: Vec<u8> = certs.iter().flat_map(|c| c.iter().copied()).collect();
        let from = [td.clone(), format!("spiffe://{td}")];
        assert!(
            from.iter()
                .any(|name| sent.get(name).is_some_and(|d| d.as_ref() == der)),
            "the bundle of {td:?} is not what was sent"
        );
    }
    for (name, reason) in &refused {
        assert!(name.chars().count() <= 64);
        assert!(!reason.is_empty());
        assert!(reason.len() < 256, "a refusal must stay short: {reason:?}");
    }
}
