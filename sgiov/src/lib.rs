//! SG-IOV core (socket-granular I/O virtualization, ASPLOS'26): the pure,
//! device-independent part of burstvm's SG functions. See docs/sgiov.md.

pub mod dedicated;
pub mod device;
pub mod driver;
pub mod engine;
pub mod exec;
pub mod fifo;
pub mod job;
pub mod jobgen;
pub mod lat;
pub mod layout;
pub mod links;
pub mod mem;
pub mod ring;
pub mod sched;
pub mod sgf;
pub mod signal;
