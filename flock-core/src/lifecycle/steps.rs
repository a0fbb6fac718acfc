//! The steps of `AddPod` and `RemovePod`, as data, in the only order the agent may
//! run them.
//!
//! The agent iterates [`ADD_POD`] / [`REMOVE_POD`] and performs each [`Step`]
//! against its store, identity provider, xDS cache and registry; it never orders
//! the calls itself. Every step is idempotent (CNI `DEL` may be repeated, `ADD` may
//! be retried), so a failed `AddPod` is rolled back by running [`REMOVE_POD`] in
//! full, and a crash anywhere leaves either a store record (the GC, the liveness
//! loop or the next `DEL` finish the job) or no store record and owner-tagged
//! leftovers (the orphan GC, [`crate::gc`], removes them).
//!
//! `AddPod`: durable first, remote last.
//! 1. [`Step::StoreWrite`]: nothing that can outlive the agent's process exists before
//!    the pod's durable record, so any crash leaves a record the GC can compare with
//!    the runtime and repair, and the liveness loop / resubscriber (which iterate the
//!    store) can see the pod. The agent may run the steps whose effects a restart
//!    rebuilds from the store (the identity subscription; the published snapshot,
//!    which the node's Envoy replaces with the restarted agent's) while the write's
//!    fsyncs run, and waits for them before a step whose effect would survive without
//!    the record (capture rules in the pod's netns, the registry entry) and before it
//!    answers.
//! 2. [`Step::CaptureApply`]: a captured pod's nftables rules are in its netns before
//!    ADD is answered (the pod's containers start after ADD, so no connection is
//!    ever made around Envoy); right after the store write because the stored record
//!    is what CNI CHECK and start-up repair verify the rules against. A no-op for a
//!    pod without capture.
//! 3. [`Step::IdentitySubscribe`]: the SVID is needed by the xDS config (SDS).
//! 4. [`Step::XdsPublish`]: the local proxy gets the pod's listeners and secret.
//! 5. [`Step::RegistryRegister`]: only now may remote agents send traffic; it lands
//!    on a proxy that already has config.
//!
//! `RemovePod`: invisible first (R4, R6).
//! 1. [`Step::StoreDelete`]: once teardown starts nothing can see the pod, so the
//!    liveness loop and the resubscriber, which re-check store membership after
//!    registering ([`super::guard`]), cannot resurrect its endpoint or subscription.
//! 2. [`Step::XdsWithdraw`]: the local proxy stops serving the pod.
//! 3. [`Step::RegistryUnregister`]: remote agents stop sending traffic.
//! 4. [`Step::IdentityUnsubscribe`]: after the withdraw, so the proxy never holds
//!    config that references a withdrawn secret.
//! 5. [`Step::CaptureRemove`]: last, so until the pod's proxy config is gone its
//!    traffic goes through Envoy or nowhere, never around it. Idempotent, and done
//!    when the netns is gone (its rules went with it).
//!
//! # Example
//!
//! ```
//! use flock_core::lifecycle::steps::{Op, Step, ADD_POD, REMOVE_POD};
//!
//! assert_eq!(ADD_POD.first(), Some(&Step::StoreWrite));
//! assert_eq!(ADD_POD.last(), Some(&Step::RegistryRegister));
//! assert_eq!(REMOVE_POD.first(), Some(&Step::StoreDelete));
//! // Every AddPod step has its undo in RemovePod.
//! for step in ADD_POD {
//!     assert!(Op::RemovePod.steps().contains(&step.undo()));
//! }
//! ```

use std::fmt;

use serde::{Deserialize, Serialize};

/// One externally visible action of the pod lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Step {
    /// Write the pod's record to the durable (fsync'd) pod store.
    StoreWrite,
    /// Install a captured pod's nftables rules in its network namespace (nothing for
    /// a pod without capture).
    CaptureApply,
    /// Subscribe to the pod's workload identity (SVID).
    IdentitySubscribe,
    /// Publish the pod's xDS resources to the local proxy.
    XdsPublish,
    /// Register the pod's endpoint in the shared registry.
    RegistryRegister,
    /// Delete the pod's record from the pod store.
    StoreDelete,
    /// Withdraw the pod's xDS resources.
    XdsWithdraw,
    /// Unregister the pod's endpoint from the registry.
    RegistryUnregister,
    /// Cancel the pod's identity subscription (or drop its reference to a shared
    /// one).
    IdentityUnsubscribe,
    /// Delete a captured pod's nftables table from its network namespace (nothing if
    /// the netns or the table is gone).
    CaptureRemove,
}

impl Step {
    /// The step that reverses this one.
    pub fn undo(self) -> Step {
        match self {
            Step::StoreWrite => Step::StoreDelete,
            Step::CaptureApply => Step::CaptureRemove,
            Step::IdentitySubscribe => Step::IdentityUnsubscribe,
            Step::XdsPublish => Step::XdsWithdraw,
            Step::RegistryRegister => Step::RegistryUnregister,
            Step::StoreDelete => Step::StoreWrite,
            Step::IdentityUnsubscribe => Step::IdentitySubscribe,
            Step::XdsWithdraw => Step::XdsPublish,
            Step::RegistryUnregister => Step::RegistryRegister,
            Step::CaptureRemove => Step::CaptureApply,
        }
    }

    /// Why the step sits where it does (for logs and docs).
    pub fn rationale(self) -> &'static str {
        match self {
            Step::StoreWrite => {
                "durable record first: a crash leaves a record the GC can repair, and \
                 background loops see the pod before anything else exists"
            }
            Step::CaptureApply => {
                "rules in the netns before ADD is answered, after the record they are \
                 verified against"
            }
            Step::IdentitySubscribe => "the SVID must exist before xDS config references it",
            Step::XdsPublish => "the local proxy has config before remote traffic can arrive",
            Step::RegistryRegister => "remote traffic last, once the local proxy is ready",
            Step::StoreDelete => {
                "invisible first (R4/R6): once teardown starts no background loop can \
                 see the pod, so its re-check undoes any late re-registration"
            }
            Step::XdsWithdraw => "the local proxy stops serving the pod",
            Step::RegistryUnregister => "remote agents stop routing to the pod",
            Step::IdentityUnsubscribe => {
                "after the withdraw: the proxy never holds config referencing a withdrawn \
                 secret"
            }
            Step::CaptureRemove => {
                "last: until the proxy config is gone, traffic goes through Envoy or \
                 nowhere, never around it"
            }
        }
    }
}

impl fmt::Display for Step {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// `AddPod`: store write → capture apply → identity subscribe → xDS publish →
/// registry register.
pub const ADD_POD: &[Step] = &[
    Step::StoreWrite,
    Step::CaptureApply,
    Step::IdentitySubscribe,
    Step::XdsPublish,
    Step::RegistryRegister,
];

/// `RemovePod`: store delete → xDS withdraw → registry unregister → identity
/// unsubscribe → capture remove. The store delete comes first (R4).
pub const REMOVE_POD: &[Step] = &[
    Step::StoreDelete,
    Step::XdsWithdraw,
    Step::RegistryUnregister,
    Step::IdentityUnsubscribe,
    Step::CaptureRemove,
];

/// Re-introduces R4 so the loom test can show it catches it; never enabled in
/// builds ([`Op::steps`] answers it under `reintroduced!("r4")`). This is the racy
/// order: unregister first, store delete last.
#[cfg(flock_mutants)]
const REMOVE_POD_R4: &[Step] = &[
    Step::RegistryUnregister,
    Step::XdsWithdraw,
    Step::IdentityUnsubscribe,
    Step::CaptureRemove,
    Step::StoreDelete,
];

/// A lifecycle operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Op {
    /// CNI `ADD`: bring a pod into the mesh.
    AddPod,
    /// CNI `DEL` (or the rollback of a failed `ADD`): take a pod out of the mesh.
    RemovePod,
}

impl Op {
    /// The ordered steps of this operation.
    pub fn steps(self) -> &'static [Step] {
        match self {
            Op::AddPod => ADD_POD,
            #[cfg(flock_mutants)]
            Op::RemovePod if crate::reintroduced!("r4") => REMOVE_POD_R4,
            Op::RemovePod => REMOVE_POD,
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn position(steps: &[Step], step: Step) -> usize {
        steps.iter().position(|s| *s == step).unwrap_or(usize::MAX)
    }

    #[test]
    fn add_pod_writes_the_store_first_and_registers_last() {
        assert_eq!(
            ADD_POD,
            &[
                Step::StoreWrite,
                Step::CaptureApply,
                Step::IdentitySubscribe,
                Step::XdsPublish,
                Step::RegistryRegister
            ]
        );
    }

    #[test]
    fn capture_rules_follow_the_record_and_precede_everything_that_serves_the_pod() {
        assert_eq!(
            position(ADD_POD, Step::CaptureApply),
            position(ADD_POD, Step::StoreWrite) + 1
        );
        assert_eq!(REMOVE_POD.last(), Some(&Step::CaptureRemove));
    }

    #[test]
    fn add_pod_subscribes_identity_before_publishing_xds_that_references_it() {
        assert!(position(ADD_POD, Step::IdentitySubscribe) < position(ADD_POD, Step::XdsPublish));
    }

    #[test]
    fn remove_pod_deletes_the_store_record_before_any_teardown() {
        assert_eq!(REMOVE_POD.first(), Some(&Step::StoreDelete));
        for step in [
            Step::RegistryUnregister,
            Step::IdentityUnsubscribe,
            Step::XdsWithdraw,
            Step::CaptureRemove,
        ] {
            assert!(position(REMOVE_POD, Step::StoreDelete) < position(REMOVE_POD, step));
        }
    }

    #[test]
    fn remove_pod_withdraws_local_config_before_unsubscribing_its_secret() {
        assert!(
            position(REMOVE_POD, Step::XdsWithdraw)
                < position(REMOVE_POD, Step::IdentityUnsubscribe)
        );
    }

    #[test]
    fn remove_pod_undoes_every_add_pod_step_exactly_once() {
        let mut undone: Vec<Step> = ADD_POD.iter().map(|s| s.undo()).collect();
        let mut remove = REMOVE_POD.to_vec();
        undone.sort();
        remove.sort();
        assert_eq!(undone, remove);
        for step in ADD_POD.iter().chain(REMOVE_POD) {
            assert_eq!(step.undo().undo(), *step);
            assert!(!step.rationale().is_empty());
        }
    }

    #[test]
    fn op_steps_are_the_constants() {
        assert_eq!(Op::AddPod.steps(), ADD_POD);
        assert_eq!(Op::RemovePod.steps(), REMOVE_POD);
        assert_eq!(Step::StoreDelete.to_string(), "StoreDelete");
    }
}
