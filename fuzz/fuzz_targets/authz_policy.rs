//! Authorization policies (`flock_core::authz`) as an operator, a registry entry or a
//! pod's annotation can write them: any bytes give a checked policy or a refusal that
//! names its field, never a panic; a refused policy denies every request, and a pod's
//! annotation never makes a request allowed that the service's policy denies.
#![no_main]

use flock_core::authz::{
    HttpRequest, Policy, Request, Sourced, Target, annotation_policy, check_annotation_size,
    effective, parse_spec,
};
use libfuzzer_sys::fuzz_target;

const CALLERS: [Option<&str>; 3] = [
    None,
    Some("spiffe://td/ns/shop/sa/a"),
    Some("spiffe://td/ns/other/sa/b"),
];

fuzz_target!(|data: &[u8]| {
    // The service's policy, then after a NUL the pod's annotation (if any).
    let (svc, ann) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], Some(&data[i + 1..])),
        None => (data, None),
    };
    let checked = parse_spec(svc).and_then(|s| Policy::from_spec(&s));
    if let Err(e) = &checked {
        assert!(!e.field.is_empty() && !e.reason.is_empty());
    }
    // The same bytes as a policy file for shop/web: read or refused, never both; a
    // file that reads checks (the agent's `--authz-dir`).
    let web = Target::from_file_name("shop.web.json").unwrap();
    let file = Sourced::read("fuzz", &web, svc);
    if let Ok(spec) = &file.written {
        assert!(Policy::from_spec(spec).is_ok(), "a file read unchecked");
        assert_eq!(spec.namespace.as_deref(), Some("shop"));
        assert_eq!(spec.service.as_deref(), Some("web"));
    }
    let annotation = ann
        .and_then(|a| std::str::from_utf8(a).ok())
        .inspect(|a| {
            let _ = check_annotation_size(a);
        })
        .map(annotation_policy);
    let base = effective("shop", None, Some(&checked));
    let narrowed = base.clone().narrowed("shop", annotation.as_ref());
    for caller in CALLERS {
        for http in [
            None,
            Some(HttpRequest {
                method: "GET",
                path: "/api/x",
                host: "web",
            }),
        ] {
            let req = Request {
                caller,
                port: 80,
                http,
            };
            let b = base.decide(&req);
            if checked.is_err() {
                assert!(!b.allowed, "a refused policy allowed {req:?}");
            }
            if narrowed.decide(&req).allowed {
                assert!(b.allowed, "the annotation widened {req:?}");
            }
        }
    }
});
