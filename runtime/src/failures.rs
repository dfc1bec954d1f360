//! Several independent failures of one cleanup (a sandbox's teardown, the
//! network pool's release), each kept as its typed error: a cleanup goes on
//! after a failed step, so one error value is not enough.

use std::fmt;

/// `what` failed in `errors.len()` independent steps (never empty).
#[derive(Debug)]
pub struct Failures<E> {
    pub what: String,
    pub errors: Vec<E>,
}

impl<E> Failures<E> {
    /// Ok if nothing failed, else every failure under `what`.
    pub fn check(what: impl FnOnce() -> String, errors: Vec<E>) -> Result<(), Failures<E>> {
        if errors.is_empty() {
            Ok(())
        } else {
            Err(Failures {
                what: what(),
                errors,
            })
        }
    }
}

impl<E: fmt::Display> fmt::Display for Failures<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ", self.what)?;
        for (i, e) in self.errors.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

impl<E: std::error::Error + 'static> std::error::Error for Failures<E> {
    /// The first failure (the others are in `errors`).
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.errors
            .first()
            .map(|e| e as &(dyn std::error::Error + 'static))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::error::Error as _;

    #[test]
    fn lists_every_failure_and_keeps_the_first_as_source() {
        assert!(Failures::<std::io::Error>::check(|| unreachable!(), vec![]).is_ok());
        let e = Failures::check(
            || "sandbox s1 teardown".to_string(),
            vec![
                std::io::Error::from_raw_os_error(libc::EBUSY),
                std::io::Error::from_raw_os_error(libc::ENOENT),
            ],
        )
        .unwrap_err();
        let s = e.to_string();
        assert!(s.starts_with("sandbox s1 teardown: "), "{s}");
        assert_eq!(s.matches("; ").count(), 1, "{s}");
        let first = e
            .source()
            .unwrap()
            .downcast_ref::<std::io::Error>()
            .unwrap();
        assert_eq!(first.raw_os_error(), Some(libc::EBUSY));
    }
}
