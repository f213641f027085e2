//! Every page complete on host, for a journal that must rebuild its records from the
//! directory (its event stream lost events); and the pages of a load grant that a late
//! copy may have hit, which the daemon drops from host (`daemon::backend::fence`).

use super::Manager;
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;
use crate::tier::host::SlotId;

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

/// A page of a load grant: its namespace, hash, and the (object, slot) pairs granted.
pub type GrantedPage = (NamespaceId, PageHash, Vec<(usize, SlotId)>);

/// The pages of open load grant `id` from its `from`th on (none when it has no more, or
/// is no open grant).
pub fn load_grant_pages(mgr: &Manager, id: u64, from: usize) -> Vec<GrantedPage> {
    let pages: Vec<_> = {
        let gt = mgr.grants();
        match gt.grants.get(&id) {
            Some(g) if g.pages.len() > from => g.pages[from..].iter().map(|p| (p.page, p.objects.clone())).collect(),
            _ => return Vec::new(),
        }
    };
    // The grant's leases keep each page's record until the grant finishes.
    let st = mgr.read();
    pages
        .into_iter()
        .map(|(page, objects)| {
            let info = st.dir.info(page);
            (info.ns, info.hash, objects)
        })
        .collect()
}

/// Drops the host copy of `page` (its slots freed, its directory entry no longer crediting
/// host) when it still sits in the slots named, `bad` still says so of them (asked under
/// the directory lock), no grant leases it and no copy into host is in flight. Returns
/// whether it did.
pub fn drop_host_copy(mgr: &Manager, page: &GrantedPage, bad: impl Fn(&[(usize, SlotId)]) -> bool) -> bool {
    let (ns, hash, objects) = page;
    let mut st = mgr.write();
    let gt = mgr.grants();
    let Some(id) = st.dir.find(*ns, hash) else { return false };
    let same = st
        .host_slots(id)
        .is_some_and(|s| objects.iter().all(|&(o, slot)| s.get(o) == Some(&slot.0)));
    if !same || gt.leased(id) || st.dir.is_inflight(id, TierKind::Host) || !bad(objects) {
        return false;
    }
    mgr.mover().drop_host_page(&mut st, id);
    true
}
