//! The crate's import graph, read from every source file, held against an
//! explicit table of layers: each file (a module, or one file of a folder
//! module) may import only files of its own layer or of layers below, the
//! graph has no circle (a folder's `mod.rs` and its children included),
//! no file of the transport layer launches a kernel, and no file names an
//! item through the root's re-exports (`crate::Error` for
//! `crate::error::Error`): that would import the root from below it.
//!
//! An import is any `crate::path` (resolved to the longest path that names
//! a file, or through the root's re-exports such as `crate::Error`), any
//! `super::path` (resolved the same way from the file's parent), and, in a
//! file that declares child modules, any use of a child's name as a path.
//! Comments and `#[cfg(test)] mod` blocks are not read.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers, from the top: a file may import files of its own layer and
/// of the layers after it. Every file of the crate is in exactly one.
const LAYERS: &[(&str, &[&str])] = &[
    (
        "api",
        &[
            "",
            "compat",
            "compat::nccl",
            "comm",
            "comm::group",
            "comm::raw",
            "comm::split",
            "traits",
            "args",
            "collectives",
            "group",
            "group_raw",
            "ipc",
            "ipc::comm",
            "ipc::comm::api",
            "ipc::comm::calls",
            "ipc::comm::create",
            "ipc::comm::ops",
            "ipc::comm::options",
            "ipc::comm::p2p",
            "ipc::comm::pace",
            "ipc::tiered",
            "ipc::nccl",
        ],
    ),
    (
        "algorithms",
        &[
            "algorithms",
            "algorithms::check",
            "algorithms::common",
            "algorithms::mesh",
            "algorithms::oneshot",
            "algorithms::ring",
            "algorithms::schedule",
        ],
    ),
    ("engine", &["communicator", "failure", "launch", "reach", "kernels", "kernels::launch", "kernels::load", "kernels::list"]),
    (
        "transport",
        &[
            "copy",
            "copy::decide",
            "copy::plan",
            "copy::route",
            "copy::staged",
            "copy::verify",
            "verdict",
            "peer",
            "topology",
            "ipc::bootstrap",
            "ipc::fdpass",
            "ipc::host",
            "ipc::id",
            "ipc::secret",
            "ipc::shm",
            "ipc::threads",
            "ipc::vmm",
            "ipc::wire",
        ],
    ),
    ("ordering", &["sync", "graph", "raw"]),
    ("base", &["driver", "dtype", "error"]),
];

/// The crate's `src`, or `None` (after saying so past libtest's capture)
/// where the test binary runs away from its sources (a GPU machine's copy).
fn source_dir() -> Option<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    if src.join("lib.rs").is_file() {
        return Some(src);
    }
    let name = std::thread::current().name().unwrap_or("layering").to_string();
    use std::io::Write;
    let _ = writeln!(std::io::stderr().lock(), "SKIPPED {name}: the sources are not at {}", src.display());
    None
}

/// Every `.rs` file under `dir`, recursively, but this one.
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).expect("src is readable") {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("src/layering.rs") {
            out.push(path);
        }
    }
}

/// A file's module path (`ipc::comm::api`; `""` for `lib.rs`).
fn module_of(src: &Path, file: &Path) -> String {
    let rel = file.strip_prefix(src).expect("under src").with_extension("");
    let mut parts: Vec<String> = rel.components().map(|c| c.as_os_str().to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod") || parts == ["lib"] {
        parts.pop();
    }
    parts.join("::")
}

/// The longest prefix of `path` (`a::b::Name`) that is a module of
/// `modules`, or the module a root re-export of its first segment names.
fn resolve(path: &[&str], modules: &BTreeSet<String>, reexports: &BTreeMap<String, String>) -> Option<String> {
    for n in (1..=path.len()).rev() {
        let candidate = path[..n].join("::");
        if modules.contains(&candidate) {
            return Some(candidate);
        }
    }
    let first = path.first()?;
    let target = reexports.get(*first)?;
    let target: Vec<&str> = target.split("::").collect();
    resolve(&target, modules, reexports)
}

/// The path segments after `at` in `line` (`a::b::c`, stopping at `{`, a
/// space or any other character that cannot continue a path).
fn path_after(line: &str, at: usize) -> Vec<&str> {
    let rest = &line[at..];
    let end = rest.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')).unwrap_or(rest.len());
    rest[..end].split("::").filter(|s| !s.is_empty()).collect()
}

/// A file's code lines: no comments, nothing from its top-level
/// `#[cfg(test)] mod` on (other attributes may stand between the two).
fn code_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let test_module = |i: usize| {
        lines[i] == "#[cfg(test)]"
            && lines[i + 1..].iter().find(|l| !l.starts_with("#[")).is_some_and(|l| l.starts_with("mod ") || l.starts_with("pub mod "))
    };
    let end = (0..lines.len()).find(|&i| test_module(i)).unwrap_or(lines.len());
    lines[..end].iter().copied().filter(|l| !l.trim_start().starts_with("//")).collect()
}

/// Whether `line` uses `name` as the first segment of a path (`name::`),
/// not as the tail of a longer one.
fn uses_child(line: &str, name: &str) -> bool {
    let needle = format!("{name}::");
    line.match_indices(&needle).any(|(i, _)| {
        let before = &line[..i];
        let prev = before.chars().last();
        prev.is_none_or(|c| !(c.is_ascii_alphanumeric() || c == '_' || c == ':')) || before.ends_with("self::")
    })
}

/// `module -> modules it imports`.
type Edges = BTreeMap<String, BTreeSet<String>>;

/// The crate's modules, their imports, and the root's re-exports (`name ->
/// module`).
fn graph() -> Option<(BTreeSet<String>, Edges, BTreeMap<String, String>)> {
    let src = source_dir()?;
    let mut paths = Vec::new();
    files(&src, &mut paths);
    let modules: BTreeSet<String> = paths.iter().map(|p| module_of(&src, p)).collect();
    // The root's re-exports: `pub use module::{A, B};` and `pub use module::A;`.
    let lib = std::fs::read_to_string(src.join("lib.rs")).expect("lib.rs");
    let mut reexports = BTreeMap::new();
    for line in code_lines(&lib) {
        let Some(rest) = line.trim().strip_prefix("pub use ").and_then(|r| r.strip_suffix(';')) else { continue };
        let (module, names) = match rest.split_once("::{") {
            Some((m, names)) => (m, names.trim_end_matches('}').split(',').map(str::trim).collect::<Vec<_>>()),
            None => match rest.rsplit_once("::") {
                Some((m, name)) => (m, vec![name.trim()]),
                None => continue,
            },
        };
        for name in names.into_iter().filter(|n| !n.is_empty()) {
            reexports.insert(name.to_string(), module.to_string());
        }
    }
    let mut edges = Edges::new();
    for p in &paths {
        let from = module_of(&src, p);
        let text = std::fs::read_to_string(p).expect("a readable source file");
        // `super` of `a::b` (a file `a/b.rs` or `a/b/mod.rs`) is `a`.
        let parent: Vec<&str> = from.split("::").filter(|s| !s.is_empty()).collect();
        let parent = &parent[..parent.len().saturating_sub(1)];
        let lines = code_lines(&text);
        let children: Vec<String> = lines
            .iter()
            .filter_map(|l| {
                let l = l.trim();
                let l = l.strip_prefix("pub(crate) ").or_else(|| l.strip_prefix("pub ")).unwrap_or(l);
                l.strip_prefix("mod ").and_then(|m| m.strip_suffix(';')).map(str::to_string)
            })
            .collect();
        let mut to = BTreeSet::new();
        for line in &lines {
            for (i, _) in line.match_indices("crate::") {
                if let Some(m) = resolve(&path_after(line, i + "crate::".len()), &modules, &reexports) {
                    to.insert(m);
                }
            }
            for (i, _) in line.match_indices("super::") {
                if line[..i].ends_with("super::") {
                    continue; // counted from the first `super::` of the chain
                }
                let mut base: Vec<&str> = parent.to_vec();
                let mut tail = path_after(line, i + "super::".len());
                while tail.first() == Some(&"super") {
                    base.pop();
                    tail.remove(0);
                }
                let full: Vec<&str> = base.iter().copied().chain(tail).collect();
                let m = resolve(&full, &modules, &reexports).unwrap_or_else(|| base.join("::"));
                to.insert(m);
            }
            if !line.trim_start().starts_with("mod ") && !line.contains(" mod ") {
                for c in &children {
                    let child = if from.is_empty() { c.clone() } else { format!("{from}::{c}") };
                    if modules.contains(&child) && uses_child(line, c) {
                        to.insert(child);
                    }
                }
            }
        }
        to.remove(&from);
        edges.insert(from, to);
    }
    Some((modules, edges, reexports))
}

/// A circle in `graph`, if there is one.
fn cycle(graph: &Edges) -> Option<Vec<String>> {
    fn visit(n: &str, graph: &Edges, done: &mut BTreeSet<String>, stack: &mut Vec<String>) -> Option<Vec<String>> {
        if let Some(at) = stack.iter().position(|s| s == n) {
            let mut c = stack[at..].to_vec();
            c.push(n.to_string());
            return Some(c);
        }
        if done.contains(n) {
            return None;
        }
        stack.push(n.to_string());
        for m in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(m, graph, done, stack) {
                return Some(c);
            }
        }
        stack.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
}

/// Each module's layer index in [`LAYERS`].
fn layer_of() -> BTreeMap<&'static str, usize> {
    LAYERS.iter().enumerate().flat_map(|(i, (_, ms))| ms.iter().map(move |m| (*m, i))).collect()
}

#[test]
fn every_file_is_in_one_layer() {
    let Some((modules, _, _)) = graph() else { return };
    let layers = layer_of();
    let listed: usize = LAYERS.iter().map(|(_, ms)| ms.len()).sum();
    assert_eq!(listed, layers.len(), "a module is listed in two layers");
    let missing: Vec<&String> = modules.iter().filter(|m| !layers.contains_key(m.as_str())).collect();
    assert!(missing.is_empty(), "modules in no layer of LAYERS: {missing:?}");
    let stale: Vec<&&str> = layers.keys().filter(|m| !modules.contains(**m)).collect();
    assert!(stale.is_empty(), "LAYERS names modules that do not exist: {stale:?}");
}

#[test]
fn imports_point_down_the_layers() {
    let Some((_, edges, _)) = graph() else { return };
    let layers = layer_of();
    let mut wrong = Vec::new();
    for (from, tos) in &edges {
        let Some(&lf) = layers.get(from.as_str()) else { continue };
        for to in tos {
            if let Some(&lt) = layers.get(to.as_str()) {
                if lt < lf {
                    wrong.push(format!("{from} ({}) -> {to} ({})", LAYERS[lf].0, LAYERS[lt].0));
                }
            }
        }
    }
    assert!(wrong.is_empty(), "imports up the layers: {wrong:#?}");
}

#[test]
fn files_import_each_other_without_circles() {
    let Some((_, edges, _)) = graph() else { return };
    let circle = cycle(&edges);
    assert!(circle.is_none(), "import circle {circle:?}; graph: {edges:#?}");
}

#[test]
fn the_transport_launches_no_kernel() {
    let Some(src) = source_dir() else { return };
    let mut paths = Vec::new();
    files(&src, &mut paths);
    let transport = LAYERS.iter().find(|(name, _)| *name == "transport").expect("a transport layer").1;
    for p in paths {
        let m = module_of(&src, &p);
        if transport.contains(&m.as_str()) {
            let text = std::fs::read_to_string(&p).expect("readable");
            for line in code_lines(&text) {
                assert!(!line.contains("launch_builder") && !line.contains("kernels::launch"), "{m} launches a kernel: {line}");
            }
        }
    }
}

#[test]
fn files_name_the_module_an_item_lives_in_not_the_roots_reexports() {
    let Some(src) = source_dir() else { return };
    let Some((modules, _, reexports)) = graph() else { return };
    let mut paths = Vec::new();
    files(&src, &mut paths);
    let mut through_root = Vec::new();
    for p in paths.iter().filter(|p| !p.ends_with("src/lib.rs")) {
        let text = std::fs::read_to_string(p).expect("a readable source file");
        for line in code_lines(&text) {
            for (i, _) in line.match_indices("crate::") {
                let path = path_after(line, i + "crate::".len());
                if let Some(first) = path.first().filter(|f| !modules.contains(**f) && reexports.contains_key(**f)) {
                    through_root.push(format!("{}: crate::{first}", module_of(&src, p)));
                }
            }
        }
    }
    assert!(through_root.is_empty(), "name the module instead of the root's re-export: {through_root:#?}");
}

#[test]
fn the_reader_sees_the_imports_it_must() {
    let Some((_, edges, reexports)) = graph() else { return };
    let has = |a: &str, b: &str| edges.get(a).is_some_and(|s| s.contains(b));
    // Through the root's re-exports, `super::`, a folder's children, and paths in braces.
    assert_eq!(reexports.get("Error").map(String::as_str), Some("error"));
    assert!(has("comm", "error") && has("comm", "ipc") && has("comm", "traits"), "{edges:#?}");
    assert!(has("ipc::comm::api", "ipc::comm"), "super:: from a child: {edges:#?}");
    assert!(has("kernels::launch", "kernels"), "super::{{..}}: {edges:#?}");
    assert!(has("copy", "copy::staged"), "a folder's use of its child: {edges:#?}");
    assert!(has("group", "algorithms") && has("algorithms", "communicator") && has("communicator", "copy"), "{edges:#?}");
}

#[test]
fn a_circle_is_found() {
    let mut g = Edges::new();
    g.entry("a".into()).or_default().insert("b".into());
    g.entry("b".into()).or_default().insert("a".into());
    assert_eq!(cycle(&g), Some(vec!["a".to_string(), "b".into(), "a".into()]));
    assert!(uses_child("    staged::f();", "staged") && uses_child("use self::staged::X;", "staged"));
    assert!(!uses_child("copy::staged::f()", "staged"));
}
