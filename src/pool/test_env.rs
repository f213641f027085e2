//! Loud skips for the library's own tests, the twin of the integration tests'
//! `tests/common/require.rs` for the few lib tests that need a tool from outside (a C
//! compiler for the stand-in Mooncake library).
//!
//! A test that cannot run writes `SKIPPED: <test>: <why>` to the raw stderr handle, which
//! the test harness does not capture, so the skip shows in every `cargo test` log instead
//! of reading as a pass. Where `KVTIER_REQUIRE` (a comma list, exported by `.ci/run`)
//! names the missing requirement, the test panics instead.

use std::io::Write;
use std::process::{Command, Stdio};

/// Whether a test that needs `what` may run: true when it is present. When it is missing,
/// panics if `KVTIER_REQUIRE` lists `what`, else writes a `SKIPPED` line and returns false.
/// `why` says what the test wanted it for.
pub(crate) fn require(what: &str, why: &str) -> bool {
    let Err(missing) = probe(what) else {
        return true;
    };
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    let listed = std::env::var("KVTIER_REQUIRE").unwrap_or_default();
    if listed.split(',').any(|n| n.trim() == what) {
        panic!("{test}: {why}: {missing}; KVTIER_REQUIRE lists {what:?}, so this environment must provide it");
    }
    let _ = writeln!(
        std::io::stderr().lock(),
        "SKIPPED: {test}: {why}: {missing} (with KVTIER_REQUIRE={what} this fails instead)"
    );
    false
}

/// The C compiler the tests build with: `$CC` where set, else `cc`.
pub(crate) fn cc() -> String {
    std::env::var("CC")
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "cc".into())
}

/// `Ok` when `what` is present, else why not.
fn probe(what: &str) -> Result<(), String> {
    match what {
        "cc" => {
            let cc = cc();
            let st = Command::new(&cc)
                .arg("--version")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map_err(|e| format!("cannot run {cc}: {e}"))?;
            if st.success() {
                Ok(())
            } else {
                Err(format!("{cc} --version exited with {st}"))
            }
        }
        other => panic!("no lib test knows the requirement {other:?}"),
    }
}
