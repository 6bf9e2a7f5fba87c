//! `Profile` and `GetSnapshot` answered with the trace's own buffer.
//!
//! tonic encodes a response into a buffer of its own before sending it: a
//! copy of the whole XSpace, tens of MB for a large capture, and as much
//! memory again while it is sent. These two methods' answers go out as
//! the gRPC frame's header and the fields around the trace, then the
//! trace's buffer itself. Their requests are decoded and handled by the
//! same [`ProfilerService`] methods as before; every other method, and
//! every failure, goes through tonic.

use std::{
    convert::Infallible,
    future::Future,
    pin::Pin,
    sync::Arc,
    task::{Context, Poll},
};

use bytes::{BufMut, Bytes, BytesMut};
use ebtrace_proto::tensorflow::{
    GetSnapshotRequest, ProfileRequest, ProfileResponse, ProfileToolData,
    profiler_service_server::ProfilerService,
};
use http_body_util::{BodyExt, Limited, StreamBody};
use prost::Message;
use tonic::{Request, Status, body::Body, metadata::MetadataMap, server::NamedService};
use tower_service::Service;

use super::service::ProfilerServer;

const PROFILE: &str = "/tensorflow.ProfilerService/Profile";
const SNAPSHOT: &str = "/tensorflow.ProfilerService/GetSnapshot";

/// The most a `Profile` or `GetSnapshot` request may take (tonic's own
/// default for a decoded message): they are a few hundred bytes.
const MAX_REQUEST_BYTES: usize = 4 << 20;

/// Wraps the generated `ProfilerServiceServer`, answering `Profile` and
/// `GetSnapshot` itself.
#[derive(Clone)]
pub struct Answering<S> {
    inner: S,
    server: Arc<ProfilerServer>,
}

impl<S> Answering<S> {
    /// `inner`, with `server` answering `Profile` and `GetSnapshot`.
    pub fn new(inner: S, server: Arc<ProfilerServer>) -> Self {
        Answering { inner, server }
    }
}

impl<S: NamedService> NamedService for Answering<S> {
    const NAME: &'static str = S::NAME;
}

type Answer = Pin<Box<dyn Future<Output = Result<http::Response<Body>, Infallible>> + Send>>;

impl<S> Service<http::Request<Body>> for Answering<S>
where
    S: Service<http::Request<Body>, Response = http::Response<Body>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = Answer;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<Body>) -> Answer {
        let server = Arc::clone(&self.server);
        match request.uri().path() {
            PROFILE => Box::pin(answered(
                request,
                move |r: Request<ProfileRequest>| async move { server.profile(r).await },
            )),
            SNAPSHOT => Box::pin(answered(
                request,
                move |r: Request<GetSnapshotRequest>| async move { server.get_snapshot(r).await },
            )),
            _ => Box::pin(self.inner.call(request)),
        }
    }
}

/// The HTTP response to a unary call of `method` with a request of type
/// `M`.
async fn answered<M, F, A>(
    request: http::Request<Body>,
    method: F,
) -> Result<http::Response<Body>, Infallible>
where
    M: Message + Default,
    F: FnOnce(Request<M>) -> A,
    A: Future<Output = Result<tonic::Response<ProfileResponse>, Status>>,
{
    let answer = async {
        let (metadata, extensions, message) = unary(request).await?;
        let message = M::decode(message).map_err(undecodable)?;
        let request = Request::from_parts(metadata, extensions, message);
        Ok(method(request).await?.into_inner())
    };
    Ok(respond(answer.await))
}

/// A request that is not the message it should be: `INTERNAL`, as tonic
/// (and gRPC's other servers) answer it.
fn undecodable(e: prost::DecodeError) -> Status {
    Status::internal(format!("failed to decode Protobuf message: {e}"))
}

/// A unary call's metadata, extensions and one uncompressed message.
/// Failures get the codes tonic gives them.
async fn unary(
    request: http::Request<Body>,
) -> Result<(MetadataMap, http::Extensions, Bytes), Status> {
    let (parts, body) = request.into_parts();
    let body = Limited::new(body, MAX_REQUEST_BYTES + 5)
        .collect()
        .await
        .map_err(|e| Status::out_of_range(format!("reading the request: {e}")))?
        .to_bytes();
    let message = one_message(body)?;
    Ok((
        MetadataMap::from_headers(parts.headers),
        parts.extensions,
        message,
    ))
}

/// The message of a gRPC body that holds exactly one, uncompressed.
fn one_message(mut body: Bytes) -> Result<Bytes, Status> {
    if body.len() < 5 {
        return Err(Status::internal("the request holds no message"));
    }
    if body[0] != 0 {
        return Err(Status::unimplemented(
            "compressed requests are not accepted: send them uncompressed",
        ));
    }
    let len = u32::from_be_bytes([body[1], body[2], body[3], body[4]]) as usize;
    let message = body.split_off(5);
    if message.len() != len {
        return Err(Status::internal(
            "the request must hold exactly one message",
        ));
    }
    Ok(message)
}

/// The HTTP response of an answer or a failure.
fn respond(answer: Result<ProfileResponse, Status>) -> http::Response<Body> {
    let response = match answer {
        Ok(response) => response,
        Err(status) => return status.into_http(),
    };
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", http::HeaderValue::from_static("0"));
    let frames = encoded(response)
        .into_iter()
        .map(http_body::Frame::data)
        .chain([http_body::Frame::trailers(trailers)])
        .map(Ok::<_, Infallible>);
    let body = Body::new(StreamBody::new(futures_util::stream::iter(frames)));
    let mut http = http::Response::new(body);
    http.headers_mut().insert(
        http::header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/grpc"),
    );
    http
}

/// `response` as one gRPC message in pieces: everything but the trace,
/// then the trace's own buffer (only a response with one tool's data and
/// no decoded XSpace has one; other responses are encoded whole).
fn encoded(mut response: ProfileResponse) -> Vec<Bytes> {
    let trace = match response.tool_data.as_mut_slice() {
        [tool] if response.xspace.is_none() => std::mem::take(&mut tool.data),
        _ => Vec::new(),
    };
    let tool_name = match response.tool_data.pop() {
        Some(tool) if !trace.is_empty() => tool.name,
        Some(tool) => {
            response.tool_data.push(tool);
            String::new()
        }
        None => String::new(),
    };
    let mut head = BytesMut::new();
    head.put_bytes(0, 5);
    response
        .encode(&mut head)
        .expect("a BytesMut grows as needed");
    if !trace.is_empty() {
        // ProfileResponse.tool_data (6) holding ProfileToolData { name (1),
        // data (2) }, its data's bytes last.
        let mut tool = Vec::new();
        ProfileToolData {
            name: tool_name,
            data: Vec::new(),
        }
        .encode(&mut tool)
        .expect("a Vec grows as needed");
        prost::encoding::encode_key(2, prost::encoding::WireType::LengthDelimited, &mut tool);
        prost::encoding::encode_varint(trace.len() as u64, &mut tool);
        prost::encoding::encode_key(6, prost::encoding::WireType::LengthDelimited, &mut head);
        prost::encoding::encode_varint((tool.len() + trace.len()) as u64, &mut head);
        head.put_slice(&tool);
    }
    let length = head.len() - 5 + trace.len();
    head[1..5].copy_from_slice(&(length as u32).to_be_bytes());
    let mut frames = vec![head.freeze()];
    if !trace.is_empty() {
        frames.push(Bytes::from(trace));
    }
    frames
}

#[cfg(test)]
mod tests {
    use super::*;
    use ebtrace_proto::tensorflow::profiler::XSpace;

    fn decoded(frames: Vec<Bytes>) -> ProfileResponse {
        let all: Vec<u8> = frames.iter().flat_map(|b| b.iter().copied()).collect();
        assert_eq!(all[0], 0, "not compressed");
        let len = u32::from_be_bytes(all[1..5].try_into().unwrap()) as usize;
        assert_eq!(len, all.len() - 5);
        ProfileResponse::decode(&all[5..]).unwrap()
    }

    #[test]
    fn a_trace_goes_out_as_its_own_buffer_and_decodes_as_prost_encodes_it() {
        let trace: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
        let response = ProfileResponse {
            tool_data: vec![ProfileToolData {
                name: "xplane.pb".into(),
                data: trace,
            }],
            empty_trace: false,
            xspace: None,
        };
        let expected = response.clone();
        let buffer = response.tool_data[0].data.as_ptr();
        let frames = encoded(response);
        assert_eq!(frames.len(), 2);
        assert_eq!(frames[1].as_ptr(), buffer, "the trace's own buffer");
        assert_eq!(decoded(frames), expected);
    }

    #[test]
    fn responses_without_one_trace_are_encoded_whole() {
        let empty = ProfileResponse {
            tool_data: vec![],
            empty_trace: true,
            xspace: None,
        };
        let inline = ProfileResponse {
            tool_data: vec![],
            empty_trace: false,
            xspace: Some(XSpace {
                hostnames: vec!["h".into()],
                ..Default::default()
            }),
        };
        let two = ProfileResponse {
            tool_data: vec![
                ProfileToolData {
                    name: "a".into(),
                    data: vec![1, 2],
                },
                ProfileToolData {
                    name: "b".into(),
                    data: vec![3],
                },
            ],
            empty_trace: false,
            xspace: None,
        };
        let named_but_empty = ProfileResponse {
            tool_data: vec![ProfileToolData {
                name: "xplane.pb".into(),
                data: vec![],
            }],
            empty_trace: true,
            xspace: None,
        };
        for response in [empty, inline, two, named_but_empty] {
            let frames = encoded(response.clone());
            assert_eq!(frames.len(), 1);
            assert_eq!(decoded(frames), response);
        }
    }

    #[test]
    fn requests_hold_one_uncompressed_message() {
        let framed = |flag: u8, len: u32, body: &[u8]| {
            let mut b = vec![flag];
            b.extend_from_slice(&len.to_be_bytes());
            b.extend_from_slice(body);
            Bytes::from(b)
        };
        assert_eq!(one_message(framed(0, 3, b"abc")).unwrap(), &b"abc"[..]);
        assert_eq!(one_message(framed(0, 0, b"")).unwrap(), &b""[..]);
        let code = |b| one_message(b).unwrap_err().code();
        assert_eq!(code(framed(1, 3, b"abc")), tonic::Code::Unimplemented);
        assert_eq!(code(framed(0, 4, b"abc")), tonic::Code::Internal);
        assert_eq!(code(framed(0, 2, b"abc")), tonic::Code::Internal);
        assert_eq!(code(Bytes::from_static(b"\0\0")), tonic::Code::Internal);
    }
}
