//! The safekeeper crate's modules form no import cycle (issue 26): a module that imports its
//! own tasks' types while they import it back (the timeline and its removal, backup and
//! recovery tasks; the configuration and the peer client) has no layer, and no part of it can
//! be tested or simulated alone. Reads every module's source (test code and comments left
//! out), takes each `crate::<module>` it names as an edge, and fails naming a cycle.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// Module name → the modules it names.
fn module_graph() -> BTreeMap<String, BTreeSet<String>> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    let mut files = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    for f in files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().to_string();
        let name = Path::new(&rel)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .to_string();
        if rel == "lib.rs"
            || rel.starts_with("bin/")
            || name == "tests.rs"
            || name == "sim.rs"
            || rel == "test_util.rs"
        {
            continue;
        }
        let module = rel
            .split('/')
            .next()
            .unwrap()
            .trim_end_matches(".rs")
            .to_string();
        let text = std::fs::read_to_string(&f).unwrap();
        let code = match text.find("#[cfg(test)]\nmod tests {") {
            Some(i) => &text[..i],
            None => &text[..],
        };
        let deps = graph.entry(module.clone()).or_default();
        let code: String = code
            .lines()
            .map(|l| l.split("//").next().unwrap())
            .collect::<Vec<_>>()
            .join("\n");
        for dep in crate_paths(&code) {
            if dep != module {
                deps.insert(dep);
            }
        }
    }
    graph
}

/// The first segment of every `crate::` path in `code`, grouped imports included
/// (`use crate::{a, b::{C, D}}` names `a` and `b`).
fn crate_paths(code: &str) -> Vec<String> {
    let ident = |s: &str| -> String {
        s.trim_start()
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut out = Vec::new();
    let mut rest = code;
    while let Some(i) = rest.find("crate::") {
        rest = &rest[i + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            out.push(ident(rest));
            continue;
        };
        // The items at depth one of the group, each up to its comma.
        let (mut depth, mut item_start) = (0usize, 0usize);
        for (j, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => {
                    out.push(ident(&group[item_start..j]));
                    break;
                }
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    out.push(ident(&group[item_start..j]));
                    item_start = j + 1;
                }
                _ => {}
            }
        }
    }
    out.retain(|d| !d.is_empty() && d != "self");
    out
}

#[test]
fn grouped_imports_are_edges_too() {
    let code = "use crate::{config::Conf, daemon,\n    wal_store::{A, B}};\nlet x = crate::lifecycle::run;";
    assert_eq!(
        crate_paths(code),
        ["config", "daemon", "wal_store", "lifecycle"]
    );
}

/// A cycle through `start`, if there is one (depth-first search).
fn cycle_from(
    graph: &BTreeMap<String, BTreeSet<String>>,
    start: &str,
    node: &str,
    path: &mut Vec<String>,
    seen: &mut BTreeSet<String>,
) -> Option<Vec<String>> {
    for dep in graph.get(node).into_iter().flatten() {
        if dep == start {
            let mut c = path.clone();
            c.push(start.to_string());
            return Some(c);
        }
        if graph.contains_key(dep) && seen.insert(dep.clone()) {
            path.push(dep.clone());
            if let Some(c) = cycle_from(graph, start, dep, path, seen) {
                return Some(c);
            }
            path.pop();
        }
    }
    None
}

#[test]
fn the_modules_form_no_import_cycle() {
    let graph = module_graph();
    assert!(
        graph.contains_key("timeline") && graph["timeline"].contains("wal_store"),
        "the graph is read: {graph:?}"
    );
    for start in graph.keys() {
        let mut path = vec![start.clone()];
        if let Some(cycle) = cycle_from(&graph, start, start, &mut path, &mut BTreeSet::new()) {
            panic!("import cycle: {}", cycle.join(" -> "));
        }
    }
}
