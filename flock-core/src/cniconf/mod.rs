//! CNI network-config patching: the pure decisions of flock's CNI installer.
//!
//! The installer (an I/O crate) watches the CNI config directory (usually
//! `/etc/cni/net.d`) and chains flock's plugin after the primary CNI's plugins. Every
//! decision it takes lives here, as pure functions over bytes: no I/O, no clock, no
//! randomness, no panics on input. The installer only executes what these functions
//! return.
//!
//! # Pieces
//!
//! * **Parse** ([`parse`], [`kind_for_file_name`]): a `.conflist` is a network config
//!   list (`name`, non-empty `plugins` of objects with a string `type`); a `.conf` or
//!   `.json` is a single plugin config that also names the network. Validation mirrors
//!   libcni (`libcni/conf.go`, v1.3.0) so that we never patch a file the runtime would
//!   reject, and never produce one. Unknown fields and key order are preserved.
//! * **Patch** ([`patch`]): the result holds exactly one entry of our plugin `type`, last
//!   in the chain, equal to the desired entry; everything else is untouched and in
//!   order. Already patched (a *semantic* check) means "unchanged", and
//!   `patch(patch(x)) == patch(x)` byte for byte. A `.conf` primary is converted the way
//!   libcni's `ConfListFromConf` does, or skipped, by an explicit [`ConfPolicy`].
//!   A primary whose effective `cniVersion` is below 0.3.0 (no `prevResult` chaining)
//!   is refused; the primary's `cniVersion` is never changed, so never downgraded.
//! * **Unpatch** ([`unpatch`], [`unpatch_to_conf`], [`semantically_equal`]): removes
//!   every entry of our type; the result is semantically equal to the original.
//! * **Drop-ins** ([`dropin`]): libcni >= 1.3 subdirectory mode, an alternative to
//!   patching the primary's file.
//! * **Ledger and decide** ([`Ledger`], [`decide`]): the fix for an installer's infinite
//!   patch loop. A shell installer that kept *one* hash for all files compared, with
//!   two configs, its own write to file A against the hash of its write to file B; it
//!   looked external and was "patched" again, forever. Here the
//!   ledger keeps one [`ContentHash`](crate::ContentHash) *per file*, and [`decide`]
//!   never writes a file that is already semantically patched: two independent brakes.
//! * **The installer's machine** ([`installer`]): every decision of the daemon that
//!   keeps a directory patched (per-file state, readiness, symlinks, refusal to
//!   overwrite, write budget and retry timing) as a sans-IO state machine; the daemon
//!   only performs the I/O it asks for.
//!
//! # Serialization
//!
//! Output is pretty JSON with a two-space indent and a trailing newline (byte-identical
//! to `serde_json::to_string_pretty` plus `"\n"`), produced by an infallible,
//! deterministic printer ([`CniConfig::to_bytes`]).
//!
//! # Input decisions worth knowing
//!
//! * Size: inputs over [`MAX_CONFIG_BYTES`] are rejected before parsing.
//! * A UTF-8 byte-order mark is **rejected**: Go's `encoding/json` (and so every
//!   libcni-based runtime) rejects it, so such a file is not loaded by the runtime and
//!   "fixing" it would silently change what the node runs.
//! * Numbers: serde_json (without `arbitrary_precision`) keeps 64-bit integers and
//!   doubles. A number that would not survive a parse/print round trip exactly
//!   (an integer beyond 64 bits, a float that does not round-trip) makes the file
//!   [`CniConfError::InexactNumber`]: we refuse to touch it rather than alter another
//!   plugin's settings.
//! * Duplicate object keys: the last one wins, as in Go; the rewritten file keeps one.
//! * `.json` files: containerd (go-cni) and CRI-O (ocicni) load every file that does not
//!   end in `.conflist` through libcni's `ConfFromFile`, i.e. as a *single plugin*; a
//!   list-shaped `.json` file is rejected by them ("no 'type'; perhaps this is a
//!   .conflist?"). So `.json` is [`ConfigKind::Conf`], and a list-shaped one is
//!   reported as [`CniConfError::ListInConfFile`] instead of being patched.
//!
//! # Example
//!
//! ```
//! use flock_core::cniconf::{
//!     parse, patch, semantically_equal, unpatch, ConfPolicy, ConfigKind, OurPlugin,
//! };
//!
//! let primary = br#"{"cniVersion": "1.0.0", "name": "k8s-pod-network",
//!                    "plugins": [{"type": "calico", "mtu": 1440}, {"type": "portmap"}]}"#;
//! let original = parse(primary, ConfigKind::ConfList)?;
//! let ours = OurPlugin::from_bytes(
//!     br#"{"type": "flock-cni", "agent_socket": "/run/flock/cni.sock"}"#,
//! )?;
//!
//! // Patch: our entry is appended, last in the chain.
//! let patched = patch(&original, &ours, ConfPolicy::Skip)?;
//! assert!(patched.changed);
//! let bytes = patched.config.to_bytes();
//! assert!(bytes.ends_with(b"}\n"));
//! let types: Vec<_> = patched.config.plugin_types();
//! assert_eq!(types, [Some("calico"), Some("portmap"), Some("flock-cni")]);
//!
//! // Patching the written file again changes nothing, byte for byte.
//! let reread = parse(&bytes, ConfigKind::ConfList)?;
//! let again = patch(&reread, &ours, ConfPolicy::Skip)?;
//! assert!(!again.changed);
//! assert_eq!(again.config.to_bytes(), bytes);
//!
//! // Unpatch: semantically the original again.
//! let restored = unpatch(&reread, &ours)?;
//! assert!(restored.changed);
//! assert!(semantically_equal(&restored.config, &original));
//! # Ok::<(), flock_core::cniconf::CniConfError>(())
//! ```

mod dropin;
mod error;
pub mod installer;
mod json;
mod ledger;
mod parse;
mod patch;

#[cfg(all(test, not(loom)))]
mod tests;

pub use dropin::{DROPIN_FILE_NAME, DropIn, MAX_NETWORK_NAME_LEN, check_network_dir_name, dropin};
pub use error::CniConfError;
pub use ledger::{Action, FileNameChange, InstallPolicy, Ledger, SkipReason, decide};
pub use parse::{
    CniConfig, CniVersion, ConfigKind, MAX_CONFIG_BYTES, conflist_file_name_for,
    kind_for_file_name, parse, parse_file, parse_plugin_entry, temp_file_name_for,
};
pub use patch::{
    ConfPolicy, OurPlugin, Patched, Unpatched, count_ours, is_patched, patch, semantically_equal,
    unpatch, unpatch_to_conf,
};
