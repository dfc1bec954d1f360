//! Log2 histograms for the signal plane's latency counters (round length,
//! priority signal to dispatch, queue depth). Cumulative, so a reader takes
//! the difference of two snapshots ([`Hist::since`]) and reads quantiles
//! from it; bucket `b` holds values in `[2^(b-1), 2^b)` (bucket 0: zero).

use std::sync::atomic::{AtomicU64, Ordering};

pub const BUCKETS: usize = 28;

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Hist(pub [u64; BUCKETS]);

fn bucket(v: u64) -> usize {
    ((64 - v.leading_zeros()) as usize).min(BUCKETS - 1)
}

impl Hist {
    pub fn add(&mut self, v: u64) {
        self.0[bucket(v)] += 1;
    }

    pub fn count(&self) -> u64 {
        self.0.iter().sum()
    }

    /// What was added after `earlier` (a snapshot of the same counter).
    pub fn since(&self, earlier: &Hist) -> Hist {
        Hist(std::array::from_fn(|i| {
            self.0[i].saturating_sub(earlier.0[i])
        }))
    }

    /// Upper bound of the bucket holding quantile `q` (0..=1): the true
    /// value is at most this and more than half of it. 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        let n = self.count();
        if n == 0 {
            return 0;
        }
        let rank = ((q.clamp(0.0, 1.0) * n as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (b, &c) in self.0.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return if b == 0 { 0 } else { (1u64 << b) - 1 };
            }
        }
        u64::MAX
    }

    /// The largest non-empty bucket's upper bound.
    pub fn max(&self) -> u64 {
        self.quantile(1.0)
    }
}

/// A [`Hist`] the executor threads add to without a lock.
#[derive(Debug, Default)]
pub struct AtomicHist([AtomicU64; BUCKETS]);

impl AtomicHist {
    pub fn add(&self, v: u64) {
        self.0[bucket(v)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> Hist {
        Hist(std::array::from_fn(|i| self.0[i].load(Ordering::Relaxed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_quantiles_and_differences() {
        let mut h = Hist::default();
        assert_eq!(h.quantile(0.99), 0);
        for v in [0, 1, 2, 3, 100, 1000] {
            h.add(v);
        }
        assert_eq!(h.count(), 6);
        assert_eq!(h.quantile(0.0), 0);
        assert_eq!(h.quantile(0.5), 3);
        assert_eq!(h.max(), 1023);
        let before = h;
        h.add(u64::MAX);
        let d = h.since(&before);
        assert_eq!((d.count(), d.max()), (1, (1 << (BUCKETS - 1)) - 1));
        let a = AtomicHist::default();
        a.add(5);
        a.add(6);
        assert_eq!(a.snapshot().quantile(1.0), 7);
    }
}
