//! The embedded backends: `memory` (a map behind a lock) and `file:PATH` (the same,
//! persisted to `PATH` on every change).
//!
//! Revisions are a counter: every successful put or delete increments it, and a put's
//! new value is the key's mod revision, like etcd's. The view is sent before a call
//! returns, so `put(..).await` followed by `view().borrow()` sees the write. Each view
//! is the last one with the one change applied (persistent maps) and names it
//! ([`View::delta`], [`View::recent`]), like etcd's.

use super::persist::{self, Entry};
use super::{
    Delta, DeltaLog, Registered, Registry, RegistryError, RegistryOptions, Rejections, View,
};
use crate::model::Endpoint;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use tokio::sync::{Mutex, watch};

/// The `memory` and `file:PATH` backends.
pub struct LocalRegistry {
    describe: String,
    path: Option<PathBuf>,
    state: Mutex<State>,
    view_tx: watch::Sender<Arc<View>>,
    /// Only this agent writes here, so nothing is refused at decode; the agent still
    /// records never-downgrade exclusions.
    rejections: Arc<Rejections>,
}

#[derive(Default)]
struct State {
    revision: u64,
    entries: BTreeMap<String, Entry>,
    log: DeltaLog,
}

/// The first view of `state`: every entry, no delta (a subscriber files it whole).
fn first_view(state: &State) -> View {
    View {
        endpoints: state
            .entries
            .iter()
            .map(|(k, e)| {
                (
                    k.clone(),
                    Registered::new(e.endpoint.clone(), e.mod_revision),
                )
            })
            .collect(),
        revision: state.revision,
        synced: true,
        generation: 1,
        ..View::default()
    }
}

/// `prev` with `key` set to `now` (or removed) at `revision`: the persistent maps share
/// every other entry, and a changed endpoint is the next [`View::delta`]. Building
/// each view from the whole map made every write O(registry), and a view without
/// deltas made every subscriber re-read the whole registry per write: the agent's own
/// ADD paid both, once per pod present.
fn next_view(
    prev: &View,
    log: &mut DeltaLog,
    key: &str,
    now: Option<&Endpoint>,
    revision: u64,
) -> View {
    let mut next = prev.clone();
    next.revision = revision;
    let mut delta = Delta::default();
    match now {
        Some(ep) => {
            match next
                .endpoints
                .insert(key.to_string(), Registered::new(ep.clone(), revision))
            {
                None => delta.added.push(key.to_string()),
                Some(old) if *old.endpoint != *ep => delta.changed.push(key.to_string()),
                Some(_) => {}
            }
        }
        None => {
            if next.endpoints.remove(key).is_some() {
                delta.removed.push(key.to_string());
            }
        }
    }
    if !delta.is_empty() {
        log.push(delta);
        log.stamp(&mut next);
    }
    next
}

impl LocalRegistry {
    /// An empty in-memory registry (`memory`).
    pub fn memory() -> Self {
        Self::with_state("memory".to_string(), None, State::default())
    }

    /// Opens `file:PATH`: loads `path` if it exists (see the module docs of the format;
    /// a corrupt file is moved aside and the registry starts empty).
    pub async fn open_file(path: &Path, opts: &RegistryOptions) -> Result<Self, RegistryError> {
        let owned = path.to_path_buf();
        let max = opts.file_max_bytes;
        let loaded = tokio::task::spawn_blocking(move || persist::load(&owned, max))
            .await
            .map_err(|e| RegistryError::Io {
                backend: format!("file:{}", path.display()),
                what: format!("loading {}", path.display()),
                source: std::io::Error::other(e),
            })??;
        tracing::info!(
            file = %path.display(),
            endpoints = loaded.entries.len(),
            revision = loaded.revision,
            "registry file loaded"
        );
        Ok(Self::with_state(
            format!("file:{}", path.display()),
            Some(path.to_path_buf()),
            State {
                revision: loaded.revision,
                entries: loaded.entries,
                log: DeltaLog::default(),
            },
        ))
    }

    fn with_state(describe: String, path: Option<PathBuf>, state: State) -> Self {
        let (view_tx, _) = watch::channel(Arc::new(first_view(&state)));
        Self {
            describe,
            path,
            state: Mutex::new(state),
            view_tx,
            rejections: Arc::default(),
        }
    }

    /// Sets `key` to `now` (or removes it) at the next revision: persists first (if
    /// file-backed; on failure the change is undone, so memory never runs ahead of the
    /// file), then publishes the view. Returns the new revision.
    async fn change(
        &self,
        state: &mut State,
        key: &str,
        now: Option<&Endpoint>,
    ) -> Result<u64, RegistryError> {
        let revision = state.revision + 1;
        let old = match now {
            Some(ep) => state.entries.insert(
                key.to_string(),
                Entry {
                    mod_revision: revision,
                    endpoint: ep.clone(),
                },
            ),
            None => state.entries.remove(key),
        };
        if let Err(e) = self.persist(revision, &state.entries).await {
            match old {
                Some(old) => state.entries.insert(key.to_string(), old),
                None => state.entries.remove(key),
            };
            return Err(e);
        }
        state.revision = revision;
        let next = next_view(&self.view_tx.borrow(), &mut state.log, key, now, revision);
        self.view_tx.send_replace(Arc::new(next));
        Ok(revision)
    }

    /// Writes the whole registry to the file, if file-backed. The caller holds the
    /// state lock across the write, so files are written in revision order.
    async fn persist(
        &self,
        revision: u64,
        entries: &BTreeMap<String, Entry>,
    ) -> Result<(), RegistryError> {
        let Some(path) = &self.path else {
            return Ok(());
        };
        let bytes = persist::encode(revision, entries).map_err(|e| RegistryError::Encode {
            backend: self.describe.clone(),
            key: String::new(),
            source: e,
        })?;
        let path = path.clone();
        let describe = self.describe.clone();
        tokio::task::spawn_blocking(move || persist::write_atomic(&path, &bytes))
            .await
            .map_err(|e| RegistryError::Io {
                backend: describe,
                what: "writing the registry file".to_string(),
                source: std::io::Error::other(e),
            })?
    }
}

#[async_trait::async_trait]
impl Registry for LocalRegistry {
    async fn put(&self, ep: &Endpoint) -> Result<u64, RegistryError> {
        let mut state = self.state.lock().await;
        self.change(&mut state, &ep.key(), Some(ep)).await
    }

    async fn delete(&self, key: &str) -> Result<bool, RegistryError> {
        let mut state = self.state.lock().await;
        if !state.entries.contains_key(key) {
            return Ok(false);
        }
        self.change(&mut state, key, None).await?;
        Ok(true)
    }

    async fn delete_if_revision(&self, key: &str, revision: u64) -> Result<bool, RegistryError> {
        let mut state = self.state.lock().await;
        match state.entries.get(key) {
            Some(e) if e.mod_revision == revision => {}
            _ => return Ok(false),
        }
        self.change(&mut state, key, None).await?;
        Ok(true)
    }

    fn view(&self) -> watch::Receiver<Arc<View>> {
        self.view_tx.subscribe()
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }

    fn rejections(&self) -> Option<Arc<Rejections>> {
        Some(Arc::clone(&self.rejections))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Health;
    use flock_core::pod::{PodKey, Protocol};

    fn endpoint(container: &str, port: u16) -> Endpoint {
        Endpoint {
            service: "web".into(),
            namespace: "default".into(),
            service_port: 8080,
            protocol: Protocol::Http,
            address: "10.0.0.1".parse().unwrap(),
            port,
            node: "n1".into(),
            pod: format!("default/{container}"),
            pod_key: PodKey::new(container, "eth0"),
            region: String::new(),
            zone: String::new(),
            health: Health::Healthy,
            identity: None,
            also_accept: Vec::new(),
            labels: Default::default(),
        }
    }

    /// Each write is one delta of the view it makes, counted by `seq` and kept in
    /// `recent`; a put of an equal endpoint moves the revision only (no delta), like
    /// etcd's view. A subscriber that applies the deltas has the view's endpoints.
    #[tokio::test]
    async fn each_write_is_one_delta_of_the_view() {
        let reg = LocalRegistry::memory();
        let a = endpoint("a", 15001);
        let b = endpoint("b", 15001);
        reg.put(&a).await.unwrap();
        reg.put(&b).await.unwrap();
        let v = reg.view().borrow().clone();
        assert_eq!((v.seq, v.recent.len()), (2, 2));
        assert_eq!(v.delta.added, vec![b.key()]);
        // The same endpoint again: a new revision, no new delta.
        let rev = reg.put(&a).await.unwrap();
        let v = reg.view().borrow().clone();
        assert_eq!(v.seq, 2);
        assert_eq!(v.revision_of(&a.key()), Some(rev));
        // A changed endpoint, then a delete.
        let a2 = endpoint("a", 15002);
        reg.put(&a2).await.unwrap();
        assert!(reg.delete(&b.key()).await.unwrap());
        assert!(!reg.delete(&b.key()).await.unwrap(), "already gone");
        let v = reg.view().borrow().clone();
        assert_eq!(v.seq, 4);
        let deltas: Vec<&Delta> = v.recent.iter().map(|d| &**d).collect();
        assert_eq!(deltas[2].changed, vec![a.key()]);
        assert_eq!(deltas[3].removed, vec![b.key()]);
        assert!(Arc::ptr_eq(v.recent.last().unwrap(), &v.delta));
        // Replaying the deltas over an empty map gives the view's keys.
        let mut keys = std::collections::BTreeSet::new();
        for d in &deltas {
            keys.extend(d.added.iter().cloned());
            for k in &d.removed {
                keys.remove(k);
            }
        }
        assert_eq!(keys, v.endpoints.keys().cloned().collect());
        assert_eq!(v.endpoints.get(&a.key()).map(|e| &**e), Some(&a2));
    }
}
