//! Switches that put a fixed bug back, so a test can show it catches that bug.
//!
//! Every fix of a race or trust bug in this workspace keeps its old shape behind
//! [`reintroduced!`](crate::reintroduced)`("<name>")`. In every real build (no
//! `--cfg flock_mutants`) the macro is the constant `false` and the old shape is
//! compiled out. The test script builds the workspace's tests once with
//! `--cfg flock_mutants`; then `FLOCK_REINTRODUCE="<name> ..."` in a test's
//! environment (inherited by the binaries it starts) turns those bugs back on, and the
//! test guarding each fix must fail. One build serves every mutant: before, each
//! mutant was its own compile-time cfg and its own release build, which cost CI most of
//! an hour.
//!
//! A name not in [`KNOWN`] does not compile, so a typo cannot leave a mutant that
//! never switches on.

/// Every name [`reintroduced!`](crate::reintroduced) accepts. The repository's
/// `docs/races.md` and the test script's mutant table say what each one breaks.
pub const KNOWN: &[&str] = &[
    "r1",
    "r3",
    "r4",
    "r6",
    "r7",
    "r8",
    "r8-lock",
    "ledger-shared-hash",
    "ledger-rewrite",
    "xds-stale-nonce",
    "xds-eds-before-cds",
    "xds-eds-behind-unacked-cds",
    "xds-break-before-make",
    "xds-unsubscribed-response",
    "xds-snapshot-regress",
    "xds-unbounded-stream",
    "xds-auth-bypass",
    "xds-accept-spin",
    "r4-agent",
    "r4-kube-resync",
    "r6-agent",
    "r6-spire",
    "gc-unconditional",
    "install-scan-before-arm",
    "installer-drops-early-events",
    "registry-trust-all",
    "agent-xds-trust-node",
    "admin-accept-spin",
    "cni-any-peer",
    "regsync-unguarded",
    "abandoned-add-kept",
    "del-counts-pending-keys",
    "svid-wall-rotation",
    "etcd-resume-compacted",
    "etcd-relist-replace",
    "service-table-delta-over-gap",
    "service-table-exclusions-in-one-pass",
    "memo-changes-keep-gone",
    "regsync-plan-misses-view-changes",
    "undo-unconditional",
    "gc-unsubscribe-unconditional",
    "issuance-any-node",
    "netns-node-allowed",
    "capture-annotation-lowers-enforced",
    "capture-strict-declared-ports-only",
    "probe-snat-any-host-socket",
    "capture-probe-gateway-exempt",
    "capture-inbound-from-loopback",
    "capture-outbound-from-node",
    "authz-allow-before-deny",
    "authz-unknown-field-ignored",
    "authz-change-not-rederived",
    "envoy-user-ignored",
    "registry-wildcard-identity",
    "noncanonical-address",
    "xds-union-peer-identities",
    "route-retries-non-idempotent",
    "agent-no-node-lock",
    "load-publishes-before-sync",
    "route-status-unconditional",
    "grpc-server-without-rbac",
    "capture-redirects-proxyless-port",
    "shm-removed-under-successor",
    "supervisor-stops-successors-parent",
    "registry-uncapped-node",
    "registry-any-scope",
    "xds-shared-connection-pool",
    "xds-idle-connections-kept",
    "xds-unbudgeted-subscriptions",
    "xds-tls-no-reload",
    "envoy-abstract-socket",
    "envoy-socket-mode-open",
    "envoy-control-dir-open",
    "envoy-control-dir-foreign",
];

/// Whether `name` is in [`KNOWN`] (a `const fn`, so the macro checks it at compile
/// time).
pub const fn is_known(name: &str) -> bool {
    let mut i = 0;
    while i < KNOWN.len() {
        if str_eq(KNOWN[i], name) {
            return true;
        }
        i += 1;
    }
    false
}

const fn str_eq(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

/// Whether this process was asked to re-introduce `name`: it is one of the
/// whitespace-separated names in `FLOCK_REINTRODUCE`, read once per process.
#[cfg(flock_mutants)]
pub fn active(name: &str) -> bool {
    // std's OnceLock even under loom: this is configuration read before any model
    // runs its threads, not state a model explores.
    static NAMES: std::sync::OnceLock<Vec<String>> = std::sync::OnceLock::new();
    NAMES
        .get_or_init(|| {
            std::env::var("FLOCK_REINTRODUCE")
                .unwrap_or_default()
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        })
        .iter()
        .any(|n| n == name)
}

/// Without `--cfg flock_mutants` (every real build) nothing is ever re-introduced.
#[cfg(not(flock_mutants))]
#[inline(always)]
pub const fn active(_name: &str) -> bool {
    false
}

/// `reintroduced!("<name>")`: whether the fixed bug `<name>` is switched back on
/// ([`active`]); always `false` in a build without `--cfg flock_mutants`. A name not in
/// [`KNOWN`] does not compile. See the [module docs](crate::reintroduce).
#[macro_export]
macro_rules! reintroduced {
    ($name:literal) => {{
        const _: () = assert!(
            $crate::reintroduce::is_known($name),
            "not a name in flock_core::reintroduce::KNOWN"
        );
        $crate::reintroduce::active($name)
    }};
}
