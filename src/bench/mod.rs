//! `kvtier bench …`: measurements that print a ratio against a reference measured in the
//! same run.

pub mod pool;
