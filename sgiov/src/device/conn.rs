//! Connections: pairing a CONNECT with an ACCEPT, building the pipes of
//! both directions (direct, staged, or through the crypto executors), and
//! tearing them down with their rings and listeners.

use super::*;

impl Device {
    /// Connects a waiting CONNECT and a waiting ACCEPT; replies to both.
    pub(super) fn pair(
        &mut self,
        c: (SgfId, RingId, u32),
        a: (SgfId, RingId, u32),
        xf: Transform,
        path: PathKind,
    ) {
        let r = self.establish((c.0, c.1), Some((a.0, a.1)), xf, path);
        if r.is_ok() && c.0 != a.0 {
            self.chains += 1;
            self.crypto_chains += (xf == Transform::Crypto) as u64;
        }
        let msg = |op: CtrlOp, req_id, sock, aux, peer| CtrlMsg {
            op: op as u16 | ctrl::REPLY,
            req_id,
            status: r.err().map_or(0, |e| e as u32),
            sock,
            aux,
            peer_sock: peer,
            ..Default::default()
        };
        if r.is_err() {
            self.set_state(c.0, c.1, SockState::Open);
            self.set_state(a.0, a.1, SockState::Open);
        }
        self.reply(c.0, msg(CtrlOp::Connect, c.2, c.1, 0, a.1));
        self.reply(a.0, msg(CtrlOp::Accept, a.2, a.1, a.1, c.1));
    }

    /// Builds the pipes of a connection between socket `a` and socket `b`
    /// (or `a` with itself: the echo service).
    pub(super) fn establish(
        &mut self,
        a: (SgfId, RingId),
        b: Option<(SgfId, RingId)>,
        xf: Transform,
        path: PathKind,
    ) -> Result<(), ErrorCode> {
        let conn = self.conns.insert(Conn {
            ends: vec![a],
            pipes: Vec::new(),
            staging: Vec::new(),
            keys: Vec::new(),
            closing: false,
        });
        let dirs = match b {
            None => vec![(a, a)],
            Some(b) => {
                self.conns[conn].ends.push(b);
                vec![(a, b), (b, a)]
            }
        };
        for (from, to) in dirs {
            if let Err(e) = self.direction(conn, from, to, xf, path) {
                self.teardown(conn);
                return Err(e);
            }
        }
        let ends = self.conns[conn].ends.clone();
        for (s, sock) in ends {
            self.set_state(s, sock, SockState::Connected { conn });
        }
        Ok(())
    }

    /// The pipes carrying `from`'s TX ring to `to`'s RX ring.
    pub(super) fn direction(
        &mut self,
        conn: usize,
        from: (SgfId, RingId),
        to: (SgfId, RingId),
        xf: Transform,
        path: PathKind,
    ) -> Result<(), ErrorCode> {
        let ring_of =
            |d: &Device, (s, sock): (SgfId, RingId), tx: bool| -> Option<(RingId, RingKey)> {
                let slot = d.sgfs.get(s as usize)?;
                let so = slot.sockets.get(&sock)?;
                let r = if tx { so.tx } else { so.rx };
                Some((r, slot.sgf.rings.get(&r)?.engine?))
            };
        let (src_id, src) = ring_of(self, from, true).ok_or(ErrorCode::NotFound)?;
        let (sink_id, sink) = ring_of(self, to, false).ok_or(ErrorCode::NotFound)?;
        let slot = &self.sgfs[from.0 as usize];
        let (tenant, prio) = (slot.sgf.tenant, slot.sockets[&from.1].prio);
        let label = |what: &str| format!("SGF {} socket {} {what}", slot.sgf.name, from.1);
        let spec = |src, sink, xf, key_slot, what: &str| PipeSpec {
            src,
            sink,
            xf,
            tenant,
            prio,
            key_slot,
            max_job: None,
            label: label(what),
            tag: conn as u64,
        };
        let mut specs = Vec::new();
        let (gsrc, gsink) = (Some((from.0, src_id)), Some((to.0, sink_id)));
        match path {
            PathKind::Direct => {
                specs.push((spec(src, sink, Xf::Direct, 0, "direct pipe"), gsrc, gsink))
            }
            PathKind::Staged => {
                let size = self.cfg.staging_ring;
                let addr = self.staging.alloc(size).ok_or(ErrorCode::NoSpace)?;
                let mem: Arc<dyn Memory> = self.staging.clone();
                let geom = RingGeom { base: addr, size };
                let st =
                    self.engine
                        .add_ring(RingView::new(mem, geom), label("staging ring"), u64::MAX);
                self.conns[conn].staging.push((st, addr, size));
                let (x1, x2, key) = match xf {
                    Transform::Copy => (Xf::Copy, Xf::Copy, 0),
                    Transform::Crypto => {
                        let (k, _) = self.keys.alloc_random().ok_or(ErrorCode::NoSpace)?;
                        self.conns[conn].keys.push(k);
                        (Xf::Encrypt, Xf::Decrypt, k)
                    }
                };
                specs.push((spec(src, st, x1, key, "to-staging pipe"), gsrc, None));
                specs.push((spec(st, sink, x2, key, "from-staging pipe"), None, gsink));
            }
        }
        for (s, gs, gk) in specs {
            let pipe = self.engine.add_pipe(s).map_err(|_| ErrorCode::Busy)?;
            self.conns[conn].pipes.push(ConnPipe {
                pipe,
                guest_src: gs,
                guest_sink: gk,
                gone: false,
            });
        }
        Ok(())
    }

    /// Closes a connection's pipes; its ends see `Closed` on their rings.
    pub(super) fn teardown(&mut self, conn: usize) {
        let Some(c) = self.conns.get_mut(conn) else {
            return;
        };
        if c.closing {
            return;
        }
        c.closing = true;
        let (pipes, ends): (Vec<PipeKey>, Vec<(SgfId, RingId)>) =
            (c.pipes.iter().map(|p| p.pipe).collect(), c.ends.clone());
        for p in pipes {
            let _ = self.engine.close_pipe(p);
        }
        for (s, sock) in ends {
            let Some(slot) = self.sgfs.get_mut(s as usize) else {
                continue;
            };
            let Some(so) = slot.sockets.get_mut(&sock) else {
                continue;
            };
            if let SockState::Connected { conn } = so.state {
                so.state = SockState::PeerClosed { conn };
            }
            let (tx, rx) = (so.tx, so.rx);
            slot.sgf.ring_closed(tx);
            slot.sgf.ring_closed(rx);
        }
        self.finish_conn(conn);
    }

    /// Frees a torn-down connection once all its pipes are gone: staging
    /// rings, key slots, and the replies to CLOSE requests that waited.
    pub(super) fn finish_conn(&mut self, conn: usize) {
        let done = self.conns.get(conn).is_some_and(|c| {
            c.closing
                && c.pipes
                    .iter()
                    .all(|p| p.gone || self.engine.pipe_state(p.pipe).is_none())
        });
        if !done {
            return;
        }
        let c = self.conns.remove(conn);
        for (k, addr, size) in c.staging {
            if self.engine.remove_ring(k).is_ok() {
                self.staging.free(addr, size);
            }
        }
        for k in c.keys {
            self.keys.remove(k);
        }
        for (s, sock) in c.ends {
            if let Some(SockState::PeerClosed { .. }) = self.sock_state(s, sock) {
                self.set_state(s, sock, SockState::Dead);
            }
            if let Some(SockState::Closing { req_id, .. }) = self.sock_state(s, sock) {
                self.release_socket(s, sock);
                self.reply(
                    s,
                    CtrlMsg {
                        op: CtrlOp::Close as u16 | ctrl::REPLY,
                        req_id,
                        sock,
                        ..Default::default()
                    },
                );
            }
        }
    }

    /// Removes a socket and its rings (no pipe uses them any more).
    pub(super) fn release_socket(&mut self, id: SgfId, sock: RingId) {
        let Some(slot) = self.sgfs.get_mut(id as usize) else {
            return;
        };
        let Some(s) = slot.sockets.remove(&sock) else {
            return;
        };
        for r in [s.tx, s.rx] {
            if let Some(k) = slot.sgf.remove_ring(r).and_then(|x| x.engine) {
                let _ = self.engine.remove_ring(k);
            }
        }
    }

    pub(super) fn retire_ring(&mut self, k: RingKey) {
        // A ring still used by a closing pipe goes once the pipe is gone.
        if self.engine.remove_ring(k).is_err() {
            self.orphans.push(k);
        }
    }

    pub(super) fn unlisten(&mut self, port: u32) {
        let Some(l) = self.ports.remove(&port) else {
            return;
        };
        for (s, sock, req_id, _, _) in l.backlog {
            self.set_state(s, sock, SockState::Open);
            self.reply(
                s,
                CtrlMsg {
                    op: CtrlOp::Connect as u16 | ctrl::REPLY,
                    req_id,
                    status: ErrorCode::Refused as u32,
                    sock,
                    ..Default::default()
                },
            );
        }
        for (sock, req_id) in l.accepts {
            self.set_state(l.sgf, sock, SockState::Open);
            self.reply(
                l.sgf,
                CtrlMsg {
                    op: CtrlOp::Accept as u16 | ctrl::REPLY,
                    req_id,
                    status: ErrorCode::State as u32,
                    sock: l.sock,
                    aux: sock,
                    ..Default::default()
                },
            );
        }
        self.set_state(l.sgf, l.sock, SockState::Open);
    }
}
