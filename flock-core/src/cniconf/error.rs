//! The one error type of the module: what is wrong with a config, and where.

use super::parse::CniVersion;

/// Why a CNI config cannot be parsed, patched, unpatched or turned into a drop-in.
///
/// Messages name the offending location the way an operator would look for it, e.g.
/// `plugins[2] is a string, not a JSON object` or
/// `config is 1048577 bytes; the limit is 1048576`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CniConfError {
    /// The input is larger than [`MAX_CONFIG_BYTES`](super::MAX_CONFIG_BYTES).
    #[error("config is {len} bytes; the limit is {limit}")]
    TooLarge {
        /// Size of the input.
        len: usize,
        /// The limit.
        limit: usize,
    },
    /// The file name does not end in `.conf`, `.conflist` or `.json`.
    #[error("file name {name:?} does not end in .conf, .conflist or .json; runtimes never load it")]
    NotAConfigFileName {
        /// The name (possibly shortened for display).
        name: String,
    },
    /// Zero bytes, or only JSON whitespace: typically a writer that truncated the file
    /// and has not written the content yet.
    #[error("config is empty (no bytes, or only whitespace)")]
    Empty,
    /// The input starts with a UTF-8 byte-order mark.
    #[error(
        "config starts with a UTF-8 byte-order mark (EF BB BF); libcni (Go encoding/json) \
         rejects it, so the runtime does not load this file"
    )]
    ByteOrderMark,
    /// The JSON text ends before the value is complete: a partial write.
    #[error("config is truncated: {detail}")]
    Truncated {
        /// serde_json's message, with line and column.
        detail: String,
    },
    /// The input is not JSON.
    #[error("config is not valid JSON: {detail}")]
    Syntax {
        /// serde_json's message, with line and column.
        detail: String,
    },
    /// A number that serde_json cannot keep exactly (beyond 64-bit integers, or a float
    /// that does not round-trip): rewriting the file would alter it.
    #[error(
        "number {token} at {at} cannot be kept exactly (flock keeps 64-bit integers and \
         round-tripping doubles); refusing to rewrite this config"
    )]
    InexactNumber {
        /// The number as written.
        token: String,
        /// Where it is (e.g. `byte 57`).
        at: String,
    },
    /// Something that must be a JSON object is not.
    #[error("{at} is {found}, not a JSON object")]
    NotAnObject {
        /// Where (e.g. `the top level`, `plugins[2]`).
        at: String,
        /// What was found instead (e.g. `a string`).
        found: &'static str,
    },
    /// Something that must be a JSON array is not.
    #[error("{at} is {found}, not a JSON array")]
    NotAnArray {
        /// Where.
        at: String,
        /// What was found instead.
        found: &'static str,
    },
    /// Something that must be a string is not.
    #[error("{at} is {found}, not a string")]
    NotAString {
        /// Where (e.g. `"cniVersion"`, `plugins[0].type`).
        at: String,
        /// What was found instead.
        found: &'static str,
    },
    /// Something that must be a boolean is not.
    #[error("{at} is {found}, not a boolean (or \"true\"/\"false\", as libcni accepts)")]
    NotABool {
        /// Where.
        at: String,
        /// What was found instead.
        found: String,
    },
    /// The network `name` is missing (CNI error code 7).
    #[error("missing network \"name\"")]
    MissingName,
    /// A plugin config has no `type` (or an empty one).
    #[error("{at} is missing \"type\" (a non-empty string naming the plugin binary)")]
    MissingType {
        /// Which plugin config (`the config`, `plugins[1]`).
        at: String,
    },
    /// A `.conflist` without `plugins`.
    #[error(
        "missing \"plugins\": flock only patches lists with inlined plugins (a list whose \
         plugins all come from a libcni >= 1.3 drop-in directory cannot be patched in place)"
    )]
    MissingPlugins,
    /// A `.conflist` whose `plugins` is `[]`.
    #[error("\"plugins\" is an empty array")]
    EmptyPlugins,
    /// A version string that libcni cannot parse.
    #[error("{at} is not a valid CNI version: {value:?}")]
    InvalidVersion {
        /// Where.
        at: String,
        /// The string found.
        value: String,
    },
    /// A `.conf`/`.json` file that is shaped like a list.
    #[error(
        "has \"plugins\" but no \"type\": runtimes load .conf and .json files as a single \
         plugin (libcni ConfFromFile) and reject this one; it should be named .conflist"
    )]
    ListInConfFile,
    /// The primary's effective `cniVersion` predates plugin chaining.
    #[error(
        "effective cniVersion {effective} (declared {declared:?}) is older than 0.3.0, the \
         first version that passes prevResult along a chain; refusing to chain flock after \
         it (upgrade the primary config's cniVersion)"
    )]
    VersionTooOld {
        /// The `cniVersion` string as declared (empty when absent).
        declared: String,
        /// The version libcni would use.
        effective: CniVersion,
    },
    /// A `.conf` primary under [`ConfPolicy::Skip`](super::ConfPolicy::Skip).
    #[error(
        "the primary is a single-plugin .conf/.json file and the configured policy is to \
         leave those alone (ConfPolicy::Skip)"
    )]
    ConfSkipped,
    /// A `.conf` primary whose own `type` is our plugin.
    #[error("the config's own \"type\" is {plugin_type:?}, which is flock's plugin, not a primary")]
    PrimaryIsOurs {
        /// Our plugin type.
        plugin_type: String,
    },
    /// Unpatching would leave no plugin at all.
    #[error("removing flock's entries would leave \"plugins\" empty: the list holds only flock")]
    OnlyOurs,
    /// Our plugin's desired entry is unusable.
    #[error("flock's plugin entry is invalid: {reason}")]
    InvalidOurEntry {
        /// Why.
        reason: String,
    },
    /// A drop-in was requested for a single-plugin `.conf` primary.
    #[error(
        "libcni loads <dir>/<network>/*.conf drop-ins only for .conflist files; this \
         primary is a single-plugin .conf/.json file"
    )]
    DropInNeedsConfList,
    /// A drop-in was requested but the list sets `loadOnlyInlinedPlugins`.
    #[error(
        "\"loadOnlyInlinedPlugins\" is true: libcni ignores the drop-in directory of this \
         network, so a drop-in would never run (patch the list instead)"
    )]
    LoadOnlyInlinedPlugins,
    /// The network name cannot be used as a directory name.
    #[error("network name {name:?} cannot be used as a drop-in directory name: {why}")]
    UnsafeNetworkName {
        /// The name (possibly shortened for display).
        name: String,
        /// Why not.
        why: &'static str,
    },
    /// A drop-in was requested while our plugin is still inlined in the list.
    #[error(
        "flock's plugin is already inlined in this list; a drop-in would make it run twice \
         (unpatch the list first)"
    )]
    AlreadyInlined,
}

impl CniConfError {
    /// True for errors that a partial write explains (empty file, JSON cut short): the
    /// installer should wait for the next event rather than warn loudly.
    pub fn is_incomplete(&self) -> bool {
        matches!(self, Self::Empty | Self::Truncated { .. })
    }
}
