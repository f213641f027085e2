//! The import arrows of docs/ARCHITECTURE.md, checked: every `crate::…` path under `src/`
//! must name a module that the importing module may use, as the document's list of arrows
//! (between `<!-- arrows:begin -->` and `<!-- arrows:end -->`) says. A module missing
//! from the list fails too, so a new module is drawn before it is used.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

/// Allowed arrows: module → the crate modules it may import.
type Arrows = BTreeMap<String, BTreeSet<String>>;

/// An import against the drawn direction.
#[derive(Debug, PartialEq, Eq)]
struct Violation {
    file: String,
    line: usize,
    from: String,
    to: String,
}

/// Parses the list of arrows: one `module: dep dep …` a line inside the markers, `#`
/// starting a comment.
fn parse_arrows(doc: &str) -> Arrows {
    let begin = doc
        .find("<!-- arrows:begin -->")
        .expect("docs/ARCHITECTURE.md has no arrows:begin marker");
    let end = doc
        .find("<!-- arrows:end -->")
        .expect("docs/ARCHITECTURE.md has no arrows:end marker");
    assert!(begin < end, "arrows:end comes before arrows:begin");
    let mut arrows = Arrows::new();
    for line in doc[begin..end].lines().skip(1) {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() || line.starts_with("```") {
            continue;
        }
        let (module, deps) = line
            .split_once(':')
            .unwrap_or_else(|| panic!("bad arrow line {line:?}"));
        let deps: BTreeSet<String> = deps.split_whitespace().map(str::to_owned).collect();
        let module = module.trim().to_owned();
        assert!(!deps.contains(&module), "{module} lists itself");
        assert!(
            arrows.insert(module.clone(), deps).is_none(),
            "{module} is listed twice"
        );
    }
    arrows
}

/// Removes `//` comments (doc comments included) and the contents of string literals, so
/// that a path named in prose is not an import.
fn code_of(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    let mut in_str = false;
    while let Some(c) = chars.next() {
        if in_str {
            match c {
                '\\' => {
                    chars.next();
                }
                '"' => {
                    in_str = false;
                    out.push('"');
                }
                _ => {}
            }
            continue;
        }
        match c {
            '"' => {
                in_str = true;
                out.push('"');
            }
            // A char literal holding a quote would otherwise open a string.
            '\'' if chars.peek() == Some(&'"') => {
                chars.next();
                out.push_str("'\"");
            }
            '/' if chars.peek() == Some(&'/') => break,
            _ => out.push(c),
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// The top-level modules a line of code names through `crate::`: `crate::x::…`,
/// `crate::x`, and each item of a group, `crate::{x::…, y}`.
fn crate_targets(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        // `$crate::` (macros) and `kvtier_crate::` are not this crate's root path.
        if before.is_some_and(|c| is_ident(c) || c == '$') {
            continue;
        }
        if let Some(group) = rest.strip_prefix('{') {
            let mut depth = 0usize;
            let mut item = String::new();
            let mut items = Vec::new();
            for c in group.chars() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => items.push(std::mem::take(&mut item)),
                    _ if depth == 0 => item.push(c),
                    _ => {}
                }
            }
            items.push(item);
            for item in items {
                let name: String = item.trim().chars().take_while(|&c| is_ident(c)).collect();
                if !name.is_empty() && name != "self" {
                    out.push(name);
                }
            }
        } else {
            let name: String = rest.chars().take_while(|&c| is_ident(c)).collect();
            if !name.is_empty() {
                out.push(name);
            }
        }
    }
    out
}

/// The violations in one file of module `from`.
fn check_source(file: &str, from: &str, source: &str, arrows: &Arrows) -> Vec<Violation> {
    let mut found = Vec::new();
    let allowed = arrows.get(from);
    let mut in_block_comment = false;
    for (n, line) in source.lines().enumerate() {
        let mut line = line;
        if in_block_comment {
            match line.find("*/") {
                Some(i) => {
                    line = &line[i + 2..];
                    in_block_comment = false;
                }
                None => continue,
            }
        }
        let mut code = code_of(line);
        if let Some(i) = code.find("/*") {
            in_block_comment = !code[i..].contains("*/");
            code.truncate(i);
        }
        for to in crate_targets(&code) {
            if to == from {
                continue;
            }
            if !allowed.is_some_and(|a| a.contains(&to)) {
                found.push(Violation {
                    file: file.to_owned(),
                    line: n + 1,
                    from: from.to_owned(),
                    to,
                });
            }
        }
    }
    found
}

/// The top-level module of a file under `src/`: `src/manager/tiers.rs` → `manager`,
/// `src/page.rs` → `page`; `None` for the crate root and the binary.
fn module_of(rel: &Path) -> Option<String> {
    let first = rel.components().next()?.as_os_str().to_str()?;
    let name = first.strip_suffix(".rs").unwrap_or(first);
    (!matches!(name, "lib" | "main")).then(|| name.to_owned())
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn every_import_under_src_follows_the_drawn_arrows() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let doc = fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let arrows = parse_arrows(&doc);
    let src = root.join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut modules = BTreeSet::new();
    let mut violations = Vec::new();
    let mut imports = 0usize;
    for path in &files {
        let rel = path.strip_prefix(&src).unwrap();
        let Some(from) = module_of(rel) else { continue };
        let source = fs::read_to_string(path).unwrap();
        imports += source.lines().map(|l| crate_targets(&code_of(l)).len()).sum::<usize>();
        violations.extend(check_source(&format!("src/{}", rel.display()), &from, &source, &arrows));
        modules.insert(from);
    }
    let undrawn: Vec<_> = modules.iter().filter(|m| !arrows.contains_key(*m)).collect();
    assert!(
        undrawn.is_empty(),
        "modules missing from docs/ARCHITECTURE.md's arrows: {undrawn:?}"
    );
    let stale: Vec<_> = arrows.keys().filter(|m| !modules.contains(*m)).collect();
    assert!(
        stale.is_empty(),
        "arrows drawn for modules that do not exist: {stale:?}"
    );
    for (from, deps) in &arrows {
        for to in deps {
            assert!(arrows.contains_key(to), "{from} may import {to}, which is not drawn");
        }
    }
    assert!(
        imports > 500,
        "only {imports} crate:: paths found under src/: is the scan broken?"
    );
    let listed: Vec<String> = violations
        .iter()
        .map(|v| format!("{}:{}: {} imports {}", v.file, v.line, v.from, v.to))
        .collect();
    assert!(
        listed.is_empty(),
        "imports against docs/ARCHITECTURE.md's arrows:\n{}",
        listed.join("\n")
    );
}

#[test]
fn the_drawn_arrows_have_no_cycle() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let arrows = parse_arrows(&fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap());
    // Depth-first search with colours: grey on the stack, black done.
    fn visit<'a>(m: &'a str, arrows: &'a Arrows, grey: &mut Vec<&'a str>, black: &mut BTreeSet<&'a str>) {
        if black.contains(m) {
            return;
        }
        if let Some(i) = grey.iter().position(|g| *g == m) {
            panic!("the arrows make a cycle: {} → {m}", grey[i..].join(" → "));
        }
        grey.push(m);
        for d in arrows.get(m).into_iter().flatten() {
            visit(d, arrows, grey, black);
        }
        grey.pop();
        black.insert(m);
    }
    let mut black = BTreeSet::new();
    for m in arrows.keys() {
        visit(m, &arrows, &mut Vec::new(), &mut black);
    }
    assert_eq!(black.len(), arrows.len());
}

const ARROWS: &str = "<!-- arrows:begin -->
```text
page: layout
layout:
manager: page layout   # the core
protocol: page
```
<!-- arrows:end -->";

#[test]
fn the_checker_fails_an_import_against_the_arrows() {
    let arrows = parse_arrows(ARROWS);
    assert_eq!(arrows.len(), 4);
    let snippet = "\
//! The manager; `crate::protocol` in a comment is not an import.
use crate::page::PageHash;
use crate::{layout::Layout, protocol::MAX_PAGES};
use super::state::DirState;
fn f() -> crate::protocol::Response { todo!(\"crate::protocol in a string\") }
/* use crate::protocol::Request; */
use crate::manager::Manager;
";
    let found = check_source("src/manager/x.rs", "manager", snippet, &arrows);
    assert_eq!(
        found,
        vec![
            Violation {
                file: "src/manager/x.rs".into(),
                line: 3,
                from: "manager".into(),
                to: "protocol".into(),
            },
            Violation {
                file: "src/manager/x.rs".into(),
                line: 5,
                from: "manager".into(),
                to: "protocol".into(),
            },
        ]
    );
    // The same imports from a module with no arrows at all: every one is refused.
    let undrawn = check_source("src/daemon/x.rs", "daemon", "use crate::page::PageHash;\n", &arrows);
    assert_eq!(undrawn.len(), 1);
    // A module allowed what it names passes.
    assert!(check_source("src/protocol/x.rs", "protocol", "use crate::page::PageHash;\n", &arrows).is_empty());
}

#[test]
fn paths_are_found_in_groups_and_expressions_but_not_in_macros_or_prose() {
    assert_eq!(
        crate_targets("use crate::{self as k, a::B, c::{d, e::F}, g};"),
        vec!["a", "c", "g"]
    );
    assert_eq!(crate_targets("let x = crate::tier::TierKind::Host;"), vec!["tier"]);
    assert!(crate_targets("$crate::page::PageHash").is_empty());
    assert!(crate_targets(&code_of("let s = \"crate::x\"; // crate::y")).is_empty());
    assert_eq!(module_of(Path::new("manager/tiers.rs")).as_deref(), Some("manager"));
    assert_eq!(module_of(Path::new("page.rs")).as_deref(), Some("page"));
    assert_eq!(module_of(Path::new("lib.rs")), None);
}

// ---------------------------------------------------------------------------------------
// Methods per type: no type under `src/` has more than `MAX_METHODS` inherent methods,
// counted over every `impl Type {` block of the type, in any file. A type still above the
// limit has a ceiling in `METHOD_CEILINGS` (its count when the ceiling was set), which may
// only go down: the test fails above the ceiling, and below it, so the table follows each
// method moved out into a component.

/// The most inherent methods one type may have.
const MAX_METHODS: usize = 40;

/// Types still above `MAX_METHODS`, with their current count: lower the figure when a
/// method moves out, remove the row once the type is at or under the limit.
const METHOD_CEILINGS: &[(&str, usize)] = &[];

/// Blanks comments, the contents of string, raw-string and char literals, keeping line
/// breaks, so that braces and `impl`/`fn` words inside them are not seen as code.
fn strip_source(src: &str) -> String {
    let c: Vec<char> = src.chars().collect();
    let mut out = String::with_capacity(src.len());
    let mut i = 0;
    let keep_lines = |out: &mut String, s: &[char]| {
        for &ch in s {
            out.push(if ch == '\n' { '\n' } else { ' ' });
        }
    };
    while i < c.len() {
        let rest = &c[i..];
        if rest.starts_with(&['/', '/']) {
            let end = rest.iter().position(|&ch| ch == '\n').unwrap_or(rest.len());
            keep_lines(&mut out, &rest[..end]);
            i += end;
        } else if rest.starts_with(&['/', '*']) {
            let (mut depth, mut j) = (0usize, 0);
            while j < rest.len() {
                if rest[j..].starts_with(&['/', '*']) {
                    depth += 1;
                    j += 2;
                } else if rest[j..].starts_with(&['*', '/']) {
                    depth -= 1;
                    j += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    j += 1;
                }
            }
            keep_lines(&mut out, &rest[..j.min(rest.len())]);
            i += j;
        } else if (rest[0] == 'r' || rest.starts_with(&['b', 'r'])) && (i == 0 || !is_ident(c[i - 1])) && {
            let s = if rest[0] == 'b' { 2 } else { 1 };
            let hashes = rest[s..].iter().take_while(|&&ch| ch == '#').count();
            rest.get(s + hashes) == Some(&'"')
        } {
            // A raw string: r"…", r#"…"#, br"…".
            let s = if rest[0] == 'b' { 2 } else { 1 };
            let hashes = rest[s..].iter().take_while(|&&ch| ch == '#').count();
            let body = s + hashes + 1;
            let mut j = body;
            while j < rest.len() {
                if rest[j] == '"' && rest[j + 1..].iter().take(hashes).filter(|&&ch| ch == '#').count() == hashes {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push('"');
            keep_lines(&mut out, &rest[1..j.min(rest.len()) - 1]);
            out.push('"');
            i += j;
        } else if rest[0] == '"' {
            let mut j = 1;
            while j < rest.len() && rest[j] != '"' {
                j += if rest[j] == '\\' { 2 } else { 1 };
            }
            let j = (j + 1).min(rest.len());
            out.push('"');
            keep_lines(&mut out, &rest[1..j - 1]);
            out.push('"');
            i += j;
        } else if rest[0] == '\'' && (rest.get(1) == Some(&'\\') || rest.get(2) == Some(&'\'')) {
            // A char literal ('{', '\'', '\u{7b}'); a lifetime ('a) has no closing quote.
            let end = rest[2..]
                .iter()
                .position(|&ch| ch == '\'')
                .map_or(rest.len(), |p| p + 3);
            out.push_str("' '");
            i += end;
        } else {
            out.push(rest[0]);
            i += 1;
        }
    }
    out
}

/// The word at byte `at` of `code`, if a whole word starts there.
fn word_at(code: &str, at: usize) -> &str {
    let w = &code[at..];
    let len = w.find(|ch: char| !is_ident(ch)).unwrap_or(w.len());
    &w[..len]
}

/// The type an inherent impl header is for (`impl<T: X> a::Foo<T> where …` → `Foo`), or
/// `None` for a trait impl.
fn impl_type(header: &str) -> Option<String> {
    let mut h = header.trim_start().strip_prefix("impl")?.trim_start();
    if let Some(g) = h.strip_prefix('<') {
        let mut depth = 1usize;
        let end = g.char_indices().find_map(|(i, ch)| {
            match ch {
                '<' => depth += 1,
                '>' => depth -= 1,
                _ => {}
            }
            (depth == 0).then_some(i)
        })?;
        h = g[end + 1..].trim_start();
    }
    let head = h.split(" where").next().unwrap_or(h);
    if head.split_whitespace().any(|w| w == "for") {
        return None;
    }
    let path: String = head.chars().take_while(|&ch| is_ident(ch) || ch == ':').collect();
    let name = path.rsplit("::").next().unwrap_or(&path).to_owned();
    (!name.is_empty()).then_some(name)
}

/// Inherent methods per type in one file's source.
fn count_methods(src: &str, counts: &mut BTreeMap<String, usize>) {
    let code = strip_source(src);
    let bytes = code.as_bytes();
    // Open impl bodies: (brace depth inside the body, type).
    let mut open: Vec<(usize, String)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'{' => depth += 1,
            b'}' => {
                if open.last().is_some_and(|(d, _)| *d == depth) {
                    open.pop();
                }
                depth = depth.saturating_sub(1);
            }
            b if is_ident(b as char) && (i == 0 || !is_ident(bytes[i - 1] as char)) => {
                let word = word_at(&code, i);
                let before = code[..i].trim_end().chars().next_back();
                let item_start = matches!(before, None | Some('{' | '}' | ';' | ']'));
                if word == "impl" && item_start {
                    if let Some(body) = code[i..].find(['{', ';']).filter(|&b| code.as_bytes()[i + b] == b'{')
                        && let Some(ty) = impl_type(&code[i..i + body])
                    {
                        open.push((depth + 1, ty));
                    }
                } else if word == "fn" && open.last().is_some_and(|(d, _)| *d == depth) {
                    let after = code[i + 2..].trim_start();
                    if after.starts_with(|ch: char| is_ident(ch)) && code[i + 2..].starts_with(char::is_whitespace) {
                        *counts.entry(open.last().unwrap().1.clone()).or_default() += 1;
                    }
                }
                i += word.len();
                continue;
            }
            _ => {}
        }
        i += 1;
    }
}

/// What is wrong with the counts: a type over the limit without a ceiling, over its
/// ceiling, or under it (lower the ceiling), and ceilings of types no longer found.
fn method_problems(counts: &BTreeMap<String, usize>, ceilings: &[(&str, usize)], max: usize) -> Vec<String> {
    let mut out = Vec::new();
    for (ty, &n) in counts {
        match ceilings.iter().find(|(t, _)| t == ty) {
            None if n > max => out.push(format!("{ty} has {n} methods, more than {max}")),
            Some(&(_, c)) if n > c => out.push(format!("{ty} has {n} methods, above its ceiling of {c}")),
            Some(&(_, c)) if n < c => out.push(format!(
                "{ty} has {n} methods, below its ceiling of {c}: lower the ceiling to {}",
                n.max(max)
            )),
            _ => {}
        }
    }
    for (ty, c) in ceilings {
        if !counts.contains_key(*ty) {
            out.push(format!("ceiling {c} for {ty}, which has no methods: remove the row"));
        } else if *c <= max {
            out.push(format!(
                "ceiling {c} for {ty} is within the limit of {max}: remove the row"
            ));
        }
    }
    out
}

#[test]
fn no_type_under_src_has_more_than_40_methods() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    let mut counts = BTreeMap::new();
    for path in &files {
        count_methods(&fs::read_to_string(path).unwrap(), &mut counts);
    }
    let total: usize = counts.values().sum();
    assert!(
        total > 1000,
        "only {total} methods found under src/: is the scan broken?"
    );
    let mut top: Vec<_> = counts.iter().collect();
    top.sort_by_key(|(t, n)| (std::cmp::Reverse(**n), (*t).clone()));
    eprintln!("most methods: {:?}", &top[..top.len().min(8)]);
    let problems = method_problems(&counts, METHOD_CEILINGS, MAX_METHODS);
    assert!(problems.is_empty(), "methods per type:\n{}", problems.join("\n"));
}

#[test]
fn the_method_count_sees_every_impl_block_and_nothing_else() {
    let a = r#"
impl Foo {
    pub fn a(&self) -> impl Iterator<Item = u8> { let s = "impl Bar { fn x() }"; let c = '{'; std::iter::empty() }
    pub(crate) const fn b() {}
    // fn commented() {}
    async fn c<'a>(x: &'a u8, f: fn(u8) -> u8) { fn nested() {} }
}
impl std::fmt::Debug for Foo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result { todo!() }
}
impl<T: Clone> Gen<T>
where
    T: Send,
{
    fn g(&self) {}
}
/* impl Foo { fn hidden() {} } */
"#;
    let b = r##"
#[cfg(test)]
mod tests {
    impl super::Foo {
        fn d(&self) { let r = r#"}"#; }
        unsafe fn e(&self) {}
    }
}
"##;
    let mut counts = BTreeMap::new();
    count_methods(a, &mut counts);
    count_methods(b, &mut counts);
    assert_eq!(counts, BTreeMap::from([("Foo".to_owned(), 5), ("Gen".to_owned(), 1)]));

    // Over the limit without a ceiling, over a ceiling, under one, and a stale row all fail.
    let counts = BTreeMap::from([("Foo".to_owned(), 5), ("Gen".to_owned(), 1), ("Big".to_owned(), 9)]);
    assert!(method_problems(&counts, &[("Foo", 5)], 4).len() == 1, "Big is over 4");
    let p = method_problems(&counts, &[("Foo", 6), ("Big", 9), ("Gone", 7)], 4);
    assert_eq!(p.len(), 2, "{p:?}");
    assert!(p[0].contains("lower the ceiling to 5"), "{p:?}");
    assert!(p[1].contains("Gone"), "{p:?}");
    assert!(method_problems(&counts, &[("Foo", 5), ("Big", 9)], 4).is_empty());
    assert!(
        !method_problems(&counts, &[("Foo", 5), ("Big", 8)], 4).is_empty(),
        "Big is above 8"
    );
}
