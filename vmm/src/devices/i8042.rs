//! The one thing of the i8042 keyboard controller a guest needs here: the
//! reset command (0xFE to port 0x64), which Linux's `reboot=k` (after a
//! panic, too) uses. As on Firecracker it ends the VM with status 0 (a
//! microVM does not reboot) instead of the guest running on from the reset
//! vector until the timeout; the runtime still sees no READY.

use std::sync::Arc;

use crate::bus::BusDevice;
use crate::events::{EventSink, VmEvent};

pub const I8042_PORT: u64 = 0x60;
pub const I8042_LEN: u64 = 5;
const COMMAND: u64 = 4; // port 0x64
const CMD_RESET: u8 = 0xfe;

pub struct I8042 {
    sink: Arc<EventSink>,
}

impl I8042 {
    pub fn new(sink: Arc<EventSink>) -> Self {
        I8042 { sink }
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        // No controller behind it: a floating bus, as for any unclaimed port.
        data.fill(0xff);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset == COMMAND && data.first() == Some(&CMD_RESET) {
            self.sink.post(VmEvent::Reset);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_ends_the_vm() {
        let sink = Arc::new(EventSink::new().unwrap());
        let mut d = I8042::new(sink.clone());
        d.write(0, &[0xfe]);
        d.write(COMMAND, &[0xd1]);
        assert!(sink.drain().is_empty());
        d.write(COMMAND, &[CMD_RESET]);
        assert_eq!(sink.drain(), vec![VmEvent::Reset]);
    }
}
