//! `Connect` and `RegisterDevice`: who the rank is, and what its device region holds.
//!
//! Every rank of an instance must name the same namespace and layout; the first rank to
//! connect fixes them for as long as any rank of the instance stays connected.

use crate::layout::LayoutSpec;
use crate::manager::ManagerError;
use crate::protocol::{DeviceInfo, ErrorCode, Identity, Response};

use super::super::backend::BackendError;
use super::super::connection::{Conn, Instance, Rank, Shared};

pub(super) fn connect(shared: &Shared, conn: &mut Conn, identity: Identity, spec: LayoutSpec) -> Response {
    if conn.rank.is_some() {
        return Response::error(ErrorCode::BadRequest, "this connection is already connected");
    }
    if identity.tp_size != spec.tp_size || identity.pp_size != spec.pp_size {
        return Response::error(
            ErrorCode::BadLayout,
            format!(
                "identity says tp_size={} pp_size={}, the layout says {} and {}",
                identity.tp_size, identity.pp_size, spec.tp_size, spec.pp_size
            ),
        );
    }
    if identity.tp_rank >= identity.tp_size || identity.pp_rank >= identity.pp_size {
        return Response::error(ErrorCode::BadLayout, "rank outside tp_size/pp_size");
    }
    if identity.instance.is_empty() || identity.namespace.model.is_empty() {
        return Response::error(ErrorCode::BadLayout, "instance and model must not be empty");
    }
    {
        let mut inst = shared.instances.lock();
        match inst.get_mut(&identity.instance) {
            Some(i) if i.namespace != identity.namespace || i.spec != spec => {
                return Response::error(
                    ErrorCode::LayoutMismatch,
                    format!(
                        "instance {:?} is connected with model {:?} and layout [{}]; this rank gives model {:?} and layout [{}]",
                        identity.instance,
                        i.namespace.model,
                        i.spec.describe(),
                        identity.namespace.model,
                        spec.describe()
                    ),
                );
            }
            Some(i) if i.ranks >= shared.limits.max_ranks => {
                return Response::error(ErrorCode::TooManyConnections, "too many ranks for this instance");
            }
            Some(i) => i.ranks += 1,
            None => {
                inst.insert(
                    identity.instance.clone(),
                    Instance {
                        namespace: identity.namespace.clone(),
                        spec: spec.clone(),
                        ranks: 1,
                    },
                );
            }
        }
    }
    let undo = |shared: &Shared, instance: &str| {
        let mut inst = shared.instances.lock();
        if let Some(i) = inst.get_mut(instance) {
            i.ranks = i.ranks.saturating_sub(1);
            if i.ranks == 0 {
                inst.remove(instance);
            }
        }
    };
    let reg = match shared.backend.register(&identity.namespace, &spec) {
        Ok(r) => r,
        Err(e) => {
            undo(shared, &identity.instance);
            return super::error_response(&e);
        }
    };
    let objects = match reg.layout.rank_objects(identity.tp_rank, identity.pp_rank) {
        Ok(o) => o.into_iter().map(|i| i as u16).collect(),
        Err(e) => {
            undo(shared, &identity.instance);
            return super::error_response(&BackendError::Manager(ManagerError::Config(e.to_string())));
        }
    };
    tracing::info!(
        conn = conn.id,
        instance = %identity.instance,
        model = %identity.namespace.model,
        tp = identity.tp_rank,
        pp = identity.pp_rank,
        "rank connected"
    );
    shared
        .ranks
        .lock()
        .insert(conn.id, (identity.clone(), std::time::Instant::now()));
    conn.rank = Some(Rank {
        identity,
        ns: reg.ns,
        layout: reg.layout,
    });
    Response::Connected {
        connection: conn.id,
        arena: reg.arena,
        objects,
        namespace: reg.ns.0,
    }
}

pub(super) fn register_device(rank: &Rank, d: DeviceInfo) -> Result<Response, BackendError> {
    let parts = rank.layout.rank_parts().len() as u64;
    let want = rank.layout.object_bytes(
        rank.layout
            .rank_objects(rank.identity.tp_rank, rank.identity.pp_rank)
            .map_err(|e| ManagerError::Config(e.to_string()))?
            .first()
            .copied()
            .unwrap_or(rank.identity.pp_rank as usize),
    );
    if d.object_bytes != want {
        return Ok(Response::error(
            ErrorCode::BadLayout,
            format!(
                "device objects are {} bytes, the layout says {want} ({parts} parts)",
                d.object_bytes
            ),
        ));
    }
    tracing::info!(kind = %d.kind, pages = d.pages, object_bytes = d.object_bytes, "device region registered");
    Ok(Response::Ok)
}
