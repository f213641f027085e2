//! The admin socket: HTTP/1.1 over a Unix domain socket, for operators and scripts
//! (`curl --unix-socket <path> http://kvtier/v1/status`), served by hyper on tokio.
//!
//! It owns the socket's security (mode, directory, peer credentials: [`security`]), the
//! accept loop and connection cap ([`server`]), each connection's deadlines and limits
//! (`conn`), the endpoints ([`routes`]) over a decoded [`request::Request`], the event
//! stream (`events`) and the Prometheus rendering ([`metrics`]). It reads the
//! [`Manager`](crate::manager::Manager) and never reaches into the directory; what it
//! knows of connected engines comes through [`EngineView`], which the daemon implements.

//!
//! The modules form a tree, each importing only those below it:
//!
//! ```text
//! server ─► conn ─► routes ─► kv_hints, session_routes, metrics
//!   │         ├───► events ─┐
//!   │         ├───► readers │
//!   ▼         ▼             ▼
//! security   request, api (answers and errors), deadline, state ─► config
//! ```

mod api;
mod config;
mod conn;
mod deadline;
mod events;
mod kv_hints;
pub mod metrics;
mod readers;
pub mod request;
pub mod routes;
pub mod security;
pub mod server;
mod session_routes;
mod state;

pub use config::{
    AdminConfig, AdminError, EngineInfo, EngineView, HostKeep, MemoryReport, NoEngines, SessionInfo,
    default_socket_path,
};
pub use server::{AdminHandle, serve, spawn};
pub use state::AdminState;
