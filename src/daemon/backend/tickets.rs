//! Tickets of committed stores, and the commit generation that waits sleep on.
//!
//! A ticket names the pages of one committed store request. It is bounded: past
//! `MAX_TICKETS` the oldest are forgotten (asking for one then is `unknown_grant`).

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

use crate::page::{NamespaceId, PageHash};

const MAX_TICKETS: usize = 65_536;

#[derive(Default)]
struct Book {
    pages: HashMap<u64, (NamespaceId, Vec<PageHash>)>,
    order: VecDeque<u64>,
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
        b.pages.insert(ticket, (ns, hashes));
        b.order.push_back(ticket);
        while b.order.len() > MAX_TICKETS {
            if let Some(old) = b.order.pop_front() {
                b.pages.remove(&old);
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
