//! The emulated CUDA driver's side of the GPU tests: which driver a test runs on, the
//! driver's counters, and building `libcuda.c` and re-running the test binary on it.

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use cudarc::driver::sys;
use kvtier::tier::cuda::driver_present;

/// Set in the re-executed test processes: the emulated driver's configuration.
pub const SCENARIO: &str = "KVTIER_GPU_TEST_SCENARIO";

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Driver {
    None,
    Emulated,
    Real,
}

/// Written to the raw stderr handle, which the test harness does not capture, so it shows
/// in every CI log.
pub fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "{line}");
}

pub fn driver() -> Driver {
    if !driver_present() {
        return Driver::None;
    }
    // SAFETY: the driver library is present (checked above); looking a symbol up has no
    // side effect.
    let fake = unsafe { sys::culib().get::<StatsFn>(b"kvtier_fake_cuda_stats").is_ok() };
    if fake { Driver::Emulated } else { Driver::Real }
}

/// Whether a GPU test can run, saying loudly on which driver (or that it skipped).
pub fn gpu() -> bool {
    match driver() {
        Driver::None => say("SKIPPED: no CUDA driver (GPU test did not run)"),
        Driver::Emulated => say("running on the emulated CUDA driver (no GPU)"),
        Driver::Real => say("GPU test ran on the real CUDA driver"),
    }
    driver() != Driver::None
}

/// The emulated driver's configuration in this process, if it is the driver in use.
pub fn scenario() -> Option<String> {
    (driver() == Driver::Emulated).then(|| std::env::var(SCENARIO).unwrap_or_default())
}

// ---- the emulated driver's counters (order of the ST_* enum in libcuda.c) -------------

pub type StatsFn = unsafe extern "C" fn(*mut u64, usize) -> usize;
pub const ST_FREES: usize = 1;
pub const ST_REGISTERS: usize = 3;
pub const ST_UNREGISTERS: usize = 5;
pub const ST_LIVE_REGISTRATIONS: usize = 6;
pub const ST_COPIES: usize = 7;
pub const ST_COPIES_2D: usize = 8;
pub const ST_BATCHES: usize = 9;
pub const ST_PAGEABLE: usize = 11;
pub const ST_STREAM_WAITS: usize = 13;
pub const ST_EVENT_RECORDS: usize = 14;
pub const ST_HOST_FUNCS: usize = 16;
pub const ST_EVENT_QUERIES: usize = 18;
pub const ST_EVENT_SYNCS: usize = 20;
pub const ST_STREAM_SYNCS: usize = 21;
/// Copy operations the stream's worker has run (not just queued).
pub const ST_COPIES_RUN: usize = 22;
pub const ST_COUNT: usize = 23;

pub fn stats() -> [u64; ST_COUNT] {
    let mut out = [0u64; ST_COUNT];
    // SAFETY: only called on the emulated driver, which exports this function.
    unsafe {
        let f = sys::culib().get::<StatsFn>(b"kvtier_fake_cuda_stats").unwrap();
        assert_eq!(f(out.as_mut_ptr(), ST_COUNT), ST_COUNT, "counter layout changed");
    }
    out
}

pub fn delta(before: &[u64; ST_COUNT], which: usize) -> u64 {
    stats()[which] - before[which]
}

/// Lets a hung stream's queued work run from now on (emulated driver only).
pub fn release_hang() {
    // SAFETY: only called on the emulated driver, which exports this function.
    unsafe {
        let f = sys::culib()
            .get::<unsafe extern "C" fn()>(b"kvtier_fake_cuda_release_hang")
            .unwrap();
        f();
    }
}

pub fn build_fake_driver(dir: &Path) -> std::path::PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fake_cuda/libcuda.c");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let so = dir.join("libcuda.so");
    let out = Command::new(&cc)
        .args(["-shared", "-fPIC", "-O2", "-pthread", "-Wall", "-Wl,-z,nodelete", "-o"])
        .arg(&so)
        .arg(&src)
        .output()
        .unwrap_or_else(|e| panic!("running {cc} to build the emulated CUDA driver: {e}"));
    assert!(
        out.status.success(),
        "building the emulated CUDA driver failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    so
}

/// Runs this test binary again with the emulated driver, bounded by a deadline.
pub fn run_scenario(dir: &Path, name: &str, env: &[(&str, &str)], filter: &[&str]) -> String {
    let lib_path = match std::env::var("LD_LIBRARY_PATH") {
        Ok(p) if !p.is_empty() => format!("{}:{p}", dir.display()),
        _ => dir.display().to_string(),
    };
    let log = dir.join(format!("{name}.log"));
    let file = std::fs::File::create(&log).unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--test-threads=1", "--nocapture"])
        .args(filter)
        .env("LD_LIBRARY_PATH", lib_path)
        .env(SCENARIO, name)
        .env("KVTIER_FAKE_CUDA_MAX_REGISTER_BYTES", (4u64 << 20).to_string())
        .envs(env.iter().copied())
        .stdout(file.try_clone().unwrap())
        .stderr(file)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if t.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "scenario {name} ran over 300 s:\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let out = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "scenario {name} failed:\n{out}");
    out
}

/// A driver configuration: its name, the emulated driver's environment, test filters.
pub type Scenario<'a> = (&'a str, &'a [(&'a str, &'a str)], &'a [&'a str]);

pub fn passed(out: &str) -> usize {
    out.lines()
        .filter_map(|l| l.strip_prefix("test result: ok. "))
        .filter_map(|l| l.split(' ').next()?.parse::<usize>().ok())
        .sum()
}
