//! The C ABI backend against the stub library of `tests/data` (upstream's ABI, objects in
//! memory; the real library is rarely built where tests run), and the typed errors of a
//! missing library and of one that lacks a function of upstream's header.

use std::time::{Duration, Instant};

use super::*;
use crate::pool::mooncake::integrity::MAC_LEN;
use crate::pool::test_env;
use crate::tier::device::pattern;
use crate::tier::host::ArenaOptions;

/// Builds the stub library with the system C compiler (`defines` as `-D` flags). With a
/// compiler present, a failed build is a failed test, never a skip.
pub(crate) fn stub_library(dir: &Path, name: &str, defines: &[&str]) -> PathBuf {
    let src = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/mooncake_store_stub.c");
    let out = dir.join(name);
    let cc = test_env::cc();
    let o = std::process::Command::new(&cc)
        .args(["-shared", "-fPIC", "-O1", "-pthread", "-o"])
        .arg(&out)
        .arg(src)
        .args(defines.iter().map(|d| format!("-D{d}")))
        .output()
        .unwrap_or_else(|e| panic!("running {cc}: {e}"));
    assert!(
        o.status.success(),
        "building the stub Mooncake library failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    out
}

fn config() -> MooncakeConfig {
    MooncakeConfig::new("127.0.0.1:1", "http://127.0.0.1:1/metadata")
        .with_staging_bytes(64 << 10)
        .with_remove_policy(RemovePolicy::Fail)
}

#[test]
fn the_c_abi_moves_bytes_and_maps_codes() {
    if !test_env::require("cc", "builds the stub Mooncake library") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lib = stub_library(dir.path(), "libmooncake_store.so", &[]);
    let opts = ArenaOptions {
        lock: false,
        ..ArenaOptions::default()
    };
    let arena = Arc::new(HostArena::create(&dir.path().join("arena"), 1 << 20, 64 << 10, &opts).unwrap());
    let pool = MooncakeCPool::open(config(), Some(&lib), Some(arena.clone())).unwrap();
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
        Err(PoolError::BufferTooSmall { got: 10, .. })
    ));
    assert_eq!(pool.remove("a", false), Err(PoolError::HasLease));
    assert_eq!(pool.remove("a", true), Ok(()));
    assert_eq!(pool.remove("a", true), Err(PoolError::NotFound));
    let too_big = vec![0u8; (64 << 10) + 1];
    assert!(matches!(
        pool.batch_put_from(&[("big", &too_big)])[0],
        Err(PoolError::TooLarge { .. })
    ));
    assert!(matches!(
        pool.batch_put_from(&[("nul\0key", &b[..])])[0],
        Err(PoolError::Backend {
            code: codes::INVALID_KEY,
            ..
        })
    ));
    // Many staged objects in one batch: packed, several to a C call, each intact.
    let many: Vec<(String, Vec<u8>)> = (0..40).map(|i| (format!("m{i}"), pattern(100 + i, 3000))).collect();
    let items: Vec<(&str, &[u8])> = many.iter().map(|(k, v)| (k.as_str(), v.as_slice())).collect();
    assert!(pool.batch_put_from(&items).iter().all(Result::is_ok));
    let mut bufs: Vec<Vec<u8>> = many.iter().map(|_| vec![0u8; 3000]).collect();
    let mut gets: Vec<(&str, &mut [u8])> = many
        .iter()
        .zip(bufs.iter_mut())
        .map(|((k, _), b)| (k.as_str(), &mut b[..]))
        .collect();
    assert!(pool.batch_get_into(&mut gets).iter().all(|r| *r == Ok(3000)));
    assert!(many.iter().zip(&bufs).all(|((_, v), b)| v == b));
}

#[test]
fn sealed_objects_carry_the_mac_and_a_forged_one_is_refused_and_removed() {
    if !test_env::require("cc", "builds the stub Mooncake library") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lib = stub_library(dir.path(), "libmooncake_store.so", &[]);
    let pool = MooncakeCPool::open(config().with_integrity_key(&[7u8; 32]), Some(&lib), None).unwrap();
    assert_eq!(pool.max_object_bytes(), (64 << 10) - MAC_LEN);
    let page = pattern(3, 5000);
    assert_eq!(pool.batch_put_from(&[("p", &page)]), vec![Ok(())]);
    // What the store holds: the page and its MAC under the key.
    let mut raw = vec![0u8; 6000];
    let got = pool.get_raw(&["p"], &[(raw.as_mut_ptr().cast(), raw.len())]);
    assert_eq!(got, vec![Ok(5000 + MAC_LEN)]);
    let mac = pool.cfg.integrity.clone().unwrap();
    assert_eq!(&raw[..5000], &page[..]);
    assert_eq!(raw[5000..5004], crate::pool::mooncake::integrity::FORMAT);
    assert_eq!(mac.open("p", &raw[..5000 + MAC_LEN]), Some(&page[..]));
    let mut back = vec![0u8; 5000];
    assert_eq!(pool.batch_get_into(&mut [("p", &mut back[..])]), vec![Ok(5000)]);
    assert_eq!(back, page);
    // A put without the key (raw bytes, or a MAC under another key) is never loaded.
    let mut forged = page.clone();
    forged.extend_from_slice(&mac.tag("other", &page));
    let put = pool.put_raw(&["f"], &[(forged.as_mut_ptr().cast(), forged.len())]);
    assert_eq!(put, vec![Ok(())]);
    let before = mac.rejected();
    assert_eq!(
        pool.batch_get_into(&mut [("f", &mut back[..])]),
        vec![Err(PoolError::NotFound)]
    );
    assert_eq!(mac.rejected(), before + 1);
    assert_eq!(pool.batch_exists(&["f", "p"]), vec![Ok(false), Ok(true)]);
    assert_eq!(pool.integrity().map(|r| (r.on, r.rejected)), Some((true, before + 1)));
}

#[test]
fn a_stalled_call_answers_unavailable_within_its_deadline() {
    if !test_env::require("cc", "builds the stub Mooncake library") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lib = stub_library(dir.path(), "libmooncake_store.so", &[]);
    // The stub's existence query stalls 1.5 s; kvtier's deadline is 200 ms.
    let cfg = config()
        .with_protocol("tcp", "stall-ms=1500")
        .with_op_timeout(Duration::from_millis(200), 200 << 20);
    let pool = MooncakeCPool::open(cfg, Some(&lib), None).unwrap();
    let t = Instant::now();
    let r = pool.batch_exists(&["x"]);
    let took = t.elapsed();
    assert!(
        matches!(&r[0], Err(PoolError::Unavailable(m)) if m.contains("batch_is_exist")),
        "{r:?}"
    );
    assert!(took < Duration::from_millis(1200), "answered after {took:?}");
    // Puts still run (they do not wait for the stalled call), and once the stalled calls
    // have returned, existence answers again.
    assert_eq!(pool.batch_put_from(&[("x", &[1u8; 8][..])]), vec![Ok(())]);
    let t = Instant::now();
    loop {
        if pool.client.refusal().is_none() && pool.client.abandoned_now() == 0 {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "the stalled call never returned");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(pool.client.abandoned_now(), 0);
}

#[test]
fn a_missing_library_is_a_typed_error() {
    let err = MooncakeCPool::open(config(), Some(Path::new("/nonexistent/libmooncake_store.so")), None);
    assert!(matches!(&err, Err(MooncakeError::Library(m)) if m.contains("no such file")));
    let err = MooncakeCPool::open(config(), Some(Path::new("libmooncake_store.so")), None);
    assert!(matches!(&err, Err(MooncakeError::Library(m)) if m.contains("absolute")));
}

#[test]
fn a_library_another_user_could_swap_is_refused() {
    if !test_env::require("cc", "builds the stub Mooncake library") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lib = stub_library(dir.path(), "libmooncake_store.so", &[]);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o777)).unwrap();
    let err = MooncakeCPool::open(config(), Some(&lib), None);
    assert!(
        matches!(&err, Err(MooncakeError::Library(m)) if m.contains("no one else can write")),
        "{:?}",
        err.err()
    );
}

#[test]
fn a_library_without_every_function_of_upstreams_header_is_refused() {
    if !test_env::require("cc", "builds the stub Mooncake library") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let lib = stub_library(dir.path(), "libwrong.so", &["KVTIER_STUB_WRONG_ABI"]);
    let err = MooncakeCPool::open(config(), Some(&lib), None);
    assert!(
        matches!(&err, Err(MooncakeError::Library(m)) if m.contains("mooncake_store_remove_all")),
        "{:?}",
        err.err()
    );
}
