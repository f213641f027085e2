//! One file per command. [`dispatch`] routes a decoded request to its handler; every
//! handler answers with a response (an error response is still an answer) and never
//! panics on client input.

mod connect;
mod hint;
mod load;
mod lookup;
mod removed;
mod session;
mod stats;
mod store;
mod ticket;

use crate::directory::DirectoryError;
use crate::protocol::{ErrorCode, Request, Response};

use super::backend::BackendError;
use super::connection::{Conn, Rank, Shared};

pub(crate) fn dispatch(shared: &Shared, conn: &mut Conn, req: Request) -> Response {
    match req {
        Request::Connect { identity, layout } => connect::connect(shared, conn, identity, layout),
        Request::Ping { payload } => Response::Pong { payload },
        Request::Stats => stats::stats(shared),
        other => {
            if conn.rank.is_none() {
                return Response::error(ErrorCode::NotConnected, "send Connect first");
            }
            run(shared, conn, other).unwrap_or_else(|e| error_response(&e))
        }
    }
}

fn run(shared: &Shared, conn: &mut Conn, req: Request) -> Result<Response, BackendError> {
    match req {
        Request::RegisterDevice(d) => connect::register_device(rank(conn)?, d),
        Request::Lookup { hashes } => lookup::lookup(shared, rank(conn)?, &hashes),
        Request::Store { hashes, session } => store::store(shared, conn, &hashes, &session),
        Request::Commit { grant, written } => store::commit(shared, conn, grant, &written),
        Request::Abort { grant } => store::abort(shared, conn, grant),
        Request::Load { hashes, wait } => load::load(shared, conn, &hashes, wait),
        Request::LoadDone { grant } => load::done(shared, conn, grant),
        Request::Poll { ticket } => ticket::status(shared, ticket, 0),
        Request::Wait { ticket, timeout_ms } => ticket::status(shared, ticket, timeout_ms),
        Request::Removed { hashes } => removed::removed(shared, rank(conn)?, &hashes),
        Request::Session { id, parent, phase } => session::session(shared, &id, parent.as_deref(), phase),
        Request::Hint(h) => hint::hint(shared, rank(conn)?, &h),
        Request::Connect { .. } | Request::Ping { .. } | Request::Stats => unreachable_request(),
    }
}

fn unreachable_request() -> Result<Response, BackendError> {
    Ok(Response::error(ErrorCode::Internal, "request routed twice"))
}

/// The rank a command runs for (`dispatch` has checked that there is one).
pub(crate) fn rank(conn: &Conn) -> Result<&Rank, BackendError> {
    conn.rank.as_ref().ok_or(BackendError::UnknownGrant(0))
}

/// The stable error code of a backend failure.
pub(crate) fn error_response(e: &BackendError) -> Response {
    let code = match e {
        BackendError::Layout(_) | BackendError::ObjectTooLarge { .. } => ErrorCode::BadLayout,
        BackendError::Directory(DirectoryError::LayoutMismatch(_)) => ErrorCode::LayoutMismatch,
        BackendError::Directory(DirectoryError::Full(_)) => ErrorCode::NoSpace,
        BackendError::Directory(_) => ErrorCode::BadRequest,
        BackendError::UnknownGrant(_) => ErrorCode::UnknownGrant,
        BackendError::FlagCount { .. } => ErrorCode::BadRequest,
        BackendError::NoSpace | BackendError::TooManyGrants(_) => ErrorCode::NoSpace,
        BackendError::Arena(_) | BackendError::Manifest { .. } => ErrorCode::Internal,
    };
    Response::error(code, e.to_string())
}
