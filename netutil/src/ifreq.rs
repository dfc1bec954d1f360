//! `struct ifreq` for the tun and socket ioctls: the kernel's layout from
//! libc, filled by name instead of by hand-counted byte offsets.

use crate::NameError;

/// Checks an interface name: 1..IFNAMSIZ-1 bytes, no NUL, no `/`.
pub fn check_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() || name.len() >= libc::IFNAMSIZ || name.contains(['/', '\0']) {
        return Err(NameError {
            name: name.to_string(),
        });
    }
    Ok(())
}

/// An `ifreq` naming `name` with every other byte zero.
pub fn ifreq(name: &str) -> Result<libc::ifreq, NameError> {
    check_name(name)?;
    // SAFETY: ifreq is a C struct of integers, byte arrays and a union of
    // such; the all-zero bit pattern is a valid value of each.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    Ok(req)
}

/// The name the kernel wrote back into `req` (e.g. after TUNSETIFF of `tap%d`).
pub fn name_of(req: &libc::ifreq) -> String {
    let bytes: Vec<u8> = req
        .ifr_name
        .iter()
        .take_while(|&&c| c != 0)
        .map(|&c| c as u8)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_checked_and_copied() {
        let r = ifreq("tap0").unwrap();
        assert_eq!(name_of(&r), "tap0");
        assert!(ifreq("").is_err());
        assert!(ifreq("a-name-that-is-too-long").is_err());
        assert!(ifreq("a/b").is_err());
        assert_eq!(
            name_of(&ifreq("fifteen-bytes-x").unwrap()),
            "fifteen-bytes-x"
        );
    }
}
