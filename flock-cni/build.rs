//! Generates the `flock.cni.v1` gRPC client and server (tonic + prost) with protoc.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    #[cfg(feature = "grpc")]
    generate()?;
    Ok(())
}

#[cfg(feature = "grpc")]
fn generate() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto/flock/cni/v1/cni.proto");
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_protos(&["proto/flock/cni/v1/cni.proto"], &["proto"])
        .map_err(|e| {
            format!("compiling flock-cni's .proto failed (protoc is Debian's protobuf-compiler; scripts/test installs it): {e}").into()
        })
}
