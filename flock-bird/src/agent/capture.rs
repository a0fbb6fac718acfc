//! Transparent capture of a pod's traffic: installing its nftables table at ADD
//! (`Step::CaptureApply`), removing it at DEL (`Step::CaptureRemove`), verifying it at
//! CNI CHECK, and repairing drift at start-up.
//!
//! The rules and what a pod gets are pure (`flock_core::capture`, resolved into the
//! record's [`PodCapture`] at ADD); the `nft` runs are `flock_capture`'s and block, so
//! each runs on the blocking pool. What is verified and repaired is the stored record's
//! capture, not the node's current flags: a record is the promise made to the pod at
//! its ADD.

use super::Agent;
use crate::model::PodRecord;
use flock_capture::{CaptureError, Nft};
use flock_core::capture::policy::PodCapture;
use flock_core::capture::probe::NodeProbeTable;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

/// Capture counters for `/metrics`.
#[derive(Debug, Default)]
pub struct CaptureMetrics {
    /// Tables installed by an ADD (`flock_capture_applied_total`).
    pub applied: AtomicU64,
    /// Capture operations that failed: an apply at ADD, a removal, a start-up repair,
    /// or a CNI CHECK that found a pod's table missing or drifted
    /// (`flock_capture_errors_total`).
    pub errors: AtomicU64,
    /// Tables re-applied at start-up because they were missing or had drifted
    /// (`flock_capture_repairs_total`).
    pub repairs: AtomicU64,
}

/// Runs `op` with a fresh [`Nft`] on the blocking pool (`nft` is a child process).
async fn blocking<T: Send + 'static>(
    op: impl FnOnce(&Nft) -> Result<T, CaptureError> + Send + 'static,
) -> Result<T, String> {
    match tokio::task::spawn_blocking(move || op(&Nft::new())).await {
        Ok(r) => r.map_err(|e| e.to_string()),
        Err(e) => Err(format!("capture task: {e}")),
    }
}

impl Agent {
    /// `Step::CaptureApply`: installs the pod's table in its netns (nothing for a pod
    /// without capture).
    pub(super) async fn capture_apply(&self, rec: &PodRecord) -> Result<(), String> {
        let Some(capture) = &rec.capture else {
            return Ok(());
        };
        // Kubelet's probes get the probe source on their way to this pod before its
        // containers start (they start after the ADD is answered).
        self.refresh_node_table().await?;
        let netns = PathBuf::from(&rec.netns);
        let spec = capture.spec(rec.ip(), &rec.ports);
        match blocking(move |nft| nft.apply(&netns, &spec)).await {
            Ok(()) => {
                self.metrics.capture.applied.fetch_add(1, Ordering::Relaxed);
                tracing::info!(pod = %rec.pod_ref(), netns = %rec.netns, mode = ?capture.mode, "capture rules installed");
                Ok(())
            }
            Err(e) => {
                self.metrics.capture.errors.fetch_add(1, Ordering::Relaxed);
                Err(format!("capture rules for netns {}: {e}", rec.netns))
            }
        }
    }

    /// `Step::CaptureRemove`: deletes the table of a removed pod that was captured.
    /// Never fails the removal: a netns that is gone took its rules with it, and any
    /// other failure is logged and counted (the pod is out of the mesh either way; the
    /// table only redirects to an Envoy listener that no longer exists).
    pub(super) async fn capture_remove(&self, rec: &PodRecord) {
        if rec.capture.is_none() {
            return;
        }
        if let Err(e) = self.refresh_node_table().await {
            tracing::warn!(pod = %rec.pod_ref(), "{e}");
        }
        let netns = PathBuf::from(&rec.netns);
        if !netns.exists() {
            return;
        }
        match blocking(move |nft| nft.remove(&netns)).await {
            Ok(()) => {
                tracing::debug!(pod = %rec.pod_ref(), netns = %rec.netns, "capture rules removed")
            }
            Err(e) => {
                self.metrics.capture.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(pod = %rec.pod_ref(), netns = %rec.netns, "removing the capture rules failed: {e}");
            }
        }
    }

    /// Rebuilds the node's probe table (`inet`/`bridge flock_node`, see
    /// `flock_core::capture::probe`) from the live captured pods' addresses, when the
    /// node names probe cgroups (`--capture-probe-cgroup`); nothing otherwise. The
    /// pods are read after the lock is taken, so the last rebuild always reflects
    /// every change that finished before it.
    pub(super) async fn refresh_node_table(&self) -> Result<(), String> {
        let cgroups = &self.cfg.capture.probe_cgroups;
        if cgroups.is_empty() {
            return Ok(());
        }
        let _turn = self.node_table.lock().await;
        let table = NodeProbeTable {
            cgroups: cgroups.iter().cloned().collect(),
            targets: self
                .core()
                .pods()
                .iter()
                .filter(|(_, rec)| rec.capture.is_some())
                .flat_map(|(_, rec)| rec.ips.iter().map(|ip| ip.to_canonical()))
                .collect(),
        };
        let targets = table.targets.len();
        match blocking(move |nft| nft.apply_node(None, &table)).await {
            Ok(()) => {
                tracing::debug!(targets, "node probe table rebuilt");
                Ok(())
            }
            Err(e) => {
                self.metrics.capture.errors.fetch_add(1, Ordering::Relaxed);
                Err(format!("the node's probe table (inet flock_node): {e}"))
            }
        }
    }

    /// CNI CHECK of a captured pod: its netns holds exactly the table its record
    /// gives. The error names the netns and the first difference.
    pub(super) async fn capture_check(&self, rec: &PodRecord) -> Result<(), String> {
        let Some(capture) = &rec.capture else {
            return Ok(());
        };
        let netns = PathBuf::from(&rec.netns);
        let spec = capture.spec(rec.ip(), &rec.ports);
        blocking(move |nft| nft.check(&netns, &spec))
            .await
            .map_err(|e| {
                self.metrics.capture.errors.fetch_add(1, Ordering::Relaxed);
                format!(
                    "pod {} ({}): capture rules not as installed: {e}",
                    rec.pod_ref(),
                    rec.key
                )
            })
    }

    /// Start-up: verifies each loaded captured pod whose netns still exists and
    /// re-applies its table when it is missing or drifted (a pod whose netns is gone
    /// is the GC's). Returns the number of tables repaired.
    pub(super) async fn capture_repair(&self, recs: &[PodRecord]) -> usize {
        let mut repaired = 0;
        for rec in recs {
            let Some(capture) = &rec.capture else {
                continue;
            };
            if !std::path::Path::new(&rec.netns).exists() {
                continue;
            }
            match self.repair_one(rec, capture).await {
                Ok(false) => {}
                Ok(true) => repaired += 1,
                Err(e) => {
                    self.metrics.capture.errors.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(pod = %rec.pod_ref(), netns = %rec.netns, "capture repair failed: {e}");
                }
            }
        }
        repaired
    }

    /// Whether `rec`'s table had to be re-applied.
    async fn repair_one(&self, rec: &PodRecord, capture: &PodCapture) -> Result<bool, String> {
        let netns = PathBuf::from(&rec.netns);
        let spec = capture.spec(rec.ip(), &rec.ports);
        let drift = {
            let (netns, spec) = (netns.clone(), spec.clone());
            match blocking(move |nft| match nft.check(&netns, &spec) {
                Ok(()) => Ok(None),
                Err(e @ (CaptureError::TableMissing(_) | CaptureError::Drifted { .. })) => {
                    Ok(Some(e.to_string()))
                }
                Err(e) => Err(e),
            })
            .await?
            {
                None => return Ok(false),
                Some(drift) => drift,
            }
        };
        blocking(move |nft| nft.apply(&netns, &spec)).await?;
        self.metrics.capture.repairs.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(pod = %rec.pod_ref(), netns = %rec.netns, %drift, "capture rules repaired at start-up (re-applied)");
        Ok(true)
    }
}
