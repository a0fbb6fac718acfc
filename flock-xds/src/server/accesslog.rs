//! Envoy's gRPC access log service (`envoy.service.accesslog.v3`) on the xDS server's
//! listeners: the node's Envoy streams the entries its `http_grpc` and `tcp_grpc`
//! access loggers buffer, and an [`AccessLogSink`] gets each with its log name.
//!
//! Served only with a sink ([`ServerBuilder::access_log_sink`](super::ServerBuilder)),
//! and only to a peer the authorizer trusts with secrets (the node's Envoy): an entry
//! says who was denied what, and a sink counts and logs it, so no other client may
//! feed it. The stream's first message names the log (`identifier.log_name`); the
//! later ones of the stream may leave it out and keep it. Every message is bounded by
//! the server's request size limit.

use super::Server;
use envoy_types::pb::envoy::data::accesslog::v3::{HttpAccessLogEntry, TcpAccessLogEntry};
use envoy_types::pb::envoy::service::accesslog::v3::{
    StreamAccessLogsMessage, StreamAccessLogsResponse, access_log_service_server::AccessLogService,
    stream_access_logs_message::LogEntries,
};
use tonic::{Request, Response, Status, Streaming};

/// Where the access log entries Envoy streams go. Called on the stream's task, once
/// per entry: keep it short (count, remember, log).
pub trait AccessLogSink: Send + Sync + 'static {
    /// One HTTP request's entry, of the access log named `log_name`.
    fn http(&self, log_name: &str, entry: &HttpAccessLogEntry);
    /// One TCP connection's entry, of the access log named `log_name`.
    fn tcp(&self, log_name: &str, entry: &TcpAccessLogEntry);
}

/// The log name a stream's later messages keep: at most this long, or refused.
const MAX_LOG_NAME: usize = 1024;

#[tonic::async_trait]
impl AccessLogService for Server {
    async fn stream_access_logs(
        &self,
        request: Request<Streaming<StreamAccessLogsMessage>>,
    ) -> Result<Response<StreamAccessLogsResponse>, Status> {
        let principal = self.authorize(&request)?;
        if !principal.secrets {
            return Err(Status::permission_denied(format!(
                "{} may not stream access logs (only the node's Envoy may)",
                principal.name
            )));
        }
        let Some(sink) = self.inner.access_log_sink.clone() else {
            return Err(Status::unimplemented("this server takes no access logs"));
        };
        let _active = super::conn::state_of(&request).map(|c| c.stream());
        let mut stream = request.into_inner();
        let mut log_name = String::new();
        let mut shutdown = self.inner.shutdown.subscribe();
        loop {
            let message = tokio::select! {
                m = stream.message() => m?,
                _ = shutdown.wait_for(|stop| *stop) => None,
            };
            let Some(message) = message else { break };
            if let Some(id) = message.identifier {
                if id.log_name.len() > MAX_LOG_NAME {
                    return Err(Status::invalid_argument(format!(
                        "access log name of {} bytes (at most {MAX_LOG_NAME})",
                        id.log_name.len()
                    )));
                }
                log_name = id.log_name;
            }
            match message.log_entries {
                Some(LogEntries::HttpLogs(logs)) => {
                    for entry in &logs.log_entry {
                        sink.http(&log_name, entry);
                    }
                }
                Some(LogEntries::TcpLogs(logs)) => {
                    for entry in &logs.log_entry {
                        sink.tcp(&log_name, entry);
                    }
                }
                None => {}
            }
        }
        Ok(Response::new(StreamAccessLogsResponse {}))
    }
}
