//! The C ABI path against a stand-in library built from `tests/data` (the real one is
//! rarely built where tests run), and the typed error of a missing library.

use super::*;
use crate::pool::test_env;
use crate::tier::device::pattern;
use crate::tier::host::ArenaOptions;

/// Builds the stand-in library of `tests/data` with the system C compiler. With a compiler
/// present, a failed build is a failed test, never a skip.
fn stub_library(dir: &Path) -> std::path::PathBuf {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mooncake_store_stub.c");
    let out = dir.join("libmooncake_store_stub.so");
    let cc = test_env::cc();
    let o = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-o"])
        .arg(&out)
        .arg(src)
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(
        o.status.success(),
        "building the stand-in Mooncake library failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

#[test]
fn the_c_abi_plumbing_moves_bytes_and_maps_codes() {
    if !test_env::require("cc", "builds the stand-in Mooncake library") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lib = stub_library(dir.path());
    let opts = ArenaOptions {
        lock: false,
        ..ArenaOptions::default()
    };
    let arena = Arc::new(HostArena::create(&dir.path().join("arena"), 1 << 20, 64 << 10, &opts).unwrap());
    let cfg = MooncakeConfig::new("127.0.0.1:1", "http://127.0.0.1:1/metadata")
        .with_staging_bytes(64 << 10)
        .with_remove_policy(RemovePolicy::Fail);
    let pool = MooncakeCPool::open(cfg, Some(&lib), Some(arena.clone())).unwrap();
    assert_eq!(pool.health(), PoolHealth::Ok);
    // One object from the arena (direct), one from a plain buffer (staged).
    let slot = arena.alloc().unwrap();
    let a = pattern(1, 4096);
    // SAFETY: the test allocated the slot and is its only user.
    unsafe { arena.slot_mut(slot, a.len()).unwrap() }.copy_from_slice(&a);
    // SAFETY: as above; nothing writes the slot while `in_arena` lives.
    let in_arena = unsafe { arena.slot(slot, a.len()).unwrap() };
    let b = pattern(2, 1000);
    assert_eq!(pool.batch_put_from(&[("a", in_arena), ("b", &b)]), vec![Ok(()), Ok(())]);
    assert_eq!(pool.batch_exists(&["a", "b", "c"]), vec![Ok(true), Ok(true), Ok(false)]);
    let mut ba = vec![0u8; 4096];
    let mut bb = vec![0u8; 2000];
    let mut small = [0u8; 10];
    let got = pool.batch_get_into(&mut [("a", &mut ba[..]), ("b", &mut bb[..]), ("c", &mut small[..])]);
    assert_eq!(got, vec![Ok(4096), Ok(1000), Err(PoolError::NotFound)]);
    assert_eq!((ba, &bb[..1000]), (a, &b[..]));
    assert!(matches!(
        pool.batch_get_into(&mut [("a", &mut small[..])])[0],
        Err(PoolError::BufferTooSmall { .. })
    ));
    assert_eq!(pool.remove("a", false), Err(PoolError::HasLease));
    assert_eq!(pool.remove("a", true), Ok(()));
    assert_eq!(pool.remove("a", true), Err(PoolError::NotFound));
    let too_big = vec![0u8; (64 << 10) + 1];
    assert!(matches!(
        pool.batch_put_from(&[("big", &too_big)])[0],
        Err(PoolError::TooLarge { .. })
    ));
}

#[test]
fn a_missing_library_is_a_typed_error() {
    let cfg = MooncakeConfig::new("127.0.0.1:1", "http://127.0.0.1:1/metadata");
    let err = MooncakeCPool::open(cfg, Some(Path::new("/nonexistent/libmooncake_store.so")), None);
    assert!(matches!(err, Err(MooncakeError::Library(_))));
}
