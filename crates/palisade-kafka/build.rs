//! Generates the Rust types of `proto/palisade/v1/event.proto` with protox
//! (a protobuf compiler in Rust), so no system `protoc` is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("palisade/v1/event.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let fds = protox::compile([&file], [&root])?;
    prost_build::compile_fds(fds)?;
    Ok(())
}
