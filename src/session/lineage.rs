//! Session lineage: a radix tree over page-hash chains.
//!
//! Every session's current chain (the page hashes of its context, in order) is a path from
//! the root. A node is one page; it counts how many chains ever passed through it (`uses`),
//! how many distinct sessions did (`sessions`; both are history that survives the sessions)
//! and how many live sessions pass through it now (`live`). From that the policy learns which pages are shared prefixes, which session a
//! new request continues (its chain extends that session's chain) and how much of a
//! parent's prefix a child (a subagent) needs again.
//!
//! The tree is bounded: past `max_nodes` nodes a chain is inserted only as far as it fits,
//! and the insert says how far that was.

use std::collections::HashMap;

use crate::page::PageHash;

const ROOT: u32 = 0;

#[derive(Clone, Debug, Default)]
struct Node {
    /// Chains that ever passed through this page (saturating).
    uses: u32,
    /// Distinct sessions that ever passed through this page (saturating).
    sessions: u32,
    /// Live sessions whose current chain passes through this page.
    live: u32,
    /// Live sessions whose current chain ends exactly here.
    ends: Vec<u32>,
    /// The session that last passed through (0: none).
    last_user: u32,
}

/// What the tree knows of one page of a chain.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PageStats {
    /// Chains that ever passed through the page.
    pub uses: u32,
    /// Distinct sessions that ever did: 2 or more means a prefix shared across sessions.
    pub sessions: u32,
    /// Live sessions whose current chain holds the page.
    pub live: u32,
}

/// How a chain matches the tree.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixMatch {
    /// Leading pages of the chain already in the tree.
    pub shared: usize,
    /// The live session whose whole current chain is the longest prefix of the query, with
    /// that prefix's length: the query continues this session.
    pub extends: Option<(u32, usize)>,
    /// The session that most recently passed through the deepest shared page (a parent
    /// candidate; it may have ended since).
    pub deepest_sharer: Option<u32>,
}

/// The lineage radix tree.
#[derive(Debug)]
pub struct Lineage {
    nodes: Vec<Node>,
    edges: HashMap<(u32, PageHash), u32>,
    chains: HashMap<u32, Vec<u32>>,
    max_nodes: usize,
}

impl Lineage {
    /// A tree of at most `max_nodes` pages.
    pub fn new(max_nodes: usize) -> Self {
        Self {
            nodes: vec![Node::default()],
            edges: HashMap::new(),
            chains: HashMap::new(),
            max_nodes,
        }
    }

    /// Pages in the tree.
    pub fn len(&self) -> usize {
        self.nodes.len() - 1
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn walk(&self, chain: &[PageHash]) -> Vec<u32> {
        let mut path = Vec::with_capacity(chain.len());
        let mut at = ROOT;
        for h in chain {
            match self.edges.get(&(at, *h)) {
                Some(&n) => {
                    path.push(n);
                    at = n;
                }
                None => break,
            }
        }
        path
    }

    /// Makes `chain` the session's current chain (a session's chain grows turn by turn, or a
    /// subagent starts from its parent's prefix). Returns how many pages were inserted;
    /// fewer than `chain.len()` only when the tree is full.
    pub fn insert(&mut self, session: u32, chain: &[PageHash]) -> usize {
        let old = self.release(session);
        let mut path = Vec::with_capacity(chain.len());
        let mut at = ROOT;
        for h in chain {
            let next = match self.edges.get(&(at, *h)) {
                Some(&n) => n,
                None => {
                    if self.len() >= self.max_nodes {
                        break;
                    }
                    self.nodes.push(Node::default());
                    let n = self.nodes.len() as u32 - 1;
                    self.edges.insert((at, *h), n);
                    n
                }
            };
            let node = &mut self.nodes[next as usize];
            node.uses = node.uses.saturating_add(1);
            if old.get(path.len()) != Some(&next) {
                node.sessions = node.sessions.saturating_add(1);
            }
            node.live += 1;
            node.last_user = session;
            path.push(next);
            at = next;
        }
        if let Some(&last) = path.last() {
            self.nodes[last as usize].ends.push(session);
        }
        let n = path.len();
        self.chains.insert(session, path);
        n
    }

    /// Drops the session's current chain from the live counts; returns that chain's path.
    fn release(&mut self, session: u32) -> Vec<u32> {
        let Some(path) = self.chains.remove(&session) else {
            return Vec::new();
        };
        for &n in &path {
            let node = &mut self.nodes[n as usize];
            node.live = node.live.saturating_sub(1);
        }
        if let Some(&last) = path.last() {
            self.nodes[last as usize].ends.retain(|&s| s != session);
        }
        path
    }

    /// The session ended: it no longer counts as live anywhere. The reuse history stays.
    pub fn remove(&mut self, session: u32) {
        self.release(session);
    }

    /// Matches `chain` against the tree (see [`PrefixMatch`]).
    pub fn match_prefix(&self, chain: &[PageHash]) -> PrefixMatch {
        let path = self.walk(chain);
        let extends = path
            .iter()
            .enumerate()
            .rev()
            .find_map(|(i, &n)| self.nodes[n as usize].ends.last().map(|&s| (s, i + 1)));
        let deepest_sharer = path
            .last()
            .map(|&n| self.nodes[n as usize].last_user)
            .filter(|&s| s != 0);
        PrefixMatch {
            shared: path.len(),
            extends,
            deepest_sharer,
        }
    }

    /// What the tree knows of each leading page of `chain` (stops at the first page it does
    /// not know).
    pub fn stats(&self, chain: &[PageHash]) -> Vec<PageStats> {
        self.walk(chain)
            .iter()
            .map(|&n| {
                let node = &self.nodes[n as usize];
                PageStats {
                    uses: node.uses,
                    sessions: node.sessions,
                    live: node.live,
                }
            })
            .collect()
    }

    /// How many chains ever used each leading page of `chain` (stops at the first page the
    /// tree does not know).
    pub fn uses(&self, chain: &[PageHash]) -> Vec<u32> {
        self.walk(chain).iter().map(|&n| self.nodes[n as usize].uses).collect()
    }

    /// Live sessions whose current chain starts with `prefix`, sorted. Walks every live
    /// chain: for inspection, not for the per-request path.
    pub fn sharers(&self, prefix: &[PageHash]) -> Vec<u32> {
        let path = self.walk(prefix);
        if path.len() != prefix.len() || path.is_empty() {
            return Vec::new();
        }
        let target = path[path.len() - 1];
        let mut out: Vec<u32> = self
            .chains
            .iter()
            .filter(|(_, p)| p.get(path.len() - 1) == Some(&target))
            .map(|(&s, _)| s)
            .collect();
        out.sort_unstable();
        out
    }

    /// Leading pages of `child`'s chain that are also on `parent`'s chain: what the child
    /// needs of its parent's prefix. 0 when either is unknown.
    pub fn needs_parent_prefix(&self, child: u32, parent: u32) -> usize {
        match (self.chains.get(&child), self.chains.get(&parent)) {
            (Some(c), Some(p)) => c.iter().zip(p).take_while(|(a, b)| a == b).count(),
            _ => 0,
        }
    }

    /// Length of the session's current chain.
    pub fn chain_len(&self, session: u32) -> usize {
        self.chains.get(&session).map_or(0, Vec::len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(ids: &[u64]) -> Vec<PageHash> {
        ids.iter().map(|&i| PageHash::from_u64(i)).collect()
    }

    #[test]
    fn a_request_that_extends_a_chain_continues_that_session() {
        let mut l = Lineage::new(100);
        assert_eq!(l.insert(1, &chain(&[1, 2, 3])), 3);
        assert_eq!(l.insert(2, &chain(&[1, 2, 9])), 3);
        let m = l.match_prefix(&chain(&[1, 2, 3, 4, 5]));
        assert_eq!(m.shared, 3);
        assert_eq!(m.extends, Some((1, 3)));
        // Shares only the system prompt: no session to continue, but a sharer.
        let m = l.match_prefix(&chain(&[1, 2, 7]));
        assert_eq!((m.shared, m.extends), (2, None));
        assert_eq!(m.deepest_sharer, Some(2));
        assert_eq!(l.sharers(&chain(&[1, 2])), vec![1, 2]);
        assert_eq!(l.sharers(&chain(&[1, 2, 9])), vec![2]);
        assert_eq!(l.uses(&chain(&[1, 2, 3, 8])), vec![2, 2, 1]);
    }

    #[test]
    fn a_child_needs_its_parents_prefix_and_ended_sessions_keep_history() {
        let mut l = Lineage::new(100);
        l.insert(1, &chain(&[1, 2, 3, 4]));
        l.insert(5, &chain(&[1, 2, 3, 40, 41]));
        assert_eq!(l.needs_parent_prefix(5, 1), 3);
        // The parent's next turn replaces its chain; the old prefix is still shared.
        l.insert(1, &chain(&[1, 2, 3, 4, 6]));
        assert_eq!(l.needs_parent_prefix(5, 1), 3);
        assert_eq!(l.match_prefix(&chain(&[1, 2, 3, 4])).extends, None);
        l.remove(1);
        assert_eq!(l.sharers(&chain(&[1])), vec![5]);
        assert_eq!(l.needs_parent_prefix(5, 1), 0);
        assert_eq!(l.uses(&chain(&[1, 2, 3, 4])), vec![3, 3, 3, 2]);
        // Session 1 passed through [1 2 3 4] twice, but it is one session.
        let st = l.stats(&chain(&[1, 2, 3, 4]));
        let sessions: Vec<u32> = st.iter().map(|p| p.sessions).collect();
        let live: Vec<u32> = st.iter().map(|p| p.live).collect();
        assert_eq!((sessions, live), (vec![2, 2, 2, 1], vec![1, 1, 1, 0]));
    }

    #[test]
    fn the_tree_is_bounded() {
        let mut l = Lineage::new(4);
        assert_eq!(l.insert(1, &chain(&[1, 2, 3])), 3);
        assert_eq!(l.insert(2, &chain(&[1, 2, 7, 8])), 3);
        assert_eq!(l.len(), 4);
        assert_eq!(l.chain_len(2), 3);
    }
}
