//! The virtio transport of an SG function: its device id, the setup queue's
//! [`SetupCmd`] (attach, detach) and the signal queue.

/// The SG function's virtio-mmio device id (burstvm-private: no standard
/// virtio driver binds to it).
pub const VIRTIO_DEVICE_ID: u32 = 0x5347;
/// Virtqueue 0 carries [`SetupCmd`]s (attach, detach).
pub const SETUP_QUEUE: u16 = 0;
/// Virtqueue 1 carries no buffers: its kick eventfd is the Cross-FIFO
/// doorbell, its call eventfd (irqfd) the Cross-FIFO interrupt.
pub const SIGNAL_QUEUE: u16 = 1;

/// The transport bootstrap (stage 2, vhost-user): the guest sends this on
/// the SGF's setup queue (virtqueue 0) as a device-readable buffer followed
/// by a device-writable `u32` status.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SetupCmd {
    /// [`SETUP_MAGIC`].
    pub magic: u32,
    /// 1 = attach the area, 2 = detach.
    pub op: u32,
    pub area_gpa: u64,
    pub area_len: u32,
    /// `dedicated` signal mode (ATTACH): slots of each channel FIFO; 0 =
    /// Cross-FIFO only. Channel k lies at `chan_gpa + k *
    /// dedicated::channel_bytes(chan_entries)`.
    pub chan_entries: u32,
    pub chan_gpa: u64,
}

/// "SGSU" little-endian.
pub const SETUP_MAGIC: u32 = u32::from_le_bytes(*b"SGSU");
pub const SETUP_ATTACH: u32 = 1;
pub const SETUP_DETACH: u32 = 2;
