//! What every connection of one admin server shares.

use std::sync::Arc;
use std::time::Instant;

use super::config::{AdminConfig, AdminError, EngineView};
use crate::manager::Manager;

/// What every connection of one admin server shares: its settings, the manager it reads
/// and the daemon's view of engines and sessions.
pub struct AdminState {
    pub(crate) cfg: AdminConfig,
    pub(crate) manager: Manager,
    pub(crate) engines: Arc<dyn EngineView>,
    pub(crate) started: Instant,
}

impl AdminState {
    /// The state of a server with these settings; fails when they are invalid.
    pub fn new(cfg: AdminConfig, manager: Manager, engines: Arc<dyn EngineView>) -> Result<Self, AdminError> {
        cfg.validate()?;
        Ok(Self {
            cfg,
            manager,
            engines,
            started: Instant::now(),
        })
    }

    pub fn config(&self) -> &AdminConfig {
        &self.cfg
    }
}
