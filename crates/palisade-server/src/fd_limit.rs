//! The open-file limit (`RLIMIT_NOFILE`): raised to the hard limit at
//! start-up where the OS allows, reported, and the HTTP connection cap kept
//! below it, so idle clients can never take the descriptors the store needs
//! for its own files (an `EMFILE` inside the commit path stops the store).
//! See `docs/decisions/0016-connection-limits.md`.

use tracing::{info, warn};

/// Descriptors kept free beyond the connection cap: the store's later files
/// (log segments, checkpoints, sled), Kafka and etcd sockets, the refusal
/// tasks' sockets and `accept` itself.
pub const RESERVED_FDS: u64 = 24;

/// The process's open-file limit after [`raise`].
#[derive(Debug, Clone, Copy)]
pub struct FdLimit {
    /// The soft limit in force (`None`: unlimited or unknown).
    pub soft: Option<u64>,
    /// The hard limit (`None`: unlimited or unknown).
    pub hard: Option<u64>,
    /// The soft limit before it was raised, if it was.
    pub raised_from: Option<u64>,
}

/// Raise the soft open-file limit to the hard limit, and log the outcome.
#[cfg(unix)]
pub fn raise() -> FdLimit {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let before = getrlimit(Resource::Nofile);
    let mut limit = FdLimit {
        soft: before.current,
        hard: before.maximum,
        raised_from: None,
    };
    if before.current.is_some() && before.current != before.maximum {
        // Unlimited (`None`) cannot be a soft descriptor limit on Linux;
        // macOS also caps it below its nominal hard limit: try, then say.
        let target = Rlimit {
            current: before.maximum,
            maximum: before.maximum,
        };
        match setrlimit(Resource::Nofile, target) {
            Ok(()) => {
                let after = getrlimit(Resource::Nofile);
                limit.raised_from = before.current;
                limit.soft = after.current;
            }
            Err(e) => warn!(
                error = %e,
                soft = ?before.current,
                hard = ?before.maximum,
                "cannot raise the open-file limit to its hard limit"
            ),
        }
    }
    info!(
        soft = ?limit.soft,
        hard = ?limit.hard,
        raised_from = ?limit.raised_from,
        "open-file limit (RLIMIT_NOFILE)"
    );
    limit
}

#[cfg(not(unix))]
pub fn raise() -> FdLimit {
    FdLimit {
        soft: None,
        hard: None,
        raised_from: None,
    }
}

/// Descriptors this process has open now (Linux: `/proc/self/fd`).
pub fn open_now() -> Option<u64> {
    let n = std::fs::read_dir("/proc/self/fd").ok()?.count();
    // The directory handle read_dir held was one of them.
    u64::try_from(n.saturating_sub(1)).ok()
}

/// The connection cap that fits: `wanted`, or less if the open-file limit
/// minus what is open now minus [`RESERVED_FDS`] is smaller (at least 1).
pub fn fit_connections(wanted: usize, limit: &FdLimit, open: Option<u64>) -> usize {
    let (Some(soft), Some(open)) = (limit.soft, open) else {
        return wanted;
    };
    let room = soft
        .saturating_sub(open)
        .saturating_sub(RESERVED_FDS)
        .max(1);
    let fitted = usize::try_from(room).unwrap_or(usize::MAX).min(wanted);
    if fitted < wanted {
        warn!(
            max_connections = wanted,
            lowered_to = fitted,
            open_file_limit = soft,
            open_now = open,
            reserved = RESERVED_FDS,
            "--max-connections lowered to fit the open-file limit (raise it with `ulimit -n` or LimitNOFILE=)"
        );
    }
    fitted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cap_fits_under_the_limit() {
        let l = FdLimit {
            soft: Some(64),
            hard: Some(64),
            raised_from: None,
        };
        assert_eq!(
            fit_connections(1024, &l, Some(20)) as u64,
            64 - 20 - RESERVED_FDS
        );
        assert_eq!(fit_connections(5, &l, Some(20)), 5);
        assert_eq!(fit_connections(1024, &l, Some(63)), 1);
        let unknown = FdLimit { soft: None, ..l };
        assert_eq!(fit_connections(1024, &unknown, Some(20)), 1024);
        assert!(open_now().is_none_or(|n| n >= 3));
    }
}
