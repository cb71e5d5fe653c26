//! The clap value parsers of the library's named kinds (`--strategy`, `--optimizer`, ...): the
//! names the library parses, each with its help, shared by `strata train` and the benchmarks.

use clap::builder::{PossibleValue, PossibleValuesParser, TypedValueParser};
use strata::NamedKind;

/// A clap value parser for one of the library's named kinds (its names, each with its help).
pub(crate) fn kind_parser<K: NamedKind>() -> impl TypedValueParser<Value = K> {
    PossibleValuesParser::new(K::all().iter().map(|k| PossibleValue::new(k.name()).help(k.help())))
        .try_map(|s| s.parse::<K>())
}
