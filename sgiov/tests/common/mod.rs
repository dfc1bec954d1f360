//! Helpers shared by the device tests: guests over memfd-backed memory and
//! an in-process transport (doorbells and interrupts are direct calls).
#![allow(dead_code)]

use std::collections::HashSet;
use std::fs::File;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use rand::{RngCore, SeedableRng};
use sgiov::device::{Device, DeviceConfig};
use sgiov::driver::{Driver, DriverConfig, SockState};
use sgiov::engine::EngineConfig;
use sgiov::mem::{GuestMem, Memory, PrepareHook};
use sgiov::sgf::SgfId;

pub const MEM: usize = 64 << 20;
pub const AREA: u64 = 0x10_0000;
pub const HEAP: u64 = 0x100_0000;

pub struct Guest {
    pub drv: Driver,
    pub sgf: SgfId,
    pub guest_view: Arc<dyn Memory>,
    _file: File,
    pub prepared: Arc<AtomicU64>,
}

/// The device with its interrupt lines: an interrupt stays pending until
/// its guest handles it, as an eventfd does.
pub struct Dev {
    pub d: Device,
    irq: HashSet<SgfId>,
}

impl std::ops::Deref for Dev {
    type Target = Device;
    fn deref(&self) -> &Device {
        &self.d
    }
}

impl std::ops::DerefMut for Dev {
    fn deref_mut(&mut self) -> &mut Device {
        &mut self.d
    }
}

pub fn device(workers: usize) -> Dev {
    let d = Device::new(DeviceConfig {
        engine: EngineConfig {
            workers,
            ..Default::default()
        },
        staging_bytes: 256 << 20,
        staging_ring: 64 << 10,
        ..Default::default()
    })
    .unwrap();
    Dev {
        d,
        irq: HashSet::new(),
    }
}

pub fn guest(dev: &mut Dev, name: &str, tenant: u32) -> Guest {
    guest_cfg(dev, name, tenant, DriverConfig::default())
}

/// [`guest`] with a driver configuration (e.g. `dedicated` channels).
pub fn guest_cfg(dev: &mut Dev, name: &str, tenant: u32, cfg: DriverConfig) -> Guest {
    let (gview, file) = GuestMem::memfd(name, 0, MEM).unwrap();
    let prepared = Arc::new(AtomicU64::new(0));
    let p = prepared.clone();
    // Stands in for guestmem's device-write preparation: counts calls and
    // refuses ranges outside the memory.
    let hook: PrepareHook = Box::new(move |addr, len| {
        p.fetch_add(1, Ordering::Relaxed);
        if addr + len > MEM as u64 {
            return Err("outside".into());
        }
        Ok(())
    });
    let dview = GuestMem::new(
        format!("sandbox {name}"),
        GuestMem::map_file(name, &file, 0, MEM).unwrap(),
        Some(hook),
    );
    let guest_view: Arc<dyn Memory> = Arc::new(gview);
    let (drv, setup) =
        Driver::new(guest_view.clone(), AREA, HEAP, (MEM as u64) - HEAP, cfg).unwrap();
    let sgf = dev
        .attach_channels(
            name,
            tenant,
            Arc::new(dview),
            setup.area_gpa,
            setup.chan_gpa,
            setup.chan_entries,
        )
        .unwrap();
    Guest {
        drv,
        sgf,
        guest_view,
        _file: file,
        prepared,
    }
}

/// One round of the transport: doorbells, the device's poll, interrupts.
pub fn pump(dev: &mut Dev, gs: &mut [&mut Guest]) {
    for g in gs.iter_mut() {
        // The Cross-FIFO's doorbell and those of `dedicated` channels.
        let n = u64::from(g.drv.flush().unwrap()) + g.drv.take_channel_kicks().len() as u64;
        if n > 0 {
            dev.d.kicks(g.sgf, n);
        }
    }
    let poll = |d: &mut Device| {
        let mut irq = d.poll();
        irq.extend(d.take_channel_irqs().into_iter().map(|(s, _)| s));
        irq
    };
    let mut irq = poll(&mut dev.d);
    if irq.is_empty() {
        dev.d.engine().wait(Duration::from_millis(1));
        irq = poll(&mut dev.d);
    }
    dev.irq.extend(irq);
    for g in gs.iter_mut() {
        if dev.irq.remove(&g.sgf) {
            g.drv.interrupt().unwrap();
        }
    }
}

pub fn until(
    dev: &mut Dev,
    gs: &mut [&mut Guest],
    what: &str,
    mut f: impl FnMut(&mut [&mut Guest]) -> bool,
) {
    for _ in 0..20_000 {
        if f(gs) {
            return;
        }
        pump(dev, gs);
    }
    panic!(
        "timed out waiting for {what}: {:?} {:?}",
        dev.stats(),
        gs.iter().map(|g| dev.sgf_stats(g.sgf)).collect::<Vec<_>>()
    );
}

pub fn reply(dev: &mut Dev, g: &mut Guest, req: u32) -> u32 {
    reply_in(dev, &mut [g], 0, req)
}

/// Waits for guest `i`'s reply to `req`, pumping every guest.
pub fn reply_in(dev: &mut Dev, gs: &mut [&mut Guest], i: usize, req: u32) -> u32 {
    let mut r = None;
    let what = format!("the reply to request {req} of guest {i}");
    until(dev, gs, &what, |gs| {
        r = gs[i].drv.reply(req);
        r.is_some()
    });
    r.unwrap().status
}

pub fn open(dev: &mut Dev, g: &mut Guest, size: u32, prio: u8) -> u16 {
    let (s, req) = g.drv.open(size, size, prio).unwrap();
    assert_eq!(reply(dev, g, req), 0);
    assert_eq!(g.drv.state(s), Some(SockState::Open));
    s
}

pub fn random(n: usize, seed: u64) -> Vec<u8> {
    let mut v = vec![0u8; n];
    rand::rngs::StdRng::seed_from_u64(seed).fill_bytes(&mut v);
    v
}

/// Sends `data` on `a`'s socket `sa` and receives it on `b`'s socket `sb`.
pub fn transfer(dev: &mut Dev, a: &mut Guest, sa: u16, b: &mut Guest, sb: u16, data: &[u8]) {
    let mut sent = 0;
    let mut got = Vec::with_capacity(data.len());
    let mut buf = vec![0u8; 1 << 16];
    let same = a.sgf == b.sgf;
    for _ in 0..100_000 {
        if got.len() == data.len() {
            break;
        }
        if sent < data.len() {
            sent += a.drv.send(sa, &data[sent..]).unwrap();
        }
        let rx = if same { &mut a.drv } else { &mut b.drv };
        let n = rx.recv(sb, &mut buf).unwrap();
        got.extend_from_slice(&buf[..n]);
        if same {
            pump(dev, &mut [a]);
        } else {
            pump(dev, &mut [a, b]);
        }
    }
    assert_eq!(got.len(), data.len(), "transfer stalled");
    assert!(got == data, "bytes differ");
}

pub fn echo(dev: &mut Dev, g: &mut Guest, s: u16, data: &[u8]) {
    let mut sent = 0;
    let mut got = Vec::with_capacity(data.len());
    let mut buf = vec![0u8; 1 << 16];
    for _ in 0..100_000 {
        if got.len() == data.len() {
            break;
        }
        if sent < data.len() {
            sent += g.drv.send(s, &data[sent..]).unwrap();
        }
        let n = g.drv.recv(s, &mut buf).unwrap();
        got.extend_from_slice(&buf[..n]);
        pump(dev, &mut [g]);
    }
    assert!(
        got == data,
        "echo bytes differ ({} of {} back)",
        got.len(),
        data.len()
    );
}

/// Nothing of any connection is left (pipes, staging rings, key slots) and
/// `sockets` sockets are still open.
pub fn assert_released(dev: &Device, sockets: usize) {
    let st = dev.stats();
    assert_eq!(
        (
            st.connections,
            st.pipes,
            st.staging_bytes,
            st.key_slots,
            st.sockets
        ),
        (0, 0, 0, 0, sockets),
        "{st:?}"
    );
}
