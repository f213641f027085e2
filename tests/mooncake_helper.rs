//! The Mooncake helper's own framing and encoding, run in the helper script itself
//! (`python/kvtier_mooncake_helper.py`, imported as a module; no store is needed for these
//! parts). The helper reads whatever its socket holds and cuts frames out of it, so it
//! must yield exactly the frames the daemon sent whether they arrive several in one read
//! or one split over many; and its key lists and result codes must be the bytes the
//! daemon's side of the protocol (`src/pool/mooncake/wire.rs`) writes and reads.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

/// One request frame as the daemon writes it: `u32 length | u64 id | u8 op | body`.
fn frame(id: u64, op: u8, body: &[u8]) -> Vec<u8> {
    let mut f = ((body.len() + 9) as u32).to_le_bytes().to_vec();
    f.extend_from_slice(&id.to_le_bytes());
    f.push(op);
    f.extend_from_slice(body);
    f
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs `driver` with the helper imported as `h`; returns its stdout lines.
fn run(python: &Path, driver: &str) -> Vec<String> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let prelude = format!(
        "import sys, socket\nsys.path.insert(0, {:?})\nimport kvtier_mooncake_helper as h\n",
        dir.display().to_string()
    );
    // The script goes in on stdin: a frame's bytes in hex can outgrow one argument.
    let mut child = Command::new(python)
        .arg("-")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start python");
    let script = format!("{prelude}{driver}");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(script.as_bytes())
        .expect("write the script");
    let out = child.wait_with_output().expect("run python");
    assert!(
        out.status.success(),
        "driver failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout)
        .expect("utf-8")
        .lines()
        .map(str::to_owned)
        .collect()
}

#[test]
fn frames_are_cut_exactly_from_coalesced_and_split_reads() {
    let Some(python) = common::require::python(&[], "the Mooncake helper's framing") else {
        return;
    };
    let big: Vec<u8> = (0..70_000u32).map(|i| (i * 7 + 3) as u8).collect();
    let sent = [
        (1u64, 3u8, b"first".to_vec()),
        (2, 5, Vec::new()),
        (u64::MAX - 4, 1, big.clone()),
        (9, 4, b"\x01tail".to_vec()),
    ];
    // Two frames in one write, then one split mid-head and mid-body (larger than one
    // read), then the last one; the writes are paced so the reads see those pieces.
    let mut bytes = Vec::new();
    for (id, op, body) in &sent {
        bytes.extend(frame(*id, *op, body));
    }
    let a = frame(1, 3, b"first").len() + frame(2, 5, b"").len();
    let cuts = [a, a + 6, a + 13 + 30_000, bytes.len()];
    let pieces: Vec<String> = cuts
        .iter()
        .scan(0, |at, &end| {
            let p = hex(&bytes[*at..end]);
            *at = end;
            Some(format!("bytes.fromhex({p:?})"))
        })
        .collect();
    let driver = format!(
        "import threading, time\n\
         a, b = socket.socketpair()\n\
         def feed():\n\
         \x20   for p in [{}]:\n\
         \x20       a.sendall(p)\n\
         \x20       time.sleep(0.05)\n\
         \x20   a.close()\n\
         threading.Thread(target=feed).start()\n\
         for rid, op, body in h.frames(b):\n\
         \x20   print(rid, op, body.hex())\n\
         print('end')\n",
        pieces.join(", ")
    );
    let lines = run(&python, &driver);
    let want: Vec<String> = sent
        .iter()
        .map(|(id, op, body)| format!("{id} {op} {}", hex(body)))
        .chain(["end".to_string()])
        .collect();
    assert_eq!(lines, want);
}

#[test]
fn a_bad_frame_length_ends_the_stream_and_keys_and_codes_keep_their_bytes() {
    let Some(python) = common::require::python(&[], "the Mooncake helper's framing") else {
        return;
    };
    // A length below the header's own 9 bytes: nothing is yielded, the loop ends.
    let mut bad = 3u32.to_le_bytes().to_vec();
    bad.extend_from_slice(&[0u8; 20]);
    // The daemon's key list: u32 count, keys joined by NUL (after one prefix byte here,
    // as a remove sends its force flag).
    let keys = ["m_00ff_0_k", "m_00ff_1_v", "t\u{e9}_x"];
    let mut list = vec![1u8];
    list.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    list.extend_from_slice(keys.join("\0").as_bytes());
    let driver = format!(
        "a, b = socket.socketpair()\n\
         a.sendall(bytes.fromhex({:?})); a.close()\n\
         print(len(list(h.frames(b))))\n\
         ks = h.parse_keys(bytes.fromhex({:?}), 1)\n\
         print(' '.join(k.hex() for k in ks), all(isinstance(k, bytes) for k in ks))\n\
         try:\n\
         \x20   h.parse_keys(bytes.fromhex({:?}), 0)\n\
         \x20   print('accepted')\n\
         except ValueError:\n\
         \x20   print('refused')\n\
         print(h.results([1, 0, -704, 2**40]).hex())\n",
        hex(&bad),
        hex(&list),
        // Says four keys, holds three.
        hex(&[&4u32.to_le_bytes()[..], keys.join("\0").as_bytes()].concat()),
    );
    let lines = run(&python, &driver);
    let mut codes = 4u32.to_le_bytes().to_vec();
    for c in [1i64, 0, -704, 1 << 40] {
        codes.extend_from_slice(&c.to_le_bytes());
    }
    let want_keys: Vec<String> = keys.iter().map(|k| hex(k.as_bytes())).collect();
    assert_eq!(
        lines,
        [
            "0".to_string(),
            format!("{} True", want_keys.join(" ")),
            "refused".into(),
            hex(&codes),
        ]
    );
}

/// The helper's request loop (`serve`) with a stand-in store whose existence query takes
/// 300 ms, on 2 workers behind a queue of 2: two requests run at once, two wait, a fifth
/// is answered busy at once, a request whose deadline has passed is never run, and a
/// status probe is answered while every worker is busy, saying how many run and wait.
#[test]
fn requests_run_concurrently_behind_a_bounded_queue_and_expired_ones_never_run() {
    let Some(python) = common::require::python(&[], "the Mooncake helper's request loop") else {
        return;
    };
    let driver = r#"
import json, struct, threading, time
class Store:
    calls = 0
    def batch_is_exist(self, keys):
        Store.calls += 1
        time.sleep(0.3)
        return [1] * len(keys)
class State:
    store = Store()
    def ready(self):
        return True, ""
a, b = socket.socketpair()
a.settimeout(30)
threading.Thread(target=h.serve, args=(b, State(), [], 2, 2, 0.0), daemon=True).start()
later = time.monotonic_ns() + 30 * 10**9
keys = struct.pack("<I", 2) + b"k1\0k2"
got, buf = {}, b""
def send(rid, op, body, deadline):
    body = struct.pack("<Q", deadline) + body
    a.sendall(h.HEAD.pack(len(body) + 9, rid, op) + body)
def take(rid):
    global buf
    while rid not in got:
        while len(buf) >= 13 and len(buf) >= 4 + h.HEAD.unpack_from(buf)[0]:
            n, r, st = h.HEAD.unpack_from(buf)
            got[r] = (st, buf[13 : 4 + n], time.monotonic())
            buf = buf[4 + n :]
        if rid not in got:
            buf += a.recv(1 << 16)
    return got[rid]
def status(rid):
    send(rid, h.OP_STATUS, b"", later)
    return json.loads(take(rid)[1])
t = time.monotonic()
send(1, h.OP_EXISTS, keys, later)
send(2, h.OP_EXISTS, keys, later)
probe = 100
while status(probe)["running"] < 2:
    probe += 1
send(3, h.OP_EXISTS, keys, later)
send(4, h.OP_EXISTS, keys, later)
while status(probe)["queued"] < 2:
    probe += 1
send(5, h.OP_EXISTS, keys, later)
print("busy", take(5)[0], take(5)[1].decode())
s = status(probe + 1)
print("status", s["running"], s["queued"], s["busy"])
codes = [take(r)[0] for r in (1, 2, 3, 4)]
print("codes", codes, [take(r)[1] for r in (1, 2, 3, 4)] == [h.results([1, 1])] * 4)
# Two waves of two: the second finished at least one store call after the first.
print("waves", min(got[r][2] for r in (3, 4)) - max(got[r][2] for r in (1, 2)) > 0.2)
# Expired before a worker took it: answered busy, and the store never saw it.
before = Store.calls
send(7, h.OP_EXISTS, keys, time.monotonic_ns())
st, body, _ = take(7)
print("expired", st, Store.calls == before, body.decode())
"#;
    let lines = run(&python, driver);
    assert_eq!(
        lines,
        vec![
            "busy 3 helper busy: 2 requests queued".to_string(),
            "status 2 2 1".to_string(),
            "codes [0, 0, 0, 0] True".to_string(),
            "waves True".to_string(),
            "expired 3 True deadline passed in the helper's queue".to_string(),
        ]
    );
}
