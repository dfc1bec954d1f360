//! A tap created while other threads of the process fork (root: netns, tun).
//! In a test binary of its own: its forks would hold the fds of sibling tests.

use netutil::{NamedNetns, Rtnl, Tap};

fn ns(tag: &str) -> NamedNetns {
    NamedNetns::create(&format!("nu-{tag}-{}", std::process::id())).expect("create netns (root)")
}

/// The runtime creates a sandbox's tap while other threads fork (VMMs, CNI
/// plugins): no forked child may keep the creator's queue attached, or the
/// VMM's own attach fails with EBUSY (issue 11, `tap` lost 1 of 50 starts).
#[test]
fn tap_creation_leaves_no_queue_to_concurrent_forks() {
    use std::os::unix::process::CommandExt;
    use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
    let a = ns("tapfork");
    let stop = AtomicBool::new(false);
    let forks = AtomicU32::new(0);
    std::thread::scope(|s| {
        for _ in 0..3 {
            s.spawn(|| {
                while !stop.load(Ordering::Relaxed) {
                    let mut cmd = std::process::Command::new("/bin/true");
                    // SAFETY: nanosleep is async-signal-safe. The child sits
                    // between fork and exec for 1 ms, holding the fd table copy.
                    unsafe {
                        cmd.pre_exec(|| {
                            let t = libc::timespec {
                                tv_sec: 0,
                                tv_nsec: 1_000_000,
                            };
                            libc::nanosleep(&t, std::ptr::null_mut());
                            Ok(())
                        });
                    }
                    cmd.status().unwrap();
                    forks.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        let r = a.run(|| {
            let mut nl = Rtnl::open().unwrap();
            for i in 0..150 {
                Tap::create_persistent("nufork0").unwrap();
                // The VMM's attach, right after the runtime made the tap.
                let t = Tap::open_existing("nufork0");
                nl.delete_link_by_name("nufork0").unwrap();
                if let Err(e) = t {
                    return Err(format!("attach {i}: {e}"));
                }
            }
            Ok(())
        });
        stop.store(true, Ordering::Relaxed);
        r.unwrap().unwrap();
    });
    assert!(forks.load(Ordering::Relaxed) > 10, "the forks ran");
}
