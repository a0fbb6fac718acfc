//! Envoy admin answers (`/server_info` over HTTP/1.1, chunked or not) as the supervisor
//! reads them: the HTTP parser and the JSON parser must return an error, never panic.
#![no_main]

use flock_hotrestart::admin::{parse_response, parse_server_info};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(body) = parse_response(data) {
        // A body can never be longer than what was read.
        assert!(body.len() <= data.len());
        let _ = parse_server_info(&body);
    }
    let _ = parse_server_info(data);
});
