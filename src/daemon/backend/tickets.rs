//! Tickets of committed stores, and the commit generation that waits sleep on.
//!
//! A ticket names the pages of one committed store request. It is bounded: past
//! `MAX_TICKETS` the oldest are forgotten (asking for one then is `unknown_grant`).

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::page::{NamespaceId, PageHash};

const MAX_TICKETS: usize = 65_536;
/// Most pages the kept tickets name together: a ticket keeps its request's hashes, and a
/// request may name thousands, so a count alone would let 65,536 large tickets hold
/// gigabytes. Past it the oldest are forgotten, as past [`MAX_TICKETS`].
const MAX_TICKET_PAGES: usize = 1 << 20;

#[derive(Default)]
struct Book {
    pages: HashMap<u64, (NamespaceId, Vec<PageHash>)>,
    order: VecDeque<u64>,
    /// Pages the kept tickets name.
    held: usize,
}

#[derive(Default)]
pub(super) struct Tickets {
    book: Mutex<Book>,
    /// Bumped on every commit or abort; waiters sleep on it.
    generation: Mutex<u64>,
    changed: Condvar,
}

impl Tickets {
    pub fn insert(&self, ticket: u64, ns: NamespaceId, hashes: Vec<PageHash>) {
        let mut b = self.book.lock();
        b.held += hashes.len();
        if let Some((_, was)) = b.pages.insert(ticket, (ns, hashes)) {
            b.held -= was.len();
        }
        b.order.push_back(ticket);
        while b.order.len() > MAX_TICKETS || (b.held > MAX_TICKET_PAGES && b.order.len() > 1) {
            let Some(old) = b.order.pop_front() else { break };
            if let Some((_, gone)) = b.pages.remove(&old) {
                b.held -= gone.len();
            }
        }
    }

    pub fn get(&self, ticket: u64) -> Option<(NamespaceId, Vec<PageHash>)> {
        self.book.lock().pages.get(&ticket).cloned()
    }

    /// Wakes every waiter: something was committed or aborted.
    pub fn bump(&self) {
        *self.generation.lock() += 1;
        self.changed.notify_all();
    }

    /// Sleeps until the next bump or `deadline`; false when the deadline passed first.
    pub fn wait_change(&self, deadline: Instant) -> bool {
        let mut g = self.generation.lock();
        let seen = *g;
        while *g == seen {
            if self.changed.wait_until(&mut g, deadline).timed_out() {
                return false;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_tickets_are_bounded_by_the_pages_they_name_oldest_first() {
        let t = Tickets::default();
        let pages = |n: usize| vec![PageHash::from_u64(1); n];
        let ns = NamespaceId(0);
        t.insert(1, ns, pages(MAX_TICKET_PAGES / 2));
        t.insert(2, ns, pages(MAX_TICKET_PAGES / 2));
        assert!(t.get(1).is_some() && t.get(2).is_some(), "at the bound, both kept");
        t.insert(3, ns, pages(1));
        assert!(t.get(1).is_none(), "past it, the oldest goes");
        assert_eq!(t.get(2).map(|(_, h)| h.len()), Some(MAX_TICKET_PAGES / 2));
        assert!(t.get(3).is_some());
        // A ticket larger than the bound alone is kept, alone.
        t.insert(4, ns, pages(MAX_TICKET_PAGES + 1));
        assert!(t.get(2).is_none() && t.get(3).is_none() && t.get(4).is_some());
        assert_eq!(t.book.lock().held, MAX_TICKET_PAGES + 1);
    }
}
