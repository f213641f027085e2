//! One file per command. [`dispatch`] routes a decoded request to its handler; every
//! handler answers with a response (an error response is still an answer) and never
//! panics on client input. [`blocks`] says which commands the connection task must not
//! run inline: handlers themselves are plain blocking code, and the caller decides where
//! they run.

mod advice;
mod connect;
mod hint;
mod load;
mod lookup;
mod removed;
mod session;
mod stats;
mod store;
mod ticket;
mod tokens;

pub(crate) use lookup::awaited as lookup_awaited;

use crate::directory::DirectoryError;
use crate::manager::ManagerError;
use crate::protocol::{ErrorCode, Request, Response};

use super::backend::BackendError;
use super::connection::{Conn, Rank, Shared};

/// Whether a request may block for longer than a lookup: it waits (a ticket, a load with
/// a wait policy), makes room or stages pages (a store may evict), reads every byte it
/// commits (a commit checksums its pages), does file I/O (connecting a rank may create
/// the arena and start the manifest), may do pool I/O or wait for room in the policy's
/// move queue (a session's phase change or a request's end may demote or stage its pages;
/// a demote hint writes to the pool, a prefetch stages from it, a share queues pool
/// writes, and a hint that names a session walks all of its pages). Pin and retain hints
/// that name pages only mark at most a batch of directory records, like `Removed`, and
/// stay inline. With `remote` discovery (a shared pool in cluster mode),
/// a lookup and a best-effort load may ask the pool over the network, for up to its op
/// timeout, so they leave the connection task too. Everything else is a short call under
/// the manager's locks and runs inline.
pub(crate) fn blocks(req: &Request, remote: bool) -> bool {
    match req {
        Request::Connect { .. }
        | Request::Store { .. }
        | Request::Commit { .. }
        | Request::Wait { .. }
        | Request::Session { .. }
        | Request::RequestEnd { .. }
        | Request::KvHints { .. } => true,
        Request::Hint(h) => hint_blocks(h),
        Request::Load { wait, .. } => remote || *wait != crate::protocol::LoadWait::BestEffort,
        Request::Lookup { .. } => remote,
        Request::RegisterDevice(_)
        | Request::Abort { .. }
        | Request::LoadDone { .. }
        | Request::Poll { .. }
        | Request::Removed { .. }
        | Request::TakeAdvice { .. }
        | Request::Stats
        | Request::Tokens { .. }
        | Request::Fence { .. }
        | Request::LookupTally(_)
        | Request::Ping { .. } => false,
    }
}

/// Whether a blocking command is pool work that takes a place of its own share
/// (`connection::POOL_WORK`): a session phase change, a request end, KvHint envelopes and
/// the hints that may do pool I/O or walk a session's pages.
pub(crate) fn pool_work(req: &Request) -> bool {
    match req {
        Request::Session { .. } | Request::RequestEnd { .. } | Request::KvHints { .. } => true,
        Request::Hint(h) => hint_blocks(h),
        _ => false,
    }
}

/// Whether a hint may do pool I/O or walk a session's pages (see [`blocks`]).
fn hint_blocks(h: &crate::hints::Hint) -> bool {
    use crate::hints::{Hint, HintTarget};
    matches!(h.target(), HintTarget::Session(_))
        || matches!(h, Hint::Share { .. } | Hint::Prefetch { .. } | Hint::Demote { .. })
}

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
        Request::LoadDone { grant, loaded } => load::done(shared, conn, grant, loaded),
        Request::Poll { ticket } => ticket::status(shared, ticket, 0),
        Request::Wait { ticket, timeout_ms } => ticket::status(shared, ticket, timeout_ms),
        Request::Removed { hashes } => removed::removed(shared, conn, &hashes),
        Request::Session { id, parent, phase } => session::session(shared, &id, parent.as_deref(), phase),
        Request::RequestEnd {
            session,
            parent,
            input_length,
            output_length,
            hashes,
        } => session::request_end(
            shared,
            rank(conn)?,
            crate::policy::RequestEnd {
                session_id: session,
                parent_session_id: parent,
                ns: crate::page::NamespaceId(0),
                input_length,
                output_length,
                hashes,
            },
        ),
        Request::Hint(h) => hint::hint(shared, rank(conn)?, &h),
        Request::TakeAdvice { max_pages } => Ok(advice::take_advice(shared, rank(conn)?, max_pages)),
        Request::Tokens { parent, hashes, tokens } => tokens::tokens(shared, rank(conn)?, parent, &hashes, &tokens),
        Request::KvHints { envelope } => hint::kv_hints(shared, rank(conn)?, &envelope),
        Request::Fence { token, done } => {
            shared.backend.fence_engine(conn.id, token, done);
            Ok(Response::Ok)
        }
        Request::LookupTally(t) => {
            rank(conn)?;
            if let Err(why) = t.check(crate::protocol::MAX_PAGES as u64) {
                return Ok(Response::error(ErrorCode::BadRequest, why));
            }
            shared.backend.lookups_tallied(&t);
            Ok(Response::Ok)
        }
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
        BackendError::Manager(m) => match m {
            ManagerError::Directory(DirectoryError::LayoutMismatch { .. }) => ErrorCode::LayoutMismatch,
            ManagerError::Directory(DirectoryError::Full(_)) | ManagerError::Busy => ErrorCode::NoSpace,
            ManagerError::Config(_) | ManagerError::SlotTooSmall { .. } | ManagerError::ObjectSize { .. } => {
                ErrorCode::BadLayout
            }
            ManagerError::UnknownGrant(_) => ErrorCode::UnknownGrant,
            ManagerError::Hint(_) => ErrorCode::BadHint,
            ManagerError::Directory(_)
            | ManagerError::Page(_)
            | ManagerError::BatchTooLarge { .. }
            | ManagerError::StoreTooLarge { .. }
            | ManagerError::LengthMismatch { .. }
            | ManagerError::GrantMismatch { .. }
            | ManagerError::NoDevice { .. }
            | ManagerError::NoNamespace
            | ManagerError::Session(_)
            | ManagerError::Policy(_) => ErrorCode::BadRequest,
            ManagerError::Arena(_)
            | ManagerError::Device(_)
            | ManagerError::Pool(_)
            | ManagerError::Mooncake(_)
            | ManagerError::Ticket(_) => ErrorCode::Internal,
        },
        BackendError::Hint(_) => ErrorCode::BadHint,
        BackendError::UnknownGrant(_) => ErrorCode::UnknownGrant,
        BackendError::FlagCount { .. } => ErrorCode::BadRequest,
        BackendError::SlotTooSmall { .. } => ErrorCode::BadLayout,
        BackendError::NoSpace => ErrorCode::NoSpace,
        BackendError::Manifest { .. } | BackendError::Private(_) => ErrorCode::Internal,
    };
    Response::error(code, e.to_string())
}

#[cfg(test)]
mod tests {
    use super::blocks;
    use crate::page::PageHash;
    use crate::protocol::{LoadWait, Request};

    #[test]
    fn lookups_and_best_effort_loads_leave_the_connection_task_only_with_remote_discovery() {
        let hashes = vec![PageHash::from_u64(1)];
        let lookup = Request::Lookup { hashes: hashes.clone() };
        let best_effort = Request::Load {
            hashes: hashes.clone(),
            wait: LoadWait::BestEffort,
        };
        let ping = Request::Ping { payload: Vec::new() };
        assert_eq!(
            [
                blocks(&lookup, false),
                blocks(&best_effort, false),
                blocks(&ping, false)
            ],
            [false, false, false]
        );
        assert_eq!(
            [blocks(&lookup, true), blocks(&best_effort, true), blocks(&ping, true)],
            [true, true, false]
        );
        let waiting = Request::Load {
            hashes: hashes.clone(),
            wait: LoadWait::WaitComplete,
        };
        assert!(blocks(&waiting, false));
    }

    /// Anything that may do pool I/O or wait for the move queue leaves the connection
    /// task, whatever the discovery mode: a phase change, a request's end, a hint that
    /// moves pages or names a session. Pin and retain on named pages stay inline.
    #[test]
    fn sessions_request_ends_and_moving_hints_leave_the_connection_task() {
        use crate::hints::{Hint, HintTarget};
        use crate::protocol::SessionPhase;
        use crate::tier::TierKind;
        let target = || HintTarget::Pages(vec![PageHash::from_u64(1)]);
        let reqs = [
            Request::Session {
                id: "s".into(),
                parent: None,
                phase: SessionPhase::Acting,
            },
            Request::RequestEnd {
                session: "s".into(),
                parent: None,
                input_length: 1,
                output_length: 1,
                hashes: vec![PageHash::from_u64(1)],
            },
            Request::Hint(Hint::Retain {
                target: HintTarget::Session("s".into()),
                priority: 1,
                ttl_ms: 1,
            }),
            Request::Hint(Hint::Demote {
                target: target(),
                to: TierKind::Pool,
            }),
            Request::Hint(Hint::Share { target: target() }),
            Request::Hint(Hint::Prefetch {
                target: target(),
                to: TierKind::Host,
                deadline_ms: None,
            }),
        ];
        for r in &reqs {
            assert!(blocks(r, false), "{r:?}");
        }
        let inline = [
            Request::Hint(Hint::Pin {
                target: target(),
                tier: TierKind::Host,
                ttl_ms: 1,
            }),
            Request::Hint(Hint::Retain {
                target: target(),
                priority: 1,
                ttl_ms: 1,
            }),
            Request::TakeAdvice { max_pages: 1 },
        ];
        for r in &inline {
            assert!(!blocks(r, false), "{r:?}");
        }
    }
}
