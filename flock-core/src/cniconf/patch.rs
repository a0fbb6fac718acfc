//! Patching our plugin into a config and taking it out again.

use serde_json::{Map, Value};

use super::error::CniConfError;
use super::json::{first_inexact_number, json_equal, kind_name, shorten};
use super::parse::{CniConfig, CniVersion, ConfigKind, parse_plugin_entry, validate_plugin};

/// The plugin entry flock chains into configs, e.g.
/// `{"type": "flock-cni", "agent_socket": "/run/flock/cni.sock"}`.
///
/// Its `type` identifies "ours": any plugin config with the same `type` is one of our
/// entries (possibly stale or duplicated), whatever its other fields.
#[derive(Debug, Clone)]
pub struct OurPlugin {
    entry: Map<String, Value>,
    plugin_type: String,
}

impl OurPlugin {
    /// Checks `entry`: a JSON object with a non-empty string `type` that is a plain
    /// binary name (no `/`, `\`, NUL, not `.`/`..`), valid as a libcni plugin config, and
    /// whose numbers print and parse back exactly.
    pub fn new(entry: Value) -> Result<Self, CniConfError> {
        let invalid = |reason: String| CniConfError::InvalidOurEntry { reason };
        let Value::Object(entry) = entry else {
            return Err(invalid(format!(
                "it is {}, not a JSON object",
                kind_name(&entry)
            )));
        };
        validate_plugin(&entry, "flock's entry", "").map_err(|e| invalid(e.to_string()))?;
        let plugin_type = entry
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned();
        if plugin_type == "." || plugin_type == ".." || plugin_type.contains(['/', '\\', '\0']) {
            return Err(invalid(format!(
                "\"type\" {:?} is not a plain binary name",
                shorten(&plugin_type)
            )));
        }
        if let Some(n) = entry.values().find_map(first_inexact_number) {
            return Err(invalid(format!(
                "number {n} does not print and parse back exactly"
            )));
        }
        Ok(Self { entry, plugin_type })
    }

    /// [`OurPlugin::new`] from JSON text (e.g. an environment variable).
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, CniConfError> {
        let entry = parse_plugin_entry(bytes).map_err(|e| CniConfError::InvalidOurEntry {
            reason: e.to_string(),
        })?;
        Self::new(Value::Object(entry))
    }

    /// Our plugin `type`.
    pub fn plugin_type(&self) -> &str {
        &self.plugin_type
    }

    /// The desired entry.
    pub fn entry(&self) -> &Map<String, Value> {
        &self.entry
    }

    fn is_ours(&self, plugin: &Value) -> bool {
        plugin.get("type").and_then(Value::as_str) == Some(self.plugin_type.as_str())
    }
}

/// What to do with a single-plugin `.conf`/`.json` primary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConfPolicy {
    /// Convert it the way libcni's `ConfListFromConf` does (`{cniVersion, name,
    /// plugins: [<the object unchanged>, ours]}`) and write it as `<stem>.conflist`
    /// ([`conflist_file_name_for`](super::conflist_file_name_for)); the `.conf` is
    /// removed after the list is in place.
    ConvertToList,
    /// Leave `.conf` primaries alone and report it.
    Skip,
}

/// The result of [`patch`].
#[derive(Debug, Clone)]
pub struct Patched {
    /// The patched config; always a [`ConfigKind::ConfList`].
    pub config: CniConfig,
    /// False when the input was already patched (semantically): nothing to write.
    pub changed: bool,
    /// True when a `.conf` was converted: the bytes belong in `<stem>.conflist`.
    pub converted_from_conf: bool,
}

/// The result of [`unpatch`].
#[derive(Debug, Clone)]
pub struct Unpatched {
    /// The config without our entries (same kind as the input).
    pub config: CniConfig,
    /// False when there was nothing of ours to remove.
    pub changed: bool,
}

/// How many plugin configs of our `type` `config` holds.
pub fn count_ours(config: &CniConfig, ours: &OurPlugin) -> usize {
    config
        .plugins()
        .into_iter()
        .filter(|p| p.get("type").and_then(Value::as_str) == Some(ours.plugin_type()))
        .count()
}

/// True when `config` is a list whose chain holds exactly one entry of our type, last,
/// equal (semantically: key order and `1` vs `1.0` do not matter) to the desired entry.
pub fn is_patched(config: &CniConfig, ours: &OurPlugin) -> bool {
    if config.kind() != ConfigKind::ConfList {
        return false;
    }
    let plugins = config.plugins();
    let desired = Value::Object(ours.entry().clone());
    count_ours(config, ours) == 1
        && plugins
            .last()
            .is_some_and(|last| json_equal(&Value::Object((*last).clone()), &desired))
}

/// Chains our plugin into `config`.
///
/// The result has exactly one entry of our type, last, equal to [`OurPlugin::entry`];
/// all other plugins and top-level fields are untouched and in order (stale, duplicated
/// or misplaced entries of ours are dropped). When `config` is already patched the
/// result is the input and `changed` is false. The primary's `cniVersion` is kept as is:
/// never downgraded.
///
/// Refused: an effective `cniVersion` below 0.3.0 ([`CniConfError::VersionTooOld`]); a
/// `.conf` under [`ConfPolicy::Skip`]; a `.conf` that is our own plugin.
pub fn patch(
    config: &CniConfig,
    ours: &OurPlugin,
    conf_policy: ConfPolicy,
) -> Result<Patched, CniConfError> {
    let effective = config.effective_cni_version()?;
    if effective < CniVersion::MIN_CHAINING {
        return Err(CniConfError::VersionTooOld {
            declared: shorten(config.cni_version().unwrap_or("")),
            effective,
        });
    }
    let (list, converted_from_conf) = match config.kind() {
        ConfigKind::ConfList => (config.clone(), false),
        ConfigKind::Conf => {
            if count_ours(config, ours) > 0 {
                return Err(CniConfError::PrimaryIsOurs {
                    plugin_type: ours.plugin_type().to_owned(),
                });
            }
            match conf_policy {
                ConfPolicy::Skip => return Err(CniConfError::ConfSkipped),
                ConfPolicy::ConvertToList => (config.to_conflist(), true),
            }
        }
    };
    if !converted_from_conf && is_patched(&list, ours) {
        return Ok(Patched {
            config: list,
            changed: false,
            converted_from_conf,
        });
    }
    let mut object = list.into_object();
    let mut plugins: Vec<Value> = match object.get_mut("plugins") {
        Some(Value::Array(items)) => std::mem::take(items),
        _ => Vec::new(),
    };
    plugins.retain(|p| !ours.is_ours(p));
    plugins.push(Value::Object(ours.entry().clone()));
    object.insert("plugins".to_owned(), Value::Array(plugins));
    Ok(Patched {
        config: CniConfig::from_object(ConfigKind::ConfList, object)?,
        changed: true,
        converted_from_conf,
    })
}

/// Removes every entry of our type from `config`.
///
/// The result is semantically equal to the config before it was patched
/// ([`semantically_equal`]). A `.conf` never holds ours (unless it *is* ours, which is
/// an error) and comes back unchanged. A list that holds only our entries cannot be
/// unpatched into a valid list ([`CniConfError::OnlyOurs`]).
pub fn unpatch(config: &CniConfig, ours: &OurPlugin) -> Result<Unpatched, CniConfError> {
    if count_ours(config, ours) == 0 {
        return Ok(Unpatched {
            config: config.clone(),
            changed: false,
        });
    }
    if config.kind() == ConfigKind::Conf {
        return Err(CniConfError::PrimaryIsOurs {
            plugin_type: ours.plugin_type().to_owned(),
        });
    }
    let mut object = config.as_object().clone();
    if let Some(Value::Array(items)) = object.get_mut("plugins") {
        items.retain(|p| !ours.is_ours(p));
        if items.is_empty() {
            return Err(CniConfError::OnlyOurs);
        }
    }
    Ok(Unpatched {
        config: CniConfig::from_object(ConfigKind::ConfList, object)?,
        changed: true,
    })
}

/// Unpatches a list that [`patch`] converted from a `.conf`
/// ([`ConfPolicy::ConvertToList`]) and gives back the original single-plugin config, to
/// be written as the `.conf` again.
///
/// `Ok(None)` when the unpatched list is not a pure `ConfListFromConf` product: it must
/// have exactly one plugin, no top-level keys besides `cniVersion`, `name` and
/// `plugins`, and the same `name` and `cniVersion` as that plugin (else someone edited
/// it after the conversion and the list is what should stay).
pub fn unpatch_to_conf(
    list: &CniConfig,
    ours: &OurPlugin,
) -> Result<Option<CniConfig>, CniConfError> {
    let unpatched = unpatch(list, ours)?.config;
    if unpatched.kind() != ConfigKind::ConfList {
        return Ok(None);
    }
    let object = unpatched.as_object();
    if object
        .keys()
        .any(|k| !matches!(k.as_str(), "cniVersion" | "name" | "plugins"))
    {
        return Ok(None);
    }
    let plugins = unpatched.plugins();
    let [only] = plugins.as_slice() else {
        return Ok(None);
    };
    let Ok(conf) = CniConfig::from_object(ConfigKind::Conf, (*only).clone()) else {
        return Ok(None);
    };
    if !conf.list_form_equal(&unpatched) {
        return Ok(None);
    }
    Ok(Some(conf))
}

/// Whether two configs mean the same to libcni: compared in list form (a `.conf` is
/// equivalent to its `ConfListFromConf` list), object key order ignored, array order
/// significant, numbers by value.
pub fn semantically_equal(a: &CniConfig, b: &CniConfig) -> bool {
    a.list_form_equal(b)
}
