//! What a recording decided that its replay must follow, beyond the inputs themselves: when
//! each input was taken (the relay's time, and the checkpoint schedule's), when the node fired
//! the relay's timers, and each pool's publication points.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::tap::TimerPlan;
use crate::pool::PublicationMode;
use kvrelay_core::model::identity::PoolId;
use kvrelay_core::pool::PublicationPoint;

/// The recorded input times, the recorded timer firings, and the recorded
/// [`PublicationPoint`]s per `(pool, generation)`, handed to each pool as the replaying node
/// starts it. A window cut out of a recording carries neither firings nor points (its pools'
/// command counts start elsewhere): it does not drive the time, and replays on the node's own
/// clock and timer with free pools.
#[derive(Debug, Default)]
pub(super) struct RecordedTiming {
    inputs: Vec<Duration>,
    points: Mutex<BTreeMap<(String, u64), Vec<PublicationPoint>>>,
    end: Duration,
    /// The journal drives its pools' publication (their points): not a window.
    scripts_pools: bool,
    /// The journal drives the node's time (its inputs' stamps and its timer firings): not a
    /// window, and the inputs arrive one by one in journal order.
    drives_clock: bool,
    /// Firings not yet performed: `(inputs handled, time)`, in journal order.
    firings: Mutex<VecDeque<(u64, Duration)>>,
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

    /// The journal drives the replaying pools and, with `time`, the node's time (its stamps
    /// and firings).
    pub(super) fn drive_time(&mut self, time: bool) {
        self.scripts_pools = true;
        self.drives_clock = time;
    }

    /// Add a recorded timer firing (in journal order).
    pub(super) fn push_firing(&mut self, inputs_handled: u64, at: Duration) {
        self.firings_mut().push_back((inputs_handled, at));
    }

    /// The relay's time for input number `inputs_handled`, when the journal drives it.
    pub(super) fn input_time(&self, inputs_handled: u64) -> Option<Duration> {
        if self.drives_clock { self.input_at(inputs_handled) } else { None }
    }

    /// Where the node's next firing comes from with `inputs_handled` inputs handled.
    pub(super) fn timer_plan(&self, inputs_handled: u64) -> TimerPlan {
        if !self.drives_clock {
            return TimerPlan::Own;
        }
        match self.next_firing(inputs_handled) {
            Some(Some(at)) => TimerPlan::Recorded(at),
            Some(None) => TimerPlan::AfterInputs,
            None => TimerPlan::OwnFrom(self.end),
        }
    }

    /// The node fired its timers at `at`: the recorded firing due there is done.
    pub(super) fn fired(&self, inputs_handled: u64, at: Duration) {
        if self.next_firing(inputs_handled).flatten().is_some_and(|due| due <= at) {
            self.firings().pop_front();
        }
    }

    /// The next recorded firing: `Some(Some(time))` when it is due with `inputs_handled`
    /// inputs handled, `Some(None)` when it follows more inputs, `None` when none is left. A
    /// firing the node passed (it never should: a recorded firing ends a batch) is due, late,
    /// rather than skipped; once every recorded input is handled, the firings left follow
    /// inputs the journal lost (a gap) and are due in order rather than waited for.
    fn next_firing(&self, inputs_handled: u64) -> Option<Option<Duration>> {
        let inputs_done = inputs_handled >= self.inputs.len() as u64;
        let &(handled, at) = self.firings().front()?;
        Some((handled <= inputs_handled || inputs_done).then_some(at))
    }

    fn firings(&self) -> std::sync::MutexGuard<'_, VecDeque<(u64, Duration)>> {
        self.firings.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn firings_mut(&mut self) -> &mut VecDeque<(u64, Duration)> {
        self.firings.get_mut().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Add a recorded point (in journal order).
    pub(super) fn push(&mut self, pool: String, layout_generation: u64, point: PublicationPoint) {
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
        let Some(origin) = origin.filter(|_| self.scripts_pools) else {
            return PublicationMode::Free;
        };
        let points = self
            .points
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&(pool_id.to_string(), layout_generation))
            .unwrap_or_default();
        PublicationMode::Scripted { points, until: origin + self.end }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn recorded_firings_drive_the_timer_in_order_then_the_node_runs_free_from_the_end() {
        let mut timing = RecordedTiming::default();
        timing.inputs_at([MS, 2 * MS, 5 * MS]);
        timing.push_firing(0, MS / 2);
        timing.push_firing(2, 3 * MS);
        timing.push_firing(2, 4 * MS);
        timing.end_at(9 * MS);
        // Not driving (a window): the node's own clock and timer.
        assert_eq!(timing.timer_plan(0), TimerPlan::Own);
        assert_eq!(timing.input_time(1), None);
        // Pools scripted, time on the node's own clock (inputs rerouted).
        timing.drive_time(false);
        assert_eq!(timing.timer_plan(0), TimerPlan::Own);
        assert_eq!(timing.input_time(1), None);
        timing.drive_time(true);
        assert_eq!(timing.input_time(2), Some(2 * MS), "the recorded stamp");
        assert_eq!(timing.input_time(4), None, "past the recorded inputs: the clock");
        assert_eq!(timing.timer_plan(0), TimerPlan::Recorded(MS / 2));
        timing.fired(0, MS / 2);
        assert_eq!(timing.timer_plan(0), TimerPlan::AfterInputs, "the next follows input 2");
        assert_eq!(timing.timer_plan(1), TimerPlan::AfterInputs);
        assert_eq!(timing.timer_plan(2), TimerPlan::Recorded(3 * MS));
        // A firing the node has not reached yet is not consumed.
        timing.fired(2, 2 * MS);
        assert_eq!(timing.timer_plan(2), TimerPlan::Recorded(3 * MS));
        timing.fired(2, 3 * MS);
        // One passed by (never expected) is still fired, late.
        assert_eq!(timing.timer_plan(3), TimerPlan::Recorded(4 * MS));
        timing.fired(3, 4 * MS);
        assert_eq!(timing.timer_plan(3), TimerPlan::OwnFrom(9 * MS), "then free from the end");
    }

    #[test]
    fn firings_past_the_recorded_inputs_are_fired_once_every_input_is_handled() {
        // A gap lost inputs: the last firings name input counts the replay never reaches.
        let mut timing = RecordedTiming::default();
        timing.inputs_at([MS, 2 * MS]);
        timing.push_firing(1, MS);
        timing.push_firing(5, 3 * MS);
        timing.push_firing(6, 4 * MS);
        timing.end_at(9 * MS);
        timing.drive_time(true);
        assert_eq!(timing.timer_plan(1), TimerPlan::Recorded(MS));
        timing.fired(1, MS);
        assert_eq!(timing.timer_plan(1), TimerPlan::AfterInputs);
        assert_eq!(timing.timer_plan(2), TimerPlan::Recorded(3 * MS), "not waited for");
        timing.fired(2, 3 * MS);
        assert_eq!(timing.timer_plan(2), TimerPlan::Recorded(4 * MS));
        timing.fired(2, 4 * MS);
        assert_eq!(timing.timer_plan(2), TimerPlan::OwnFrom(9 * MS));
    }
}
