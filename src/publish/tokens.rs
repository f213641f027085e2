//! Token ids and chain parents that engines supplied with stored pages, kept for the
//! vLLM publisher's `BlockStored` events.
//!
//! kvtier's core never sees tokens: a page is a hash. Routers that index by tokens
//! (Dynamo's indexer computes its own block hashes from `token_ids` and links blocks by
//! `parent_block_hash`) need both, so an engine may send them with a store
//! (`Client::store_tokens`), and the daemon records them here, keyed by namespace and
//! page hash. The publisher looks a page up when it encodes the page's `BlockStored`.
//!
//! The table is bounded by the tokens it holds ([`TokenTable::new`]): the oldest entries
//! go first, so a page stored long ago and completed later is published without tokens
//! (`token_ids: []`) rather than growing memory. One mutex guards it; it is taken for a
//! map insert or lookup only, never across I/O.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use parking_lot::Mutex;

use crate::page::{NamespaceId, PageHash};

/// What an engine said about one page: its tokens, and the page before it in its chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageTokens {
    pub parent: Option<PageHash>,
    pub tokens: Arc<[u32]>,
}

/// Most tokens one page may carry; longer lists are refused by the protocol.
pub use crate::protocol::MAX_PAGE_TOKENS;

/// Default bound of a [`TokenTable`]: 16 Mi tokens (64 MiB of token ids).
pub const DEFAULT_MAX_TOKENS: usize = 16 << 20;

type Key = (NamespaceId, PageHash);

/// A bounded map from (namespace, page hash) to [`PageTokens`], oldest out first.
pub struct TokenTable {
    inner: Mutex<Inner>,
    max_tokens: usize,
}

struct Inner {
    /// Each entry with the generation of the insert that wrote it.
    map: HashMap<Key, (PageTokens, u64)>,
    /// Insertion order; a key written again appears twice, and its older position is
    /// skipped when it comes up (the map's generation is not the one it added).
    order: VecDeque<(Key, u64)>,
    tokens: usize,
    next_gen: u64,
}

impl std::fmt::Debug for TokenTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let g = self.inner.lock();
        f.debug_struct("TokenTable")
            .field("pages", &g.map.len())
            .field("tokens", &g.tokens)
            .field("max_tokens", &self.max_tokens)
            .finish()
    }
}

impl Default for TokenTable {
    fn default() -> Self {
        Self::new(DEFAULT_MAX_TOKENS)
    }
}

impl TokenTable {
    /// A table that holds at most `max_tokens` token ids (and as many pages).
    pub fn new(max_tokens: usize) -> Self {
        Self {
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                order: VecDeque::new(),
                tokens: 0,
                next_gen: 0,
            }),
            max_tokens: max_tokens.max(1),
        }
    }

    /// Records the tokens of consecutive pages of one chain: page `i`'s parent is page
    /// `i - 1`, the first page's is `parent`. `tokens[i]` belongs to `hashes[i]`; extra
    /// entries on either side are ignored.
    pub fn record(&self, ns: NamespaceId, parent: Option<PageHash>, hashes: &[PageHash], tokens: &[Vec<u32>]) {
        let mut g = self.inner.lock();
        let mut prev = parent;
        for (h, t) in hashes.iter().zip(tokens) {
            let entry = PageTokens {
                parent: prev,
                tokens: Arc::from(t.as_slice()),
            };
            prev = Some(*h);
            let key = (ns, *h);
            let gen_ = g.next_gen;
            g.next_gen += 1;
            g.tokens += entry.tokens.len().max(1);
            if let Some((old, _)) = g.map.insert(key, (entry, gen_)) {
                g.tokens -= old.tokens.len().max(1);
            }
            g.order.push_back((key, gen_));
            while g.tokens > self.max_tokens || g.order.len() > 2 * self.max_tokens {
                let Some((k, gen_)) = g.order.pop_front() else { break };
                if g.map.get(&k).is_some_and(|(_, gn)| *gn == gen_)
                    && let Some((old, _)) = g.map.remove(&k)
                {
                    g.tokens -= old.tokens.len().max(1);
                }
            }
        }
    }

    /// What was recorded for a page, if it is still held.
    pub fn get(&self, ns: NamespaceId, hash: &PageHash) -> Option<PageTokens> {
        self.inner.lock().map.get(&(ns, *hash)).map(|(t, _)| t.clone())
    }

    /// Pages held.
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h(v: u64) -> PageHash {
        PageHash::from_u64(v)
    }

    #[test]
    fn chains_link_parents_and_the_oldest_go_first() {
        let t = TokenTable::new(8);
        let ns = NamespaceId(1);
        t.record(ns, Some(h(100)), &[h(1), h(2)], &[vec![1, 2], vec![3, 4]]);
        assert_eq!(t.get(ns, &h(1)).unwrap().parent, Some(h(100)));
        let second = t.get(ns, &h(2)).unwrap();
        assert_eq!((second.parent, &second.tokens[..]), (Some(h(1)), &[3u32, 4][..]));
        assert_eq!(t.get(NamespaceId(2), &h(1)), None);
        // 4 more tokens fit; 2 beyond push page 1 out.
        t.record(ns, None, &[h(3), h(4)], &[vec![5, 6], vec![7, 8]]);
        assert_eq!(t.len(), 4);
        t.record(ns, None, &[h(5)], &[vec![9, 10]]);
        assert_eq!(t.get(ns, &h(1)), None);
        assert_eq!(&t.get(ns, &h(5)).unwrap().tokens[..], &[9, 10]);
        assert_eq!(t.len(), 4);
    }
}
