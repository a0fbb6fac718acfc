//! What a CNI request to the agent came to: done, ignored, or why not.

use flock_core::lifecycle::steps::Step;

/// Why a CNI request was not done.
#[derive(Debug, thiserror::Error)]
pub enum PodError {
    /// The request is malformed (the plugin reports it to the runtime).
    #[error("invalid request: {0}")]
    Invalid(String),
    /// Kube mode could not take the pod's facts from the Kubernetes API (unreachable,
    /// no such pod, another pod of that name); the message says why, for the runtime.
    #[error("{0}")]
    Unidentified(String),
    /// A step failed; the pod was rolled back.
    #[error("{step} failed: {message}")]
    Step {
        /// The step.
        step: Step,
        /// Why.
        message: String,
    },
}

/// What an AddPod/RemovePod did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodOutcome {
    /// Done; the message says what.
    Done(String),
    /// Nothing to do (not meshed, unknown pod); the message says why.
    Ignored(String),
}
