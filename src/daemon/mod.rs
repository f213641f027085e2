//! The per-node daemon (`kvtier serve`): a Unix-socket server in front of a [`Backend`].
//!
//! Shaped after mini-redis: [`server::run`] accepts on a tokio listener until a
//! [`Shutdown`] token (a `CancellationToken`) is cancelled, one [`connection`] task per
//! client, one file per command under `cmd`, the backend's [`upkeep`] as a task woken by
//! the manager, configuration in [`config`], and the CLI entry point in [`cli`].

pub mod backend;
pub mod cli;
mod cmd;
pub mod config;
pub mod connection;
mod engines;
pub mod memory;
pub mod orphans;
pub mod pool_config;
mod pool_watch;
mod recovering;
pub mod server;
pub mod upkeep;

#[cfg(test)]
mod tests;

pub use crate::shutdown::Shutdown;
pub use backend::{Backend, BackendError, ManagedTiers, TiersConfig};
pub use config::{DaemonConfig, EventsEncoding};
pub use connection::{Limits, Shared};
