//! Parsing and validating `.conf` / `.conflist` files, mirroring libcni v1.3.0.

use std::fmt;

use serde_json::{Map, Value};

use super::error::CniConfError;
use super::json::{check_number_tokens, json_equal, kind_name, shorten, to_pretty_bytes};

/// The largest config file flock reads: 1 MiB. Real configs are a few KiB.
pub const MAX_CONFIG_BYTES: usize = 1 << 20;

/// How libcni-based runtimes read a file in the config directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConfigKind {
    /// `.conf` or `.json`: one plugin config object that also names the network.
    /// Runtimes up-convert it with libcni's `ConfListFromConf`.
    Conf,
    /// `.conflist`: a network config list with a `plugins` array.
    ConfList,
}

/// The kind of config a runtime reads from a file named `name`, or `None` if runtimes
/// never load it.
///
/// Mirrors containerd (go-cni) and CRI-O (ocicni): libcni's `ConfFiles(dir,
/// [".conf", ".conflist", ".json"])` matches Go's `filepath.Ext` exactly (the part
/// from the last `.`, case-sensitive), then a `.conflist` is read with
/// `ConfListFromFile` and *everything else* with `ConfFromFile`. So `.json` is
/// [`ConfigKind::Conf`] whatever it contains (a list-shaped `.json` is rejected by the
/// runtimes, see [`CniConfError::ListInConfFile`]). Names like `ZZZ-flock-kubeconfig`,
/// `10-calico.conflist.tmp` or `10-calico.CONF` never match. A path is accepted; only
/// its last component counts.
pub fn kind_for_file_name(name: &str) -> Option<ConfigKind> {
    let base = name.rsplit('/').next().unwrap_or(name);
    let ext = base.rfind('.').and_then(|i| base.get(i..))?;
    match ext {
        ".conflist" => Some(ConfigKind::ConfList),
        ".conf" | ".json" => Some(ConfigKind::Conf),
        _ => None,
    }
}

/// The name a converted `.conf`/`.json` file gets: `10-flannel.conf` →
/// `10-flannel.conflist`. `None` for names that are not single-plugin configs. A path is
/// accepted; its directory part is kept.
///
/// libcni parses a `.conf` file as one plugin, so a list written under the old name
/// would not load; the list must live in a `.conflist`. `<stem>.conflist` sorts right
/// after `<stem>.conf`, so the network keeps its priority.
pub fn conflist_file_name_for(conf_name: &str) -> Option<String> {
    if kind_for_file_name(conf_name) != Some(ConfigKind::Conf) {
        return None;
    }
    let dot = conf_name.rfind('.')?;
    let stem = conf_name.get(..dot)?;
    Some(format!("{stem}.conflist"))
}

/// A temporary file name for writing `name` atomically (write, fsync, rename) in the
/// same directory: `10-calico.conflist` → `.10-calico.conflist.flock-tmp`. Its
/// extension is `.flock-tmp`, so no runtime ([`kind_for_file_name`]) ever loads a
/// half-written temp file, and the leading dot plus fixed suffix let a restarted
/// installer find and delete stale ones.
pub fn temp_file_name_for(name: &str) -> String {
    let base = name.rsplit('/').next().unwrap_or(name);
    format!(".{base}.flock-tmp")
}

/// A CNI spec version, parsed like libcni's `version.ParseVersion`: up to three
/// dot-separated decimal parts, missing parts are 0, and the empty string is 0.1.0.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CniVersion {
    /// Major part.
    pub major: u64,
    /// Minor part.
    pub minor: u64,
    /// Patch part.
    pub patch: u64,
}

impl CniVersion {
    /// 0.3.0: the first version with `prevResult`, i.e. plugin chaining.
    pub const MIN_CHAINING: Self = Self::new(0, 3, 0);
    /// The newest version libcni v1.3.0 implements (`version.Current()`).
    pub const LIBCNI_CURRENT: Self = Self::new(1, 1, 0);

    /// A version from its parts.
    pub const fn new(major: u64, minor: u64, patch: u64) -> Self {
        Self {
            major,
            minor,
            patch,
        }
    }

    /// Parses `"1.0.0"`, `"0.4"`, `""` (= 0.1.0); `None` for anything libcni rejects.
    pub fn parse(s: &str) -> Option<Self> {
        if s.is_empty() {
            return Some(Self::new(0, 1, 0));
        }
        let mut parts = [0u64; 3];
        let mut pieces = s.split('.');
        for slot in &mut parts {
            let Some(piece) = pieces.next() else { break };
            if piece.is_empty() || !piece.bytes().all(|b| b.is_ascii_digit()) {
                return None;
            }
            *slot = piece.parse().ok()?;
        }
        if pieces.next().is_some() {
            return None;
        }
        let [major, minor, patch] = parts;
        Some(Self::new(major, minor, patch))
    }
}

impl fmt::Display for CniVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// A parsed, validated CNI config: a JSON object (key order and unknown fields kept)
/// and how runtimes read it.
///
/// Only [`parse`] and [`CniConfig::from_object`] build one, so every value satisfies
/// the rules of its [`ConfigKind`].
#[derive(Debug, Clone)]
pub struct CniConfig {
    kind: ConfigKind,
    object: Map<String, Value>,
}

impl CniConfig {
    /// Validates `object` as a config of `kind`.
    pub fn from_object(kind: ConfigKind, object: Map<String, Value>) -> Result<Self, CniConfError> {
        match kind {
            ConfigKind::Conf => validate_conf(&object)?,
            ConfigKind::ConfList => validate_conflist(&object)?,
        }
        Ok(Self { kind, object })
    }

    /// How runtimes read this config.
    pub fn kind(&self) -> ConfigKind {
        self.kind
    }

    /// The JSON object, in file order.
    pub fn as_object(&self) -> &Map<String, Value> {
        &self.object
    }

    /// The JSON object, in file order.
    pub fn into_object(self) -> Map<String, Value> {
        self.object
    }

    /// The network name.
    pub fn name(&self) -> Option<&str> {
        self.object.get("name").and_then(Value::as_str)
    }

    /// The declared `cniVersion`, if any.
    pub fn cni_version(&self) -> Option<&str> {
        self.object.get("cniVersion").and_then(Value::as_str)
    }

    /// The version libcni runs this network with: for a list with `cniVersions`, the
    /// highest of those and `cniVersion` that libcni implements (<= 1.1.0); otherwise
    /// `cniVersion`, where absent means 0.1.0.
    pub fn effective_cni_version(&self) -> Result<CniVersion, CniConfError> {
        let declared = self.cni_version().unwrap_or("");
        let invalid = || CniConfError::InvalidVersion {
            at: "\"cniVersion\"".to_owned(),
            value: shorten(declared),
        };
        let version = CniVersion::parse(declared).ok_or_else(invalid)?;
        if self.kind == ConfigKind::ConfList
            && let Some(Value::Array(listed)) = self.object.get("cniVersions")
        {
            let mut best = listed
                .iter()
                .filter_map(Value::as_str)
                .filter_map(CniVersion::parse)
                .filter(|v| *v <= CniVersion::LIBCNI_CURRENT)
                .max();
            if !declared.is_empty() && version <= CniVersion::LIBCNI_CURRENT {
                best = best.max(Some(version));
            }
            if let Some(best) = best {
                return Ok(best);
            }
        }
        Ok(version)
    }

    /// The plugin configs, in chain order: the `plugins` of a list, or the object itself
    /// for a `.conf`.
    pub fn plugins(&self) -> Vec<&Map<String, Value>> {
        match self.kind {
            ConfigKind::Conf => vec![&self.object],
            ConfigKind::ConfList => self
                .object
                .get("plugins")
                .and_then(Value::as_array)
                .map(|items| items.iter().filter_map(Value::as_object).collect())
                .unwrap_or_default(),
        }
    }

    /// The `type` of each plugin, in chain order.
    pub fn plugin_types(&self) -> Vec<Option<&str>> {
        self.plugins()
            .into_iter()
            .map(|p| p.get("type").and_then(Value::as_str))
            .collect()
    }

    /// libcni's `loadOnlyInlinedPlugins` (a boolean or `"true"`/`"false"`); false for a
    /// `.conf`.
    pub fn load_only_inlined_plugins(&self) -> bool {
        self.kind == ConfigKind::ConfList
            && matches!(read_bool(&self.object, "loadOnlyInlinedPlugins"), Ok(true))
    }

    /// The list form: a list is itself; a `.conf` becomes exactly what libcni's
    /// `ConfListFromConf` builds, `{"cniVersion", "name", "plugins": [<the object>]}`
    /// (keys in that order, as Go marshals a map; missing strings become `""`).
    pub fn to_conflist(&self) -> CniConfig {
        match self.kind {
            ConfigKind::ConfList => self.clone(),
            ConfigKind::Conf => {
                let string = |key: &str| {
                    Value::String(
                        self.object
                            .get(key)
                            .and_then(Value::as_str)
                            .unwrap_or("")
                            .to_owned(),
                    )
                };
                let mut list = Map::new();
                list.insert("cniVersion".to_owned(), string("cniVersion"));
                list.insert("name".to_owned(), string("name"));
                list.insert(
                    "plugins".to_owned(),
                    Value::Array(vec![Value::Object(self.object.clone())]),
                );
                CniConfig {
                    kind: ConfigKind::ConfList,
                    object: list,
                }
            }
        }
    }

    /// Pretty JSON (two-space indent) plus a trailing newline; deterministic and
    /// byte-identical to `serde_json::to_string_pretty` + `"\n"`.
    pub fn to_bytes(&self) -> Vec<u8> {
        to_pretty_bytes(&Value::Object(self.object.clone()))
    }

    /// Semantic equality with another config (see [`semantically_equal`](super::semantically_equal)).
    pub(crate) fn list_form_equal(&self, other: &CniConfig) -> bool {
        json_equal(
            &Value::Object(self.to_conflist().object),
            &Value::Object(other.to_conflist().object),
        )
    }
}

/// Parses and validates `bytes` as a config of `kind`.
///
/// Checks, in order: size ([`MAX_CONFIG_BYTES`]), byte-order mark, empty, JSON syntax
/// (truncated input is [`CniConfError::Truncated`]), exact numbers, top level is an
/// object, then the rules of the kind:
///
/// * `.conf`: a string `type` (non-empty) and a network `name` (string), as the spec
///   requires (libcni only checks `type`; a missing name is CNI error 7).
/// * `.conflist`: a string `name`; `cniVersion` a string if present; `cniVersions` an
///   array of valid versions; `disableCheck`, `disableGC`, `loadOnlyInlinedPlugins`
///   booleans or `"true"`/`"false"`; `plugins` a non-empty array.
/// * every plugin config: an object with a non-empty string `type`; `name` and
///   `cniVersion` strings, `capabilities` an object of booleans, `ipam`, `dns` and
///   `prevResult` objects, when present (libcni unmarshals these into typed fields).
pub fn parse(bytes: &[u8], kind: ConfigKind) -> Result<CniConfig, CniConfError> {
    CniConfig::from_object(kind, parse_object(bytes)?)
}

/// [`parse`] with the kind taken from the file name ([`kind_for_file_name`]).
pub fn parse_file(file_name: &str, bytes: &[u8]) -> Result<CniConfig, CniConfError> {
    let kind = kind_for_file_name(file_name).ok_or_else(|| CniConfError::NotAConfigFileName {
        name: shorten(file_name),
    })?;
    parse(bytes, kind)
}

/// Parses one plugin config object the way libcni's `NetworkPluginConfFromBytes` reads
/// a drop-in file: an object with a non-empty string `type`; no `name` or `cniVersion`
/// needed (libcni injects the list's).
pub fn parse_plugin_entry(bytes: &[u8]) -> Result<Map<String, Value>, CniConfError> {
    let object = parse_object(bytes)?;
    validate_plugin(&object, "the plugin config", "")?;
    Ok(object)
}

pub(crate) fn parse_object(bytes: &[u8]) -> Result<Map<String, Value>, CniConfError> {
    if bytes.len() > MAX_CONFIG_BYTES {
        return Err(CniConfError::TooLarge {
            len: bytes.len(),
            limit: MAX_CONFIG_BYTES,
        });
    }
    if bytes.starts_with(&[0xEF, 0xBB, 0xBF]) {
        return Err(CniConfError::ByteOrderMark);
    }
    if bytes
        .iter()
        .all(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
    {
        return Err(CniConfError::Empty);
    }
    let value: Value = serde_json::from_slice(bytes).map_err(|e| match e.classify() {
        serde_json::error::Category::Eof => CniConfError::Truncated {
            detail: e.to_string(),
        },
        _ => CniConfError::Syntax {
            detail: e.to_string(),
        },
    })?;
    check_number_tokens(bytes)?;
    match value {
        Value::Object(object) => Ok(object),
        other => Err(CniConfError::NotAnObject {
            at: "the top level".to_owned(),
            found: kind_name(&other),
        }),
    }
}

/// `"name"` at the top level, `plugins[2].name` inside.
fn field(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        format!("\"{key}\"")
    } else {
        format!("{prefix}.{key}")
    }
}

/// A field that, when present and not null, must be a string (Go: `string` field).
fn optional_string(
    object: &Map<String, Value>,
    prefix: &str,
    key: &str,
) -> Result<(), CniConfError> {
    match object.get(key) {
        None | Some(Value::Null | Value::String(_)) => Ok(()),
        Some(other) => Err(CniConfError::NotAString {
            at: field(prefix, key),
            found: kind_name(other),
        }),
    }
}

/// A field that, when present and not null, must be an object.
fn optional_object<'a>(
    object: &'a Map<String, Value>,
    prefix: &str,
    key: &str,
) -> Result<Option<&'a Map<String, Value>>, CniConfError> {
    match object.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(inner)) => Ok(Some(inner)),
        Some(other) => Err(CniConfError::NotAnObject {
            at: field(prefix, key),
            found: kind_name(other),
        }),
    }
}

/// Validates one plugin config object. `at` names it in messages ("plugins[1]"),
/// `prefix` prefixes its fields ("" at the top level).
pub(crate) fn validate_plugin(
    plugin: &Map<String, Value>,
    at: &str,
    prefix: &str,
) -> Result<(), CniConfError> {
    match plugin.get("type") {
        None | Some(Value::Null) => {
            return Err(CniConfError::MissingType { at: at.to_owned() });
        }
        Some(Value::String(s)) if s.is_empty() => {
            return Err(CniConfError::MissingType { at: at.to_owned() });
        }
        Some(Value::String(_)) => {}
        Some(other) => {
            return Err(CniConfError::NotAString {
                at: field(prefix, "type"),
                found: kind_name(other),
            });
        }
    }
    optional_string(plugin, prefix, "name")?;
    optional_string(plugin, prefix, "cniVersion")?;
    if let Some(caps) = optional_object(plugin, prefix, "capabilities")? {
        let caps_prefix = field(prefix, "capabilities");
        for (key, value) in caps {
            if !matches!(value, Value::Bool(_) | Value::Null) {
                return Err(CniConfError::NotABool {
                    at: format!("{caps_prefix}.{}", shorten(key)),
                    found: kind_name(value).to_owned(),
                });
            }
        }
    }
    if let Some(ipam) = optional_object(plugin, prefix, "ipam")? {
        optional_string(ipam, &field(prefix, "ipam"), "type")?;
    }
    optional_object(plugin, prefix, "dns")?;
    optional_object(plugin, prefix, "prevResult")?;
    Ok(())
}

fn validate_conf(object: &Map<String, Value>) -> Result<(), CniConfError> {
    let has_type = matches!(object.get("type"), Some(Value::String(s)) if !s.is_empty());
    if !has_type && object.contains_key("plugins") {
        return Err(CniConfError::ListInConfFile);
    }
    validate_plugin(object, "the config", "")?;
    match object.get("name") {
        None | Some(Value::Null) => Err(CniConfError::MissingName),
        Some(Value::String(_)) => Ok(()),
        Some(other) => Err(CniConfError::NotAString {
            at: "\"name\"".to_owned(),
            found: kind_name(other),
        }),
    }
}

/// libcni's `readBool`: absent is false; a boolean; or "true"/"false" in any case.
pub(crate) fn read_bool(object: &Map<String, Value>, key: &str) -> Result<bool, CniConfError> {
    match object.get(key) {
        None => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("true") => Ok(true),
        Some(Value::String(s)) if s.eq_ignore_ascii_case("false") => Ok(false),
        Some(Value::String(s)) => Err(CniConfError::NotABool {
            at: field("", key),
            found: format!("the string {:?}", shorten(s)),
        }),
        Some(other) => Err(CniConfError::NotABool {
            at: field("", key),
            found: kind_name(other).to_owned(),
        }),
    }
}

fn validate_conflist(object: &Map<String, Value>) -> Result<(), CniConfError> {
    match object.get("name") {
        None => return Err(CniConfError::MissingName),
        Some(Value::String(_)) => {}
        Some(other) => {
            return Err(CniConfError::NotAString {
                at: "\"name\"".to_owned(),
                found: kind_name(other),
            });
        }
    }
    match object.get("cniVersion") {
        None | Some(Value::String(_)) => {}
        Some(other) => {
            return Err(CniConfError::NotAString {
                at: "\"cniVersion\"".to_owned(),
                found: kind_name(other),
            });
        }
    }
    if let Some(listed) = object.get("cniVersions") {
        let Value::Array(items) = listed else {
            return Err(CniConfError::NotAnArray {
                at: "\"cniVersions\"".to_owned(),
                found: kind_name(listed),
            });
        };
        for (i, item) in items.iter().enumerate() {
            let at = format!("cniVersions[{i}]");
            let Value::String(s) = item else {
                return Err(CniConfError::NotAString {
                    at,
                    found: kind_name(item),
                });
            };
            if CniVersion::parse(s).is_none() {
                return Err(CniConfError::InvalidVersion {
                    at,
                    value: shorten(s),
                });
            }
        }
        // libcni also parses cniVersion when cniVersions is present.
        if let Some(Value::String(s)) = object.get("cniVersion")
            && CniVersion::parse(s).is_none()
        {
            return Err(CniConfError::InvalidVersion {
                at: "\"cniVersion\"".to_owned(),
                value: shorten(s),
            });
        }
    }
    for key in ["disableCheck", "disableGC", "loadOnlyInlinedPlugins"] {
        read_bool(object, key)?;
    }
    let plugins = match object.get("plugins") {
        None => return Err(CniConfError::MissingPlugins),
        Some(Value::Array(items)) => items,
        Some(other) => {
            return Err(CniConfError::NotAnArray {
                at: "\"plugins\"".to_owned(),
                found: kind_name(other),
            });
        }
    };
    if plugins.is_empty() {
        return Err(CniConfError::EmptyPlugins);
    }
    for (i, plugin) in plugins.iter().enumerate() {
        let at = format!("plugins[{i}]");
        let Value::Object(plugin) = plugin else {
            return Err(CniConfError::NotAnObject {
                at,
                found: kind_name(plugin),
            });
        };
        validate_plugin(plugin, &at, &at)?;
    }
    Ok(())
}
