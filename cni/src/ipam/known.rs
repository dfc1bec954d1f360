//! What the lease files of each network directory held when this process
//! last read them, so that a long-lived process (the NIC daemon's CNI
//! server) reads, in an ADD's one-lease-per-attachment check, only the files
//! that are new since: host-local reads every lease on every ADD, which in a
//! burst of N attachments is O(N) opens per ADD.
//!
//! Why a name and inode number are enough: a lease file is created and
//! written once, under the store's lock (host-local does the same), and
//! removed when released, never rewritten; a file with the inode it had when
//! it was read still holds that text. Some filesystems reuse an inode number
//! after a removal, so a lease this finds for an owner is read again before
//! it is believed (`Store::owned_by`), and releases never use it.

use std::collections::HashMap;
use std::sync::Mutex;

/// Most directories remembered (runtimes come and go under one daemon);
/// past it the memory starts over.
const MAX_DIRS: usize = 64;

/// A directory's lease files: name → (inode, text).
pub(super) type Files = HashMap<Vec<u8>, (u64, String)>;

/// By directory (device, inode).
static KNOWN: Mutex<Option<HashMap<(u64, u64), Files>>> = Mutex::new(None);

/// Takes what is known of `dir`'s files (empty if nothing): a listing
/// works on it without the lock, under the directory's own (`Store`).
pub(super) fn take(dir: (u64, u64)) -> Files {
    let mut k = KNOWN.lock().unwrap_or_else(|p| p.into_inner());
    k.as_mut().and_then(|m| m.remove(&dir)).unwrap_or_default()
}

/// Stores what a listing of `dir` read.
pub(super) fn put(dir: (u64, u64), files: Files) {
    let mut k = KNOWN.lock().unwrap_or_else(|p| p.into_inner());
    let m = k.get_or_insert_with(HashMap::new);
    if m.len() >= MAX_DIRS && !m.contains_key(&dir) {
        m.clear();
    }
    m.insert(dir, files);
}
