//! Build script: compiles the C++ side of the cxx bridge.
//!
//! Each part of the build lives in its own function so that parts added for other
//! features (a bindgen step for the Mooncake C ABI, for one) merge as siblings.

fn main() {
    build_cxx();
}

/// The cxx bridge (`src/ffi/cxx.rs`) and its C++ helpers (`cpp/client.cc`), compiled into
/// the static library `kvtier-cxx` that the crate links. Also tells the integration tests
/// where cxx's own header is, so they can compile a C++ engine against the bridge.
fn build_cxx() {
    cxx_build::bridge("src/ffi/cxx.rs")
        .file("cpp/client.cc")
        .include("include")
        .std("c++17")
        .compile("kvtier-cxx");
    for path in [
        "src/ffi/cxx.rs",
        "cpp/client.cc",
        "include/kvtier/client.h",
        "include/kvtier.h",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
    // cxx exports its header's path to crates that depend on it directly.
    if let Ok(header) = std::env::var("DEP_CXXBRIDGE1_HEADER") {
        println!("cargo:rustc-env=KVTIER_CXX_HEADER={header}");
    }
}
