//! The engine build of `libkvtier.so` (profile `engine`, without the `daemon` feature: what
//! the Python package ships and engines load) exports the same engine-facing API as the
//! cdylib of the default build: the same dynamic symbols, every C function of
//! `include/kvtier.h` and the cxx bridge's functions among them.

mod common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use common::engine_lib::engine_cdylib;

/// The cdylib `cargo test` built with the default features, beside the `kvtier` binary.
fn daemon_cdylib() -> PathBuf {
    let dir = Path::new(env!("CARGO_BIN_EXE_kvtier")).parent().unwrap();
    [dir.join("deps/libkvtier.so"), dir.join("libkvtier.so")]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .unwrap_or_else(|| panic!("libkvtier.so was not built in {}", dir.display()))
}

fn u16_at(b: &[u8], at: usize) -> usize {
    u16::from_le_bytes(b[at..at + 2].try_into().unwrap()) as usize
}

fn u32_at(b: &[u8], at: usize) -> usize {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap()) as usize
}

fn u64_at(b: &[u8], at: usize) -> usize {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap()) as usize
}

/// The defined global and weak functions and objects of an ELF64 little-endian shared
/// library's `.dynsym`: what a dynamic linker or `dlsym` can find in it.
fn exported(path: &Path) -> BTreeSet<String> {
    let b = std::fs::read(path).unwrap();
    assert_eq!(
        &b[..6],
        b"\x7fELF\x02\x01",
        "{} is not ELF64 little-endian",
        path.display()
    );
    let (shoff, shentsize, shnum) = (u64_at(&b, 0x28), u16_at(&b, 0x3a), u16_at(&b, 0x3c));
    let section = |i: usize| {
        let h = shoff + i * shentsize;
        // (type, offset, size, link, entry size)
        (
            u32_at(&b, h + 4),
            u64_at(&b, h + 0x18),
            u64_at(&b, h + 0x20),
            u32_at(&b, h + 0x28),
            u64_at(&b, h + 0x38),
        )
    };
    const SHT_DYNSYM: usize = 11;
    let (_, off, size, link, entsize) = (0..shnum)
        .map(section)
        .find(|s| s.0 == SHT_DYNSYM)
        .unwrap_or_else(|| panic!("{} has no .dynsym", path.display()));
    let (_, stroff, strsize, _, _) = section(link);
    let strtab = &b[stroff..stroff + strsize];
    let mut names = BTreeSet::new();
    for at in (off..off + size).step_by(entsize) {
        let (name, info, shndx) = (u32_at(&b, at), b[at + 4], u16_at(&b, at + 6));
        let (bind, kind) = (info >> 4, info & 0xf);
        // Defined (section index not UNDEF), GLOBAL or WEAK, OBJECT or FUNC.
        if shndx != 0 && (bind == 1 || bind == 2) && (kind == 1 || kind == 2) {
            let end = strtab[name..].iter().position(|&c| c == 0).unwrap();
            names.insert(String::from_utf8_lossy(&strtab[name..name + end]).into_owned());
        }
    }
    names
}

/// The functions `include/kvtier.h` declares: `kvtier_<name>(` at the start of a
/// declaration's name.
fn header_functions() -> BTreeSet<String> {
    let h = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("include/kvtier.h")).unwrap();
    let mut names = BTreeSet::new();
    for (i, _) in h.match_indices("kvtier_") {
        let before = h[..i].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            continue;
        }
        let rest = &h[i..];
        let len = rest
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .unwrap_or(rest.len());
        if rest[len..].starts_with('(') {
            names.insert(rest[..len].to_owned());
        }
    }
    names
}

#[test]
fn engine_build_exports_the_same_api_as_the_default_build() {
    let engine = exported(&engine_cdylib());
    let daemon = exported(&daemon_cdylib());
    let only_engine: Vec<_> = engine.difference(&daemon).collect();
    let only_daemon: Vec<_> = daemon.difference(&engine).collect();
    assert!(
        only_engine.is_empty() && only_daemon.is_empty(),
        "exports differ: only in the engine build {only_engine:?}, only in the default build {only_daemon:?}"
    );

    let declared = header_functions();
    assert!(declared.len() >= 20, "found only {declared:?} in include/kvtier.h");
    let missing: Vec<_> = declared.difference(&engine).collect();
    assert!(
        missing.is_empty(),
        "include/kvtier.h declares {missing:?}, the engine build lacks them"
    );
    assert!(
        engine.iter().any(|s| s.starts_with("kvtier$cxxbridge1$")),
        "no cxx bridge function in the engine build: {engine:?}"
    );
}
