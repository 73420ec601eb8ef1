//! Every `ARCHITECTURE.md §N` in the repository's Rust sources and Markdown names a section
//! ARCHITECTURE.md has, nothing cites a design document the repository does not hold, and
//! every relative link of the Markdown (README.md, docs/, ...) reaches a file and heading.

use kvconnect_tests::workspace_root;
use std::path::{Path, PathBuf};

const DOC: &str = "ARCHITECTURE.md";
/// Built, so that this file does not cite it.
const GONE: &str = concat!("DESIGN", ".md");

/// The section numbers of ARCHITECTURE.md: its `## N. Title` headings.
fn sections(doc: &str) -> Vec<u32> {
    doc.lines().filter_map(|l| l.strip_prefix("## ")?.split_once(". ")?.0.parse().ok()).collect()
}

/// Each `ARCHITECTURE.md §N` in `text`, as (line, N); `§1, §2 and §3` after one name are
/// three references.
fn references(text: &str) -> Vec<(usize, u32)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for (i, _) in line.match_indices(DOC) {
            let mut rest = &line[i + DOC.len()..];
            loop {
                rest = rest.trim_start_matches([' ', ',']);
                rest = rest.strip_prefix("and ").unwrap_or(rest);
                let Some(after) = rest.strip_prefix('§') else { break };
                let digits: String = after.chars().take_while(char::is_ascii_digit).collect();
                let Ok(section) = digits.parse() else { break };
                out.push((n + 1, section));
                rest = &after[digits.len()..];
            }
        }
    }
    out
}

/// The `.rs` and `.md` files of the repository, leaving out build output, hidden folders and
/// links (`connector-api/fixtures` links to `fixtures`).
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("read {}: {e}", dir.display()));
    for entry in entries {
        let entry = entry.expect("a folder entry");
        let (path, kind) = (entry.path(), entry.file_type().expect("a file type"));
        let name = entry.file_name().to_string_lossy().into_owned();
        if kind.is_symlink() || name.starts_with('.') || name == "target" {
            continue;
        }
        if kind.is_dir() {
            sources(&path, out);
        } else if name.ends_with(".rs") || name.ends_with(".md") {
            out.push(path);
        }
    }
}

#[test]
fn every_architecture_reference_names_a_section_that_exists() {
    let root = workspace_root();
    let doc = std::fs::read_to_string(root.join(DOC)).expect("ARCHITECTURE.md at the repository root");
    let have = sections(&doc);
    assert_eq!(have, (1..=have.len() as u32).collect::<Vec<_>>(), "sections are numbered 1, 2, ...");
    let mut files = Vec::new();
    sources(&root, &mut files);
    let mut bad = Vec::new();
    let mut seen = 0;
    for file in &files {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let shown = file.strip_prefix(&root).unwrap_or(file).display().to_string();
        for (n, line) in text.lines().enumerate().filter(|(_, l)| l.contains(GONE)) {
            bad.push(format!("{shown}:{}: cites {GONE}, which is not in the repository: {line}", n + 1));
        }
        for (line, section) in references(&text) {
            seen += 1;
            if !have.contains(&section) {
                bad.push(format!("{shown}:{line}: cites {DOC} §{section}, which has §1 to §{}", have.len()));
            }
        }
    }
    assert!(seen > 0, "the scan found no reference at all (read {} files)", files.len());
    assert!(bad.is_empty(), "references to fix:\n{}", bad.join("\n"));
}

#[test]
fn references_are_read_as_written() {
    // Built from DOC, so that the scan of this file does not read them.
    let text = format!("see {DOC} §6 and §9.\n({DOC} §3): x\n{DOC} §1, §2, and §12; §4\n{DOC} §N");
    assert_eq!(references(&text), vec![(1, 6), (1, 9), (2, 3), (3, 1), (3, 2), (3, 12)]);
    assert_eq!(sections("# T\n\n## 1. A\n\n### 1.1 x\n\n## 2. B\n## Notes\n"), vec![1, 2]);
}

/// A heading's anchor as GitHub makes it: lower case, spaces to hyphens, other punctuation
/// than `-` and `_` dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, '-' | '_' | ' '))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// The anchors of a Markdown file's headings (outside code blocks).
fn anchors(text: &str) -> Vec<String> {
    let mut fenced = false;
    let mut out = Vec::new();
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
        } else if !fenced && line.starts_with('#') {
            out.push(anchor(line.trim_start_matches('#')));
        }
    }
    out
}

/// Each relative `[text](target)` of `text`, as (line, target); web links are left out.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in text.lines().enumerate() {
        for (i, _) in line.match_indices("](") {
            let rest = &line[i + 2..];
            let Some(end) = rest.find(')') else { continue };
            let target = &rest[..end];
            if !target.contains("://") && !target.starts_with("mailto:") && !target.contains(' ') {
                out.push((n + 1, target.to_owned()));
            }
        }
    }
    out
}

#[test]
fn every_markdown_link_reaches_a_file_and_heading() {
    let root = workspace_root();
    let mut files = Vec::new();
    sources(&root, &mut files);
    let mut bad = Vec::new();
    let mut seen = 0;
    for file in files.iter().filter(|f| f.extension().is_some_and(|e| e == "md")) {
        let text = std::fs::read_to_string(file).unwrap_or_default();
        let shown = file.strip_prefix(&root).unwrap_or(file).display().to_string();
        for (line, target) in links(&text) {
            seen += 1;
            let (path, heading) = target.split_once('#').unwrap_or((&target, ""));
            let to = if path.is_empty() { file.clone() } else { file.parent().expect("a folder").join(path) };
            if !to.exists() {
                bad.push(format!("{shown}:{line}: links {target}, and {} does not exist", to.display()));
                continue;
            }
            if !heading.is_empty() && to.extension().is_some_and(|e| e == "md") {
                let other = std::fs::read_to_string(&to).unwrap_or_default();
                if !anchors(&other).iter().any(|a| a == heading) {
                    bad.push(format!("{shown}:{line}: links {target}, and no heading there has that anchor"));
                }
            }
        }
    }
    assert!(seen > 10, "the scan found only {seen} links");
    assert!(bad.is_empty(), "links to fix:\n{}", bad.join("\n"));
}

#[test]
fn links_and_anchors_are_read_as_github_reads_them() {
    assert_eq!(
        anchor(" Before launch: `kvconnect negotiate` and `kvconnect plan`"),
        "before-launch-kvconnect-negotiate-and-kvconnect-plan"
    );
    assert_eq!(anchors("# A\n```\n# not\n```\n## B c\n"), vec!["a", "b-c"]);
    assert_eq!(
        links("see [x](docs/a.md#b) and [y](https://e.org) [z](#c)"),
        vec![(1, "docs/a.md#b".to_owned()), (1, "#c".to_owned())]
    );
}
