//! kvtier: a per-node KV-cache tier manager for LLM inference engines.
//!
//! The core (this crate's library) knows pages, layouts and tiers: it keeps a directory of
//! which objects of which page are present in which tier, moves pages between an engine's
//! device memory, a shared-memory host arena and a shared pool, executes KV hints and
//! evicts by watermark. The daemon, protocol, client and FFI are thin layers above it.

#[cfg(feature = "daemon")]
pub mod admin;
pub mod affinity;
#[cfg(feature = "daemon")]
pub mod bench;
#[cfg(feature = "daemon")]
pub mod cli;
pub mod client;
pub mod clock;
#[cfg(feature = "daemon")]
pub mod daemon;
pub mod directory;
pub mod events;
pub mod expiry;
pub mod ffi;
pub mod hints;
pub mod layout;
pub mod manager;
pub mod page;
pub mod paths;
pub mod policy;
pub mod pool;
pub mod priority;
pub mod protocol;
#[cfg(feature = "daemon")]
pub mod publish;
#[cfg(feature = "daemon")]
pub mod replay;
pub mod router_hint;
pub mod session;
#[cfg(feature = "daemon")]
pub mod shutdown;
pub mod tier;
pub mod transfer;
pub mod watermarks;
pub mod wire;

pub use layout::{AttentionKind, ByteOrder, Layout, LayoutError, LayoutSpec, ObjectId, Part};
pub use page::{KeyScheme, Namespace, NamespaceId, PageError, PageHash};
pub use tier::TierKind;
