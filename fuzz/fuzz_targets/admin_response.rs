//! Envoy admin answers (`/server_info`'s JSON) as the supervisor reads them: the
//! parser must return an error, never panic. (HTTP itself is hyper's.)
#![no_main]

use flock_hotrestart::admin::parse_server_info;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse_server_info(data);
});
