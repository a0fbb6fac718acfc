//! The `file` backend's on-disk format and its atomic, crash-safe write.
//!
//! Format (versioned so a future change is detected, not misread):
//! `{"schema":1,"revision":N,"endpoints":[{"mod_revision":R,"endpoint":{...}},...]}`.

use super::RegistryError;
use crate::model::Endpoint;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// The schema this version reads and writes.
pub(crate) const SCHEMA: u64 = 1;

/// One stored endpoint with the revision of its last write.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Entry {
    pub(crate) mod_revision: u64,
    pub(crate) endpoint: Endpoint,
}

#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileBody {
    schema: u64,
    revision: u64,
    endpoints: Vec<Entry>,
}

/// Only the schema, read first so an unknown schema is an error rather than "corrupt".
#[derive(Deserialize)]
struct SchemaOnly {
    schema: u64,
}

/// What was loaded.
pub(crate) struct Loaded {
    pub(crate) revision: u64,
    pub(crate) entries: BTreeMap<String, Entry>,
}

fn io_err(path: &Path, what: &str, source: std::io::Error) -> RegistryError {
    RegistryError::Io {
        backend: format!("file:{}", path.display()),
        what: format!("{what} {}", path.display()),
        source,
    }
}

/// Loads `path`: missing is empty; too large or an unknown schema is an error; anything
/// unreadable as schema 1 is renamed aside to `PATH.corrupt-<ms>` (warn) and the
/// registry starts empty, because a node agent must come up rather than crash-loop on
/// a torn or hand-edited file.
pub(crate) fn load(path: &Path, max_bytes: u64) -> Result<Loaded, RegistryError> {
    let empty = Loaded {
        revision: 0,
        entries: BTreeMap::new(),
    };
    let file = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(empty),
        Err(e) => return Err(io_err(path, "opening", e)),
    };
    let size = file
        .metadata()
        .map_err(|e| io_err(path, "reading metadata of", e))?
        .len();
    if size > max_bytes {
        return Err(RegistryError::FileTooLarge {
            path: path.to_path_buf(),
            size,
            limit: max_bytes,
        });
    }
    let mut bytes = Vec::new();
    // `take` bounds the read even if the file grows after the metadata check.
    file.take(max_bytes.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(|e| io_err(path, "reading", e))?;
    if bytes.len() as u64 > max_bytes {
        return Err(RegistryError::FileTooLarge {
            path: path.to_path_buf(),
            size: bytes.len() as u64,
            limit: max_bytes,
        });
    }
    let parsed = match decode(&bytes) {
        Err(Decoded::UnsupportedSchema(schema)) => {
            return Err(RegistryError::UnsupportedSchema {
                path: path.to_path_buf(),
                schema,
                supported: SCHEMA,
            });
        }
        Err(Decoded::Corrupt(why)) => Err(why),
        Ok(loaded) => Ok(loaded),
    };
    match parsed {
        Ok(loaded) => Ok(loaded),
        Err(why) => {
            let aside = aside_path(path);
            std::fs::rename(path, &aside).map_err(|e| io_err(path, "renaming aside corrupt", e))?;
            tracing::warn!(
                file = %path.display(),
                moved_to = %aside.display(),
                error = %why,
                "registry file is corrupt; moved it aside and starting with an empty registry"
            );
            Ok(empty)
        }
    }
}

/// Why file bytes are not a registry: a newer schema (kept in place) or anything
/// else (the caller moves the file aside).
#[derive(Debug)]
pub(crate) enum Decoded {
    UnsupportedSchema(u64),
    Corrupt(String),
}

/// Parses the registry file's bytes (no I/O; the fuzz target drives this).
pub(crate) fn decode(bytes: &[u8]) -> Result<Loaded, Decoded> {
    if let Ok(s) = serde_json::from_slice::<SchemaOnly>(bytes)
        && s.schema != SCHEMA
    {
        return Err(Decoded::UnsupportedSchema(s.schema));
    }
    let body =
        serde_json::from_slice::<FileBody>(bytes).map_err(|e| Decoded::Corrupt(e.to_string()))?;
    let mut entries = BTreeMap::new();
    let mut revision = body.revision;
    for entry in body.endpoints {
        revision = revision.max(entry.mod_revision);
        let key = entry.endpoint.key();
        if entries.insert(key.clone(), entry).is_some() {
            return Err(Decoded::Corrupt(format!("endpoint {key:?} appears twice")));
        }
    }
    Ok(Loaded { revision, entries })
}

fn aside_path(path: &Path) -> PathBuf {
    let ms = flock_clock::unix_now().as_millis();
    let mut s = path.as_os_str().to_os_string();
    s.push(format!(".corrupt-{ms}"));
    PathBuf::from(s)
}

/// Serializes the whole registry.
pub(crate) fn encode(
    revision: u64,
    entries: &BTreeMap<String, Entry>,
) -> Result<Vec<u8>, serde_json::Error> {
    let body = FileBody {
        schema: SCHEMA,
        revision,
        endpoints: entries.values().cloned().collect(),
    };
    serde_json::to_vec_pretty(&body)
}

static TEMP_COUNTER: AtomicU64 = AtomicU64::new(0);

/// Replaces `path` with `bytes` atomically: a reader (or a crash) sees the old file or
/// the new one, never a mix. Temp file in the same directory (O_EXCL | O_NOFOLLOW,
/// mode 0600: endpoints reveal the pod layout), fsync, rename, fsync the directory so
/// the rename itself is durable.
pub(crate) fn write_atomic(path: &Path, bytes: &[u8]) -> Result<(), RegistryError> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(|e| io_err(&dir, "creating directory", e))?;
    }
    let file_name = path
        .file_name()
        .ok_or_else(|| RegistryError::Invalid {
            backend: format!("file:{}", path.display()),
            reason: "the path has no file name".to_string(),
        })?
        .to_string_lossy()
        .into_owned();
    let tmp = dir.join(format!(
        ".{file_name}.tmp-{}-{}",
        std::process::id(),
        TEMP_COUNTER.fetch_add(1, Ordering::Relaxed)
    ));
    let result = (|| {
        let mut f = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
            .open(&tmp)
            .map_err(|e| io_err(&tmp, "creating temp file", e))?;
        f.write_all(bytes).map_err(|e| io_err(&tmp, "writing", e))?;
        f.sync_all().map_err(|e| io_err(&tmp, "fsyncing", e))?;
        std::fs::rename(&tmp, path).map_err(|e| io_err(path, "renaming temp file onto", e))?;
        File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(|e| io_err(&dir, "fsyncing directory", e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}
