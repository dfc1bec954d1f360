//! Standalone runner of `nic::bench` until `burstvm bench devset` is wired:
//! `cargo run -p nic --example bench_devset -- --vfs 200 --policy global,hierarchical`
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: nic::bench::BenchDevsetArgs,
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = nic::bench::run_cli(&cli.args) {
        eprintln!("{e}");
        std::process::exit(1);
    }
}
