use std::io::Write;

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress};

use super::*;
use crate::virtio::chain::tests::{first_chain, mem, queue_with, F_NEXT, F_WRITE, MEM_SIZE};
use crate::virtio::net::read_config_bytes;
use crate::virtio::VirtioDevice;

const HDR: u64 = 0x4000;
const DATA: u64 = 0x5000;
const STATUS: u64 = 0x7000;

fn disk(ro: bool, sectors: u64) -> (tempfile::TempDir, Disk) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    let mut f = File::create(&path).unwrap();
    for s in 0..sectors {
        f.write_all(&[s as u8; SECTOR as usize]).unwrap();
    }
    let d = Disk::open(&DiskSpec {
        path,
        read_only: ro,
        unlink: false,
        id: Some("rootfs-test".into()),
        empty: false,
    })
    .unwrap();
    (dir, d)
}

fn header(m: &GuestMemoryMmap, kind: u32, sector: u64) {
    m.write_obj(kind, GuestAddress(HDR)).unwrap();
    m.write_obj(0u32, GuestAddress(HDR + 4)).unwrap();
    m.write_obj(sector, GuestAddress(HDR + 8)).unwrap();
    m.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
}

/// Serves the one chain `descs`; returns (used length, status byte).
fn serve(
    m: &GuestMemoryMmap,
    d: &Disk,
    descs: &[(u64, u32, u16, u16)],
) -> (Result<u32, String>, u8) {
    let mut q = queue_with(m, descs);
    let (v, head) = first_chain(m, &mut q, 0);
    let split = v.split(head).unwrap();
    let counters = BlkCounters::default();
    let mut bounce = vec![0u8; 1024]; // small: requests span several rounds
    let r = d
        .serve(m, &|_, _| Ok(()), &split, &mut bounce, &counters)
        .map_err(|e| e.to_string());
    (r, m.read_obj::<u8>(GuestAddress(STATUS)).unwrap())
}

fn rw(kind_data_flags: u16, len: u32) -> [(u64, u32, u16, u16); 3] {
    [
        (HDR, 16, F_NEXT, 1),
        (DATA, len, kind_data_flags | F_NEXT, 2),
        (STATUS, 1, F_WRITE, 0),
    ]
}

#[test]
fn reads_writes_flush_and_id() {
    let m = mem();
    let (_dir, d) = disk(false, 8);
    assert_eq!(d.sectors(), 8);
    // Read sectors 2..6 (4 sectors span the 1 KiB bounce buffer twice).
    header(&m, VIRTIO_BLK_T_IN, 2);
    let (r, st) = serve(&m, &d, &rw(F_WRITE, 2048));
    assert_eq!((r, st), (Ok(2049), VIRTIO_BLK_S_OK as u8));
    let mut got = vec![0u8; 2048];
    m.read_slice(&mut got, GuestAddress(DATA)).unwrap();
    assert!(got[..512].iter().all(|&b| b == 2) && got[1536..].iter().all(|&b| b == 5));
    // Write sector 7, read it back.
    m.write_slice(&[0xab; 512], GuestAddress(DATA)).unwrap();
    header(&m, VIRTIO_BLK_T_OUT, 7);
    let (r, st) = serve(&m, &d, &rw(0, 512));
    assert_eq!((r, st), (Ok(1), VIRTIO_BLK_S_OK as u8));
    let mut back = [0u8; 512];
    d.file
        .as_ref()
        .unwrap()
        .read_exact_at(&mut back, 7 * 512)
        .unwrap();
    assert_eq!(back, [0xab; 512]);
    // Flush.
    header(&m, VIRTIO_BLK_T_FLUSH, 0);
    let (r, st) = serve(&m, &d, &[(HDR, 16, F_NEXT, 1), (STATUS, 1, F_WRITE, 0)]);
    assert_eq!((r, st), (Ok(1), VIRTIO_BLK_S_OK as u8));
    // Get id.
    header(&m, VIRTIO_BLK_T_GET_ID, 0);
    let (r, st) = serve(&m, &d, &rw(F_WRITE, 20));
    assert_eq!((r, st), (Ok(21), VIRTIO_BLK_S_OK as u8));
    let mut id = [0u8; 11];
    m.read_slice(&mut id, GuestAddress(DATA)).unwrap();
    assert_eq!(&id, b"rootfs-test");
}

#[test]
fn bad_requests_fail_only_themselves() {
    let m = mem();
    let (_dir, d) = disk(false, 8);
    let ioerr = VIRTIO_BLK_S_IOERR as u8;
    // Out of range, past the end and overflowing.
    for sector in [8, 7, u64::MAX / 512, u64::MAX] {
        header(&m, VIRTIO_BLK_T_IN, sector);
        assert_eq!(
            serve(&m, &d, &rw(F_WRITE, 1024)),
            (Ok(1), ioerr),
            "{sector}"
        );
        header(&m, VIRTIO_BLK_T_OUT, sector);
        assert_eq!(serve(&m, &d, &rw(0, 1024)), (Ok(1), ioerr), "{sector}");
    }
    // Not a whole sector.
    header(&m, VIRTIO_BLK_T_IN, 0);
    assert_eq!(serve(&m, &d, &rw(F_WRITE, 100)), (Ok(1), ioerr));
    // Data buffer outside guest memory.
    header(&m, VIRTIO_BLK_T_IN, 0);
    let bad = [
        (HDR, 16, F_NEXT, 1),
        (MEM_SIZE - 256, 512, F_WRITE | F_NEXT, 2),
        (STATUS, 1, F_WRITE, 0),
    ];
    assert_eq!(serve(&m, &d, &bad), (Ok(1), ioerr));
    // Header too short.
    let short = [(HDR, 8, F_NEXT, 1), (STATUS, 1, F_WRITE, 0)];
    m.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
    assert_eq!(serve(&m, &d, &short), (Ok(1), ioerr));
    // Unknown type.
    header(&m, 0x77, 0);
    assert_eq!(
        serve(&m, &d, &[(HDR, 16, F_NEXT, 1), (STATUS, 1, F_WRITE, 0)]),
        (Ok(1), VIRTIO_BLK_S_UNSUPP as u8)
    );
    // No status byte: nothing can be answered.
    header(&m, VIRTIO_BLK_T_IN, 0);
    let (r, st) = serve(&m, &d, &[(HDR, 16, 0, 0)]);
    assert!(r.unwrap_err().contains("status"));
    assert_eq!(st, 0xff);
    // Status byte outside guest memory.
    let (r, _) = serve(
        &m,
        &d,
        &[(HDR, 16, F_NEXT, 1), (MEM_SIZE + 8, 1, F_WRITE, 0)],
    );
    assert!(r.is_err());
    // The disk still serves good requests.
    header(&m, VIRTIO_BLK_T_IN, 1);
    assert_eq!(serve(&m, &d, &rw(F_WRITE, 512)), (Ok(513), 0));
}

#[test]
fn read_only_disk_refuses_writes() {
    let m = mem();
    let (_dir, d) = disk(true, 4);
    assert_ne!(d.features() & (1 << VIRTIO_BLK_F_RO), 0);
    m.write_slice(&[0xcd; 512], GuestAddress(DATA)).unwrap();
    header(&m, VIRTIO_BLK_T_OUT, 0);
    assert_eq!(
        serve(&m, &d, &rw(0, 512)),
        (Ok(1), VIRTIO_BLK_S_IOERR as u8)
    );
    let mut back = [0u8; 512];
    d.file
        .as_ref()
        .unwrap()
        .read_exact_at(&mut back, 0)
        .unwrap();
    assert_eq!(back, [0; 512]);
    header(&m, VIRTIO_BLK_T_IN, 3);
    assert_eq!(serve(&m, &d, &rw(F_WRITE, 512)), (Ok(513), 0));
}

#[test]
fn unlink_removes_the_name_and_config_reports_capacity() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("clone.ext4");
    std::fs::write(&path, vec![0u8; 4096 + 100]).unwrap();
    let d = Disk::open(&DiskSpec {
        path: path.clone(),
        read_only: false,
        unlink: true,
        id: None,
        empty: false,
    })
    .unwrap();
    assert!(!path.exists());
    assert_eq!(d.sectors(), 8);
    assert_eq!(&d.id[..10], b"clone.ext4");
    let mut cap = [0u8; 8];
    read_config_bytes(&d.config(), 0, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), 8);
    let e = Disk::open(&DiskSpec {
        path,
        read_only: true,
        unlink: false,
        id: None,
        empty: false,
    })
    .err()
    .unwrap()
    .to_string();
    assert!(e.contains("clone.ext4") && e.contains("open"), "{e}");
}

/// Two disks on their own worker threads: a bad request (out of range,
/// no status byte) fails on its device only; both keep serving.
#[test]
fn workers_serve_each_device_alone() {
    use vmm_sys_util::eventfd::EFD_NONBLOCK;
    let ctx = crate::virtio::tests::ctx(false);
    let m = ctx.mem.clone();
    let (_da, a) = disk(false, 8);
    let (_db, b) = disk(false, 8);
    // Per device: queue at base, header/status/data pages after it.
    struct Dev {
        blk: Blk,
        evt: EventFd,
        base: u64,
        posted: u16,
    }
    let mut devs: Vec<Dev> = [(a, 0x10000u64), (b, 0x20000u64)]
        .into_iter()
        .map(|(d, base)| {
            let evt = EventFd::new(EFD_NONBLOCK).unwrap();
            let irq = Arc::new(Interrupt::new(EventFd::new(EFD_NONBLOCK).unwrap()));
            let mut blk = Blk::new(d, &ctx, evt.try_clone().unwrap(), irq);
            let mut q = Queue::new(QUEUE_MAX_SIZE).unwrap();
            q.set_size(16);
            q.set_desc_table_address(Some(base as u32), Some(0));
            q.set_avail_ring_address(Some(base as u32 + 0x1000), Some(0));
            q.set_used_ring_address(Some(base as u32 + 0x2000), Some(0));
            q.set_ready(true);
            blk.activate(blk.features(), vec![q]).unwrap();
            Dev {
                blk,
                evt,
                base,
                posted: 0,
            }
        })
        .collect();
    // Request r of a device: descriptors 3r..3r+2, header/status/data in page r.
    let submit = |d: &mut Dev, kind: u32, sector: u64, with_status: bool| -> u64 {
        let r = d.posted as u64;
        let page = d.base + 0x4000 + r * 0x1000;
        m.write_obj(kind, GuestAddress(page)).unwrap();
        m.write_obj(sector, GuestAddress(page + 8)).unwrap();
        m.write_obj(0xffu8, GuestAddress(page + 16)).unwrap();
        let descs: Vec<(u64, u32, u16)> = if with_status {
            vec![(page, 16, 1), (page + 512, 512, 1 | 2), (page + 16, 1, 2)]
        } else {
            vec![(page, 16, 0)]
        };
        for (i, (addr, len, flags)) in descs.iter().enumerate() {
            let at = d.base + 16 * (3 * r + i as u64);
            m.write_obj(*addr, GuestAddress(at)).unwrap();
            m.write_obj(*len, GuestAddress(at + 8)).unwrap();
            m.write_obj(*flags, GuestAddress(at + 12)).unwrap();
            m.write_obj((3 * r + i as u64 + 1) as u16, GuestAddress(at + 14))
                .unwrap();
        }
        let slot = d.base + 0x1000 + 4 + 2 * (d.posted as u64 % 16);
        m.write_obj((3 * r) as u16, GuestAddress(slot)).unwrap();
        d.posted += 1;
        m.write_obj(d.posted, GuestAddress(d.base + 0x1002))
            .unwrap();
        d.evt.write(1).unwrap();
        page
    };
    let wait_used = |d: &Dev| {
        let end = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while m.read_obj::<u16>(GuestAddress(d.base + 0x2002)).unwrap() != d.posted {
            assert!(std::time::Instant::now() < end, "device did not answer");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    };
    let status = |page: u64| m.read_obj::<u8>(GuestAddress(page + 16)).unwrap();

    let bad = submit(&mut devs[0], VIRTIO_BLK_T_IN, 100, true);
    let no_status = submit(&mut devs[0], VIRTIO_BLK_T_IN, 0, false);
    let good_b = submit(&mut devs[1], VIRTIO_BLK_T_IN, 3, true);
    let good_a = submit(&mut devs[0], VIRTIO_BLK_T_IN, 5, true);
    wait_used(&devs[0]);
    wait_used(&devs[1]);
    assert_eq!(status(bad), VIRTIO_BLK_S_IOERR as u8);
    assert_eq!(status(no_status), 0xff);
    assert_eq!((status(good_a), status(good_b)), (0, 0));
    assert_eq!(m.read_obj::<u8>(GuestAddress(good_a + 512)).unwrap(), 5);
    assert_eq!(m.read_obj::<u8>(GuestAddress(good_b + 512)).unwrap(), 3);
    let c = &devs[0].blk.counters;
    assert_eq!(c.failed.load(Ordering::Relaxed), 1);
    assert_eq!(c.bad_chains.load(Ordering::Relaxed), 1);
    assert_eq!(c.reads.load(Ordering::Relaxed), 1);
    assert_eq!(devs[1].blk.counters.failed.load(Ordering::Relaxed), 0);
    // Reset stops the worker; the device is still sound.
    devs[0].blk.reset();
    assert!(devs[0].blk.worker.is_none());
}

/// An empty slot: no sectors (a read fails), then media inserted through
/// its `DiskSlot` (capacity, generation, a config interrupt), refused while
/// occupied, ejected back to empty.
#[test]
fn an_empty_slot_takes_media_and_gives_them_back() {
    let spec: DiskSpec = "empty,ro,id=c0".parse().unwrap();
    let media = Arc::new(Media::new(Disk::open(&spec).unwrap()));
    let irq = EventFd::new(libc::EFD_NONBLOCK).unwrap();
    let interrupt = Arc::new(Interrupt::new(irq));
    let slot = DiskSlot::new("c0".into(), true, media.clone(), interrupt.clone());
    assert_eq!((slot.sectors(), media.generation()), (0, 0));
    let m = mem();
    header(&m, VIRTIO_BLK_T_IN, 0);
    let (_, status) = serve(&m, &media.get(), &rw(F_WRITE, 512));
    assert_eq!(status, VIRTIO_BLK_S_IOERR as u8);

    let (dir, _) = disk(true, 4);
    let img = dir.path().join("disk.img");
    assert_eq!(slot.insert(&img).unwrap(), 4);
    assert_eq!(media.generation(), 1);
    assert_eq!(
        interrupt.status() & crate::virtio::INT_CONFIG,
        crate::virtio::INT_CONFIG
    );
    let mut cap = [0u8; 8];
    read_config_bytes(&media.get().config(), 0, &mut cap);
    assert_eq!(u64::from_le_bytes(cap), 4);
    header(&m, VIRTIO_BLK_T_IN, 3);
    let (r, status) = serve(&m, &media.get(), &rw(F_WRITE, 512));
    assert_eq!((r.unwrap(), status), (513, VIRTIO_BLK_S_OK as u8));
    assert_eq!(m.read_obj::<u8>(GuestAddress(DATA)).unwrap(), 3);
    // The slot is read-only: so are its media.
    header(&m, VIRTIO_BLK_T_OUT, 0);
    let (_, status) = serve(&m, &media.get(), &rw(0, 512));
    assert_eq!(status, VIRTIO_BLK_S_IOERR as u8);

    let e = slot.insert(&img).unwrap_err().to_string();
    assert!(e.contains("c0") && e.contains("disk.img"), "{e}");
    let missing = slot
        .insert(&dir.path().join("nope"))
        .unwrap_err()
        .to_string();
    assert!(missing.contains("c0"), "{missing}");
    assert!(slot.eject());
    assert!(!slot.eject());
    assert_eq!((slot.sectors(), media.generation()), (0, 2));
    let empty_file = dir.path().join("empty");
    std::fs::write(&empty_file, b"").unwrap();
    let e = slot.insert(&empty_file).unwrap_err().to_string();
    assert!(e.contains("0 sectors"), "{e}");
}

#[test]
fn empty_slot_specs() {
    let d: DiskSpec = "empty,id=c1".parse().unwrap();
    assert!(d.empty && !d.read_only && d.path.as_os_str().is_empty());
    for bad in ["empty", "empty,id=c1,unlink", "empty,path=/x,id=c1", "ro"] {
        assert!(bad.parse::<DiskSpec>().is_err(), "{bad}");
    }
}
