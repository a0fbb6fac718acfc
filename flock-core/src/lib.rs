//! The pure, deterministic core of flock: every decision the agent, CNI installer and supervisor make, with no I/O.
//!
//! flock is a service-mesh node agent. Its I/O crates (`flock-xds`, `flock-cni`,
//! `flock-bird`, `flock-hotrestart`) only perform I/O and feed results back into the
//! functions and small state machines of this crate, which decide what to do. That
//! split is what lets the races of a real mesh agent be fixed once, here, where loom
//! and proptest can see every interleaving — quinn-proto's design applied to a mesh
//! agent:
//!
//! * **no I/O and no async runtime**: inputs are values, outputs are decisions;
//! * **no clock reads**: time is an argument (`MonoMs` for deadlines and windows, Unix
//!   milliseconds for what other processes read);
//! * **no randomness**: jitter is an argument;
//! * **concurrent types use [`sync`]**, which is `loom::sync` under `--cfg loom`, so a
//!   loom test model-checks the code that ships.
//!
//! | module | decides | race or bug it rules out |
//! |---|---|---|
//! | [`agent`] | the node agent's pod state and every decision about it, as a sans-IO machine: per-pod turns, the re-checks after writes outside a turn, the GC's conditional removals, the start-up merge | R3, R4, R6 in the agent; the GC removing what a re-added pod owns; an abandoned ADD kept |
//! | [`snapshot`] | one publish point for state changes, versions, subscribers | R1 stale snapshot wins; R2 aliased mutation |
//! | [`resources`] | typed resource sets and their diff, content hash as version | unchanged resources resent; O(all) per change |
//! | [`cniconf`] | parsing, patching and unpatching CNI configs; the per-file ledger | the two-file patch loop, corrupted configs |
//! | [`pod`] | a pod's key, ports and the one validator of its fields | a pod accepted at ADD that the translation refuses (stored, registered, never served) |
//! | [`gc`] | which orphans to remove, with hysteresis and a breaker | leaks after crashes; mass deletion after a bug |
//! | [`lifecycle`] | pod add/remove order, loading, re-registration, liveness | R3 lost pod at startup; R4 ghost endpoint; R6 leaked subscription |
//! | [`epoch`] | Envoy hot-restart epochs, state-file writes, restart gate | R7 restart while initializing; R8 epoch file regresses |
//! | [`issuance`] | whether the signer issues a node the certificate it asks for: only for a pod on that node, as its service account | one node's root minting every identity of the trust domain |
//! | [`authz`] | whether a caller may call a service, by its verified identity: defaults, allow and deny rules, a pod's annotation narrowing its own policy | a policy that does not parse, or a field this version does not know, silently allowing calls; a pod widening its own policy |
//! | [`access`] | what an xDS peer may see, from what the transport authenticated; non-loopback listeners | a client claiming to be Envoy receiving every workload key |
//! | [`backoff`] | retry delays | synchronized retry storms |
//! | [`capture`] | a pod's transparent-capture nftables table, and whether the kernel's copy drifted | an app reaching the network, or a caller reaching the app, around Envoy |
//! | [`journal`] | which keys of a persistent map changed since an earlier snapshot | a per-pod derivation walking every pod to find the one that changed |
//! | [`labels`] | which endpoints a route subset selects, and the syntax of the labels that travel to other nodes | a label from another node's entry breaking a resource name |
//! | [`debounce`] | when a burst of events becomes one action (quiet period, cap) | an action per event; a never-quiet source postponing it forever |
//! | [`ratelimit`] | write-rate bound (token bucket) | an installer re-patching a constantly rewritten config as fast as it can |
//! | [`registry`] | the registry key layout and which remote entries an agent serves | one node's bad or forged entry taking a service down or widening who a caller trusts |
//! | [`regsync`] | the registry writes that make the registry hold exactly the live pods' endpoints | CNI failing while the registry is down; ghosts of writes abandoned midway |
//! | [`route`] | a Service's traffic policy from Gateway API `HTTPRoute`s: matches, weighted backends, timeouts, retries, and the order Envoy tries them in | a bad route (an unknown filter, a regex Envoy would refuse) breaking every route of the node; a `POST` retried twice |
//! | [`rotation`] | when a certificate (an SVID) is rotated: half its written lifetime after issuance, on the monotonic clock | a wall-clock step rotating every identity at once, or stalling rotation for hours |
//!
//! The names R1–R8 are the races described in the repository's `docs/races.md`. Each can be re-introduced with
//! [`reintroduced!`]`("<name>")`, a switch compiled only into the test script's
//! `--cfg flock_mutants` build (see [`reintroduce`]): the script turns each one on in
//! turn and requires the test guarding the fix to fail.
//!
//! # Example: the publish point
//!
//! ```
//! # if flock_core::sync::LOOM { return; } // loom's primitives work only inside a model
//! use flock_core::snapshot::Publisher;
//! use flock_core::resources::{ResourceSet, diff};
//! use flock_core::ContentHash;
//!
//! const CDS: &str = "type.googleapis.com/envoy.config.cluster.v3.Cluster";
//! let publisher = Publisher::new(ResourceSet::<Vec<u8>>::new());
//! let before = publisher.latest();
//! let after = publisher.publish(|prev| {
//!     let bytes = b"encoded cluster".to_vec();
//!     prev.edit().upsert(CDS, "svc-a", ContentHash::of(&bytes), bytes).build()
//! });
//! assert_eq!(after.version(), before.version() + 1);
//! assert_eq!(diff(before.state(), after.state()).types[CDS].added.len(), 1);
//! ```
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod access;
pub mod agent;
pub mod authz;
pub mod backoff;
pub mod capture;
pub mod cniconf;
pub mod debounce;
pub mod epoch;
pub mod gc;
pub mod hash;
pub mod issuance;
pub mod journal;
pub mod labels;
pub mod lifecycle;
pub mod pod;
pub mod ratelimit;
pub mod registry;
pub mod regsync;
pub mod reintroduce;
pub mod resources;
pub mod rotation;
pub mod route;
pub mod snapshot;
pub mod sync;
pub mod time;

pub use hash::ContentHash;
pub use time::{MonoMs, UnixMs};
