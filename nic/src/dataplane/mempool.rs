//! A mempool in the style of ixy: fixed-size packet buffers handed out and
//! taken back through a free stack. Owned by one dataplane thread, so no
//! locking. A working set is allocated at once; past it the pool grows on
//! demand up to its cap, each buffer allocated once (when the pool first
//! runs past its high-water mark) and then reused, so the steady state
//! allocates nothing and a pool sized for every backlog full costs memory
//! only when guests actually leave frames waiting.
//!
//! With several dataplane threads a packet may cross to another thread (a
//! frame for a VF it serves); a buffer always goes back to the pool it came
//! from (its `home`): freed elsewhere, it waits in `away` until its thread
//! sends it home (`Dataplane::flush_peers`).

pub const BUF_SIZE: usize = 2048;

type Buf = Box<[u8; BUF_SIZE]>;

/// A packet: its buffer, and how many bytes of it are the frame.
pub struct Pkt {
    buf: Buf,
    pub len: usize,
    home: usize,
}

impl Pkt {
    /// The whole buffer (for filling).
    pub fn buf_mut(&mut self) -> &mut [u8] {
        &mut self.buf[..]
    }
    /// The frame bytes.
    pub fn data(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl std::fmt::Debug for Pkt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Pkt(len {}, pool {})", self.len, self.home)
    }
}

pub struct Mempool {
    home: usize,
    free: Vec<Buf>,
    /// Buffers of other pools freed here, per home pool.
    away: Vec<Vec<Pkt>>,
    /// Buffers the pool may still allocate before it reaches its cap.
    unallocated: usize,
}

// Counts, not the packet buffers.
impl std::fmt::Debug for Mempool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mempool")
            .field("home", &self.home)
            .field("free", &self.free.len())
            .field("away", &self.away.iter().map(Vec::len).collect::<Vec<_>>())
            .field("unallocated", &self.unallocated)
            .finish()
    }
}

impl Mempool {
    pub fn new(n: usize) -> Self {
        Self::with_home(n, 0, 1)
    }
    /// Pool `home` of `homes` pools of `n` buffers each, all allocated now.
    pub fn with_home(n: usize, home: usize, homes: usize) -> Self {
        Self::growing(n, n, home, homes)
    }
    /// Pool `home` of `homes`: `prealloc` buffers now, up to `cap` on demand.
    pub fn growing(prealloc: usize, cap: usize, home: usize, homes: usize) -> Self {
        let prealloc = prealloc.min(cap);
        // At most `cap` buffers of a pool are anywhere: pushing never reallocates.
        let mut free = Vec::with_capacity(cap);
        free.extend((0..prealloc).map(|_| Box::new([0; BUF_SIZE])));
        Mempool {
            home,
            free,
            away: (0..homes)
                .map(|h| Vec::with_capacity(if h == home { 0 } else { cap }))
                .collect(),
            unallocated: cap - prealloc,
        }
    }
    pub fn alloc(&mut self) -> Option<Pkt> {
        let buf = match self.free.pop() {
            Some(buf) => buf,
            None if self.unallocated > 0 => {
                self.unallocated -= 1;
                Box::new([0; BUF_SIZE])
            }
            None => return None,
        };
        Some(Pkt {
            buf,
            len: 0,
            home: self.home,
        })
    }
    pub fn free(&mut self, p: Pkt) {
        if p.home == self.home {
            self.free.push(p.buf);
        } else {
            self.away[p.home].push(p);
        }
    }
    /// Buffers an `alloc` can still hand out (free, or not yet allocated).
    pub fn available(&self) -> usize {
        self.free.len() + self.unallocated
    }
    /// Buffers of pool `home` freed here, to send home.
    pub fn away(&mut self, home: usize) -> &mut Vec<Pkt> {
        &mut self.away[home]
    }
    /// A copy of `p` in a new buffer (flooding to several ports).
    pub fn clone_pkt(&mut self, p: &Pkt) -> Option<Pkt> {
        let mut q = self.alloc()?;
        q.buf[..p.len].copy_from_slice(p.data());
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
        a.buf_mut()[..3].copy_from_slice(b"abc");
        a.len = 3;
        let b = m.clone_pkt(&a).unwrap();
        assert_eq!(b.data(), b"abc");
        assert!(m.alloc().is_none());
        m.free(a);
        m.free(b);
        assert_eq!(m.available(), 2);
    }

    #[test]
    fn a_growing_pool_allocates_up_to_its_cap_and_then_reuses() {
        let mut m = Mempool::growing(1, 3, 0, 1);
        assert_eq!(m.available(), 3);
        let p: Vec<Pkt> = (0..3).map(|_| m.alloc().unwrap()).collect();
        assert!(m.alloc().is_none(), "capped");
        for p in p {
            m.free(p);
        }
        assert_eq!((m.available(), m.unallocated), (3, 0), "grown once, kept");
    }

    #[test]
    fn foreign_buffers_wait_to_go_home() {
        let (mut a, mut b) = (Mempool::with_home(1, 0, 2), Mempool::with_home(1, 1, 2));
        let p = a.alloc().unwrap();
        b.free(p);
        assert_eq!(
            (a.available(), b.available()),
            (0, 1),
            "not in b's own pool"
        );
        let p = b.away(0).pop().unwrap();
        a.free(p);
        assert_eq!((a.available(), b.available()), (1, 1));
    }
}
