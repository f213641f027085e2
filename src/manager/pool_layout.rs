//! Pool objects in SGLang's page-first byte order where SGLang reads them.
//!
//! HiCache engines on a shared Mooncake Store read and write each object as
//! `[token][layer][head][dim]` (the `page_first` host layout). With SGLang's keys
//! ([`KeyFormat::Sglang`]), a namespace registered with [`ByteOrder::LayerFirst`] (which
//! keeps `[layer][token][head][dim]` on host, as its GPU holds it) must write SGLang's bytes
//! under SGLang's keys, so the host-to-pool copy transposes each object to page-first and
//! the pool-to-host copy transposes back. The transpose moves whole `[head][dim]` rows, one
//! `copy_from_slice` per (token, layer), straight between the host slot and the pool's
//! object where the backend allows it (see [`crate::pool::reorder`]).
//!
//! With kvtier's own keys ([`KeyFormat::Kvtier`], the default) no SGLang instance reads the
//! objects, and the key's layout fingerprint holds the byte order: only an engine of the
//! same byte order ever reads an object. So objects keep the host's bytes, and a page moves
//! between host and pool in one `memcpy` per object. A row-by-row transpose of 16-token
//! objects ran at 0.5-0.6 of such a `memcpy` wherever the bytes were in cache (see
//! docs/ARCHITECTURE.md, issue 29).

use crate::layout::{ByteOrder, Layout};
use crate::pool::Transpose;
use crate::pool::keys::KeyFormat;

/// How object `obj` of `layout` is reordered between host and pool under keys of
/// `format`: with SGLang's keys, layer-first host bytes `[layer][token][row]` are pool
/// bytes `[token][layer][row]`. `None` when host and pool orders are the same (kvtier's
/// keys, a page-first layout, or an object of one layer or one token).
pub(crate) fn transpose_rows(format: KeyFormat, layout: &Layout, obj: usize) -> Option<Transpose> {
    if format != KeyFormat::Sglang || layout.byte_order() != ByteOrder::LayerFirst {
        return None;
    }
    let id = layout.objects().get(obj)?;
    let layers = layout.stage_layers(id.pp_rank) as usize;
    let tokens = layout.page_tokens() as usize;
    let bytes = layout.object_bytes(obj) as usize;
    if layers <= 1 || tokens <= 1 || !bytes.is_multiple_of(layers * tokens) {
        return None;
    }
    Some(Transpose {
        outer: layers,
        inner: tokens,
        row: bytes / (layers * tokens),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LayoutSpec, Part};

    /// Every element lands at its page-first place and comes back unchanged.
    #[test]
    fn layer_first_objects_become_page_first_and_back() {
        let l = LayoutSpec::mha(4, 4, 8, 2, 16)
            .with_parallel(2, 2)
            .with_byte_order(ByteOrder::LayerFirst)
            .build()
            .unwrap();
        assert_eq!(transpose_rows(KeyFormat::Kvtier, &l, 0), None);
        let r = transpose_rows(KeyFormat::Sglang, &l, 0).unwrap();
        assert_eq!(
            r,
            Transpose {
                outer: 2,
                inner: 16,
                row: 2 * 8 * 2
            }
        );
        let n = l.object_bytes(0) as usize;
        // Byte b of (layer, token) row: a distinct value per position.
        let host: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut pool = vec![0u8; n];
        assert!(r.to_pool(&host, &mut pool));
        for layer in 0..2 {
            for token in 0..16 {
                let h = (layer * 16 + token) * r.row;
                let p = (token * 2 + layer) * r.row;
                assert_eq!(pool[p..p + r.row], host[h..h + r.row], "layer {layer} token {token}");
            }
        }
        assert_ne!(pool, host);
        let mut back = vec![0u8; n];
        assert!(r.from_pool(&pool, &mut back));
        assert_eq!(back, host);
        assert!(!r.to_pool(&host[1..], &mut pool));
        let pf = LayoutSpec::mha(4, 4, 8, 2, 16)
            .with_byte_order(ByteOrder::PageFirst)
            .build()
            .unwrap();
        assert_eq!(transpose_rows(KeyFormat::Sglang, &pf, 0), None);
    }

    /// Through a manager with the local pool and SGLang's keys: a layer-first page stored
    /// from a device and shared lands in the pool page-first, element by element (the
    /// in-place transpose), and prefetched back from the pool alone it loads unchanged.
    #[test]
    fn with_sglang_keys_the_local_pool_holds_page_first_bytes_and_gives_layer_first_back() {
        round_trip_through_the_pool(KeyFormat::Sglang);
    }

    /// With kvtier's keys the same page lands in the pool with the host's own bytes
    /// (layer-first, no transpose), and comes back unchanged.
    #[test]
    fn with_kvtier_keys_the_local_pool_holds_the_hosts_bytes() {
        round_trip_through_the_pool(KeyFormat::Kvtier);
    }

    /// Stores, shares, reads every pool object row by row against where `format` puts each
    /// (token, layer) row, then drops host and device copies and loads the pages back from
    /// the pool alone.
    fn round_trip_through_the_pool(format: KeyFormat) {
        use crate::clock::SystemClock;
        use crate::hints::{Hint, HintTarget};
        use crate::manager::{LoadWait, Manager, ManagerConfig, pool_key_scheme};
        use crate::page::{Namespace, PageHash};
        use crate::tier::TierKind;
        use crate::tier::device::EmulatedDevice;
        use std::sync::Arc;
        use std::time::Duration;

        // 4 layers, 16 tokens, rows of 2 heads x 32 dims x 2 bytes = 128 bytes.
        let l = LayoutSpec::mha(4, 2, 32, 2, 16).build().unwrap();
        assert_eq!(l.byte_order(), ByteOrder::LayerFirst);
        let dir = tempfile::tempdir().unwrap();
        let page = l.page_bytes();
        let mut cfg = ManagerConfig::in_dir(dir.path(), 16 * page, Some(16 * page));
        cfg.policy = None;
        cfg.pool_key_format = format;
        let m = Manager::new(cfg, SystemClock::new()).unwrap();
        let name = Namespace::model("pool-layout");
        let ns = m.register_namespace(name.clone(), l.clone()).unwrap();
        let dev = Arc::new(EmulatedDevice::new(&l, 0, 4));
        m.attach_device(ns, 0, 0, dev.clone()).unwrap();
        let hashes = [PageHash::from_u64(11), PageHash::from_u64(12)];
        for s in 0..2 {
            dev.fill_page(s, 100 + s as u64).unwrap();
        }
        let wait = Duration::from_secs(30);
        let r = m.wait(m.store(ns, 0, 0, &hashes, &[0, 1], 0).unwrap(), wait).unwrap();
        assert_eq!((r.pages, r.failed), (2, 0));
        m.hint(
            ns,
            Hint::Share {
                target: HintTarget::Pages(hashes.to_vec()),
            },
        )
        .unwrap();
        assert!(m.quiesce(wait));
        let pool = m.stores().pool().unwrap();
        let keys = pool_key_scheme(m.config(), &name, &l);
        let row = transpose_rows(KeyFormat::Sglang, &l, 0).unwrap().row;
        let transposed = transpose_rows(format, &l, 0).is_some();
        assert_eq!(transposed, format == KeyFormat::Sglang);
        for (s, h) in hashes.iter().enumerate() {
            for (o, &part) in [Part::K, Part::V].iter().enumerate() {
                let key = keys.object_key(&l, h, l.objects()[o]);
                let mut raw = vec![0u8; l.object_bytes(o) as usize];
                assert_eq!(pool.batch_get_into(&mut [(&key, &mut raw[..])]), vec![Ok(raw.len())]);
                // The device's layer `layer`, token `token` is pool row (token, layer)
                // page-first, else row (layer, token) as on host.
                for layer in 0..4u32 {
                    let want = dev.read_layer(s as u32, part, layer).unwrap();
                    for token in 0..16 {
                        let p = match transposed {
                            true => (token * 4 + layer as usize) * row,
                            false => (layer as usize * 16 + token) * row,
                        };
                        assert_eq!(
                            raw[p..p + row],
                            want[token * row..(token + 1) * row],
                            "page {s} {part:?} layer {layer} token {token}"
                        );
                    }
                }
            }
        }
        // Drop host and device copies, bring the pages back from the pool, load them into
        // fresh device slots: the layer-first bytes the device wrote.
        m.removed(ns, 0, 0, &hashes).unwrap();
        m.mover().make_host_room(usize::MAX);
        let where_now = m.lookup(ns, &hashes).unwrap();
        assert_eq!((where_now.host, where_now.pool), (0, 2));
        let to = TierKind::Host;
        m.hint(
            ns,
            Hint::Prefetch {
                target: HintTarget::Pages(hashes.to_vec()),
                to,
                deadline_ms: None,
            },
        )
        .unwrap();
        assert_eq!(m.lookup(ns, &hashes).unwrap().host, 2);
        let r = m
            .wait(
                m.load(ns, 0, 0, &hashes, &[2, 3], LoadWait::WaitComplete).unwrap(),
                wait,
            )
            .unwrap();
        assert_eq!((r.pages, r.failed), (2, 0));
        assert!(dev.page_matches(2, 100).unwrap() && dev.page_matches(3, 101).unwrap());
    }
}
