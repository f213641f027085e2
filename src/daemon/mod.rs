//! The per-node daemon (`kvtier serve`): a Unix-socket server in front of a [`Backend`].
//!
//! Shaped after mini-redis: [`server::run`] accepts on a listener until a [`Shutdown`]
//! fires, one [`connection`] handler (a thread) per client, one file per command under
//! `cmd`, configuration in [`config`], and the CLI entry point in [`cli`].

pub mod backend;
pub mod cli;
mod cmd;
pub mod config;
pub mod connection;
pub mod server;
pub mod shutdown;

pub use backend::{Backend, BackendError, ManagedTiers, TiersConfig};
pub use config::DaemonConfig;
pub use connection::{Limits, Shared};
pub use shutdown::Shutdown;
