//! The code blocks of a Markdown document that tests build or run. A block is found by the
//! HTML comment on the line before its opening fence (`<!-- plugin-file: src/lib.rs -->`),
//! which renders as nothing, and is returned without the indentation of its list item.

/// The text from the line `heading` up to the next heading of the same or a higher level.
pub fn section<'a>(doc: &'a str, heading: &str) -> Option<&'a str> {
    let start = doc.find(&format!("\n{heading}\n")).map(|i| i + 1)?;
    let level = heading.chars().take_while(|c| *c == '#').count();
    let body = &doc[start + heading.len()..];
    let end = body
        .match_indices('\n')
        .map(|(i, _)| i + 1)
        .find(|&i| {
            let hashes = body[i..].chars().take_while(|c| *c == '#').count();
            (1..=level).contains(&hashes) && body[i + hashes..].starts_with(' ')
        })
        .unwrap_or(body.len());
    Some(&doc[start..start + heading.len() + end])
}

/// Every block marked `<!-- {prefix}LABEL -->`, as (LABEL, the block's text), in order.
pub fn marked_blocks(text: &str, prefix: &str) -> Vec<(String, String)> {
    let lines: Vec<&str> = text.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let Some(label) = line
            .trim()
            .strip_prefix("<!--")
            .and_then(|l| l.strip_suffix("-->"))
            .and_then(|l| l.trim().strip_prefix(prefix))
        else {
            continue;
        };
        let Some(fence) = lines.get(i + 1).filter(|l| l.trim_start().starts_with("```")) else {
            panic!("the marker `{}` is not right before a fenced code block", line.trim());
        };
        let indent = fence.len() - fence.trim_start().len();
        let body: Vec<&str> = lines[i + 2..]
            .iter()
            .take_while(|l| l.trim() != "```")
            .map(|l| l.get(indent..).unwrap_or_else(|| l.trim_start()))
            .collect();
        out.push((label.trim().to_owned(), body.join("\n") + "\n"));
    }
    out
}

/// The one block marked `<!-- {marker} -->`.
pub fn marked_block(text: &str, marker: &str) -> Option<String> {
    marked_blocks(text, marker).into_iter().find(|(label, _)| label.is_empty()).map(|(_, body)| body)
}

#[cfg(test)]
mod tests {
    use super::*;

    const DOC: &str = "# T\n\n## A\n\n1. x:\n\n   <!-- f: a.rs -->\n   ```rust\n   fn a() {\n       1\n   }\n   ```\n\n   <!-- step -->\n   ```\n   run\n   ```\n\n### A.1\n\n## B\n\n<!-- f: b.rs -->\n```\nb\n```\n";

    #[test]
    fn a_section_runs_to_the_next_heading_of_its_level() {
        let a = section(DOC, "## A").unwrap();
        assert!(a.starts_with("## A\n") && a.contains("### A.1") && !a.contains("## B"), "{a}");
        assert!(section(DOC, "## B").unwrap().ends_with("```\n"));
        assert!(section(DOC, "## C").is_none());
    }

    #[test]
    fn marked_blocks_lose_their_list_indentation() {
        let a = section(DOC, "## A").unwrap();
        assert_eq!(marked_blocks(a, "f: "), vec![("a.rs".to_owned(), "fn a() {\n    1\n}\n".to_owned())]);
        assert_eq!(marked_block(a, "step").as_deref(), Some("run\n"));
        assert_eq!(marked_blocks(DOC, "f: ").len(), 2);
    }
}
