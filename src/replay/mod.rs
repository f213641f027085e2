//! `kvtier replay`: replays request traces or generated agentic sessions against the real
//! policy code and compares policies with two bounds.
//!
//! [`workload`] reads the Mooncake trace format and kvtier's own request traces,
//! [`generate`] makes agentic sessions, [`engine`] emulates an engine with a device, a
//! host tier and optionally a pool over the page directory, [`bounds`] computes the
//! infinite-cache and Belady hits, [`report`] turns runs into the figures `--json` prints
//! and [`plot`] draws a capacity sweep. [`cli`] is the subcommand.

pub mod bounds;
pub mod cli;
pub mod engine;
pub mod export;
pub mod generate;
pub mod plot;
pub mod report;
pub mod workload;

pub use engine::{Capacity, CostModel, EngineConfig, PolicyKind};
pub use report::{Report, replay};
pub use workload::Workload;

/// Why a replay failed.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("reading the workload: {0}")]
    Io(#[from] std::io::Error),
    #[error("workload line {line}: {what}")]
    Input { line: usize, what: String },
    #[error(transparent)]
    Trace(#[from] crate::session::trace::TraceError),
    #[error(transparent)]
    Directory(#[from] crate::directory::DirectoryError),
    #[error(transparent)]
    Layout(#[from] crate::layout::LayoutError),
    #[error(transparent)]
    Session(#[from] crate::session::SessionError),
    #[error(transparent)]
    Policy(#[from] crate::policy::PolicyError),
    #[error("invalid replay settings: {0}")]
    Config(String),
    #[error("drawing the plot: {0}")]
    Plot(String),
}
