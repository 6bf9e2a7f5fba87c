//! A gRPC client on a slow link: it takes what the server sends a little
//! at a time, as one across a busy network (or on a loaded machine) does,
//! so the server's answers are still on their way when it closes.

use std::{
    future::Future as _,
    io,
    net::SocketAddr,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};

use ebtrace_proto::tensorflow::profiler_service_client::ProfilerServiceClient;
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
    time::{Instant, Sleep},
};
use tonic::transport::{Channel, Endpoint, Uri};
use tower::service_fn;

/// The most one read takes.
const READ_BYTES: usize = 1024;
/// The pause after each read: about 1 MB/s.
const READ_PAUSE: Duration = Duration::from_millis(1);

/// A client of the ProfilerService at `addr` that reads about 1 MB/s.
pub async fn client(addr: SocketAddr) -> ProfilerServiceClient<Channel> {
    let channel = Endpoint::from_shared(format!("http://{addr}"))
        .expect("an address")
        .connect_with_connector(service_fn(move |_: Uri| async move {
            Ok::<_, io::Error>(TokioIo::new(SlowReads {
                tcp: TcpStream::connect(addr).await?,
                pause: Box::pin(tokio::time::sleep(Duration::ZERO)),
            }))
        }))
        .await
        .expect("connect to ebtrace serve");
    ProfilerServiceClient::new(channel).max_decoding_message_size(usize::MAX)
}

/// A TCP stream that reads [`READ_BYTES`] at a time, [`READ_PAUSE`] apart.
struct SlowReads {
    tcp: TcpStream,
    pause: Pin<Box<Sleep>>,
}

impl AsyncRead for SlowReads {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        ready!(this.pause.as_mut().poll(cx));
        let mut bytes = [0u8; READ_BYTES];
        let wanted = buf.remaining().min(READ_BYTES);
        let mut some = ReadBuf::new(&mut bytes[..wanted]);
        ready!(Pin::new(&mut this.tcp).poll_read(cx, &mut some))?;
        buf.put_slice(some.filled());
        this.pause.as_mut().reset(Instant::now() + READ_PAUSE);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for SlowReads {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().tcp).poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().tcp).poll_shutdown(cx)
    }
}
