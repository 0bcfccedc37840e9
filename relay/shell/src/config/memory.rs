//! Byte budgets of what the DC can make the relay hold beside the pools' filters: each pool's
//! exact ownership state, the node's input queue, the NATS event plane's backlog, the recovery
//! answers being read and the journal recorder's queue. Each has a default sized for the
//! contract's largest legal inputs and a `DYN_RELAY_*` setting.

use kvrelay_core::filter::ckf::CkfFormat;
use kvrelay_core::pool::exact_state_bytes_max_default;

use super::{ConfigError, Env, parse_positive};
use crate::event_plane::{NATS_MAX_PAYLOAD_DEFAULT, NATS_SUBSCRIPTION_BYTES_MAX_DEFAULT};
use crate::journal::QUEUE_BYTES_MAX_DEFAULT as JOURNAL_QUEUE_BYTES_MAX_DEFAULT;
use crate::node::{INPUT_QUEUE_BYTES_MAX_DEFAULT, INPUT_QUEUE_BYTES_MAX_LIMIT};
use crate::request_plane::{
    CONTROL_FRAME_BYTES_MAX, RECOVERY_ANSWERS_BYTES_MAX, RECOVERY_RESPONSE_BYTES_MAX,
};

/// Smallest accepted exact-state and input-queue budget: 1 MiB.
pub const BYTE_BUDGET_MIN: u64 = 1 << 20;

/// Largest accepted exact-state and NATS backlog budget: 1 TiB (a typing error, not a plan).
pub const BYTE_BUDGET_MAX: u64 = 1 << 40;

/// The budgets in effect.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemoryBudgets {
    /// `DYN_RELAY_POOL_EXACT_STATE_BYTES_MAX`: bytes each pool's exact ownership tables may
    /// allocate (default: 256 bytes per filter slot, at least 64 MiB).
    pub pool_exact_state_bytes_max: usize,
    /// `DYN_RELAY_INPUT_QUEUE_BYTES_MAX`: bytes of DC inputs queued for the node (and in its step).
    pub input_queue_bytes_max: usize,
    /// `DYN_RELAY_NATS_BACKLOG_BYTES_MAX`: bytes of decoded NATS messages the event plane holds
    /// while the node's queue is full (its subscription queues' capacity is derived from it,
    /// but never below 16,384 messages).
    pub nats_backlog_bytes_max: usize,
    /// `DYN_RELAY_RECOVERY_RESPONSE_BYTES_MAX`: bytes of one recovery answer (a worker's tree
    /// dump or event range); a larger answer fails its query (default 128 MiB, also the most).
    pub recovery_response_bytes_max: usize,
    /// `DYN_RELAY_RECOVERY_ANSWERS_BYTES_MAX`: bytes of all recovery answers being read at once
    /// (default two of the largest answers; at least one answer's bound).
    pub recovery_answers_bytes_max: usize,
    /// `DYN_RELAY_JOURNAL_QUEUE_BYTES_MAX`: bytes of records queued for the `--record` writer;
    /// past it a record is dropped and counted (the recording notes the gap).
    pub journal_queue_bytes_max: usize,
}

/// Read the budgets; each must be a positive integer of bytes within its range.
pub(super) fn resolve_memory_budgets(
    env: &Env<'_>,
    ckf_format: &CkfFormat,
) -> Result<MemoryBudgets, ConfigError> {
    let bytes = |setting: &'static str, min: u64, max: u64, default: usize| {
        let Some(value) = env.get(setting) else { return Ok(default) };
        let parsed = parse_positive(setting, value, max)?;
        if parsed < min {
            return Err(super::invalid(setting, value, format!("must be at least {min} bytes")));
        }
        Ok(usize::try_from(parsed).unwrap_or(usize::MAX))
    };
    let recovery_response_bytes_max = bytes(
        "DYN_RELAY_RECOVERY_RESPONSE_BYTES_MAX",
        CONTROL_FRAME_BYTES_MAX as u64,
        RECOVERY_RESPONSE_BYTES_MAX as u64,
        RECOVERY_RESPONSE_BYTES_MAX,
    )?;
    Ok(MemoryBudgets {
        pool_exact_state_bytes_max: bytes(
            "DYN_RELAY_POOL_EXACT_STATE_BYTES_MAX",
            BYTE_BUDGET_MIN,
            BYTE_BUDGET_MAX,
            exact_state_bytes_max_default(ckf_format),
        )?,
        input_queue_bytes_max: bytes(
            "DYN_RELAY_INPUT_QUEUE_BYTES_MAX",
            BYTE_BUDGET_MIN,
            INPUT_QUEUE_BYTES_MAX_LIMIT as u64,
            INPUT_QUEUE_BYTES_MAX_DEFAULT,
        )?,
        nats_backlog_bytes_max: bytes(
            "DYN_RELAY_NATS_BACKLOG_BYTES_MAX",
            NATS_MAX_PAYLOAD_DEFAULT as u64,
            BYTE_BUDGET_MAX,
            NATS_SUBSCRIPTION_BYTES_MAX_DEFAULT,
        )?,
        recovery_response_bytes_max,
        recovery_answers_bytes_max: bytes(
            "DYN_RELAY_RECOVERY_ANSWERS_BYTES_MAX",
            recovery_response_bytes_max as u64,
            BYTE_BUDGET_MAX,
            RECOVERY_ANSWERS_BYTES_MAX,
        )?,
        journal_queue_bytes_max: bytes(
            "DYN_RELAY_JOURNAL_QUEUE_BYTES_MAX",
            BYTE_BUDGET_MIN,
            BYTE_BUDGET_MAX,
            JOURNAL_QUEUE_BYTES_MAX_DEFAULT,
        )?,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn resolve(pairs: &[(&str, &str)]) -> Result<MemoryBudgets, ConfigError> {
        let env: BTreeMap<String, String> =
            pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
        let format = CkfFormat::for_expected_blocks(1 << 20).unwrap();
        resolve_memory_budgets(&Env(&env), &format)
    }

    #[test]
    fn defaults_hold_and_each_budget_is_read_and_validated() {
        let format = CkfFormat::for_expected_blocks(1 << 20).unwrap();
        assert_eq!(
            resolve(&[]).unwrap(),
            MemoryBudgets {
                pool_exact_state_bytes_max: exact_state_bytes_max_default(&format),
                input_queue_bytes_max: INPUT_QUEUE_BYTES_MAX_DEFAULT,
                nats_backlog_bytes_max: NATS_SUBSCRIPTION_BYTES_MAX_DEFAULT,
                recovery_response_bytes_max: RECOVERY_RESPONSE_BYTES_MAX,
                recovery_answers_bytes_max: RECOVERY_ANSWERS_BYTES_MAX,
                journal_queue_bytes_max: JOURNAL_QUEUE_BYTES_MAX_DEFAULT,
            }
        );
        let set = resolve(&[
            ("DYN_RELAY_POOL_EXACT_STATE_BYTES_MAX", "8388608"),
            ("DYN_RELAY_INPUT_QUEUE_BYTES_MAX", "16777216"),
            ("DYN_RELAY_NATS_BACKLOG_BYTES_MAX", "2097152"),
            ("DYN_RELAY_RECOVERY_RESPONSE_BYTES_MAX", "4194304"),
            ("DYN_RELAY_RECOVERY_ANSWERS_BYTES_MAX", "8388608"),
            ("DYN_RELAY_JOURNAL_QUEUE_BYTES_MAX", "3145728"),
        ])
        .unwrap();
        assert_eq!(
            set,
            MemoryBudgets {
                pool_exact_state_bytes_max: 8 << 20,
                input_queue_bytes_max: 16 << 20,
                nats_backlog_bytes_max: 2 << 20,
                recovery_response_bytes_max: 4 << 20,
                recovery_answers_bytes_max: 8 << 20,
                journal_queue_bytes_max: 3 << 20,
            }
        );
        // A smaller answer bound lowers the floor of the shared one.
        let small = resolve(&[
            ("DYN_RELAY_RECOVERY_RESPONSE_BYTES_MAX", "1048576"),
            ("DYN_RELAY_RECOVERY_ANSWERS_BYTES_MAX", "1048576"),
        ])
        .unwrap();
        assert_eq!(
            (small.recovery_response_bytes_max, small.recovery_answers_bytes_max),
            (1 << 20, 1 << 20)
        );
        for (name, bad) in [
            ("DYN_RELAY_POOL_EXACT_STATE_BYTES_MAX", "1048575"),
            ("DYN_RELAY_POOL_EXACT_STATE_BYTES_MAX", "1099511627777"),
            ("DYN_RELAY_INPUT_QUEUE_BYTES_MAX", "0"),
            ("DYN_RELAY_INPUT_QUEUE_BYTES_MAX", "8589934592"),
            ("DYN_RELAY_NATS_BACKLOG_BYTES_MAX", "1000"),
            ("DYN_RELAY_NATS_BACKLOG_BYTES_MAX", "lots"),
            ("DYN_RELAY_RECOVERY_RESPONSE_BYTES_MAX", "65535"),
            ("DYN_RELAY_RECOVERY_RESPONSE_BYTES_MAX", "134217729"),
            // Below the one answer's bound (the default 128 MiB): an answer could never finish.
            ("DYN_RELAY_RECOVERY_ANSWERS_BYTES_MAX", "134217727"),
            ("DYN_RELAY_JOURNAL_QUEUE_BYTES_MAX", "1048575"),
        ] {
            let error = resolve(&[(name, bad)]).unwrap_err().to_string();
            assert!(error.contains(name), "{name}={bad}: {error}");
        }
    }
}
