//! Pool objects always in SGLang's page-first byte order, whatever order the engine
//! registered.
//!
//! HiCache engines on a shared Mooncake Store read and write each object as
//! `[token][layer][head][dim]` (the `page_first` host layout). A namespace registered with
//! [`ByteOrder::LayerFirst`] keeps `[layer][token][head][dim]` on host, as its GPU holds it;
//! so that its pool objects have SGLang's bytes as well as SGLang's keys, the host-to-pool
//! copy transposes each object to page-first and the pool-to-host copy transposes back.
//! A page-first namespace is copied as it is. The transpose moves whole `[head][dim]` rows,
//! so it is one `copy_from_slice` per (token, layer), straight between the host slot and
//! the pool's object where the backend allows it (see [`crate::pool::reorder`]).

use crate::layout::{ByteOrder, Layout};
use crate::pool::Transpose;

/// How object `obj` of `layout` is reordered between host and pool: layer-first host
/// bytes `[layer][token][row]` are pool bytes `[token][layer][row]`. `None` when host and
/// pool orders are the same (page-first, or an object of one layer or one token).
pub(crate) fn transpose_rows(layout: &Layout, obj: usize) -> Option<Transpose> {
    if layout.byte_order() != ByteOrder::LayerFirst {
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
    use crate::layout::LayoutSpec;

    /// Every element lands at its page-first place and comes back unchanged.
    #[test]
    fn layer_first_objects_become_page_first_and_back() {
        let l = LayoutSpec::mha(4, 4, 8, 2, 16)
            .with_parallel(2, 2)
            .with_byte_order(ByteOrder::LayerFirst)
            .build()
            .unwrap();
        let r = transpose_rows(&l, 0).unwrap();
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
        assert_eq!(transpose_rows(&pf, 0), None);
    }
}
