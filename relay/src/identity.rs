//! Identity of pools, producers and relays (relay-facts §2). Filled in by the identity work.
