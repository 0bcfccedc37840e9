//! A journal's publication points, grouped per pool actor for a replay.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use crate::identity::PoolId;
use crate::pool::{PublicationMode, PublicationPoint, PublicationScript};

/// The recorded [`PublicationPoint`]s of a journal per `(pool, generation)`, handed to each
/// actor as the replaying node starts it. A journal with no point at all (a window cut out of a
/// recording, whose actors' command counts start elsewhere) replays with free actors.
#[derive(Debug, Default)]
pub(super) struct PublicationScripts {
    points: Mutex<BTreeMap<(String, u64), Vec<PublicationPoint>>>,
    any: bool,
    end: Duration,
}

impl PublicationScripts {
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

    /// The node time from which actors run free (the end of the replayed window).
    pub(super) fn end_at(&mut self, end: Duration) {
        self.end = end;
    }

    /// The mode of the actor of `(pool_id, layout_generation)` starting now, for a node whose
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
        PublicationMode::Scripted(PublicationScript { points, until: origin + self.end })
    }
}
