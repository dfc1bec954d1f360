//! The shared-memory contract between a guest driver and the device, as
//! `#[repr(C)]` little-endian types (docs/sgiov.md is the prose version and
//! the C header is derived from it). Every struct here has no implicit
//! padding, so it is `ByteValued` and its byte offsets are the ones the docs
//! give.
//!
//! An SG function's *area* is one guest-physically contiguous range:
//!
//! ```text
//! +0            AreaHeader (128 B: 64 B guest-written config, 64 B device status)
//! +g2d_off      FifoCtl (128 B) + g2d_entries × u64 slots   guest → device
//! +d2g_off      FifoCtl (128 B) + d2g_entries × u64 slots   device → guest
//! +table_off    table_entries × RingDesc (32 B)             ring id i = entry i
//! ```
//!
//! Rings 0 and 1 are the two control rings (§A.4): ring 0 carries
//! [`CtrlMsg`] requests guest → device, ring 1 replies device → guest.

use vm_memory::ByteValued;

mod control;
mod transport;

pub use control::{ctrl, CtrlMsg, CtrlOp, PathKind, Transform};
pub use transport::{
    SetupCmd, SETUP_ATTACH, SETUP_DETACH, SETUP_MAGIC, SETUP_QUEUE, SIGNAL_QUEUE, VIRTIO_DEVICE_ID,
};

/// `AreaHeader::magic`: "SGIOVAR1" little-endian.
pub const AREA_MAGIC: u64 = u64::from_le_bytes(*b"SGIOVAR1");
/// `AreaHeader::version` this crate speaks.
pub const VERSION: u32 = 1;

/// Ring 0: control requests, guest → device.
pub const CTRL_REQ_RING: u16 = 0;
/// Ring 1: control replies, device → guest.
pub const CTRL_REPLY_RING: u16 = 1;
/// First ring id a socket may use.
pub const FIRST_DATA_RING: u16 = 2;

/// Limits the device enforces (and the guest driver must respect).
pub mod limits {
    /// Area: at most 16 MiB (a table of 65535 rings is 2 MiB).
    pub const MAX_AREA: u32 = 16 << 20;
    /// FIFO slots: a power of two in this range.
    pub const MIN_FIFO_ENTRIES: u32 = 64;
    pub const MAX_FIFO_ENTRIES: u32 = 1 << 16;
    /// Ring table entries (ring ids 0..entries-1; 0xFFFF is never a ring).
    pub const MIN_TABLE_ENTRIES: u32 = 4;
    pub const MAX_TABLE_ENTRIES: u32 = 0xFFFF;
    /// Ring data: a power of two in this range, based at a multiple of 64.
    pub const MIN_RING: u32 = 4096;
    pub const MAX_RING: u32 = 64 << 20;
    pub const RING_ALIGN: u64 = 64;
    /// Sockets (pipe pairs) one SGF may have open; with two rings each plus the
    /// control rings this needs 8194 ring ids.
    pub const MAX_SOCKETS_PER_SGF: usize = 4096;
    /// The device accepts at most this many control requests per kick, and
    /// this many signal words per SGF per round, so one guest cannot starve
    /// the others.
    pub const CTRL_BUDGET: usize = 64;
    pub const SIGNAL_BUDGET: usize = 1024;
    /// Largest payload of one encrypted record a decrypting pipe accepts.
    pub const MAX_RECORD_PAYLOAD: u32 = 1 << 20;
    /// Default maximum job size (bytes of input per job), §5.2.
    pub const DEFAULT_MAX_JOB: u32 = 64 << 10;
    /// Connections waiting in a listener's backlog.
    pub const LISTEN_BACKLOG: usize = 64;
}

/// Guest-written configuration at area offset 0 (64 bytes), then the
/// device-written status (64 bytes). The device reads the config once, at
/// attach, and never again.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AreaHeader {
    pub magic: u64,
    pub version: u32,
    /// Bytes of the whole area, a multiple of 4096.
    pub area_len: u32,
    pub g2d_off: u32,
    pub g2d_entries: u32,
    pub d2g_off: u32,
    pub d2g_entries: u32,
    pub table_off: u32,
    pub table_entries: u32,
    pub reserved: [u32; 6],
    /// Device-written: [`SgfState`].
    pub dev_state: u32,
    /// Device-written: [`ErrorCode`] when `dev_state` is `Error`.
    pub dev_error: u32,
    pub dev_reserved: [u32; 14],
}

/// Byte offsets inside [`AreaHeader`].
pub mod area {
    pub const DEV_STATE: u64 = 64;
    pub const DEV_ERROR: u64 = 68;
    pub const SIZE: u64 = 128;
}

/// State of an SG function as the device reports it in `AreaHeader::dev_state`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum SgfState {
    Detached = 0,
    Attached = 1,
    /// The FIFOs or the area were corrupt: no more signals are processed.
    Error = 2,
}

/// One FIFO's control block (128 bytes: a producer cache line, a consumer
/// cache line), followed by its slots. Indices are free-running u32; slot
/// `i` is at `FIFO_SLOTS + 8 * (i & (entries - 1))`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FifoCtl {
    /// Producer-owned: slots written so far.
    pub prod: u32,
    /// Producer-owned: [`fifo::PF_BACKLOG`].
    pub pflags: u32,
    pub prod_reserved: [u32; 14],
    /// Consumer-owned: slots consumed so far.
    pub cons: u32,
    /// Consumer-owned: notify me when `prod` passes this index (virtio event idx).
    pub event_idx: u32,
    /// Consumer-owned: [`fifo::CF_NO_NOTIFY`].
    pub cflags: u32,
    /// Consumer-owned: during a long burst the producer notifies early once
    /// this many words are pending (>= 1; 0 counts as 1).
    pub watermark: u32,
    pub cons_reserved: [u32; 12],
}

/// Byte offsets and flags of [`FifoCtl`].
pub mod fifo {
    pub const PROD: u64 = 0;
    pub const PFLAGS: u64 = 4;
    pub const CONS: u64 = 64;
    pub const EVENT_IDX: u64 = 68;
    pub const CFLAGS: u64 = 72;
    pub const WATERMARK: u64 = 76;
    pub const SLOTS: u64 = 128;
    /// `pflags`: the producer has words it could not push (FIFO full). The
    /// consumer must notify the producer after freeing slots.
    pub const PF_BACKLOG: u32 = 1;
    /// `cflags`: the consumer is polling; the producer need not notify.
    pub const CF_NO_NOTIFY: u32 = 1;

    /// Bytes of a FIFO with `entries` slots.
    pub const fn bytes(entries: u32) -> u64 {
        SLOTS + 8 * entries as u64
    }
}

/// One entry of the ring descriptor table (32 bytes). The guest writes
/// `base`, `size`, `role` before it names the ring in an OPEN request; the
/// device reads them once, at OPEN, and keeps its own copy. `dev_ptr`,
/// `state` and `error` are device-written.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RingDesc {
    /// Guest-physical address of the ring's bytes, a multiple of 64.
    pub base: u64,
    /// Bytes, a power of two in [`limits::MIN_RING`, `limits::MAX_RING`].
    pub size: u32,
    /// [`RingRole`].
    pub role: u32,
    /// Guest-owned mirror of the guest's pointer (head of a TX ring, tail of
    /// an RX ring). Informational: the device never reads it.
    pub guest_ptr: u32,
    /// Device-written: the device's pointer (tail of a TX ring, head of an RX ring).
    pub dev_ptr: u32,
    /// Device-written: [`RingState`].
    pub state: u32,
    /// Device-written: [`ErrorCode`] when `state` is `Error`.
    pub error: u32,
}

/// Byte offsets inside [`RingDesc`].
pub mod ring {
    pub const BASE: u64 = 0;
    pub const SIZE: u64 = 8;
    pub const ROLE: u64 = 12;
    pub const GUEST_PTR: u64 = 16;
    pub const DEV_PTR: u64 = 20;
    pub const STATE: u64 = 24;
    pub const ERROR: u64 = 28;
    pub const BYTES: u64 = 32;
}

/// Who produces into a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RingRole {
    /// The guest produces (a socket's TX ring, control ring 0).
    GuestProduces = 1,
    /// The device produces (a socket's RX ring, control ring 1).
    DeviceProduces = 2,
}

impl RingRole {
    pub fn from_u32(v: u32) -> Option<RingRole> {
        match v {
            1 => Some(RingRole::GuestProduces),
            2 => Some(RingRole::DeviceProduces),
            _ => None,
        }
    }
}

/// Device-written state of a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum RingState {
    Free = 0,
    Open = 1,
    Error = 2,
    Closed = 3,
}

/// Why a ring, a pipe, an SGF or a control request failed. The same numbers
/// go into `RingDesc::error`, `AreaHeader::dev_error`, the pointer field of
/// an `Error` signal and `CtrlMsg::status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum ErrorCode {
    /// A ring descriptor is invalid: base or size outside guest memory, size
    /// not a power of two in range, base misaligned, wrong role.
    BadRing = 1,
    /// The ring overlaps another open ring of the SGF or the area.
    Overlap = 2,
    /// A head or tail pointer moved backwards or past the ring's bounds.
    BadPointer = 3,
    /// A signal the sender may not send for this ring (e.g. `Head` on an RX ring).
    WrongDirection = 4,
    /// An encrypted record failed authentication or its sequence number.
    Auth = 5,
    /// Guest memory could not be accessed or prepared.
    Memory = 6,
    /// The ring id or socket is already in use.
    Busy = 7,
    /// Unknown socket, ring or port.
    NotFound = 8,
    /// The port already has a listener.
    AddrInUse = 9,
    /// No listener on the port, or its backlog is full.
    Refused = 10,
    /// Out of staging memory, key slots or socket slots.
    NoSpace = 11,
    /// Malformed control request.
    BadRequest = 12,
    /// The socket is not in a state that allows the request.
    State = 13,
    /// A record header is malformed, too large or straddles the ring end.
    Record = 14,
    /// The FIFO indices are corrupt (more words claimed than slots).
    FifoCorrupt = 15,
    /// The area header is invalid.
    BadArea = 16,
}

impl ErrorCode {
    pub fn from_u32(v: u32) -> Option<ErrorCode> {
        use ErrorCode::*;
        Some(match v {
            1 => BadRing,
            2 => Overlap,
            3 => BadPointer,
            4 => WrongDirection,
            5 => Auth,
            6 => Memory,
            7 => Busy,
            8 => NotFound,
            9 => AddrInUse,
            10 => Refused,
            11 => NoSpace,
            12 => BadRequest,
            13 => State,
            14 => Record,
            15 => FifoCorrupt,
            16 => BadArea,
            _ => return None,
        })
    }
}

// SAFETY: all of these are repr(C) structs of integers with no implicit
// padding (checked by the size assertions below), so every byte pattern is a
// valid value.
unsafe impl ByteValued for AreaHeader {}
// SAFETY: as above.
unsafe impl ByteValued for FifoCtl {}
// SAFETY: as above.
unsafe impl ByteValued for RingDesc {}
// SAFETY: as above.
unsafe impl ByteValued for CtrlMsg {}
// SAFETY: as above.
unsafe impl ByteValued for SetupCmd {}

const _: () = assert!(size_of::<AreaHeader>() == 128);
const _: () = assert!(size_of::<FifoCtl>() == 128);
const _: () = assert!(size_of::<RingDesc>() == 32);
const _: () = assert!(size_of::<CtrlMsg>() == 64);
const _: () = assert!(size_of::<SetupCmd>() == 32);

/// The canonical area layout for given FIFO and table sizes (the driver may
/// choose another, as long as the header describes it and it validates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub g2d_off: u32,
    pub g2d_entries: u32,
    pub d2g_off: u32,
    pub d2g_entries: u32,
    pub table_off: u32,
    pub table_entries: u32,
    pub area_len: u32,
}

impl Layout {
    /// Header, g2d FIFO, d2g FIFO, ring table, each 64-byte aligned, the
    /// whole rounded up to 4 KiB. Panics only on arguments outside `limits`
    /// (a programming error of the caller, not guest input).
    pub fn canonical(fifo_entries: u32, table_entries: u32) -> Layout {
        assert!(fifo_entries.is_power_of_two());
        assert!((limits::MIN_FIFO_ENTRIES..=limits::MAX_FIFO_ENTRIES).contains(&fifo_entries));
        assert!((limits::MIN_TABLE_ENTRIES..=limits::MAX_TABLE_ENTRIES).contains(&table_entries));
        let g2d_off = area::SIZE;
        let d2g_off = g2d_off + fifo::bytes(fifo_entries);
        let table_off = d2g_off + fifo::bytes(fifo_entries);
        let end = table_off + ring::BYTES * table_entries as u64;
        Layout {
            g2d_off: g2d_off as u32,
            g2d_entries: fifo_entries,
            d2g_off: d2g_off as u32,
            d2g_entries: fifo_entries,
            table_off: table_off as u32,
            table_entries,
            area_len: end.next_multiple_of(4096) as u32,
        }
    }

    pub fn header(&self) -> AreaHeader {
        AreaHeader {
            magic: AREA_MAGIC,
            version: VERSION,
            area_len: self.area_len,
            g2d_off: self.g2d_off,
            g2d_entries: self.g2d_entries,
            d2g_off: self.d2g_off,
            d2g_entries: self.d2g_entries,
            table_off: self.table_off,
            table_entries: self.table_entries,
            ..Default::default()
        }
    }

    /// Checks a header the guest wrote (already read once into `h`): every
    /// section inside the area, aligned, sized within limits, and disjoint.
    pub fn validate(h: &AreaHeader) -> Result<Layout, &'static str> {
        if h.magic != AREA_MAGIC {
            return Err("bad magic");
        }
        if h.version != VERSION {
            return Err("unsupported version");
        }
        if h.area_len == 0 || !h.area_len.is_multiple_of(4096) || h.area_len > limits::MAX_AREA {
            return Err("area_len not a multiple of 4096 within 16 MiB");
        }
        let fifo_ok = |e: u32| {
            e.is_power_of_two()
                && (limits::MIN_FIFO_ENTRIES..=limits::MAX_FIFO_ENTRIES).contains(&e)
        };
        if !fifo_ok(h.g2d_entries) || !fifo_ok(h.d2g_entries) {
            return Err("FIFO entries not a power of two in 64..65536");
        }
        if !(limits::MIN_TABLE_ENTRIES..=limits::MAX_TABLE_ENTRIES).contains(&h.table_entries) {
            return Err("table_entries not in 4..65535");
        }
        let sections = [
            (h.g2d_off as u64, fifo::bytes(h.g2d_entries)),
            (h.d2g_off as u64, fifo::bytes(h.d2g_entries)),
            (h.table_off as u64, ring::BYTES * h.table_entries as u64),
        ];
        for (i, &(off, len)) in sections.iter().enumerate() {
            if off % 64 != 0 || off < area::SIZE || off + len > h.area_len as u64 {
                return Err("section misaligned or outside the area");
            }
            for &(o2, l2) in &sections[i + 1..] {
                if off < o2 + l2 && o2 < off + len {
                    return Err("sections overlap");
                }
            }
        }
        Ok(Layout {
            g2d_off: h.g2d_off,
            g2d_entries: h.g2d_entries,
            d2g_off: h.d2g_off,
            d2g_entries: h.d2g_entries,
            table_off: h.table_off,
            table_entries: h.table_entries,
            area_len: h.area_len,
        })
    }

    /// Area offset of ring `id`'s descriptor.
    pub fn desc_off(&self, id: u16) -> u64 {
        self.table_off as u64 + ring::BYTES * id as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offsets_match_the_docs() {
        let h = AreaHeader::default();
        let base = &h as *const _ as usize;
        assert_eq!(
            &h.dev_state as *const _ as usize - base,
            area::DEV_STATE as usize
        );
        assert_eq!(
            &h.dev_error as *const _ as usize - base,
            area::DEV_ERROR as usize
        );
        let f = FifoCtl::default();
        let b = &f as *const _ as usize;
        assert_eq!(&f.pflags as *const _ as usize - b, fifo::PFLAGS as usize);
        assert_eq!(&f.cons as *const _ as usize - b, fifo::CONS as usize);
        assert_eq!(
            &f.event_idx as *const _ as usize - b,
            fifo::EVENT_IDX as usize
        );
        assert_eq!(&f.cflags as *const _ as usize - b, fifo::CFLAGS as usize);
        assert_eq!(
            &f.watermark as *const _ as usize - b,
            fifo::WATERMARK as usize
        );
        let r = RingDesc::default();
        let b = &r as *const _ as usize;
        assert_eq!(&r.size as *const _ as usize - b, ring::SIZE as usize);
        assert_eq!(&r.role as *const _ as usize - b, ring::ROLE as usize);
        assert_eq!(
            &r.guest_ptr as *const _ as usize - b,
            ring::GUEST_PTR as usize
        );
        assert_eq!(&r.dev_ptr as *const _ as usize - b, ring::DEV_PTR as usize);
        assert_eq!(&r.state as *const _ as usize - b, ring::STATE as usize);
        assert_eq!(&r.error as *const _ as usize - b, ring::ERROR as usize);
        let c = CtrlMsg::default();
        let b = &c as *const _ as usize;
        assert_eq!(&c.sock as *const _ as usize - b, 12);
        assert_eq!(&c.port as *const _ as usize - b, 16);
        assert_eq!(&c.prio as *const _ as usize - b, 20);
        assert_eq!(&c.peer_sock as *const _ as usize - b, 24);
    }

    #[test]
    fn constants_match_the_docs() {
        assert_eq!(AREA_MAGIC, 0x3152_4156_4F49_4753);
        assert_eq!(SETUP_MAGIC, 0x5553_4753);
        assert_eq!(VIRTIO_DEVICE_ID, 0x5347);
        assert_eq!(ErrorCode::from_u32(16), Some(ErrorCode::BadArea));
        assert_eq!(ErrorCode::from_u32(17), None);
        for v in 1..=16 {
            assert_eq!(ErrorCode::from_u32(v).map(|c| c as u32), Some(v));
        }
    }

    #[test]
    fn canonical_layout_validates() {
        let l = Layout::canonical(1024, 8194);
        assert_eq!(Layout::validate(&l.header()), Ok(l));
        assert_eq!(l.g2d_off, 128);
        assert_eq!(l.d2g_off, 128 + 128 + 8 * 1024);
        assert_eq!(l.area_len % 4096, 0);
        assert!(l.area_len <= limits::MAX_AREA);
        let big = Layout::canonical(limits::MAX_FIFO_ENTRIES, limits::MAX_TABLE_ENTRIES);
        assert!(Layout::validate(&big.header()).is_ok());
    }

    #[test]
    fn rejects_bad_headers() {
        let good = Layout::canonical(64, 16).header();
        let bad = |f: &dyn Fn(&mut AreaHeader)| {
            let mut h = good;
            f(&mut h);
            Layout::validate(&h).unwrap_err()
        };
        bad(&|h| h.magic = 0);
        bad(&|h| h.version = 2);
        bad(&|h| h.area_len = 100);
        bad(&|h| h.area_len = limits::MAX_AREA + 4096);
        bad(&|h| h.g2d_entries = 100);
        bad(&|h| h.d2g_entries = 1 << 17);
        bad(&|h| h.table_entries = 0x1_0000);
        bad(&|h| h.g2d_off = 8);
        bad(&|h| h.d2g_off = h.g2d_off);
        bad(&|h| h.table_off = h.area_len - 64);
        bad(&|h| h.table_off = u32::MAX - 63);
    }
}
