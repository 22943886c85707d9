//! Generated blocks in `docs/` (settings tables), checked by tests so documents cannot drift
//! from the code.

/// Check (or with `FELIX_BLESS=1` rewrite) the block between `<!-- NAME:begin -->` and
/// `<!-- NAME:end -->` in a document. Shared by the broker's and control plane's doc tests.
pub fn check_doc_block(path: &std::path::Path, name: &str, want: &str) -> Result<(), String> {
    let doc = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let begin = format!("<!-- {name}:begin -->\n");
    let end = format!("<!-- {name}:end -->");
    let (Some(b), Some(e)) = (doc.find(&begin), doc.find(&end)) else {
        return Err(format!("{} lacks the {name} markers", path.display()));
    };
    let have = &doc[b + begin.len()..e];
    if have == want {
        return Ok(());
    }
    if std::env::var_os("FELIX_BLESS").is_some() {
        let new = format!("{}{}{}", &doc[..b + begin.len()], want, &doc[e..]);
        std::fs::write(path, new).map_err(|e| e.to_string())?;
        return Ok(());
    }
    Err(format!(
        "{} is stale in block {name}; rerun the test with FELIX_BLESS=1 to regenerate. Expected:\n{want}",
        path.display()
    ))
}

/// Text made safe for one Markdown table cell (pipes escaped, one line).
pub fn table_cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// An environment variable's table cell.
pub fn env_cell(name: &std::ffi::OsStr) -> String {
    format!("`{}`", name.to_string_lossy())
}
