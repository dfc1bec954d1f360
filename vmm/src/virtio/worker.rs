//! The device worker thread model: one thread per running device, asleep in
//! epoll on the device's fds (queue ioeventfds, a tap, ...) and a stop
//! eventfd. Dropping the `Worker` stops and joins the thread, so a device
//! reset or teardown never leaves a thread touching guest memory.

use std::os::fd::{AsRawFd, RawFd};
use std::thread::JoinHandle;

use virtio_queue::{Queue, QueueT};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::chain::PrepareWrite;
use super::VirtioError;

/// The epoll token of the stop eventfd; the body returns when it sees it.
pub const STOP_TOKEN: u64 = u64::MAX;

/// A worker thread that could not be set up: the step and its cause.
#[derive(Debug, thiserror::Error)]
#[error("{what}: {source}")]
pub struct WorkerError {
    pub what: &'static str,
    #[source]
    pub source: std::io::Error,
}

impl WorkerError {
    fn at(what: &'static str) -> impl FnOnce(std::io::Error) -> WorkerError {
        move |source| WorkerError { what, source }
    }
}

#[derive(Debug)]
pub struct Worker {
    stop: EventFd,
    handle: Option<JoinHandle<()>>,
}

impl Worker {
    /// Spawns thread `name` running `body(epoll)`; `fds` (fd, token) and the
    /// stop eventfd ([`STOP_TOKEN`]) are registered for input. The caller wraps
    /// an error with the device's name.
    pub fn spawn<F>(name: String, fds: &[(RawFd, u64)], body: F) -> Result<Worker, WorkerError>
    where
        F: FnOnce(Epoll) + Send + 'static,
    {
        let stop = EventFd::new(EFD_NONBLOCK).map_err(WorkerError::at("eventfd"))?;
        let stop2 = stop.try_clone().map_err(WorkerError::at("eventfd"))?;
        let epoll = Epoll::new().map_err(WorkerError::at("epoll"))?;
        for &(fd, token) in fds.iter().chain([&(stop2.as_raw_fd(), STOP_TOKEN)]) {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, token),
                )
                .map_err(WorkerError::at("epoll add"))?;
        }
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                // The stop eventfd stays open while the body runs: epoll watches it.
                let _stop = stop2;
                body(epoll)
            })
            .map_err(WorkerError::at("spawn worker"))?;
        Ok(Worker {
            stop,
            handle: Some(handle),
        })
    }
}

/// What a device with one request queue (virtio-blk, virtio-rng) needs at
/// DRIVER_OK: the queue, which must be ready, with its used ring prepared
/// for the device's writes (lazy zeroing), and the worker's copy of the
/// queue's eventfd. Errors name `device`.
pub fn take_request_queue(
    device: &str,
    queues: Vec<Queue>,
    prepare: &PrepareWrite,
    queue_evt: &EventFd,
) -> Result<(Queue, EventFd), VirtioError> {
    let Some(queue) = queues.into_iter().next().filter(|q| q.ready()) else {
        return Err(VirtioError::QueuesNotReady {
            device: device.to_string(),
            need: "request queue",
        });
    };
    prepare(queue.used_ring(), 6 + 8 * u64::from(queue.size())).map_err(|source| {
        VirtioError::UsedRing {
            device: device.to_string(),
            source,
        }
    })?;
    let evt = queue_evt
        .try_clone()
        .map_err(|source| VirtioError::DupEventFd {
            device: device.to_string(),
            source,
        })?;
    Ok((queue, evt))
}

/// The body of a one-queue device's worker: `process` once (requests may
/// have been queued before the worker started), then after every
/// notification on `evt`, until the stop eventfd fires (or epoll fails,
/// logged naming `device`).
pub fn serve_notifications(epoll: &Epoll, evt: &EventFd, device: &str, mut process: impl FnMut()) {
    let mut events = [EpollEvent::default(); 4];
    process();
    loop {
        let n = match epoll.wait(-1, &mut events) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("{device}: epoll wait: {e}");
                return;
            }
        };
        for ev in &events[..n] {
            if ev.data() == STOP_TOKEN {
                return;
            }
            let _ = evt.read();
            process();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.stop.write(1);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
