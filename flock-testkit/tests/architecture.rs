//! ARCHITECTURE.md's crate table against `cargo metadata`: every workspace package has
//! exactly one row, every row names a workspace package, and each row's "flock deps"
//! cell is exactly that package's normal (not dev, not build) dependencies on other
//! workspace packages.
//!
//! The table is the one whose header starts `| crate | job | flock deps |`. A row's
//! packages are the backticked names in its first cell that contain no `/` (a path
//! such as `` `bins/flock-cni` `` is a location, not a name); its dependencies are the
//! comma-separated names of the "flock deps" cell, `—` for none. A new crate needs only
//! its row. The `fuzz/` workspace is excluded from the main one and is not a package
//! here.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

const CRATE_COLUMN: &str = "crate";
const DEPS_COLUMN: &str = "flock deps";

/// The workspace's packages and, for each, its normal dependencies on the others.
fn workspace_packages(root: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(&cargo)
        .args([
            "metadata",
            "--no-deps",
            "--format-version",
            "1",
            "--manifest-path",
        ])
        .arg(root.join("Cargo.toml"))
        .output()
        .unwrap_or_else(|e| panic!("running {} metadata: {e}", cargo.to_string_lossy()));
    assert!(
        out.status.success(),
        "cargo metadata failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("metadata JSON");
    let members: BTreeSet<&str> = meta["workspace_members"]
        .as_array()
        .expect("workspace_members")
        .iter()
        .map(|id| id.as_str().expect("package id"))
        .collect();
    let packages: Vec<&serde_json::Value> = meta["packages"]
        .as_array()
        .expect("packages")
        .iter()
        .filter(|p| members.contains(p["id"].as_str().unwrap_or_default()))
        .collect();
    let names: BTreeSet<String> = packages
        .iter()
        .map(|p| p["name"].as_str().expect("package name").to_owned())
        .collect();
    packages
        .iter()
        .map(|p| {
            let deps = p["dependencies"]
                .as_array()
                .expect("dependencies")
                .iter()
                // `kind` is null for normal dependencies, "dev" or "build" otherwise.
                .filter(|d| d["kind"].is_null() && d["path"].is_string())
                .map(|d| d["name"].as_str().expect("dependency name").to_owned())
                .filter(|n| names.contains(n))
                .collect();
            (p["name"].as_str().unwrap().to_owned(), deps)
        })
        .collect()
}

/// A table row's cells, split on `|` not escaped as `\|`.
fn cells(line: &str) -> Vec<String> {
    let inner = line.trim().trim_start_matches('|');
    let inner = inner.strip_suffix('|').unwrap_or(inner);
    let mut out = vec![String::new()];
    let mut chars = inner.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'|') => {
                out.last_mut().unwrap().push('|');
                chars.next();
            }
            '|' => out.push(String::new()),
            c => out.last_mut().unwrap().push(c),
        }
    }
    out.iter().map(|c| c.trim().to_owned()).collect()
}

/// The backticked names in a cell that contain no `/`.
fn backticked_names(cell: &str) -> Vec<String> {
    cell.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| !s.contains('/') && !s.is_empty())
        .map(str::to_owned)
        .collect()
}

struct Row {
    line: usize,
    crate_cell: String,
    packages: Vec<String>,
    deps: Result<BTreeSet<String>, String>,
}

/// The crate table's rows (1-based line numbers of ARCHITECTURE.md).
fn crate_table(text: &str) -> Vec<Row> {
    let lines: Vec<&str> = text.lines().collect();
    let header_at = lines
        .iter()
        .position(|l| {
            let c = cells(l);
            l.trim_start().starts_with('|')
                && c.first().map(String::as_str) == Some(CRATE_COLUMN)
                && c.iter().any(|c| c == DEPS_COLUMN)
        })
        .unwrap_or_else(|| {
            panic!("ARCHITECTURE.md has no table whose header starts `| {CRATE_COLUMN} |` with a `{DEPS_COLUMN}` column")
        });
    let header = cells(lines[header_at]);
    let deps_col = header.iter().position(|c| c == DEPS_COLUMN).unwrap();
    lines[header_at + 2..]
        .iter()
        .enumerate()
        .take_while(|(_, l)| l.trim_start().starts_with('|'))
        .map(|(i, l)| {
            let c = cells(l);
            let deps_cell = c.get(deps_col).cloned().unwrap_or_default();
            let deps = if matches!(deps_cell.as_str(), "—" | "-" | "") {
                Ok(BTreeSet::new())
            } else {
                deps_cell
                    .split(',')
                    .map(|d| {
                        let d = d.trim().trim_matches('`');
                        if !d.is_empty()
                            && d.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
                        {
                            Ok(d.to_owned())
                        } else {
                            Err(format!(
                                "its `{DEPS_COLUMN}` cell {deps_cell:?} is not a comma-separated list of package names (or `—`)"
                            ))
                        }
                    })
                    .collect()
            };
            Row {
                line: header_at + 3 + i,
                crate_cell: c.first().cloned().unwrap_or_default(),
                packages: backticked_names(&c[0]),
                deps,
            }
        })
        .collect()
}

/// What is wrong with `rows` against `packages`, one message per problem.
fn problems(rows: &[Row], packages: &BTreeMap<String, BTreeSet<String>>) -> Vec<String> {
    let mut problems = Vec::new();
    let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
    for row in rows {
        let at = format!("ARCHITECTURE.md:{} ({})", row.line, row.crate_cell);
        let known: Vec<&String> = row
            .packages
            .iter()
            .filter(|p| packages.contains_key(p.as_str()))
            .collect();
        for p in row
            .packages
            .iter()
            .filter(|p| !packages.contains_key(p.as_str()))
        {
            problems.push(format!("{at}: `{p}` is not a workspace package"));
        }
        if known.is_empty() {
            problems.push(format!(
                "{at}: the row names no workspace package (name it in backticks in the first cell)"
            ));
        }
        for p in &known {
            if let Some(first) = seen.insert(p, row.line) {
                problems.push(format!(
                    "{at}: `{p}` already has a row at ARCHITECTURE.md:{first}"
                ));
            }
        }
        let listed = match &row.deps {
            Ok(d) => d,
            Err(e) => {
                problems.push(format!("{at}: {e}"));
                continue;
            }
        };
        for p in known {
            let actual = &packages[p.as_str()];
            let missing: Vec<&String> = actual.difference(listed).collect();
            let extra: Vec<&String> = listed.difference(actual).collect();
            if !missing.is_empty() {
                problems.push(format!(
                    "{at}: `{p}` depends on {missing:?} (Cargo.toml), missing from its `{DEPS_COLUMN}` cell"
                ));
            }
            if !extra.is_empty() {
                problems.push(format!(
                    "{at}: the `{DEPS_COLUMN}` cell lists {extra:?}, which `{p}` does not depend on (normal dependencies; dev ones do not count)"
                ));
            }
        }
    }
    for p in packages.keys().filter(|p| !seen.contains_key(p.as_str())) {
        problems.push(format!(
            "workspace package `{p}` has no row in ARCHITECTURE.md's crate table"
        ));
    }
    problems
}

#[test]
fn the_crate_table_lists_every_workspace_package_with_its_flock_dependencies() {
    let root = flock_testkit::repo_root();
    let packages = workspace_packages(&root);
    assert!(
        packages.contains_key("flock-core") && packages.contains_key("flock-testkit"),
        "cargo metadata returned an unexpected workspace: {:?}",
        packages.keys()
    );
    let text = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
    let rows = crate_table(&text);
    let problems = problems(&rows, &packages);
    assert!(
        problems.is_empty(),
        "ARCHITECTURE.md's crate table does not match `cargo metadata`:\n  {}",
        problems.join("\n  ")
    );
}

/// The checker itself, on a small table: each kind of mismatch is named.
#[test]
fn the_checker_names_each_kind_of_mismatch() {
    let table = "\
| crate | job | flock deps | outside |
|---|---|---|---|
| `a` (`bins/a`) | x | b | y |
| `b` | x | — | y |
| `ghost` | x | — | y |
| `fuzz/` | x | — | y |
| `c` | x | a, d | y |
| `e` | x | see below | y |
";
    let packages: BTreeMap<String, BTreeSet<String>> = [
        ("a", vec!["b", "c"]),
        ("b", vec![]),
        ("c", vec!["a"]),
        ("d", vec![]),
        ("e", vec![]),
        ("f", vec![]),
    ]
    .into_iter()
    .map(|(n, d)| (n.to_owned(), d.into_iter().map(str::to_owned).collect()))
    .collect();
    let rows = crate_table(table);
    assert_eq!(rows[0].packages, ["a"], "a path in backticks is not a name");
    let got: BTreeSet<String> = problems(&rows, &packages).into_iter().collect();
    let expect: BTreeSet<String> = [
        r#"ARCHITECTURE.md:3 (`a` (`bins/a`)): `a` depends on ["c"] (Cargo.toml), missing from its `flock deps` cell"#,
        r#"ARCHITECTURE.md:5 (`ghost`): `ghost` is not a workspace package"#,
        r#"ARCHITECTURE.md:5 (`ghost`): the row names no workspace package (name it in backticks in the first cell)"#,
        r#"ARCHITECTURE.md:6 (`fuzz/`): the row names no workspace package (name it in backticks in the first cell)"#,
        r#"ARCHITECTURE.md:7 (`c`): the `flock deps` cell lists ["d"], which `c` does not depend on (normal dependencies; dev ones do not count)"#,
        r#"ARCHITECTURE.md:8 (`e`): its `flock deps` cell "see below" is not a comma-separated list of package names (or `—`)"#,
        r#"workspace package `d` has no row in ARCHITECTURE.md's crate table"#,
        r#"workspace package `f` has no row in ARCHITECTURE.md's crate table"#,
    ]
    .into_iter()
    .map(str::to_owned)
    .collect();
    assert_eq!(got, expect);
}
