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

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn ids_follow_pci_numbering() {
        assert_eq!(vf_id(0, 3), "0000:b1:00.3");
        assert_eq!(vf_id(0, 7), "0000:b1:00.7");
        assert_eq!(vf_id(0, 8), "0000:b1:01.0");
        assert_eq!(vf_id(1, 17), "0000:b2:02.1");
        let mac = netutil::MacAddr::from(default_mac(1, 258));
        assert_eq!(mac.to_string(), "02:42:bf:01:01:02");
        assert_eq!("02:42:bf:01:01:02".parse(), Ok(mac));
    }
}
