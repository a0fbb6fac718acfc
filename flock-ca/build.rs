//! Generates the `flock.ca.v1` gRPC client and server (tonic + prost) with protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/flock/ca/v1/ca.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/flock/ca/v1/ca.proto"], &["proto"])
        .map_err(|e| {
            format!("compiling flock-ca's .proto failed (protoc is Debian's protobuf-compiler; scripts/test installs it): {e}").into()
        })
}
