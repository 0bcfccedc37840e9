//! CBI1 frame encoding (relay-facts §5). Filled in by the CBI1 work.
