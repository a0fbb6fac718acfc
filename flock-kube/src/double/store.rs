//! The double's object store: objects as JSON, one global resourceVersion counter (as
//! etcd's revision), an event log for resuming watches, compaction, and the open
//! watches each event is fanned out to.

use std::collections::BTreeMap;

use hyper::body::Bytes;
use serde_json::{Value, json};
use tokio::sync::mpsc;

/// The resources the double serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) enum Kind {
    Pods,
    Services,
    EndpointSlices,
    Namespaces,
    Nodes,
    /// flock's own `AuthorizationPolicy` (`flock.io/v1alpha1`), as if its CRD were
    /// installed.
    AuthorizationPolicies,
    /// core/v1 Events (written by the agent, read by tests).
    Events,
    /// Gateway API `HTTPRoute` (`gateway.networking.k8s.io/v1`), as if the upstream
    /// CRDs were installed (stored as given: the double does not run their schema).
    HttpRoutes,
}

impl Kind {
    pub(crate) const ALL: [Kind; 8] = [
        Kind::Pods,
        Kind::Services,
        Kind::EndpointSlices,
        Kind::Namespaces,
        Kind::Nodes,
        Kind::AuthorizationPolicies,
        Kind::Events,
        Kind::HttpRoutes,
    ];

    pub(crate) fn group(self) -> &'static str {
        match self {
            Kind::EndpointSlices => "discovery.k8s.io",
            Kind::AuthorizationPolicies => "flock.io",
            Kind::HttpRoutes => "gateway.networking.k8s.io",
            _ => "",
        }
    }

    /// The version the double serves the group at (one per group).
    pub(crate) fn version(self) -> &'static str {
        match self {
            Kind::AuthorizationPolicies => "v1alpha1",
            _ => "v1",
        }
    }

    pub(crate) fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlices => "discovery.k8s.io/v1",
            Kind::AuthorizationPolicies => "flock.io/v1alpha1",
            Kind::HttpRoutes => "gateway.networking.k8s.io/v1",
            _ => "v1",
        }
    }

    pub(crate) fn kind(self) -> &'static str {
        match self {
            Kind::Pods => "Pod",
            Kind::Services => "Service",
            Kind::EndpointSlices => "EndpointSlice",
            Kind::Namespaces => "Namespace",
            Kind::Nodes => "Node",
            Kind::AuthorizationPolicies => "AuthorizationPolicy",
            Kind::Events => "Event",
            Kind::HttpRoutes => "HTTPRoute",
        }
    }

    pub(crate) fn plural(self) -> &'static str {
        match self {
            Kind::Pods => "pods",
            Kind::Services => "services",
            Kind::EndpointSlices => "endpointslices",
            Kind::Namespaces => "namespaces",
            Kind::Nodes => "nodes",
            Kind::AuthorizationPolicies => "authorizationpolicies",
            Kind::Events => "events",
            Kind::HttpRoutes => "httproutes",
        }
    }

    /// Whether the kind has a `status` subresource: writes of the object keep the
    /// stored status, and only `…/status` writes change it (and nothing else).
    pub(crate) fn has_status_subresource(self) -> bool {
        self == Kind::HttpRoutes
    }

    pub(crate) fn namespaced(self) -> bool {
        matches!(
            self,
            Kind::Pods
                | Kind::Services
                | Kind::EndpointSlices
                | Kind::AuthorizationPolicies
                | Kind::Events
                | Kind::HttpRoutes
        )
    }

    pub(crate) fn from_group_plural(group: &str, plural: &str) -> Option<Kind> {
        Kind::ALL
            .into_iter()
            .find(|k| k.group() == group && k.plural() == plural)
    }

    /// The kind a request path's group, version and plural name (`None`: a path the
    /// real server would answer 404 for).
    pub(crate) fn from_path(group: &str, version: &str, plural: &str) -> Option<Kind> {
        Kind::from_group_plural(group, plural).filter(|k| k.version() == version)
    }

    /// Field selectors the real API server accepts for this resource, among those the
    /// double evaluates (every resource takes `metadata.name` and `metadata.namespace`).
    fn field_supported(self, field: &str) -> bool {
        matches!(field, "metadata.name" | "metadata.namespace")
            || (self == Kind::Pods && field == "spec.nodeName")
    }
}

/// One requirement of a label or field selector.
#[derive(Clone, Debug)]
enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
}

/// A parsed `labelSelector` or `fieldSelector`: comma-joined requirements, all of
/// which must hold.
#[derive(Clone, Debug, Default)]
pub(crate) struct Selector {
    requirements: Vec<Requirement>,
    fields: bool,
}

impl Selector {
    /// Parses an equality-based label selector: `k=v`, `k==v`, `k!=v`, `k`, `!k`.
    /// Set-based forms (`in`, `notin`) are refused with a message, not misread.
    pub(crate) fn labels(text: &str) -> Result<Selector, String> {
        Self::parse(text, false, |_| true)
    }

    /// Parses a field selector (`field=v`, `field==v`, `field!=v`) over the fields
    /// the real API server supports for `kind` (among those the double evaluates).
    pub(crate) fn fields(text: &str, kind: Kind) -> Result<Selector, String> {
        Self::parse(text, true, |f| kind.field_supported(f))
            .map_err(|e| format!("{e} (resource {})", kind.plural()))
    }

    fn parse(
        text: &str,
        fields: bool,
        supported: impl Fn(&str) -> bool,
    ) -> Result<Selector, String> {
        let mut requirements = Vec::new();
        for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let req = if let Some((k, v)) = part.split_once("!=") {
                Requirement::NotEquals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once("==") {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if let Some((k, v)) = part.split_once('=') {
                Requirement::Equals(k.trim().into(), v.trim().into())
            } else if fields {
                return Err(format!("invalid field selector requirement {part:?}"));
            } else if part.contains(' ') || part.contains('(') {
                return Err(format!(
                    "set-based label selector {part:?} is not supported by the API-server double"
                ));
            } else if let Some(k) = part.strip_prefix('!') {
                Requirement::NotExists(k.trim().into())
            } else {
                Requirement::Exists(part.into())
            };
            let key = match &req {
                Requirement::Equals(k, _)
                | Requirement::NotEquals(k, _)
                | Requirement::Exists(k)
                | Requirement::NotExists(k) => k,
            };
            if key.is_empty() {
                return Err(format!("empty key in selector requirement {part:?}"));
            }
            if fields && !supported(key) {
                return Err(format!("field label not supported: {key}"));
            }
            requirements.push(req);
        }
        Ok(Selector {
            requirements,
            fields,
        })
    }

    fn value_of(&self, obj: &Value, key: &str) -> Option<String> {
        if self.fields {
            let mut at = obj;
            for seg in key.split('.') {
                at = at.get(seg)?;
            }
            at.as_str().map(str::to_string)
        } else {
            obj.pointer("/metadata/labels")
                .and_then(|l| l.get(key))
                .and_then(Value::as_str)
                .map(str::to_string)
        }
    }

    pub(crate) fn matches(&self, obj: &Value) -> bool {
        self.requirements.iter().all(|req| match req {
            // A field the object lacks reads as "" (an unscheduled pod matches
            // `spec.nodeName=`), as in the real API server; a missing label equals
            // nothing.
            Requirement::Equals(k, v) => match self.value_of(obj, k) {
                Some(x) => x == *v,
                None => self.fields && v.is_empty(),
            },
            Requirement::NotEquals(k, v) => match self.value_of(obj, k) {
                Some(x) => x != *v,
                None => !(self.fields && v.is_empty()),
            },
            Requirement::Exists(k) => self.value_of(obj, k).is_some(),
            Requirement::NotExists(k) => self.value_of(obj, k).is_none(),
        })
    }
}

/// What an open watch stream receives.
#[derive(Debug)]
pub(crate) enum WatchMsg {
    /// One JSON line (a watch event).
    Line(Bytes),
    /// Cut the connection (a dropped watch, or the API going away).
    Drop,
}

/// An open watch.
pub(crate) struct Subscription {
    pub(crate) kind: Kind,
    pub(crate) namespace: Option<String>,
    pub(crate) labels: Selector,
    pub(crate) fields: Selector,
    pub(crate) bookmarks: bool,
    pub(crate) tx: mpsc::UnboundedSender<WatchMsg>,
}

impl Subscription {
    fn matches(&self, obj: &Value) -> bool {
        let ns_ok = match &self.namespace {
            Some(ns) => obj.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns),
            None => true,
        };
        ns_ok && self.labels.matches(obj) && self.fields.matches(obj)
    }

    /// The event this watch sees for a change, as the real API server filters: an
    /// object that starts matching the selectors is ADDED to this watch, one that
    /// stops matching is DELETED from it.
    fn event_for(&self, ty: &str, old: Option<&Value>, new: &Value) -> Option<&'static str> {
        let now = self.matches(new);
        let before = old.is_some_and(|o| self.matches(o));
        match (ty, before, now) {
            ("ADDED", _, true) => Some("ADDED"),
            ("DELETED", _, true) => Some("DELETED"),
            ("MODIFIED", true, true) => Some("MODIFIED"),
            ("MODIFIED", false, true) => Some("ADDED"),
            ("MODIFIED", true, false) => Some("DELETED"),
            _ => None,
        }
    }
}

pub(crate) fn event_line(ty: &str, obj: &Value) -> Bytes {
    let mut line = serde_json::to_vec(&json!({ "type": ty, "object": obj })).unwrap_or_default();
    line.push(b'\n');
    Bytes::from(line)
}

/// A logged change, replayed to a watch that resumes from an older resourceVersion.
struct Logged {
    rv: u64,
    kind: Kind,
    ty: &'static str,
    old: Option<Value>,
    new: Value,
}

/// Why a write was refused.
#[derive(Debug)]
pub(crate) enum WriteError {
    NotFound,
    AlreadyExists,
    Conflict(String),
    Invalid(String),
}

#[derive(Default)]
pub(crate) struct Store {
    rv: u64,
    compacted: u64,
    next_uid: u64,
    objects: BTreeMap<(Kind, String, String), Value>,
    log: Vec<Logged>,
    subs: Vec<Subscription>,
}

pub(crate) fn name_of(obj: &Value) -> Option<&str> {
    obj.pointer("/metadata/name").and_then(Value::as_str)
}

fn ns_of(obj: &Value) -> &str {
    obj.pointer("/metadata/namespace")
        .and_then(Value::as_str)
        .unwrap_or_default()
}

pub(crate) fn rv_of(obj: &Value) -> Option<&str> {
    obj.pointer("/metadata/resourceVersion")
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
}

fn set_meta(obj: &mut Value, key: &str, value: Value) {
    if !obj.get("metadata").is_some_and(Value::is_object) {
        obj["metadata"] = json!({});
    }
    obj["metadata"][key] = value;
}

impl Store {
    pub(crate) fn resource_version(&self) -> u64 {
        self.rv
    }

    pub(crate) fn get(&self, kind: Kind, ns: &str, name: &str) -> Option<&Value> {
        self.objects.get(&(kind, ns.to_string(), name.to_string()))
    }

    /// Every stored object of `kind` (in `ns` when given), in key order, after `after`.
    pub(crate) fn list(
        &self,
        kind: Kind,
        ns: Option<&str>,
        after: Option<&(String, String)>,
    ) -> impl Iterator<Item = (&(Kind, String, String), &Value)> {
        self.objects
            .range((kind, String::new(), String::new())..)
            .take_while(move |((k, _, _), _)| *k == kind)
            .filter(move |((_, o_ns, o_name), _)| {
                ns.is_none_or(|n| n == o_ns)
                    && after.is_none_or(|(a_ns, a_name)| (o_ns, o_name) > (a_ns, a_name))
            })
    }

    /// Normalises an incoming object: apiVersion/kind, the namespace of namespaced
    /// kinds (default `default`), none on cluster-scoped ones.
    fn normalise(kind: Kind, mut obj: Value) -> Result<(Value, String, String), WriteError> {
        if !obj.is_object() {
            return Err(WriteError::Invalid("object is not a JSON object".into()));
        }
        obj["apiVersion"] = json!(kind.api_version());
        obj["kind"] = json!(kind.kind());
        let name = name_of(&obj)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| WriteError::Invalid("metadata.name is required".into()))?
            .to_string();
        let ns = if kind.namespaced() {
            let ns = match ns_of(&obj) {
                "" => "default".to_string(),
                ns => ns.to_string(),
            };
            set_meta(&mut obj, "namespace", json!(ns));
            ns
        } else {
            if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
                m.remove("namespace");
            }
            String::new()
        };
        Ok((obj, ns, name))
    }

    /// Creates or replaces an object. `check_rv`: refuse (409) when the object carries
    /// a resourceVersion that is not the stored one (the optimistic-concurrency rule
    /// of update); `must_exist`/`must_not_exist` give update and create semantics.
    pub(crate) fn put(
        &mut self,
        kind: Kind,
        obj: Value,
        check_rv: bool,
        must_exist: bool,
        must_not_exist: bool,
    ) -> Result<Value, WriteError> {
        self.write(kind, obj, check_rv, must_exist, must_not_exist, false)
    }

    /// A write of the `status` subresource: `obj`'s status replaces the stored
    /// object's, nothing else of `obj` is kept (its resourceVersion is still a
    /// precondition when `check_rv`).
    pub(crate) fn put_status(
        &mut self,
        kind: Kind,
        obj: Value,
        check_rv: bool,
    ) -> Result<Value, WriteError> {
        self.write(kind, obj, check_rv, true, false, true)
    }

    fn write(
        &mut self,
        kind: Kind,
        obj: Value,
        check_rv: bool,
        must_exist: bool,
        must_not_exist: bool,
        status_write: bool,
    ) -> Result<Value, WriteError> {
        let (mut obj, ns, name) = Self::normalise(kind, obj)?;
        let key = (kind, ns, name);
        let old = self.objects.get(&key).cloned();
        match (&old, must_exist, must_not_exist) {
            (None, true, _) => return Err(WriteError::NotFound),
            (Some(_), _, true) => return Err(WriteError::AlreadyExists),
            _ => {}
        }
        if check_rv
            && let (Some(old), Some(want)) = (&old, rv_of(&obj))
            && rv_of(old) != Some(want)
        {
            return Err(WriteError::Conflict(format!(
                "Operation cannot be fulfilled on {} \"{}\": the object has been modified; \
                 please apply your changes to the latest version and try again",
                kind.plural(),
                key.2
            )));
        }
        if kind.has_status_subresource() {
            let status = if status_write {
                obj.get("status").cloned()
            } else {
                old.as_ref().and_then(|o| o.get("status").cloned())
            };
            if let (true, Some(old)) = (status_write, &old) {
                obj = old.clone();
            }
            match (status, obj.as_object_mut()) {
                (Some(st), Some(o)) => {
                    o.insert("status".into(), st);
                }
                (None, Some(o)) => {
                    o.remove("status");
                }
                _ => {}
            }
        }
        // `metadata.generation`, as the API server keeps it for objects with a spec:
        // 1 when created, one more at each change of the spec, else unchanged.
        if obj.get("spec").is_some() {
            let old_generation = old
                .as_ref()
                .and_then(|o| o.pointer("/metadata/generation"))
                .and_then(Value::as_i64);
            let generation = match (&old, old_generation) {
                (Some(o), Some(g)) if o.get("spec") == obj.get("spec") => g,
                (Some(_), Some(g)) => g + 1,
                _ => 1,
            };
            set_meta(&mut obj, "generation", json!(generation));
        }
        let uid = old
            .as_ref()
            .and_then(|o| o.pointer("/metadata/uid").cloned())
            .or_else(|| {
                obj.pointer("/metadata/uid")
                    .cloned()
                    .filter(|u| u.as_str().is_some_and(|s| !s.is_empty()))
            })
            .unwrap_or_else(|| {
                self.next_uid += 1;
                json!(format!("00000000-0000-4000-8000-{:012x}", self.next_uid))
            });
        set_meta(&mut obj, "uid", uid);
        self.rv += 1;
        set_meta(&mut obj, "resourceVersion", json!(self.rv.to_string()));
        self.objects.insert(key, obj.clone());
        let ty = if old.is_some() { "MODIFIED" } else { "ADDED" };
        self.emit(kind, ty, old, obj.clone());
        Ok(obj)
    }

    /// Deletes an object; the DELETED event carries its last state at a new
    /// resourceVersion, as the real API server's does.
    pub(crate) fn remove(&mut self, kind: Kind, ns: &str, name: &str) -> Option<Value> {
        let mut obj = self
            .objects
            .remove(&(kind, ns.to_string(), name.to_string()))?;
        self.rv += 1;
        set_meta(&mut obj, "resourceVersion", json!(self.rv.to_string()));
        self.emit(kind, "DELETED", None, obj.clone());
        Some(obj)
    }

    fn emit(&mut self, kind: Kind, ty: &'static str, old: Option<Value>, new: Value) {
        self.subs.retain(|sub| {
            if sub.kind != kind {
                return !sub.tx.is_closed();
            }
            match sub.event_for(ty, old.as_ref(), &new) {
                Some(t) => sub.tx.send(WatchMsg::Line(event_line(t, &new))).is_ok(),
                None => !sub.tx.is_closed(),
            }
        });
        self.log.push(Logged {
            rv: self.rv,
            kind,
            ty,
            old,
            new,
        });
    }

    /// Opens a watch from `from` (None: from now, sending the current objects as
    /// ADDED first, as `resourceVersion=0` or unset does). Refuses with the
    /// compaction point when `from` is older than it: the caller answers 410 Gone.
    pub(crate) fn subscribe(&mut self, sub: Subscription, from: Option<u64>) -> Result<(), u64> {
        match from {
            Some(rv) if rv < self.compacted => return Err(self.compacted),
            Some(rv) => {
                for ev in self.log.iter().filter(|e| e.kind == sub.kind && e.rv > rv) {
                    if let Some(t) = sub.event_for(ev.ty, ev.old.as_ref(), &ev.new) {
                        let _ = sub.tx.send(WatchMsg::Line(event_line(t, &ev.new)));
                    }
                }
            }
            None => {
                for (_, obj) in self.list(sub.kind, sub.namespace.as_deref(), None) {
                    if sub.matches(obj) {
                        let _ = sub.tx.send(WatchMsg::Line(event_line("ADDED", obj)));
                    }
                }
            }
        }
        self.subs.push(sub);
        Ok(())
    }

    /// Sends a BOOKMARK at the current resourceVersion to every watch that asked for
    /// bookmarks; under the store lock, so it is ordered after every event before it.
    pub(crate) fn bookmark_all(&mut self) {
        let rv = self.rv.to_string();
        self.subs.retain(|sub| {
            if !sub.bookmarks {
                return !sub.tx.is_closed();
            }
            let obj = json!({
                "kind": sub.kind.kind(), "apiVersion": sub.kind.api_version(),
                "metadata": { "resourceVersion": rv }
            });
            sub.tx
                .send(WatchMsg::Line(event_line("BOOKMARK", &obj)))
                .is_ok()
        });
    }

    /// Forgets the event log: a watch or continue token older than now answers 410.
    pub(crate) fn compact(&mut self) {
        self.compacted = self.rv;
        self.log.clear();
    }

    pub(crate) fn compacted(&self) -> u64 {
        self.compacted
    }

    /// Cuts every open watch.
    pub(crate) fn drop_watches(&mut self) {
        for sub in self.subs.drain(..) {
            let _ = sub.tx.send(WatchMsg::Drop);
        }
    }

    /// How many watches are open (streams whose client is gone are not counted).
    pub(crate) fn open_watches(&self) -> usize {
        self.subs.iter().filter(|s| !s.tx.is_closed()).count()
    }
}

/// RFC 7386 JSON merge patch: objects merge key by key, `null` deletes, anything else
/// (arrays included) replaces.
pub(crate) fn merge_patch(target: &mut Value, patch: &Value) {
    match patch {
        Value::Object(p) => {
            if !target.is_object() {
                *target = json!({});
            }
            let t = target.as_object_mut().expect("made an object above");
            for (k, v) in p {
                if v.is_null() {
                    t.remove(k);
                } else {
                    merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
                }
            }
        }
        other => *target = other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(labels: Value, node: Option<&str>) -> Value {
        let mut p = json!({ "metadata": { "namespace": "default", "name": "p", "labels": labels },
            "spec": {} });
        if let Some(n) = node {
            p["spec"]["nodeName"] = json!(n);
        }
        p
    }

    #[test]
    fn label_selectors() {
        let p = pod(json!({ "app": "web", "tier": "" }), None);
        let m = |sel: &str| Selector::labels(sel).unwrap().matches(&p);
        assert!(m(""));
        assert!(m("app=web") && m("app==web") && m("app = web"));
        assert!(!m("app=api"));
        assert!(m("app!=api") && !m("app!=web"));
        assert!(m("missing!=x"), "an absent label is not equal to anything");
        assert!(
            !m("missing="),
            "an absent label equals nothing, not the empty value"
        );
        assert!(m("tier="));
        assert!(m("app,tier") && !m("missing") && m("!missing") && !m("!app"));
        assert!(m("app=web,tier") && !m("app=web,missing"));
        assert!(Selector::labels("app in (web,api)").is_err());
        assert!(Selector::labels("=web").is_err());
    }

    #[test]
    fn field_selectors() {
        let on_a = pod(json!({}), Some("node-a"));
        let unscheduled = pod(json!({}), None);
        let sel = |s: &str| Selector::fields(s, Kind::Pods).unwrap();
        assert!(sel("spec.nodeName=node-a").matches(&on_a));
        assert!(!sel("spec.nodeName=node-b").matches(&on_a));
        assert!(sel("spec.nodeName!=node-b").matches(&on_a));
        assert!(
            sel("spec.nodeName=").matches(&unscheduled),
            "a missing field reads as empty"
        );
        assert!(!sel("spec.nodeName!=").matches(&unscheduled));
        assert!(sel("metadata.name=p,metadata.namespace=default").matches(&on_a));
        let err = Selector::fields("spec.nodeName=x", Kind::Services).unwrap_err();
        assert!(
            err.contains("field label not supported: spec.nodeName"),
            "{err}"
        );
        assert!(Selector::fields("status.phase=Running", Kind::Pods).is_err());
        assert!(Selector::fields("metadata.name", Kind::Nodes).is_err());
    }

    #[test]
    fn merge_patch_follows_rfc7386() {
        let mut doc = json!({ "a": "b", "c": { "d": "e", "f": "g" }, "l": [1, 2] });
        merge_patch(
            &mut doc,
            &json!({ "a": "z", "c": { "f": null }, "l": [3], "n": { "x": 1 } }),
        );
        assert_eq!(
            doc,
            json!({ "a": "z", "c": { "d": "e" }, "l": [3], "n": { "x": 1 } })
        );
        merge_patch(&mut doc, &json!("scalar"));
        assert_eq!(doc, json!("scalar"));
    }

    fn lines(rx: &mut mpsc::UnboundedReceiver<WatchMsg>) -> Vec<(String, String)> {
        let mut out = Vec::new();
        while let Ok(WatchMsg::Line(l)) = rx.try_recv() {
            let v: Value = serde_json::from_slice(&l).unwrap();
            let name = name_of(&v["object"]).unwrap_or_default().to_string();
            out.push((v["type"].as_str().unwrap().to_string(), name));
        }
        out
    }

    #[test]
    fn watch_filters_and_replays_like_the_api_server() {
        let mut store = Store::default();
        let (tx, mut rx) = mpsc::unbounded_channel();
        let sub = Subscription {
            kind: Kind::Pods,
            namespace: None,
            labels: Selector::labels("app=web").unwrap(),
            fields: Selector::default(),
            bookmarks: false,
            tx,
        };
        store.subscribe(sub, Some(0)).unwrap();
        let mut p = pod(json!({ "app": "web" }), None);
        store
            .put(Kind::Pods, p.clone(), false, false, false)
            .unwrap();
        p["metadata"]["labels"] = json!({ "app": "api" });
        store
            .put(Kind::Pods, p.clone(), false, false, false)
            .unwrap();
        p["metadata"]["labels"] = json!({ "app": "web" });
        store
            .put(Kind::Pods, p.clone(), false, false, false)
            .unwrap();
        store
            .put(Kind::Pods, p.clone(), false, false, false)
            .unwrap();
        store.remove(Kind::Pods, "default", "p");
        let seen = lines(&mut rx);
        let types: Vec<&str> = seen.iter().map(|(t, _)| t.as_str()).collect();
        assert_eq!(types, ["ADDED", "DELETED", "ADDED", "MODIFIED", "DELETED"]);

        // A watch from resourceVersion 2 replays what came after it; after compaction
        // it is refused (410).
        let (tx, mut rx) = mpsc::unbounded_channel();
        let sub = |tx| Subscription {
            kind: Kind::Pods,
            namespace: Some("default".into()),
            labels: Selector::default(),
            fields: Selector::default(),
            bookmarks: true,
            tx,
        };
        store.subscribe(sub(tx), Some(2)).unwrap();
        let types: Vec<String> = lines(&mut rx).into_iter().map(|(t, _)| t).collect();
        assert_eq!(types, ["MODIFIED", "MODIFIED", "DELETED"]);
        store.compact();
        let (tx, _rx) = mpsc::unbounded_channel();
        assert_eq!(store.subscribe(sub(tx), Some(2)), Err(5));
    }

    #[test]
    fn stale_resource_version_conflicts() {
        let mut store = Store::default();
        let p = store
            .put(Kind::Pods, pod(json!({}), None), true, false, false)
            .unwrap();
        assert_eq!(rv_of(&p), Some("1"));
        let mut stale = p.clone();
        stale["metadata"]["resourceVersion"] = json!("0");
        assert!(matches!(
            store.put(Kind::Pods, stale, true, true, false),
            Err(WriteError::Conflict(_))
        ));
        let updated = store.put(Kind::Pods, p.clone(), true, true, false).unwrap();
        assert_eq!(rv_of(&updated), Some("2"));
        assert_eq!(updated["metadata"]["uid"], p["metadata"]["uid"], "uid kept");
        assert!(matches!(
            store.put(Kind::Pods, p, false, false, true),
            Err(WriteError::AlreadyExists)
        ));
    }
}
