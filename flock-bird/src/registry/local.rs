//! The embedded backends: `memory` (a map behind a lock) and `file:PATH` (the same,
//! persisted to `PATH` on every change).
//!
//! Revisions are a counter: every successful put or delete increments it, and a put's
//! new value is the key's mod revision, like etcd's. The view is sent before a call
//! returns, so `put(..).await` followed by `view().borrow()` sees the write.

use super::persist::{self, Entry};
use super::{Registry, RegistryError, RegistryOptions, Rejections, View};
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

#[derive(Clone, Default)]
struct State {
    revision: u64,
    entries: BTreeMap<String, Entry>,
}

impl State {
    fn view(&self) -> View {
        View {
            endpoints: self
                .entries
                .iter()
                .map(|(k, e)| (k.clone(), e.endpoint.clone()))
                .collect(),
            revisions: self
                .entries
                .iter()
                .map(|(k, e)| (k.clone(), e.mod_revision))
                .collect(),
            revision: self.revision,
            synced: true,
            generation: 1,
            ..View::default()
        }
    }
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
            },
        ))
    }

    fn with_state(describe: String, path: Option<PathBuf>, state: State) -> Self {
        let (view_tx, _) = watch::channel(Arc::new(state.view()));
        Self {
            describe,
            path,
            state: Mutex::new(state),
            view_tx,
            rejections: Arc::default(),
        }
    }

    /// Makes `next` the state: persists it first (if file-backed; on failure nothing
    /// changes, so memory never runs ahead of the file), then publishes the view.
    async fn commit(&self, current: &mut State, next: State) -> Result<(), RegistryError> {
        if let Some(path) = &self.path {
            let bytes = persist::encode(next.revision, &next.entries).map_err(|e| {
                RegistryError::Encode {
                    backend: self.describe.clone(),
                    key: String::new(),
                    source: e,
                }
            })?;
            let path = path.clone();
            let describe = self.describe.clone();
            // The lock stays held across the write, so files are written in revision order.
            tokio::task::spawn_blocking(move || persist::write_atomic(&path, &bytes))
                .await
                .map_err(|e| RegistryError::Io {
                    backend: describe,
                    what: "writing the registry file".to_string(),
                    source: std::io::Error::other(e),
                })??;
        }
        *current = next;
        self.view_tx.send_replace(Arc::new(current.view()));
        Ok(())
    }
}

#[async_trait::async_trait]
impl Registry for LocalRegistry {
    async fn put(&self, ep: &Endpoint) -> Result<u64, RegistryError> {
        let mut state = self.state.lock().await;
        let mut next = state.clone();
        next.revision += 1;
        let revision = next.revision;
        next.entries.insert(
            ep.key(),
            Entry {
                mod_revision: revision,
                endpoint: ep.clone(),
            },
        );
        self.commit(&mut state, next).await?;
        Ok(revision)
    }

    async fn delete(&self, key: &str) -> Result<bool, RegistryError> {
        let mut state = self.state.lock().await;
        if !state.entries.contains_key(key) {
            return Ok(false);
        }
        let mut next = state.clone();
        next.revision += 1;
        next.entries.remove(key);
        self.commit(&mut state, next).await?;
        Ok(true)
    }

    async fn delete_if_revision(&self, key: &str, revision: u64) -> Result<bool, RegistryError> {
        let mut state = self.state.lock().await;
        match state.entries.get(key) {
            Some(e) if e.mod_revision == revision => {}
            _ => return Ok(false),
        }
        let mut next = state.clone();
        next.revision += 1;
        next.entries.remove(key);
        self.commit(&mut state, next).await?;
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
