//! Descriptor-chain copies against malformed and hostile chains, and the
//! config space layout.

use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::virtio::chain::tests::{first_chain, mem, queue_with, F_NEXT, F_WRITE, MEM_SIZE};

use virtq::{ChainError, CopyError, SplitError};

/// The queue's rings and its first available head.
fn chain<'m>(m: &'m GuestMemoryMmap, q: &mut Queue) -> (RingView<'m, GuestMemoryMmap>, u16) {
    first_chain(m, q, NET_FEATURES)
}

/// A buffer (partly) outside guest memory: refused by the split or by the
/// checked copy, never accessed.
fn outside_memory(e: &NetChainError) -> bool {
    matches!(
        e,
        NetChainError::Split(SplitError::Outside { .. })
            | NetChainError::Copy(CopyError::Access { .. })
    )
}

fn no_prepare() -> Box<PrepareWrite> {
    Box::new(|_, _| Ok(()))
}

#[test]
fn rx_frame_spans_a_chain_and_prepares_each_write() {
    let m = mem();
    let mut q = queue_with(
        &m,
        &[(0x4000, 8, F_WRITE | F_NEXT, 1), (0x5000, 100, F_WRITE, 0)],
    );
    let (v, head) = chain(&m, &mut q);
    let prepared = std::sync::Mutex::new(Vec::new());
    let prepare = |gpa, len| {
        prepared.lock().unwrap().push((gpa, len));
        Ok(())
    };
    let data: Vec<u8> = (0..20).collect();
    assert_eq!(write_rx_chain(&v, &prepare, head, &data).unwrap(), 20);
    assert_eq!(*prepared.lock().unwrap(), vec![(0x4000, 8), (0x5000, 12)]);
    let mut back = [0u8; 12];
    m.read_slice(&mut back, GuestAddress(0x5000)).unwrap();
    assert_eq!(back[..], data[8..]);
}

#[test]
fn malformed_rx_chains_are_rejected_without_writing() {
    let m = mem();
    let data = [0xaau8; 64];
    // Buffer outside guest memory.
    let mut q = queue_with(&m, &[(MEM_SIZE - 16, 64, F_WRITE, 0)]);
    let (v, head) = chain(&m, &mut q);
    let e = write_rx_chain(&v, &*no_prepare(), head, &data).unwrap_err();
    assert!(outside_memory(&e), "{e}");
    // Address overflowing u64.
    let mut q = queue_with(&m, &[(u64::MAX - 8, 64, F_WRITE, 0)]);
    let (v, head) = chain(&m, &mut q);
    assert!(write_rx_chain(&v, &*no_prepare(), head, &data).is_err());
    // A device-readable descriptor in an RX chain.
    let mut q = queue_with(&m, &[(0x4000, 64, 0, 0)]);
    let (v, head) = chain(&m, &mut q);
    assert!(matches!(
        write_rx_chain(&v, &*no_prepare(), head, &data),
        Err(NetChainError::ReadableInRx)
    ));
    // Too small for the frame: nothing is written.
    let mut q = queue_with(&m, &[(0x4000, 16, F_WRITE, 0)]);
    let (v, head) = chain(&m, &mut q);
    assert!(matches!(
        write_rx_chain(&v, &*no_prepare(), head, &data),
        Err(NetChainError::RxTooSmall {
            capacity: 16,
            need: 64
        })
    ));
    let mut b = [0u8; 16];
    m.read_slice(&mut b, GuestAddress(0x4000)).unwrap();
    assert_eq!(b, [0; 16]);
    // A chain looping onto itself is refused (`virtq::RingView::walk` counts
    // at most the queue size, 8 here), never hangs, writes nothing.
    m.write_slice(&[0u8; 0x100], GuestAddress(0x4000)).unwrap();
    let mut q = queue_with(&m, &[(0x4000, 8, F_WRITE | F_NEXT, 0)]);
    let (v, head) = chain(&m, &mut q);
    let e = write_rx_chain(&v, &*no_prepare(), head, &data).unwrap_err();
    assert!(
        matches!(
            e,
            NetChainError::Split(SplitError::Walk(ChainError::Loop { .. }))
        ),
        "{e}"
    );
    let mut after = [0xffu8; 0xf8];
    m.read_slice(&mut after, GuestAddress(0x4008)).unwrap();
    assert_eq!(after, [0u8; 0xf8], "bytes past the looping buffer");
    // A next index beyond the queue size.
    let mut q = queue_with(&m, &[(0x4000, 8, F_WRITE | F_NEXT, 200)]);
    let (v, head) = chain(&m, &mut q);
    assert!(write_rx_chain(&v, &*no_prepare(), head, &data).is_err());
}

#[test]
fn failed_prepare_stops_the_write() {
    let m = mem();
    let mut q = queue_with(&m, &[(0x4000, 64, F_WRITE, 0)]);
    let (v, head) = chain(&m, &mut q);
    let prepare = |gpa: u64, len| Err(guestmem::Error::OutOfRange { gpa, len });
    let e = write_rx_chain(&v, &prepare, head, &[1; 8]).unwrap_err();
    // The preparation's own error is the typed source of the refusal.
    let NetChainError::Copy(CopyError::Prepare { addr, source, .. }) = &e else {
        panic!("{e}");
    };
    assert_eq!(*addr, 0x4000);
    assert!(matches!(
        source.downcast_ref::<guestmem::Error>(),
        Some(guestmem::Error::OutOfRange { gpa: 0x4000, .. })
    ));
    assert_eq!(m.read_obj::<u8>(GuestAddress(0x4000)).unwrap(), 0);
}

#[test]
fn tx_chain_gathers_and_rejects_malformed() {
    let m = mem();
    m.write_slice(&[1, 2, 3], GuestAddress(0x4000)).unwrap();
    m.write_slice(&[4, 5], GuestAddress(0x5000)).unwrap();
    let mut buf = Vec::new();
    let mut q = queue_with(&m, &[(0x4000, 3, F_NEXT, 1), (0x5000, 2, 0, 0)]);
    let (v, head) = chain(&m, &mut q);
    assert_eq!(
        read_tx_chain(&v, &*no_prepare(), head, &mut buf).unwrap(),
        5
    );
    assert_eq!(buf, [1, 2, 3, 4, 5]);

    let mut q = queue_with(&m, &[(0x4000, 3, F_WRITE, 0)]);
    let (v, head) = chain(&m, &mut q);
    assert!(matches!(
        read_tx_chain(&v, &*no_prepare(), head, &mut buf),
        Err(NetChainError::WritableInTx)
    ));
    let mut q = queue_with(&m, &[(MEM_SIZE - 1, 2, 0, 0)]);
    let (v, head) = chain(&m, &mut q);
    let e = read_tx_chain(&v, &*no_prepare(), head, &mut buf).unwrap_err();
    assert!(outside_memory(&e), "{e}");
    // A huge length is refused before any allocation.
    let mut q = queue_with(&m, &[(0x4000, u32::MAX, 0, 0)]);
    let (v, head) = chain(&m, &mut q);
    assert!(matches!(
        read_tx_chain(&v, &*no_prepare(), head, &mut buf),
        Err(NetChainError::TxTooLong { .. })
    ));
}

#[test]
fn config_space_layout() {
    let c = net_config(&[2, 0, 0, 0, 0, 7], VIRTIO_NET_S_LINK_UP as u16);
    let mut status = [0u8; 2];
    read_config_bytes(&c, 6, &mut status);
    assert_eq!(u16::from_le_bytes(status), 1);
    let mut mac = [0u8; 6];
    read_config_bytes(&c, 0, &mut mac);
    assert_eq!(mac, [2, 0, 0, 0, 0, 7]);
    let mut past = [0xffu8; 4];
    read_config_bytes(&c, 6, &mut past);
    assert_eq!(past, [1, 0, 0, 0]);
    read_config_bytes(&c, u64::MAX, &mut past);
    assert_eq!(past, [0; 4]);
}

#[test]
fn indirect_chains_are_refused_without_the_feature() {
    const F_INDIRECT: u16 = 4;
    let m = mem();
    // An indirect table at 0x6000 with one descriptor.
    let table = |flags: u16| {
        let d = virtio_queue::desc::split::Descriptor::new(0x4000, 64, flags, 0);
        m.write_obj(d, GuestAddress(0x6000)).unwrap();
    };
    let data = [0x5au8; 32];
    table(F_WRITE);
    let mut q = queue_with(&m, &[(0x6000, 16, F_INDIRECT, 0)]);
    let (v, head) = chain(&m, &mut q);
    let e = write_rx_chain(&v, &*no_prepare(), head, &data).unwrap_err();
    assert!(
        matches!(
            e,
            NetChainError::Split(SplitError::Walk(ChainError::IndirectNotNegotiated { .. }))
        ),
        "{e}"
    );
    assert_eq!(m.read_obj::<u8>(GuestAddress(0x4000)).unwrap(), 0);
    table(0);
    let mut q = queue_with(&m, &[(0x6000, 16, F_INDIRECT, 0)]);
    let (v, head) = chain(&m, &mut q);
    let mut buf = Vec::new();
    let e = read_tx_chain(&v, &*no_prepare(), head, &mut buf).unwrap_err();
    assert!(
        matches!(
            e,
            NetChainError::Split(SplitError::Walk(ChainError::IndirectNotNegotiated { .. }))
        ),
        "{e}"
    );
    assert!(buf.is_empty());
}
