//! The namespace part of pool object keys: SGLang's form where it is safe, escaped where
//! two tenants could otherwise meet on one key.
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

use crate::page::{KeyScheme, Namespace};

/// The model field of a key for `ns` (see the module docs).
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

/// The key scheme of a namespace under `tag`: `{tag}_{field}_…`, or `{field}_…` with an
/// empty tag. A namespace with no model, LoRA or salt gets bare `{hash}_…` keys.
pub fn scheme_for(tag: &str, ns: &Namespace) -> KeyScheme {
    let field = namespace_field(ns);
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

    #[test]
    fn model_only_namespaces_render_sglang_keys() {
        let h = PageHash::from_u64(0xab);
        let tp2 = LayoutSpec::mha(4, 4, 64, 2, 16).with_parallel(2, 1).build().unwrap();
        let s = scheme_for("", &ns("Qwen/Qwen3-8B", "", ""));
        assert_eq!(s.page_keys(&tp2, &h)[3], "Qwen-Qwen3-8B_00000000000000ab_1_v");
        let s = scheme_for("prod", &ns("deepseek-ai/DeepSeek_V3", "", ""));
        let mla = LayoutSpec::mla(4, 512, 2, 16).with_parallel(2, 1).build().unwrap();
        assert_eq!(
            s.page_keys(&mla, &h),
            vec!["prod_deepseek-ai-DeepSeek_V3_00000000000000ab__k"]
        );
        assert_eq!(scheme_for("", &Namespace::default()).prefix, "");
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
        for tag in ["", "kvtier"] {
            let prefixes: Vec<String> = cases.iter().map(|n| scheme_for(tag, n).prefix).collect();
            for i in 0..cases.len() {
                for j in i + 1..cases.len() {
                    assert_ne!(prefixes[i], prefixes[j], "{:?} vs {:?}", cases[i], cases[j]);
                }
            }
        }
        assert_eq!(scheme_for("kvtier", &ns("m", "", "t_1")).prefix, "kvtier_m+st%5F1_");
        assert_eq!(scheme_for("kvtier", &ns("m", "", "t-1")).prefix, "kvtier_m+st-1_");
    }
}
