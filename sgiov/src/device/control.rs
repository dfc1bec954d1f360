//! The control protocol (SG-IOV §A.4): OPEN, LISTEN, CONNECT, ACCEPT and
//! CLOSE requests on an SGF's control ring, each answered on its reply ring.

use super::*;

impl Device {
    /// Handles the control requests that arrived.
    pub(super) fn control(&mut self, id: SgfId) {
        for _ in 0..limits::CTRL_BUDGET {
            let Some(m) = self.sgfs.get_mut(id as usize).and_then(|s| {
                s.sgf.write_replies();
                s.sgf.next_request()
            }) else {
                return;
            };
            if let Some(r) = self.request(id, &m) {
                self.reply(id, reply_to(&m, r));
            }
        }
        // More requests than the budget: continue in the next round.
        self.rekick.push_back(id);
    }

    pub(super) fn reply(&mut self, id: SgfId, m: CtrlMsg) {
        if let Some(s) = self.sgfs.get_mut(id as usize) {
            s.sgf.reply(m);
        }
    }

    /// One control request; `None` when the reply comes later.
    pub(super) fn request(&mut self, id: SgfId, m: &CtrlMsg) -> Option<Result<(), ErrorCode>> {
        let Some(op) = CtrlOp::from_u16(m.op) else {
            return Some(Err(ErrorCode::BadRequest));
        };
        match op {
            CtrlOp::Open => Some(self.open(id, m)),
            CtrlOp::Listen => Some(self.listen(id, m)),
            CtrlOp::Connect => self.connect(id, m).transpose(),
            CtrlOp::Accept => self.accept(id, m).transpose(),
            CtrlOp::Close => self.close(id, m).transpose(),
        }
    }

    pub(super) fn sock_state(&self, id: SgfId, sock: RingId) -> Option<SockState> {
        self.sgfs
            .get(id as usize)?
            .sockets
            .get(&sock)
            .map(|s| s.state)
    }

    pub(super) fn set_state(&mut self, id: SgfId, sock: RingId, st: SockState) {
        if let Some(s) = self
            .sgfs
            .get_mut(id as usize)
            .and_then(|x| x.sockets.get_mut(&sock))
        {
            s.state = st;
        }
    }

    /// OPEN: validate the two ring descriptors (read once) and register them.
    pub(super) fn open(&mut self, id: SgfId, m: &CtrlMsg) -> Result<(), ErrorCode> {
        let (tx, rx) = (m.sock, m.aux);
        let slot = self.sgfs.get_mut(id as usize).ok_or(ErrorCode::NotFound)?;
        let sgf = &mut slot.sgf;
        let valid =
            |r: RingId| r >= FIRST_DATA_RING && r != RING_NONE && (r as u32) < sgf.ring_table_len();
        if tx == rx || !valid(tx) || !valid(rx) {
            return Err(ErrorCode::BadRequest);
        }
        if sgf.rings.contains_key(&tx) || sgf.rings.contains_key(&rx) {
            return Err(ErrorCode::Busy);
        }
        if slot.sockets.len() >= limits::MAX_SOCKETS_PER_SGF {
            return Err(ErrorCode::NoSpace);
        }
        // `dedicated` mode: the socket's own channel, released again if the
        // rings are refused.
        let chan = m.chan.checked_sub(1).map(u16::from);
        if let Some(k) = chan {
            sgf.open_channel(k, tx, rx)?;
        }
        let r = Self::open_rings(sgf, tx, rx);
        let geoms = match (r, chan) {
            (Ok(g), _) => g,
            (Err(e), Some(k)) => {
                sgf.close_channel(k);
                return Err(e);
            }
            (Err(e), None) => return Err(e),
        };
        for (r, role, g, label) in geoms {
            let view = RingView::new(sgf.mem.clone(), g);
            let k = self
                .engine
                .add_ring(view, label, ((id as u64) << 16) | r as u64);
            sgf.add_ring(r, role, g, k, tx);
        }
        if let Some(k) = chan {
            sgf.bind_channel(k, tx, rx);
        }
        slot.sockets.insert(
            tx,
            Socket {
                tx,
                rx,
                prio: m.prio.min(crate::sched::PRIO_LEVELS - 1),
                state: SockState::Open,
            },
        );
        Ok(())
    }

    /// OPEN's checks of the two ring descriptors (read once): in guest
    /// memory, overlapping nothing, prepared for device writes.
    #[allow(clippy::type_complexity)]
    fn open_rings(
        sgf: &mut Sgf,
        tx: RingId,
        rx: RingId,
    ) -> Result<Vec<(RingId, RingRole, RingGeom, String)>, ErrorCode> {
        let mut geoms = Vec::with_capacity(2);
        for (r, role) in [
            (tx, RingRole::GuestProduces),
            (rx, RingRole::DeviceProduces),
        ] {
            let d = sgf.read_desc(r).ok_or(ErrorCode::Memory)?;
            let label = format!("SGF {} ring {r}", sgf.name);
            let geom = RingGeom::from_desc(&label, &*sgf.mem, &d, role).map_err(|e| e.code())?;
            geoms.push((r, role, geom, label));
        }
        let mut inserted = Vec::new();
        for (_, _, g, label) in &geoms {
            if sgf.ranges.insert(g.base, g.end(), label.clone()).is_err() {
                for b in inserted {
                    sgf.ranges.remove(b);
                }
                return Err(ErrorCode::Overlap);
            }
            inserted.push(g.base);
        }
        for (_, _, g, _) in &geoms {
            if sgf.mem.prepare(g.base, g.size as u64).is_err() {
                for b in inserted {
                    sgf.ranges.remove(b);
                }
                return Err(ErrorCode::Memory);
            }
        }
        Ok(geoms)
    }

    pub(super) fn listen(&mut self, id: SgfId, m: &CtrlMsg) -> Result<(), ErrorCode> {
        match self.sock_state(id, m.sock) {
            None => return Err(ErrorCode::NotFound),
            Some(SockState::Open) => {}
            Some(_) => return Err(ErrorCode::State),
        }
        if m.port == 0 {
            return Err(ErrorCode::BadRequest);
        }
        if self.ports.contains_key(&m.port) {
            return Err(ErrorCode::AddrInUse);
        }
        self.ports.insert(
            m.port,
            Listener {
                sgf: id,
                sock: m.sock,
                accepts: VecDeque::new(),
                backlog: VecDeque::new(),
            },
        );
        self.set_state(id, m.sock, SockState::Listening { port: m.port });
        Ok(())
    }

    pub(super) fn connect(&mut self, id: SgfId, m: &CtrlMsg) -> Result<Option<()>, ErrorCode> {
        match self.sock_state(id, m.sock) {
            None => return Err(ErrorCode::NotFound),
            Some(SockState::Open) => {}
            Some(_) => return Err(ErrorCode::State),
        }
        let xf = Transform::from_u8(m.xf).ok_or(ErrorCode::BadRequest)?;
        let path = PathKind::from_u8(m.path).ok_or(ErrorCode::BadRequest)?;
        if xf == Transform::Crypto && path == PathKind::Direct {
            return Err(ErrorCode::BadRequest);
        }
        if m.port == 0 {
            self.establish((id, m.sock), None, xf, path)?;
            return Ok(Some(()));
        }
        let lsgf = self.ports.get(&m.port).ok_or(ErrorCode::Refused)?.sgf;
        if !self.links.allowed(self.tenant(id), self.tenant(lsgf)) {
            // Another tenant's port: as if nobody listened (no probing).
            return Err(ErrorCode::Refused);
        }
        let l = self.ports.get_mut(&m.port).ok_or(ErrorCode::Refused)?;
        if let Some((b, breq)) = l.accepts.pop_front() {
            let lsgf = l.sgf;
            self.pair((id, m.sock, m.req_id), (lsgf, b, breq), xf, path);
            return Ok(None);
        }
        if l.backlog.len() >= limits::LISTEN_BACKLOG {
            return Err(ErrorCode::Refused);
        }
        l.backlog.push_back((id, m.sock, m.req_id, xf, path));
        self.set_state(
            id,
            m.sock,
            SockState::Connecting {
                port: m.port,
                req_id: m.req_id,
            },
        );
        Ok(None)
    }

    pub(super) fn tenant(&self, id: SgfId) -> u32 {
        self.sgfs.get(id as usize).map_or(0, |s| s.sgf.tenant)
    }

    pub(super) fn accept(&mut self, id: SgfId, m: &CtrlMsg) -> Result<Option<()>, ErrorCode> {
        let port = match self.sock_state(id, m.sock) {
            Some(SockState::Listening { port }) => port,
            None => return Err(ErrorCode::NotFound),
            Some(_) => return Err(ErrorCode::State),
        };
        match self.sock_state(id, m.aux) {
            None => return Err(ErrorCode::NotFound),
            Some(SockState::Open) => {}
            Some(_) => return Err(ErrorCode::State),
        }
        let l = self.ports.get_mut(&port).ok_or(ErrorCode::NotFound)?;
        if let Some((a, asock, areq, xf, path)) = l.backlog.pop_front() {
            self.pair((a, asock, areq), (id, m.aux, m.req_id), xf, path);
        } else {
            l.accepts.push_back((m.aux, m.req_id));
            self.set_state(id, m.aux, SockState::AcceptWait { listener: m.sock });
        }
        Ok(None)
    }

    pub(super) fn close(&mut self, id: SgfId, m: &CtrlMsg) -> Result<Option<()>, ErrorCode> {
        let st = self.sock_state(id, m.sock).ok_or(ErrorCode::NotFound)?;
        match st {
            SockState::Connected { conn } | SockState::PeerClosed { conn } => {
                self.set_state(
                    id,
                    m.sock,
                    SockState::Closing {
                        conn,
                        req_id: m.req_id,
                    },
                );
                if self.conns.get(conn).is_some_and(|c| c.closing) {
                    self.finish_conn(conn);
                } else {
                    self.teardown(conn);
                }
                return Ok(None);
            }
            SockState::Closing { .. } => return Err(ErrorCode::State),
            SockState::Dead => {}
            SockState::Listening { port } => self.unlisten(port),
            SockState::Connecting { port, .. } => {
                if let Some(l) = self.ports.get_mut(&port) {
                    l.backlog.retain(|c| !(c.0 == id && c.1 == m.sock));
                }
            }
            SockState::AcceptWait { listener } => {
                if let Some(SockState::Listening { port }) = self.sock_state(id, listener) {
                    if let Some(l) = self.ports.get_mut(&port) {
                        l.accepts.retain(|a| a.0 != m.sock);
                    }
                }
            }
            SockState::Open => {}
        }
        self.release_socket(id, m.sock);
        Ok(Some(()))
    }
}
