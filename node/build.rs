//! Build script: re-runs (and so rebuilds the crate) when anything under `web/` changes, so
//! the UI embedded by `api::assets` is always the tree's. rust-embed tracks the files it
//! embedded but not files added later. It generates nothing.

fn main() {
    println!("cargo:rerun-if-changed=../web");
}
