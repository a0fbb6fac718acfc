//! Between the wire (envoy-types protos) and the protocol layer, with input limits.
//!
//! Every request is checked before the protocol machines see it: a client that sends
//! a million names, a megabyte-long name or fifty type URLs on one stream gets a clear
//! `INVALID_ARGUMENT` and the stream ends; nothing it sent is kept. The `Node` of a
//! stream's first request is checked the same way ([`checked_node`]): its ID, cluster
//! and user agent are kept for the life of the stream and written into logs and
//! callbacks, so an over-long one is refused, and an error message quotes at most
//! [`PREVIEW_CHARS`] characters of it, escaped.

use crate::callbacks::NodeInfo;
use crate::protocol::{DeltaRequest, DeltaResponse, SotwRequest, SotwResponse};
use envoy_types::pb::envoy::config::core::v3::{ControlPlane, Node};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use envoy_types::pb::google::protobuf::Any;
use std::time::Duration;
use tonic::Status;

#[cfg(doc)]
use super::SubscriptionBudget;

/// Most characters of a client-supplied string quoted back in an error message.
pub(crate) const PREVIEW_CHARS: usize = 64;

/// Limits on what one client may send. The defaults fit a node-local Envoy with
/// thousands of clusters and are far below what would hurt the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Most resource names (subscribe + unsubscribe + initial versions) in one request.
    pub max_names_per_request: usize,
    /// Longest resource name or type URL, in bytes.
    pub max_name_len: usize,
    /// Most distinct type URLs on one stream (each one is a protocol machine).
    pub max_types_per_stream: usize,
    /// Longest `error_detail.message` kept (longer ones are cut, not refused: a NACK
    /// must always get through).
    pub max_error_detail_len: usize,
    /// Largest encoded request accepted by the gRPC layer, in bytes.
    pub max_request_bytes: usize,
    /// Most resource names one stream may be subscribed to at once, summed over its
    /// types (SotW: the names of each type's latest request; Delta: every name
    /// subscribed and not yet unsubscribed; `*` is not a name). The per-request limit
    /// alone does not bound a stream: Delta subscriptions accumulate over requests,
    /// and every subscribed name costs the stream memory for as long as it lives. A
    /// request that would go over it ends the stream with `RESOURCE_EXHAUSTED`.
    pub max_subscribed_names_per_stream: usize,
    /// Longest `Node.id`, in bytes (`INVALID_ARGUMENT` over it).
    pub max_node_id_len: usize,
    /// Longest `Node.cluster`, in bytes (`INVALID_ARGUMENT` over it).
    pub max_node_cluster_len: usize,
    /// Longest `Node.user_agent_name`, in bytes (`INVALID_ARGUMENT` over it).
    pub max_user_agent_len: usize,
    /// How long a new stream may wait for its first request before it ends with
    /// `DEADLINE_EXCEEDED`. An idle stream holds one of the
    /// [`max_open_streams`](Self::max_open_streams) slots; without this a client could
    /// hold them all by opening streams and sending nothing.
    pub first_request_timeout: Duration,
    /// Most streams open at once on the whole server (every listener, ADS and per-type,
    /// SotW and Delta, counted from the moment the stream opens, before its first
    /// request). A stream over it ends at once with `RESOURCE_EXHAUSTED`; streams
    /// already open are unaffected.
    pub max_open_streams: usize,
    /// What a connection, a client and all clients of a pool of listeners may hold
    /// subscribed at once, in names and bytes of names (see [`SubscriptionBudget`]).
    pub subscription_budget: super::SubscriptionBudget,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_names_per_request: 200_000,
            max_name_len: 4096,
            max_types_per_stream: 32,
            max_error_detail_len: 16 * 1024,
            max_request_bytes: 16 * 1024 * 1024,
            max_subscribed_names_per_stream: 10_000,
            max_node_id_len: 256,
            max_node_cluster_len: 256,
            max_user_agent_len: 128,
            first_request_timeout: Duration::from_secs(10),
            max_open_streams: 4096,
            subscription_budget: super::SubscriptionBudget::default(),
        }
    }
}

/// The node of a request, with its fields checked against `limits`.
pub(crate) fn checked_node(node: &Node, limits: &Limits) -> Result<NodeInfo, Status> {
    check_node_field("node.id", &node.id, limits.max_node_id_len)?;
    check_node_field("node.cluster", &node.cluster, limits.max_node_cluster_len)?;
    check_node_field(
        "node.user_agent_name",
        &node.user_agent_name,
        limits.max_user_agent_len,
    )?;
    Ok(NodeInfo {
        id: node.id.clone(),
        cluster: node.cluster.clone(),
        user_agent_name: node.user_agent_name.clone(),
    })
}

fn check_node_field(field: &str, value: &str, max: usize) -> Result<(), Status> {
    if value.len() > max {
        return Err(Status::invalid_argument(format!(
            "{field} is {} bytes long, more than the limit of {max} (starts with {})",
            value.len(),
            preview(value)
        )));
    }
    Ok(())
}

/// A client-supplied string as quoted in an error message or a log line: its first
/// [`PREVIEW_CHARS`] characters, escaped (`{:?}`: quotes, newlines and control
/// characters cannot end the quote or start a new log line), with `…` after the
/// quote when cut.
pub(crate) fn preview(s: &str) -> String {
    match s.char_indices().nth(PREVIEW_CHARS) {
        None => format!("{s:?}"),
        Some((end, _)) => format!("{:?}…", &s[..end]),
    }
}

fn check_name(what: &str, name: &str, limits: &Limits) -> Result<(), Status> {
    if name.len() > limits.max_name_len {
        return Err(Status::invalid_argument(format!(
            "{what} is {} bytes long, more than the limit of {} (starts with {})",
            name.len(),
            limits.max_name_len,
            preview(name)
        )));
    }
    Ok(())
}

fn check_count(count: usize, limits: &Limits) -> Result<(), Status> {
    if count > limits.max_names_per_request {
        return Err(Status::invalid_argument(format!(
            "request names {count} resources, more than the limit of {}",
            limits.max_names_per_request
        )));
    }
    Ok(())
}

fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

fn error_message(
    status: Option<&envoy_types::pb::google::rpc::Status>,
    limits: &Limits,
) -> Option<String> {
    status.map(|s| {
        let msg = if s.message.is_empty() {
            format!("(no message, code {})", s.code)
        } else {
            s.message.clone()
        };
        truncate(&msg, limits.max_error_detail_len).to_string()
    })
}

/// Checks a SotW request and converts it. `fixed_type` is the type of a per-type
/// service, which fills in an empty `type_url` and refuses any other.
pub(crate) fn sotw_request(
    req: &DiscoveryRequest,
    fixed_type: Option<&str>,
    limits: &Limits,
) -> Result<SotwRequest, Status> {
    let type_url = resolve_type(&req.type_url, fixed_type)?;
    check_name("type_url", &type_url, limits)?;
    check_count(req.resource_names.len(), limits)?;
    for name in &req.resource_names {
        check_name("a resource name", name, limits)?;
    }
    Ok(SotwRequest {
        type_url,
        version_info: truncate(&req.version_info, limits.max_name_len).to_string(),
        resource_names: req.resource_names.clone(),
        response_nonce: truncate(&req.response_nonce, limits.max_name_len).to_string(),
        error_detail: error_message(req.error_detail.as_ref(), limits),
    })
}

/// Checks a Delta request and converts it (see [`sotw_request`] for `fixed_type`).
pub(crate) fn delta_request(
    req: &DeltaDiscoveryRequest,
    fixed_type: Option<&str>,
    limits: &Limits,
) -> Result<DeltaRequest, Status> {
    let type_url = resolve_type(&req.type_url, fixed_type)?;
    check_name("type_url", &type_url, limits)?;
    check_count(
        req.resource_names_subscribe.len()
            + req.resource_names_unsubscribe.len()
            + req.initial_resource_versions.len(),
        limits,
    )?;
    for name in req
        .resource_names_subscribe
        .iter()
        .chain(&req.resource_names_unsubscribe)
        .chain(req.initial_resource_versions.keys())
        .chain(req.initial_resource_versions.values())
    {
        check_name("a resource name or version", name, limits)?;
    }
    Ok(DeltaRequest {
        type_url,
        resource_names_subscribe: req.resource_names_subscribe.clone(),
        resource_names_unsubscribe: req.resource_names_unsubscribe.clone(),
        initial_resource_versions: req
            .initial_resource_versions
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect(),
        response_nonce: truncate(&req.response_nonce, limits.max_name_len).to_string(),
        error_detail: error_message(req.error_detail.as_ref(), limits),
    })
}

fn resolve_type(type_url: &str, fixed_type: Option<&str>) -> Result<String, Status> {
    match fixed_type {
        None if type_url.is_empty() => Err(Status::invalid_argument(
            "an aggregated (ADS) request must set type_url",
        )),
        None => Ok(type_url.to_string()),
        Some(fixed) if type_url.is_empty() || type_url == fixed => Ok(fixed.to_string()),
        Some(fixed) => Err(Status::invalid_argument(format!(
            "this service serves {fixed}, the request asks for {}",
            preview(type_url)
        ))),
    }
}

pub(crate) fn control_plane(identifier: &str) -> Option<ControlPlane> {
    (!identifier.is_empty()).then(|| ControlPlane {
        identifier: identifier.to_string(),
    })
}

pub(crate) fn sotw_response(resp: &SotwResponse<Any>, identifier: &str) -> DiscoveryResponse {
    DiscoveryResponse {
        version_info: resp.version_info.clone(),
        resources: resp
            .resources
            .iter()
            .map(|(_, any)| (**any).clone())
            .collect(),
        type_url: resp.type_url.to_string(),
        nonce: resp.nonce.clone(),
        control_plane: control_plane(identifier),
        ..DiscoveryResponse::default()
    }
}

pub(crate) fn delta_response(
    resp: &DeltaResponse<Any>,
    identifier: &str,
) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        system_version_info: resp.system_version_info.clone(),
        resources: resp
            .resources
            .iter()
            .map(|r| Resource {
                name: r.name.to_string(),
                version: r.version(),
                resource: Some((*r.value).clone()),
                ..Resource::default()
            })
            .collect(),
        type_url: resp.type_url.to_string(),
        removed_resources: resp
            .removed_resources
            .iter()
            .map(|n| n.to_string())
            .collect(),
        nonce: resp.nonce.clone(),
        control_plane: control_plane(identifier),
        ..DeltaDiscoveryResponse::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{CLUSTER, LISTENER};
    use tonic::Code;

    #[test]
    fn per_type_services_fill_in_and_enforce_their_type() {
        let limits = Limits::default();
        let req = DiscoveryRequest::default();
        assert_eq!(
            sotw_request(&req, Some(CLUSTER), &limits).unwrap().type_url,
            CLUSTER
        );
        let err = sotw_request(&req, None, &limits).unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument);
        assert!(
            err.message().contains("must set type_url"),
            "{}",
            err.message()
        );
        let wrong = DiscoveryRequest {
            type_url: LISTENER.into(),
            ..DiscoveryRequest::default()
        };
        let err = sotw_request(&wrong, Some(CLUSTER), &limits).unwrap_err();
        assert!(
            err.message().contains("this service serves"),
            "{}",
            err.message()
        );
    }

    #[test]
    fn oversized_requests_are_refused_with_the_limit_in_the_message() {
        let limits = Limits {
            max_names_per_request: 2,
            max_name_len: 64,
            ..Limits::default()
        };
        let many = DeltaDiscoveryRequest {
            type_url: CLUSTER.into(),
            resource_names_subscribe: vec!["a".into(), "b".into(), "c".into()],
            ..DeltaDiscoveryRequest::default()
        };
        let err = delta_request(&many, None, &limits).unwrap_err();
        assert!(err.message().contains("limit of 2"), "{}", err.message());
        let long = DiscoveryRequest {
            type_url: "t".into(),
            resource_names: vec!["é".repeat(40)],
            ..DiscoveryRequest::default()
        };
        let err = sotw_request(&long, None, &limits).unwrap_err();
        assert!(err.message().contains("80 bytes long"), "{}", err.message());
    }

    #[test]
    fn a_nack_keeps_its_message_cut_to_the_limit() {
        let limits = Limits {
            max_error_detail_len: 5,
            ..Limits::default()
        };
        let nack = DiscoveryRequest {
            type_url: CLUSTER.into(),
            response_nonce: "1".into(),
            error_detail: Some(envoy_types::pb::google::rpc::Status {
                code: 3,
                message: "bad cluster".into(),
                details: vec![],
            }),
            ..DiscoveryRequest::default()
        };
        let req = sotw_request(&nack, None, &limits).unwrap();
        assert_eq!(req.error_detail.as_deref(), Some("bad c"));
    }

    #[test]
    fn node_fields_over_their_limits_are_refused_naming_field_and_limit() {
        let limits = Limits::default();
        let ok = Node {
            id: "i".repeat(256),
            cluster: "c".repeat(256),
            user_agent_name: "u".repeat(128),
            ..Node::default()
        };
        let info = checked_node(&ok, &limits).unwrap();
        assert_eq!(
            (
                info.id.len(),
                info.cluster.len(),
                info.user_agent_name.len()
            ),
            (256, 256, 128)
        );
        for (field, node, len, max) in [
            (
                "node.id",
                Node {
                    id: "i".repeat(257),
                    ..ok.clone()
                },
                257,
                256,
            ),
            (
                "node.cluster",
                Node {
                    cluster: "c".repeat(1 << 20),
                    ..ok.clone()
                },
                1 << 20,
                256,
            ),
            (
                "node.user_agent_name",
                Node {
                    user_agent_name: "u".repeat(129),
                    ..ok.clone()
                },
                129,
                128,
            ),
        ] {
            let err = checked_node(&node, &limits).unwrap_err();
            assert_eq!(err.code(), Code::InvalidArgument, "{field}");
            let expected =
                format!("{field} is {len} bytes long, more than the limit of {max} (starts with");
            assert!(err.message().starts_with(&expected), "{}", err.message());
            // The value is quoted, cut to 64 characters.
            assert!(
                err.message().len() < expected.len() + 64 + 10,
                "{}",
                err.message()
            );
        }
    }

    #[test]
    fn a_quoted_client_string_is_cut_and_cannot_break_a_line() {
        assert_eq!(preview("short"), "\"short\"");
        let evil = format!("a\"b\nc\r{}", "é".repeat(100));
        let p = preview(&evil);
        assert!(!p.contains('\n') && !p.contains('\r'), "{p}");
        assert!(p.starts_with("\"a\\\"b\\nc\\r"), "{p}");
        assert!(p.ends_with("\"…"), "{p}");
        // 64 characters of the value: 6 before the é's, then 58 of them.
        assert_eq!(p.matches('é').count(), 58, "{p}");
        let exact = "x".repeat(PREVIEW_CHARS);
        assert_eq!(
            preview(&exact),
            format!("{exact:?}"),
            "not cut at the limit"
        );
    }
}
