"""The package version, kept equal to the Rust crate's (Cargo.toml)."""

__version__ = "0.1.0"
