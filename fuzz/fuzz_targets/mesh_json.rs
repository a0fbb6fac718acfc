//! The mesh model parser (`serve` example, control planes): any bytes → a `Mesh` or a
//! precise error, never a panic; a mesh that validates translates into Envoy and
//! proxyless-gRPC sets that pass the consistency check.
#![no_main]

use flock_xds::cache::check_consistency;
use flock_xds::translate::{self, EnvoyOptions, EnvoyReferences, Mesh};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(mesh) = Mesh::from_json(data) else { return };
    if mesh.validate().is_err() {
        // Unvalidated meshes must still translate without panicking.
        let _ = translate::envoy_resources(&mesh, &EnvoyOptions::default());
        return;
    }
    for set in [
        translate::envoy_resources(&mesh, &EnvoyOptions::default()),
        translate::grpc_resources(&mesh),
    ] {
        check_consistency(&translate::into_set(set), &EnvoyReferences)
            .expect("a valid mesh translates consistently");
    }
});
