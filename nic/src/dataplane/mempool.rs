//! A mempool in the style of ixy: a fixed number of fixed-size packet buffers
//! in one allocation, handed out and taken back through a free stack. Owned by
//! one dataplane thread, so no locking.

pub const BUF_SIZE: usize = 2048;

/// A packet: which buffer, and how many bytes of it are the frame.
#[derive(Debug)]
pub struct Pkt {
    idx: u32,
    pub len: usize,
}

pub struct Mempool {
    mem: Vec<u8>,
    free: Vec<u32>,
}

impl Mempool {
    pub fn new(n: usize) -> Self {
        Mempool {
            mem: vec![0; n * BUF_SIZE],
            free: (0..n as u32).rev().collect(),
        }
    }
    pub fn alloc(&mut self) -> Option<Pkt> {
        self.free.pop().map(|idx| Pkt { idx, len: 0 })
    }
    pub fn free(&mut self, p: Pkt) {
        self.free.push(p.idx);
    }
    pub fn available(&self) -> usize {
        self.free.len()
    }
    /// The whole buffer (for filling).
    pub fn buf_mut(&mut self, p: &Pkt) -> &mut [u8] {
        let o = p.idx as usize * BUF_SIZE;
        &mut self.mem[o..o + BUF_SIZE]
    }
    /// The frame bytes.
    pub fn data(&self, p: &Pkt) -> &[u8] {
        let o = p.idx as usize * BUF_SIZE;
        &self.mem[o..o + p.len]
    }
    /// A copy of `p` in a new buffer (flooding to several ports).
    pub fn clone_pkt(&mut self, p: &Pkt) -> Option<Pkt> {
        let mut q = self.alloc()?;
        let (src, dst) = (p.idx as usize * BUF_SIZE, q.idx as usize * BUF_SIZE);
        self.mem.copy_within(src..src + p.len, dst);
        q.len = p.len;
        Some(q)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn alloc_free_clone() {
        let mut m = Mempool::new(2);
        let mut a = m.alloc().unwrap();
        m.buf_mut(&a)[..3].copy_from_slice(b"abc");
        a.len = 3;
        let b = m.clone_pkt(&a).unwrap();
        assert_eq!(m.data(&b), b"abc");
        assert!(m.alloc().is_none());
        m.free(a);
        m.free(b);
        assert_eq!(m.available(), 2);
    }
}
