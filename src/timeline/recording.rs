//! What a recording captured ([`Recording`]): the events kept, the number dropped, the threads
//! and the state before the oldest event kept. The recorder (the parent module) makes it and
//! writes it out through the exporters, which read it.

use std::fmt;
use std::time::{Duration, SystemTime};

use super::event::MemoryEvent;
use super::replay::Replay;

/// What a recording captured: the events kept (the last `max_entries`), the number dropped, the
/// threads, and the state when the oldest kept event happened. Export it with
/// [`write_chrome_trace`](Self::write_chrome_trace) and
/// [`write_memory_snapshot`](Self::write_memory_snapshot).
#[derive(Clone)]
pub struct Recording {
    pub(super) events: Vec<MemoryEvent>,
    pub(super) base: Replay,
    pub(super) dropped: u64,
    pub(super) max_entries: usize,
    pub(super) duration_ns: u64,
    pub(super) started_wall: SystemTime,
    pub(super) thread: u32,
    pub(super) threads: Vec<String>,
    pub(super) pid: u32,
}

impl fmt::Debug for Recording {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Recording")
            .field("events", &self.events.len())
            .field("dropped", &self.dropped)
            .field("max_entries", &self.max_entries)
            .field("duration", &self.duration())
            .finish()
    }
}

impl Recording {
    /// The events kept, oldest first.
    pub fn events(&self) -> &[MemoryEvent] {
        &self.events
    }

    /// Events dropped because the buffer was full (the oldest ones).
    pub fn dropped(&self) -> u64 {
        self.dropped
    }

    /// The cap on events kept.
    pub fn max_entries(&self) -> usize {
        self.max_entries
    }

    /// How long it recorded (until it stopped, or until this copy was taken).
    pub fn duration(&self) -> Duration {
        Duration::from_nanos(self.duration_ns)
    }

    /// Names of the threads, indexed by [`MemoryEvent::thread`] (the thread's name, or
    /// `thread N`).
    pub fn threads(&self) -> &[String] {
        &self.threads
    }
}
