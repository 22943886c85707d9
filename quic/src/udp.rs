//! Batched UDP for QUIC: generic segmentation offload on send (GSO, `UDP_SEGMENT`) and
//! receive offload (GRO, `UDP_GRO`), shared by the broker's glommio cores and the tokio client.
//!
//! Why: without offload every QUIC packet costs one syscall each way (~5 µs of kernel time per
//! packet here, DEPENDENCIES.md); with GSO a run of up to [`GSO_SEGMENTS_MAX`] equal-size
//! packets to one peer goes down in one `sendmsg`, and with GRO the kernel hands several
//! datagrams of one flow back in one `recvmsg`.
//!
//! The planning ([`gso_runs`], [`gro_segments`]) is pure code; [`send_gso`] / [`recv_gro`]
//! are thin non-blocking syscalls that report `WouldBlock` so each runtime can wait for
//! readiness its own way. Where the kernel refuses offload (`EIO`/`EINVAL` on a GSO send, e.g.
//! a device without checksum offload), the caller turns GSO off and sends packet by packet.

use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::ops::Range;
use std::os::fd::RawFd;

/// Most segments the kernel takes in one GSO send (`UDP_MAX_SEGMENTS`).
pub const GSO_SEGMENTS_MAX: usize = 64;
/// Largest UDP payload one `sendmsg` may carry (the IPv4 limit is 65,507; kept below it).
pub const UDP_PAYLOAD_SUM_MAX: usize = 65_000;

const SOL_UDP: libc::c_int = 17;
const UDP_SEGMENT: libc::c_int = 103;
const UDP_GRO: libc::c_int = 104;

/// Split `packets` (length and destination of each, in send order) into runs that one GSO
/// `sendmsg` can carry: same destination, every packet the size of the first except a
/// shorter last one, at most `segments_max` packets and [`UDP_PAYLOAD_SUM_MAX`] bytes.
pub fn gso_runs(packets: &[(usize, SocketAddr)], segments_max: usize) -> Vec<Range<usize>> {
    let mut runs = Vec::new();
    let mut start = 0;
    while start < packets.len() {
        let end = gso_run_end(packets, start, segments_max);
        runs.push(start..end);
        start = end;
    }
    runs
}

/// The end of the run that starts at `start` (see [`gso_runs`]).
pub fn gso_run_end(packets: &[(usize, SocketAddr)], start: usize, segments_max: usize) -> usize {
    let segments_max = segments_max.clamp(1, GSO_SEGMENTS_MAX);
    let (seg, to) = packets[start];
    let mut end = start + 1;
    let mut bytes = seg;
    while end < packets.len() && end - start < segments_max {
        let (n, t) = packets[end];
        if t != to || n > seg || bytes + n > UDP_PAYLOAD_SUM_MAX {
            break;
        }
        bytes += n;
        end += 1;
        if n < seg {
            break; // a shorter packet may only end a run
        }
    }
    end
}

/// The datagrams inside `len` received bytes coalesced by GRO at `segment` bytes each (the
/// last may be shorter); one datagram when the kernel did not coalesce.
pub fn gro_segments(len: usize, segment: Option<usize>) -> impl Iterator<Item = Range<usize>> {
    let seg = match segment {
        Some(s) if s > 0 => s,
        _ => len.max(1),
    };
    (0..len).step_by(seg).map(move |o| o..(o + seg).min(len))
}

/// Ask the kernel to coalesce received datagrams (GRO). False when unsupported.
pub fn enable_gro(fd: RawFd) -> bool {
    let one: libc::c_int = 1;
    // SAFETY: setsockopt on a caller-owned socket with a correctly sized int.
    unsafe {
        libc::setsockopt(
            fd,
            SOL_UDP,
            UDP_GRO,
            &one as *const libc::c_int as *const libc::c_void,
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        ) == 0
    }
}

/// Set "don't fragment, and don't cap sends at the cached path MTU" (`IP_PMTUDISC_PROBE`, and
/// the IPv6 twin) so path MTU discovery sees the truth: a datagram larger than the path is
/// refused (`EMSGSIZE` locally) or dropped in the network, never fragmented. False if the
/// kernel refused; QUIC still works, only probes may then be fragmented.
pub fn set_pmtu_probe(fd: RawFd, ipv6: bool) -> bool {
    let set = |level: libc::c_int, opt: libc::c_int, v: libc::c_int| {
        // SAFETY: setsockopt on a caller-owned socket with a correctly sized int.
        unsafe {
            libc::setsockopt(
                fd,
                level,
                opt,
                &v as *const libc::c_int as *const libc::c_void,
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            ) == 0
        }
    };
    if ipv6 {
        // A dual-stack socket also carries IPv4; the IPv4 option may be refused there.
        let _ = set(
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_PROBE,
        );
        set(
            libc::IPPROTO_IPV6,
            libc::IPV6_MTU_DISCOVER,
            libc::IPV6_PMTUDISC_PROBE,
        )
    } else {
        set(
            libc::IPPROTO_IP,
            libc::IP_MTU_DISCOVER,
            libc::IP_PMTUDISC_PROBE,
        )
    }
}

fn to_sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all-zero is a valid value.
    let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(v4.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in.
            unsafe { std::ptr::write(&mut st as *mut _ as *mut libc::sockaddr_in, sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: sockaddr_storage is larger than and aligned for sockaddr_in6.
            unsafe { std::ptr::write(&mut st as *mut _ as *mut libc::sockaddr_in6, sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (st, len as libc::socklen_t)
}

fn from_sockaddr(st: &libc::sockaddr_storage) -> Option<SocketAddr> {
    match st.ss_family as libc::c_int {
        libc::AF_INET => {
            // SAFETY: the family says this storage holds a sockaddr_in.
            let sin = unsafe { &*(st as *const _ as *const libc::sockaddr_in) };
            let ip = Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes());
            Some(SocketAddr::V4(SocketAddrV4::new(
                ip,
                u16::from_be(sin.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this storage holds a sockaddr_in6.
            let sin6 = unsafe { &*(st as *const _ as *const libc::sockaddr_in6) };
            let ip = Ipv6Addr::from(sin6.sin6_addr.s6_addr);
            Some(SocketAddr::V6(SocketAddrV6::new(
                ip,
                u16::from_be(sin6.sin6_port),
                sin6.sin6_flowinfo,
                sin6.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

/// Control-message space for one `int` (UDP_SEGMENT / UDP_GRO), 8-byte aligned.
#[repr(C, align(8))]
struct CmsgBuf([u8; 64]);

/// Send `bufs` (one run from [`gso_runs`]) to `to` with one non-blocking `sendmsg`; with
/// `segment` set and more than one buffer the kernel splits the payload into datagrams of that
/// size (GSO). Returns the bytes sent; `WouldBlock` when the socket buffer is full.
pub fn send_gso(
    fd: RawFd,
    bufs: &[&[u8]],
    to: SocketAddr,
    segment: Option<u16>,
) -> io::Result<usize> {
    assert!(
        !bufs.is_empty() && bufs.len() <= GSO_SEGMENTS_MAX,
        "run of 1..=64 packets"
    );
    let (mut addr, addr_len) = to_sockaddr(to);
    let mut iov: Vec<libc::iovec> = bufs
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr() as *mut libc::c_void,
            iov_len: b.len(),
        })
        .collect();
    let mut cmsg = CmsgBuf([0; 64]);
    // SAFETY: msghdr is plain data; all-zero is a valid (empty) value.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = &mut addr as *mut _ as *mut libc::c_void;
    msg.msg_namelen = addr_len;
    msg.msg_iov = iov.as_mut_ptr();
    msg.msg_iovlen = iov.len() as _;
    if let (Some(seg), true) = (segment, bufs.len() > 1) {
        // SAFETY: CMSG_SPACE of a u16 fits the 64-byte aligned buffer; CMSG_FIRSTHDR is non-null
        // because msg_controllen covers one header.
        unsafe {
            let space = libc::CMSG_SPACE(std::mem::size_of::<u16>() as u32) as usize;
            msg.msg_control = cmsg.0.as_mut_ptr() as *mut libc::c_void;
            msg.msg_controllen = space as _;
            let c = libc::CMSG_FIRSTHDR(&msg);
            (*c).cmsg_level = SOL_UDP;
            (*c).cmsg_type = UDP_SEGMENT;
            (*c).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<u16>() as u32) as _;
            std::ptr::write_unaligned(libc::CMSG_DATA(c) as *mut u16, seg);
        }
    }
    // SAFETY: every pointer in msg refers to live locals or caller buffers for the call.
    let n = unsafe { libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Receive one (possibly GRO-coalesced) datagram without blocking: bytes, sender, and the
/// segment size when the kernel coalesced several. `WouldBlock` when nothing is waiting.
pub fn recv_gro(fd: RawFd, buf: &mut [u8]) -> io::Result<(usize, SocketAddr, Option<usize>)> {
    // SAFETY: plain data, all-zero valid.
    let mut addr: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr() as *mut libc::c_void,
        iov_len: buf.len(),
    };
    let mut cmsg = CmsgBuf([0; 64]);
    // SAFETY: plain data, all-zero valid.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = &mut addr as *mut _ as *mut libc::c_void;
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cmsg.0.as_mut_ptr() as *mut libc::c_void;
    msg.msg_controllen = cmsg.0.len() as _;
    // SAFETY: every pointer in msg refers to live locals or `buf` for the call.
    let n = unsafe { libc::recvmsg(fd, &mut msg, libc::MSG_DONTWAIT) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut segment = None;
    // SAFETY: walking the control messages the kernel wrote within msg_controllen.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            if (*c).cmsg_level == SOL_UDP && (*c).cmsg_type == UDP_GRO {
                let v = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::c_int);
                if v > 0 {
                    segment = Some(v as usize);
                }
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    let from =
        from_sockaddr(&addr).unwrap_or(SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0));
    Ok((n as usize, from, segment))
}

/// True for the errors that mean "this socket/device cannot do GSO": send packet by packet.
pub fn is_gso_unsupported(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EIO) | Some(libc::EINVAL) | Some(libc::EOPNOTSUPP)
    )
}

/// Sends every packet of a batch, in order: one GSO `sendmsg` per run of [`gso_runs`], one
/// packet per `sendmsg` when GSO is off. Runtime-agnostic: [`BatchSend::send`] returns
/// `WouldBlock` when the socket is full, the driver waits its own way and calls it again (or
/// [`BatchSend::give_up_run`]). Packets that cannot be sent are counted, never fatal: QUIC
/// recovers lost packets.
pub struct BatchSend<'a> {
    packets: &'a [(&'a [u8], SocketAddr)],
    shape: Vec<(usize, SocketAddr)>,
    next: usize,
    /// Packets not sent.
    pub failed: usize,
}

impl<'a> BatchSend<'a> {
    pub fn new(packets: &'a [(&'a [u8], SocketAddr)]) -> Self {
        let shape = packets.iter().map(|(p, a)| (p.len(), *a)).collect();
        BatchSend {
            packets,
            shape,
            next: 0,
            failed: 0,
        }
    }

    /// Send what is left. Turns `*gso` off for good if the kernel refuses offload and
    /// resends that run packet by packet.
    pub fn send(&mut self, fd: RawFd, gso: &mut bool) -> io::Result<()> {
        self.send_with(gso, |bufs, to, seg| send_gso(fd, bufs, to, seg))
    }

    /// [`BatchSend::send`] over any `sendmsg`-shaped function (the decision logic, testable
    /// without a kernel).
    pub fn send_with(
        &mut self,
        gso: &mut bool,
        mut send: impl FnMut(&[&[u8]], SocketAddr, Option<u16>) -> io::Result<usize>,
    ) -> io::Result<()> {
        let mut bufs: Vec<&[u8]> = Vec::with_capacity(GSO_SEGMENTS_MAX);
        while self.next < self.packets.len() {
            let i = self.next;
            let end = gso_run_end(&self.shape, i, if *gso { GSO_SEGMENTS_MAX } else { 1 });
            bufs.clear();
            bufs.extend(self.packets[i..end].iter().map(|(p, _)| *p));
            let seg = self.packets[i].0.len() as u16;
            match send(&bufs, self.packets[i].1, Some(seg)) {
                Ok(_) => self.next = end,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Err(e),
                Err(e) if end - i > 1 && is_gso_unsupported(&e) => {
                    // EINVAL also means "segment larger than the device MTU": a path MTU
                    // probe leading a run. Tell the two apart by sending the first packet
                    // alone: if the device takes it, offload itself was refused.
                    match send(&bufs[..1], self.packets[i].1, None) {
                        Ok(_) => {
                            tracing::warn!(error = %e, "UDP GSO refused by the kernel: sending packet by packet");
                            *gso = false;
                            self.next = i + 1;
                        }
                        Err(e1) if e1.kind() == io::ErrorKind::WouldBlock => return Err(e1),
                        Err(e1) => {
                            // Too large for the path (or failing anyway): this packet is lost
                            // (QUIC recovers it, PMTUD learns from it); offload stays on.
                            tracing::trace!(error = %e1, "udp send failed");
                            self.failed += 1;
                            self.next = i + 1;
                        }
                    }
                }
                Err(e) => {
                    tracing::trace!(error = %e, "udp send failed");
                    self.failed += end - i;
                    self.next = end;
                }
            }
        }
        Ok(())
    }

    /// Drop the run that could not be sent (socket full for too long).
    pub fn give_up_run(&mut self, gso: bool) {
        if self.next < self.packets.len() {
            let end = gso_run_end(
                &self.shape,
                self.next,
                if gso { GSO_SEGMENTS_MAX } else { 1 },
            );
            self.failed += end - self.next;
            self.next = end;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn a(p: u16) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], p))
    }

    #[test]
    fn runs_split_on_peer_size_and_count() {
        let p = vec![
            (1200, a(1)),
            (1200, a(1)),
            (800, a(1)),
            (1200, a(1)),
            (1200, a(2)),
        ];
        assert_eq!(gso_runs(&p, 64), vec![0..3, 3..4, 4..5]);
        // A longer packet after a full-size one starts a new run.
        let p = vec![(1000, a(1)), (1200, a(1))];
        assert_eq!(gso_runs(&p, 64), vec![0..1, 1..2]);
        let p = vec![(1350, a(1)); 130];
        assert_eq!(
            gso_runs(&p, 64),
            vec![0..48, 48..96, 96..130],
            "capped by bytes"
        );
        let p = vec![(100, a(1)); 130];
        assert_eq!(
            gso_runs(&p, 64),
            vec![0..64, 64..128, 128..130],
            "capped by count"
        );
        assert_eq!(gso_runs(&p[..3], 1), vec![0..1, 1..2, 2..3]);
        assert!(gso_runs(&[], 64).is_empty());
    }

    proptest::proptest! {
        #[test]
        fn runs_cover_in_order_and_hold_the_gso_rules(
            p in proptest::collection::vec((1usize..1400, 0u16..3), 0..300),
            max in 1usize..80,
        ) {
            let p: Vec<(usize, SocketAddr)> = p.into_iter().map(|(n, x)| (n, a(x))).collect();
            let runs = gso_runs(&p, max);
            let mut next = 0;
            for r in &runs {
                proptest::prop_assert_eq!(r.start, next);
                proptest::prop_assert!(!r.is_empty() && r.len() <= max.min(GSO_SEGMENTS_MAX));
                let (seg, to) = p[r.start];
                let sum: usize = p[r.clone()].iter().map(|x| x.0).sum();
                proptest::prop_assert!(r.len() == 1 || sum <= UDP_PAYLOAD_SUM_MAX);
                for (k, (n, t)) in p[r.clone()].iter().enumerate() {
                    proptest::prop_assert_eq!(*t, to);
                    proptest::prop_assert!(*n == seg || (*n < seg && k == r.len() - 1));
                }
                next = r.end;
            }
            proptest::prop_assert_eq!(next, p.len());
        }
    }

    /// A fake `sendmsg` for a path whose device MTU is `mtu`: a GSO run whose segments exceed
    /// it is EINVAL (what Linux answers), a lone datagram over it EMSGSIZE.
    fn device(
        mtu: usize,
        sent: &mut Vec<usize>,
    ) -> impl FnMut(&[&[u8]], SocketAddr, Option<u16>) -> io::Result<usize> + '_ {
        move |bufs, _to, seg| {
            if bufs.len() > 1 && seg.is_some_and(|s| s as usize > mtu) {
                return Err(io::Error::from_raw_os_error(libc::EINVAL));
            }
            if bufs.len() == 1 && bufs[0].len() > mtu {
                return Err(io::Error::from_raw_os_error(libc::EMSGSIZE));
            }
            sent.extend(bufs.iter().map(|b| b.len()));
            Ok(bufs.iter().map(|b| b.len()).sum())
        }
    }

    /// A path MTU probe larger than the device leads a GSO run: the kernel says EINVAL, as it
    /// would for a device that refuses offload. The probe alone gets EMSGSIZE, so it is counted
    /// lost and offload stays on; every other packet goes out, in order.
    #[test]
    fn oversized_probe_is_lost_without_turning_gso_off() {
        let sizes = [1400, 1400, 1400, 9000, 1400, 1400, 1400];
        let pkts: Vec<Vec<u8>> = sizes.iter().map(|&n| vec![0u8; n]).collect();
        let list: Vec<(&[u8], SocketAddr)> = pkts.iter().map(|p| (&p[..], a(1))).collect();
        let mut sent = Vec::new();
        let mut gso = true;
        let mut b = BatchSend::new(&list);
        b.send_with(&mut gso, device(1500, &mut sent)).unwrap();
        assert!(gso, "a too-large probe is not a refusal of offload");
        assert_eq!(b.failed, 1);
        assert_eq!(sent, vec![1400; 6]);
    }

    /// A device that refuses offload outright: GSO is turned off and the batch is sent packet
    /// by packet, nothing lost or repeated.
    #[test]
    fn refused_offload_turns_gso_off_and_sends_every_packet() {
        let pkts: Vec<Vec<u8>> = (0..10u8).map(|i| vec![i; 1200]).collect();
        let list: Vec<(&[u8], SocketAddr)> = pkts.iter().map(|p| (&p[..], a(1))).collect();
        let mut firsts = Vec::new();
        let mut gso = true;
        let mut b = BatchSend::new(&list);
        b.send_with(&mut gso, |bufs, _, seg| {
            if bufs.len() > 1 && seg.is_some() {
                return Err(io::Error::from_raw_os_error(libc::EIO));
            }
            firsts.push(bufs[0][0]);
            Ok(bufs[0].len())
        })
        .unwrap();
        assert!(!gso);
        assert_eq!(b.failed, 0);
        assert_eq!(firsts, (0..10u8).collect::<Vec<_>>());
    }

    #[test]
    fn gro_split() {
        let v: Vec<_> = gro_segments(2500, Some(1000)).collect();
        assert_eq!(v, vec![0..1000, 1000..2000, 2000..2500]);
        let v: Vec<_> = gro_segments(700, None).collect();
        assert_eq!(v, vec![0..700]);
        assert_eq!(gro_segments(0, None).count(), 0);
    }

    /// Real kernel, loopback: a GSO send of 40 packets arrives as the same 40 datagrams, in
    /// order, whether or not the receiver coalesces them with GRO.
    #[test]
    fn gso_send_gro_receive_on_loopback() {
        for gro in [true, false] {
            let rx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            let tx = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            if gro {
                assert!(enable_gro(rx.as_raw_fd()), "loopback supports UDP_GRO");
            }
            let to = rx.local_addr().unwrap();
            let pkts: Vec<Vec<u8>> = (0..40u8)
                .map(|i| vec![i; if i == 39 { 300 } else { 1200 }])
                .collect();
            let list: Vec<(&[u8], SocketAddr)> = pkts.iter().map(|p| (&p[..], to)).collect();
            let mut gso = true;
            let mut b = BatchSend::new(&list);
            b.send(tx.as_raw_fd(), &mut gso).unwrap();
            let failed = b.failed;
            assert_eq!(failed, 0);
            assert!(gso, "loopback supports UDP_SEGMENT");
            let mut got: Vec<Vec<u8>> = Vec::new();
            let mut buf = vec![0u8; 65536];
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
            while got.len() < 40 && std::time::Instant::now() < deadline {
                match recv_gro(rx.as_raw_fd(), &mut buf) {
                    Ok((n, from, seg)) => {
                        assert_eq!(from, tx.local_addr().unwrap());
                        for r in gro_segments(n, seg) {
                            got.push(buf[r].to_vec());
                        }
                    }
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        std::thread::sleep(std::time::Duration::from_millis(1))
                    }
                    Err(e) => panic!("recv: {e}"),
                }
            }
            assert_eq!(got, pkts, "gro={gro}");
        }
    }

    #[test]
    fn sockaddr_round_trip() {
        for s in ["127.0.0.1:7400", "[::1]:9", "[fe80::1%3]:443"] {
            let addr: SocketAddr = s.parse().unwrap();
            let (st, _) = to_sockaddr(addr);
            assert_eq!(from_sockaddr(&st), Some(addr));
        }
    }
}
