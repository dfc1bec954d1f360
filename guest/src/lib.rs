//! The built-in guest agent: freestanding C (in `src/c/`) built by build.rs
//! into a flat binary linked at [`LOAD_ADDR`]. See docs/guest.md.

/// Guest physical address the image must be loaded at (start of the `image` region).
pub const LOAD_ADDR: u64 = 0xC000_0000;

include!(concat!(env!("OUT_DIR"), "/agent_consts.rs"));

/// The agent, to be copied to [`LOAD_ADDR`]; it includes its zeroed `.bss`
/// (stack and data), so everything from `LOAD_ADDR + AGENT_IMAGE.len()` on is
/// free for the app payload.
pub static AGENT_IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/agent.bin"));

// The entry point is the first byte of the image (entry.S, .text.entry).
const _: () = assert!(ENTRY_ADDR == LOAD_ADDR);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn image_is_small() {
        // Guest code runs ~1000x slower here; the agent must stay tiny.
        assert!(!AGENT_IMAGE.is_empty() && AGENT_IMAGE.len() < 64 * 1024);
    }
}
