//! The built-in guest agent: freestanding C (in `src/c/`) built by build.rs
//! into a flat binary linked at [`LOAD_ADDR`]. See docs/guest.md.

/// Guest physical address the image must be loaded at (start of the `image` region).
pub const LOAD_ADDR: u64 = 0xC000_0000;

include!(concat!(env!("OUT_DIR"), "/agent_consts.rs"));

/// The agent, to be copied to [`LOAD_ADDR`]; it includes its zeroed `.bss`
/// (stack and data), so everything from `LOAD_ADDR + AGENT_IMAGE.len()` on is
/// free for the app payload.
pub static AGENT_IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/agent.bin"));

/// burstvm init for Linux guests (linux/init.c): a static x86-64 ELF that a
/// VMX host runs as /sbin/init from the EROFS root; it reports on the agent
/// port as the built-in agent does (`burstvm rootfs build --init` adds it).
pub static LINUX_INIT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/linux_init"));

// The entry point is the first byte of the image (entry.S, .text.entry).
const _: () = assert!(ENTRY_ADDR == LOAD_ADDR);

/// The agent's checksum (docs/guest.md), as agent.c computes it (csum.h)
/// over the app payload and the rootfs file: wrapping sum of little-endian
/// u64 words, last partial word zero-padded, folded to 32 bits as
/// low ^ high. Cheap per byte in a slow guest, yet every byte counts.
pub fn checksum(data: &[u8]) -> u32 {
    let mut c = Checksum::default();
    c.add(data);
    c.finish()
}

/// [`checksum`] over a stream of chunks of any length.
#[derive(Debug, Clone, Default)]
pub struct Checksum {
    sum: u64,
    /// Bytes of a word not yet complete, and how many.
    partial: [u8; 8],
    npartial: usize,
}

impl Checksum {
    pub fn add(&mut self, mut data: &[u8]) {
        if self.npartial > 0 {
            let n = (8 - self.npartial).min(data.len());
            self.partial[self.npartial..self.npartial + n].copy_from_slice(&data[..n]);
            self.npartial += n;
            data = &data[n..];
            if self.npartial < 8 {
                return;
            }
            self.sum = self.sum.wrapping_add(u64::from_le_bytes(self.partial));
            self.npartial = 0;
        }
        let mut chunks = data.chunks_exact(8);
        for c in &mut chunks {
            self.sum = self
                .sum
                .wrapping_add(u64::from_le_bytes(c.try_into().expect("8-byte chunk")));
        }
        let rest = chunks.remainder();
        self.partial[..rest.len()].copy_from_slice(rest);
        self.npartial = rest.len();
    }

    pub fn finish(&self) -> u32 {
        let mut tail = [0u8; 8];
        tail[..self.npartial].copy_from_slice(&self.partial[..self.npartial]);
        let sum = self.sum.wrapping_add(u64::from_le_bytes(tail));
        sum as u32 ^ (sum >> 32) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn streamed_checksum_equals_whole() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 + i / 3) as u8).collect();
        let whole = checksum(&data);
        for step in [1, 3, 8, 13, 999] {
            let mut c = Checksum::default();
            data.chunks(step).for_each(|p| c.add(p));
            assert_eq!(c.finish(), whole, "chunks of {step}");
        }
        assert_eq!(checksum(&[1, 0, 0, 0, 0, 0, 0, 0, 2]), 3);
    }

    #[test]
    fn linux_init_is_a_static_elf() {
        assert_eq!(&LINUX_INIT[..4], b"\x7fELF");
        assert!(LINUX_INIT.len() < 32 * 1024);
    }

    #[test]
    fn image_is_small() {
        // Guest code runs ~1000x slower here; the agent must stay tiny.
        assert!(!AGENT_IMAGE.is_empty() && AGENT_IMAGE.len() < 64 * 1024);
    }
}
