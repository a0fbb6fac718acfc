//! The node-scoped signer's outside input: a node's CSR (`BuiltinCa::sign_csr`, the
//! bytes are the node's), the client certificate it authenticates with
//! (`flock_ca::server::node_of_peer`), and the operator's scope file
//! (`flock_core::issuance::parse_scope`). Each input is read all three ways.
//!
//! Never a panic, and:
//! - a signed CSR yields a leaf whose one URI SAN is the ID asked for, whatever names
//!   the CSR carried;
//! - a certificate authenticates a node only if its URI SAN is a node credential of
//!   the trust domain, and the node named is a valid node name;
//! - a parsed scope names only valid nodes, namespaces and accounts.
#![no_main]

use flock_bird::identity::BuiltinCa;
use flock_core::pod::{check_label, check_node_name, check_subdomain};
use libfuzzer_sys::fuzz_target;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

const TD: &str = "cluster.local";
const ID: &str = "spiffe://cluster.local/ns/pay/sa/api";

fn ca() -> &'static Arc<BuiltinCa> {
    static CA: OnceLock<Arc<BuiltinCa>> = OnceLock::new();
    CA.get_or_init(|| {
        BuiltinCa::new(TD, Duration::from_secs(600), || flock_core::UnixMs(1_800_000_000_000))
            .expect("a node-local CA")
    })
}

fuzz_target!(|data: &[u8]| {
    if let Ok(leaf) = ca().sign_csr(data, ID, Duration::from_secs(600)) {
        let (_, pem) = x509_parser::pem::parse_x509_pem(leaf.cert_chain_pem.as_bytes())
            .expect("the signer's own PEM parses");
        assert_eq!(flock_ca::server::uri_san(&pem.contents).as_deref(), Some(ID));
    }
    if let Ok(node) = flock_ca::server::node_of_peer(TD, Some(data)) {
        check_node_name(&node).expect("an authenticated node has a valid name");
        let uri = flock_ca::server::uri_san(data).expect("authenticated by its URI SAN");
        assert_eq!(uri, flock_core::issuance::node_id(TD, &node));
    }
    if let Ok(text) = std::str::from_utf8(data)
        && let Ok(scope) = flock_core::issuance::parse_scope(text)
    {
        for (node, accounts) in &scope.nodes {
            check_node_name(node).expect("scope node");
            for (ns, sa) in accounts {
                check_label(ns).expect("scope namespace");
                check_subdomain(sa).expect("scope account");
            }
        }
    }
});
