//! Requests a server cannot decode are the caller's fault: [`DecodeErrors`] wraps every gRPC
//! service of this crate and answers them `INVALID_ARGUMENT`.
//!
//! tonic's codec answers a request that does not decode (protobuf it cannot parse, a frame with
//! a bad compression flag, a stream that ends inside a message, a unary call without its
//! message) with `INTERNAL`, as gRPC's status-code table suggests, and a message over the
//! server's size limit with `OUT_OF_RANGE`. Those statuses are made before a handler runs (or
//! by the codec while a handler reads its stream), so they reach the response as a
//! trailers-only answer: this layer reads the status from the response headers and, when it is
//! one of the codec's, answers `INVALID_ARGUMENT` with the codec's text (the size limit
//! included). A server's own `INTERNAL` answers are left alone.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use tonic::codegen::{http, Service};
use tonic::{Code, Status};

/// The beginnings of the messages tonic's codec gives a request it cannot decode.
const UNDECODABLE: [&str; 6] = [
    "failed to decode Protobuf message",
    "protocol error: received message",
    "Unexpected EOF decoding stream",
    "Missing request message",
    "Error decompressing",
    "Error, decoded message length too large",
];

/// The `INVALID_ARGUMENT` status for a codec's refusal of a request, if `s` is one.
pub(crate) fn undecodable(s: &Status) -> Option<Status> {
    let codec = matches!(s.code(), Code::Internal | Code::OutOfRange)
        && UNDECODABLE.iter().any(|prefix| s.message().starts_with(prefix));
    codec.then(|| Status::invalid_argument(format!("the request does not decode: {}", s.message())))
}

/// A gRPC service whose answers to undecodable requests are `INVALID_ARGUMENT`.
#[derive(Clone, Debug)]
pub(crate) struct DecodeErrors<S>(pub(crate) S);

impl<S: tonic::server::NamedService> tonic::server::NamedService for DecodeErrors<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for DecodeErrors<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>> + Send,
    S::Future: Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<B>) -> Self::Future {
        let answer = self.0.call(req);
        Box::pin(async move {
            let mut response = answer.await?;
            let fixed = Status::from_header_map(response.headers()).and_then(|s| undecodable(&s));
            if let Some(fixed) = fixed {
                let headers = response.headers_mut();
                headers.remove("grpc-status-details-bin");
                headers.remove("grpc-message");
                if fixed.add_header(headers).is_err() {
                    headers.insert("grpc-status", http::HeaderValue::from(Code::InvalidArgument as i32));
                }
            }
            Ok(response)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_codecs_refusals_become_invalid_argument() {
        let decode = Status::internal("failed to decode Protobuf message: invalid wire type value: 7");
        let fixed = undecodable(&decode).unwrap();
        assert_eq!(fixed.code(), Code::InvalidArgument);
        assert!(fixed.message().contains("invalid wire type value: 7"), "{}", fixed.message());
        let large =
            Status::out_of_range("Error, decoded message length too large: found 5000 bytes, the limit is: 4096 bytes");
        let fixed = undecodable(&large).unwrap();
        assert_eq!(fixed.code(), Code::InvalidArgument);
        assert!(fixed.message().contains("the limit is: 4096 bytes"), "{}", fixed.message());
        assert!(undecodable(&Status::internal("the checkpoint writer stopped")).is_none());
        assert!(undecodable(&Status::not_found("failed to decode Protobuf message")).is_none());
    }
}
