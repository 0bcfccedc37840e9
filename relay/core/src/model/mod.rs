//! The values everything else is made of: pool, producer and relay identity, Dynamo's block and
//! sequence hashes, and the KV event values workers publish.

pub mod hashing;
pub mod identity;
pub mod kv_events;
