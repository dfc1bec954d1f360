//! `burstvm vmm` without the rest of the workspace: handy while developing
//! the VMM alone (`cargo run -p vmm --example vmm -- --sandbox sb1`).

use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: vmm::VmmArgs,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = vmm::run_cli(&cli.args) {
        eprintln!("burstvm vmm: {e}");
        std::process::exit(1);
    }
}
