//! `burstvm-vmm`: the VMM alone, with the arguments of `burstvm vmm`.
//!
//! The runtime execs one VMM per sandbox; this executable links only the vmm
//! crate (not the runtime, CRI client and shim of `burstvm`), so the loader
//! has far fewer relocations and pages to touch at every start
//! (docs/vmm.md, "The burstvm-vmm executable"). It is entered without std's
//! runtime start-up, for the same reason (`procutil::entry`).

#![no_main]

use clap::Parser;

#[derive(Parser)]
#[command(name = "burstvm-vmm", version, about = "Run one burstvm microVM")]
struct Cli {
    #[command(flatten)]
    args: Box<burstvm::args::vmm::VmmArgs>,
}

#[no_mangle]
extern "C" fn main(_argc: libc::c_int, _argv: *const *const libc::c_char) -> libc::c_int {
    procutil::entry::run(run)
}

fn run() -> i32 {
    burstvm::init_logging();
    // The VMM's exit status is the guest's under --until-exit.
    match vmm::run_cli(&Cli::parse().args.into_params()) {
        Ok(status) => i32::from(status),
        Err(e) => {
            // One line naming the cause chain, as the VMM contract asks.
            eprintln!("{:#}", anyhow::Error::new(e).context("burstvm-vmm"));
            1
        }
    }
}
