//! What a recording decided that its replay must follow, beyond the inputs themselves: when
//! each input was taken (the checkpoint schedule runs on those times), and each pool's
//! publication points.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::pool::PublicationMode;
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::pool::PublicationPoint;

/// The recorded input times, and the recorded [`PublicationPoint`]s per `(pool, generation)`,
/// handed to each pool as the replaying node starts it. A journal with no point at all (a
/// window cut out of a recording, whose pools' command counts start elsewhere) replays with
/// free pools.
#[derive(Debug, Default)]
pub(super) struct RecordedTiming {
    inputs: Vec<Duration>,
    points: Mutex<BTreeMap<(String, u64), Vec<PublicationPoint>>>,
    any: bool,
    end: Duration,
}

impl RecordedTiming {
    /// The recorded times of the inputs, in order.
    pub(super) fn inputs_at(&mut self, times: impl IntoIterator<Item = Duration>) {
        self.inputs = times.into_iter().collect();
    }

    /// The recorded time of input number `inputs_handled` (from 1), if the journal has it. The
    /// replay decides and stamps checkpoints with it rather than with its own clock, whose
    /// timer may only reach the input's time rounded up (tokio's millisecond wheel).
    pub(super) fn input_at(&self, inputs_handled: u64) -> Option<Duration> {
        let index = usize::try_from(inputs_handled.checked_sub(1)?).ok()?;
        self.inputs.get(index).copied()
    }

    /// Add a recorded point (in journal order).
    pub(super) fn push(&mut self, pool: String, layout_generation: u64, point: PublicationPoint) {
        self.any = true;
        self.points
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .entry((pool, layout_generation))
            .or_default()
            .push(point);
    }

    /// The node time from which pools run free (the end of the replayed window).
    pub(super) fn end_at(&mut self, end: Duration) {
        self.end = end;
    }

    /// The mode of the pool `(pool_id, layout_generation)` starting now, for a node whose
    /// time counts from `origin`: its script (taken: a second start gets an empty one).
    pub(super) fn mode(
        &self,
        origin: Option<Instant>,
        pool_id: &PoolId,
        layout_generation: u64,
    ) -> PublicationMode {
        let Some(origin) = origin.filter(|_| self.any) else { return PublicationMode::Free };
        let points = self
            .points
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&(pool_id.to_string(), layout_generation))
            .unwrap_or_default();
        PublicationMode::Scripted { points, until: origin + self.end }
    }
}
