//! Puts and gets with the integrity MAC ([`super::integrity`]): every object goes through
//! the staging region, where its bytes and their 32-byte trailer lie together. A put
//! copies the page into staging and hashes it there; a get hashes the staged object and
//! copies the page out only when its MAC holds.

use super::codes;
use super::integrity::{Integrity, MAC_LEN};
use super::pool::MooncakePool;
use super::wire::Op;
use crate::pool::PoolError;

impl MooncakePool {
    pub(super) fn sealed_put(&self, mac: &Integrity, items: &[(&str, &[u8])]) -> Vec<Result<(), PoolError>> {
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<usize> = items.iter().map(|(_, d)| d.len() + MAC_LEN).collect();
        let at: Vec<Option<u64>> = vec![None; items.len()];
        let stage_in = |i: usize, dst: &mut [u8]| {
            let (key, data) = items[i];
            let obj = &mut dst[..data.len() + MAC_LEN];
            obj[..data.len()].copy_from_slice(data);
            mac.seal(key, obj);
        };
        self.put_retrying(&keys, &lens, &at, &stage_in)
    }

    pub(super) fn sealed_get(&self, mac: &Integrity, items: &mut [(&str, &mut [u8])]) -> Vec<Result<usize, PoolError>> {
        let keys: Vec<&str> = items.iter().map(|(k, _)| *k).collect();
        let lens: Vec<usize> = items.iter().map(|(_, b)| b.len() + MAC_LEN).collect();
        let at: Vec<Option<u64>> = vec![None; items.len()];
        let mut bufs: Vec<&mut [u8]> = items.iter_mut().map(|(_, b)| &mut **b).collect();
        // Per item: the page bytes copied out, once its MAC held.
        let mut opened: Vec<Option<usize>> = vec![None; keys.len()];
        let mut stage_out = |i: usize, src: &[u8], code: i64| {
            let n = usize::try_from(code).unwrap_or(0).min(src.len());
            match mac.open(keys[i], &src[..n]) {
                Some(page) if page.len() <= bufs[i].len() => {
                    bufs[i][..page.len()].copy_from_slice(page);
                    opened[i] = Some(page.len());
                }
                Some(_) => mac.reject(),
                None => {}
            }
        };
        let res = self.transfer(Op::Get, &keys, &lens, &at, &|_, _| {}, &mut stage_out);
        res.into_iter()
            .zip(lens)
            .zip(opened)
            .map(|((r, len), opened)| {
                let code = r?;
                if code < 0 {
                    return codes::get_result(code, len - MAC_LEN);
                }
                // An object that failed its MAC is as good as absent: fewer pages, never
                // its bytes.
                opened.ok_or(PoolError::NotFound)
            })
            .collect()
    }
}
