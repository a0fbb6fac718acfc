//! The CA directory (`--ca-dir`: files an operator or cert-manager writes), judged by
//! `flock_bird::identity::ca_dir::validate` over the files' contents, as the loader
//! calls it after reading them.
//!
//! Input: the files NUL-separated, in the order `ca-cert.pem`, `ca-key.pem`,
//! `root-cert.pem`, `cert-chain.pem` (absent when the input has fewer than three NULs);
//! PEM never holds a NUL. Validated at a fixed time, 2027-01-01, so an input means the
//! same on every run.
//!
//! Never a panic, and:
//! - a refusal names one of the four files (or the directory) with a bounded reason;
//! - an accepted set has at least one root, its chain and roots are PEM certificates
//!   again, and it is valid now (`not_after` is not in the past: every leaf it signs
//!   ends there at the latest). That a leaf it signs verifies against its roots,
//!   `validate` proves itself before it accepts.
#![no_main]

use std::path::Path;

use flock_bird::identity::ca_dir::{
    CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, CaDirFiles, ROOT_CERT_FILE, validate,
};
use flock_core::UnixMs;
use libfuzzer_sys::fuzz_target;
use rustls_pki_types::CertificateDer;
use rustls_pki_types::pem::PemObject as _;
use zeroize::Zeroizing;

/// 2027-01-01T00:00:00Z.
const NOW: UnixMs = UnixMs(1_798_761_600_000);
const TRUST_DOMAIN: &str = "cluster.local";

fuzz_target!(|data: &[u8]| {
    let mut parts = data.splitn(4, |b| *b == 0);
    let mut next = || parts.next().map(<[u8]>::to_vec);
    let (ca_cert, ca_key, root_cert) = (
        next().unwrap_or_default(),
        next().unwrap_or_default(),
        next().unwrap_or_default(),
    );
    let cert_chain = next();
    let dir = Path::new("/etc/flock/ca");
    let files =
        CaDirFiles::from_contents(dir, ca_cert, Zeroizing::new(ca_key), cert_chain, root_cert);
    match validate(files, TRUST_DOMAIN, NOW) {
        Err(e) => {
            let named = [CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE]
                .iter()
                .map(|f| dir.join(f))
                .any(|p| p == e.path);
            assert!(named || e.path == dir, "{}", e.path.display());
            assert!(!e.reason.is_empty());
            assert!(
                e.reason.len() < 4096,
                "a refusal must stay short: {} bytes",
                e.reason.len()
            );
        }
        Ok(set) => {
            let certs = |pem: &str| {
                CertificateDer::pem_slice_iter(pem.as_bytes())
                    .collect::<Result<Vec<_>, _>>()
                    .expect("the set's PEM is certificates")
            };
            assert!(!certs(set.roots_pem()).is_empty());
            certs(set.chain_pem());
            assert!(set.describe().len() < 4096);
            assert!(
                set.not_after_ms() >= NOW,
                "accepted a set that expired at {} ms: {}",
                set.not_after_ms().as_millis(),
                set.describe()
            );
        }
    }
});
