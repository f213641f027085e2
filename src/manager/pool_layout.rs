//! Pool objects always in SGLang's page-first byte order, whatever order the engine
//! registered.
//!
//! HiCache engines on a shared Mooncake Store read and write each object as
//! `[token][layer][head][dim]` (the `page_first` host layout). A namespace registered with
//! [`ByteOrder::LayerFirst`] keeps `[layer][token][head][dim]` on host, as its GPU holds it;
//! so that its pool objects have SGLang's bytes as well as SGLang's keys, the host-to-pool
//! copy transposes each object to page-first and the pool-to-host copy transposes back.
//! A page-first namespace is copied as it is. The transpose moves whole `[head][dim]` rows,
//! so it is one `copy_from_slice` per (token, layer).

use crate::layout::{ByteOrder, Layout};

/// The shape of one object as rows: `layers × tokens` rows of `row` bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Rows {
    layers: usize,
    tokens: usize,
    row: usize,
}

/// The rows of object `obj` of `layout` when its host bytes differ from the pool's order;
/// `None` when they are the same (page-first, or an object of one layer or one token).
pub(crate) fn transpose_rows(layout: &Layout, obj: usize) -> Option<Rows> {
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
    Some(Rows {
        layers,
        tokens,
        row: bytes / (layers * tokens),
    })
}

/// Host `[layer][token][row]` to pool `[token][layer][row]`. Both slices hold the whole
/// object; a length mismatch copies nothing and returns false.
pub(crate) fn to_pool(r: Rows, host: &[u8], pool: &mut [u8]) -> bool {
    transpose(r.layers, r.tokens, r.row, host, pool)
}

/// Pool `[token][layer][row]` back to host `[layer][token][row]`.
pub(crate) fn from_pool(r: Rows, pool: &[u8], host: &mut [u8]) -> bool {
    transpose(r.tokens, r.layers, r.row, pool, host)
}

/// `src` as `[a][b][row]` into `dst` as `[b][a][row]`.
fn transpose(a: usize, b: usize, row: usize, src: &[u8], dst: &mut [u8]) -> bool {
    let len = a * b * row;
    if src.len() != len || dst.len() != len {
        return false;
    }
    for i in 0..a {
        for j in 0..b {
            let s = (i * b + j) * row;
            let d = (j * a + i) * row;
            dst[d..d + row].copy_from_slice(&src[s..s + row]);
        }
    }
    true
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
            Rows {
                layers: 2,
                tokens: 16,
                row: 2 * 8 * 2
            }
        );
        let n = l.object_bytes(0) as usize;
        // Byte b of (layer, token) row: a distinct value per position.
        let host: Vec<u8> = (0..n).map(|i| (i * 7 + i / 251) as u8).collect();
        let mut pool = vec![0u8; n];
        assert!(to_pool(r, &host, &mut pool));
        for layer in 0..2 {
            for token in 0..16 {
                let h = (layer * 16 + token) * r.row;
                let p = (token * 2 + layer) * r.row;
                assert_eq!(pool[p..p + r.row], host[h..h + r.row], "layer {layer} token {token}");
            }
        }
        assert_ne!(pool, host);
        let mut back = vec![0u8; n];
        assert!(from_pool(r, &pool, &mut back));
        assert_eq!(back, host);
        assert!(!to_pool(r, &host[1..], &mut pool));
        let pf = LayoutSpec::mha(4, 4, 8, 2, 16)
            .with_byte_order(ByteOrder::PageFirst)
            .build()
            .unwrap();
        assert_eq!(transpose_rows(&pf, 0), None);
    }
}
