#[derive(Debug, clap::Args)]
pub struct VmmArgs {}
#[derive(Debug, thiserror::Error)]
pub enum Error {}
pub fn run_cli(_a: &VmmArgs) -> Result<(), Error> {
    unreachable!("vmm under construction")
}
