//! Intel MultiProcessor table for Linux guests (as Firecracker's mptable):
//! it tells the kernel how many CPUs there are and where the IOAPIC is, with
//! ISA IRQs 0-23 routed 1:1 to IOAPIC pins. Each entry is a `ByteValued`
//! struct laid out as in the MP specification 1.4.

use vm_memory::ByteValued;

/// In the EBDA, which the e820 map leaves out of usable RAM.
pub const MPTABLE_ADDR: u64 = 0x9_fc00;
const APIC_VERSION: u8 = 0x14;
const IOAPIC_ADDR: u32 = 0xfec0_0000;
const LAPIC_ADDR: u32 = 0xfee0_0000;
const IRQS: u8 = 24;

/// MP floating pointer structure (16 bytes).
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct MpFloating {
    signature: [u8; 4],
    physptr: u32,
    length: u8,
    spec: u8,
    checksum: u8,
    features: [u8; 5],
}

/// MP configuration table header (44 bytes).
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct MpTableHeader {
    signature: [u8; 4],
    length: u16,
    spec: u8,
    checksum: u8,
    oem: [u8; 8],
    product: [u8; 12],
    oem_table: u32,
    oem_size: u16,
    entries: u16,
    lapic: u32,
    ext_length: u16,
    ext_checksum: u8,
    reserved: u8,
}

/// Processor entry (20 bytes).
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct MpCpu {
    kind: u8,
    apic_id: u8,
    apic_version: u8,
    flags: u8,
    signature: u32,
    features: u32,
    reserved: [u32; 2],
}

/// Bus entry (8 bytes).
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct MpBus {
    kind: u8,
    bus_id: u8,
    bus_type: [u8; 6],
}

/// I/O APIC entry (8 bytes).
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct MpIoapic {
    kind: u8,
    apic_id: u8,
    apic_version: u8,
    flags: u8,
    address: u32,
}

/// I/O interrupt (kind 3) and local interrupt (kind 4) assignment (8 bytes).
#[repr(C, packed)]
#[derive(Clone, Copy, Default)]
struct MpInterrupt {
    kind: u8,
    irq_type: u8,
    irq_flags: u16,
    src_bus: u8,
    src_irq: u8,
    dst_apic: u8,
    dst_pin: u8,
}

// SAFETY: each struct is repr(C, packed) of integers and byte arrays, so it
// has no padding and every bit pattern is a valid value.
unsafe impl ByteValued for MpFloating {}
// SAFETY: as above.
unsafe impl ByteValued for MpTableHeader {}
// SAFETY: as above.
unsafe impl ByteValued for MpCpu {}
// SAFETY: as above.
unsafe impl ByteValued for MpBus {}
// SAFETY: as above.
unsafe impl ByteValued for MpIoapic {}
// SAFETY: as above.
unsafe impl ByteValued for MpInterrupt {}

const _: () = assert!(size_of::<MpFloating>() == 16);
const _: () = assert!(size_of::<MpTableHeader>() == 44);
const _: () = assert!(size_of::<MpCpu>() == 20);
const _: () = assert!(size_of::<MpBus>() == 8);
const _: () = assert!(size_of::<MpIoapic>() == 8);
const _: () = assert!(size_of::<MpInterrupt>() == 8);

fn checksum(bytes: &[u8]) -> u8 {
    0u8.wrapping_sub(bytes.iter().fold(0u8, |a, b| a.wrapping_add(*b)))
}

/// The floating pointer followed by the configuration table, to be written
/// at `MPTABLE_ADDR`.
pub fn build(vcpus: u8) -> Vec<u8> {
    let ioapic_id = vcpus + 1;
    let mut entries = Vec::new();
    for id in 0..vcpus {
        let cpu = MpCpu {
            kind: 0,
            apic_id: id,
            apic_version: APIC_VERSION,
            flags: if id == 0 { 3 } else { 1 }, // enabled (| BSP)
            signature: 0x600,                   // family 6
            features: 0x201,                    // FPU, APIC
            reserved: [0; 2],
        };
        entries.extend_from_slice(cpu.as_slice());
    }
    let bus = MpBus {
        kind: 1,
        bus_id: 0,
        bus_type: *b"ISA   ",
    };
    entries.extend_from_slice(bus.as_slice());
    let ioapic = MpIoapic {
        kind: 2,
        apic_id: ioapic_id,
        apic_version: 0x11,
        flags: 1, // usable
        address: IOAPIC_ADDR,
    };
    entries.extend_from_slice(ioapic.as_slice());
    for irq in 0..IRQS {
        // INT, default polarity/trigger, ISA irq → IOAPIC pin irq.
        let int = MpInterrupt {
            kind: 3,
            src_irq: irq,
            dst_apic: ioapic_id,
            dst_pin: irq,
            ..MpInterrupt::default()
        };
        entries.extend_from_slice(int.as_slice());
    }
    for (irq_type, pin) in [(3, 0), (1, 1)] {
        // LINT0: ExtINT, LINT1: NMI, on every local APIC.
        let lint = MpInterrupt {
            kind: 4,
            irq_type,
            dst_apic: 0xff,
            dst_pin: pin,
            ..MpInterrupt::default()
        };
        entries.extend_from_slice(lint.as_slice());
    }

    let header_len = size_of::<MpTableHeader>();
    let header = MpTableHeader {
        signature: *b"PCMP",
        length: (header_len + entries.len()) as u16,
        spec: 4,
        oem: *b"BURSTVM ",
        product: *b"MICROVM     ",
        entries: vcpus as u16 + 1 + 1 + IRQS as u16 + 2,
        lapic: LAPIC_ADDR,
        ..MpTableHeader::default()
    };
    let mut table = header.as_slice().to_vec();
    table.extend_from_slice(&entries);
    table[std::mem::offset_of!(MpTableHeader, checksum)] = checksum(&table);

    let mut mpf = MpFloating {
        signature: *b"_MP_",
        physptr: (MPTABLE_ADDR + size_of::<MpFloating>() as u64) as u32,
        length: 1, // in 16-byte units
        spec: 4,
        ..MpFloating::default()
    };
    mpf.checksum = checksum(mpf.as_slice());
    let mut out = mpf.as_slice().to_vec();
    out.extend_from_slice(&table);
    out
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
