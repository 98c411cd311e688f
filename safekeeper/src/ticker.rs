//! The clock of the daemon's periodic tasks (timeline manager, WAL lifecycle, disk usage, peer
//! recovery): a tick every period, the first at once; a late tick is delayed, never a burst.

use std::time::Duration;

use tokio::time::{Interval, MissedTickBehavior};
use tokio_util::sync::CancellationToken;

/// Ticks every period until its task is cancelled.
pub struct Ticker(Interval);

impl Ticker {
    /// A ticker whose first tick is at once.
    pub fn new(period: Duration) -> Ticker {
        let mut interval = tokio::time::interval(period);
        interval.set_missed_tick_behavior(MissedTickBehavior::Delay);
        Ticker(interval)
    }

    /// Waits for the next tick: `true`, or `false` once `cancel` is cancelled.
    pub async fn tick(&mut self, cancel: &CancellationToken) -> bool {
        tokio::select! {
            _ = self.0.tick() => true,
            _ = cancel.cancelled() => false,
        }
    }
}
