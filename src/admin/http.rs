//! A small, bounded HTTP/1.1 reader and writer: enough for the admin socket's clients
//! (curl, the `kvtier` CLI, scripts), nothing more.
//!
//! One request per connection (`Connection: close`). The request line and headers are
//! limited in size, bodies need a `Content-Length` within the configured limit (over it:
//! 413 before the body is read), `Expect: 100-continue` is honoured, and chunked request
//! bodies are refused. Responses are JSON or text with a length, or a chunked stream.

use std::io::{Read, Write};

/// A request that could not be read, with the status and stable code to answer.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    #[error("{message}")]
    Reply {
        status: u16,
        code: &'static str,
        message: String,
    },
    /// The client went away or timed out; nothing to answer.
    #[error("connection: {0}")]
    Io(#[from] std::io::Error),
}

impl HttpError {
    pub fn reply(status: u16, code: &'static str, message: impl Into<String>) -> Self {
        HttpError::Reply {
            status,
            code,
            message: message.into(),
        }
    }
}

/// A parsed request.
#[derive(Debug, Default)]
pub struct Request {
    pub method: String,
    pub path: String,
    pub query: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Request {
    /// The first value of a query parameter.
    pub fn param(&self, name: &str) -> Option<&str> {
        self.query.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// Reads one request, with at most `max_header` bytes of head and `max_body` of body.
pub fn read_request<S: Read + Write>(s: &mut S, max_header: usize, max_body: usize) -> Result<Request, HttpError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 2048];
    let head_end = loop {
        if let Some(i) = find(&buf, b"\r\n\r\n") {
            break i;
        }
        if buf.len() > max_header {
            return Err(HttpError::reply(
                431,
                "header_too_large",
                format!("request head over {max_header} bytes"),
            ));
        }
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(
                std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed before the request ended").into(),
            );
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    if head_end > max_header {
        return Err(HttpError::reply(
            431,
            "header_too_large",
            format!("request head over {max_header} bytes"),
        ));
    }
    let head = std::str::from_utf8(&buf[..head_end]).map_err(|_| bad("request head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let line = lines.next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (method, target, version) = match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some(m), Some(t), Some(v), None) if !m.is_empty() && t.starts_with('/') => (m, t, v),
        _ => return Err(bad("malformed request line")),
    };
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::reply(505, "http_version", "only HTTP/1.x is served"));
    }
    let mut length: Option<usize> = None;
    let mut expect_continue = false;
    for h in lines {
        let (name, value) = h.split_once(':').ok_or_else(|| bad("malformed header line"))?;
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            length = Some(value.parse().map_err(|_| bad("Content-Length is not a number"))?);
        } else if name.eq_ignore_ascii_case("transfer-encoding") && !value.eq_ignore_ascii_case("identity") {
            return Err(HttpError::reply(
                411,
                "length_required",
                "send bodies with Content-Length",
            ));
        } else if name.eq_ignore_ascii_case("expect") && value.eq_ignore_ascii_case("100-continue") {
            expect_continue = true;
        }
    }
    let length = length.unwrap_or(0);
    if length > max_body {
        return Err(HttpError::reply(
            413,
            "body_too_large",
            format!("a body of {length} bytes is over the limit of {max_body}"),
        ));
    }
    let mut body = buf[head_end + 4..].to_vec();
    if body.len() < length && expect_continue {
        s.write_all(b"HTTP/1.1 100 Continue\r\n\r\n")?;
    }
    while body.len() < length {
        let n = s.read(&mut chunk)?;
        if n == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed inside the body").into());
        }
        body.extend_from_slice(&chunk[..n]);
    }
    body.truncate(length);
    let (path, query) = match target.split_once('?') {
        Some((p, q)) => (p, parse_query(q)),
        None => (target, Vec::new()),
    };
    Ok(Request {
        method: method.to_owned(),
        path: percent_decode(path),
        query,
        body,
    })
}

fn bad(message: &str) -> HttpError {
    HttpError::reply(400, "bad_request", message)
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
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

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16).map(|d| d as u8);
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

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        411 => "Length Required",
        413 => "Content Too Large",
        422 => "Unprocessable Content",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        505 => "HTTP Version Not Supported",
        _ => "Status",
    }
}

/// Writes a whole response with a length and closes the exchange.
pub fn write_response<W: Write>(w: &mut W, status: u16, content_type: &str, body: &[u8]) -> std::io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        reason(status),
        body.len()
    );
    w.write_all(head.as_bytes())?;
    w.write_all(body)?;
    w.flush()
}

/// Writes a JSON response.
pub fn write_json<W: Write>(w: &mut W, status: u16, value: &impl serde::Serialize) -> std::io::Result<()> {
    let mut body = serde_json::to_vec(value).map_err(std::io::Error::other)?;
    body.push(b'\n');
    write_response(w, status, "application/json", &body)
}

/// Writes the JSON error `{"code": …, "message": …}`.
pub fn write_error<W: Write>(w: &mut W, status: u16, code: &str, message: &str) -> std::io::Result<()> {
    write_json(w, status, &serde_json::json!({ "code": code, "message": message }))
}

/// A chunked response body: one chunk per `send`, ended by `finish`.
pub struct Chunked<'a, W: Write> {
    w: &'a mut W,
}

impl<'a, W: Write> Chunked<'a, W> {
    pub fn start(w: &'a mut W, content_type: &str) -> std::io::Result<Self> {
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: {content_type}\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        );
        w.write_all(head.as_bytes())?;
        w.flush()?;
        Ok(Self { w })
    }

    /// The underlying writer (to poll it, not to write around the chunking).
    pub fn inner(&self) -> &W {
        self.w
    }

    pub fn send(&mut self, data: &[u8]) -> std::io::Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        write!(self.w, "{:x}\r\n", data.len())?;
        self.w.write_all(data)?;
        self.w.write_all(b"\r\n")?;
        self.w.flush()
    }

    pub fn finish(self) -> std::io::Result<()> {
        self.w.write_all(b"0\r\n\r\n")?;
        self.w.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Pipe(std::io::Cursor<Vec<u8>>, Vec<u8>);
    impl Read for Pipe {
        fn read(&mut self, b: &mut [u8]) -> std::io::Result<usize> {
            self.0.read(b)
        }
    }
    impl Write for Pipe {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            self.1.write(b)
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    fn pipe(s: &str) -> Pipe {
        Pipe(std::io::Cursor::new(s.as_bytes().to_vec()), Vec::new())
    }

    #[test]
    fn parses_request_with_query_and_body() {
        let mut p =
            pipe("POST /v1/pages?prefix=aa%2Cbb&ns=0 HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\nabcdEXTRA");
        let r = read_request(&mut p, 1024, 16).unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/v1/pages"));
        assert_eq!(r.param("prefix"), Some("aa,bb"));
        assert_eq!(r.param("ns"), Some("0"));
        assert_eq!(r.body, b"abcd");
    }

    #[test]
    fn limits_give_stable_codes() {
        let mut p = pipe("POST /x HTTP/1.1\r\nContent-Length: 17\r\n\r\n");
        match read_request(&mut p, 1024, 16) {
            Err(HttpError::Reply { status: 413, code, .. }) => assert_eq!(code, "body_too_large"),
            other => panic!("{other:?}"),
        }
        let long = format!("GET /{} HTTP/1.1\r\n\r\n", "a".repeat(300));
        assert!(matches!(
            read_request(&mut pipe(&long), 128, 16),
            Err(HttpError::Reply { status: 431, .. })
        ));
        assert!(matches!(
            read_request(&mut pipe("GET\r\n\r\n"), 128, 16),
            Err(HttpError::Reply { status: 400, .. })
        ));
        let te = "POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n";
        assert!(matches!(
            read_request(&mut pipe(te), 128, 16),
            Err(HttpError::Reply { status: 411, .. })
        ));
    }
}
