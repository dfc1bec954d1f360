#[derive(Debug, clap::Args)]
pub struct NicArgs {}
#[derive(Debug, thiserror::Error)]
pub enum Error {}
pub fn run_cli(_a: &NicArgs) -> Result<(), Error> {
    unreachable!("nic under construction")
}
