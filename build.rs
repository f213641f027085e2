//! Build script. Each part lives in its own function:
//!
//! - `build_cxx`: the C++ side of the cxx bridge (always; needs a C++17 compiler).
//! - `mooncake_c`: with the `mooncake-c` feature, bindgen turns upstream Mooncake's own
//!   `include/upstream/mooncake/store_c.h` (vendored verbatim) into bindings that load
//!   `libmooncake_store.so` at run time through libloading (the default build needs no
//!   libclang).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    build_cxx();
    #[cfg(feature = "mooncake-c")]
    mooncake_c();
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

#[cfg(feature = "mooncake-c")]
fn mooncake_c() {
    let header = "include/upstream/mooncake/store_c.h";
    println!("cargo:rerun-if-changed={header}");
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    bindgen::Builder::default()
        .header(header)
        .allowlist_function("mooncake_store_.*")
        .allowlist_type("mooncake_.*")
        .dynamic_library_name("MooncakeStoreC")
        .dynamic_link_require_all(true)
        .layout_tests(false)
        .generate()
        .expect("bindgen could not read include/upstream/mooncake/store_c.h (is libclang installed?)")
        .write_to_file(out.join("mooncake_store_c.rs"))
        .expect("write bindings");
}
