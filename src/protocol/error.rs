//! Error responses: a stable numeric code and a human-readable message.
//!
//! Codes are part of the wire contract (the C ABI exposes them as constants); never
//! renumber, only append.

/// Why the daemon refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    /// The frame body could not be decoded.
    BadFrame = 1,
    /// The frame's protocol version is not spoken here.
    UnsupportedVersion = 2,
    /// The frame is larger than the maximum; the connection is closed.
    FrameTooLarge = 3,
    /// The message kind is unknown, or a response kind was sent as a request.
    UnknownMessage = 4,
    /// The request needs a connected identity; send `Connect` first.
    NotConnected = 5,
    /// Another rank of the instance (or the namespace) has a different layout.
    LayoutMismatch = 6,
    /// The layout or identity is invalid.
    BadLayout = 7,
    /// The grant or ticket is unknown (finished, aborted or never issued).
    UnknownGrant = 8,
    /// The host arena has no room, even after eviction.
    NoSpace = 9,
    /// The hint is malformed.
    BadHint = 10,
    /// The request is well-formed but not valid here (e.g. wrong number of flags).
    BadRequest = 11,
    /// The daemon serves its maximum number of connections.
    TooManyConnections = 12,
    /// The daemon is shutting down.
    ShuttingDown = 13,
    /// A failure inside the daemon.
    Internal = 14,
    /// The daemon is rebuilding its index after a restart (arena, local pool) and serves
    /// nothing yet; retry shortly. Sent unsolicited (request id 0), then the connection is
    /// closed.
    Recovering = 15,
}

impl ErrorCode {
    pub const ALL: [ErrorCode; 15] = [
        ErrorCode::BadFrame,
        ErrorCode::UnsupportedVersion,
        ErrorCode::FrameTooLarge,
        ErrorCode::UnknownMessage,
        ErrorCode::NotConnected,
        ErrorCode::LayoutMismatch,
        ErrorCode::BadLayout,
        ErrorCode::UnknownGrant,
        ErrorCode::NoSpace,
        ErrorCode::BadHint,
        ErrorCode::BadRequest,
        ErrorCode::TooManyConnections,
        ErrorCode::ShuttingDown,
        ErrorCode::Internal,
        ErrorCode::Recovering,
    ];

    pub fn code(self) -> u16 {
        self as u16
    }

    /// The code for a number; unknown numbers (from a newer daemon) map to `Internal`.
    pub fn from_code(code: u16) -> Self {
        Self::ALL
            .iter()
            .copied()
            .find(|c| c.code() == code)
            .unwrap_or(ErrorCode::Internal)
    }

    pub fn name(self) -> &'static str {
        match self {
            ErrorCode::BadFrame => "bad_frame",
            ErrorCode::UnsupportedVersion => "unsupported_version",
            ErrorCode::FrameTooLarge => "frame_too_large",
            ErrorCode::UnknownMessage => "unknown_message",
            ErrorCode::NotConnected => "not_connected",
            ErrorCode::LayoutMismatch => "layout_mismatch",
            ErrorCode::BadLayout => "bad_layout",
            ErrorCode::UnknownGrant => "unknown_grant",
            ErrorCode::NoSpace => "no_space",
            ErrorCode::BadHint => "bad_hint",
            ErrorCode::BadRequest => "bad_request",
            ErrorCode::TooManyConnections => "too_many_connections",
            ErrorCode::ShuttingDown => "shutting_down",
            ErrorCode::Internal => "internal",
            ErrorCode::Recovering => "recovering",
        }
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.name(), self.code())
    }
}

/// An error response as it travels.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{code}: {message}")]
pub struct RemoteError {
    pub code: ErrorCode,
    pub message: String,
}

impl RemoteError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        Self {
            code,
            message: message.into(),
        }
    }
}
