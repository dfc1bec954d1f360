//! The devices' specifications as the command line and the runtime give
//! them (`--net`, `--disk`, `--vsock`, `--vf-init`): each parses with
//! `FromStr` and renders with `Display` to the same text, so the runtime's
//! launch contract (`VmParams::to_args`) and the VMM's parser agree.

use std::path::PathBuf;

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

impl std::fmt::Display for NetBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            NetBackend::Tap(name) => write!(f, "tap:{name}"),
            NetBackend::VhostUser(p) => write!(f, "vf:{}", p.display()),
            NetBackend::Sg(p) => write!(f, "sg:{}", p.display()),
        }
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

impl DiskSpec {
    /// The file `path`, read-write, kept, labelled by its name.
    pub fn file(path: impl Into<PathBuf>) -> DiskSpec {
        DiskSpec {
            path: path.into(),
            read_only: false,
            unlink: false,
            id: None,
            empty: false,
        }
    }

    /// An empty slot `id` (media through `--api`).
    pub fn empty_slot(id: impl Into<String>, read_only: bool) -> DiskSpec {
        DiskSpec {
            path: PathBuf::new(),
            read_only,
            unlink: false,
            id: Some(id.into()),
            empty: true,
        }
    }
}

/// The `--disk` text `FromStr` reads back (a path with a comma has none).
impl std::fmt::Display for DiskSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut parts = Vec::new();
        if self.empty {
            parts.push("empty".to_string());
        } else {
            parts.push(format!("path={}", self.path.display()));
        }
        if self.read_only {
            parts.push("ro".into());
        }
        if self.unlink {
            parts.push("unlink".into());
        }
        if let Some(id) = &self.id {
            parts.push(format!("id={id}"));
        }
        f.write_str(&parts.join(","))
    }
}

impl std::str::FromStr for DiskSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut d = DiskSpec::file(PathBuf::new());
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_render_as_they_parse() {
        for s in ["tap:t0", "vf:/run/x/pf0-vf1.sock", "sg:/run/x/sg0.sock"] {
            assert_eq!(s.parse::<NetBackend>().unwrap().to_string(), s);
        }
        for s in [
            "path=/img.erofs,ro,id=rootfs",
            "path=/l.ext4,unlink,id=rw",
            "path=/d",
            "empty,ro,id=ctr-slot-0",
        ] {
            let d: DiskSpec = s.parse().unwrap();
            assert_eq!(d.to_string(), s);
            assert_eq!(d.to_string().parse::<DiskSpec>().unwrap(), d);
        }
        assert_eq!(
            DiskSpec::empty_slot("c0", true).to_string(),
            "empty,ro,id=c0"
        );
        for v in VfInit::ALL {
            assert_eq!(v.to_string().parse::<VfInit>().unwrap(), v);
        }
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
