pub mod pool {
    #[derive(Debug, clap::Args)]
    pub struct PoolArgs {}
    #[derive(Debug, thiserror::Error)]
    pub enum Error {}
    pub fn run_cli(_a: &PoolArgs) -> Result<(), Error> {
        unreachable!("guestmem under construction")
    }
}
pub mod bench {
    #[derive(Debug, clap::Args)]
    pub struct MemoryBenchArgs {}
    #[derive(Debug, thiserror::Error)]
    pub enum Error {}
    pub fn run_cli(_a: &MemoryBenchArgs) -> Result<(), Error> {
        unreachable!("guestmem under construction")
    }
}
