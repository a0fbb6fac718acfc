//! Fuzzes the agent's access log sinks: raw bytes decoded as Envoy's
//! `StreamAccessLogsMessage` (what the access log service takes from the node's
//! Envoy), under the denial log's name, the access log's and the message's own, fed to
//! the authorization-denial sink (`flock_bird::denials`) and the access log writer
//! (`flock_bird::access_log`, writing half the entries to a temporary file rotated at
//! 1 MiB and recording every one in the workload metrics). Neither
//! may panic, and every denial counted is one it was given: the counts never exceed
//! the entries fed.

#![no_main]

use envoy_types::pb::envoy::service::accesslog::v3::StreamAccessLogsMessage;
use envoy_types::pb::envoy::service::accesslog::v3::stream_access_logs_message::LogEntries;
use flock_bird::access_log::{AccessLogs, Destination, Outputs};
use flock_bird::workload_metrics::WorkloadMetrics;
use flock_bird::denials::Denials;
use flock_xds::translate::telemetry::ACCESS_LOG_NAME;
use std::sync::{Arc, OnceLock};
use flock_xds::server::accesslog::AccessLogSink;
use flock_xds::translate::authz::DENIAL_LOG_NAME;
use libfuzzer_sys::fuzz_target;
use prost::Message;

/// One writer for the whole run (it owns a thread and a file).
fn access_logs() -> &'static Arc<AccessLogs> {
    static LOGS: OnceLock<(tempfile::TempDir, Arc<AccessLogs>)> = OnceLock::new();
    &LOGS
        .get_or_init(|| {
            let dir = tempfile::tempdir().expect("a temporary directory");
            let (_, view) = tokio::sync::watch::channel(Arc::default());
            let logs = AccessLogs::start(
                Outputs {
                    lines: Some(Destination::File {
                        path: dir.path().join("access.log"),
                        max_bytes: 1 << 20,
                    }),
                    line_percent: 50,
                    metrics: Some(WorkloadMetrics::default()),
                },
                view,
            )
            .expect("the access log");
            (dir, logs)
        })
        .1
}

fuzz_target!(|data: &[u8]| {
    let Ok(message) = StreamAccessLogsMessage::decode(data) else {
        return;
    };
    let sink = Denials::new();
    let name = message
        .identifier
        .as_ref()
        .map_or(DENIAL_LOG_NAME, |id| id.log_name.as_str());
    let access = access_logs();
    let mut fed = 0u64;
    for log_name in [DENIAL_LOG_NAME, ACCESS_LOG_NAME, name] {
        match &message.log_entries {
            Some(LogEntries::HttpLogs(logs)) => {
                for e in &logs.log_entry {
                    sink.http(log_name, e);
                    access.http(log_name, e);
                    fed += 1;
                }
            }
            Some(LogEntries::TcpLogs(logs)) => {
                for e in &logs.log_entry {
                    sink.tcp(log_name, e);
                    access.tcp(log_name, e);
                    fed += 1;
                }
            }
            None => {}
        }
    }
    assert!(sink.total() <= fed, "{} denials from {fed} entries", sink.total());
});
