//! A request answered before its body was read must close its connection, and say so.
//!
//! A refusal can come before the handler reads the body: the bearer check's 401/403, a path
//! that does not parse, a body past `max_body_bytes` (413, read only up to the limit). hyper
//! then drops the connection after the answer, because the unread rest of the body would be
//! taken for the next request; but unless the answer carries `Connection: close`, the client
//! keeps the connection for its next request and finds it dead ("EOF occurred in violation of
//! protocol" from Python, "Connection died" from curl). Schemathesis caught it on a 401 to a
//! 100 KB POST. This layer watches whether the body reached its end and, when it did not,
//! adds `Connection: close` to the answer, so the client opens a new connection instead.

use axum::body::{Body, Bytes, HttpBody};
use axum::http::header::{HeaderValue, CONNECTION};
use axum::response::Response;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};

/// A request body that records when it has been read to its end.
struct Watched {
    inner: Body,
    ended: Arc<AtomicBool>,
}

impl HttpBody for Watched {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        // The end is either the `None` after the last frame, or a frame after which the
        // inner body knows it is done (a Content-Length body read to its length).
        if matches!(r, Poll::Ready(None)) || (r.is_ready() && self.inner.is_end_stream()) {
            self.ended.store(true, Ordering::Release);
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// Run `next` with the request's body watched; if the answer leaves part of the body unread,
/// mark the answer `Connection: close`.
pub async fn close_if_unread(
    req: axum::extract::Request,
    next: axum::middleware::Next,
) -> Response {
    // A request without a body (GET, Content-Length: 0) has nothing to leave unread.
    if req.body().is_end_stream() {
        return next.run(req).await;
    }
    let ended = Arc::new(AtomicBool::new(false));
    let req = req.map(|inner| {
        Body::new(Watched {
            inner,
            ended: ended.clone(),
        })
    });
    let mut resp = next.run(req).await;
    if !ended.load(Ordering::Acquire) {
        resp.headers_mut()
            .insert(CONNECTION, HeaderValue::from_static("close"));
    }
    resp
}
