//! What the admin endpoint and its client decide on bytes from the network (hyper
//! parses the HTTP itself): the router must refuse with a status, never panic, and
//! accept only GETs of its own paths; the client's document decoder must return an
//! error for anything that is not the document, never panic.
#![no_main]

use flock_bird::admin::api::{Pods, RegistryView, Route, Snapshot, Status};
use flock_bird::admin::{client, route};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first line is the method, the rest the path (as hyper hands them over).
    let text = String::from_utf8_lossy(data);
    let (method, path) = text.split_once('\n').unwrap_or((&text, "/"));
    match route(method, path) {
        Ok(r) => {
            assert_eq!(method, "GET");
            assert_eq!(r.path(), path);
        }
        Err(e) => {
            assert!(matches!(e.status(), 404 | 405));
            // The message is what the client sees: bounded whatever the input.
            assert!(e.to_string().len() < 200, "{e}");
        }
    }
    let _ = client::decode::<Status>(Route::Status, data);
    let _ = client::decode::<Pods>(Route::Pods, data);
    let _ = client::decode::<Snapshot>(Route::Snapshot, data);
    let _ = client::decode::<RegistryView>(Route::Registry, data);
});
