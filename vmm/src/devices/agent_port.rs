//! The agent port (docs/design.md): DATA at +4 is latched, every EVENT write
//! at +0 is timestamped on CLOCK_MONOTONIC and turned into trace stages.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use trace::{monotonic_ns, Stage, TraceWriter};

use crate::bus::BusDevice;
use crate::error::GuestFailure;
use crate::events::{EventSink, VmEvent};

pub const EV_BOOT: u8 = 0x01;
pub const EV_VF_DRIVER_START: u8 = 0x02;
pub const EV_VF_DRIVER_END: u8 = 0x03;
pub const EV_APP_LAUNCH_START: u8 = 0x04;
pub const EV_APP_LAUNCH_END: u8 = 0x05;
pub const EV_READY: u8 = 0x06;
pub const EV_VALUE: u8 = 0x07;
pub const EV_ERROR: u8 = 0x08;
pub const EV_EXIT: u8 = 0x09;
pub const EV_ROOTFS_FILE: u8 = 0x0a;
pub const EV_ROOTFS_MARKER: u8 = 0x0b;
pub const EV_VF_LINK_UP: u8 = 0x0c;
pub const EV_TEMPLATE: u8 = 0x0d;
/// SG agent mode: DATA = pipes whose echo came back byte-exact.
pub const EV_SG_PIPES: u8 = 0x0e;
/// SG agent mode: DATA = checksum of everything the pipes returned.
pub const EV_SG_CSUM: u8 = 0x0f;
/// Linux guest agent: the container root is mounted and switched to.
pub const EV_ROOTFS_MOUNTED: u8 = 0x10;
/// Linux guest agent: the network is configured.
pub const EV_NET_CONFIGURED: u8 = 0x11;

/// What the agent's SG mode must report before READY (docs/sgiov.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SgExpect {
    pub pipes: u32,
    pub checksum: u32,
}

/// What the agent must report about the rootfs (docs/rootfs.md).
#[derive(Debug, Clone, Default)]
pub struct RootfsExpect {
    /// Path and checksum of the file it reads from the EROFS layer.
    pub file: Option<(String, u32)>,
    /// A writable layer is attached: its first sector must start clean.
    pub marker: bool,
}

/// Stage boundaries seen so far (0 = not yet).
#[derive(Default)]
struct Marks {
    boot_end: u64,
    vf_start: u64,
    vf_end: u64,
    app_start: u64,
    app_end: u64,
    link_end: u64,
    rootfs_end: u64,
    net_end: u64,
    ready: bool,
    rootfs_file: bool,
    rootfs_marker: bool,
    sg_pipes: bool,
    sg_csum: bool,
}

pub struct AgentPort {
    data: u32,
    marks: Marks,
    /// When vCPU 0 first entered the guest (set by the vCPU thread).
    vcpu_start: Arc<AtomicU64>,
    expected_checksum: u32,
    rootfs: RootfsExpect,
    sg: Option<SgExpect>,
    trace: Arc<TraceWriter>,
    sink: Arc<EventSink>,
    values: Arc<Mutex<Vec<u32>>>,
}

impl AgentPort {
    pub fn new(
        vcpu_start: Arc<AtomicU64>,
        expected_checksum: u32,
        trace: Arc<TraceWriter>,
        sink: Arc<EventSink>,
        values: Arc<Mutex<Vec<u32>>>,
    ) -> Self {
        AgentPort {
            data: 0,
            marks: Marks::default(),
            vcpu_start,
            expected_checksum,
            rootfs: RootfsExpect::default(),
            sg: None,
            trace,
            sink,
            values,
        }
    }

    pub fn with_rootfs(mut self, rootfs: RootfsExpect) -> Self {
        self.rootfs = rootfs;
        self
    }

    pub fn with_sg(mut self, sg: Option<SgExpect>) -> Self {
        self.sg = sg;
        self
    }

    /// An SG report: checked against the expectation, if there is one.
    fn sg_report(&self, what: &'static str, expected: impl Fn(&SgExpect) -> u32) {
        if let Some(e) = &self.sg {
            if self.data != expected(e) {
                self.fail(GuestFailure::SgReport {
                    what,
                    expected: expected(e),
                    got: Some(self.data),
                });
            }
        }
    }

    fn fail(&self, f: GuestFailure) {
        self.sink.post(VmEvent::Failure(f));
    }

    fn record(&self, stage: Stage, start: u64, end: u64) {
        if let Err(e) = self.trace.record(stage, start, end) {
            tracing::warn!("sandbox {}: {e}", self.trace.sandbox());
        }
    }

    fn event(&mut self, code: u8, now: u64) {
        // A stage whose start event never came starts at the end of boot.
        let start_or = |start: u64, fallback: u64| if start != 0 { start } else { fallback };
        let m = &mut self.marks;
        match code {
            EV_BOOT if m.boot_end == 0 => {
                m.boot_end = now;
                self.record(Stage::Boot, self.vcpu_start.load(Ordering::Acquire), now);
            }
            EV_ROOTFS_MOUNTED if m.rootfs_end == 0 => {
                m.rootfs_end = now;
                let start = start_or(m.boot_end, now);
                self.record(Stage::RootfsMount, start, now);
            }
            EV_NET_CONFIGURED if m.net_end == 0 => {
                m.net_end = now;
                let start = start_or(m.rootfs_end, start_or(m.boot_end, now));
                self.record(Stage::NetConfig, start, now);
            }
            EV_VF_DRIVER_START => m.vf_start = now,
            EV_VF_DRIVER_END if m.vf_end == 0 => {
                m.vf_end = now;
                let start = start_or(m.vf_start, m.boot_end);
                self.record(Stage::VfDriver, start, now);
            }
            EV_APP_LAUNCH_START => m.app_start = now,
            EV_APP_LAUNCH_END if m.app_end == 0 => {
                m.app_end = now;
                let (have_file, have_marker) = (m.rootfs_file, m.rootfs_marker);
                let start = start_or(m.app_start, m.boot_end);
                self.record(Stage::AppLaunch, start, now);
                if self.data != self.expected_checksum {
                    self.fail(GuestFailure::AppChecksum {
                        expected: self.expected_checksum,
                        got: self.data,
                    });
                }
                if self.rootfs.file.is_some() && !have_file {
                    self.fail(GuestFailure::RootfsMissing {
                        what: "the rootfs file checksum",
                    });
                }
                if self.rootfs.marker && !have_marker {
                    self.fail(GuestFailure::RootfsMissing {
                        what: "the writable-layer marker",
                    });
                }
            }
            EV_VF_LINK_UP if m.link_end == 0 => {
                m.link_end = now;
                // The wait begins when the agent needs the link: after both
                // the driver init and the app launch.
                let start = start_or(m.app_end.max(m.vf_end), m.boot_end);
                self.record(Stage::VfLink, start, now);
            }
            EV_ROOTFS_FILE if !m.rootfs_file => {
                m.rootfs_file = true;
                if let Some((file, expected)) = &self.rootfs.file {
                    if self.data != *expected {
                        self.fail(GuestFailure::RootfsChecksum {
                            file: file.clone(),
                            expected: *expected,
                            got: self.data,
                        });
                    }
                }
            }
            EV_ROOTFS_MARKER if !m.rootfs_marker => {
                m.rootfs_marker = true;
                // Zero: the first sector was all zeros, as in the template.
                if self.data != 0 {
                    self.fail(GuestFailure::WritableLayerNotFresh { got: self.data });
                }
            }
            EV_SG_PIPES if !m.sg_pipes => {
                m.sg_pipes = true;
                self.sg_report("pipe count", |e| e.pipes);
            }
            EV_SG_CSUM if !m.sg_csum => {
                m.sg_csum = true;
                self.sg_report("checksum", |e| e.checksum);
            }
            EV_READY if !m.ready => {
                m.ready = true;
                if let Some(e) = self.sg {
                    for (seen, what, expected) in [
                        (m.sg_pipes, "pipe count", e.pipes),
                        (m.sg_csum, "checksum", e.checksum),
                    ] {
                        if !seen {
                            self.sink.post(VmEvent::Failure(GuestFailure::SgReport {
                                what,
                                expected,
                                got: None,
                            }));
                        }
                    }
                }
                // ready = max(app-launch end, vf-driver end, vf-link end) → READY.
                let start = [
                    m.app_end.max(m.vf_end).max(m.link_end),
                    m.net_end.max(m.rootfs_end),
                    m.boot_end,
                    self.vcpu_start.load(Ordering::Acquire),
                ]
                .into_iter()
                .find(|&t| t != 0)
                .unwrap_or(now);
                self.record(Stage::Ready, start, now);
                self.sink.post(VmEvent::Ready);
            }
            EV_VALUE => self
                .values
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(self.data),
            EV_ERROR => self.sink.post(VmEvent::Failure(GuestFailure::AgentError {
                code: self.data,
            })),
            EV_EXIT => self.sink.post(VmEvent::GuestExit(self.data)),
            EV_TEMPLATE => self.sink.post(VmEvent::Checkpoint),
            other => tracing::debug!("agent port: ignored event {other:#x}"),
        }
    }
}

impl BusDevice for AgentPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        data.fill(0);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        let now = monotonic_ns();
        match offset {
            0 => {
                if let Some(&code) = data.first() {
                    self.event(code, now);
                }
            }
            4..=7 => {
                // Latch the bytes written; an `outl` replaces the whole word.
                let mut bytes = self.data.to_le_bytes();
                for (i, b) in data.iter().enumerate() {
                    if let Some(slot) = bytes.get_mut(offset as usize - 4 + i) {
                        *slot = *b;
                    }
                }
                self.data = u32::from_le_bytes(bytes);
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_become_stages_in_order() {
        let trace = Arc::new(TraceWriter::new("sb", None).unwrap());
        let sink = Arc::new(EventSink::new().unwrap());
        let values = Arc::new(Mutex::new(Vec::new()));
        let start = Arc::new(AtomicU64::new(monotonic_ns()));
        let mut p = AgentPort::new(start, 0x1234, trace.clone(), sink.clone(), values.clone());
        p.write(0, &[EV_BOOT]);
        p.write(0, &[EV_VF_DRIVER_START]);
        p.write(0, &[EV_APP_LAUNCH_START]);
        p.write(0, &[EV_VF_DRIVER_END]);
        p.write(4, &0x1234u32.to_le_bytes());
        p.write(0, &[EV_APP_LAUNCH_END]);
        p.write(4, &7u32.to_le_bytes());
        p.write(0, &[EV_VALUE]);
        p.write(0, &[EV_READY]);
        p.write(0, &[EV_READY]);
        p.write(0, &[0x77]);
        let stages: Vec<Stage> = trace.events().iter().map(|e| e.stage).collect();
        assert_eq!(
            stages,
            [Stage::Boot, Stage::VfDriver, Stage::AppLaunch, Stage::Ready]
        );
        let ev = trace.events();
        // ready starts at the later of app-launch end and vf-driver end.
        assert_eq!(ev[3].start_ns, ev[2].end_ns.max(ev[1].end_ns));
        assert!(ev.windows(2).all(|w| w[0].end_ns <= w[1].end_ns));
        assert_eq!(sink.drain(), vec![VmEvent::Ready]);
        assert_eq!(*values.lock().unwrap(), vec![7]);
    }

    #[test]
    fn link_wait_is_its_own_stage_before_ready() {
        let trace = Arc::new(TraceWriter::new("sb", None).unwrap());
        let sink = Arc::new(EventSink::new().unwrap());
        let start = Arc::new(AtomicU64::new(monotonic_ns()));
        let mut p = AgentPort::new(start, 0, trace.clone(), sink, Arc::default());
        for ev in [
            EV_BOOT,
            EV_VF_DRIVER_START,
            EV_VF_DRIVER_END,
            EV_APP_LAUNCH_START,
            EV_APP_LAUNCH_END,
            EV_VF_LINK_UP,
            EV_READY,
        ] {
            p.write(0, &[ev]);
        }
        let ev = trace.events();
        let stages: Vec<Stage> = ev.iter().map(|e| e.stage).collect();
        assert_eq!(
            stages,
            [
                Stage::Boot,
                Stage::VfDriver,
                Stage::AppLaunch,
                Stage::VfLink,
                Stage::Ready
            ]
        );
        // vf-link runs from the app-launch end; ready from the link.
        assert_eq!(ev[3].start_ns, ev[2].end_ns);
        assert_eq!(ev[4].start_ns, ev[3].end_ns);
    }

    /// The Linux guest agent's order: boot, root mounted, network, READY
    /// (listening), then the container's exec (app-launch, after READY).
    #[test]
    fn linux_agent_stages() {
        let trace = Arc::new(TraceWriter::new("sb", None).unwrap());
        let sink = Arc::new(EventSink::new().unwrap());
        let start = Arc::new(AtomicU64::new(monotonic_ns()));
        let mut p = AgentPort::new(start, 0, trace.clone(), sink.clone(), Arc::default());
        for ev in [
            EV_BOOT,
            EV_ROOTFS_MOUNTED,
            EV_NET_CONFIGURED,
            EV_READY,
            EV_APP_LAUNCH_START,
            EV_APP_LAUNCH_END,
        ] {
            p.write(0, &[ev]);
        }
        let ev = trace.events();
        let stages: Vec<Stage> = ev.iter().map(|e| e.stage).collect();
        assert_eq!(
            stages,
            [
                Stage::Boot,
                Stage::RootfsMount,
                Stage::NetConfig,
                Stage::Ready,
                Stage::AppLaunch
            ]
        );
        // Each boot step starts where the one before ended; the exec starts
        // at its own START event, after READY.
        assert!(ev[..4].windows(2).all(|w| w[1].start_ns == w[0].end_ns));
        assert!(ev[4].start_ns >= ev[3].end_ns);
        // DATA 0 is the checksum of no payload: no failure.
        assert_eq!(sink.drain(), vec![VmEvent::Ready]);
    }

    #[test]
    fn rootfs_reports_are_checked() {
        let trace = Arc::new(TraceWriter::new("sb", None).unwrap());
        let sink = Arc::new(EventSink::new().unwrap());
        let port = || {
            let start = Arc::new(AtomicU64::new(1));
            AgentPort::new(start, 0, trace.clone(), sink.clone(), Arc::default()).with_rootfs(
                RootfsExpect {
                    file: Some(("/etc/os-release".into(), 0x42)),
                    marker: true,
                },
            )
        };
        let mut p = port();
        p.write(4, &0x42u32.to_le_bytes());
        p.write(0, &[EV_ROOTFS_FILE]);
        p.write(4, &0u32.to_le_bytes());
        p.write(0, &[EV_ROOTFS_MARKER]);
        p.write(0, &[EV_APP_LAUNCH_END]);
        assert_eq!(sink.drain(), vec![]);
        // Wrong file checksum, another sandbox's marker, and missing reports.
        let mut p = port();
        p.write(4, &0x43u32.to_le_bytes());
        p.write(0, &[EV_ROOTFS_FILE]);
        p.write(0, &[EV_ROOTFS_MARKER]);
        assert_eq!(
            sink.drain(),
            vec![
                VmEvent::Failure(GuestFailure::RootfsChecksum {
                    file: "/etc/os-release".into(),
                    expected: 0x42,
                    got: 0x43
                }),
                VmEvent::Failure(GuestFailure::WritableLayerNotFresh { got: 0x43 }),
            ]
        );
        let mut p = port();
        p.write(4, &0u32.to_le_bytes());
        p.write(0, &[EV_APP_LAUNCH_END]);
        assert_eq!(sink.drain().len(), 2);
    }

    #[test]
    fn checksum_mismatch_and_error_are_reported() {
        let trace = Arc::new(TraceWriter::new("sb", None).unwrap());
        let sink = Arc::new(EventSink::new().unwrap());
        let start = Arc::new(AtomicU64::new(1));
        let mut p = AgentPort::new(start, 5, trace, sink.clone(), Arc::default());
        p.write(4, &6u32.to_le_bytes());
        p.write(0, &[EV_APP_LAUNCH_END]);
        p.write(4, &3u32.to_le_bytes());
        p.write(0, &[EV_ERROR]);
        assert_eq!(
            sink.drain(),
            vec![
                VmEvent::Failure(GuestFailure::AppChecksum {
                    expected: 5,
                    got: 6
                }),
                VmEvent::Failure(GuestFailure::AgentError { code: 3 }),
            ]
        );
    }

    #[test]
    fn sg_reports_are_checked_and_required_before_ready() {
        let trace = Arc::new(TraceWriter::new("sb", None).unwrap());
        let sink = Arc::new(EventSink::new().unwrap());
        let start = Arc::new(AtomicU64::new(1));
        let expect = SgExpect {
            pipes: 64,
            checksum: 0xabcd,
        };
        let mut p = AgentPort::new(
            start.clone(),
            0,
            trace.clone(),
            sink.clone(),
            Arc::default(),
        )
        .with_sg(Some(expect));
        p.write(4, &64u32.to_le_bytes());
        p.write(0, &[EV_SG_PIPES]);
        p.write(4, &0xabcdu32.to_le_bytes());
        p.write(0, &[EV_SG_CSUM]);
        p.write(0, &[EV_READY]);
        assert_eq!(sink.drain(), vec![VmEvent::Ready]);

        let mut p =
            AgentPort::new(start, 0, trace, sink.clone(), Arc::default()).with_sg(Some(expect));
        p.write(4, &63u32.to_le_bytes());
        p.write(0, &[EV_SG_PIPES]);
        p.write(0, &[EV_READY]);
        assert_eq!(
            sink.drain(),
            vec![
                VmEvent::Failure(GuestFailure::SgReport {
                    what: "pipe count",
                    expected: 64,
                    got: Some(63)
                }),
                VmEvent::Failure(GuestFailure::SgReport {
                    what: "checksum",
                    expected: 0xabcd,
                    got: None
                }),
                VmEvent::Ready,
            ]
        );
    }
}
