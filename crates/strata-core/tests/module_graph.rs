//! strata-core's modules form layers: every `crate::<module>` path in `src/**/*.rs` (a `use`
//! or a path in code; comments do not count) is an edge from the module of the file to
//! `<module>`, a root re-export (`crate::Error`) an edge to the module it comes from, and this
//! test fails, naming the cycle, if the edges are not a DAG.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `text` without comments and without the contents of string and char literals.
fn code_only(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                let mut depth = 0;
                while i < b.len() {
                    if b[i] == b'/' && b.get(i + 1) == Some(&b'*') {
                        depth += 1;
                        i += 2;
                    } else if b[i] == b'*' && b.get(i + 1) == Some(&b'/') {
                        depth -= 1;
                        i += 2;
                        if depth == 0 {
                            break;
                        }
                    } else {
                        i += 1;
                    }
                }
            }
            b'r' if matches!(b.get(i + 1), Some(b'"') | Some(b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                // a raw string: r"..." or r#"..."#
                let hashes = b[i + 1..].iter().take_while(|&&c| c == b'#').count();
                if b.get(i + 1 + hashes) != Some(&b'"') {
                    out.push('r');
                    i += 1;
                    continue;
                }
                let close: Vec<u8> = std::iter::once(b'"').chain(std::iter::repeat_n(b'#', hashes)).collect();
                i += 2 + hashes;
                while i < b.len() && !b[i..].starts_with(&close) {
                    i += 1;
                }
                i += close.len();
                out.push_str("\"\"");
            }
            b'"' => {
                i += 1;
                while i < b.len() && b[i] != b'"' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
                out.push_str("\"\"");
            }
            b'\'' if b.get(i + 2) == Some(&b'\'') || b.get(i + 1) == Some(&b'\\') => {
                // a char literal ('x', '\n', '\''), not a lifetime
                i += 1;
                while i < b.len() && b[i] != b'\'' {
                    i += if b[i] == b'\\' { 2 } else { 1 };
                }
                i += 1;
            }
            c => {
                out.push(c as char);
                i += 1;
            }
        }
    }
    out
}

fn ident_at(s: &str) -> &str {
    let end = s.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(s.len());
    &s[..end]
}

/// The first segment of each path in a `{...}` group starting at `s[0] == '{'`.
fn group_heads(s: &str) -> Vec<&str> {
    let mut heads = Vec::new();
    let mut depth = 0;
    let mut at_start = true;
    for (i, c) in s.char_indices() {
        match c {
            '{' => {
                depth += 1;
                at_start = depth == 1;
            }
            '}' => {
                depth -= 1;
                if depth == 0 {
                    break;
                }
            }
            ',' if depth == 1 => at_start = true,
            c if at_start && depth == 1 && !c.is_whitespace() => {
                heads.push(ident_at(&s[i..]));
                at_start = false;
            }
            _ => {}
        }
    }
    heads
}

/// The names `crate::` paths start with in `code`.
fn crate_refs(code: &str) -> Vec<&str> {
    let mut refs = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let rest = &code[at + "crate::".len()..];
        if rest.starts_with('{') {
            refs.extend(group_heads(rest));
        } else {
            refs.push(ident_at(rest));
        }
    }
    refs
}

/// The top-level modules declared in `lib.rs`, and the module each root re-export comes from.
fn root(lib: &str) -> (BTreeSet<String>, BTreeMap<String, String>) {
    let mut modules = BTreeSet::new();
    let mut reexports = BTreeMap::new();
    for stmt in lib.split(';') {
        // the statement without its attributes (`#[cfg(..)]` lines, the crate's `#![..]` lints)
        let stmt: String = stmt
            .lines()
            .map(str::trim)
            .filter(|l| !l.starts_with("#[") && !l.starts_with("#!["))
            .collect::<Vec<_>>()
            .join(" ");
        let stmt = stmt.trim();
        if let Some(m) = stmt.strip_prefix("pub mod ").or_else(|| stmt.strip_prefix("mod ")) {
            modules.insert(m.trim().to_string());
        } else if let Some(path) = stmt.strip_prefix("pub use ") {
            let (module, items) = path.split_once("::").unwrap_or((path, ""));
            let items = items.trim().trim_start_matches('{').trim_end_matches('}');
            for item in items.split(',').map(str::trim).filter(|i| !i.is_empty()) {
                let name = item.rsplit(" as ").next().unwrap_or(item).rsplit("::").next().unwrap_or(item);
                reexports.insert(name.trim().to_string(), module.trim().to_string());
            }
        }
    }
    (modules, reexports)
}

/// A cycle in `edges`, as the list of its modules (the first repeated at the end).
fn find_cycle(edges: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        m: &str,
        edges: &BTreeMap<String, BTreeSet<String>>,
        state: &mut BTreeMap<String, u8>,
        stack: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        state.insert(m.to_string(), 1);
        stack.push(m.to_string());
        for next in edges.get(m).into_iter().flatten() {
            match state.get(next.as_str()) {
                Some(1) => {
                    let from = stack.iter().position(|s| s == next).unwrap_or(0);
                    let mut cycle = stack[from..].to_vec();
                    cycle.push(next.clone());
                    return Some(cycle);
                }
                Some(_) => {}
                None => {
                    if let Some(c) = visit(next, edges, state, stack) {
                        return Some(c);
                    }
                }
            }
        }
        stack.pop();
        state.insert(m.to_string(), 2);
        None
    }
    let mut state = BTreeMap::new();
    for m in edges.keys() {
        if !state.contains_key(m.as_str()) {
            if let Some(c) = visit(m, edges, &mut state, &mut Vec::new()) {
                return Some(c);
            }
        }
    }
    None
}

/// The module graph of `src`: an edge set per top-level module.
fn module_graph(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let lib = std::fs::read_to_string(src.join("lib.rs")).unwrap();
    let (modules, reexports) = root(&code_only(&lib));
    assert!(modules.len() > 5, "found only {modules:?} in lib.rs");
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut edges: BTreeMap<String, BTreeSet<String>> = modules.iter().map(|m| (m.clone(), BTreeSet::new())).collect();
    for file in files {
        let rel = file.strip_prefix(src).unwrap();
        let first = rel.components().next().unwrap().as_os_str().to_string_lossy().into_owned();
        let from = first.trim_end_matches(".rs").to_string();
        if from == "lib" {
            continue;
        }
        assert!(modules.contains(&from), "{} is not in a module lib.rs declares", rel.display());
        let code = code_only(&std::fs::read_to_string(&file).unwrap());
        for name in crate_refs(&code) {
            let to = if modules.contains(name) {
                name.to_string()
            } else if let Some(m) = reexports.get(name) {
                m.clone()
            } else {
                panic!("{}: crate::{name} is neither a module nor a re-export of lib.rs", rel.display());
            };
            if to != from {
                edges.entry(from.clone()).or_default().insert(to);
            }
        }
    }
    edges
}

#[test]
fn core_modules_form_a_dag() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = module_graph(&src);
    if let Some(cycle) = find_cycle(&edges) {
        panic!("strata-core's modules import each other in a cycle: {}", cycle.join(" -> "));
    }
}

#[test]
fn the_implementer_module_depends_only_on_the_leaf_vocabulary() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let edges = module_graph(&src);
    let allowed = ["cross_device", "device", "embedding", "error", "group", "reduce", "timeline", "values"];
    let extra: Vec<&String> = edges["extended"].iter().filter(|m| !allowed.contains(&m.as_str())).collect();
    assert!(extra.is_empty(), "strata-core's extended module depends on {extra:?}; it may use only {allowed:?}");
}

#[test]
fn the_parser_sees_paths_groups_and_cycles() {
    let code = code_only(
        "use crate::{a::X, b, c::{D, E}};\n// crate::comment\nlet s = \"crate::string\"; f(crate::d::g);\n$crate::e",
    );
    assert_eq!(crate_refs(&code), ["a", "b", "c", "d"]);
    let edges: BTreeMap<String, BTreeSet<String>> = [
        ("a".to_string(), BTreeSet::from(["b".to_string()])),
        ("b".to_string(), BTreeSet::from(["c".to_string()])),
        ("c".to_string(), BTreeSet::from(["a".to_string()])),
    ]
    .into();
    assert_eq!(find_cycle(&edges).unwrap(), ["a", "b", "c", "a"]);
    let (modules, reexports) = root("pub mod a;\nmod b;\npub use a::{X, Y as Z};\npub use b::W;");
    assert_eq!(modules, BTreeSet::from(["a".to_string(), "b".to_string()]));
    assert_eq!(reexports["Z"], "a");
    assert_eq!(reexports["W"], "b");
}
