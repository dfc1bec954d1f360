//! Argument parsing shared by the `burstvm` executables. The library crates
//! take typed configs and know nothing of clap; this module and `cmd/` (the
//! `burstvm` binary's command families) hold the clap structs and turn them
//! into those configs. `vmm` is here, in the library, because `burstvm-vmm`
//! uses it without linking the rest of `burstvm`.

pub mod vmm;

use clap::builder::{PossibleValuesParser, TypedValueParser};

/// A value parser over one of a library's value enums: `--help` and errors
/// list `names` (the enum's spellings, from its `ALL` and `name()`), and the
/// enum's own `FromStr` does the parsing, so each spelling has one home.
pub fn choice<T>(names: impl IntoIterator<Item = &'static str>) -> impl TypedValueParser<Value = T>
where
    T: std::str::FromStr + Clone + Send + Sync + 'static,
    T::Err: Into<Box<dyn std::error::Error + Send + Sync + 'static>>,
{
    PossibleValuesParser::new(names).try_map(|s| s.parse::<T>())
}
