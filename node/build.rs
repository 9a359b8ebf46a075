//! Build script: re-runs (and so rebuilds the crate) when anything under `web/` changes, so
//! the UI embedded by `api::assets` is always the tree's (rust-embed tracks the files it
//! embedded but not files added later). With the `cuda` feature it also compiles
//! `cuda/decode.cu` to PTX with nvcc (`NVCC`, else `$CUDA_ROOT/bin/nvcc`, else `nvcc` on PATH)
//! for `CUDA_COMPUTE_CAP` (default 80; the driver JIT-compiles PTX for newer GPUs).
//! It generates nothing else.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=../web");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        compile_ptx();
    }
}

fn compile_ptx() {
    println!("cargo:rerun-if-changed=cuda/decode.cu");
    for var in ["NVCC", "CUDA_ROOT", "CUDA_COMPUTE_CAP"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let nvcc = std::env::var("NVCC").ok().or_else(|| std::env::var("CUDA_ROOT").ok().map(|r| format!("{r}/bin/nvcc"))).unwrap_or_else(|| "nvcc".into());
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_else(|_| "80".into());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR")).join("decode.ptx");
    let status = Command::new(&nvcc)
        .args(["--ptx", "-O3", &format!("-arch=compute_{cap}"), "-o"])
        .arg(&out)
        .arg("cuda/decode.cu")
        .status()
        .unwrap_or_else(|e| panic!("running {nvcc} to compile cuda/decode.cu: {e} (set NVCC or CUDA_ROOT)"));
    assert!(status.success(), "{nvcc} failed on cuda/decode.cu");
}
