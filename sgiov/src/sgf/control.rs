//! The control rings of one SGF: requests read once from ring 0 and replies
//! written into ring 1, held back (bounded) while it is full.

use super::*;

impl Sgf {
    /// Takes the next control request (read once), if a whole one is there
    /// and the reply backlog has room. The tail it frees is signalled.
    pub fn next_request(&mut self) -> Option<CtrlMsg> {
        if self.state != SgfState::Attached
            || self.req.1.used() < ctrl::MSG_BYTES
            || self.replies.len() >= MAX_REPLY_BACKLOG
        {
            return None;
        }
        let mut b = [0u8; 64];
        let tail = self.req.1.tail;
        if self.req.0.read(tail, &mut b).is_err() {
            self.ring_error(CTRL_REQ_RING, ErrorCode::Memory);
            return None;
        }
        let label = format!("SGF {} ring 0", self.name);
        let _ = self
            .req
            .1
            .publish_tail(&label, tail.wrapping_add(ctrl::MSG_BYTES));
        let t = self.req.1.tail;
        if let Some(r) = self.rings.get_mut(&CTRL_REQ_RING) {
            r.dev_ptr = t;
        }
        self.queue(CTRL_REQ_RING, pend::PTR);
        self.stats.ctrl_requests += 1;
        let mut m = CtrlMsg::default();
        // CtrlMsg is ByteValued and exactly 64 bytes.
        vm_memory::ByteValued::as_mut_slice(&mut m).copy_from_slice(&b);
        Some(m)
    }

    /// Queues a reply; written into ring 1 as soon as there is room.
    pub fn reply(&mut self, m: CtrlMsg) {
        if m.status != 0 {
            self.stats.ctrl_errors += 1;
        }
        self.replies.push_back(m);
        self.write_replies();
    }

    /// Writes held-back replies while ring 1 has room.
    pub fn write_replies(&mut self) {
        let mut wrote = false;
        while self.rep.1.free() >= ctrl::MSG_BYTES {
            let Some(m) = self.replies.pop_front() else {
                break;
            };
            let head = self.rep.1.head;
            if self
                .rep
                .0
                .write(head, vm_memory::ByteValued::as_slice(&m))
                .is_err()
            {
                self.ring_error(CTRL_REPLY_RING, ErrorCode::Memory);
                return;
            }
            let label = format!("SGF {} ring 1", self.name);
            let _ = self
                .rep
                .1
                .publish_head(&label, head.wrapping_add(ctrl::MSG_BYTES));
            wrote = true;
        }
        if wrote {
            let h = self.rep.1.head;
            if let Some(r) = self.rings.get_mut(&CTRL_REPLY_RING) {
                r.dev_ptr = h;
            }
            self.queue(CTRL_REPLY_RING, pend::PTR);
        }
    }
}
