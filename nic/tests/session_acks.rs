//! The VMM asks the NIC for one ack per ring hand-over, on its last message
//! (vmm `vhost_user::session`, as QEMU asks for few). That is sound only
//! because a VF session handles its messages in order and ends at the first
//! one it refuses: the ack of the last message then answers for all of them.
//! Both halves, against the NIC daemon.
#![allow(clippy::unwrap_used)] // test code: a failed step fails the test

use testutil::nic as common;

use std::os::fd::AsRawFd;

use common::TestNic;
use nic::frontend::{MIN_MEM, QSIZE};
use nic::LockPolicy;
use vhost::vhost_user::message::{
    VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// Where the frontend says its memory is: the NIC translates ring addresses
/// through the memory table and maps the file itself.
const VA: u64 = 0x7000_0000_0000;

/// A session up to its acked SET_MEM_TABLE, as the VMM's `vf-open` leaves it.
fn open(socket: &std::path::Path, mem: &std::fs::File) -> Frontend {
    let mut fe = Frontend::connect(socket, 2).unwrap();
    fe.set_owner().unwrap();
    let offered = fe.get_features().unwrap();
    let proto_bit = VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
    fe.set_features((1 << VIRTIO_F_VERSION_1) | (offered & proto_bit))
        .unwrap();
    let proto = fe.get_protocol_features().unwrap();
    assert!(proto.contains(VhostUserProtocolFeatures::REPLY_ACK));
    fe.set_protocol_features(VhostUserProtocolFeatures::REPLY_ACK)
        .unwrap();
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    fe.set_mem_table(&[VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: MIN_MEM as u64,
        userspace_addr: VA,
        mmap_offset: 0,
        mmap_handle: mem.as_raw_fd(),
    }])
    .unwrap();
    fe
}

/// Both rings handed over (both set up, then both enabled) with no ack until the last
/// SET_VRING_ENABLE;
/// ring 0 gets `size0` entries.
fn hand_over(fe: &mut Frontend, size0: u16, fds: &[EventFd]) -> Result<(), vhost::Error> {
    fe.set_features((1 << VIRTIO_F_VERSION_1) | VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits())?;
    fe.set_hdr_flags(VhostUserHeaderFlag::empty());
    for q in 0..2usize {
        let area = VA + q as u64 * 0x10000;
        let size = if q == 0 { size0 } else { QSIZE };
        fe.set_vring_num(q, size)?;
        fe.set_vring_addr(
            q,
            &VringConfigData {
                queue_max_size: QSIZE,
                queue_size: size,
                flags: 0,
                desc_table_addr: area,
                avail_ring_addr: area + 0x1000,
                used_ring_addr: area + 0x2000,
                log_addr: None,
            },
        )?;
        fe.set_vring_base(q, 0)?;
        fe.set_vring_call(q, &fds[2 * q])?;
        fe.set_vring_kick(q, &fds[2 * q + 1])?;
    }
    // Enabled once both are set up, as the VMM does.
    for q in 0..2usize {
        if q == 1 {
            fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        fe.set_vring_enable(q, true)?;
    }
    Ok(())
}

#[test]
fn the_last_ack_answers_for_the_whole_hand_over() {
    let name = format!("acks-{}", std::process::id());
    let nic = TestNic::start(&name, 2, None, LockPolicy::Hierarchical);
    let mut c = nic.client();
    let good = c.alloc("pf0", "sb-good", None, None).unwrap();
    let bad = c.alloc("pf0", "sb-bad", None, None).unwrap();
    let fds: Vec<EventFd> = (0..4)
        .map(|_| EventFd::new(EFD_NONBLOCK).unwrap())
        .collect();

    let mem = tempfile::tempfile().unwrap();
    mem.set_len(MIN_MEM as u64).unwrap();
    let mut fe = open(&good.socket, &mem);
    hand_over(&mut fe, QSIZE, &fds).unwrap();

    // A ring size of 0 is refused without a reply (none was asked for): the
    // NIC ends the session, so the last message's ack never comes.
    let mut fe = open(&bad.socket, &mem);
    let e = hand_over(&mut fe, 0, &fds).unwrap_err();
    eprintln!("the refused hand-over: {e}");
}
