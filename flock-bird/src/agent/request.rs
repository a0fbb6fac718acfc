//! An AddPod request checked into a pod record, by the one pod validator the store and
//! the translation share (`flock_core::pod`). The agent is the only judge of a CNI
//! request: the plugin does not know whether the annotations matter (with `--kube` they
//! do not), and reports the agent's refusal as CNI error 102.

use super::{Agent, PodError};
use crate::model::PodRecord;
use flock_core::capture::policy::resolve;
use flock_core::pod::AdmittedPod;

/// What AddPod needs from the CNI request, decoupled from the proto.
pub use flock_core::pod::AddRequest as AddPodInput;
/// Parses the ports annotation (`8080`, `8080/http,50051/grpc`, `5432/tcp`,
/// `50051/grpc-xds`).
pub use flock_core::pod::parse_ports;

impl Agent {
    /// Validates an AddPod request into a record (no I/O): `Ok(None)` when the pod is
    /// not meshed, an error naming the field when anything the store, the registry or
    /// the translation would refuse is in it.
    pub fn record_for(&self, input: &AddPodInput) -> Result<Option<PodRecord>, PodError> {
        match flock_core::pod::admit(input) {
            Ok(Some(pod)) => self.admitted_record(pod, input).map(Some),
            Ok(None) => Ok(None),
            // The pod's name as the runtime sees it, so the refusal (CNI error 102 at
            // the plugin) says which pod and which field. Bounded: the name itself may
            // be what is wrong.
            Err(e) => Err(PodError::Invalid(format!(
                "pod {}/{} cannot be meshed: {e}",
                bounded(&input.namespace),
                bounded(&input.name)
            ))),
        }
    }
}

impl Agent {
    /// The record of an admitted pod (from its annotations or, in kube mode, from the
    /// API), with its capture resolved against this node's settings
    /// ([`flock_core::capture::policy::resolve`]). A pod asking for
    /// what this node cannot give is refused, naming the annotation.
    pub(super) fn admitted_record(
        &self,
        pod: AdmittedPod,
        input: &AddPodInput,
    ) -> Result<PodRecord, PodError> {
        let mut capture = resolve(&self.cfg.capture, &pod.capture, &pod.ports).map_err(|e| {
            PodError::Invalid(format!(
                "pod {}/{} cannot be meshed: {e}",
                bounded(&input.namespace),
                bounded(&input.name)
            ))
        })?;
        if let Some(c) = &mut capture
            && flock_core::reintroduced!("capture-probe-gateway-exempt")
        {
            // The mutant exempts the node's address on the pod network again.
            for g in &input.gateways {
                if let Ok(ip) = g.trim().parse() {
                    c.probe_sources.push(flock_core::capture::Cidr::host(ip));
                }
            }
        }
        let mut rec = PodRecord::admitted(pod, flock_clock::unix_now());
        rec.capture = capture;
        Ok(rec)
    }
}

/// `s`, or its first 61 characters and `...` when longer than 64.
fn bounded(s: &str) -> String {
    if s.chars().count() <= 64 {
        s.to_owned()
    } else {
        let mut out: String = s.chars().take(61).collect();
        out.push_str("...");
        out
    }
}
