//! `kvtier bench arena`: how long mapping and first-touching a host arena takes with the
//! parallel first touch, against one thread touching the same size in the same run.

use clap::Args;
use serde::Serialize;

use crate::tier::host::{ArenaOptions, HostArena};

#[derive(Debug, Args)]
pub struct ArenaArgs {
    /// Arena size in MiB.
    #[arg(long, default_value_t = 2048)]
    pub mib: u64,
    /// Directory for the arena file. Default: /dev/shm (else the current directory).
    #[arg(long)]
    pub dir: Option<std::path::PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
pub struct ArenaReport {
    pub bytes: u64,
    pub threads: usize,
    pub map_ms: f64,
    pub single_thread_map_ms: f64,
    pub speedup: f64,
    pub locked: bool,
    pub lock_error: Option<String>,
}

fn map_once(dir: &std::path::Path, bytes: u64, threads: usize) -> anyhow::Result<(f64, Result<(), String>)> {
    let path = dir.join(format!("kvtier-bench-arena-{}-{threads}", std::process::id()));
    let opts = ArenaOptions {
        touch_threads: threads,
        ..ArenaOptions::default()
    };
    let a = HostArena::create(&path, bytes, 2 << 20, &opts);
    let _ = std::fs::remove_file(&path);
    let a = a?;
    Ok((a.report().map_time.as_secs_f64() * 1e3, a.report().locked.clone()))
}

pub fn run(args: ArenaArgs) -> anyhow::Result<()> {
    let dir = args.dir.clone().unwrap_or_else(|| {
        let shm = std::path::Path::new("/dev/shm");
        if shm.is_dir() { shm.to_owned() } else { ".".into() }
    });
    let bytes = args.mib << 20;
    let threads = ArenaOptions::default().touch_threads;
    let (single, _) = map_once(&dir, bytes, 1)?;
    let (par, locked) = map_once(&dir, bytes, threads)?;
    let r = ArenaReport {
        bytes,
        threads,
        map_ms: par,
        single_thread_map_ms: single,
        speedup: single / par.max(1e-9),
        locked: locked.is_ok(),
        lock_error: locked.err(),
    };
    if args.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!(
            "{} MiB arena mapped in {:.0} ms with {} threads ({:.0} ms with one; {:.2}x); locked: {}",
            args.mib,
            r.map_ms,
            r.threads,
            r.single_thread_map_ms,
            r.speedup,
            r.lock_error.as_deref().unwrap_or("yes")
        );
    }
    Ok(())
}
