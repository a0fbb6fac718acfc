//! Traffic-policy routes (`flock_core::route`) as an operator writes them (a file of
//! `--routes-dir`, an `HTTPRoute` object): any bytes give a checked route or a
//! refusal that names its field, never a panic; a checked route's rules pass the
//! translation model's validation once on a service with their ports, and translate
//! for Envoy and proxyless gRPC.
#![no_main]

use flock_core::route::SourcedRoute;
use flock_xds::translate::{self, EnvoyOptions, Mesh, Protocol, Service, ServicePort};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let read = SourcedRoute::read("fuzz", data);
    let route = match read.written {
        Ok(r) => r,
        Err(e) => {
            assert!(!e.field.is_empty() && !e.reason.is_empty());
            return;
        }
    };
    for (parent, _) in &route.parents {
        let rules = route.rules_for(parent);
        let mut ports: Vec<u16> = rules.iter().map(|r| r.port.unwrap_or(80)).collect();
        ports.sort_unstable();
        ports.dedup();
        let service = |name: &str| Service {
            name: name.to_string(),
            namespace: route.namespace.clone(),
            ports: ports
                .iter()
                .map(|p| ServicePort {
                    name: None,
                    port: *p,
                    protocol: Protocol::Http,
                })
                .collect(),
            endpoints: Vec::new(),
            vips: Vec::new(),
            routes: Vec::new(),
            pool: None,
        };
        let mut mesh = Mesh {
            services: vec![Service {
                routes: rules.clone(),
                ..service(parent)
            }],
            ..Mesh::default()
        };
        // Every backend that names another service exists with the parent's ports,
        // or is dropped by the resolution; either way the result validates.
        let _ = mesh.resolve_routes();
        if let Err(errors) = mesh.validate() {
            panic!("a checked route failed the model: {errors:?}");
        }
        let _ = translate::envoy_resources(&mesh, &EnvoyOptions::default());
        mesh.services[0].ports[0].protocol = Protocol::Grpc;
        let _ = translate::grpc_resources(&mesh);
    }
});
