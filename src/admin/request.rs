//! A request as the admin routes see it: method, decoded path, query parameters and the
//! whole (size-limited) body, read by hyper beforehand.
//!
//! hyper parses the wire format; what is left here is the part HTTP libraries leave to
//! applications: splitting and percent-decoding the query string (`prefix=aa%2Cbb`), so
//! the routes can stay plain synchronous functions run on the blocking pool.

use bytes::Bytes;

/// A request the server has read completely.
#[derive(Debug, Default)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: Vec<(String, String)>,
    pub body: Bytes,
}

impl Request {
    /// A request from its method, its target's path and query string, and its body.
    pub fn new(method: &str, path: &str, query: Option<&str>, body: Bytes) -> Self {
        Self {
            method: method.to_owned(),
            path: percent_decode(path),
            query: query.map(parse_query).unwrap_or_default(),
            body,
        }
    }

    /// The first value of a query parameter.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

fn parse_query(q: &str) -> Vec<(String, String)> {
    q.split('&')
        .filter(|p| !p.is_empty())
        .map(|p| match p.split_once('=') {
            Some((k, v)) => (percent_decode(k), percent_decode(v)),
            None => (percent_decode(p), String::new()),
        })
        .collect()
}

/// Decodes `%hh` escapes and `+` (a space in form encoding); a malformed escape is kept
/// as it is rather than refused, so the route can name the bad value in its answer.
fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
    while i < b.len() {
        match b[i] {
            b'%' => match (b.get(i + 1).and_then(|&c| hex(c)), b.get(i + 2).and_then(|&c| hex(c))) {
                (Some(h), Some(l)) => {
                    out.push(h << 4 | l);
                    i += 3;
                    continue;
                }
                _ => out.push(b'%'),
            },
            b'+' => out.push(b' '),
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_path_and_query() {
        let r = Request::new(
            "GET",
            "/v1/pa%67es",
            Some("prefix=aa%2Cbb&ns=0&flag&a+b=%zz"),
            Bytes::new(),
        );
        assert_eq!(r.path, "/v1/pages");
        assert_eq!(r.param("prefix"), Some("aa,bb"));
        assert_eq!(r.param("ns"), Some("0"));
        assert_eq!(r.param("flag"), Some(""));
        assert_eq!(r.param("a b"), Some("%zz"));
        assert_eq!(r.param("missing"), None);
        assert_eq!(r.query.len(), 4);
    }
}
