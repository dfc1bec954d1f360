//! Intel MultiProcessor table for Linux guests (as Firecracker's mptable):
//! it tells the kernel how many CPUs there are and where the IOAPIC is, with
//! ISA IRQs 0-23 routed 1:1 to IOAPIC pins.

/// In the EBDA, which the e820 map leaves out of usable RAM.
pub const MPTABLE_ADDR: u64 = 0x9_fc00;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_ADDR: u32 = 0xfec0_0000;
const LAPIC_ADDR: u32 = 0xfee0_0000;
const IRQS: u8 = 24;

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// The floating pointer followed by the configuration table, to be written
/// at `MPTABLE_ADDR`.
pub fn build(vcpus: u8) -> Vec<u8> {
    let ioapic_id = vcpus + 1;
    let mut entries = Vec::new();
    for id in 0..vcpus {
        entries.extend_from_slice(&[0, id, APIC_VERSION, if id == 0 { 3 } else { 1 }]); // enabled (| BSP)
        entries.extend_from_slice(&0x600u32.to_le_bytes()); // cpu signature: family 6
        entries.extend_from_slice(&0x201u32.to_le_bytes()); // features: FPU, APIC
        entries.extend_from_slice(&[0; 8]);
    }
    entries.extend_from_slice(&[1, 0, b'I', b'S', b'A', b' ', b' ', b' ']); // bus 0 = ISA
    entries.extend_from_slice(&[2, ioapic_id, 0x11, 1]); // IOAPIC, usable
    entries.extend_from_slice(&IOAPIC_ADDR.to_le_bytes());
    for irq in 0..IRQS {
        // INT, default polarity/trigger, ISA irq → IOAPIC pin irq.
        entries.extend_from_slice(&[3, 0, 0, 0, 0, irq, ioapic_id, irq]);
    }
    entries.extend_from_slice(&[4, 3, 0, 0, 0, 0, 0xff, 0]); // LINT0: ExtINT
    entries.extend_from_slice(&[4, 1, 0, 0, 0, 0, 0xff, 1]); // LINT1: NMI

    let mut table = Vec::with_capacity(44 + entries.len());
    table.extend_from_slice(b"PCMP");
    table.extend_from_slice(&((44 + entries.len()) as u16).to_le_bytes());
    table.push(4); // spec 1.4
    table.push(0); // checksum, below
    table.extend_from_slice(b"BURSTVM ");
    table.extend_from_slice(b"MICROVM     ");
    table.extend_from_slice(&0u32.to_le_bytes()); // oem table
    table.extend_from_slice(&0u16.to_le_bytes()); // oem size
    let count = vcpus as u16 + 1 + 1 + IRQS as u16 + 2;
    table.extend_from_slice(&count.to_le_bytes());
    table.extend_from_slice(&LAPIC_ADDR.to_le_bytes());
    table.extend_from_slice(&0u32.to_le_bytes()); // extended table
    table.extend_from_slice(&entries);
    table[7] = checksum(&table);

    let mut mpf = Vec::with_capacity(16);
    mpf.extend_from_slice(b"_MP_");
    mpf.extend_from_slice(&((MPTABLE_ADDR + 16) as u32).to_le_bytes());
    mpf.extend_from_slice(&[1, 4, 0, 0, 0, 0, 0, 0]); // length 16 bytes, spec 1.4
    mpf[10] = checksum(&mpf);
    mpf.extend_from_slice(&table);
    mpf
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_and_layout() {
        let t = build(2);
        assert_eq!(&t[..4], b"_MP_");
        assert_eq!(t[..16].iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
        let table = &t[16..];
        assert_eq!(&table[..4], b"PCMP");
        let len = u16::from_le_bytes([table[4], table[5]]) as usize;
        assert_eq!(len, table.len());
        assert_eq!(table.iter().fold(0u8, |a, b| a.wrapping_add(*b)), 0);
        // 2 CPUs (20 bytes each), bus, IOAPIC, 24 IRQs, 2 LINTs (8 bytes each).
        assert_eq!(len, 44 + 2 * 20 + 8 * (1 + 1 + 24 + 2));
        assert!(MPTABLE_ADDR + build(32).len() as u64 <= 0xa_0000);
    }
}
