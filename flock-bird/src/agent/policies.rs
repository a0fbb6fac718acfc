//! The agent's authorization policies from a watched directory (`--authz-dir`): one
//! file per target, `<namespace>.json` or `<namespace>.<service>.json`, read into the
//! agent's core ([`flock_core::agent::AgentCore::set_policy`]) and published.
//!
//! A change of one file re-reads that file alone (its name is in the inotify event),
//! and the core names only its target as changed, so the publish re-derives only the
//! pods that target governs. An event on any other name (a ConfigMap volume swaps
//! its `..data` symlink, not the files), a lost watch, and a timer every `resync`
//! re-read the whole directory: what an event could have missed is caught there.
//!
//! In kube mode the policies are the `AuthorizationPolicy` objects of the reflectors
//! instead ([`follow_kube`], mapped by [`flock_kube::policy`]), with the same checks.
//!
//! A file that cannot be read, does not parse or does not check is kept as a refusal
//! for the target its name gives: every call to that namespace or service is denied
//! until it is fixed (fail closed), and the status names it. A file whose name gives
//! no target is named in the log and ignored (it governs nothing it could refuse).

use super::Agent;
use flock_core::authz::{MAX_SPEC_BYTES, PolicyError, Sourced, Target};
use std::collections::BTreeSet;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Most policy files in the directory the agent reads (a bound on its memory).
pub const MAX_FILES: usize = 10_000;

/// What the directory says about `target`'s file at `path`: its policy, a refusal, or
/// `None` when there is no such file.
pub fn read_file(path: &Path, target: &Target) -> Option<Sourced> {
    let origin = path.display().to_string();
    let refused = |reason: String| Sourced {
        origin: origin.clone(),
        written: Err(PolicyError {
            field: "file".to_string(),
            reason,
        }),
    };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => return Some(refused(format!("cannot open: {e}"))),
    };
    match file.metadata() {
        Ok(m) if !m.is_file() => return Some(refused("not a regular file".to_string())),
        Err(e) => return Some(refused(format!("cannot stat: {e}"))),
        Ok(_) => {}
    }
    let mut bytes = Vec::new();
    // One byte over the limit is enough to refuse it, with the parser's message.
    if let Err(e) = file.take(MAX_SPEC_BYTES as u64 + 1).read_to_end(&mut bytes) {
        return Some(refused(format!("cannot read: {e}")));
    }
    Some(Sourced::read(origin, target, &bytes))
}

impl Agent {
    /// Puts `target`'s policy (or its removal) into the core and, when what is in
    /// force changed, publishes. Returns whether it changed.
    pub fn set_policy(&self, target: &Target, policy: Option<Sourced>) -> bool {
        let log = policy.clone();
        let changed = self.core().set_policy(target.clone(), policy);
        if changed {
            match log {
                None => tracing::info!(%target, "authorization policy removed"),
                Some(Sourced {
                    origin,
                    written: Ok(_),
                }) => tracing::info!(%target, %origin, "authorization policy in force"),
                Some(Sourced {
                    origin,
                    written: Err(e),
                }) => tracing::warn!(
                    %target, %origin, error = %e,
                    "authorization policy refused: every call to {target} is denied until it is fixed"
                ),
            }
            let version = self.publish();
            tracing::debug!(%target, version, "policy change published");
        }
        changed
    }

    /// The policies in force, by target.
    pub fn policies(&self) -> Vec<(Target, Arc<Sourced>)> {
        self.core()
            .policies()
            .iter()
            .map(|(t, p)| (t.clone(), Arc::clone(p)))
            .collect()
    }
}

/// Re-reads every policy file of `dir` into `agent`; a target whose file is gone is
/// removed. Names that give no target are returned (for the log).
pub fn resync_dir(agent: &Agent, dir: &Path) -> Vec<String> {
    let mut seen = BTreeSet::new();
    let mut ignored = Vec::new();
    match std::fs::read_dir(dir) {
        Ok(entries) => {
            for entry in entries.flatten().take(MAX_FILES) {
                let name = entry.file_name().to_string_lossy().into_owned();
                if name.starts_with('.') {
                    // `..data` and its timestamped directories, editors' swap files.
                    continue;
                }
                let Some(target) = Target::from_file_name(&name) else {
                    ignored.push(name);
                    continue;
                };
                let policy = read_file(&dir.join(&name), &target);
                if policy.is_some() {
                    seen.insert(target.clone());
                }
                agent.set_policy(&target, policy);
            }
        }
        Err(e) => {
            // An unreadable directory keeps what is in force: dropping every policy
            // would open every service (fail closed, not open).
            tracing::warn!(dir = %dir.display(), error = %e, "cannot read the policy directory; keeping the policies in force");
            return ignored;
        }
    }
    for (target, _) in agent.policies() {
        if !seen.contains(&target) {
            agent.set_policy(&target, None);
        }
    }
    ignored
}

/// Follows `dir` forever (see the [module docs](self)). Spawn it; abort to stop.
pub async fn watch_dir(agent: Arc<Agent>, dir: PathBuf, resync: Duration) {
    use tokio_stream::StreamExt as _;
    let mut warned: BTreeSet<String> = BTreeSet::new();
    let full = |warned: &mut BTreeSet<String>| {
        for name in resync_dir(&agent, &dir) {
            if warned.insert(name.clone()) {
                tracing::warn!(dir = %dir.display(), file = %name,
                    "policy file name is neither <namespace>.json nor <namespace>.<service>.json; ignored");
            }
        }
    };
    let mut events = arm_watch(&dir);
    full(&mut warned);
    let mut timer = tokio::time::interval(resync);
    timer.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    timer.tick().await;
    loop {
        let event = async {
            match events.as_mut() {
                Some(stream) => stream.next().await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            ev = event => {
                // An overflowed queue lost events: read all of it, as after a lost watch.
                let live = crate::dirwatch::alive(ev.as_ref())
                    && !matches!(&ev, Some(Ok(e)) if e.mask.contains(inotify::EventMask::Q_OVERFLOW));
                if live {
                    let target = match &ev {
                        Some(Ok(e)) => e.name.as_ref().and_then(|n| n.to_str()).and_then(Target::from_file_name),
                        _ => None,
                    };
                    match target {
                        // One file changed: that file alone.
                        Some(t) => {
                            let policy = read_file(&dir.join(t.file_name()), &t);
                            agent.set_policy(&t, policy);
                        }
                        None => full(&mut warned),
                    }
                } else {
                    // The directory is gone or moved, the queue overflowed, or the
                    // watch broke: watch what is there now, and read all of it.
                    tracing::warn!(dir = %dir.display(), "policy directory watch lost; re-arming it");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    events = arm_watch(&dir);
                    full(&mut warned);
                }
            }
            _ = timer.tick() => {
                if events.is_none() {
                    events = arm_watch(&dir);
                }
                full(&mut warned);
            }
        }
    }
}

/// A watch of the directory's entries: a file closed after writing, renamed in or
/// out, or deleted (not created: a file just created is still empty, and reading it
/// then would refuse its target until the write closes).
fn arm_watch(dir: &Path) -> Option<crate::dirwatch::EventStream> {
    use inotify::WatchMask;
    crate::dirwatch::arm(
        dir,
        WatchMask::CLOSE_WRITE | WatchMask::MOVED_TO | WatchMask::MOVED_FROM | WatchMask::DELETE,
        "policy directory",
    )
}

/// Kube mode's source: puts the `AuthorizationPolicy` objects of `kube`'s reflectors
/// into `agent` whenever they change ([`flock_kube::policy::policies_by_target`]: one
/// policy or refusal per target; a target no object names any more is removed).
/// Nothing is put before the reflectors' first list: an unsynced snapshot would read
/// as "no policies", and removing every policy would open every service. Returns when
/// the reflectors stop.
pub async fn follow_kube(agent: Arc<Agent>, kube: Arc<crate::kube::KubePods>) {
    let mut view = kube.watch().view();
    let mut seen: Option<
        imbl::OrdMap<(String, String), Arc<flock_kube::policy::AuthorizationPolicy>>,
    > = None;
    loop {
        let snapshot = view.borrow_and_update().clone();
        let unchanged = seen.as_ref().is_some_and(|s| s.ptr_eq(&snapshot.policies));
        if snapshot.synced && !unchanged {
            let by_target = flock_kube::policy::policies_by_target(
                snapshot.policies.iter().map(|(k, v)| (k, &**v)),
            );
            for (target, _) in agent.policies() {
                if !by_target.contains_key(&target) {
                    agent.set_policy(&target, None);
                }
            }
            for (target, policy) in by_target {
                agent.set_policy(&target, Some(policy));
            }
            seen = Some(snapshot.policies.clone());
        }
        if view.changed().await.is_err() {
            return;
        }
    }
}
