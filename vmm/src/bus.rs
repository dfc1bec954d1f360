//! The device bus shared by the VM core and the virtio devices.
//!
//! One `Bus` serves port I/O (serial, agent port) and another MMIO (virtio-mmio
//! devices). Both use the same device trait: `offset` is always relative to
//! the base the device was inserted at. Accesses that hit no device are the
//! caller's business (the vCPU loop ignores them), never a crash.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

/// A device behind the PIO or MMIO bus.
pub trait BusDevice: Send {
    /// `offset` from the device's base; fill `data` (its length is the access size).
    fn read(&mut self, offset: u64, data: &mut [u8]);
    fn write(&mut self, offset: u64, data: &[u8]);
}

impl BusDevice for Box<dyn BusDevice> {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        (**self).read(offset, data)
    }
    fn write(&mut self, offset: u64, data: &[u8]) {
        (**self).write(offset, data)
    }
}

/// How the guest's VF driver init relates to the vCPU start (FastIOV §4.2.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum VfInit {
    /// `vf-open` completes before the vCPU starts; DRIVER_OK waits for the NIC.
    #[default]
    Sync,
    /// `vf-open` runs on a thread; link-up is signalled by a config interrupt.
    Async,
}

impl VfInit {
    pub const ALL: [VfInit; 2] = [VfInit::Sync, VfInit::Async];

    pub fn name(self) -> &'static str {
        match self {
            VfInit::Sync => "sync",
            VfInit::Async => "async",
        }
    }
}

impl std::fmt::Display for VfInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for VfInit {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|v| v.name() == s)
            .ok_or_else(|| format!("unknown VF init {s:?} (sync, async)"))
    }
}

/// The backend of a network device, parsed from `--net tap:NAME` / `--net vf:SOCKET` /
/// `--net sg:SOCKET`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetBackend {
    Tap(String),
    VhostUser(PathBuf),
    /// An SG function of `burstvm nic` (docs/sgiov.md): a vhost-user device like a VF, but
    /// the guest sees burstvm's private SG device id, not virtio-net.
    Sg(PathBuf),
}

impl NetBackend {
    /// Served over vhost-user by the NIC daemon (shares guest memory with it).
    pub fn is_vhost_user(&self) -> bool {
        matches!(self, NetBackend::VhostUser(_) | NetBackend::Sg(_))
    }
}

impl std::str::FromStr for NetBackend {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.split_once(':') {
            Some(("tap", name)) if !name.is_empty() && name.len() < libc::IFNAMSIZ => {
                Ok(NetBackend::Tap(name.to_string()))
            }
            Some(("tap", name)) => Err(format!(
                "--net tap:{name}: interface name must be 1..{} bytes",
                libc::IFNAMSIZ - 1
            )),
            Some(("vf", path)) if !path.is_empty() => {
                Ok(NetBackend::VhostUser(PathBuf::from(path)))
            }
            Some(("sg", path)) if !path.is_empty() => Ok(NetBackend::Sg(PathBuf::from(path))),
            _ => Err(format!(
                "--net {s:?}: expected tap:NAME, vf:SOCKET or sg:SOCKET"
            )),
        }
    }
}

/// A virtio-blk disk, parsed from `--disk path=FILE[,ro][,unlink][,id=ID]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskSpec {
    pub path: PathBuf,
    /// Offered with VIRTIO_BLK_F_RO; writes fail with IOERR.
    pub read_only: bool,
    /// Unlink the file once open (RunD's volatile writable layer): nothing
    /// persists after the VMM, and a flush has nothing to make durable.
    pub unlink: bool,
    /// VIRTIO_BLK_T_GET_ID answer (at most 20 bytes; default: the file name).
    pub id: Option<String>,
    /// An empty slot (`empty`): no file and no sectors until media are
    /// inserted through the VMM's `--api` socket (Firecracker's drive update),
    /// e.g. a pod container's image after the pod's VM booted.
    pub empty: bool,
}

impl std::str::FromStr for DiskSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut d = DiskSpec {
            path: PathBuf::new(),
            read_only: false,
            unlink: false,
            id: None,
            empty: false,
        };
        for part in s.split(',') {
            match part.split_once('=') {
                Some(("path", p)) if !p.is_empty() => d.path = PathBuf::from(p),
                Some(("id", id)) if !id.is_empty() && id.len() <= 20 => d.id = Some(id.into()),
                None if part == "ro" => d.read_only = true,
                None if part == "unlink" => d.unlink = true,
                None if part == "empty" => d.empty = true,
                _ => {
                    return Err(format!(
                        "--disk {s:?}: {part:?} is not path=FILE, empty, ro, unlink or id=ID (1..20 bytes)"
                    ))
                }
            }
        }
        match (d.empty, d.path.as_os_str().is_empty()) {
            (false, true) => return Err(format!("--disk {s:?}: path=FILE or empty is required")),
            (true, false) => return Err(format!("--disk {s:?}: an empty slot has no path")),
            (true, true) if d.id.is_none() || d.unlink => {
                return Err(format!(
                "--disk {s:?}: an empty slot needs id=ID (the --api names it) and takes no unlink"
            ))
            }
            _ => {}
        }
        Ok(d)
    }
}

/// The virtio-vsock device, from `--vsock PATH [--vsock-cid CID]`: the
/// host side listens on `path` (host-initiated connections) and connects
/// to `path_<port>` (guest-initiated ones).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockSpec {
    pub path: PathBuf,
    /// The guest's CID (3 unless given).
    pub cid: u64,
}

/// What a device gets from the VM core when it is created.
pub struct DeviceContext {
    /// For irqfd / ioeventfd registration.
    pub vm: Arc<kvm_ioctls::VmFd>,
    /// Device view of every region (VMM writes go here); one view shared by
    /// all devices. It does not own the mapping: keep `guestmem` alive for
    /// as long as a clone of it is kept.
    pub mem: vm_memory::GuestMemoryMmap,
    /// prepare_for_device_write, memfds for SET_MEM_TABLE.
    pub guestmem: Arc<guestmem::GuestMemory>,
    pub mmio_base: u64,
    pub gsi: u32,
    pub trace: Arc<trace::TraceWriter>,
    pub vf_init: VfInit,
    /// How long a vhost-user device may try to reconnect to a vanished backend.
    pub vf_reconnect: std::time::Duration,
}

/// A device as the bus holds it: shared between vCPU threads.
pub type SharedDevice = Arc<Mutex<dyn BusDevice>>;

#[derive(Debug, thiserror::Error)]
#[error("bus range {base:#x}+{len:#x} for {name} overlaps an existing device or is empty")]
pub struct BusError {
    pub name: String,
    pub base: u64,
    pub len: u64,
}

/// Address → device map (non-overlapping ranges).
#[derive(Default, Clone)]
pub struct Bus {
    devices: BTreeMap<u64, (u64, SharedDevice)>,
}

impl Bus {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(
        &mut self,
        name: &str,
        base: u64,
        len: u64,
        dev: SharedDevice,
    ) -> Result<(), BusError> {
        let err = || BusError {
            name: name.to_string(),
            base,
            len,
        };
        let end = base.checked_add(len).filter(|_| len > 0).ok_or_else(err)?;
        // The closest device below `end` is the only one that can overlap.
        if let Some((&b, &(l, _))) = self.devices.range(..end).next_back() {
            if b + l > base {
                return Err(err());
            }
        }
        self.devices.insert(base, (len, dev));
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, &SharedDevice)> {
        let (&base, (len, dev)) = self.devices.range(..=addr).next_back()?;
        let off = addr - base;
        (off + size as u64 <= *len).then_some((off, dev))
    }

    /// Returns false when no device covers the access.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .read(off, data);
                true
            }
            None => false,
        }
    }

    /// Returns false when no device covers the access.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((off, dev)) => {
                dev.lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .write(off, data);
                true
            }
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Reg(Vec<u8>);
    impl BusDevice for Reg {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            let o = offset as usize;
            data.copy_from_slice(&self.0[o..o + data.len()]);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            let o = offset as usize;
            self.0[o..o + data.len()].copy_from_slice(data);
        }
    }

    #[test]
    fn routes_by_offset_and_rejects_overlap_and_misses() {
        let mut bus = Bus::new();
        bus.insert("a", 0x1000, 0x10, Arc::new(Mutex::new(Reg(vec![0; 0x10]))))
            .unwrap();
        bus.insert("b", 0x1010, 0x10, Arc::new(Mutex::new(Reg(vec![0; 0x10]))))
            .unwrap();
        assert!(bus
            .insert("c", 0x100f, 2, Arc::new(Mutex::new(Reg(vec![0; 2]))))
            .is_err());
        assert!(bus
            .insert("d", 0x0ff8, 0x10, Arc::new(Mutex::new(Reg(vec![0; 0x10]))))
            .is_err());
        assert!(bus
            .insert("e", 0x2000, 0, Arc::new(Mutex::new(Reg(vec![]))))
            .is_err());
        assert!(bus.write(0x1014, &[1, 2, 3, 4]));
        let mut d = [0u8; 4];
        assert!(bus.read(0x1014, &mut d));
        assert_eq!(d, [1, 2, 3, 4]);
        assert!(bus.read(0x1000, &mut d));
        assert_eq!(d, [0; 4]);
        // Straddling the end of a device, or hitting nothing: not handled.
        assert!(!bus.read(0x101e, &mut d));
        assert!(!bus.write(0x3000, &[0]));
    }

    #[test]
    fn net_backend_parses() {
        assert_eq!("tap:tap0".parse(), Ok(NetBackend::Tap("tap0".into())));
        assert_eq!(
            "vf:/run/x.sock".parse(),
            Ok(NetBackend::VhostUser("/run/x.sock".into()))
        );
        assert_eq!(
            "sg:/run/pf0-sg0.sock".parse(),
            Ok(NetBackend::Sg("/run/pf0-sg0.sock".into()))
        );
        assert!("sg:".parse::<NetBackend>().is_err());
        assert!("tap:".parse::<NetBackend>().is_err());
        assert!("tap:averyveryverylongname".parse::<NetBackend>().is_err());
        assert!("eth0".parse::<NetBackend>().is_err());
    }
}
