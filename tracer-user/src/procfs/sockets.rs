//! Who owns a TCP socket on this machine, from the kernel's socket table
//! (`sock_diag`, the interface `ss` reads): the uid of the process at the
//! other end of a loopback connection, before anything it sent is read.

use std::{
    io,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use rustix::net::{
    AddressFamily, RecvFlags, SendFlags, SocketFlags, SocketType, netlink, recv, send, socket_with,
    sockopt::{Timeout, set_socket_timeout},
};

/// `SOCK_DIAG_BY_FAMILY`: a request about sockets of one family.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
const NLM_F_REQUEST: u16 = 1;
const NLMSG_ERROR: u16 = 2;
const IPPROTO_TCP: u8 = 6;
/// Every TCP state.
const ALL_STATES: u32 = u32::MAX;
/// `INET_DIAG_NOCOOKIE`: the socket is found by its addresses alone.
const NO_COOKIE: u32 = u32::MAX;
const HEADER_LEN: usize = 16;
/// `struct inet_diag_sockid`: ports, two 16-byte addresses, interface, cookie.
const SOCKID_LEN: usize = 48;
/// Where `idiag_uid` lies in `struct inet_diag_msg`: four bytes, the
/// socket id, then expires, rqueue and wqueue.
const UID_AT: usize = 4 + SOCKID_LEN + 12;
/// How long the kernel gets to answer (it answers at once).
const ANSWER_WAIT: Duration = Duration::from_secs(1);

/// The uid owning the TCP socket whose local address is `local` and whose
/// peer is `remote`: for a connection accepted on `remote`, the process
/// at its other end (`local` is that process's side). `None` where no
/// such socket is known (it closed since).
pub fn tcp_socket_owner(local: SocketAddr, remote: SocketAddr) -> io::Result<Option<u32>> {
    let fd = socket_with(
        AddressFamily::NETLINK,
        SocketType::DGRAM,
        SocketFlags::CLOEXEC,
        Some(netlink::SOCK_DIAG),
    )?;
    set_socket_timeout(&fd, Timeout::Recv, Some(ANSWER_WAIT))?;
    send(&fd, &request(local, remote), SendFlags::empty())?;
    let mut answer = vec![0u8; 8192];
    let (len, _) = recv(&fd, &mut answer, RecvFlags::empty())?;
    parse_answer(&answer[..len])
}

/// The request for the one socket with these addresses.
fn request(local: SocketAddr, remote: SocketAddr) -> Vec<u8> {
    let family = match local.ip() {
        IpAddr::V4(_) => libc::AF_INET,
        IpAddr::V6(_) => libc::AF_INET6,
    } as u8;
    let address = |a: SocketAddr| -> [u8; 16] {
        let mut out = [0u8; 16];
        match a.ip() {
            IpAddr::V4(v4) => out[..4].copy_from_slice(&v4.octets()),
            IpAddr::V6(v6) => out.copy_from_slice(&v6.octets()),
        }
        out
    };
    let body_len = 8 + SOCKID_LEN;
    let mut req = Vec::with_capacity(HEADER_LEN + body_len);
    req.extend(((HEADER_LEN + body_len) as u32).to_ne_bytes());
    req.extend(SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend(NLM_F_REQUEST.to_ne_bytes());
    req.extend([0u8; 8]); // sequence number, port id
    req.extend([family, IPPROTO_TCP, 0, 0]);
    req.extend(ALL_STATES.to_ne_bytes());
    req.extend(local.port().to_be_bytes());
    req.extend(remote.port().to_be_bytes());
    req.extend(address(local));
    req.extend(address(remote));
    req.extend(0u32.to_ne_bytes()); // any interface
    req.extend(NO_COOKIE.to_ne_bytes());
    req.extend(NO_COOKIE.to_ne_bytes());
    req
}

/// The owner's uid in the kernel's answer; `None` where it knows no such
/// socket.
fn parse_answer(answer: &[u8]) -> io::Result<Option<u32>> {
    let short = || io::Error::new(io::ErrorKind::InvalidData, "short sock_diag answer");
    let header = answer.get(..HEADER_LEN).ok_or_else(short)?;
    let kind = u16::from_ne_bytes([header[4], header[5]]);
    let body = &answer[HEADER_LEN..];
    if kind == NLMSG_ERROR {
        let errno = -i32::from_ne_bytes(body.get(..4).ok_or_else(short)?.try_into().unwrap());
        return match errno {
            libc::ENOENT => Ok(None),
            _ => Err(io::Error::from_raw_os_error(errno)),
        };
    }
    if kind != SOCK_DIAG_BY_FAMILY {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("sock_diag answered with message type {kind}"),
        ));
    }
    let uid = body.get(UID_AT..UID_AT + 4).ok_or_else(short)?;
    Ok(Some(u32::from_ne_bytes(uid.try_into().unwrap())))
}

#[cfg(test)]
mod tests {
    use std::{
        net::{TcpListener, TcpStream},
        os::unix::process::CommandExt as _,
        process::Command,
    };

    use super::*;

    /// A connection this process made: its own socket is owned by its own
    /// uid, and a socket that does not exist is none.
    #[test]
    fn the_owner_of_a_loopback_connection_is_its_process_uid() {
        for any in ["127.0.0.1:0", "[::1]:0"] {
            let listener = TcpListener::bind(any).unwrap();
            let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (accepted, peer) = listener.accept().unwrap();
            let server_side = accepted.local_addr().unwrap();
            // SAFETY: no arguments.
            let uid = unsafe { libc::getuid() };
            assert_eq!(tcp_socket_owner(peer, server_side).unwrap(), Some(uid));
            drop((client, accepted));
            let mut gone = peer;
            gone.set_port(1);
            assert_eq!(tcp_socket_owner(gone, server_side).unwrap(), None);
        }
    }

    /// A connection from a process of another user (as root, which may
    /// start one): the kernel names that user.
    #[test]
    fn another_users_connection_is_owned_by_that_user() {
        // SAFETY: no arguments.
        if unsafe { libc::geteuid() } != 0 {
            return;
        }
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let mut child = Command::new("python3")
            .args([
                "-c",
                &format!(
                    "import socket,time; s=socket.create_connection(('127.0.0.1',{port})); \
                     time.sleep(30)"
                ),
            ])
            .uid(65534)
            .gid(65534)
            .spawn()
            .unwrap();
        let (accepted, peer) = listener.accept().unwrap();
        let owner = tcp_socket_owner(peer, accepted.local_addr().unwrap());
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(owner.unwrap(), Some(65534));
    }
}
