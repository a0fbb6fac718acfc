//! JSON helpers: the deterministic printer, semantic equality and the exact-number check.

use serde_json::{Number, Value};

use super::error::CniConfError;

/// "a string", "an array", ...: for error messages.
pub(crate) fn kind_name(value: &Value) -> &'static str {
    match value {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// JSON equality as a Go program that unmarshals into `interface{}` sees it: object key
/// order does not matter, array order does, numbers compare by value (`1 == 1.0`).
pub(crate) fn json_equal(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Null, Value::Null) => true,
        (Value::Bool(x), Value::Bool(y)) => x == y,
        (Value::Number(x), Value::Number(y)) => number_equal(x, y),
        (Value::String(x), Value::String(y)) => x == y,
        (Value::Array(x), Value::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_equal(p, q))
        }
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, v)| y.get(k).is_some_and(|w| json_equal(v, w)))
        }
        _ => false,
    }
}

fn number_equal(a: &Number, b: &Number) -> bool {
    if let (Some(x), Some(y)) = (a.as_i64(), b.as_i64()) {
        return x == y;
    }
    if let (Some(x), Some(y)) = (a.as_u64(), b.as_u64()) {
        return x == y;
    }
    if a.is_f64() || b.is_f64() {
        return matches!((a.as_f64(), b.as_f64()), (Some(x), Some(y)) if x == y);
    }
    // One negative i64, one u64 above i64::MAX.
    false
}

/// Pretty JSON, two-space indent, trailing newline: byte-identical to
/// `serde_json::to_string_pretty(value) + "\n"`, but infallible.
pub(crate) fn to_pretty_bytes(value: &Value) -> Vec<u8> {
    let mut out = String::new();
    write_value(&mut out, value, 0);
    out.push('\n');
    out.into_bytes()
}

fn indent(out: &mut String, level: usize) {
    for _ in 0..level {
        out.push_str("  ");
    }
}

fn write_value(out: &mut String, value: &Value, level: usize) {
    match value {
        Value::Null => out.push_str("null"),
        Value::Bool(true) => out.push_str("true"),
        Value::Bool(false) => out.push_str("false"),
        Value::Number(n) => out.push_str(&n.to_string()),
        Value::String(s) => write_string(out, s),
        Value::Array(items) => {
            if items.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push('\n');
                indent(out, level + 1);
                write_value(out, item, level + 1);
            }
            out.push('\n');
            indent(out, level);
            out.push(']');
        }
        Value::Object(map) => {
            if map.is_empty() {
                out.push_str("{}");
                return;
            }
            out.push('{');
            for (i, (key, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push('\n');
                indent(out, level + 1);
                write_string(out, key);
                out.push_str(": ");
                write_value(out, item, level + 1);
            }
            out.push('\n');
            indent(out, level);
            out.push('}');
        }
    }
}

/// The escaping serde_json uses: `"`, `\` and control characters only.
fn write_string(out: &mut String, s: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if u32::from(c) < 0x20 => {
                let b = u32::from(c) as u8;
                out.push_str("\\u00");
                out.push(char::from(HEX[usize::from(b >> 4)]));
                out.push(char::from(HEX[usize::from(b & 0x0f)]));
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Checks every number token of `text` (valid JSON already) survives serde_json exactly:
/// integers must fit 64 bits, floats must parse to the correctly rounded double and
/// print/parse back to the same value.
pub(crate) fn check_number_tokens(text: &[u8]) -> Result<(), CniConfError> {
    let mut i = 0;
    while let Some(&b) = text.get(i) {
        match b {
            b'"' => {
                i += 1;
                loop {
                    match text.get(i) {
                        None => break,
                        Some(b'\\') => i += 2,
                        Some(b'"') => {
                            i += 1;
                            break;
                        }
                        Some(_) => i += 1,
                    }
                }
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while matches!(
                    text.get(i),
                    Some(b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                ) {
                    i += 1;
                }
                let token = text
                    .get(start..i)
                    .and_then(|t| std::str::from_utf8(t).ok())
                    .unwrap_or("");
                if !token_is_exact(token) {
                    return Err(CniConfError::InexactNumber {
                        token: shorten(token),
                        at: format!("byte {start}"),
                    });
                }
            }
            _ => i += 1,
        }
    }
    Ok(())
}

fn token_is_exact(token: &str) -> bool {
    let Ok(parsed) = serde_json::from_str::<Number>(token) else {
        return false;
    };
    if token.contains(['.', 'e', 'E']) {
        // serde_json's default float parser is best-effort; std's is correctly rounded.
        let Ok(exact) = token.parse::<f64>() else {
            return false;
        };
        if parsed.as_f64().map(f64::to_bits) != Some(exact.to_bits()) {
            return false;
        }
    } else if parsed.as_i64().is_none() && parsed.as_u64().is_none() && token != "-0" {
        // An integer beyond 64 bits: serde_json would turn it into a lossy double.
        // (`-0` is read as the double -0.0 and printed as `-0.0`: the same value.)
        return false;
    }
    number_round_trips(&parsed)
}

/// Printing `n` and parsing it back gives `n` again (so rewriting is a fixed point).
pub(crate) fn number_round_trips(n: &Number) -> bool {
    serde_json::from_str::<Number>(&n.to_string()).is_ok_and(|back| back == *n)
}

/// Finds a number inside `value` that does not round-trip; returns it printed.
pub(crate) fn first_inexact_number(value: &Value) -> Option<String> {
    match value {
        Value::Number(n) if !number_round_trips(n) => Some(n.to_string()),
        Value::Array(items) => items.iter().find_map(first_inexact_number),
        Value::Object(map) => map.values().find_map(first_inexact_number),
        _ => None,
    }
}

/// At most 64 characters of `s`, for error messages about untrusted input.
pub(crate) fn shorten(s: &str) -> String {
    const MAX: usize = 64;
    if s.chars().count() <= MAX {
        return s.to_owned();
    }
    let mut out: String = s.chars().take(MAX).collect();
    out.push('…');
    out
}
