//! Compiles `proto/*.proto` with the pure-Rust `protox` (no `protoc` on the machine needed).

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    let fds = protox::compile(["proto/shoal.proto", "proto/cluster.proto", "proto/dataplane.proto", "proto/control.proto", "proto/files.proto"], ["proto"])?;
    prost_build::Config::new().compile_fds(fds)?;
    Ok(())
}
