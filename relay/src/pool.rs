//! Pool ownership state (relay-facts §4.4, §7). Filled in by the pool work.
