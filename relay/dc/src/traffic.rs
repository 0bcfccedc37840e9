//! Prefix-sharing request traffic: a pool of shared prefixes (system prompts, documents) with
//! skewed popularity, each request a prefix plus a unique tail.

use rand_core::Rng;

use kvrelay_core::rng::RelayRng;

/// Shape of the traffic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrafficConfig {
    /// Distinct shared prefixes.
    pub prefix_count: usize,
    /// Tokens per shared prefix.
    pub prefix_tokens: usize,
    /// Most unique tokens appended per request.
    pub tail_tokens_max: usize,
    /// Token vocabulary size.
    pub vocabulary: u32,
}

impl Default for TrafficConfig {
    fn default() -> Self {
        TrafficConfig {
            prefix_count: 64,
            prefix_tokens: 256,
            tail_tokens_max: 128,
            vocabulary: 32_000,
        }
    }
}

/// One request: its tokens and, for adapter traffic, the served adapter name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// Prompt tokens.
    pub tokens: Vec<u32>,
    /// Index of the shared prefix it starts with.
    pub prefix_index: usize,
}

/// A deterministic source of requests.
#[derive(Debug, Clone)]
pub struct Traffic {
    config: TrafficConfig,
    prefixes: Vec<Vec<u32>>,
}

impl Traffic {
    /// Draw the shared prefixes.
    pub fn new(config: TrafficConfig, rng: &mut RelayRng) -> Self {
        let vocabulary = config.vocabulary.max(2);
        let prefixes = (0..config.prefix_count.max(1))
            .map(|_| (0..config.prefix_tokens).map(|_| rng.next_u32() % vocabulary).collect())
            .collect();
        Traffic { config, prefixes }
    }

    /// The shared prefixes.
    #[must_use]
    pub fn prefixes(&self) -> &[Vec<u32>] {
        &self.prefixes
    }

    /// The next request: a prefix chosen with a skew toward low indices (half the requests go to
    /// the first eighth of prefixes), plus a random tail.
    pub fn next_request(&self, rng: &mut RelayRng) -> Request {
        let count = self.prefixes.len();
        let prefix_index = if rng.next_u32().is_multiple_of(2) {
            (rng.next_u32() as usize) % count.div_ceil(8)
        } else {
            (rng.next_u32() as usize) % count
        };
        let mut tokens = self.prefixes[prefix_index].clone();
        let tail = (rng.next_u32() as usize) % (self.config.tail_tokens_max + 1);
        let vocabulary = self.config.vocabulary.max(2);
        tokens.extend((0..tail).map(|_| rng.next_u32() % vocabulary));
        Request { tokens, prefix_index }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::rng::rng_from_seed;

    #[test]
    fn requests_share_prefixes_and_are_deterministic() {
        let config = TrafficConfig {
            prefix_count: 4,
            prefix_tokens: 32,
            tail_tokens_max: 8,
            vocabulary: 100,
        };
        let a = Traffic::new(config, &mut rng_from_seed(1));
        let b = Traffic::new(config, &mut rng_from_seed(1));
        assert_eq!(a.prefixes(), b.prefixes());
        let mut rng = rng_from_seed(2);
        for _ in 0..50 {
            let request = a.next_request(&mut rng);
            assert!(request.tokens.starts_with(&a.prefixes()[request.prefix_index]));
            assert!(request.tokens.len() <= 40);
        }
    }
}
