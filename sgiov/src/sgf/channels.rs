//! The `dedicated` mode of one SGF (the SR-IOV model): a signal channel
//! per pipe instead of the one Cross-FIFO, checked when a socket opens it
//! and polled one by one each round (the O(pipes) scan the SG model avoids).

use super::*;

impl Sgf {
    /// `dedicated` mode: one polling round over every channel (the SR-IOV
    /// model's O(pipes) scan, counted). A word is valid only for its own
    /// pipe's two rings: any other id is forged, counted, and puts that
    /// pipe (its TX ring) into error; a corrupt channel FIFO does the same.
    /// Returns whether words raced in after the channels were re-armed.
    pub(super) fn consume_channels(&mut self, out: &mut Vec<Inbound>) -> bool {
        let Some((_, _, plane)) = self.chans.as_mut() else {
            return false;
        };
        let (mut words, mut bad) = (Vec::new(), Vec::new());
        let before = plane.scanned();
        let again = plane.poll(&mut words, &mut bad);
        self.stats.chan_scanned += plane.scanned() - before;
        self.stats.signals_in += words.len() as u64;
        let owners: Vec<Option<(RingId, bool)>> = words
            .iter()
            .map(|(k, w)| {
                let c = plane.get(*k)?;
                Some((c.tx, w.decode().is_ok_and(|s| c.owns(s.ring))))
            })
            .collect();
        // A guest that found its channel full waits for a notification.
        let mut waiting: Vec<u16> = words
            .iter()
            .map(|(k, _)| *k)
            .filter(|k| plane.producer_backlog(*k))
            .collect();
        waiting.dedup();
        self.chan_irqs.extend(waiting);
        for ((_, w), owner) in words.into_iter().zip(owners) {
            match owner {
                None => {}
                Some((tx, false)) => {
                    if w.decode().is_err() {
                        self.stats.bad_signals += 1;
                    } else {
                        self.stats.chan_forged += 1;
                        out.push(self.ring_error(tx, ErrorCode::BadRing));
                    }
                }
                Some((_, true)) => {
                    if let Some(i) = self.inbound(w) {
                        out.push(i);
                    }
                }
            }
        }
        for k in bad {
            let tx = self
                .chans
                .as_ref()
                .and_then(|(_, _, p)| p.get(k))
                .map(|c| c.tx);
            // The channel is dropped (its range stays taken until CLOSE);
            // the pipe's words go over the Cross-FIFO from now on.
            if let Some((_, _, p)) = self.chans.as_mut() {
                p.remove(k);
            }
            if let Some(tx) = tx {
                out.push(self.ring_error(tx, ErrorCode::FifoCorrupt));
            }
        }
        again
    }

    /// Turns on the `dedicated` mode (ATTACH with channels): channel k of
    /// `entries` slots per FIFO lies at `gpa + k * channel_bytes(entries)`.
    /// Each channel is checked when a socket opens it.
    pub fn enable_channels(&mut self, gpa: u64, entries: u32) -> Result<(), SgfError> {
        let fifo = limits::MIN_FIFO_ENTRIES..=limits::MAX_FIFO_ENTRIES;
        if !entries.is_power_of_two() || !fifo.contains(&entries) || !gpa.is_multiple_of(64) {
            return Err(SgfError::BadArea {
                sgf: self.name.clone(),
                gpa,
                what:
                    "channel array: FIFO slots not a power of two 64..65536, or not 64-byte aligned",
            });
        }
        self.chans = Some((gpa, entries, DedicatedPlane::new()));
        Ok(())
    }

    /// OPEN with a channel: checks that channel `k` lies in guest memory
    /// and overlaps nothing the SGF uses (area, rings, other channels),
    /// then takes over its device-owned fields for the pipe `tx`/`rx`.
    pub fn open_channel(&mut self, k: u16, tx: RingId, rx: RingId) -> Result<(), ErrorCode> {
        let Some((gpa, entries, plane)) = self.chans.as_mut() else {
            return Err(ErrorCode::BadRequest);
        };
        if k as usize >= dedicated::MAX_CHANNELS {
            return Err(ErrorCode::BadRequest);
        }
        if plane.contains(k) {
            return Err(ErrorCode::Busy);
        }
        let bytes = dedicated::channel_bytes(*entries);
        let at = gpa
            .checked_add(k as u64 * bytes)
            .filter(|a| a.checked_add(bytes).is_some())
            .ok_or(ErrorCode::BadRing)?;
        if self.mem.slice(at, bytes as usize).is_none() {
            return Err(ErrorCode::BadRing);
        }
        let label = format!("SGF {} channel {k}", self.name);
        self.ranges
            .insert(at, at + bytes, label)
            .map_err(|_| ErrorCode::Overlap)?;
        let c = self
            .mem
            .prepare(at, bytes)
            .map_err(|_| ErrorCode::Memory)
            .and_then(|_| {
                Channel::new(self.mem.clone(), at, *entries, tx, rx).map_err(|e| e.code())
            });
        match c {
            Ok(c) => {
                plane.insert(k, c);
                Ok(())
            }
            Err(e) => {
                self.ranges.remove(at);
                Err(e)
            }
        }
    }

    /// Releases channel `k` (a refused OPEN, or its socket's rings gone).
    pub fn close_channel(&mut self, k: u16) {
        if let Some((gpa, entries, plane)) = self.chans.as_mut() {
            plane.remove(k);
            self.ranges
                .remove(*gpa + k as u64 * dedicated::channel_bytes(*entries));
        }
    }

    /// The two rings of an opened socket signal over channel `k`.
    pub fn bind_channel(&mut self, k: u16, tx: RingId, rx: RingId) {
        for r in [tx, rx] {
            if let Some(r) = self.rings.get_mut(&r) {
                r.chan = Some(k);
            }
        }
    }

    /// Open channels (`dedicated` mode).
    pub fn channels(&self) -> usize {
        self.chans.as_ref().map_or(0, |(_, _, p)| p.len())
    }

    /// The channels whose guests must be interrupted (their call eventfds).
    pub fn take_channel_irqs(&mut self) -> Vec<u16> {
        let mut v = std::mem::take(&mut self.chan_irqs);
        v.sort_unstable();
        v.dedup();
        v
    }
}
