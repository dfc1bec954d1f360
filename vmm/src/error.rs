//! Errors of the VMM. Every message names the flag, file, device or sandbox.

use std::path::PathBuf;

/// Why a running guest stopped the VM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GuestFailure {
    TripleFault {
        vcpu: u8,
        state: String,
    },
    HltInterruptsOff {
        vcpu: u8,
    },
    InternalError {
        vcpu: u8,
        suberror: u32,
    },
    FailEntry {
        vcpu: u8,
        reason: u64,
    },
    EmulationFailure {
        vcpu: u8,
        state: String,
    },
    UnexpectedExit {
        vcpu: u8,
        what: String,
    },
    AgentError {
        code: u32,
    },
    AppChecksum {
        expected: u32,
        got: u32,
    },
    /// The rootfs file the agent read differs from the host's.
    RootfsChecksum {
        file: String,
        expected: u32,
        got: u32,
    },
    /// The writable layer did not start clean: `got` is the checksum of its
    /// first sector (another sandbox's marker, or a reused layer).
    WritableLayerNotFresh {
        got: u32,
    },
    /// The agent reached app-launch end without this rootfs report.
    RootfsMissing {
        what: &'static str,
    },
    /// The SG agent mode reported a wrong pipe count or checksum (`got`), or none before
    /// READY (`None`).
    SgReport {
        what: &'static str,
        expected: u32,
        got: Option<u32>,
    },
    Exit {
        status: u32,
    },
    /// `vcpus`: where each vCPU was when the deadline passed.
    Timeout {
        secs: u64,
        vcpus: String,
    },
    Terminated {
        signal: String,
    },
    MemoryHandler(String),
}

/// The agent's error names (guest/src/c/agent.h).
pub fn agent_error_name(code: u32) -> &'static str {
    match code {
        1 => "ERR_BAD_MAGIC (boot info magic or version wrong)",
        2 => "ERR_NO_MEMORY (no usable RAM left)",
        3 => "ERR_BAD_DEVICE (virtio-mmio magic/version/device id mismatch)",
        4 => "ERR_FEATURES (device lacks VIRTIO_F_VERSION_1 or refused FEATURES_OK)",
        5 => "ERR_QUEUE (queue unavailable or too small)",
        6 => "ERR_LINK_TIMEOUT (link never came up)",
        7 => "ERR_REPLY_TIMEOUT (no UDP reply arrived)",
        8 => "ERR_TX_TIMEOUT (device never returned the TX buffer)",
        9 => "ERR_DEVICE_FAILED (device set DEVICE_NEEDS_RESET)",
        10 => "ERR_EXCEPTION (CPU exception in the agent)",
        11 => "ERR_BLK_TIMEOUT (virtio-blk request never completed)",
        12 => "ERR_BLK_IO (virtio-blk request failed; status in the VALUE before)",
        13 => "ERR_EROFS (rootfs file not readable; erofs.h code in the VALUE before)",
        14 => "ERR_MARKER (marker read back from the writable layer differs)",
        15 => "ERR_NO_ROOTFS (rootfs file named but no EROFS image)",
        16 => "ERR_NO_NEEDS_RESET (the device never reported DEVICE_NEEDS_RESET after a fault)",
        17 => "ERR_SG_DEVICE (no SG function, or its attach failed; status in the VALUE before)",
        18 => "ERR_SG_REFUSED (the SG function refused a pipe request; status in the VALUE before)",
        19 => "ERR_SG_TIMEOUT (the SG function did not answer in time)",
        20 => "ERR_SG_DATA (bytes back from a warp pipe differ from those sent)",
        21 => "ERR_SG_RING (a warp-pipe ring in error or closed, or a corrupt FIFO)",
        _ => "unknown agent error",
    }
}

impl std::fmt::Display for GuestFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GuestFailure::TripleFault { vcpu, state } => {
                write!(f, "triple fault on vCPU {vcpu} (KVM_EXIT_SHUTDOWN) at {state}")
            }
            GuestFailure::HltInterruptsOff { vcpu } => {
                write!(f, "vCPU {vcpu} executed hlt with interrupts off (KVM_EXIT_HLT)")
            }
            GuestFailure::InternalError { vcpu, suberror } => {
                write!(f, "KVM internal error on vCPU {vcpu} (suberror {suberror})")
            }
            GuestFailure::FailEntry { vcpu, reason } => write!(
                f,
                "KVM_EXIT_FAIL_ENTRY on vCPU {vcpu} (hardware entry failure reason {reason:#x})"
            ),
            GuestFailure::EmulationFailure { vcpu, state } => {
                write!(f, "instruction emulation failure on vCPU {vcpu} at {state}")
            }
            GuestFailure::UnexpectedExit { vcpu, what } => {
                write!(f, "unexpected VM exit on vCPU {vcpu}: {what}")
            }
            GuestFailure::AgentError { code } => {
                write!(f, "guest agent reported ERROR {code}: {}", agent_error_name(*code))
            }
            GuestFailure::AppChecksum { expected, got } => write!(
                f,
                "app payload checksum mismatch: agent reported {got:#010x}, expected {expected:#010x}"
            ),
            GuestFailure::RootfsChecksum {
                file,
                expected,
                got,
            } => write!(
                f,
                "rootfs file {file}: agent read checksum {got:#010x}, the image has {expected:#010x}"
            ),
            GuestFailure::WritableLayerNotFresh { got } => write!(
                f,
                "writable layer not fresh: its first sector already held data (checksum {got:#010x})"
            ),
            GuestFailure::RootfsMissing { what } => {
                write!(f, "agent finished app launch without reporting {what}")
            }
            GuestFailure::SgReport {
                what,
                expected,
                got: Some(got),
            } => write!(
                f,
                "warp pipes: agent reported {what} {got:#010x}, expected {expected:#010x}"
            ),
            GuestFailure::SgReport {
                what,
                got: None,
                ..
            } => write!(f, "agent reached READY without reporting the warp-pipe {what}"),
            GuestFailure::Exit { status } => {
                write!(f, "guest exited with status {status} before READY")
            }
            GuestFailure::Timeout { secs, vcpus } => {
                write!(f, "timeout: guest not ready after {secs} s (--timeout); {vcpus}")
            }
            GuestFailure::Terminated { signal } => write!(f, "terminated by {signal}"),
            GuestFailure::MemoryHandler(msg) => {
                write!(f, "guest memory fault handling failed, VM stopped: {msg}")
            }
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{field}: {msg}")]
    InvalidArg { field: &'static str, msg: String },
    #[error("{field}: {source}")]
    InvalidMac {
        field: &'static str,
        #[source]
        source: netutil::MacParseError,
    },
    #[error("KVM device {path}: {source}")]
    KvmOpen {
        path: PathBuf,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("sandbox {sandbox}: {source}")]
    SupportedCpuid {
        sandbox: String,
        #[source]
        source: crate::supported_cpuid::SupportedCpuidError,
    },
    #[error("KVM device {path}: not a usable KVM device (KVM_GET_API_VERSION returned {version}, need 12)")]
    KvmApi { path: PathBuf, version: i32 },
    #[error("sandbox {sandbox}: {what}: {source}")]
    Kvm {
        sandbox: String,
        what: String,
        #[source]
        source: kvm_ioctls::Error,
    },
    #[error("sandbox {sandbox}: guest memory: {source}")]
    Memory {
        sandbox: String,
        #[source]
        source: guestmem::Error,
    },
    #[error("sandbox {sandbox}: device view of guest memory: {what}: {source}")]
    MemoryView {
        sandbox: String,
        what: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("sandbox {sandbox}: guest memory write at {gpa:#x} ({what}): {source}")]
    GuestWrite {
        sandbox: String,
        gpa: u64,
        what: &'static str,
        #[source]
        source: guestmem::Error,
    },
    #[error("--cmdline: {source}")]
    Cmdline {
        #[source]
        source: linux_loader::cmdline::Error,
    },
    #[error("kernel {path}: {msg}")]
    Kernel { path: PathBuf, msg: String },
    /// linux-loader refused the kernel as an ELF (`hint` says what to do
    /// with a compressed image).
    #[error("kernel {path}: not a bootable vmlinux ELF: {source}{hint}")]
    KernelElf {
        path: PathBuf,
        hint: &'static str,
        #[source]
        source: linux_loader::loader::elf::Error,
    },
    /// A step of loading the kernel failed: the I/O or linux-loader error of `what`.
    #[error("kernel {path}: {what}: {source}")]
    KernelStep {
        path: PathBuf,
        what: &'static str,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    #[error("initrd {path}: {msg}")]
    Initrd { path: PathBuf, msg: String },
    #[error("initrd {path}: cannot read: {source}")]
    InitrdRead {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox {sandbox}: network device {device}: {source}")]
    Net {
        sandbox: String,
        device: String,
        #[source]
        source: Box<crate::virtio::VirtioError>,
    },
    /// The `--vsock` device could not be created (its error names the socket path).
    #[error("sandbox {sandbox}: vsock device: {source}")]
    Vsock {
        sandbox: String,
        #[source]
        source: crate::virtio::VirtioError,
    },
    /// The `--api` socket could not be bound (the error names its path).
    #[error("sandbox {sandbox}: api socket: {source}")]
    Api {
        sandbox: String,
        #[source]
        source: crate::virtio::vsock::VsockError,
    },
    #[error("sandbox {sandbox}: device {device}: {source}")]
    Device {
        sandbox: String,
        device: String,
        #[source]
        source: Box<crate::virtio::VirtioError>,
    },
    /// A device's MMIO or port range could not be placed on its bus.
    #[error("sandbox {sandbox}: device {device}: {source}")]
    Bus {
        sandbox: String,
        device: String,
        #[source]
        source: crate::bus::BusError,
    },
    #[error(transparent)]
    Trace(#[from] trace::TraceError),
    #[error("{what} {path}: {source}")]
    File {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("--ready-fd {fd}: {source}")]
    ReadyFd {
        fd: i32,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox {sandbox}: {what}: {source}")]
    Os {
        sandbox: String,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("sandbox {sandbox}: template {path}: {source}")]
    SnapshotState {
        sandbox: String,
        path: PathBuf,
        #[source]
        source: crate::snapshot::state::StateError,
    },
    #[error("template {path}: {msg}")]
    Template { path: PathBuf, msg: String },
    #[error(
        "template {path}: {} does not parse: {source}",
        crate::snapshot::STATE_FILE
    )]
    TemplateJson {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("template {path}: serializing the state: {source}")]
    TemplateSerialize {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },
    #[error("template {path}: guest memory: {source}")]
    TemplateMemory {
        path: PathBuf,
        #[source]
        source: guestmem::Error,
    },
    #[error("sandbox {sandbox}: {failure}")]
    Guest {
        sandbox: String,
        failure: GuestFailure,
    },
}
