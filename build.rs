//! Build script. Without the `mooncake-c` feature it does nothing (the default build needs
//! no libclang). With it, bindgen turns `include/mooncake_store_c.h` into bindings that
//! load `libmooncake_store.so` at run time through libloading.

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    #[cfg(feature = "mooncake-c")]
    mooncake_c();
}

#[cfg(feature = "mooncake-c")]
fn mooncake_c() {
    let header = "include/mooncake_store_c.h";
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
        .expect("bindgen could not read include/mooncake_store_c.h (is libclang installed?)")
        .write_to_file(out.join("mooncake_store_c.rs"))
        .expect("write bindings");
}
