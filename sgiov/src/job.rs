//! Job descriptors: all an executor ever sees (§6.2). A job names an
//! operation, its source and destination bytes (memory, address, length), a
//! key slot and a sequence number; it never refers to a pipe.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::mem::Memory;

/// What a job does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// `src` → `dst`, same length (full copy through the daemon).
    Copy,
    /// `src` in one guest → `dst` in another in one copy (the zero-copy
    /// delegate: no staging hop). Same as `Copy` for the executor; counted apart.
    Direct,
    /// `src` plaintext → `dst` one record: header, ciphertext, tag, padding.
    Encrypt,
    /// `src` one record → `dst` plaintext (or in place, see [`crate::exec`]).
    Decrypt,
    /// Writes a padding record filling `dst` (the bytes before a sink ring's end
    /// that are too few for a record).
    Pad,
    /// Moves no bytes: consumes a padding record from the source.
    Skip,
}

/// Executor classes: the resources DRF shares and capacities limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Class {
    Copy = 0,
    Crypto = 1,
}

pub const NCLASSES: usize = 2;
pub const CLASSES: [Class; NCLASSES] = [Class::Copy, Class::Crypto];

impl Class {
    pub fn index(self) -> usize {
        self as usize
    }

    pub fn name(self) -> &'static str {
        match self {
            Class::Copy => "copy",
            Class::Crypto => "crypto",
        }
    }
}

impl fmt::Display for Class {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for Class {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "copy" => Ok(Class::Copy),
            "crypto" => Ok(Class::Crypto),
            _ => Err(format!("unknown executor class {s:?} (copy, crypto)")),
        }
    }
}

impl Op {
    pub fn class(self) -> Class {
        match self {
            Op::Encrypt | Op::Decrypt => Class::Crypto,
            _ => Class::Copy,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Op::Copy => "copy",
            Op::Direct => "direct",
            Op::Encrypt => "encrypt",
            Op::Decrypt => "decrypt",
            Op::Pad => "pad",
            Op::Skip => "skip",
        }
    }
}

/// Bytes in one memory.
#[derive(Clone)]
pub struct Buf {
    pub mem: Arc<dyn Memory>,
    pub addr: u64,
    pub len: u32,
}

impl Buf {
    /// Same memory and same address (an in-place operation).
    pub fn same_place(&self, other: &Buf, delta: u64) -> bool {
        std::ptr::addr_eq(Arc::as_ptr(&self.mem), Arc::as_ptr(&other.mem))
            && self.addr.checked_add(delta) == Some(other.addr)
    }
}

impl fmt::Debug for Buf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{:#x}+{}", self.mem.name(), self.addr, self.len)
    }
}

/// One job, as the executor sees it.
#[derive(Clone, Debug)]
pub struct JobDesc {
    pub op: Op,
    pub src: Option<Buf>,
    pub dst: Option<Buf>,
    pub key_slot: u16,
    pub seq: u64,
}

impl JobDesc {
    /// Bytes of input the job processes (what capacities and DRF charge).
    pub fn cost(&self) -> u64 {
        match self.op {
            // A padding record writes its 16-byte header only.
            Op::Pad => 16,
            Op::Skip => 0,
            _ => self.src.as_ref().map_or(0, |s| s.len as u64),
        }
    }
}
