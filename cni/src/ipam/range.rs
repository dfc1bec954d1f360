//! Address ranges as the reference `host-local` IPAM plugin defines them
//! (plugins/ipam/host-local/backend/allocator, v1.9.1): a range is a subnet
//! with an inclusive `rangeStart`..`rangeEnd` and a gateway; a range set is
//! ranges of one family, and an ADD takes one address from each set.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde_json::Value;

use crate::error::PluginError;
use netutil::IpNet;

/// One range, canonical: the subnet is its network address, start and end
/// lie in it with start ≤ end, every address is of the subnet's family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Range {
    pub subnet: IpNet,
    pub start: IpAddr,
    pub end: IpAddr,
    pub gateway: IpAddr,
}

fn bits(a: IpAddr) -> u32 {
    if a.is_ipv4() {
        32
    } else {
        128
    }
}

fn to_int(a: IpAddr) -> u128 {
    match a {
        IpAddr::V4(a) => u32::from(a) as u128,
        IpAddr::V6(a) => u128::from(a),
    }
}

fn from_int(v: u128, v4: bool) -> IpAddr {
    if v4 {
        IpAddr::V4(Ipv4Addr::from(v as u32))
    } else {
        IpAddr::V6(Ipv6Addr::from(v))
    }
}

/// The address after `a` (callers stay inside a subnet, so it never wraps).
fn next(a: IpAddr) -> IpAddr {
    from_int(to_int(a).wrapping_add(1), a.is_ipv4())
}

fn host_mask(subnet: &IpNet) -> u128 {
    let host_bits = bits(subnet.addr) - subnet.prefix as u32;
    if host_bits == 128 {
        u128::MAX
    } else {
        (1u128 << host_bits) - 1
    }
}

/// An address as host-local canonicalizes it: an IPv4-mapped IPv6 address
/// is the IPv4 address.
pub fn canonical(a: IpAddr) -> IpAddr {
    a.to_canonical()
}

fn in_subnet(subnet: &IpNet, a: IpAddr) -> bool {
    a.is_ipv4() == subnet.addr.is_ipv4() && to_int(a) & !host_mask(subnet) == to_int(subnet.addr)
}

fn addr_field(
    o: &serde_json::Map<String, Value>,
    key: &str,
    field: &str,
) -> Result<Option<IpAddr>, PluginError> {
    match o.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if s.is_empty() => Ok(None),
        Some(Value::String(s)) => s
            .parse::<IpAddr>()
            .map(|a| Some(canonical(a)))
            .map_err(|e| PluginError::invalid_config_caused(&format!("{field}.{key}"), e)),
        Some(other) => Err(PluginError::invalid_config(
            &format!("{field}.{key}"),
            format!("{other} is not an IP address string"),
        )),
    }
}

impl Range {
    /// A range object (`subnet`, optional `rangeStart`, `rangeEnd`,
    /// `gateway`), with host-local's defaults: the gateway and the start are
    /// the subnet's first address, the end its last (IPv4: before broadcast).
    /// `field` names it in errors (`ipam.ranges[0][1]`).
    pub fn parse(v: &Value, field: &str) -> Result<Range, PluginError> {
        let o = v
            .as_object()
            .ok_or_else(|| PluginError::invalid_config(field, format!("{v} is not an object")))?;
        let subnet: IpNet = match o.get("subnet") {
            Some(Value::String(s)) => s
                .parse()
                .map_err(|e| PluginError::invalid_config_caused(&format!("{field}.subnet"), e))?,
            other => {
                return Err(PluginError::invalid_config(
                    &format!("{field}.subnet"),
                    format!("{} is not a CIDR string", crate::config::shown(other)),
                ))
            }
        };
        if canonical(subnet.addr) != subnet.addr {
            // host-local refuses it too (its mask stays IPv6).
            return Err(PluginError::invalid_config(
                &format!("{field}.subnet"),
                format!("{subnet} is IPv4-mapped: write the IPv4 subnet"),
            ));
        }
        let v4 = subnet.addr.is_ipv4();
        if subnet.prefix as u32 > bits(subnet.addr) - 2 {
            return Err(PluginError::invalid_config(
                &format!("{field}.subnet"),
                format!("{subnet} is too small to allocate from"),
            ));
        }
        let network = from_int(to_int(subnet.addr) & !host_mask(&subnet), v4);
        if network != subnet.addr {
            return Err(PluginError::invalid_config(
                &format!("{field}.subnet"),
                format!(
                    "{subnet} has host bits set: the network address is {network}/{}",
                    subnet.prefix
                ),
            ));
        }
        let first = next(network);
        let last = {
            let top = to_int(network) | host_mask(&subnet);
            from_int(if v4 { top - 1 } else { top }, v4)
        };
        let within = |key: &str, a: Option<IpAddr>, default: IpAddr| match a {
            None => Ok(default),
            Some(a) if in_subnet(&subnet, a) => Ok(a),
            Some(a) => Err(PluginError::invalid_config(
                &format!("{field}.{key}"),
                format!("{a} is not in {subnet}"),
            )),
        };
        let start = within("rangeStart", addr_field(o, "rangeStart", field)?, first)?;
        let end = within("rangeEnd", addr_field(o, "rangeEnd", field)?, last)?;
        if to_int(start) > to_int(end) {
            return Err(PluginError::invalid_config(
                &format!("{field}.rangeStart"),
                format!("{start} is after rangeEnd {end}"),
            ));
        }
        let gateway = match addr_field(o, "gateway", field)? {
            None => first,
            Some(g) if g.is_ipv4() == v4 => g,
            Some(g) => {
                return Err(PluginError::invalid_config(
                    &format!("{field}.gateway"),
                    format!("{g} is not of {subnet}'s address family"),
                ))
            }
        };
        Ok(Range {
            subnet,
            start,
            end,
            gateway,
        })
    }

    pub fn contains(&self, a: IpAddr) -> bool {
        let a = canonical(a);
        in_subnet(&self.subnet, a) && (to_int(self.start)..=to_int(self.end)).contains(&to_int(a))
    }

    fn overlaps(&self, o: &Range) -> bool {
        self.start.is_ipv4() == o.start.is_ipv4()
            && to_int(self.start) <= to_int(o.end)
            && to_int(o.start) <= to_int(self.end)
    }

    /// How many addresses ADD can hand out (the gateway is never one).
    pub fn capacity(&self) -> u128 {
        let n = to_int(self.end) - to_int(self.start) + 1;
        n - u128::from(self.contains(self.gateway))
    }
}

impl fmt::Display for Range {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}-{}", self.start, self.end)
    }
}

/// Ranges of one family, none overlapping another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeSet(pub Vec<Range>);

impl RangeSet {
    pub fn parse(v: &Value, field: &str) -> Result<RangeSet, PluginError> {
        let list = match v {
            Value::Array(a) if !a.is_empty() => a,
            other => {
                return Err(PluginError::invalid_config(
                    field,
                    format!("{other} is not a non-empty array of ranges"),
                ))
            }
        };
        let ranges = list
            .iter()
            .enumerate()
            .map(|(i, r)| Range::parse(r, &format!("{field}[{i}]")))
            .collect::<Result<Vec<_>, _>>()?;
        RangeSet::new(ranges, field)
    }

    pub fn new(ranges: Vec<Range>, field: &str) -> Result<RangeSet, PluginError> {
        let v4 = ranges[0].start.is_ipv4();
        if ranges.iter().any(|r| r.start.is_ipv4() != v4) {
            return Err(PluginError::invalid_config(
                field,
                "mixes IPv4 and IPv6 ranges",
            ));
        }
        for (i, a) in ranges.iter().enumerate() {
            if let Some(b) = ranges[i + 1..].iter().find(|b| a.overlaps(b)) {
                return Err(PluginError::invalid_config(
                    field,
                    format!("ranges {a} and {b} overlap"),
                ));
            }
        }
        Ok(RangeSet(ranges))
    }

    pub fn is_ipv4(&self) -> bool {
        self.0[0].start.is_ipv4()
    }

    pub fn range_for(&self, a: IpAddr) -> Option<&Range> {
        self.0.iter().find(|r| r.contains(a))
    }

    pub fn overlaps(&self, o: &RangeSet) -> bool {
        self.0.iter().any(|a| o.0.iter().any(|b| a.overlaps(b)))
    }

    pub fn capacity(&self) -> u128 {
        self.0.iter().map(Range::capacity).sum()
    }

    /// The addresses ADD tries, in host-local's order: round robin from the
    /// one after `last` (the set's last reservation, if it is in the set),
    /// else from the first range's start; through every range once, the
    /// gateways skipped. Each comes with its range.
    pub fn candidates(&self, last: Option<IpAddr>) -> Candidates<'_> {
        let at = last.and_then(|l| self.0.iter().position(|r| r.contains(l)).map(|i| (i, l)));
        Candidates {
            set: self,
            idx: at.map_or(0, |(i, _)| i),
            cur: at.map(|(_, l)| l),
            first: None,
            done: false,
        }
    }
}

impl fmt::Display for RangeSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.0.iter().map(Range::to_string).collect();
        f.write_str(&parts.join(","))
    }
}

/// See [`RangeSet::candidates`].
#[derive(Debug)]
pub struct Candidates<'a> {
    set: &'a RangeSet,
    idx: usize,
    cur: Option<IpAddr>,
    /// The first address handed out: meeting it again ends the walk.
    first: Option<IpAddr>,
    done: bool,
}

impl<'a> Iterator for Candidates<'a> {
    type Item = (IpAddr, &'a Range);

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            let r = &self.set.0[self.idx];
            let cur = match self.cur {
                None => r.start,
                Some(c) if c == r.end => {
                    self.idx = (self.idx + 1) % self.set.0.len();
                    self.set.0[self.idx].start
                }
                Some(c) => next(c),
            };
            self.cur = Some(cur);
            let r = &self.set.0[self.idx];
            match self.first {
                None => self.first = Some(cur),
                Some(f) if f == cur => {
                    self.done = true;
                    break;
                }
                Some(_) => {}
            }
            if cur != r.gateway {
                return Some((cur, r));
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::code;
    use serde_json::json;

    fn range(v: Value) -> Result<Range, PluginError> {
        Range::parse(&v, "r")
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn defaults_follow_host_local() {
        let r = range(json!({"subnet": "10.1.2.0/24"})).unwrap();
        assert_eq!(
            (r.start, r.end, r.gateway),
            (ip("10.1.2.1"), ip("10.1.2.254"), ip("10.1.2.1"))
        );
        assert_eq!(r.capacity(), 253);
        let r = range(json!({"subnet": "fd00::/120"})).unwrap();
        assert_eq!((r.start, r.end), (ip("fd00::1"), ip("fd00::ff")));
        let r = range(json!({"subnet": "10.0.0.0/24", "gateway": "::ffff:10.0.0.9"})).unwrap();
        assert_eq!(r.gateway, ip("10.0.0.9"));
        assert!(r.contains(ip("::ffff:10.0.0.7")));
    }

    #[test]
    fn bad_ranges_name_their_field() {
        for (v, field) in [
            (json!({"subnet": "10.0.0.0/31"}), "r.subnet"),
            (json!({"subnet": "10.0.0.1/24"}), "r.subnet"),
            (json!({"subnet": "nope"}), "r.subnet"),
            (json!({"subnet": "::ffff:10.0.0.0/90"}), "r.subnet"),
            (json!({}), "r.subnet"),
            (
                json!({"subnet": "10.0.0.0/24", "rangeStart": "10.0.1.1"}),
                "r.rangeStart",
            ),
            (
                json!({"subnet": "10.0.0.0/24", "rangeEnd": "fd00::1"}),
                "r.rangeEnd",
            ),
            (
                json!({"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.9", "rangeEnd": "10.0.0.8"}),
                "r.rangeStart",
            ),
            (
                json!({"subnet": "10.0.0.0/24", "gateway": "fd00::1"}),
                "r.gateway",
            ),
            (json!({"subnet": "10.0.0.0/24", "gateway": 7}), "r.gateway"),
        ] {
            let e = range(v.clone()).unwrap_err();
            assert_eq!(e.code, code::INVALID_CONFIG, "{v}");
            assert!(e.msg.contains(&format!("{field:?}")), "{v}: {e}");
        }
    }

    #[test]
    fn sets_refuse_mixed_families_and_overlaps() {
        let a = json!({"subnet": "10.0.0.0/24"});
        let b = json!({"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.200"});
        let c = json!({"subnet": "10.0.1.0/24"});
        let d = json!({"subnet": "fd00::/64"});
        assert!(RangeSet::parse(&json!([a, c]), "s").is_ok());
        assert!(RangeSet::parse(&json!([a, b]), "s")
            .unwrap_err()
            .details
            .contains("overlap"));
        assert!(RangeSet::parse(&json!([a, d]), "s")
            .unwrap_err()
            .details
            .contains("mixes"));
        assert!(RangeSet::parse(&json!([]), "s").is_err());
    }

    #[test]
    fn candidates_walk_every_range_once_from_after_the_last() {
        let set = RangeSet::parse(
            &json!([
                {"subnet": "10.0.0.0/24", "rangeStart": "10.0.0.1", "rangeEnd": "10.0.0.3"},
                {"subnet": "10.0.1.0/24", "rangeStart": "10.0.1.5", "rangeEnd": "10.0.1.6", "gateway": "10.0.1.6"},
            ]),
            "s",
        )
        .unwrap();
        let all = |last: Option<&str>| -> Vec<String> {
            set.candidates(last.map(ip))
                .map(|(a, _)| a.to_string())
                .collect()
        };
        // 10.0.0.1 and 10.0.1.6 are gateways.
        assert_eq!(all(None), ["10.0.0.2", "10.0.0.3", "10.0.1.5"]);
        assert_eq!(all(Some("10.0.0.2")), ["10.0.0.3", "10.0.1.5", "10.0.0.2"]);
        assert_eq!(all(Some("10.0.1.6")), ["10.0.0.2", "10.0.0.3", "10.0.1.5"]);
        // A last reservation outside the set restarts at the first range.
        assert_eq!(all(Some("10.9.9.9")), all(None));
        assert_eq!(set.capacity(), 3);
        let (_, r) = set.candidates(None).nth(2).unwrap();
        assert_eq!(r.subnet.to_string(), "10.0.1.0/24");
    }
}
