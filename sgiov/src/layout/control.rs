//! The control rings' messages (§A.4): [`CtrlMsg`] and its opcodes, and the
//! options a connection carries (transformation, path).

/// A control message (64 bytes) on ring 0 (request) or ring 1 (reply). The
/// control rings' sizes are multiples of 64, so a message never wraps.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CtrlMsg {
    /// [`CtrlOp`]; a reply has [`ctrl::REPLY`] or-ed in.
    pub op: u16,
    pub flags: u16,
    /// Chosen by the guest, echoed in the reply.
    pub req_id: u32,
    /// Reply: 0 = ok, else an [`ErrorCode`].
    pub status: u32,
    /// The socket a request is about (its TX ring id).
    pub sock: u16,
    /// OPEN: the socket's RX ring id. ACCEPT: the socket that takes the connection.
    pub aux: u16,
    /// LISTEN / CONNECT: the port (0 = the device's echo service for CONNECT).
    pub port: u32,
    /// OPEN: priority 0 (highest) .. 7.
    pub prio: u8,
    /// CONNECT: [`Transform`] of the connection.
    pub xf: u8,
    /// CONNECT: [`PathKind`].
    pub path: u8,
    /// OPEN in `dedicated` mode: the socket's own signal channel, index + 1
    /// (0 = none: its signals use the Cross-FIFO). See [`crate::dedicated`].
    pub chan: u8,
    /// Reply to ACCEPT / CONNECT: the peer socket's id on its own SGF.
    pub peer_sock: u16,
    pub reserved1: u16,
    pub reserved: [u32; 9],
}

/// Control opcodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u16)]
pub enum CtrlOp {
    /// `sock` = TX ring id, `aux` = RX ring id, `prio`: create a socket.
    Open = 1,
    /// `sock`, `port`: make the socket a listener.
    Listen = 2,
    /// `sock`, `port`, `xf`, `path`: connect to a listener (port 0: echo).
    Connect = 3,
    /// `sock` = listener, `aux` = an open unconnected socket to bind the next
    /// incoming connection to. The reply comes when a peer connects.
    Accept = 4,
    /// `sock`: close the socket and its pipes; its ring ids become free.
    Close = 5,
}

pub mod ctrl {
    /// Or-ed into `op` of a reply.
    pub const REPLY: u16 = 0x80;
    pub const MSG_BYTES: u32 = 64;
}

impl CtrlOp {
    pub fn from_u16(v: u16) -> Option<CtrlOp> {
        Some(match v {
            1 => CtrlOp::Open,
            2 => CtrlOp::Listen,
            3 => CtrlOp::Connect,
            4 => CtrlOp::Accept,
            5 => CtrlOp::Close,
            _ => return None,
        })
    }
}

/// The transformation a connection applies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Transform {
    /// Bytes arrive as sent.
    Copy = 0,
    /// Encrypted (AES-256-GCM records) in the staging ring, decrypted on delivery.
    Crypto = 1,
}

impl Transform {
    pub fn from_u8(v: u8) -> Option<Transform> {
        match v {
            0 => Some(Transform::Copy),
            1 => Some(Transform::Crypto),
            _ => None,
        }
    }
}

/// Where a connection's bytes go between the two guests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum PathKind {
    /// Guest ring → daemon staging ring → guest ring (two pipes, chained).
    Staged = 0,
    /// Guest ring → guest ring in one copy (one pipe). Copy only.
    Direct = 1,
}

impl PathKind {
    pub fn from_u8(v: u8) -> Option<PathKind> {
        match v {
            0 => Some(PathKind::Staged),
            1 => Some(PathKind::Direct),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            PathKind::Staged => "staged",
            PathKind::Direct => "direct",
        }
    }
}

impl std::str::FromStr for PathKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "staged" => Ok(PathKind::Staged),
            "direct" => Ok(PathKind::Direct),
            _ => Err(format!("unknown path {s:?} (staged, direct)")),
        }
    }
}
