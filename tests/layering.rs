//! The crate's structure, read from `src/`: every `.rs` file is a module, every reference to
//! another module (`use crate::…`, `super::…`, `crate::…` in code, a child module's path) an
//! import edge to the file that defines the name (re-exports are followed). Two rules:
//!
//! - **No import cycle** between modules.
//! - **No upward import**: each module has a layer (`LAYERS` below, the order of
//!   `ARCHITECTURE.md`), and a module imports only from its own layer or lower ones.
//!
//! A cycle through a folder of modules is not always one between two files: exec imported the
//! tape (`autograd/tape.rs`, `autograd/pending.rs`) while other files of the same folder
//! (`autograd/backward.rs`, `autograd/leaf.rs`) import exec, and `pending.rs` runs ops through
//! methods (`.addmm_(…)`), which no path names. So a folder that observes a module below it is
//! checked as one unit (`OBSERVERS`): nothing the module reaches, directly or through others,
//! may be in the folder.
//!
//! The test fails on any upward import and on any cycle, naming the files.
//! `cargo test --release --test layering -- --nocapture` prints the figures: modules, edges,
//! upward edges and cycles.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::path::{Path, PathBuf};

/// Rooms (a folder of modules) that observe a module below them, and that module: the room
/// imports it, and it reaches nothing in the room, directly or through other modules; it calls
/// the room only through an interface it declares and the room implements (bound at compile
/// time, as `observe` is for the timeline). The room counts as one unit here: its files that
/// import the lower module (`backward.rs`) are not the ones the lower module would import
/// (`tape.rs`, `pending.rs`), so the cycle is one between the room and the module, which the
/// graph of files does not show (and a call of a method, `.addmm_(…)`, is no path to read).
const OBSERVERS: &[(&str, &str)] = &[
    // The tape observes how ops run (settling pending products, refusing in-place reads of
    // saved arrays); exec knows nothing of it.
    ("ndarray::autograd", "ndarray::exec"),
];

/// The layers, lowest first: a module path prefix (longest match wins) and its layer.
const LAYERS: &[(&str, u32)] = &[
    // Ground: plain types.
    ("error", 0),
    ("dtype", 0),
    ("shape", 0),
    ("device", 0),
    ("host", 0),
    // The lock order (ranks checked in debug builds).
    ("locks", 0),
    // Per-device accounting, limits and counters.
    ("memory", 1),
    // The memory events the core emits, and the switch that says whether anyone listens.
    ("observe", 1),
    // Memory and kernels: host and device storage, blocks, the op families.
    ("backend", 2),
    // Keys, slots and the owner table.
    ("arena", 3),
    // The workspace allocator and cycle state machine.
    ("workspace", 4),
    // The state behind the arena lock: the one `State`, its lock and deferred work.
    ("state", 5),
    // The manager tree's handle and scopes, and the workspace handle's locked operations.
    ("manager", 6),
    ("workspace::handle", 6),
    // Arrays and their op front-ends, and what reads the tree.
    ("ndarray", 7),
    ("report", 7),
    ("testing", 7),
    // Built on the core.
    ("print", 8),
    ("persist", 8),
    ("prefetch", 8),
    ("inference", 8),
    ("optim", 8),
    // Loss scaling over the optimizers' flagged steps.
    ("amp", 8),
    ("layer_workspace", 8),
    ("timeline", 8),
    // Data-parallel training over several devices (NCCL).
    ("training", 8),
    // Several processes, one rank each: torchrun's configuration and the TCP rendezvous.
    ("distributed", 8),
    ("cuda", 8),
    // The crate root re-exports everything.
    ("", 9),
];

fn src_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("src")
}

/// Every `.rs` file under `src/`, relative to it.
fn rust_files(dir: &Path, base: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = fs::read_dir(dir)
        .expect("src/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(&path, base, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.strip_prefix(base).expect("under src").to_path_buf());
        }
    }
}

/// The module path of a file: `arena/mod.rs` → `arena`, `arena/memory.rs` → `arena::memory`,
/// `lib.rs` → `` (the crate root).
fn module_of(file: &Path) -> String {
    let mut parts: Vec<String> = file
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().expect("a file name");
    let stem = last.trim_end_matches(".rs");
    if stem != "mod" && stem != "lib" {
        parts.push(stem.to_string());
    }
    parts.join("::")
}

/// The source with comments, string and char literals blanked, and `#[cfg(test)]` modules cut.
fn code_of(text: &str) -> String {
    let b = text.as_bytes();
    let mut out = String::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if c == b'/' && b.get(i + 1) == Some(&b'/') {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
        } else if c == b'/' && b.get(i + 1) == Some(&b'*') {
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
            out.push(' ');
        } else if c == b'r'
            && (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
            && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_'))
        {
            // A raw string r"…" or r#"…"#.
            let mut j = i + 1;
            let mut hashes = 0;
            while b.get(j) == Some(&b'#') {
                hashes += 1;
                j += 1;
            }
            if b.get(j) != Some(&b'"') {
                out.push('r');
                i += 1;
                continue;
            }
            j += 1;
            loop {
                if j >= b.len() {
                    break;
                }
                if b[j] == b'"' && (0..hashes).all(|h| b.get(j + 1 + h) == Some(&b'#')) {
                    j += 1 + hashes;
                    break;
                }
                j += 1;
            }
            out.push_str("\"\"");
            i = j;
        } else if c == b'"' {
            i += 1;
            while i < b.len() && b[i] != b'"' {
                if b[i] == b'\\' {
                    i += 1;
                }
                i += 1;
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == b'\'' {
            // A char literal ('x', '\n', '\u{..}') or a lifetime ('a).
            if b.get(i + 1) == Some(&b'\\') {
                let mut j = i + 2;
                while j < b.len() && b[j] != b'\'' {
                    j += 1;
                }
                i = j + 1;
                out.push_str("' '");
            } else if b.get(i + 2) == Some(&b'\'') {
                i += 3;
                out.push_str("' '");
            } else {
                // A multi-byte char literal, or a lifetime.
                let s = &text[i + 1..];
                let ch = s.chars().next().map_or(0, char::len_utf8);
                if ch > 1 && s.as_bytes().get(ch) == Some(&b'\'') {
                    i += 2 + ch;
                    out.push_str("' '");
                } else {
                    out.push('\'');
                    i += 1;
                }
            }
        } else {
            let ch = text[i..].chars().next().expect("a char");
            out.push(ch);
            i += ch.len_utf8();
        }
    }
    cut_test_modules(&out)
}

/// Removes `#[cfg(test)] mod … { … }` blocks: unit tests may reach anywhere.
fn cut_test_modules(code: &str) -> String {
    let mut out = code.to_string();
    while let Some(at) = out.find("#[cfg(test)]") {
        let rest = &out[at + "#[cfg(test)]".len()..];
        let trimmed = rest.trim_start();
        let is_mod = trimmed.starts_with("mod ") || trimmed.starts_with("pub(crate) mod ");
        let end = if is_mod {
            match rest.find('{') {
                Some(open) => {
                    let mut depth = 0;
                    let mut end = rest.len();
                    for (k, ch) in rest[open..].char_indices() {
                        match ch {
                            '{' => depth += 1,
                            '}' => {
                                depth -= 1;
                                if depth == 0 {
                                    end = open + k + 1;
                                    break;
                                }
                            }
                            _ => {}
                        }
                    }
                    end
                }
                None => 0,
            }
        } else {
            0
        };
        let cut_to = at + "#[cfg(test)]".len() + end;
        out.replace_range(at..cut_to, " ");
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// One `use` declaration, expanded: each imported path, and whether it is a re-export.
struct UseDecl {
    paths: Vec<Vec<String>>,
    reexport: bool,
}

/// Expands a use tree (`a::{b, c::{d, e as f}}`, `a::*`) into paths.
fn expand_tree(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if tree.is_empty() {
        return;
    }
    // Split at the first top-level `{`.
    if let Some(open) = tree.find('{') {
        let head: Vec<String> = tree[..open]
            .split("::")
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect();
        let close = tree.rfind('}').unwrap_or(tree.len());
        let inner = &tree[open + 1..close];
        let mut depth = 0;
        let mut start = 0;
        let mut parts = Vec::new();
        for (k, ch) in inner.char_indices() {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ',' if depth == 0 => {
                    parts.push(&inner[start..k]);
                    start = k + 1;
                }
                _ => {}
            }
        }
        parts.push(&inner[start..]);
        let mut base = prefix.to_vec();
        base.extend(head);
        for part in parts {
            expand_tree(part, &base, out);
        }
    } else {
        let without_alias = tree.split(" as ").next().unwrap_or(tree);
        let mut path = prefix.to_vec();
        path.extend(
            without_alias
                .split("::")
                .map(str::trim)
                .filter(|s| !s.is_empty())
                .map(String::from),
        );
        if path.last().is_some_and(|s| s == "self") {
            path.pop();
        }
        out.push(path);
    }
}

/// The `use` declarations of a file's code.
fn use_decls(code: &str) -> Vec<UseDecl> {
    let mut decls = Vec::new();
    let bytes = code.as_bytes();
    let mut search = 0;
    while let Some(found) = code[search..].find("use ") {
        let at = search + found;
        search = at + 4;
        if at > 0 && is_ident(bytes[at - 1] as char) {
            continue;
        }
        // What stands before `use` on its statement: `pub`, `pub(crate)`, or nothing.
        let line_start = code[..at].rfind(['\n', ';', '{', '}']).map_or(0, |p| p + 1);
        let before = code[line_start..at].trim();
        let before = before
            .split(']')
            .next_back()
            .unwrap_or(before)
            .trim()
            .to_string();
        if !(before.is_empty() || before.starts_with("pub")) {
            continue;
        }
        let Some(end) = code[at..].find(';') else {
            break;
        };
        let tree = &code[at + 4..at + end];
        let mut paths = Vec::new();
        expand_tree(tree, &[], &mut paths);
        decls.push(UseDecl {
            paths,
            reexport: before.starts_with("pub"),
        });
        search = at + end;
    }
    decls
}

/// Names a file defines at its top level (items at brace depth 0), for glob re-exports.
fn defined_names(code: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut depth = 0i32;
    let mut line = String::new();
    for ch in code.chars() {
        match ch {
            '{' => {
                if depth == 0 {
                    collect_item(&line, &mut names);
                }
                depth += 1;
                line.clear();
            }
            '}' => {
                depth -= 1;
                line.clear();
            }
            ';' if depth == 0 => {
                collect_item(&line, &mut names);
                line.clear();
            }
            _ if depth == 0 => line.push(ch),
            _ => {}
        }
    }
    names
}

fn collect_item(statement: &str, names: &mut BTreeSet<String>) {
    let words: Vec<&str> = statement
        .split(|c: char| !is_ident(c) && c != '!')
        .filter(|w| !w.is_empty())
        .collect();
    for pair in words.windows(2) {
        if matches!(
            pair[0],
            "fn" | "struct" | "enum" | "trait" | "const" | "static" | "type" | "union" | "mod"
        ) || pair[0] == "macro_rules!"
        {
            names.insert(pair[1].to_string());
            return;
        }
    }
}

struct Crate {
    /// module path → file (relative to src/).
    files: BTreeMap<String, PathBuf>,
    /// module path → stripped code.
    code: HashMap<String, String>,
    /// module path → its `use` declarations.
    uses: HashMap<String, Vec<UseDecl>>,
    /// module path → names it defines.
    defined: HashMap<String, BTreeSet<String>>,
}

impl Crate {
    fn read() -> Crate {
        let src = src_dir();
        let mut list = Vec::new();
        rust_files(&src, &src, &mut list);
        let mut files = BTreeMap::new();
        let mut code = HashMap::new();
        let mut uses = HashMap::new();
        let mut defined = HashMap::new();
        for file in list {
            let module = module_of(&file);
            let text = fs::read_to_string(src.join(&file)).expect("a readable source file");
            let stripped = code_of(&text);
            uses.insert(module.clone(), use_decls(&stripped));
            defined.insert(module.clone(), defined_names(&stripped));
            code.insert(module.clone(), stripped);
            files.insert(module, file);
        }
        Crate {
            files,
            code,
            uses,
            defined,
        }
    }

    fn is_module(&self, m: &str) -> bool {
        self.files.contains_key(m)
    }

    fn join(base: &str, name: &str) -> String {
        if base.is_empty() {
            name.to_string()
        } else {
            format!("{base}::{name}")
        }
    }

    fn parent(m: &str) -> String {
        m.rsplit_once("::")
            .map_or(String::new(), |(p, _)| p.to_string())
    }

    /// The absolute segments of a path written in module `from`, or `None` for another crate.
    fn absolute(&self, from: &str, path: &[String]) -> Option<Vec<String>> {
        let first = path.first()?;
        let mut base: Vec<String> = Vec::new();
        let mut rest = path;
        match first.as_str() {
            "crate" => rest = &path[1..],
            "self" => {
                base = split(from);
                rest = &path[1..];
            }
            "super" => {
                let mut m = from.to_string();
                while rest.first().is_some_and(|s| s == "super") {
                    m = Self::parent(&m);
                    rest = &rest[1..];
                }
                base = split(&m);
            }
            name => {
                // A child module of `from` (2018 paths), else another crate.
                if self.is_module(&Self::join(from, name)) {
                    base = split(from);
                } else {
                    return None;
                }
            }
        }
        base.extend(rest.iter().cloned());
        Some(base)
    }

    /// The file (module) that defines what `path` (absolute) names, following re-exports.
    fn resolve(&self, path: &[String], hops: u32) -> Option<String> {
        if hops > 16 {
            return None;
        }
        // The longest prefix that is a module.
        let mut module = String::new();
        let mut k = 0;
        while k < path.len() && self.is_module(&Self::join(&module, &path[k])) {
            module = Self::join(&module, &path[k]);
            k += 1;
        }
        let Some(item) = path.get(k) else {
            return Some(module);
        };
        if self.defined.get(&module).is_some_and(|d| d.contains(item)) {
            return Some(module);
        }
        // A re-export of `item` in `module`.
        for decl in self.uses.get(&module).into_iter().flatten() {
            if !decl.reexport {
                continue;
            }
            for p in &decl.paths {
                let Some(abs) = self.absolute(&module, p) else {
                    continue;
                };
                if p.last() == Some(item) {
                    let mut target = abs.clone();
                    target.extend(path[k + 1..].iter().cloned());
                    return self.resolve(&target, hops + 1);
                }
                if p.last().is_some_and(|s| s == "*") {
                    let glob = &abs[..abs.len() - 1];
                    let mut target = glob.to_vec();
                    target.extend(path[k..].iter().cloned());
                    if let Some(found) = self.resolve(&target, hops + 1) {
                        if found != glob.join("::")
                            || self.defined.get(&found).is_some_and(|d| d.contains(item))
                        {
                            return Some(found);
                        }
                    }
                }
            }
        }
        Some(module)
    }

    /// The import edges of the crate: (from module, to module).
    fn edges(&self) -> BTreeSet<(String, String)> {
        let mut edges = BTreeSet::new();
        for (module, decls) in &self.uses {
            let is_parent_face = self.files[module].ends_with("mod.rs") || module.is_empty();
            for decl in decls {
                for p in &decl.paths {
                    let Some(abs) = self.absolute(module, p) else {
                        continue;
                    };
                    // A parent re-exporting its own child is the child's public face, no edge.
                    if decl.reexport && is_parent_face && abs.starts_with(&split(module)) {
                        continue;
                    }
                    let abs: Vec<String> = abs.into_iter().filter(|s| s != "*").collect();
                    if let Some(to) = self.resolve(&abs, 0) {
                        if &to != module {
                            edges.insert((module.clone(), to));
                        }
                    }
                }
            }
            // Paths written in code: crate::a::b, super::a, child::a.
            let code = &self.code[module];
            for path in inline_paths(code) {
                let Some(abs) = self.absolute(module, &path) else {
                    continue;
                };
                if let Some(to) = self.resolve(&abs, 0) {
                    if &to != module {
                        edges.insert((module.clone(), to));
                    }
                }
            }
        }
        edges
    }

    fn file(&self, module: &str) -> String {
        self.files[module].to_string_lossy().into_owned()
    }
}

fn split(m: &str) -> Vec<String> {
    if m.is_empty() {
        Vec::new()
    } else {
        m.split("::").map(String::from).collect()
    }
}

/// `a::b::c` paths in code outside `use` declarations (the first segment is checked later).
fn inline_paths(code: &str) -> Vec<Vec<String>> {
    let mut paths = Vec::new();
    let chars: Vec<char> = code.chars().collect();
    let mut i = 0;
    let mut in_use = false;
    while i < chars.len() {
        let c = chars[i];
        if c == ';' {
            in_use = false;
        }
        if is_ident(c) && (i == 0 || !(is_ident(chars[i - 1]) || chars[i - 1] == ':')) {
            let mut j = i;
            let mut segments = Vec::new();
            loop {
                let start = j;
                while j < chars.len() && is_ident(chars[j]) {
                    j += 1;
                }
                segments.push(chars[start..j].iter().collect::<String>());
                if j + 2 < chars.len()
                    && chars[j] == ':'
                    && chars[j + 1] == ':'
                    && is_ident(chars[j + 2])
                {
                    j += 2;
                } else {
                    break;
                }
            }
            if segments.len() == 1 && segments[0] == "use" {
                in_use = true;
            } else if !in_use && segments.len() > 1 {
                paths.push(segments);
            }
            i = j;
        } else {
            i += 1;
        }
    }
    paths
}

fn layer_of(module: &str) -> u32 {
    LAYERS
        .iter()
        .filter(|(prefix, _)| {
            prefix.is_empty() || module == *prefix || module.starts_with(&format!("{prefix}::"))
        })
        .max_by_key(|(prefix, _)| prefix.len())
        .map_or(u32::MAX, |(_, layer)| *layer)
}

/// Whether `module` is `room` or inside it.
fn in_room(module: &str, room: &str) -> bool {
    module == room || module.starts_with(&format!("{room}::"))
}

/// The cycles between an observer room and the module it observes (see `OBSERVERS`): for each
/// import path from the module into the room (shortest first found), the path, closed by one
/// of the room's imports of the module. Also a problem when the room imports the module no
/// more (the entry would check nothing).
fn observer_cycles(edges: &BTreeSet<(String, String)>) -> (Vec<Vec<String>>, Vec<String>) {
    let mut next: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
    for (a, b) in edges {
        next.entry(a.as_str()).or_default().push(b.as_str());
    }
    let mut cycles = Vec::new();
    let mut stale = Vec::new();
    for &(room, lower) in OBSERVERS {
        let Some((importer, _)) = edges
            .iter()
            .find(|(a, b)| in_room(a, room) && !in_room(b, room) && in_room(b, lower))
        else {
            stale.push(format!(
                "{room} does not import {lower}: remove its entry from OBSERVERS"
            ));
            continue;
        };
        // Breadth first from `lower`, not entering the room's own files until the end.
        let mut came_from: BTreeMap<&str, &str> = BTreeMap::new();
        let mut queue = std::collections::VecDeque::from([lower]);
        let mut seen = BTreeSet::from([lower]);
        while let Some(m) = queue.pop_front() {
            for &n in next.get(m).into_iter().flatten() {
                if !seen.insert(n) {
                    continue;
                }
                came_from.insert(n, m);
                if in_room(n, room) {
                    let mut path = vec![n.to_string()];
                    let mut at = n;
                    while let Some(&back) = came_from.get(at) {
                        path.push(back.to_string());
                        at = back;
                    }
                    path.reverse();
                    path.push(importer.clone());
                    path.push(lower.to_string());
                    cycles.push(path);
                } else {
                    queue.push_back(n);
                }
            }
        }
    }
    (cycles, stale)
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles(nodes: &[String], edges: &BTreeSet<(String, String)>) -> Vec<BTreeSet<String>> {
    let index_of: HashMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.as_str(), i))
        .collect();
    let mut adj = vec![Vec::new(); nodes.len()];
    for (a, b) in edges {
        adj[index_of[a.as_str()]].push(index_of[b.as_str()]);
    }
    struct Tarjan<'a> {
        adj: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    impl Tarjan<'_> {
        fn visit(&mut self, v: usize) {
            self.index[v] = Some(self.next);
            self.low[v] = self.next;
            self.next += 1;
            self.stack.push(v);
            self.on_stack[v] = true;
            for k in 0..self.adj[v].len() {
                let w = self.adj[v][k];
                match self.index[w] {
                    None => {
                        self.visit(w);
                        self.low[v] = self.low[v].min(self.low[w]);
                    }
                    Some(iw) if self.on_stack[w] => self.low[v] = self.low[v].min(iw),
                    _ => {}
                }
            }
            if Some(self.low[v]) == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack[w] = false;
                    component.push(w);
                    if w == v {
                        break;
                    }
                }
                self.out.push(component);
            }
        }
    }
    let mut t = Tarjan {
        adj: &adj,
        index: vec![None; nodes.len()],
        low: vec![0; nodes.len()],
        on_stack: vec![false; nodes.len()],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..nodes.len() {
        if t.index[v].is_none() {
            t.visit(v);
        }
    }
    t.out
        .into_iter()
        .filter(|c| c.len() > 1)
        .map(|c| c.into_iter().map(|i| nodes[i].clone()).collect())
        .collect()
}

#[test]
fn modules_form_layers_without_cycles() {
    let krate = Crate::read();
    let nodes: Vec<String> = krate.files.keys().cloned().collect();
    let edges = krate.edges();
    let upward: BTreeSet<(String, String)> = edges
        .iter()
        .filter(|(a, b)| layer_of(a) < layer_of(b))
        .map(|(a, b)| (krate.file(a), krate.file(b)))
        .collect();
    let found_cycles: Vec<BTreeSet<String>> = cycles(&nodes, &edges)
        .into_iter()
        .map(|c| c.iter().map(|m| krate.file(m)).collect())
        .collect();
    let (room_cycles, stale_observers) = observer_cycles(&edges);
    let room_cycles: Vec<String> = room_cycles
        .iter()
        .map(|path| {
            path.iter()
                .map(|m| krate.file(m))
                .collect::<Vec<_>>()
                .join(" -> ")
        })
        .collect();

    println!(
        "structure of src/: {} modules, {} import edges, {} upward, {} cycles ({} modules in \
         them), {} cycles between an observer room and the module it observes ({} checked)",
        nodes.len(),
        edges.len(),
        upward.len(),
        found_cycles.len(),
        found_cycles.iter().map(BTreeSet::len).sum::<usize>(),
        room_cycles.len(),
        OBSERVERS.len()
    );
    for (a, b) in &upward {
        println!(
            "  upward: {a} (layer {}) -> {b} (layer {})",
            layer_of(&module_of(Path::new(a))),
            layer_of(&module_of(Path::new(b)))
        );
    }
    for c in &found_cycles {
        println!(
            "  cycle: {}",
            c.iter().cloned().collect::<Vec<_>>().join(", ")
        );
    }
    for c in &room_cycles {
        println!("  cycle through an observer room: {c}");
    }

    let mut problems = Vec::new();
    for edge in &upward {
        problems.push(format!(
            "upward import {} -> {}: a module imports from a higher layer (see LAYERS and \
             ARCHITECTURE.md: move the code down, or pass what it needs in from above)",
            edge.0, edge.1
        ));
    }
    for c in &found_cycles {
        problems.push(format!(
            "import cycle: {c:?} (modules must form layers: split the shared piece into a module \
             below the others)"
        ));
    }
    for c in &room_cycles {
        problems.push(format!(
            "import cycle between an observer room and the module it observes: {c} (the lower \
             module must not reach the room: let it declare the interface it calls and the room \
             implement it, as `observe` does for the timeline; see OBSERVERS)"
        ));
    }
    problems.extend(stale_observers);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_reader_sees_paths_through_comments_strings_and_re_exports() {
    let code = code_of(
        "// use crate::timeline;\nlet s = \"crate::report::x\"; let c = '\"'; use crate::arena::{self, memory::{a, b as c}};\n#[cfg(test)]\nmod tests { use crate::print; }\n",
    );
    assert!(!code.contains("timeline") && !code.contains("report") && !code.contains("print"));
    let decls = use_decls(&code);
    assert_eq!(decls.len(), 1);
    assert_eq!(
        decls[0].paths,
        vec![
            vec!["crate".to_string(), "arena".into()],
            vec!["crate".into(), "arena".into(), "memory".into(), "a".into()],
            vec!["crate".into(), "arena".into(), "memory".into(), "b".into()],
        ]
    );
    let nodes: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
    let edges: BTreeSet<(String, String)> = [("a", "b"), ("b", "a"), ("b", "c")]
        .iter()
        .map(|(x, y)| (x.to_string(), y.to_string()))
        .collect();
    let found = cycles(&nodes, &edges);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].len(), 2);
    // A module that imports one file of an observer room, while another file of the room
    // imports it, closes a cycle no two files make.
    let edges: BTreeSet<(String, String)> = [
        ("ndarray::exec", "ndarray"),
        ("ndarray::exec", "ndarray::autograd::tape"),
        ("ndarray::autograd::backward", "ndarray::exec"),
    ]
    .iter()
    .map(|(x, y)| (x.to_string(), y.to_string()))
    .collect();
    let nodes: Vec<String> = [
        "ndarray",
        "ndarray::exec",
        "ndarray::autograd::tape",
        "ndarray::autograd::backward",
    ]
    .map(String::from)
    .to_vec();
    assert!(cycles(&nodes, &edges).is_empty());
    let (found, stale) = observer_cycles(&edges);
    assert!(stale.is_empty());
    assert_eq!(
        found,
        vec![vec![
            "ndarray::exec".to_string(),
            "ndarray::autograd::tape".into(),
            "ndarray::autograd::backward".into(),
            "ndarray::exec".into(),
        ]]
    );
    // The crate root's re-exports lead to the defining file.
    let krate = Crate::read();
    assert_eq!(
        krate.resolve(&["DType".to_string()], 0).as_deref(),
        Some("dtype")
    );
    assert_eq!(
        krate.resolve(&["Manager".to_string()], 0).as_deref(),
        Some("manager")
    );
}
