//! The subscription mux in the simulator. On odd seeds every drop_new subscription of a core
//! shares one connection (`mux_conn(core)`) whose one mux stream carries `SubMux` frames, as a
//! connection that negotiated `SUB_MUX` does. What the host writes on it goes through the wire
//! and waits in that connection's unread frames; the stream is writable once the connection
//! read them all. A read hands each item to every client the frame names. Stalling one of its
//! clients stalls the whole connection: the real client never stops reading the mux stream
//! for one subscription, so the broker's queues fill only when the connection falls behind.

use super::{Got, World};
use crate::core::conn::subs::SubEffect;
use felix_quic::wire::{submux, Frame, Records};

/// Connection keys of the mux connections (one per core): above every client id.
pub(crate) const MUX_CONN: u64 = 1 << 62;

/// A core's mux connection.
#[derive(Default)]
pub(crate) struct MuxConn {
    /// Frames written and not read yet: the subscriptions named, and the item.
    pub unread: Vec<(Vec<u64>, Got)>,
    pub stalled: bool,
}

pub(crate) fn mux_conn(core: u8) -> u64 {
    MUX_CONN | u64::from(core)
}

pub(crate) fn is_mux_conn(conn: u64) -> bool {
    conn & MUX_CONN != 0
}

impl World {
    /// A `SubMux` written on connection `conn`'s mux stream, through the wire.
    pub(super) fn on_mux_effect(&mut self, e: SubEffect) {
        let (conn, bytes) = match e {
            SubEffect::MuxBatch(conn, _, _, ids, b) => {
                let mut bytes = submux::encode_head(&ids, &b.head).to_vec();
                bytes.extend_from_slice(&b.region);
                (conn, bytes)
            }
            SubEffect::MuxFrame(conn, _, ids, frame) => {
                (conn, submux::encode_head(&ids, &frame.encode()).to_vec())
            }
            _ => unreachable!("only mux effects"),
        };
        assert!(is_mux_conn(conn), "a mux frame on a mux connection");
        // What the client reads is what it decodes from the bytes the host wrote.
        let decoded = felix_quic::wire::decode_frame(&bytes, usize::MAX >> 1)
            .expect("a SubMux the host wrote decodes");
        let Frame::SubMux {
            subscription_ids,
            frame,
        } = decoded
        else {
            panic!("a mux stream carries only SubMux frames")
        };
        let got = match *frame {
            Frame::Delivery {
                first_offset,
                records,
                ..
            } => Got::Batch {
                first: first_offset,
                records: Records::iter(&records).collect(),
            },
            Frame::Lag { from_offset, lost } => Got::Lag {
                from: from_offset,
                lost,
            },
            Frame::SubEnd { code, .. } => Got::End { code },
            other => panic!("a SubMux wraps {other:?}"),
        };
        self.mux_conns
            .entry(conn)
            .or_default()
            .unread
            .push((subscription_ids, got));
    }

    pub(super) fn mux_readable(&self) -> impl Iterator<Item = u64> + '_ {
        self.mux_conns
            .iter()
            .filter(|(_, m)| !m.stalled && !m.unread.is_empty())
            .map(|(c, _)| *c)
    }

    /// A mux connection reads everything on its mux stream; the stream drains and the core
    /// writes the next frame.
    pub(super) fn mux_conn_reads(&mut self) {
        let conns: Vec<u64> = self.mux_readable().collect();
        let conn = conns[self.rng.below(conns.len() as u64) as usize];
        let frames = std::mem::take(&mut self.mux_conns.get_mut(&conn).expect("readable").unread);
        for (ids, got) in frames {
            for sid in ids {
                // A client that unsubscribed is gone here: what was in flight for it is dropped.
                if let Some(cl) = self.clients.get_mut(&sid) {
                    assert!(cl.mux, "only mux subscriptions are named in a SubMux");
                    cl.read.push(got.clone());
                }
            }
        }
        let core = (conn & 0xff) as u8;
        self.with_subs(core, |h, w, ctx| h.pump_mux(conn, w, ctx));
        self.drain_inbox(core);
    }
}
