//! A small SVG that carries a message instead of a flamegraph: what a profile with nothing to
//! draw answers, so a browser or an SVG viewer shows why instead of a blank (or broken) file.

/// An SVG image with a title and one line of explanation.
pub(crate) fn message(title: &str, message: &str) -> Vec<u8> {
    format!(
        r##"<?xml version="1.0" standalone="no"?>
<svg version="1.1" width="1200" height="140" viewBox="0 0 1200 140" xmlns="http://www.w3.org/2000/svg">
<rect x="0" y="0" width="1200" height="140" fill="#eeeeee"/>
<text x="600" y="40" text-anchor="middle" font-family="Verdana" font-size="17">{}</text>
<text id="message" x="600" y="90" text-anchor="middle" font-family="Verdana" font-size="15" fill="#333333">{}</text>
</svg>
"##,
        escape(title),
        escape(message)
    )
    .into_bytes()
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            _ => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn message_is_escaped() {
        let svg = String::from_utf8(super::message("a<b", "x & y")).unwrap();
        assert!(svg.contains("a&lt;b") && svg.contains("x &amp; y"), "{svg}");
    }
}
