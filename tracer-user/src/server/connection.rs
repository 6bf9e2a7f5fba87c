//! The connections of `serve`'s TCP listeners, plain or TLS, each with who
//! is at its other end ([`Peer`]), for both the gRPC and the HTTP server.
//! TLS handshakes run off the accept loop, a bounded number at once and
//! each within [`HANDSHAKE_TIMEOUT`], so a client that stalls in one holds
//! up no one else. A connection is closed the way [`Closing`] says, so the
//! end of an answer is never lost on the way.

use std::{
    io,
    net::SocketAddr,
    pin::Pin,
    sync::{Arc, atomic::Ordering},
    task::{Context, Poll},
    time::Duration,
};

use tokio::{
    io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf},
    net::{TcpListener, TcpStream},
    sync::{Semaphore, mpsc},
};
use tokio_rustls::{TlsAcceptor, server::TlsStream};
use tokio_util::task::TaskTracker;

use super::tls::{CertSubject, ServerTls};
use crate::metrics::Metrics;

/// How long a client has to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// TLS handshakes in progress at once; connections past it are closed.
const MAX_HANDSHAKES: usize = 64;
/// How long a closed connection's client has to take what was sent to it
/// and close its end.
pub const LINGER: Duration = Duration::from_secs(5);

/// Who is at the far end of a connection.
#[derive(Clone, Debug)]
pub struct Peer {
    /// This server's address the connection came to.
    pub local: SocketAddr,
    /// The client's address.
    pub remote: SocketAddr,
    /// What its client certificate names, on a TLS listener.
    pub certificate: Option<Arc<CertSubject>>,
}

enum Io {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
    /// Handed to [`Closing`].
    Closed,
}

/// One accepted connection, ready for HTTP.
pub struct Connection {
    io: Io,
    peer: Peer,
    closing: Closing,
}

/// The connections being closed. A socket closed while its client still
/// sends (HTTP/2 flow-control updates, as it reads an answer) is reset by
/// the kernel, and what was still on its way to the client is dropped: the
/// end of a large answer, most often at shutdown. So a connection's end
/// is closed after what was sent, and its socket only once the client
/// closes its own end, or after [`LINGER`].
#[derive(Clone, Default)]
pub struct Closing(TaskTracker);

impl Closing {
    /// Waits, at most [`LINGER`], for the connections being closed.
    pub async fn wait(&self) {
        self.0.close();
        let _ = tokio::time::timeout(LINGER, self.0.wait()).await;
    }

    fn close(&self, tcp: TcpStream) {
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        self.0.spawn_on(linger(tcp), &runtime);
    }
}

/// Closes `tcp`'s end after what was written to it, and reads (and drops)
/// what the client sends until it closes its end, at most [`LINGER`].
async fn linger(mut tcp: TcpStream) {
    let _ = tcp.shutdown().await;
    let mut unread = [0u8; 4096];
    let _ = tokio::time::timeout(LINGER, async {
        while let Ok(1..) = tcp.read(&mut unread).await {}
    })
    .await;
}

impl Drop for Connection {
    fn drop(&mut self) {
        match std::mem::replace(&mut self.io, Io::Closed) {
            Io::Plain(tcp) => self.closing.close(tcp),
            Io::Tls(tls) => self.closing.close(tls.into_inner().0),
            Io::Closed => {}
        }
    }
}

/// The connections a listener accepted, in order of their handshakes'
/// end; ends when nothing reads it.
pub struct Incoming {
    connections: mpsc::Receiver<Connection>,
    local: SocketAddr,
    tls: bool,
}

impl Incoming {
    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Whether its connections speak TLS.
    pub fn speaks_tls(&self) -> bool {
        self.tls
    }
}

/// Accepts connections on `listener`, with TLS where `tls` is given; each
/// is closed through `closing`.
pub fn accept(
    listener: TcpListener,
    tls: Option<Arc<ServerTls>>,
    metrics: Arc<Metrics>,
    closing: Closing,
) -> io::Result<Incoming> {
    let local = listener.local_addr()?;
    let (sender, connections) = mpsc::channel(16);
    let speaks_tls = tls.is_some();
    tokio::spawn(accept_loop(
        listener,
        Accepting {
            local,
            tls,
            metrics,
            closing,
        },
        sender,
    ));
    Ok(Incoming {
        connections,
        local,
        tls: speaks_tls,
    })
}

/// What the accept loop gives each connection.
struct Accepting {
    local: SocketAddr,
    tls: Option<Arc<ServerTls>>,
    metrics: Arc<Metrics>,
    closing: Closing,
}

async fn accept_loop(
    listener: TcpListener,
    accepting: Accepting,
    sender: mpsc::Sender<Connection>,
) {
    let Accepting {
        local,
        tls,
        metrics,
        closing,
    } = accepting;
    let handshakes = Arc::new(Semaphore::new(MAX_HANDSHAKES));
    loop {
        let accepted = tokio::select! {
            () = sender.closed() => return,
            accepted = listener.accept() => accepted,
        };
        let (tcp, remote) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                // Out of descriptors, most likely: wait for some to close.
                log::warn!("accepting a connection on {local}: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let _ = tcp.set_nodelay(true);
        let peer = Peer {
            local,
            remote,
            certificate: None,
        };
        let Some(tls) = &tls else {
            let connection = Connection {
                io: Io::Plain(tcp),
                peer,
                closing: closing.clone(),
            };
            if sender.send(connection).await.is_err() {
                return;
            }
            continue;
        };
        let Ok(permit) = Arc::clone(&handshakes).try_acquire_owned() else {
            log::warn!("{MAX_HANDSHAKES} TLS handshakes in progress: closed {remote}'s connection");
            continue;
        };
        let acceptor = TlsAcceptor::from(tls.config());
        let sender = sender.clone();
        let metrics = Arc::clone(&metrics);
        let closing = closing.clone();
        tokio::spawn(async move {
            let _permit = permit;
            match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    let certificate = stream
                        .get_ref()
                        .1
                        .peer_certificates()
                        .and_then(|chain| chain.first())
                        .and_then(|cert| CertSubject::of(cert))
                        .map(Arc::new);
                    let connection = Connection {
                        io: Io::Tls(Box::new(stream)),
                        peer: Peer {
                            certificate,
                            ..peer
                        },
                        closing,
                    };
                    let _ = sender.send(connection).await;
                }
                // Closed before saying anything: a port probe (the
                // kubelet's tcpSocket check), not a client refused.
                Ok(Err(e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    log::debug!("{remote} closed its connection before a TLS handshake");
                }
                Ok(Err(e)) => refused_handshake(&metrics, remote, &e.to_string()),
                Err(_) => refused_handshake(&metrics, remote, "it did not finish in time"),
            }
        });
    }
}

fn refused_handshake(metrics: &Metrics, remote: SocketAddr, why: &str) {
    metrics
        .server
        .tls_handshakes_refused
        .fetch_add(1, Ordering::Relaxed);
    eprintln!("ebtrace: refused a TLS connection from {remote}: {why}");
}

impl tokio_stream::Stream for Incoming {
    type Item = io::Result<Connection>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.connections.poll_recv(cx).map(|c| c.map(Ok))
    }
}

impl axum::serve::Listener for Incoming {
    type Io = Connection;
    type Addr = Peer;

    async fn accept(&mut self) -> (Connection, Peer) {
        match self.connections.recv().await {
            Some(connection) => {
                let peer = connection.peer.clone();
                (connection, peer)
            }
            // The accept loop ends only once this is dropped.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> io::Result<Peer> {
        Ok(Peer {
            local: self.local,
            remote: self.local,
            certificate: None,
        })
    }
}

impl axum::extract::connect_info::Connected<axum::serve::IncomingStream<'_, Incoming>> for Peer {
    fn connect_info(stream: axum::serve::IncomingStream<'_, Incoming>) -> Self {
        stream.remote_addr().clone()
    }
}

impl tonic::transport::server::Connected for Connection {
    type ConnectInfo = Peer;

    fn connect_info(&self) -> Peer {
        self.peer.clone()
    }
}

impl AsyncRead for Connection {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
            Io::Closed => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }
}

impl AsyncWrite for Connection {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
            Io::Closed => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
            Io::Closed => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
            Io::Closed => false,
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
            Io::Closed => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            Io::Closed => Poll::Ready(Err(io::ErrorKind::NotConnected.into())),
        }
    }
}
