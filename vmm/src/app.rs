//! The app payload: deterministic pseudo-random bytes derived from the
//! sandbox id, which the agent checksums during `app-launch`.

/// FNV-1a, 64-bit: a stable seed from the sandbox id.
pub fn fnv1a64(data: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for &b in data {
        h ^= b as u64;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// `len` bytes of xorshift64* output seeded from the sandbox id.
pub fn payload(sandbox: &str, len: usize) -> Vec<u8> {
    let mut x = fnv1a64(sandbox.as_bytes()) | 1;
    let mut out = Vec::with_capacity(len + 8);
    while out.len() < len {
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        out.extend_from_slice(&x.wrapping_mul(0x2545_f491_4f6c_dd1d).to_le_bytes());
    }
    out.truncate(len);
    out
}

/// The agent's checksum (docs/guest.md), shared with the rootfs check.
pub use guest::checksum;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payload_is_deterministic_per_sandbox() {
        assert_eq!(payload("a", 1000), payload("a", 1000));
        assert_ne!(payload("a", 64), payload("b", 64));
        assert_eq!(payload("a", 13).len(), 13);
        assert_eq!(&payload("a", 100)[..13], &payload("a", 13)[..]);
    }

    #[test]
    fn checksum_counts_every_byte() {
        assert_eq!(checksum(&[]), 0);
        assert_eq!(checksum(&[1, 0, 0, 0, 0, 0, 0, 0, 2]), 3);
        assert_eq!(checksum(&[0, 0, 0, 0, 1, 0, 0, 0]), 1);
        let p = payload("x", 4099);
        let mut q = p.clone();
        q[4098] ^= 0x40;
        assert_ne!(checksum(&p), checksum(&q));
    }
}
