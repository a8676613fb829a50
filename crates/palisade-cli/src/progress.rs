//! Progress of long work (export, import, backup, restore) on stderr.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// Progress of long work on stderr: a bar with rate and ETA redrawn in
/// place on a terminal, a plain line every few seconds otherwise.
pub(crate) struct Progress {
    what: &'static str,
    /// What is counted (`events`, `bytes`).
    unit: &'static str,
    total: u64,
    done: u64,
    started: Instant,
    last: Instant,
    tty: bool,
    /// Off when stdout carries the data and stderr is the same terminal.
    on: bool,
}

impl Progress {
    pub(crate) fn new(what: &'static str, unit: &'static str, total: u64, on: bool) -> Self {
        let now = Instant::now();
        Self {
            what,
            unit,
            total,
            done: 0,
            started: now,
            last: now,
            tty: std::io::stderr().is_terminal(),
            on,
        }
    }

    pub(crate) fn set_total(&mut self, total: u64) {
        self.total = total;
    }

    pub(crate) fn set(&mut self, done: u64) {
        self.done = done;
        let every = if self.tty {
            Duration::from_millis(100)
        } else {
            Duration::from_secs(5)
        };
        if self.on && self.last.elapsed() >= every {
            self.last = Instant::now();
            self.draw();
        }
    }

    fn draw(&self) {
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        #[allow(clippy::cast_precision_loss)]
        let (done, total) = (self.done as f64, self.total.max(1) as f64);
        let rate = done / secs;
        let eta = if rate > 0.0 {
            format!("{:.0}s", (total - done).max(0.0) / rate)
        } else {
            "?".into()
        };
        if self.tty {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let filled = ((done / total) * 30.0).min(30.0) as usize;
            eprint!(
                "\r{} [{}{}] {}/{} {}, {rate:.0}/s, ETA {eta}   ",
                self.what,
                "#".repeat(filled),
                ".".repeat(30 - filled),
                self.done,
                self.total,
                self.unit
            );
        } else {
            eprintln!(
                "{}: {}/{} {}, {rate:.0}/s, ETA {eta}",
                self.what, self.done, self.total, self.unit
            );
        }
    }

    pub(crate) fn finish(&mut self) {
        if self.on {
            self.done = self.total.max(self.done);
            self.draw();
            if self.tty {
                eprintln!();
            }
        }
    }
}
