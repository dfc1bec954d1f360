//! 16550 UART on 0x3f8 (vm-superio), IRQ 4 through an irqfd.

use std::io::Write;

use vm_superio::{Serial, Trigger};
use vmm_sys_util::eventfd::EventFd;

use crate::bus::BusDevice;

/// Raises the serial IRQ by writing the eventfd registered as irqfd.
pub struct IrqTrigger(pub EventFd);

impl Trigger for IrqTrigger {
    type E = std::io::Error;
    fn trigger(&self) -> Result<(), Self::E> {
        self.0.write(1)
    }
}

pub struct SerialDevice {
    uart: Serial<IrqTrigger, vm_superio::serial::NoEvents, Box<dyn Write + Send>>,
}

impl SerialDevice {
    pub fn new(irq: EventFd, out: Box<dyn Write + Send>) -> Self {
        SerialDevice {
            uart: Serial::new(IrqTrigger(irq), out),
        }
    }
}

impl BusDevice for SerialDevice {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        if let Some(b) = data.first_mut() {
            *b = self.uart.read(offset as u8);
        }
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Some(&b) = data.first() {
            // An output error (closed stdout) must not stop the guest.
            if let Err(e) = self.uart.write(offset as u8, b) {
                tracing::debug!("serial write: {e:?}");
            }
        }
    }
}
