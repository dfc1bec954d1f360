//! How long a dataplane thread keeps polling after its last work before it sleeps, adapted
//! as KVM adapts its halt polling (`grow_halt_poll_ns` / `shrink_halt_poll_ns`): what
//! matters is the length of each idle period, from the last work to the next.
//!
//! - shorter than the window: polling caught the work, the window stays;
//! - longer than the ceiling: no window could have caught it, the window halves (and is
//!   zero once below `START`: the thread sleeps as soon as a round finds nothing);
//! - in between: the window was too short, it doubles (from `START`).
//!
//! Streaming traffic keeps the window at the ceiling, so a busy VF is served by polling as
//! before; a burst of sandbox starts (a few frames per guest, milliseconds apart, hundreds of
//! mostly idle VFs making each round dearer) brings it to zero, so the thread no longer
//! spins after each wake-up for work that comes much later.

use std::time::Duration;

#[derive(Debug, Clone, Copy)]
pub struct SpinWindow {
    now: Duration,
}

impl SpinWindow {
    /// Where a growing window starts (KVM's `halt_poll_ns_grow_start`).
    pub const START: Duration = Duration::from_micros(10);
    /// The ceiling: a spin's cost grows with the PF's VFs (every round looks at each
    /// unparked one).
    pub const MAX: Duration = Duration::from_micros(50);

    /// At the ceiling: polling as the dataplane always did until the traffic says otherwise.
    pub fn new() -> SpinWindow {
        SpinWindow { now: Self::MAX }
    }

    /// How long to poll an idle thread before it sleeps.
    pub fn window(&self) -> Duration {
        self.now
    }

    /// Work came after an idle period this long (polled and slept).
    pub fn idle_ended(&mut self, idle: Duration) {
        if idle <= self.now {
            return;
        }
        self.now = if idle > Self::MAX {
            let half = self.now / 2;
            if half < Self::START {
                Duration::ZERO
            } else {
                half
            }
        } else {
            (self.now * 2).clamp(Self::START, Self::MAX)
        };
    }
}

impl Default for SpinWindow {
    fn default() -> Self {
        SpinWindow::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const US: Duration = Duration::from_micros(1);

    #[test]
    fn idle_periods_longer_than_the_ceiling_bring_the_window_to_zero() {
        let mut w = SpinWindow::new();
        let mut seen = vec![w.window()];
        for _ in 0..4 {
            w.idle_ended(2 * SpinWindow::MAX);
            seen.push(w.window());
        }
        assert_eq!(
            seen,
            [
                50 * US,
                25 * US,
                Duration::from_nanos(12_500),
                Duration::ZERO,
                Duration::ZERO
            ]
        );
    }

    #[test]
    fn caught_work_keeps_the_window_and_near_misses_grow_it_to_the_ceiling() {
        let mut w = SpinWindow::new();
        w.idle_ended(40 * US);
        assert_eq!(w.window(), SpinWindow::MAX, "caught: unchanged");
        for _ in 0..4 {
            w.idle_ended(SpinWindow::MAX * 3);
        }
        assert_eq!(w.window(), Duration::ZERO);
        // Work 30 µs after the last: the window was too short, it grows from START.
        w.idle_ended(30 * US);
        assert_eq!(w.window(), SpinWindow::START);
        w.idle_ended(30 * US);
        assert_eq!(w.window(), 20 * US);
        w.idle_ended(30 * US);
        assert_eq!(w.window(), 40 * US);
        w.idle_ended(45 * US);
        assert_eq!(w.window(), SpinWindow::MAX, "capped");
        w.idle_ended(5 * US);
        assert_eq!(w.window(), SpinWindow::MAX);
    }
}
