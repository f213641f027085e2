//! Engine ranks as separate OS processes: [`RankProc`] re-executes the running test
//! binary with `KVT_RANK` set, and that process runs [`rank_main`] instead of the test
//! harness.
//!
//! The rank body is no `#[test]`: it is hooked in as an ELF constructor (an `.init_array`
//! entry, what the `ctor` crate does), which runs before libtest's `main` and, in a rank
//! process only, takes the process over and exits. So the harness counts only real tests,
//! and a rank always runs the code of the test binary that spawned it.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::mpsc::{Receiver, sync_channel};
use std::time::Duration;

use kvtier::client::{Client, ClientConfig};
use kvtier::page::PageHash;
use kvtier::protocol::{LoadWait, SessionPhase};
use kvtier::tier::device::EmulatedDevice;

use super::{hashes, identity, seed, spec};

/// Set in a rank process; its presence turns the test binary into a rank.
const RANK_ENV: &str = "KVT_RANK";

/// The constructor: before `main`, a rank process runs the rank body and exits; any other
/// process returns at once and goes on to the test harness.
#[used]
#[unsafe(link_section = ".init_array")]
static RANK_ENTRY: extern "C" fn() = rank_entry;

extern "C" fn rank_entry() {
    if std::env::var_os(RANK_ENV).is_none() {
        return;
    }
    // A panic may not unwind out of an `extern "C"` function; end the process instead.
    let code = match std::panic::catch_unwind(rank_main) {
        Ok(()) => 0,
        Err(_) => 101,
    };
    std::process::exit(code);
}

/// An engine rank running as a separate OS process, driven line by line.
pub struct RankProc {
    child: Child,
    stdin: ChildStdin,
    lines: Receiver<String>,
}

impl RankProc {
    pub fn spawn(socket: &Path, instance: &str, tp: u16, pp: u16, tps: u16, pps: u16) -> Self {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .env(RANK_ENV, "1")
            .env("KVT_SOCKET", socket)
            .env("KVT_INSTANCE", instance)
            .env("KVT_TP", format!("{tp},{pp},{tps},{pps}"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        // Bounded: a rank answers one line per command, so a few in flight is plenty.
        let (tx, lines) = sync_channel(16);
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // Only `@@ ` lines are answers; anything else a library prints is not.
                if let Some(at) = line.find("@@ ") {
                    let _ = tx.send(line[at + 3..].to_owned());
                }
            }
        });
        let mut r = Self { child, stdin, lines };
        assert_eq!(r.cmd("ready"), "ready");
        r
    }

    /// Sends one command and returns its answer line.
    pub fn cmd(&mut self, line: &str) -> String {
        writeln!(self.stdin, "{line}").unwrap();
        self.stdin.flush().unwrap();
        self.lines.recv_timeout(Duration::from_secs(20)).expect("rank answered")
    }

    /// Sends a command and parses the numbers of its answer.
    pub fn nums(&mut self, line: &str) -> Vec<u64> {
        let a = self.cmd(line);
        a.split_whitespace()
            .skip(1)
            .map(|w| w.parse().unwrap_or_else(|_| panic!("{line:?} -> {a:?}")))
            .collect()
    }

    pub fn kill9(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }

    pub fn exit(mut self) {
        let _ = writeln!(self.stdin, "exit");
        self.child.wait().unwrap();
    }
}

impl Drop for RankProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The pages of `<base> <n>` pairs, one run after another.
fn chain(w: &[&str]) -> Vec<PageHash> {
    let n: Vec<u64> = w.iter().filter_map(|v| v.parse().ok()).collect();
    n.chunks(2)
        .flat_map(|c| hashes(c[0], c.get(1).copied().unwrap_or(0) as usize))
        .collect()
}

/// The rank process: reads commands on stdin, answers `@@ …` lines on stdout.
fn rank_main() {
    let env = |k: &str| std::env::var(k).unwrap();
    let r: Vec<u16> = env("KVT_TP").split(',').map(|v| v.parse().unwrap()).collect();
    let (tp, pp, tps, pps) = (r[0], r[1], r[2], r[3]);
    let layout = spec(tps, pps);
    let cfg = ClientConfig::new(
        env("KVT_SOCKET"),
        identity(&env("KVT_INSTANCE"), tp, pp, tps, pps),
        layout.clone(),
    );
    let client = Client::connect(cfg.with_timeout(Duration::from_secs(10))).unwrap();
    let built = layout.build().unwrap();
    let dev = Arc::new(EmulatedDevice::new(&built, pp, 256));
    client.register_device(dev.clone()).unwrap();
    let mut plans = Vec::new();
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let w: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| w.get(i).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
        let hs = hashes(num(1), num(2) as usize);
        let slots: Vec<u32> = (0..hs.len() as u32).collect();
        let answer = match w.first().copied() {
            Some("ready") => Ok("ready".to_string()),
            Some("store") => {
                for (i, h) in hs.iter().enumerate() {
                    dev.fill_page(i as u32, seed(h, tp, pp)).unwrap();
                }
                client
                    .store(&hs, &slots, "s")
                    .map(|r| format!("stored {} {} {}", r.written, r.complete, r.ticket))
            }
            Some("begin") => {
                for (i, h) in hs.iter().enumerate() {
                    dev.fill_page(i as u32, seed(h, tp, pp)).unwrap();
                }
                client.begin_store(&hs, "s").and_then(|p| {
                    client.write_plan(&p, &slots)?;
                    let n = p.pages.len();
                    plans.push(p);
                    Ok(format!("begun {n}"))
                })
            }
            Some("lookup") => client
                .lookup(&hs)
                .map(|h| format!("hit {} {} {}", h.device, h.host, h.pool)),
            Some("load") => {
                let fresh = Arc::new(EmulatedDevice::new(&built, pp, 256));
                client.register_device(fresh.clone()).unwrap();
                let r = client.load(&hs, &slots, LoadWait::BestEffort).map(|n| {
                    let ok = (0..n)
                        .filter(|&i| fresh.page_matches(i as u32, seed(&hs[i], tp, pp)).unwrap())
                        .count();
                    format!("loaded {n} {ok}")
                });
                client.register_device(dev.clone()).unwrap();
                r
            }
            Some("wait") => client
                .wait(num(1), Duration::from_millis(num(2)))
                .map(|t| format!("ticket {} {} {}", t.complete, t.total, t.failed)),
            // Session commands (tests/sessions.rs): a chain is `<base> <n>` pairs.
            Some("phase") => {
                let phase = match w.get(3).copied() {
                    Some("reasoning") => SessionPhase::Reasoning,
                    Some("acting") => SessionPhase::Acting,
                    Some("paused") => SessionPhase::Paused,
                    _ => SessionPhase::Ended,
                };
                let parent = w.get(2).copied().filter(|p| *p != "-");
                client
                    .session(w.get(1).copied().unwrap_or(""), parent, phase)
                    .map(|()| "ok".to_string())
            }
            Some("cstore") => {
                let hs = chain(&w[2..]);
                for (i, h) in hs.iter().enumerate() {
                    dev.fill_page(i as u32, seed(h, tp, pp)).unwrap();
                }
                let slots: Vec<u32> = (0..hs.len() as u32).collect();
                client
                    .store(&hs, &slots, w.get(1).copied().unwrap_or(""))
                    .and_then(|r| client.wait(r.ticket, Duration::from_secs(10)))
                    .map(|t| format!("stored {} {}", t.complete, t.total))
            }
            Some("cload") => {
                let hs = chain(&w[1..]);
                let slots: Vec<u32> = (0..hs.len() as u32).collect();
                let fresh = Arc::new(EmulatedDevice::new(&built, pp, 256));
                client.register_device(fresh.clone()).unwrap();
                let r = client.load(&hs, &slots, LoadWait::BestEffort).map(|n| {
                    let ok = (0..n)
                        .filter(|&i| fresh.page_matches(i as u32, seed(&hs[i], tp, pp)).unwrap())
                        .count();
                    format!("loaded {n} {ok}")
                });
                client.register_device(dev.clone()).unwrap();
                r
            }
            // reqend <session> <parent|-> <input> <output> <chain…>
            Some("reqend") => client
                .request_end(
                    w.get(1).copied().unwrap_or(""),
                    w.get(2).copied().filter(|p| *p != "-"),
                    num(3),
                    num(4),
                    &chain(&w[5.min(w.len())..]),
                )
                .map(|()| "ok".to_string()),
            Some("cremoved") => client.removed(&chain(&w[1..])).map(|()| "ok".to_string()),
            Some("advice") => client.take_advice(4096).map(|b| {
                let ready: usize = b
                    .advice
                    .iter()
                    .filter(|a| a.kind == kvtier::protocol::AdviceKind::ReadyToLoad)
                    .map(|a| a.hashes.len())
                    .sum();
                format!("ready {ready}")
            }),
            // Every advice entry in order: `pause:<id>`, `resume:<id>`, `ready:<pages>`, …
            Some("alladvice") => client.take_advice(4096).map(|b| {
                let words: Vec<String> = b
                    .advice
                    .iter()
                    .map(|a| match a.session_id.as_deref() {
                        Some(id) => format!("{:?}:{id}", a.kind).to_lowercase(),
                        None => format!("{:?}:{}", a.kind, a.hashes.len()).to_lowercase(),
                    })
                    .collect();
                format!("advice {}", words.join(" ")).trim_end().to_string()
            }),
            Some("exit") | None => break,
            Some(other) => Ok(format!("unknown {other}")),
        };
        match answer {
            Ok(a) => println!("@@ {a}"),
            Err(e) => println!("@@ err {e}"),
        }
    }
}
