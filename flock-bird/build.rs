//! Generates the *server* side of SPIRE's Delegated Identity API (tonic + prost, with
//! protoc) for the test double in `tests/spire_double/`. The messages are not generated:
//! `extern_path` maps them to `spire-api`'s own types, so the double and the bridge's
//! client share one set of message types. The agent itself uses only `spire-api`'s
//! client; the generated file is included by the tests alone.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const ROOT: &str = "tests/spire_double/proto";
    const API: &str =
        "tests/spire_double/proto/spire/api/agent/delegatedidentity/v1/delegatedidentity.proto";
    println!("cargo:rerun-if-changed={ROOT}");
    tonic_prost_build::configure()
        .build_client(false)
        .build_server(true)
        .extern_path(".spire.api.types", "::spire_api::pb::spire::api::types")
        .extern_path(
            ".spire.api.agent.delegatedidentity.v1",
            "::spire_api::pb::spire::api::agent::delegatedidentity::v1",
        )
        .compile_protos(&[API], &[ROOT])
        .map_err(|e| {
            format!("compiling SPIRE's delegatedidentity.proto failed (protoc is Debian's protobuf-compiler; scripts/test installs it): {e}").into()
        })
}
