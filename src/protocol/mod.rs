//! The control protocol between engine ranks and the daemon.
//!
//! Length-prefixed binary frames over a Unix socket ([`frame`]): a fixed 16-byte header
//! with magic, version, message kind, body length and request id, then a body written
//! with a small hand-written codec ([`codec`]: little-endian integers, length-prefixed
//! strings and arrays with caps). The daemon reads and writes frames through a
//! `tokio-util` codec over `bytes` ([`frame_codec`]); the blocking client uses
//! [`read_frame`] on std I/O, and both check headers with the same [`Header::decode`]. Nothing on the wire is a serde encoding of a Rust enum,
//! so the C ABI can speak the same bytes. Bulk KV data never travels here: requests carry
//! page hashes and arena slot numbers only.

pub mod codec;
pub mod error;
pub mod frame;
#[cfg(feature = "daemon")]
pub mod frame_codec;
mod hint;
pub mod message;
mod response;
pub mod types;

#[cfg(test)]
mod tests;

pub use crate::wire::{MAX_SESSION_ADVICE, PrefixHit};
pub use codec::DecodeError;
pub use error::{ErrorCode, RemoteError};
pub use frame::{DEFAULT_MAX_BODY, FrameError, HEADER_BYTES, Header, read_frame};
#[cfg(feature = "daemon")]
pub use frame_codec::{Frame, FrameCodec, Outgoing};
pub use message::{MAX_ENVELOPE, MAX_PAGE_TOKENS, Request, Response, kind};
pub use types::{
    AdviceBatch, AdviceKind, ArenaInfo, DaemonStats, DeviceInfo, EngineAdvice, GrantPage, Identity, LoadWait,
    MAX_ADVICE, MAX_PAGES, MAX_STR, ObjectSlot, SessionPhase, TicketStatus,
};
