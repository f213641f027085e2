//! A request as the admin routes see it: method, decoded path, query parameters and the
//! whole (size-limited) body, read by hyper beforehand.
//!
//! hyper parses the wire format; the query string (`prefix=aa%2Cbb`) and form bodies are
//! decoded by `form_urlencoded`, the path by `percent-encoding`, so the routes can stay
//! plain synchronous functions run on the blocking pool.
//!
//! A `POST` whose body is form-encoded (`prefix=aa,bb`, anything not starting like JSON)
//! adds the body's parameters after the query's: a 4,096-hash `prefix=` (up to 266 KiB
//! of hex) fits the body limit where it would not fit the head limit.

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
        let mut query = query.map(parse_query).unwrap_or_default();
        if method == "POST"
            && let Some(form) = form_body(&body)
        {
            query.extend(parse_query(form));
        }
        Self {
            method: method.to_owned(),
            path: percent_decode(path),
            query,
            body,
        }
    }

    /// The first value of a query parameter.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// The body as form parameters, when it is UTF-8 text that is not JSON.
fn form_body(body: &[u8]) -> Option<&str> {
    let text = std::str::from_utf8(body).ok()?.trim();
    (!text.is_empty() && !text.starts_with(['{', '['])).then_some(text)
}

/// `application/x-www-form-urlencoded` pairs: `%hh` and `+` decoded; a malformed escape
/// is kept as it is rather than refused, so the route can name the bad value in its answer.
fn parse_query(q: &str) -> Vec<(String, String)> {
    form_urlencoded::parse(q.as_bytes())
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect()
}

/// Decodes `%hh` escapes of a path (a `+` stays a `+` there).
fn percent_decode(s: &str) -> String {
    percent_encoding::percent_decode_str(s).decode_utf8_lossy().into_owned()
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

    #[test]
    fn a_form_post_body_adds_parameters_and_json_does_not() {
        let r = Request::new(
            "POST",
            "/v1/pages",
            Some("ns=1"),
            Bytes::from_static(b"prefix=aa%2Cbb\n"),
        );
        assert_eq!((r.param("ns"), r.param("prefix")), (Some("1"), Some("aa,bb")));
        let j = Request::new("POST", "/v1/hints", None, Bytes::from_static(b"{\"kind\":\"pin\"}"));
        assert!(j.query.is_empty());
        let g = Request::new("GET", "/v1/pages", None, Bytes::from_static(b"prefix=aa"));
        assert_eq!(g.param("prefix"), None, "only a POST body counts");
    }
}
