//! VF ids and default MACs (docs/design.md, "NIC control API").

/// PCI-style id of VF `i` of PF `k`: bus `0xb1 + k`, device/function as PCI
/// numbers them (8 functions per device).
pub fn vf_id(pf_index: usize, vf_index: usize) -> String {
    format!(
        "0000:{:02x}:{:02x}.{}",
        0xb1 + pf_index,
        vf_index / 8,
        vf_index % 8
    )
}

/// Default MAC of VF `i` of PF `k`: `02:42:bf:<k>:<i/256>:<i%256>`.
pub fn default_mac(pf_index: usize, vf_index: usize) -> [u8; 6] {
    [
        0x02,
        0x42,
        0xbf,
        pf_index as u8,
        (vf_index / 256) as u8,
        (vf_index % 256) as u8,
    ]
}

pub fn format_mac(mac: &[u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

pub fn parse_mac(s: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = s.split(':');
    for b in mac.iter_mut() {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *b = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn ids_follow_pci_numbering() {
        assert_eq!(vf_id(0, 3), "0000:b1:00.3");
        assert_eq!(vf_id(0, 7), "0000:b1:00.7");
        assert_eq!(vf_id(0, 8), "0000:b1:01.0");
        assert_eq!(vf_id(1, 17), "0000:b2:02.1");
        assert_eq!(format_mac(&default_mac(1, 258)), "02:42:bf:01:01:02");
        assert_eq!(parse_mac("02:42:bf:01:01:02"), Some(default_mac(1, 258)));
        assert_eq!(parse_mac("02:42:bf:01:01"), None);
        assert_eq!(parse_mac("02:42:bf:01:01:02:03"), None);
        assert_eq!(parse_mac("zz:42:bf:01:01:02"), None);
    }
}
