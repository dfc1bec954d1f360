//! The `burstvm` binary's command families: clap structs and their
//! conversion into the library crates' typed configs (`into_config`).

pub mod nic;
pub mod runtime;
pub mod sgiov;
