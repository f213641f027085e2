//! `/v1/events` and `/v1/sessions/events`: page events, or the pressure controller's
//! session pauses and resumes, streamed as JSON lines in a chunked response.
//!
//! A producer task reads the manager's event log (a blocking read with a short wait, on
//! the blocking pool) and hands chunks to hyper through a bounded channel. It ends when
//! `limit` events were sent, the server is cancelled, the client went away (the body was
//! dropped) or the client stopped reading: a chunk that cannot be queued within the
//! write timeout ends the stream instead of piling events up in memory.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame};
use serde_json::json;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::api::Source;
use super::deadline::Deadline;
use super::state::AdminState;

/// Events read from the log per chunk of the stream, and how long one read waits (so
/// cancellation is seen within it).
const EVENTS_PER_READ: usize = 512;
const EVENTS_WAIT: Duration = Duration::from_millis(200);
/// Chunks queued between the producer and hyper.
const QUEUE_CHUNKS: usize = 4;

/// A response body fed by a bounded channel of chunks; it ends when the sender is gone.
pub(crate) struct EventBody {
    rx: mpsc::Receiver<Bytes>,
}

impl Body for EventBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.rx.poll_recv(cx).map(|c| c.map(|b| Ok(Frame::data(b))))
    }
}

/// One read of either log, as JSON lines.
struct Read {
    lines: Vec<u8>,
    events: u64,
    next: u64,
}

fn read(state: &AdminState, source: Source, next: u64, want: usize) -> Read {
    let mut lines = Vec::new();
    let (events, next) = match source {
        Source::Pages => {
            let b = state.manager.pages().events().read_from(next, want, EVENTS_WAIT);
            lines.reserve(96 * (b.events.len() + 1));
            if b.lost > 0 {
                json_line(&mut lines, &json!({ "lost": b.lost }));
            }
            b.events.iter().for_each(|ev| json_line(&mut lines, ev));
            (b.events.len(), b.next)
        }
        Source::Sessions => {
            let b = state
                .manager
                .session_policy()
                .events()
                .read_from(next, want, EVENTS_WAIT);
            if b.lost > 0 {
                json_line(&mut lines, &json!({ "lost": b.lost }));
            }
            b.events.iter().for_each(|ev| json_line(&mut lines, ev));
            (b.events.len(), b.next)
        }
    };
    Read {
        lines,
        events: events as u64,
        next,
    }
}

/// What one stream needs: where to read, from which sequence, how many, and when to stop.
pub(crate) struct Stream {
    pub state: Arc<AdminState>,
    pub source: Source,
    pub from: u64,
    pub limit: u64,
    pub cancel: CancellationToken,
    /// The connection's deadline, re-armed when the stream ends so writing its last
    /// chunk is bounded like any answer.
    pub deadline: Arc<Deadline>,
}

impl Stream {
    /// Starts the producer on `tracker` and returns the body hyper sends.
    pub fn start(self, tracker: &tokio_util::task::TaskTracker) -> EventBody {
        let (tx, rx) = mpsc::channel(QUEUE_CHUNKS);
        tracker.spawn(async move {
            let timeout = self.state.cfg.read_timeout;
            let deadline = self.deadline.clone();
            self.produce(tx).await;
            deadline.extend(timeout);
        });
        EventBody { rx }
    }

    async fn produce(self, tx: mpsc::Sender<Bytes>) {
        let write_timeout = self.state.cfg.read_timeout;
        let mut next = self.from.max(1);
        let mut sent = 0u64;
        while sent < self.limit && !self.cancel.is_cancelled() && !tx.is_closed() {
            let want = (self.limit - sent).min(EVENTS_PER_READ as u64) as usize;
            let (st, source) = (self.state.clone(), self.source);
            let read = tokio::task::spawn_blocking(move || {
                let _blocking = crate::pool::io_guard::allow_blocking();
                read(&st, source, next, want)
            });
            let Ok(Read { lines, events, next: n }) = read.await else {
                return;
            };
            next = n;
            sent += events;
            if lines.is_empty() {
                continue;
            }
            match tokio::time::timeout(write_timeout, tx.send(Bytes::from(lines))).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) => return,
                Err(_) => {
                    tracing::info!("admin: an event stream's client stopped reading; ended");
                    return;
                }
            }
        }
    }
}

fn json_line(out: &mut Vec<u8>, v: &impl serde::Serialize) {
    // Serializing these plain structs into a Vec cannot fail; a failure would only
    // drop the line.
    if serde_json::to_writer(&mut *out, v).is_ok() {
        out.push(b'\n');
    }
}
