//! The agent a program was started with (`LD_PRELOAD` and
//! `EBTRACE_AGENT=listen`), reached on its abstract socket
//! `@ebtrace-agent.<pid>`. Any user in the network namespace can bind that
//! name first, so the listener is trusted only if it is the program itself,
//! running as the program's user; anything else is ignored, with one line
//! saying so, and ebtrace loads its agent as for any program. ebtrace then
//! proves to the agent that it may trace the program, by reading the
//! agent's challenge out of the program's memory.

use std::os::{linux::net::SocketAddrExt as _, unix::net::SocketAddr, unix::net::UnixStream};

use tracer_agent::protocol;

use super::channel::Channel;

/// The channel to `pid`'s preloaded agent, proven and greeted; `None`
/// where nothing listens; an error line where what listens is not
/// trusted, or does not speak this protocol.
pub fn connect(pid: u32) -> Result<Option<Channel>, String> {
    let mut name = [0u8; 64];
    let len = protocol::abstract_socket_name(pid, &mut name);
    let Ok(addr) = SocketAddr::from_abstract_name(&name[..len]) else {
        return Ok(None);
    };
    let Ok(stream) = UnixStream::connect_addr(&addr) else {
        return Ok(None);
    };
    let socket = format!("@{}", String::from_utf8_lossy(&name[..len]));
    let (peer_pid, peer_uid) = peer_credentials(&stream)
        .map_err(|e| format!("{socket}: who listens there cannot be told ({e}); ignored"))?;
    if let Some(why) = untrusted(pid, peer_pid, peer_uid) {
        return Err(format!(
            "{socket} is held by {why}: ignored, ebtrace's agent is loaded instead"
        ));
    }
    let mut channel = Channel::new(stream, pid);
    let refused = |why: String| format!("the agent pid {pid} was started with: {why}; ignored");
    let hello = channel.greeting().map_err(refused)?;
    if hello.challenge != 0 {
        prove(&mut channel, pid, hello.challenge).map_err(refused)?;
    }
    Ok(Some(channel))
}

/// The process id and user id of whoever listens at the other end of
/// `stream` (`SO_PEERCRED`). The pid is 0 where the listener is in a pid
/// namespace ebtrace cannot see into, which rustix's non-zero `Pid` cannot
/// hold: so the plain C call.
fn peer_credentials(stream: &UnixStream) -> std::io::Result<(u32, u32)> {
    use std::os::fd::AsRawFd as _;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket, and an out buffer of the length given.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&raw mut cred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok((cred.pid.max(0) as u32, cred.uid))
}

/// Why a listener of pid `peer_pid` and uid `peer_uid` is not `pid`'s own
/// agent; `None` if it is.
fn untrusted(pid: u32, peer_pid: u32, peer_uid: u32) -> Option<String> {
    // The kernel gives the listener's process id (0 where it is in a pid
    // namespace ebtrace cannot see into).
    let process = crate::procfs::process_of_task(peer_pid);
    if peer_pid == 0 || process != Some(pid) {
        return Some(format!(
            "pid {peer_pid} (uid {peer_uid}), not the program itself"
        ));
    }
    match crate::procfs::real_uid(pid) {
        Some(uid) if uid == peer_uid => None,
        Some(uid) => Some(format!(
            "uid {peer_uid}, not the program's user (uid {uid})"
        )),
        None => Some(format!("pid {peer_pid}, whose user cannot be read")),
    }
}

/// Answers the agent's challenge with what lies at `address` in `pid`.
fn prove(channel: &mut Channel, pid: u32, address: u64) -> Result<(), String> {
    let mut proof = [0u8; protocol::CHALLENGE_LEN];
    crate::procfs::read_memory(pid, address, &mut proof)
        .map_err(|e| format!("its challenge cannot be read from /proc/{pid}/mem ({e})"))?;
    channel.send("PROVE", protocol::PROVE, &proof)?;
    match channel.receive()? {
        (protocol::PROVEN, _) => Ok(()),
        (kind, _) => Err(format!("it answered the proof with frame {kind}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_program_itself_as_its_user_is_trusted() {
        let me = std::process::id();
        let uid = crate::procfs::real_uid(me).unwrap();
        assert_eq!(untrusted(me, me, uid), None);
        let other_user = untrusted(me, me, uid + 1).unwrap();
        assert!(
            other_user.contains("not the program's user"),
            "{other_user}"
        );
        // pid 1 is another process; pid 0, one ebtrace cannot see.
        assert!(
            untrusted(me, 1, uid)
                .unwrap()
                .contains("not the program itself")
        );
        assert!(
            untrusted(me, 0, uid)
                .unwrap()
                .contains("not the program itself")
        );
    }
}
