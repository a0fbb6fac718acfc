#![cfg(not(loom))]
//! Property tests for `flock_core::lifecycle`: the liveness state machine and the
//! merge-not-replace load (R3).

use std::collections::{BTreeMap, BTreeSet};

use flock_core::MonoMs;
use flock_core::lifecycle::liveness::{Health, Liveness, LivenessPolicy};
use flock_core::lifecycle::merge::PodTable;
use proptest::prelude::*;

fn arb_policy() -> impl Strategy<Value = LivenessPolicy> {
    (0u64..20_000, 0u32..5, 0u32..5).prop_map(|(warmup_ms, h, u)| LivenessPolicy {
        interval_ms: 5_000,
        warmup_ms,
        healthy_threshold: h,
        unhealthy_threshold: u,
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    /// Liveness over random probe sequences (monotonic time, starting up to 5 s
    /// before or after the pod was added):
    /// * every reported transition changes the health (from = previous, to = new),
    ///   and the health never changes without a report (exactly one per change);
    /// * Healthy is reached only when the last `healthy_threshold` probes passed,
    ///   Unhealthy only when the last `unhealthy_threshold` probes failed outside
    ///   warm-up, and never during warm-up;
    /// * conversely, once the thresholds are met the state has changed (no missed
    ///   transition).
    #[test]
    fn liveness_transitions_exactly_at_thresholds_and_never_in_warmup(
        policy in arb_policy(),
        added_ms in 5_000u64..10_000,
        start_offset in 0u64..10_000,
        probes in prop::collection::vec((0u64..7_000, any::<bool>()), 0..60),
    ) {
        let h = policy.healthy_threshold.max(1) as usize;
        let u = policy.unhealthy_threshold.max(1) as usize;
        let mut l = Liveness::new(MonoMs(added_ms), policy);
        let mut now = added_ms - 5_000 + start_offset;
        let mut history: Vec<(u64, bool)> = Vec::new();
        let counted_failure = |t: u64, ok: bool| !ok && t.saturating_sub(added_ms) >= policy.warmup_ms;
        for (dt, ok) in probes {
            now += dt;
            history.push((now, ok));
            let before = l.health();
            let report = l.observe(MonoMs(now), ok);
            let after = l.health();
            match report {
                Some(t) => {
                    prop_assert_eq!(t.from, before);
                    prop_assert_eq!(t.to, after);
                    prop_assert_ne!(t.from, t.to);
                    let tail_len = match t.to {
                        Health::Healthy => h,
                        Health::Unhealthy => u,
                        Health::Unknown | Health::Draining => {
                            return Err(TestCaseError::fail("back to Unknown, or Draining"));
                        }
                    };
                    prop_assert!(history.len() >= tail_len);
                    let tail = &history[history.len() - tail_len..];
                    if t.to == Health::Healthy {
                        prop_assert!(tail.iter().all(|(_, ok)| *ok));
                    } else {
                        prop_assert!(!l.in_warmup(MonoMs(now)));
                        prop_assert!(tail.iter().all(|(t, ok)| counted_failure(*t, *ok)));
                    }
                }
                None => prop_assert_eq!(before, after, "health changed without a report"),
            }
            if history.len() >= h && history[history.len() - h..].iter().all(|(_, ok)| *ok) {
                prop_assert_eq!(after, Health::Healthy);
            }
            if history.len() >= u
                && history[history.len() - u..].iter().all(|(t, ok)| counted_failure(*t, *ok))
            {
                prop_assert_eq!(after, Health::Unhealthy);
            }
        }
    }

    /// R3, sequentially interleaved: a startup load (read the store, later merge
    /// into the table) runs concurrently with a CNI worker doing adds and removes
    /// (each: store write, then table write). Whatever the interleaving:
    /// * every pod in the store at the end is in the table with the store's value
    ///   (no added pod is lost, no stale value wins);
    /// * the only table entries not in the store are pods the load read and that
    ///   were removed before its merge (the documented resurrection the GC repairs).
    ///
    /// Fails under `reintroduced!("r3")` (the wholesale replace loses adds).
    #[test]
    fn load_merge_never_loses_an_added_pod(
        initial in prop::collection::btree_set(0u32..6, 0..6),
        ops in prop::collection::vec((0u32..8, any::<bool>()), 0..12),
        read_at in any::<prop::sample::Index>(),
        merge_after in any::<prop::sample::Index>(),
    ) {
        let mut storage: BTreeMap<u32, u64> = initial.iter().map(|k| (*k, 0)).collect();
        let table: PodTable<u32, u64> = PodTable::new();
        // The CNI worker's sub-steps: op i is steps 2i (store) and 2i+1 (table).
        let n = ops.len() * 2;
        let read_at = read_at.index(n + 1);
        let merge_at = read_at + merge_after.index(n + 1 - read_at);
        let mut snapshot: Option<BTreeMap<u32, u64>> = None;
        for step in 0..=n {
            if step == read_at {
                snapshot = Some(storage.clone());
            }
            if step == merge_at {
                table.load_merge(snapshot.clone().unwrap_or_default());
            }
            if step == n {
                break;
            }
            let (pod, add) = ops[step / 2];
            let version = step as u64 / 2 + 1;
            match (add, step % 2) {
                (true, 0) => { storage.insert(pod, version); }
                (true, _) => { table.insert(pod, version); }
                (false, 0) => { storage.remove(&pod); }
                (false, _) => { table.remove(&pod); }
            }
        }
        let live = table.snapshot();
        for (pod, version) in &storage {
            prop_assert_eq!(live.get(pod), Some(version), "R3: pod {} lost or stale in the table after the load", pod);
        }
        let read: BTreeSet<u32> = snapshot.unwrap_or_default().into_keys().collect();
        for pod in live.keys().filter(|p| !storage.contains_key(p)) {
            prop_assert!(read.contains(pod), "pod {} appeared from nowhere", pod);
        }
    }
}
