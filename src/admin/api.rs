//! What the admin endpoints answer: a [`Reply`], or an [`ApiError`] with its status and
//! stable code, and which event log a stream reads ([`Source`]).

use serde_json::{Value, json};

use crate::manager::ManagerError;

/// What to answer.
#[derive(Debug)]
pub(crate) enum Reply {
    /// A JSON document with its status.
    Json(u16, Value),
    /// Text with its content type (the Prometheus exposition).
    Text(u16, &'static str, String),
    /// The live event stream of `source` from sequence `from`, at most `limit` events.
    Events { source: Source, from: u64, limit: u64 },
}

/// An error answer: status, stable code, message.
#[derive(Debug)]
pub(crate) struct ApiError {
    status: u16,
    code: &'static str,
    message: String,
}

impl ApiError {
    pub(crate) fn new(status: u16, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code,
            message: message.into(),
        }
    }

    pub(crate) fn status(&self) -> u16 {
        self.status
    }

    /// The answer `{"code": …, "message": …}` with this error's status.
    pub(crate) fn reply(self) -> Reply {
        let (status, v) = self.into_json();
        Reply::Json(status, v)
    }

    pub(crate) fn into_json(self) -> (u16, Value) {
        (self.status, json!({ "code": self.code, "message": self.message }))
    }
}

impl From<ManagerError> for ApiError {
    fn from(e: ManagerError) -> Self {
        let (status, code) = match &e {
            ManagerError::Hint(_) => (400, "malformed_hint"),
            ManagerError::Directory(_) => (404, "unknown_namespace"),
            ManagerError::Page(_) => (400, "bad_hash"),
            ManagerError::Config(_) => (422, "invalid_config"),
            ManagerError::BatchTooLarge { .. } => (413, "batch_too_large"),
            ManagerError::Busy => (503, "busy"),
            ManagerError::NoNamespace => (404, "no_namespace"),
            ManagerError::Session(_) | ManagerError::Policy(_) => (400, "bad_session"),
            _ => (500, "internal"),
        };
        ApiError::new(status, code, e.to_string())
    }
}

/// Which log a stream reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// The page event log (`/v1/events`).
    Pages,
    /// The session event log (`/v1/sessions/events`): read from a position, so it takes
    /// nothing from the advice queues engines and `/v1/sessions/advice` consume.
    Sessions,
}
