//! Kubernetes labels on endpoints and the label selectors of route subsets.
//!
//! A route may send a share of a Service's traffic to a *subset* of its endpoints:
//! those whose pod carries given labels (`version: v2`), as Istio's destination
//! subsets do, for teams that run several versions behind one Service instead of one
//! Service per version. The labels travel from the pod to every node (in registry
//! entries, which are outside input to the nodes that read them) and into resource
//! names (a subset's cluster is named after its selector, [`render`]), so keys and
//! values are held to the API server's own syntax, and to a count:
//!
//! * key: an optional DNS-subdomain prefix and `/`, then a name of 1 to 63 of
//!   `A-Z a-z 0-9 - _ .`, starting and ending with a letter or digit;
//! * value: empty, or a name as above;
//! * at most [`MAX_LABELS`] labels on one endpoint, and in one selector.

use std::collections::BTreeMap;

/// Most labels one endpoint carries, and most of one subset's selector: the few a
/// subset selects on (`version`, `track`), not a pod's every label.
pub const MAX_LABELS: usize = 8;
/// Longest name part of a key, and longest value (the API server's limit).
pub const MAX_NAME_LEN: usize = 63;
/// Longest key prefix (a DNS subdomain).
pub const MAX_PREFIX_LEN: usize = 253;

/// Labels or a selector: sorted by key, so one set has one rendering.
pub type Labels = BTreeMap<String, String>;

/// No labels (a `'static` empty set to borrow).
pub static NONE: Labels = BTreeMap::new();

fn is_name(s: &str) -> bool {
    let b = s.as_bytes();
    !b.is_empty()
        && b.len() <= MAX_NAME_LEN
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// Checks a label key (see the [module docs](self)).
pub fn check_key(key: &str) -> Result<(), String> {
    let (prefix, name) = match key.split_once('/') {
        Some((p, n)) => (Some(p), n),
        None => (None, key),
    };
    if let Some(p) = prefix
        && (p.len() > MAX_PREFIX_LEN || crate::pod::check_subdomain(p).is_err())
    {
        return Err(format!(
            "label key {:?}: the prefix is not a DNS subdomain",
            crate::registry::bounded(key)
        ));
    }
    if !is_name(name) {
        return Err(format!(
            "label key {:?}: the name must be 1 to {MAX_NAME_LEN} of A-Z a-z 0-9 - _ ., \
             starting and ending with a letter or digit",
            crate::registry::bounded(key)
        ));
    }
    Ok(())
}

/// Checks a label value (see the [module docs](self)).
pub fn check_value(value: &str) -> Result<(), String> {
    if value.is_empty() || is_name(value) {
        Ok(())
    } else {
        Err(format!(
            "label value {:?} is not empty or 1 to {MAX_NAME_LEN} of A-Z a-z 0-9 - _ ., \
             starting and ending with a letter or digit",
            crate::registry::bounded(value)
        ))
    }
}

/// Checks a whole set: at most [`MAX_LABELS`], each key and value well-formed.
pub fn check(labels: &Labels) -> Result<(), String> {
    if labels.len() > MAX_LABELS {
        return Err(format!("{} labels, more than {MAX_LABELS}", labels.len()));
    }
    for (k, v) in labels {
        check_key(k)?;
        check_value(v).map_err(|e| format!("{}: {e}", crate::registry::bounded(k)))?;
    }
    Ok(())
}

/// Whether `labels` carry every label of `selector` with the same value. An empty
/// selector selects every endpoint (the whole Service).
pub fn selects(selector: &Labels, labels: &Labels) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

/// `k=v,k2=v2` in key order: the one rendering of a set (names, logs, the
/// `flock.io/labels` annotation).
pub fn render(labels: &Labels) -> String {
    let mut out = String::new();
    for (i, (k, v)) in labels.iter().enumerate() {
        if i > 0 {
            out.push(',');
        }
        out.push_str(k);
        out.push('=');
        out.push_str(v);
    }
    out
}

/// Parses [`render`]'s form (`version=v2,track=canary`; spaces around items are
/// ignored; empty: no labels), checked as [`check`] does. A key given twice is an
/// error, not the last one winning.
pub fn parse(s: &str) -> Result<Labels, String> {
    let mut out = Labels::new();
    if s.trim().is_empty() {
        return Ok(out);
    }
    for item in s.split(',') {
        let item = item.trim();
        let Some((k, v)) = item.split_once('=') else {
            return Err(format!(
                "{:?} is not key=value",
                crate::registry::bounded(item)
            ));
        };
        if out.insert(k.to_string(), v.to_string()).is_some() {
            return Err(format!(
                "label key {:?} given twice",
                crate::registry::bounded(k)
            ));
        }
        if out.len() > MAX_LABELS {
            return Err(format!("more than {MAX_LABELS} labels"));
        }
    }
    check(&out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn keys_and_values_follow_the_api_servers_syntax() {
        for ok in [
            "version",
            "app.kubernetes.io/version",
            "a",
            "A_b-c.d",
            "x/y",
        ] {
            assert!(check_key(ok).is_ok(), "{ok}");
        }
        for bad in [
            "", "-a", "a-", "a/b/c", "/a", "a b", "a=b", "a,b", "UPPER/x", "a/",
        ] {
            assert!(check_key(bad).is_err(), "{bad:?}");
        }
        assert!(check_key(&"k".repeat(64)).is_err());
        assert!(check_value("").is_ok());
        assert!(check_value("v1.2.3").is_ok());
        for bad in ["-v", "v=", "a,b", "a b", "|", "ü"] {
            assert!(check_value(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn parse_refuses_what_render_cannot_say() {
        assert_eq!(parse("").unwrap(), Labels::new());
        let l = parse(" version=v2 , track=canary").unwrap();
        assert_eq!(render(&l), "track=canary,version=v2");
        assert!(parse("version").unwrap_err().contains("key=value"));
        assert!(parse("a=1,a=2").unwrap_err().contains("twice"));
        let many: Vec<String> = (0..9).map(|i| format!("k{i}=v")).collect();
        assert!(parse(&many.join(",")).unwrap_err().contains("more than 8"));
        assert!(parse("a=b=c").is_err());
    }

    #[test]
    fn an_empty_selector_selects_everything_and_a_missing_key_nothing() {
        let l = parse("version=v2,app=web").unwrap();
        assert!(selects(&Labels::new(), &l));
        assert!(selects(&parse("version=v2").unwrap(), &l));
        assert!(!selects(&parse("version=v1").unwrap(), &l));
        assert!(!selects(&parse("track=x").unwrap(), &l));
    }

    proptest! {
        #[test]
        fn render_and_parse_round_trip(
            set in proptest::collection::btree_map(
                "[a-z]([a-z0-9._-]{0,10}[a-z0-9])?",
                "([A-Za-z0-9]([A-Za-z0-9._-]{0,10}[A-Za-z0-9])?)?",
                0..=MAX_LABELS,
            )
        ) {
            prop_assert!(check(&set).is_ok());
            prop_assert_eq!(parse(&render(&set)).unwrap(), set);
        }

        #[test]
        fn parse_never_panics_and_what_it_accepts_checks(s in ".{0,200}") {
            if let Ok(l) = parse(&s) {
                prop_assert!(check(&l).is_ok());
            }
        }
    }
}
