//! Fuzzes the agent's authorization-denial sink (`flock_bird::denials`): raw bytes
//! decoded as Envoy's `StreamAccessLogsMessage` (what the access log service takes
//! from the node's Envoy), under the denial log's name and another, fed to the sink.
//! It must not panic, and every denial it counts is one it was given: the counts
//! never exceed the entries fed.

#![no_main]

use envoy_types::pb::envoy::service::accesslog::v3::StreamAccessLogsMessage;
use envoy_types::pb::envoy::service::accesslog::v3::stream_access_logs_message::LogEntries;
use flock_bird::denials::Denials;
use flock_xds::server::accesslog::AccessLogSink;
use flock_xds::translate::authz::DENIAL_LOG_NAME;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fuzz_target!(|data: &[u8]| {
    let Ok(message) = StreamAccessLogsMessage::decode(data) else {
        return;
    };
    let sink = Denials::new();
    let name = message
        .identifier
        .as_ref()
        .map_or(DENIAL_LOG_NAME, |id| id.log_name.as_str());
    let mut fed = 0u64;
    for log_name in [DENIAL_LOG_NAME, name] {
        match &message.log_entries {
            Some(LogEntries::HttpLogs(logs)) => {
                for e in &logs.log_entry {
                    sink.http(log_name, e);
                    fed += 1;
                }
            }
            Some(LogEntries::TcpLogs(logs)) => {
                for e in &logs.log_entry {
                    sink.tcp(log_name, e);
                    fed += 1;
                }
            }
            None => {}
        }
    }
    assert!(sink.total() <= fed, "{} denials from {fed} entries", sink.total());
});
