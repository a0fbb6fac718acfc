//! libcni >= 1.3 subdirectory drop-ins: chaining without editing the primary's file.
//!
//! What libcni does since v1.3.0 (`libcni/conf.go`):
//!
//! * `NetworkConfFromFile` (used by `ConfListFromFile`, i.e. only for `.conflist`
//!   files) parses the list, then, unless `loadOnlyInlinedPlugins` is true (a boolean,
//!   or `"true"`/`"false"` in any case), calls `NetworkPluginConfsFromFiles(dir, name)`
//!   and **appends** the result after the inlined `plugins`.
//! * That reads `filepath.Join(dir, <network name>)` with `ConfFiles(.., [".conf"])`:
//!   only regular entries whose `filepath.Ext` is exactly `.conf`; sub-directories are
//!   skipped; a missing directory means "no drop-ins". Order is `os.ReadDir`'s, which
//!   sorts by file name (byte order).
//! * Each file goes through `NetworkPluginConfFromBytes`: JSON that unmarshals into
//!   `types.PluginConf` with a non-empty `type`. No `name` or `cniVersion` is needed:
//!   `buildOneConfig` injects the list's `name` and `cniVersion` into every plugin at
//!   invocation time.
//! * One invalid drop-in fails the whole network (`return nil, err`): write it to a temp
//!   name whose extension is not `.conf`, validate, then rename into place.
//! * `.conf` (single-plugin) primaries go through `ConfFromFile` and never get drop-ins.
//! * Runtimes built with libcni < 1.3 ignore the directory silently: use drop-ins only
//!   when the runtime's libcni is known to be >= 1.3.

use serde_json::Value;

use super::error::CniConfError;
use super::json::{shorten, to_pretty_bytes};
use super::parse::{CniConfig, CniVersion, ConfigKind};
use super::patch::{OurPlugin, count_ours};

/// The drop-in's file name. libcni runs drop-ins in file-name byte order after the
/// inlined plugins, and flock must be last in the chain: `zz-` sorts after digits,
/// upper-case letters and every lower-case name not starting with `zz`, the usual
/// `NN-name.conf` convention. It cannot be *guaranteed* last (a `~x.conf` sorts later),
/// so the installer checks with [`DropIn::sorts_last_among`] and reports otherwise.
pub const DROPIN_FILE_NAME: &str = "zz-flock.conf";

/// The longest network name accepted as a directory name (Linux `NAME_MAX`).
pub const MAX_NETWORK_NAME_LEN: usize = 255;

/// A drop-in file to write: `<conf-dir>/<dir_name>/<file_name>` containing `bytes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DropIn {
    /// The sub-directory, named after the network; a single safe path component.
    pub dir_name: String,
    /// [`DROPIN_FILE_NAME`].
    pub file_name: String,
    /// Our plugin entry, pretty JSON plus newline.
    pub bytes: Vec<u8>,
}

impl DropIn {
    /// The name to write `bytes` to before renaming to [`DropIn::file_name`]; its
    /// extension is not `.conf`, so libcni never reads it half-written.
    pub fn temp_file_name(&self) -> String {
        super::parse::temp_file_name_for(&self.file_name)
    }

    /// Whether our file runs last among the `.conf` files named in `names` (the
    /// sub-directory's listing): no other `.conf` name sorts after ours.
    pub fn sorts_last_among<'a>(&self, names: impl IntoIterator<Item = &'a str>) -> bool {
        // `filepath.Ext(name) == ".conf"` is the same as ending in ".conf".
        names
            .into_iter()
            .map(|n| n.rsplit('/').next().unwrap_or(n))
            .filter(|n| n.ends_with(".conf"))
            .all(|n| n.as_bytes() <= self.file_name.as_bytes())
    }
}

/// Checks that a network name can be used as the drop-in directory name: the spec's
/// rule for network names (an ASCII letter or digit, then letters, digits, `_`, `.`,
/// `-`), at most [`MAX_NETWORK_NAME_LEN`] bytes. That excludes `/`, NUL, `.`, `..` and
/// anything else that could leave the config directory.
pub fn check_network_dir_name(name: &str) -> Result<(), CniConfError> {
    let unsafe_name = |why| CniConfError::UnsafeNetworkName {
        name: shorten(name),
        why,
    };
    let mut bytes = name.bytes();
    let Some(first) = bytes.next() else {
        return Err(unsafe_name("it is empty"));
    };
    if name.len() > MAX_NETWORK_NAME_LEN {
        return Err(unsafe_name("it is longer than 255 bytes"));
    }
    if !first.is_ascii_alphanumeric() {
        return Err(unsafe_name("it must start with an ASCII letter or digit"));
    }
    if !bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-')) {
        return Err(unsafe_name(
            "it may only contain ASCII letters, digits, '_', '.' and '-'",
        ));
    }
    Ok(())
}

/// The drop-in that chains our plugin after `primary`'s plugins without touching its
/// file (libcni >= 1.3).
///
/// Refused: a `.conf` primary (no drop-ins for those), `loadOnlyInlinedPlugins: true`,
/// an unsafe network name, an effective `cniVersion` below 0.3.0, and a primary that
/// already inlines our plugin (it would run twice).
pub fn dropin(primary: &CniConfig, ours: &OurPlugin) -> Result<DropIn, CniConfError> {
    if primary.kind() != ConfigKind::ConfList {
        return Err(CniConfError::DropInNeedsConfList);
    }
    if primary.load_only_inlined_plugins() {
        return Err(CniConfError::LoadOnlyInlinedPlugins);
    }
    let name = primary.name().unwrap_or("");
    check_network_dir_name(name)?;
    let effective = primary.effective_cni_version()?;
    if effective < CniVersion::MIN_CHAINING {
        return Err(CniConfError::VersionTooOld {
            declared: shorten(primary.cni_version().unwrap_or("")),
            effective,
        });
    }
    if count_ours(primary, ours) > 0 {
        return Err(CniConfError::AlreadyInlined);
    }
    Ok(DropIn {
        dir_name: name.to_owned(),
        file_name: DROPIN_FILE_NAME.to_owned(),
        bytes: to_pretty_bytes(&Value::Object(ours.entry().clone())),
    })
}
