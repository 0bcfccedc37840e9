//! The byte budget shared by all recovery answers being read at once
//! ([`RecoveryClientConfig::answers_bytes_max`](super::RecoveryClientConfig::answers_bytes_max)),
//! and the rule that keeps it from deadlocking.
//!
//! An answer reserves bytes before each allocation of its frame buffers and holds them until it
//! is handed over, fails or is dropped ([`AnswerBytes`]). It cannot hand bytes back midway (they
//! hold data it has read), so a plain semaphore of bytes could deadlock: answers that each hold
//! part of the budget and wait for more would wait for each other until the earliest deadline.
//!
//! **Rule.** A reservation of `bytes` by an answer holding `holding` is granted only if
//!
//! ```text
//! free − bytes ≥ answer_bytes_max − max(largest holding, holding + bytes)
//! ```
//!
//! that is, if afterwards the free bytes still cover all that the answer holding the most could
//! still reserve. Otherwise it waits.
//!
//! **Why nothing can deadlock.** No answer reserves more than `answer_bytes_max` in all (the
//! ledger refuses more as [`RecoveryError::ResponseTooLarge`]). The rule keeps
//! `free ≥ answer_bytes_max − largest holding` at all times: it holds with nothing held, as the
//! budget is at least one answer's bound; a grant keeps it by its own test; a release only adds
//! free bytes, and when the largest holder releases, `free` becomes at least `answer_bytes_max`.
//! So the largest holder's next reservation, at most `answer_bytes_max − its holding ≤ free`,
//! always passes: **the answer holding the most never waits for the budget**. Every waiting
//! answer waits on one that is reading (or decoding), bounded by that one's worker and deadline;
//! when it ends, the answer then holding the most is granted at once. No answer waits in a cycle.
//!
//! **Order and cost.** Waiting reservations are granted in arrival order, each as soon as it
//! passes the rule; one that does not pass does not hold back a later one that does. A waiting
//! answer is bounded only by its call's deadline (it may wait behind a stalled largest holder).
//! Beside the largest holder, the other answers together hold at most
//! `bytes_max − answer_bytes_max`.
//!
//! [`AnswerLedger`] is the rule as a plain struct (no runtime, no clock); [`AnswerBudget`] puts it
//! behind a mutex and wakes waiting readers.

use std::collections::BTreeMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use tokio::sync::oneshot;

use super::RecoveryError;

/// Names one answer's account in an [`AnswerLedger`].
pub(super) type AnswerId = u64;

/// Names one waiting reservation in an [`AnswerLedger`].
pub(super) type WaitTicket = u64;

/// What [`AnswerLedger::reserve`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Reservation {
    /// The bytes belong to the answer now.
    Granted,
    /// The reservation waits under this ticket until a state change grants it.
    Waiting(WaitTicket),
}

/// A reservation that did not pass the rule yet.
#[derive(Debug)]
struct Waiting<W> {
    answer: AnswerId,
    bytes: usize,
    /// Handed back to the caller when the reservation is granted.
    waker: W,
}

/// The shared budget's accounts: who holds how much, and who waits for how much.
///
/// Invariants (checked after every change in debug builds):
/// - `free + Σ holdings = bytes_max`;
/// - every holding is at most `answer_bytes_max`;
/// - `free ≥ answer_bytes_max − largest holding`;
/// - no waiting answer holds the largest holding (the largest holder never waits).
#[derive(Debug)]
pub(super) struct AnswerLedger<W> {
    bytes_max: usize,
    answer_bytes_max: usize,
    free: usize,
    holdings: BTreeMap<AnswerId, usize>,
    waiting: BTreeMap<WaitTicket, Waiting<W>>,
    answer_next: AnswerId,
    ticket_next: WaitTicket,
    peak: usize,
    waits: u64,
}

impl<W> AnswerLedger<W> {
    /// An empty ledger of `bytes_max` bytes for answers of at most `answer_bytes_max` bytes each.
    /// The caller validates `answer_bytes_max ≤ bytes_max` (an answer must be able to complete
    /// alone); a larger bound is taken as `bytes_max`.
    pub(super) fn new(bytes_max: usize, answer_bytes_max: usize) -> Self {
        debug_assert!(answer_bytes_max <= bytes_max);
        AnswerLedger {
            bytes_max,
            answer_bytes_max: answer_bytes_max.min(bytes_max),
            free: bytes_max,
            holdings: BTreeMap::new(),
            waiting: BTreeMap::new(),
            answer_next: 0,
            ticket_next: 0,
            peak: 0,
            waits: 0,
        }
    }

    /// Open an account for a new answer, holding nothing.
    pub(super) fn open(&mut self) -> AnswerId {
        let answer = self.answer_next;
        self.answer_next = self.answer_next.wrapping_add(1);
        self.holdings.insert(answer, 0);
        answer
    }

    /// Reserve `bytes` more for `answer`: granted at once if the rule allows, else queued under a
    /// ticket with the waker `waker()` makes. Fails if the answer would hold more than its bound
    /// ([`RecoveryError::ResponseTooLarge`]) or has no account ([`RecoveryError::Closed`]).
    pub(super) fn reserve(
        &mut self,
        answer: AnswerId,
        bytes: usize,
        waker: impl FnOnce() -> W,
    ) -> Result<Reservation, RecoveryError> {
        let holding = *self.holdings.get(&answer).ok_or(RecoveryError::Closed)?;
        if bytes > self.answer_bytes_max - holding {
            return Err(RecoveryError::ResponseTooLarge { max: self.answer_bytes_max });
        }
        if self.passes(holding, bytes, self.largest_holding()) {
            self.grant(answer, bytes);
            self.check();
            return Ok(Reservation::Granted);
        }
        let ticket = self.ticket_next;
        self.ticket_next = self.ticket_next.wrapping_add(1);
        self.waiting.insert(ticket, Waiting { answer, bytes, waker: waker() });
        self.waits = self.waits.saturating_add(1);
        self.check();
        Ok(Reservation::Waiting(ticket))
    }

    /// Withdraw a waiting reservation (its caller gave up); nothing if it was granted already.
    pub(super) fn withdraw(&mut self, ticket: WaitTicket) {
        // No grant depends on a waiting reservation, so removing one grants nothing.
        self.waiting.remove(&ticket);
    }

    /// Close `answer`'s account: its bytes return, its waiting reservation (if any) goes, and
    /// the wakers of the reservations this grants are returned, in arrival order.
    pub(super) fn close(&mut self, answer: AnswerId) -> Vec<W> {
        if let Some(holding) = self.holdings.remove(&answer) {
            self.free += holding;
        }
        self.waiting.retain(|_, waiting| waiting.answer != answer);
        self.grant_waiting()
    }

    /// Bytes held now.
    pub(super) fn in_use(&self) -> usize {
        self.bytes_max - self.free
    }

    /// Most bytes ever held at once.
    pub(super) fn peak(&self) -> usize {
        self.peak
    }

    /// Reservations that had to wait.
    pub(super) fn waits(&self) -> u64 {
        self.waits
    }

    /// Bytes `answer` holds (0 without an account).
    #[cfg(test)]
    fn holding(&self, answer: AnswerId) -> usize {
        self.holdings.get(&answer).copied().unwrap_or(0)
    }

    /// Reservations waiting now.
    #[cfg(test)]
    fn waiting_count(&self) -> usize {
        self.waiting.len()
    }

    fn largest_holding(&self) -> usize {
        self.holdings.values().copied().max().unwrap_or(0)
    }

    /// The rule: after granting `bytes` to an answer holding `holding`, the free bytes still
    /// cover what the largest holder could still reserve.
    fn passes(&self, holding: usize, bytes: usize, largest: usize) -> bool {
        let Some(free_after) = self.free.checked_sub(bytes) else {
            return false;
        };
        let largest_after = largest.max(holding + bytes);
        free_after >= self.answer_bytes_max.saturating_sub(largest_after)
    }

    fn grant(&mut self, answer: AnswerId, bytes: usize) {
        if let Some(holding) = self.holdings.get_mut(&answer) {
            *holding += bytes;
            self.free -= bytes;
        }
        self.peak = self.peak.max(self.in_use());
    }

    /// Grant every waiting reservation that passes the rule, in arrival order. One pass is
    /// enough: a grant lowers `free` by its bytes and the rule's right side by at most as much,
    /// so it never lets an earlier-skipped reservation pass.
    fn grant_waiting(&mut self) -> Vec<W> {
        let mut wakers = Vec::new();
        let mut largest = self.largest_holding();
        let tickets: Vec<WaitTicket> = self.waiting.keys().copied().collect();
        for ticket in tickets {
            let Some(waiting) = self.waiting.get(&ticket) else { continue };
            let (answer, bytes) = (waiting.answer, waiting.bytes);
            let holding = self.holdings.get(&answer).copied().unwrap_or(0);
            if self.passes(holding, bytes, largest) {
                if let Some(granted) = self.waiting.remove(&ticket) {
                    wakers.push(granted.waker);
                }
                self.grant(answer, bytes);
                largest = largest.max(holding + bytes);
            }
        }
        self.check();
        wakers
    }

    /// The invariants of the type, after each whole operation (a pass of grants may break the
    /// last one midway).
    fn check(&self) {
        if cfg!(debug_assertions) {
            let held: usize = self.holdings.values().sum();
            let largest = self.largest_holding();
            assert_eq!(self.free + held, self.bytes_max, "bytes are neither lost nor invented");
            assert!(largest <= self.answer_bytes_max, "an answer holds more than its bound");
            assert!(
                self.free >= self.answer_bytes_max - largest,
                "the largest holder could not finish"
            );
            assert!(
                self.waiting.values().all(|waiting| self.holdings[&waiting.answer] < largest),
                "the largest holder waits"
            );
        }
    }
}

/// A reading of the budget for the client's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AnswerBudgetReading {
    /// Bytes held now.
    pub(super) in_use: usize,
    /// Most bytes ever held at once.
    pub(super) peak: usize,
    /// Reservations that had to wait.
    pub(super) waits: u64,
}

/// The [`AnswerLedger`] shared by a client's calls; waiting readers are woken through oneshot
/// channels when a release grants their reservation.
#[derive(Debug)]
pub(super) struct AnswerBudget {
    ledger: Mutex<AnswerLedger<oneshot::Sender<()>>>,
}

impl AnswerBudget {
    /// A budget of `bytes_max` for answers of at most `answer_bytes_max` each.
    pub(super) fn new(bytes_max: usize, answer_bytes_max: usize) -> Self {
        AnswerBudget { ledger: Mutex::new(AnswerLedger::new(bytes_max, answer_bytes_max)) }
    }

    /// An account for one answer, holding nothing until it reserves.
    pub(super) fn open(&self) -> AnswerBytes<'_> {
        let answer = self.ledger().open();
        AnswerBytes { budget: self, answer }
    }

    /// Bytes held, peak and waits.
    pub(super) fn reading(&self) -> AnswerBudgetReading {
        let ledger = self.ledger();
        AnswerBudgetReading { in_use: ledger.in_use(), peak: ledger.peak(), waits: ledger.waits() }
    }

    /// Every critical section is one ledger operation that leaves it consistent (or panics in
    /// a debug check), so a poisoned lock is taken over.
    fn ledger(&self) -> MutexGuard<'_, AnswerLedger<oneshot::Sender<()>>> {
        self.ledger.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// The bytes one answer holds of the shared [`AnswerBudget`]; all of them return to it when this
/// is dropped (answer handed over, call failed, or call cancelled).
#[derive(Debug)]
pub(super) struct AnswerBytes<'a> {
    budget: &'a AnswerBudget,
    answer: AnswerId,
}

impl AnswerBytes<'_> {
    /// Take `bytes` more of the budget, before buffering them; waits while the rule refuses them.
    /// Cancel-safe: a wait dropped midway is withdrawn, and bytes granted meanwhile stay with
    /// this answer until it is dropped.
    pub(super) async fn reserve(&mut self, bytes: usize) -> Result<(), RecoveryError> {
        let mut granted = None;
        let reservation = self.budget.ledger().reserve(self.answer, bytes, || {
            let (sender, receiver) = oneshot::channel();
            granted = Some(receiver);
            sender
        })?;
        let Reservation::Waiting(ticket) = reservation else {
            return Ok(());
        };
        let _withdraw = WithdrawOnDrop { budget: self.budget, ticket };
        let granted = granted.ok_or(RecoveryError::Closed)?;
        granted.await.map_err(|_| RecoveryError::Closed)
    }
}

impl Drop for AnswerBytes<'_> {
    fn drop(&mut self) {
        let wakers = self.budget.ledger().close(self.answer);
        for waker in wakers {
            // A reader that has gone meanwhile holds the bytes until its own account closes.
            let _ = waker.send(());
        }
    }
}

/// Withdraws a waiting reservation whose reader stopped waiting.
struct WithdrawOnDrop<'a> {
    budget: &'a AnswerBudget,
    ticket: WaitTicket,
}

impl Drop for WithdrawOnDrop<'_> {
    fn drop(&mut self) {
        self.budget.ledger().withdraw(self.ticket);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvrelay_core::rng::rng_from_seed;
    use rand_core::Rng;

    const MIB: usize = 1 << 20;

    fn reserve(ledger: &mut AnswerLedger<AnswerId>, answer: AnswerId, bytes: usize) -> Reservation {
        ledger.reserve(answer, bytes, || answer).unwrap()
    }

    /// The stall a plain semaphore of bytes ran into: four answers of 1.7 MiB each (bound 2 MiB)
    /// under a shared 4 MiB + 64 KiB budget all took their first MiB, then each needed 0.7 MiB
    /// more while 64 KiB were free. Under the rule the fourth first MiB waits instead, and the
    /// largest holder's growth always fits.
    #[test]
    fn answers_that_each_fit_alone_never_all_wait() {
        let mut ledger = AnswerLedger::<AnswerId>::new(4 * MIB + (64 << 10), 2 * MIB);
        let answers: Vec<AnswerId> = (0..4).map(|_| ledger.open()).collect();
        for &answer in &answers[..3] {
            assert_eq!(reserve(&mut ledger, answer, MIB), Reservation::Granted);
        }
        assert!(matches!(reserve(&mut ledger, answers[3], MIB), Reservation::Waiting(_)));
        let growth = 7 * MIB / 10;
        assert_eq!(reserve(&mut ledger, answers[0], growth), Reservation::Granted);
        // The others cannot grow beside the new largest holder, which could grow further.
        for &answer in &answers[1..3] {
            assert!(matches!(reserve(&mut ledger, answer, growth), Reservation::Waiting(_)));
        }
        assert_eq!(ledger.waiting_count(), 3);

        // The first answer is handed over. In arrival order: the fourth answer's first MiB
        // fits, then the second answer's growth (it becomes the largest holder); the third's
        // would leave too little for it.
        assert_eq!(ledger.close(answers[0]), [answers[3], answers[1]]);
        assert_eq!(ledger.holding(answers[1]), MIB + growth);
        assert_eq!(ledger.close(answers[1]), [answers[2]]);
        assert_eq!(ledger.holding(answers[2]), MIB + growth);
        assert!(ledger.close(answers[2]).is_empty());
        assert_eq!(reserve(&mut ledger, answers[3], growth), Reservation::Granted);
        assert!(ledger.close(answers[3]).is_empty());
        assert_eq!((ledger.in_use(), ledger.waiting_count(), ledger.waits()), (0, 0, 3));
        assert!(ledger.peak() <= 4 * MIB + (64 << 10));
    }

    #[test]
    fn an_answer_cannot_reserve_past_its_own_bound() {
        let mut ledger = AnswerLedger::<AnswerId>::new(4 * MIB, 2 * MIB);
        let answer = ledger.open();
        assert_eq!(reserve(&mut ledger, answer, 2 * MIB - 1), Reservation::Granted);
        assert_eq!(
            ledger.reserve(answer, 2, || 0),
            Err(RecoveryError::ResponseTooLarge { max: 2 * MIB })
        );
        assert_eq!(ledger.holding(answer), 2 * MIB - 1);
        ledger.close(answer);
        assert_eq!(ledger.reserve(answer, 1, || 0), Err(RecoveryError::Closed));
    }

    #[test]
    fn a_withdrawn_reservation_is_never_granted() {
        let mut ledger = AnswerLedger::<AnswerId>::new(2 * MIB, 2 * MIB);
        let (first, second) = (ledger.open(), ledger.open());
        assert_eq!(reserve(&mut ledger, first, MIB), Reservation::Granted);
        let Reservation::Waiting(ticket) = ledger.reserve(second, MIB, || 7).unwrap() else {
            panic!("the second answer's MiB would leave the first unable to finish");
        };
        ledger.withdraw(ticket);
        assert!(ledger.close(first).is_empty());
        assert_eq!(ledger.holding(second), 0);
    }

    /// Seeded random schedules of answers that open, grow in steps and finish: whenever every
    /// open answer is waiting for bytes, the schedule would be stuck. The ledger's debug checks
    /// run after every step.
    #[test]
    fn random_schedules_never_leave_every_open_answer_waiting() {
        for seed in 0..200u64 {
            let mut rng = rng_from_seed(seed);
            let bytes_max = 3 * MIB + (rng.next_u64() % (3 * MIB as u64)) as usize;
            let answer_bytes_max = MIB + (rng.next_u64() % (2 * MIB as u64)) as usize;
            let mut ledger = AnswerLedger::<AnswerId>::new(bytes_max, answer_bytes_max);
            // answer -> (bytes still to reserve, waiting?)
            let mut open: BTreeMap<AnswerId, (usize, bool)> = BTreeMap::new();
            let mut finished = 0;
            for _ in 0..2_000 {
                let runnable: Vec<AnswerId> =
                    open.iter().filter(|(_, (_, waiting))| !waiting).map(|(id, _)| *id).collect();
                assert!(
                    open.is_empty() || !runnable.is_empty(),
                    "seed {seed}: every open answer waits: {open:?}"
                );
                if open.len() < 8 && rng.next_u64().is_multiple_of(3) {
                    let size = 1 + (rng.next_u64() % answer_bytes_max as u64) as usize;
                    open.insert(ledger.open(), (size, false));
                    continue;
                }
                let Some(&answer) = runnable.get((rng.next_u64() as usize) % runnable.len().max(1))
                else {
                    continue;
                };
                let left = open[&answer].0;
                if left == 0 {
                    for woken in ledger.close(answer) {
                        open.get_mut(&woken).unwrap().1 = false;
                    }
                    open.remove(&answer);
                    finished += 1;
                    continue;
                }
                let step = left.min(1 + (rng.next_u64() % MIB as u64) as usize);
                match ledger.reserve(answer, step, || answer).unwrap() {
                    Reservation::Granted => {}
                    Reservation::Waiting(_) => open.get_mut(&answer).unwrap().1 = true,
                }
                // A waiting answer's step counts as taken once it is granted.
                open.get_mut(&answer).unwrap().0 -= step;
            }
            assert!(finished > 50, "seed {seed}: only {finished} answers finished");
            assert!(ledger.peak() <= bytes_max);
        }
    }

    #[tokio::test]
    async fn a_waiting_reader_is_woken_by_a_release_and_a_dropped_one_holds_nothing() {
        let budget = AnswerBudget::new(2 * MIB, 2 * MIB);
        let mut first = budget.open();
        first.reserve(MIB + 1).await.unwrap();
        let mut second = budget.open();
        {
            // Dropped while waiting: withdrawn, and nothing is held for it.
            let wait = second.reserve(MIB);
            tokio::pin!(wait);
            assert!(futures::poll!(wait.as_mut()).is_pending());
        }
        assert_eq!(budget.reading().waits, 1);
        let mut third = budget.open();
        {
            let wait = third.reserve(MIB);
            tokio::pin!(wait);
            assert!(futures::poll!(wait.as_mut()).is_pending());
            drop(first);
            wait.await.unwrap();
        }
        assert_eq!(budget.reading().in_use, MIB);
        drop(third);
        drop(second);
        assert_eq!(budget.reading().in_use, 0);
    }
}
