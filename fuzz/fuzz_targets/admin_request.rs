//! Request heads as the agent's admin endpoint reads them from the network: the parser
//! must refuse with a status, never panic, and a path it accepts is origin-form.
#![no_main]

use flock_bird::admin::{MAX_HEAD, parse_head};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    match parse_head(data) {
        Ok(path) => {
            assert!(path.starts_with('/'), "{path:?}");
            assert!(!path.contains('?') && !path.contains(' '), "{path:?}");
            assert!(data.len() <= MAX_HEAD);
        }
        Err(e) => {
            assert!(matches!(e.status(), 400 | 405 | 431));
            // The message is what the client sees: bounded whatever the input.
            assert!(e.to_string().len() < 200, "{e}");
        }
    }
});
