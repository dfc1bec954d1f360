//! Optional capacity limits per executor class (`copy=400M,crypto=160M`),
//! as token buckets, so that scheduling policies can be measured on a small
//! machine without its cores being the bottleneck: each class then behaves
//! like an engine of that bandwidth.

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use crate::job::{Class, CLASSES, NCLASSES};

const MIB: f64 = (1u64 << 20) as f64;

/// Bytes per second per class; `None` = unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Capacities(pub [Option<f64>; NCLASSES]);

impl Capacities {
    pub fn get(&self, c: Class) -> Option<f64> {
        self.0[c.index()]
    }

    pub fn unlimited() -> Self {
        Capacities([None; NCLASSES])
    }

    /// The capacities DRF normalizes shares by: the limit, or 1 GB/s for
    /// an unlimited class.
    pub fn nominal(&self) -> [f64; NCLASSES] {
        std::array::from_fn(|j| self.0[j].unwrap_or(1e9))
    }
}

/// Parses a rate in bytes per second with guestmem's size syntax
/// (`64K`, `400M`, `2G`: binary multiples, so `400M` is 400 MiB/s).
pub fn parse_rate(s: &str) -> Result<f64, String> {
    guestmem::parse_bytes(s)
        .filter(|v| *v > 0)
        .map(|v| v as f64)
        .ok_or_else(|| format!("bad rate {s:?} (bytes per second: 400M, 2G)"))
}

impl FromStr for Capacities {
    type Err = String;
    /// `copy=400M,crypto=160M`; `none` or an empty string for no limits.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut c = Capacities::unlimited();
        if s.trim().is_empty() || s.trim() == "none" {
            return Ok(c);
        }
        for part in s.split(',') {
            let (k, v) = part
                .split_once('=')
                .ok_or_else(|| format!("capacity {part:?}: expected CLASS=RATE"))?;
            let class: Class = k.trim().parse()?;
            c.0[class.index()] = Some(parse_rate(v)?);
        }
        Ok(c)
    }
}

impl fmt::Display for Capacities {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<_> = CLASSES
            .iter()
            .filter_map(|c| self.get(*c).map(|r| format!("{}={}M", c.name(), r / MIB)))
            .collect();
        if parts.is_empty() {
            f.write_str("none")
        } else {
            f.write_str(&parts.join(","))
        }
    }
}

/// A token bucket: a job may start while the bucket is not in debt; it then
/// takes its whole cost (possibly going into debt), so the long-run rate
/// equals the capacity whatever the job sizes.
#[derive(Debug, Clone)]
pub struct TokenBucket {
    rate: Option<f64>,
    tokens: f64,
    burst: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(rate: Option<f64>, now: Instant) -> Self {
        TokenBucket {
            rate,
            tokens: 0.0,
            // A few milliseconds of burst: enough to keep an engine busy
            // between refills, too little to distort shares.
            burst: rate.map_or(0.0, |r| r * 0.002),
            last: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        if let Some(r) = self.rate {
            let dt = now.saturating_duration_since(self.last).as_secs_f64();
            self.tokens = (self.tokens + r * dt).min(self.burst);
        }
        self.last = now;
    }

    /// Whether a job may start now.
    pub fn ready(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.rate.is_none() || self.tokens >= 0.0
    }

    pub fn take(&mut self, cost: u64) {
        if self.rate.is_some() {
            self.tokens -= cost as f64;
        }
    }

    /// How long until a job may start (zero if it may now).
    pub fn wait(&self) -> Duration {
        match self.rate {
            Some(r) if self.tokens < 0.0 => Duration::from_secs_f64(-self.tokens / r),
            _ => Duration::ZERO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_specs() {
        let c: Capacities = "copy=400M,crypto=160M".parse().unwrap();
        assert_eq!(c.get(Class::Copy), Some(400.0 * MIB));
        assert_eq!(c.get(Class::Crypto), Some(160.0 * MIB));
        assert_eq!(c.to_string(), "copy=400M,crypto=160M");
        let c: Capacities = "crypto=2G".parse().unwrap();
        assert_eq!(c.get(Class::Copy), None);
        assert_eq!(
            "none".parse::<Capacities>().unwrap(),
            Capacities::unlimited()
        );
        assert!("dma=1M".parse::<Capacities>().is_err());
        assert!("copy=0".parse::<Capacities>().is_err());
        assert!("copy".parse::<Capacities>().is_err());
        assert_eq!(parse_rate("64K").unwrap(), 65536.0);
    }

    #[test]
    fn bucket_paces_to_its_rate() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(Some(1e6), t0);
        assert!(b.ready(t0));
        b.take(100_000);
        assert!(!b.ready(t0));
        assert!((b.wait().as_secs_f64() - 0.1).abs() < 1e-9);
        assert!(b.ready(t0 + Duration::from_millis(100)));
        let mut u = TokenBucket::new(None, t0);
        u.take(1 << 40);
        assert!(u.ready(t0));
    }
}
