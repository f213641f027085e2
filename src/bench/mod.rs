//! Measurements that print a ratio against a physical reference measured in the same run.

pub mod control;
