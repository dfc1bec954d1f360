//! The virtio-vsock packet (virtio 1.2 §5.10.6): the 44-byte little-endian
//! header, its constants, and the copies between a packet and a guest's
//! descriptor chain.
//!
//! A chain is a byte stream here, whatever its layout: Linux 6.1 posts an RX
//! buffer as two device-writable descriptors (header, 4 KiB of data) and
//! sends a TX packet as one or two device-readable ones, later kernels use
//! one descriptor for both. The header is the first 44 bytes of the chain,
//! the payload follows it. Every chain is untrusted: a TX chain must be
//! device-readable only and hold the header and the `len` bytes it claims
//! (at most [`MAX_PAYLOAD`]); an RX chain must be device-writable only and
//! lie in guest memory as a whole before anything is written to it. The
//! chain was walked and split by `virtq` (`chain.rs`), the one walker.

use vm_memory::GuestMemory;

use crate::virtio::chain::{total, CopyError, Split, SplitError};

/// Size of `struct virtio_vsock_hdr`.
pub const HDR_LEN: usize = 44;
/// The host's CID (VMADDR_CID_HOST): every packet of the guest goes there.
pub const HOST_CID: u64 = 2;
/// Largest payload one TX packet may carry (Linux's VIRTIO_VSOCK_MAX_PKT_BUF_SIZE),
/// and the largest the device puts into one RX buffer.
pub const MAX_PAYLOAD: usize = 64 << 10;

/// `type`: stream sockets only (VIRTIO_VSOCK_F_SEQPACKET is not offered).
pub const TYPE_STREAM: u16 = 1;

/// `op` values.
pub const OP_REQUEST: u16 = 1;
pub const OP_RESPONSE: u16 = 2;
pub const OP_RST: u16 = 3;
pub const OP_SHUTDOWN: u16 = 4;
pub const OP_RW: u16 = 5;
pub const OP_CREDIT_UPDATE: u16 = 6;
pub const OP_CREDIT_REQUEST: u16 = 7;

/// SHUTDOWN flags: the sender will receive no more / send no more.
pub const SHUTDOWN_RCV: u32 = 1;
pub const SHUTDOWN_SEND: u32 = 2;
pub const SHUTDOWN_BOTH: u32 = SHUTDOWN_RCV | SHUTDOWN_SEND;

/// `struct virtio_vsock_event` id: the transport was reset (connections are gone).
pub const EVENT_TRANSPORT_RESET: u32 = 0;
/// Size of `struct virtio_vsock_event`.
pub const EVENT_LEN: usize = 4;

/// `struct virtio_vsock_hdr`, decoded.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Header {
    pub src_cid: u64,
    pub dst_cid: u64,
    pub src_port: u32,
    pub dst_port: u32,
    pub len: u32,
    pub type_: u16,
    pub op: u16,
    pub flags: u32,
    pub buf_alloc: u32,
    pub fwd_cnt: u32,
}

impl Header {
    pub fn to_bytes(self) -> [u8; HDR_LEN] {
        let mut b = [0u8; HDR_LEN];
        b[0..8].copy_from_slice(&self.src_cid.to_le_bytes());
        b[8..16].copy_from_slice(&self.dst_cid.to_le_bytes());
        b[16..20].copy_from_slice(&self.src_port.to_le_bytes());
        b[20..24].copy_from_slice(&self.dst_port.to_le_bytes());
        b[24..28].copy_from_slice(&self.len.to_le_bytes());
        b[28..30].copy_from_slice(&self.type_.to_le_bytes());
        b[30..32].copy_from_slice(&self.op.to_le_bytes());
        b[32..36].copy_from_slice(&self.flags.to_le_bytes());
        b[36..40].copy_from_slice(&self.buf_alloc.to_le_bytes());
        b[40..44].copy_from_slice(&self.fwd_cnt.to_le_bytes());
        b
    }

    pub fn from_bytes(b: &[u8; HDR_LEN]) -> Self {
        let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().expect("8 bytes"));
        let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().expect("4 bytes"));
        let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().expect("2 bytes"));
        Header {
            src_cid: u64_at(0),
            dst_cid: u64_at(8),
            src_port: u32_at(16),
            dst_port: u32_at(20),
            len: u32_at(24),
            type_: u16_at(28),
            op: u16_at(30),
            flags: u32_at(32),
            buf_alloc: u32_at(36),
            fwd_cnt: u32_at(40),
        }
    }
}

/// The name of an op, for logs.
pub fn op_name(op: u16) -> &'static str {
    match op {
        OP_REQUEST => "REQUEST",
        OP_RESPONSE => "RESPONSE",
        OP_RST => "RST",
        OP_SHUTDOWN => "SHUTDOWN",
        OP_RW => "RW",
        OP_CREDIT_UPDATE => "CREDIT_UPDATE",
        OP_CREDIT_REQUEST => "CREDIT_REQUEST",
        _ => "unknown op",
    }
}

/// Why a guest's chain was refused (returned unused, counted, logged).
#[derive(Debug, thiserror::Error)]
pub enum PacketError {
    #[error(transparent)]
    Split(#[from] SplitError),
    #[error(transparent)]
    Copy(#[from] CopyError),
    #[error("device-writable descriptor in a TX chain")]
    WritableInTx,
    #[error("device-readable descriptor in an {queue} chain")]
    ReadableIn { queue: &'static str },
    #[error("TX chain of {len} bytes is shorter than the {HDR_LEN}-byte header")]
    Short { len: u64 },
    #[error("header len {len} exceeds the {have} payload bytes of the chain")]
    LenBeyondChain { len: u32, have: u64 },
    #[error("header len {len} exceeds the {MAX_PAYLOAD}-byte packet limit")]
    TooLong { len: u32 },
    #[error("{queue} chain holds {capacity} bytes, need at least {need}")]
    TooSmall {
        queue: &'static str,
        capacity: u64,
        need: usize,
    },
}

/// Reads the TX packet of chain `s` (already walked and split): returns its
/// header, with its payload (`len` bytes, only for RW) in `payload`.
pub fn read_tx<M, P>(
    mem: &M,
    prepare: &P,
    s: &Split,
    payload: &mut Vec<u8>,
) -> Result<Header, PacketError>
where
    M: GuestMemory + ?Sized,
    P: Fn(u64, u64) -> Result<(), guestmem::Error> + ?Sized,
{
    payload.clear();
    if !s.writable.is_empty() {
        return Err(PacketError::WritableInTx);
    }
    let len = total(&s.readable);
    if len < HDR_LEN as u64 {
        return Err(PacketError::Short { len });
    }
    let mut raw = [0u8; HDR_LEN];
    virtq::read_bufs(mem, prepare, &s.readable, 0, &mut raw)?;
    let hdr = Header::from_bytes(&raw);
    let have = len - HDR_LEN as u64;
    if hdr.len as usize > MAX_PAYLOAD {
        return Err(PacketError::TooLong { len: hdr.len });
    }
    if u64::from(hdr.len) > have {
        return Err(PacketError::LenBeyondChain { len: hdr.len, have });
    }
    if hdr.op == OP_RW && hdr.len > 0 {
        payload.resize(hdr.len as usize, 0);
        virtq::read_bufs(mem, prepare, &s.readable, HDR_LEN as u64, payload)?;
    }
    Ok(hdr)
}

/// Checks a device-writable chain the device wants to fill (RX or event):
/// only writable buffers, every one inside guest memory, at least `need`
/// bytes. Returns its capacity.
pub fn writable_capacity<M: GuestMemory + ?Sized>(
    mem: &M,
    s: &Split,
    queue: &'static str,
    need: usize,
) -> Result<u64, PacketError> {
    if !s.readable.is_empty() {
        return Err(PacketError::ReadableIn { queue });
    }
    s.check_in(mem)?;
    let capacity = total(&s.writable);
    if capacity < need as u64 {
        return Err(PacketError::TooSmall {
            queue,
            capacity,
            need,
        });
    }
    Ok(capacity)
}

/// Writes `hdr` and `payload` into the device-writable chain `s` (checked
/// with [`writable_capacity`]); returns the used length.
pub fn write_rx<M, P>(
    mem: &M,
    prepare: &P,
    s: &Split,
    hdr: &Header,
    payload: &[u8],
) -> Result<u32, PacketError>
where
    M: GuestMemory + ?Sized,
    P: Fn(u64, u64) -> Result<(), guestmem::Error> + ?Sized,
{
    let raw = hdr.to_bytes();
    virtq::write_bufs(mem, prepare, &s.writable, 0, &[&raw, payload])?;
    Ok((HDR_LEN + payload.len()) as u32)
}
