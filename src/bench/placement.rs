//! Where a bench's threads run: pinning the calling thread, a thread of this process, or
//! every thread of a child process to one named core, so a subject and its reference are
//! placed the same way and the placement is reported, not left to the scheduler.
//!
//! On a small machine the scheduler decides whether a request's wake-up lands on the
//! core that sent it or on another, and that alone moved `kvtier bench control`'s echo
//! reference between 9.5 µs and 40 µs from run to run. Pinned, both sides of a round trip
//! meet the same placement, and each placement is measured on its own.

use std::fmt;

pub use crate::affinity::{allowed_cores, pin};

/// How the client and the server of a round trip are placed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Placement {
    /// `same_core` or `cross_core`.
    pub name: &'static str,
    pub client_core: usize,
    pub server_core: usize,
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (client on core {}, server on core {})",
            self.name, self.client_core, self.server_core
        )
    }
}

/// The placements measured on `cores`: both sides on the first core, then client on
/// the first and server on the second (when there is a second).
pub fn placements(cores: &[usize]) -> Vec<Placement> {
    let Some(&a) = cores.first() else { return Vec::new() };
    let mut out = vec![Placement {
        name: "same_core",
        client_core: a,
        server_core: a,
    }];
    if let Some(&b) = cores.get(1).filter(|&&b| b != a) {
        out.push(Placement {
            name: "cross_core",
            client_core: a,
            server_core: b,
        });
    }
    out
}

/// Pins every thread of process `pid` to `cores`; threads it starts later inherit the
/// pinning from the thread that starts them. Returns how many threads were pinned.
pub fn pin_process(pid: u32, cores: &[usize]) -> std::io::Result<usize> {
    let mut n = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/task"))? {
        let Some(tid) = entry?.file_name().to_str().and_then(|t| t.parse::<libc::pid_t>().ok()) else {
            continue;
        };
        match pin(tid, cores) {
            Ok(()) => n += 1,
            // A thread that exited since the listing.
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placements_name_both_cores_and_a_pinned_thread_stays_on_its_core() {
        let p = placements(&[3, 5]);
        assert_eq!(
            p.iter()
                .map(|p| (p.name, p.client_core, p.server_core))
                .collect::<Vec<_>>(),
            vec![("same_core", 3, 3), ("cross_core", 3, 5)]
        );
        assert_eq!(placements(&[2]).len(), 1);
        assert_eq!(placements(&[2, 2]).len(), 1);
        let cores = allowed_cores().unwrap();
        let last = *cores.last().unwrap();
        std::thread::spawn(move || {
            pin(0, &[last]).unwrap();
            assert_eq!(allowed_cores().unwrap(), vec![last]);
            // SAFETY: sched_getcpu has no preconditions.
            assert_eq!(unsafe { libc::sched_getcpu() } as usize, last);
        })
        .join()
        .unwrap();
        assert!(pin(0, &[libc::CPU_SETSIZE as usize]).is_err());
    }
}
