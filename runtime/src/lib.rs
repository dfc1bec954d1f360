#[derive(Debug, clap::Args)]
pub struct RunArgs {}
#[derive(Debug, clap::Args)]
pub struct BenchStartupArgs {}
#[derive(Debug, thiserror::Error)]
pub enum Error {}
pub fn run_cli(_a: &RunArgs) -> Result<(), Error> {
    unreachable!("runtime under construction")
}
pub fn bench_startup_cli(_a: &BenchStartupArgs) -> Result<(), Error> {
    unreachable!("runtime under construction")
}
