//! Every page complete on host, for a journal that must rebuild its records from the
//! directory (its event stream lost events).

use super::Manager;
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;

/// The pages complete on host right now, with their namespaces: one pass over the
/// directory under its read lock.
pub fn host_complete_pages(mgr: &Manager) -> Vec<(NamespaceId, PageHash)> {
    let st = mgr.read();
    st.dir
        .pages_in(TierKind::Host)
        .into_iter()
        .filter(|&id| st.dir.is_complete(id, TierKind::Host))
        .map(|id| {
            let info = st.dir.info(id);
            (info.ns, info.hash)
        })
        .collect()
}
