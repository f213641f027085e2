//! Directory calls for a whole batch of a move, so that the manager's reserve does one
//! index probe per page instead of two (see `manager/store_plan.rs`).

use super::{Directory, DirectoryError, PageId};
use crate::page::{NamespaceId, PageHash};
use crate::tier::TierKind;

impl Directory {
    /// Finds a page or creates its empty record, and says whether it was created: one
    /// index probe where `find` followed by `find_or_insert` took two.
    pub fn find_or_insert_fresh(&mut self, ns: NamespaceId, hash: &PageHash) -> Result<(PageId, bool), DirectoryError> {
        self.layout(ns)?;
        match self.find(ns, hash) {
            Some(id) => Ok((id, false)),
            None => self.insert_new(ns, hash).map(|id| (id, true)),
        }
    }

    /// Whether the page has no object present in `tier` and none in flight into it:
    /// every object of its layout is still to be written there, and nothing else is
    /// writing it (the common case of a store or a staging, answered from the record
    /// alone, with no side-table read and no list built).
    pub fn untouched(&self, id: PageId, tier: TierKind) -> bool {
        !self.has_any(id, tier) && !self.is_inflight(id, tier)
    }
}

#[cfg(test)]
mod tests {
    use crate::directory::Directory;
    use crate::layout::LayoutSpec;
    use crate::page::{Namespace, NamespaceId, PageHash};
    use crate::tier::TierKind;

    #[test]
    fn find_or_insert_fresh_says_once_that_it_created_the_record_and_untouched_follows_the_marks() {
        let mut d = Directory::new(1 << 10);
        let ns = d
            .register(Namespace::model("m"), LayoutSpec::mha(2, 1, 64, 2, 16).build().unwrap())
            .unwrap();
        let h = PageHash::from_u64(7);
        let (id, fresh) = d.find_or_insert_fresh(ns, &h).unwrap();
        assert!(fresh);
        assert_eq!(d.find_or_insert_fresh(ns, &h).unwrap(), (id, false));
        assert_eq!(d.find(ns, &h), Some(id));
        assert!(d.find_or_insert_fresh(NamespaceId(9), &h).is_err());
        assert!(d.untouched(id, TierKind::Host));
        d.set_inflight_objects(id, TierKind::Host, &[1], true).unwrap();
        assert!(!d.untouched(id, TierKind::Host));
        d.set_objects(id, TierKind::Host, &[1], true).unwrap();
        d.set_inflight_objects(id, TierKind::Host, &[1], false).unwrap();
        assert!(!d.untouched(id, TierKind::Host), "one object present: partial");
        assert!(d.untouched(id, TierKind::Pool));
        d.set_objects(id, TierKind::Host, &[1], false).unwrap();
        // The page had nothing left anywhere: its record is gone, and a new one is fresh.
        assert_eq!(d.find(ns, &h), None);
        assert!(d.find_or_insert_fresh(ns, &h).unwrap().1);
    }
}
