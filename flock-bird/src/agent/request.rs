//! An AddPod request checked into a pod record, by the one pod validator the CNI
//! plugin, the store and the translation share (`flock_core::pod`).

use super::{Agent, PodError};
use crate::model::PodRecord;

/// What AddPod needs from the CNI request, decoupled from the proto.
pub use flock_core::pod::AddRequest as AddPodInput;
/// Parses the ports annotation (`8080`, `8080/http,50051/grpc`, `5432/tcp`).
pub use flock_core::pod::parse_ports;

impl Agent {
    /// Validates an AddPod request into a record (no I/O): `Ok(None)` when the pod is
    /// not meshed, an error naming the field when anything the store, the registry or
    /// the translation would refuse is in it.
    pub fn record_for(&self, input: &AddPodInput) -> Result<Option<PodRecord>, PodError> {
        match flock_core::pod::admit(input) {
            Ok(Some(pod)) => Ok(Some(PodRecord::admitted(pod, flock_clock::unix_now()))),
            Ok(None) => Ok(None),
            Err(e) => Err(PodError::Invalid(e.to_string())),
        }
    }
}
