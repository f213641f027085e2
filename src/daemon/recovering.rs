//! While the daemon opens its tiers (the arena's and the local pool's index rebuilt from
//! their manifests), its control socket is already bound and answers: each connection
//! gets one `recovering` error frame (request id 0, as any unsolicited notice) and is
//! closed, so an engine sees a typed "retry shortly" instead of "connection refused".

use std::io::{Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use tokio_util::codec::Encoder;

use crate::protocol::{ErrorCode, FrameCodec, Outgoing, Response};

/// How often the accept loop looks for a connection (and whether to stop).
const POLL: Duration = Duration::from_millis(5);
/// Connections answered at once; one more is closed unanswered.
const MAX_ANSWERING: usize = 64;
/// How long an answered connection is read and drained before it is closed, so the
/// client's request write never meets a closed socket before it reads the answer.
const DRAIN: Duration = Duration::from_secs(1);

/// The answering thread; [`Recovering::finish`] stops it and leaves the listener to the server.
pub struct Recovering {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

/// Starts answering `recovering` on `listener` (a clone of it: the server takes the same
/// socket afterwards).
pub fn answer(listener: &UnixListener) -> std::io::Result<Recovering> {
    let listener = listener.try_clone()?;
    listener.set_nonblocking(true)?;
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let thread = std::thread::Builder::new()
        .name("kvtier-recovering".into())
        .spawn(move || accept_loop(&listener, &s))?;
    Ok(Recovering {
        stop,
        thread: Some(thread),
    })
}

impl Recovering {
    /// Stops answering; connections from now on wait in the backlog for the server.
    pub fn finish(mut self) {
        self.stop_now();
    }

    fn stop_now(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Recovering {
    fn drop(&mut self) {
        self.stop_now();
    }
}

fn accept_loop(listener: &UnixListener, stop: &AtomicBool) {
    let answering = Arc::new(AtomicUsize::new(0));
    let mut told = 0u64;
    while !stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                if answering.fetch_add(1, Ordering::AcqRel) >= MAX_ANSWERING {
                    answering.fetch_sub(1, Ordering::AcqRel);
                    continue;
                }
                told += 1;
                let n = answering.clone();
                let spawned = std::thread::Builder::new()
                    .name("kvtier-recovering-answer".into())
                    .spawn(move || {
                        tell(stream);
                        n.fetch_sub(1, Ordering::AcqRel);
                    });
                if spawned.is_err() {
                    answering.fetch_sub(1, Ordering::AcqRel);
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => std::thread::sleep(POLL),
            Err(_) => std::thread::sleep(POLL),
        }
    }
    if told > 0 {
        tracing::info!(connections = told, "answered 'recovering' while the index was rebuilt");
    }
}

/// Writes the `recovering` frame, then reads until the client closes or [`DRAIN`] passes.
fn tell(mut stream: UnixStream) {
    let notice = Response::error(
        ErrorCode::Recovering,
        "the daemon is rebuilding its index after a restart; retry shortly",
    );
    let mut out = bytes::BytesMut::new();
    if FrameCodec::new(0)
        .encode(Outgoing::Response(0, &notice), &mut out)
        .is_err()
    {
        return;
    }
    if stream.set_nonblocking(false).is_err()
        || stream.set_write_timeout(Some(DRAIN)).is_err()
        || stream.write_all(&out).is_err()
    {
        return;
    }
    let end = Instant::now() + DRAIN;
    let mut sink = [0u8; 4096];
    loop {
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return;
        }
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
    }
}
