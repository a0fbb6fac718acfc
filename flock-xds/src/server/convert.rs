//! Between the wire (envoy-types protos) and the protocol layer, with input limits.
//!
//! Every request is checked before the protocol machines see it: a client that sends
//! a million names, a megabyte-long name or fifty type URLs on one stream gets a clear
//! `INVALID_ARGUMENT` and the stream ends; nothing it sent is kept.

use crate::callbacks::NodeInfo;
use crate::protocol::{DeltaRequest, DeltaResponse, SotwRequest, SotwResponse};
use envoy_types::pb::envoy::config::core::v3::{ControlPlane, Node};
use envoy_types::pb::envoy::service::discovery::v3::{
    DeltaDiscoveryRequest, DeltaDiscoveryResponse, DiscoveryRequest, DiscoveryResponse, Resource,
};
use envoy_types::pb::google::protobuf::Any;
use tonic::Status;

/// Limits on what one client may send. The defaults fit a node-local Envoy with tens of
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
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_names_per_request: 200_000,
            max_name_len: 4096,
            max_types_per_stream: 32,
            max_error_detail_len: 16 * 1024,
            max_request_bytes: 16 * 1024 * 1024,
        }
    }
}

pub(crate) fn node_info(node: &Node) -> NodeInfo {
    NodeInfo {
        id: node.id.clone(),
        cluster: node.cluster.clone(),
        user_agent_name: node.user_agent_name.clone(),
    }
}

fn check_name(what: &str, name: &str, limits: &Limits) -> Result<(), Status> {
    if name.len() > limits.max_name_len {
        return Err(Status::invalid_argument(format!(
            "{what} is {} bytes long, more than the limit of {} (starts with {:?})",
            name.len(),
            limits.max_name_len,
            truncate(name, 64)
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
            "this service serves {fixed}, the request asks for {:?}",
            truncate(type_url, 256)
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
}
