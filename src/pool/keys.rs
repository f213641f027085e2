//! The namespace and layout part of pool object keys.
//!
//! Two engines may share a pool object only when its bytes are the same for both: same
//! namespace (model, LoRA, salt) and same layout (TP size, PP split, KV heads, head size,
//! dtype, page size, byte order; the TP and PP ranks are in each object's own key). The
//! default format, [`KeyFormat::Kvtier`], renders
//! `[{tag}_]esc(model)[+l{esc(lora)}][+s{esc(salt)}]+g{fingerprint}_…`, where the
//! fingerprint is [`layout_fingerprint`] over the whole [`Layout`]: namespaces that differ
//! in any character, `/` against `-` included, and layouts that differ in any field never
//! share a key.
//!
//! [`KeyFormat::Sglang`] renders SGLang HiCache's exact keys, for a store shared with
//! SGLang instances. Those keys carry the TP rank but not the TP size, dtype or page size,
//! so the format is safe only when every engine on the store (SGLang and kvtier alike)
//! serves the model with the same TP size, PP split, KV dtype, page size and byte order.
//!
//! SGLang 0.5.23's Mooncake keys are `[tag_]<model, '/' as '-'>_{hash}_{tp}[_{pp}]_{k|v}`
//! (MLA: `…_{hash}_{pp}_k`, or `…_{hash}__k` without PP). A namespace that holds only a
//! model name renders exactly that, so HiCache instances on the same store read kvtier's
//! pages. Every other namespace (a LoRA adapter, a salt, or a model name holding `%` or
//! `+`) renders `esc(model)[+l{esc(lora)}][+s{esc(salt)}]`, where `esc` writes `%`, `_`, `/`
//! and `+` as `%25`, `%5F`, `%2F` and `%2B`: separators are escaped, never replaced, so salt
//! `t_1` and salt `t-1` differ, and LoRA `x` (`+lx`) differs from salt `x` (`+sx`). The two
//! forms never meet: the escaped one always holds a `%` or a `+`, the plain one neither.
//! The one collision left is SGLang's own: model names that differ only in `/` against `-`
//! share SGLang's key; kvtier keeps it so that its keys equal SGLang's.

use serde::{Deserialize, Serialize};

use crate::layout::Layout;
use crate::page::{KeyScheme, Namespace};

/// What changes in the encoding of a page's bytes that the [`Layout`] does not show; part
/// of every fingerprint. Bump it with any such change, so old objects are never read as new.
/// 2: objects keep the host's byte order (1 stored layer-first layouts page-first).
pub const LAYOUT_KEY_VERSION: u32 = 2;

/// How pool keys are rendered (`mooncake.key_format`; see the module docs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeyFormat {
    /// kvtier's own: the namespace escaped and the layout's fingerprint in every key; safe
    /// for any mix of engines and layouts on one store.
    #[default]
    Kvtier,
    /// SGLang HiCache's exact keys: safe only when every engine sharing the store serves
    /// the model with the same TP size, PP split, dtype, page size and byte order.
    Sglang,
}

impl KeyFormat {
    pub fn name(self) -> &'static str {
        match self {
            KeyFormat::Kvtier => "kvtier",
            KeyFormat::Sglang => "sglang",
        }
    }
}

/// The fingerprint of everything in `layout` that changes a page's bytes: a 64-bit FNV-1a
/// hash of [`LAYOUT_KEY_VERSION`] and the layout's serialized form (every field of
/// [`Layout`], so a field added to it is covered without touching this function).
pub fn layout_fingerprint(layout: &Layout) -> u64 {
    let encoded = serde_json::to_vec(layout).unwrap_or_default();
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in LAYOUT_KEY_VERSION.to_le_bytes().iter().chain(&encoded) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// The namespace field of kvtier's own keys: every part escaped (so no two namespaces
/// meet), then `+g` and the layout's fingerprint in hex.
pub fn kvtier_field(ns: &Namespace, layout: &Layout) -> String {
    let mut out = escape(&ns.model);
    for (mark, v) in [("+l", &ns.lora), ("+s", &ns.salt)] {
        if !v.is_empty() {
            out.push_str(mark);
            out.push_str(&escape(v));
        }
    }
    out.push_str(&format!("+g{:016x}", layout_fingerprint(layout)));
    out
}

/// The model field of SGLang's keys for `ns` (see the module docs).
pub fn namespace_field(ns: &Namespace) -> String {
    let plain = ns.lora.is_empty() && ns.salt.is_empty() && !ns.model.contains(['%', '+']);
    if plain {
        return ns.model.replace('/', "-");
    }
    let mut out = escape(&ns.model);
    for (mark, v) in [("+l", &ns.lora), ("+s", &ns.salt)] {
        if !v.is_empty() {
            out.push_str(mark);
            out.push_str(&escape(v));
        }
    }
    out
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '_' => out.push_str("%5F"),
            '/' => out.push_str("%2F"),
            '+' => out.push_str("%2B"),
            c => out.push(c),
        }
    }
    out
}

/// The key scheme of a namespace of `layout` under `tag`, in `format`: `{tag}_{field}_…`,
/// or `{field}_…` with an empty tag, where the field is [`kvtier_field`] or, in SGLang's
/// format, [`namespace_field`] (where a namespace with no model, LoRA or salt gets bare
/// `{hash}_…` keys).
pub fn scheme_for(tag: &str, format: KeyFormat, ns: &Namespace, layout: &Layout) -> KeyScheme {
    let field = match format {
        KeyFormat::Kvtier => kvtier_field(ns, layout),
        KeyFormat::Sglang => namespace_field(ns),
    };
    let prefix = match (tag.is_empty(), field.is_empty()) {
        (true, true) => String::new(),
        (true, false) => format!("{field}_"),
        (false, _) => format!("{tag}_{field}_"),
    };
    KeyScheme { prefix }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::LayoutSpec;
    use crate::page::PageHash;

    fn ns(model: &str, lora: &str, salt: &str) -> Namespace {
        Namespace {
            model: model.into(),
            lora: lora.into(),
            salt: salt.into(),
        }
    }

    fn sglang(tag: &str, n: &Namespace) -> KeyScheme {
        scheme_for(
            tag,
            KeyFormat::Sglang,
            n,
            &LayoutSpec::mha(1, 1, 64, 2, 16).build().unwrap(),
        )
    }

    #[test]
    fn model_only_namespaces_render_sglang_keys_in_sglang_format() {
        let h = PageHash::from_u64(0xab);
        let tp2 = LayoutSpec::mha(4, 4, 64, 2, 16).with_parallel(2, 1).build().unwrap();
        let s = scheme_for("", KeyFormat::Sglang, &ns("Qwen/Qwen3-8B", "", ""), &tp2);
        assert_eq!(s.page_keys(&tp2, &h)[3], "Qwen-Qwen3-8B_00000000000000ab_1_v");
        let mla = LayoutSpec::mla(4, 512, 2, 16).with_parallel(2, 1).build().unwrap();
        let s = scheme_for("prod", KeyFormat::Sglang, &ns("deepseek-ai/DeepSeek_V3", "", ""), &mla);
        assert_eq!(
            s.page_keys(&mla, &h),
            vec!["prod_deepseek-ai-DeepSeek_V3_00000000000000ab__k"]
        );
        assert_eq!(sglang("", &Namespace::default()).prefix, "");
    }

    #[test]
    fn kvtier_keys_differ_for_every_layout_field_and_every_namespace_character() {
        let h = PageHash::from_u64(0xab);
        let base = LayoutSpec::mha(4, 2, 64, 2, 16);
        let layouts = [
            base.clone(),
            base.clone().with_parallel(2, 1),
            base.clone().with_parallel(4, 1),
            base.clone().with_parallel(2, 2),
            LayoutSpec::mha(4, 2, 64, 4, 16),
            LayoutSpec::mha(4, 2, 64, 2, 32),
            LayoutSpec::mha(4, 2, 128, 2, 16),
            LayoutSpec::mha(8, 2, 64, 2, 16),
            LayoutSpec::mha(4, 4, 64, 2, 16),
            base.clone().with_byte_order(crate::layout::ByteOrder::PageFirst),
            LayoutSpec::mla(4, 64, 2, 16),
        ];
        let mut keys = Vec::new();
        for spec in &layouts {
            let l = spec.clone().build().unwrap();
            let s = scheme_for("kvtier", KeyFormat::Kvtier, &ns("m", "", ""), &l);
            // TP rank 1's K object where the layout has one, else the first object.
            let id = l
                .objects()
                .iter()
                .copied()
                .find(|o| o.tp_rank == 1)
                .unwrap_or(l.objects()[0]);
            keys.push(s.object_key(&l, &h, id));
        }
        for i in 0..keys.len() {
            for j in i + 1..keys.len() {
                assert_ne!(keys[i], keys[j], "{:?} vs {:?}", layouts[i], layouts[j]);
            }
        }
        // The break of issue 27: 2 KV heads at TP=2 and TP=4; rank 1 holds head 1 at TP=2
        // and head 0 at TP=4, and their keys were equal.
        let (tp2, tp4) = (&keys[1], &keys[2]);
        assert!(tp2.ends_with("_1_k") && tp4.ends_with("_1_k") && tp2 != tp4);
        let l = base.build().unwrap();
        let a = scheme_for("kvtier", KeyFormat::Kvtier, &ns("org/model", "", ""), &l);
        let b = scheme_for("kvtier", KeyFormat::Kvtier, &ns("org-model", "", ""), &l);
        assert_ne!(a.prefix, b.prefix);
        assert!(a.prefix.starts_with("kvtier_org%2Fmodel+g"), "{}", a.prefix);
        // The same layout built twice has one fingerprint: nodes that agree share keys.
        let again = LayoutSpec::mha(4, 2, 64, 2, 16).build().unwrap();
        assert_eq!(layout_fingerprint(&l), layout_fingerprint(&again));
        assert_eq!(
            a,
            scheme_for("kvtier", KeyFormat::Kvtier, &ns("org/model", "", ""), &again)
        );
        let (hash, index) = a.parse(&l, &a.object_key(&l, &h, l.objects()[1])).unwrap();
        assert_eq!((hash, index), (h, 1));
    }

    #[test]
    fn distinct_namespaces_never_share_a_prefix() {
        let cases = [
            ns("m", "", "t_1"),
            ns("m", "", "t-1"),
            ns("m", "adapterX", ""),
            ns("m", "", "adapterX"),
            ns("m", "a", "b"),
            ns("m", "", "a+sb"),
            ns("m+la", "", ""),
            ns("m", "a", ""),
            ns("m_x", "", ""),
            ns("m", "x", ""),
            ns("m%5Fx", "", ""),
            ns("m", "", ""),
            ns("m/x", "", "s"),
            ns("m_x", "", "s"),
        ];
        let l = LayoutSpec::mha(1, 1, 64, 2, 16).build().unwrap();
        for (tag, format) in [
            ("", KeyFormat::Sglang),
            ("kvtier", KeyFormat::Sglang),
            ("", KeyFormat::Kvtier),
        ] {
            let prefixes: Vec<String> = cases.iter().map(|n| scheme_for(tag, format, n, &l).prefix).collect();
            for i in 0..cases.len() {
                for j in i + 1..cases.len() {
                    assert_ne!(prefixes[i], prefixes[j], "{:?} vs {:?}", cases[i], cases[j]);
                }
            }
        }
        assert_eq!(sglang("kvtier", &ns("m", "", "t_1")).prefix, "kvtier_m+st%5F1_");
        assert_eq!(sglang("kvtier", &ns("m", "", "t-1")).prefix, "kvtier_m+st-1_");
    }
}
