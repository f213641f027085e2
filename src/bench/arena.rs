//! `kvtier bench arena`: how long mapping and first-touching a host arena takes with the
//! parallel first touch, against one thread touching the same size in the same run; and
//! how fast the first copy into the fresh arena runs, against a second copy of the same
//! bytes into the same memory (the first write to a page can cost more than the copy: on
//! some virtual machines a page locked before it was touched for writing took its first
//! write at about 60 % of memcpy speed).

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
    /// Bytes of the fresh arena copied into, in 16 KiB pieces, caches evicted first.
    pub write_bytes: u64,
    /// The first copy into those bytes after the arena was mapped and touched.
    pub first_write_gbps: f64,
    /// The same copy again, into the same bytes, caches evicted first: the reference.
    pub rewrite_gbps: f64,
    /// `first_write_gbps / rewrite_gbps`: 1 when the first touch left nothing for the
    /// first copy to pay.
    pub first_write_ratio: f64,
}

/// Bytes of the arena the first-write rows copy into (at most the arena).
const WRITE_BYTES: u64 = 256 << 20;
/// The piece each copy moves, an object's size.
const PIECE: usize = 16 << 10;

/// Copies `src` over `dst` piece by piece, cycling through `src`, after evicting both from
/// the caches. Returns GB/s.
fn write_pass(dst: &mut [u8], src: &[u8]) -> f64 {
    // SAFETY: both are this process's live mappings, and no other thread touches them.
    unsafe {
        super::caches::evict(dst.as_ptr(), dst.len());
        super::caches::evict(src.as_ptr(), src.len());
    }
    let t = std::time::Instant::now();
    for (i, piece) in dst.chunks_mut(PIECE).enumerate() {
        let at = (i * PIECE) % src.len();
        piece.copy_from_slice(&src[at..at + piece.len()]);
    }
    std::hint::black_box(&dst[..]);
    dst.len() as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9
}

fn map_once(dir: &std::path::Path, bytes: u64, threads: usize) -> anyhow::Result<(f64, Result<(), String>, HostArena)> {
    let path = dir.join(format!("kvtier-bench-arena-{}-{threads}", std::process::id()));
    let opts = ArenaOptions {
        touch_threads: threads,
        ..ArenaOptions::default()
    };
    let a = HostArena::create(&path, bytes, 2 << 20, &opts);
    let _ = std::fs::remove_file(&path);
    let a = a?;
    Ok((a.report().map_time.as_secs_f64() * 1e3, a.report().locked.clone(), a))
}

pub fn run(args: ArenaArgs) -> anyhow::Result<()> {
    let dir = args.dir.clone().unwrap_or_else(|| {
        let shm = std::path::Path::new("/dev/shm");
        if shm.is_dir() { shm.to_owned() } else { ".".into() }
    });
    let bytes = args.mib << 20;
    let threads = ArenaOptions::default().touch_threads;
    let (single, ..) = map_once(&dir, bytes, 1)?;
    let (par, locked, arena) = map_once(&dir, bytes, threads)?;
    let write_bytes = (bytes.min(WRITE_BYTES) / PIECE as u64) * PIECE as u64;
    // SAFETY: the bench owns the arena (its file already unlinked) and nothing else maps
    // it; `write_bytes` lies inside the mapping, which lives until `arena` drops.
    let dst = unsafe { std::slice::from_raw_parts_mut(arena.base_ptr(), write_bytes as usize) };
    let src = crate::tier::device::pattern(7, (16 << 20).min(write_bytes as usize).max(PIECE));
    // An arena holds at least one 2 MiB slot, so there are pieces to copy.
    let (first, again) = (write_pass(dst, &src), write_pass(dst, &src));
    let r = ArenaReport {
        bytes,
        threads,
        map_ms: par,
        single_thread_map_ms: single,
        speedup: single / par.max(1e-9),
        locked: locked.is_ok(),
        lock_error: locked.err(),
        write_bytes,
        first_write_gbps: first,
        rewrite_gbps: again,
        first_write_ratio: first / again.max(1e-9),
    };
    drop(arena);
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
        println!(
            "first copy into {} MiB of it: {:.2} GB/s; the same copy again: {:.2} GB/s ({:.2}x)",
            r.write_bytes >> 20,
            r.first_write_gbps,
            r.rewrite_gbps,
            r.first_write_ratio
        );
    }
    Ok(())
}
