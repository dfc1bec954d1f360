//! One vhost-user session with the NIC: `vf-open`, handing the rings over, stopping them.

use std::sync::atomic::Ordering;
use std::sync::MutexGuard;

use trace::{monotonic_ns, Stage};
use vhost::vhost_user::message::{
    VhostUserConfigFlags, VhostUserHeaderFlag, VhostUserProtocolFeatures, VhostUserVirtioFeatures,
};
use vhost::vhost_user::{Frontend, VhostUserFrontend};
use vhost::{VhostBackend, VringConfigData};
use virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
use virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG;
use virtio_bindings::virtio_net::VIRTIO_NET_S_LINK_UP;
use virtio_queue::{Queue, QueueT};

use super::{vu_err, Conn, DriverState, Session, Vf, SOCKET_TIMEOUT};
use crate::virtio::VirtioError;

impl Vf {
    pub(super) fn lock(&self) -> MutexGuard<'_, Conn> {
        self.conn.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(super) fn err(
        &self,
        what: &'static str,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> VirtioError {
        vu_err(&self.socket, what, source)
    }

    /// A line on stderr that names the sandbox and the VF socket (the runtime reads it).
    pub(super) fn report(&self, msg: &str) {
        eprintln!(
            "sandbox {}: VF socket {}: {msg}",
            self.sandbox,
            self.socket.display()
        );
    }

    /// `vf-open` (the first time): connect, SET_OWNER, features, SET_MEM_TABLE (acked, so
    /// the NIC's mapping of guest memory is inside the stage).
    pub(super) fn open(&self, first: bool) -> Result<Session, VirtioError> {
        let start = monotonic_ns();
        // Bounded: a unix connect blocks while a wedged NIC's backlog is full.
        let stream = netutil::unixsock::connect_timeout(&self.socket, SOCKET_TIMEOUT)
            .map_err(|e| self.err("connect", e))?;
        stream
            .set_read_timeout(Some(SOCKET_TIMEOUT))
            .and_then(|_| stream.set_write_timeout(Some(SOCKET_TIMEOUT)))
            .map_err(|e| self.err("socket timeout", e))?;
        let mut frontend = Frontend::from_stream(stream, 2);
        frontend.set_owner().map_err(|e| self.err("SET_OWNER", e))?;
        let backend_features = frontend
            .get_features()
            .map_err(|e| self.err("GET_FEATURES", e))?;
        if backend_features & (1 << VIRTIO_F_VERSION_1) == 0 {
            return Err(self.err("GET_FEATURES", "backend lacks VIRTIO_F_VERSION_1"));
        }
        let protocol = backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits() != 0;
        // No SET_FEATURES yet (as QEMU's vhost_user_backend_init sends
        // none): the features are the driver's, known at DRIVER_OK, and
        // `start` sends them before any ring message; what comes before
        // (protocol features, GET_CONFIG, SET_MEM_TABLE) does not depend on them.
        let mut reset_device = false;
        let mut reply_ack = false;
        if protocol {
            let theirs = frontend
                .get_protocol_features()
                .map_err(|e| self.err("GET_PROTOCOL_FEATURES", e))?;
            let ours = theirs
                & (VhostUserProtocolFeatures::REPLY_ACK
                    | VhostUserProtocolFeatures::RESET_DEVICE
                    | VhostUserProtocolFeatures::CONFIG);
            frontend
                .set_protocol_features(ours)
                .map_err(|e| self.err("SET_PROTOCOL_FEATURES", e))?;
            self.learn_mac(
                &mut frontend,
                ours.contains(VhostUserProtocolFeatures::CONFIG),
            )?;
            reply_ack = ours.contains(VhostUserProtocolFeatures::REPLY_ACK);
            if reply_ack {
                frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
            }
            reset_device = ours.contains(VhostUserProtocolFeatures::RESET_DEVICE);
        } else {
            self.learn_mac(&mut frontend, false)?;
        }
        frontend
            .set_mem_table(&self.regions)
            .map_err(|e| self.err("SET_MEM_TABLE", e))?;
        if first {
            if let Err(e) = self.trace.record(Stage::VfOpen, start, monotonic_ns()) {
                tracing::warn!("vhost-user {}: trace: {e}", self.socket.display());
            }
        }
        Ok(Session {
            frontend,
            backend_features,
            protocol,
            reset_device,
            reply_ack,
        })
    }

    /// Reads the VF's MAC from the NIC (GET_CONFIG, before NEED_REPLY is
    /// set: the reply is the config itself). Without `--mac` it becomes the
    /// guest's; with `--mac` (or after a reconnect) the two must agree.
    fn learn_mac(&self, f: &mut Frontend, config: bool) -> Result<(), VirtioError> {
        if self.kind == super::VuKind::Sg {
            return Ok(()); // no MAC: an SG function has no config space
        }
        if !config {
            let m = self.mac.known().ok_or_else(|| {
                self.err(
                    "GET_CONFIG",
                    "the NIC does not report the VF's MAC (no vhost-user CONFIG \
                     protocol feature): give --mac",
                )
            })?;
            self.mac.set(m);
            return Ok(());
        }
        let (_, cfg) = f
            .get_config(0, 6, VhostUserConfigFlags::empty(), &[0u8; 6])
            .map_err(|e| self.err("GET_CONFIG", e))?;
        let vf_mac: [u8; 6] = cfg
            .get(..6)
            .and_then(|m| m.try_into().ok())
            .ok_or_else(|| self.err("GET_CONFIG", "reply shorter than a MAC"))?;
        if vf_mac[0] & 1 != 0 || vf_mac == [0; 6] {
            return Err(self.err(
                "GET_CONFIG",
                format!(
                    "the VF reports MAC {}, not a unicast one",
                    netutil::MacAddr::from(vf_mac)
                ),
            ));
        }
        if let Some(m) = self.mac.known().filter(|m| *m != vf_mac) {
            return Err(self.err(
                "GET_CONFIG",
                format!(
                    "the guest's MAC {} is not the VF's MAC {}: the NIC would drop every \
                     frame the guest sends (omit --mac to use the VF's)",
                    netutil::MacAddr::from(m),
                    netutil::MacAddr::from(vf_mac)
                ),
            ));
        }
        self.mac.set(vf_mac);
        Ok(())
    }

    /// The address the NIC knows `gpa` by: the userspace address we gave
    /// for its region in SET_MEM_TABLE (vhost-user vring addresses are
    /// frontend virtual addresses).
    pub(super) fn host_addr(&self, gpa: u64, what: &'static str) -> Result<u64, VirtioError> {
        self.regions
            .iter()
            .find(|r| gpa >= r.guest_phys_addr && gpa - r.guest_phys_addr < r.memory_size)
            .map(|r| r.userspace_addr + (gpa - r.guest_phys_addr))
            .ok_or_else(|| self.err(what, format!("{gpa:#x} is not in a dma region")))
    }

    pub(super) fn ring_config(&self, q: &Queue) -> Result<VringConfigData, VirtioError> {
        Ok(VringConfigData {
            queue_max_size: q.max_size(),
            queue_size: q.size(),
            flags: 0,
            desc_table_addr: self.host_addr(q.desc_table(), "descriptor table")?,
            used_ring_addr: self.host_addr(q.used_ring(), "used ring")?,
            avail_ring_addr: self.host_addr(q.avail_ring(), "avail ring")?,
            log_addr: None,
        })
    }

    /// Where each ring of `d` restarts: 0 for a fresh driver; after a reconnect the used
    /// index in guest memory (what the old backend completed; what it had taken but not
    /// completed is taken again).
    pub(super) fn ring_bases(&self, d: &DriverState) -> Result<Vec<u16>, VirtioError> {
        if !d.started_once {
            return Ok(vec![0; d.queues.len()]);
        }
        d.queues
            .iter()
            .map(|q| {
                // Ring pages the guest never touched are zeroed first (lazy memory).
                for gpa in [q.used_ring(), q.avail_ring()] {
                    self.guestmem
                        .prepare_for_device_write(gpa, 4)
                        .map_err(|e| self.err("used index", e))?;
                }
                q.used_idx(&self.mem, Ordering::Acquire)
                    .map(|w| w.0)
                    .map_err(|e| self.err("used index", e))
            })
            .collect()
    }

    /// Hands the rings of `d` to the backend of `s`, starting at `bases`.
    pub(super) fn start(
        &self,
        s: &mut Session,
        d: &DriverState,
        bases: &[u16],
    ) -> Result<(), VirtioError> {
        // One ack for the whole hand-over, as QEMU asks for few: a backend
        // handles messages in order, and ours ends the session at the first
        // it refuses, so the last one's ack (or the closed socket) answers
        // for all. An ack per message cost two context switches each on
        // the DRIVER_OK path.
        if s.reply_ack {
            s.frontend.set_hdr_flags(VhostUserHeaderFlag::empty());
        }
        let res = self.hand_over(s, d, bases);
        if s.reply_ack {
            s.frontend.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
        }
        res
    }

    /// The messages of `start`; with REPLY_ACK (so protocol features too)
    /// only the last SET_VRING_ENABLE asks for a reply.
    fn hand_over(
        &self,
        s: &mut Session,
        d: &DriverState,
        bases: &[u16],
    ) -> Result<(), VirtioError> {
        let (protocol, ack_last) = (s.protocol, s.reply_ack);
        let mut acked = d.features & s.backend_features;
        acked |= s.backend_features & VhostUserVirtioFeatures::PROTOCOL_FEATURES.bits();
        let f = &mut s.frontend;
        f.set_features(acked)
            .map_err(|e| self.err("SET_FEATURES", e))?;
        let last = d.queues.len().saturating_sub(1);
        for (i, q) in d.queues.iter().enumerate() {
            let cfg = self.ring_config(q)?;
            f.set_vring_num(i, q.size())
                .map_err(|e| self.err("SET_VRING_NUM", e))?;
            f.set_vring_addr(i, &cfg)
                .map_err(|e| self.err("SET_VRING_ADDR", e))?;
            f.set_vring_base(i, bases[i])
                .map_err(|e| self.err("SET_VRING_BASE", e))?;
            f.set_vring_call(i, &self.call)
                .map_err(|e| self.err("SET_VRING_CALL", e))?;
            f.set_vring_err(i, &self.errs[i])
                .map_err(|e| self.err("SET_VRING_ERR", e))?;
            f.set_vring_kick(i, &self.kicks[i])
                .map_err(|e| self.err("SET_VRING_KICK", e))?;
        }
        // Every ring set up before any is enabled (as QEMU's vhost_dev_start does): the
        // NIC's dataplane takes a VF's rings once one is enabled, and each later set-up
        // message would have to take them back from it (a wake-up and a wait apiece).
        if protocol {
            for i in 0..d.queues.len() {
                let step = if ack_last && i == last {
                    f.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
                    "SET_FEATURES..SET_VRING_ENABLE (acked at the last)"
                } else {
                    "SET_VRING_ENABLE"
                };
                f.set_vring_enable(i, true).map_err(|e| self.err(step, e))?;
            }
        }
        Ok(())
    }

    /// Stops the backend using the rings (guest reset): a VF reset when negotiated, else
    /// GET_VRING_BASE on each ring.
    pub(super) fn stop(&self, s: &mut Session, rings: usize) -> Result<(), VirtioError> {
        if s.reset_device {
            return s
                .frontend
                .reset_device()
                .map_err(|e| self.err("RESET_DEVICE", e));
        }
        for i in 0..rings {
            s.frontend
                .get_vring_base(i)
                .map_err(|e| self.err("GET_VRING_BASE", e))?;
        }
        Ok(())
    }

    /// Starts the driver's rings on the current session if that is still to be done.
    /// A failure of the connection leaves the session to the monitor (reconnect).
    pub(super) fn apply(&self, c: &mut Conn) -> Result<(), VirtioError> {
        let Conn {
            session: Some(s),
            started: started @ false,
            broken: false,
            driver: Some(d),
            ..
        } = c
        else {
            return Ok(());
        };
        let bases = match self.ring_bases(d) {
            Ok(b) => b,
            Err(e) => {
                self.fail();
                return Err(e);
            }
        };
        if let Err(e) = self.start(s, d, &bases) {
            c.broken = true;
            let _ = self.wake.write(1);
            return Err(e);
        }
        *started = true;
        d.started_once = true;
        self.set_link(true);
        Ok(())
    }

    pub(super) fn set_link(&self, up: bool) {
        self.link.store(
            if up { VIRTIO_NET_S_LINK_UP as u16 } else { 0 },
            Ordering::SeqCst,
        );
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.interrupt.signal(VIRTIO_MMIO_INT_CONFIG);
    }

    /// Consumes the NIC's error signals of every ring; whether there was one. Callers hold
    /// the connection lock, so that each signal is taken once: by the monitor (reported)
    /// or by a guest reset (the error of the rings it stopped).
    pub(super) fn take_err_signals(&self) -> bool {
        // Every one is read (no short cut), so that each ring's signal is consumed.
        self.errs.iter().filter(|e| e.read().is_ok()).count() > 0
    }

    /// DEVICE_NEEDS_RESET plus a config interrupt.
    pub(super) fn fail(&self) {
        self.failed.store(true, Ordering::SeqCst);
        self.mac.done.notify_all();
        self.generation.fetch_add(1, Ordering::SeqCst);
        self.interrupt.signal(VIRTIO_MMIO_INT_CONFIG);
    }
}
