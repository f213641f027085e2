//! Which cores a thread runs on.
//!
//! On a machine with few cores the scheduler's wake-up placement decides how many cores a
//! batch's copy really gets: two transfer workers woken back to back by a caller that then
//! sleeps were both queued on one core while the other stayed idle for 0.5-1.5 ms, until
//! idle balancing moved one (seen in a scheduler trace of `kvtier bench transfer` on a
//! 2-core machine; docs/ARCHITECTURE.md, issue 29). Pinning each worker to its own core
//! (`control.worker_cores`) removes that race; the benches pin their subjects and
//! references to named cores the same way, so both meet the same placement.

/// The CPUs this thread may run on, in order.
pub fn allowed_cores() -> std::io::Result<Vec<usize>> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set; the call fills it for this thread.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a live cpu_set_t of the size passed.
    if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let isset = |c: usize| {
        // SAFETY: `c` is below CPU_SETSIZE, so CPU_ISSET reads within the set.
        unsafe { libc::CPU_ISSET(c, &set) }
    };
    Ok((0..libc::CPU_SETSIZE as usize).filter(|&c| isset(c)).collect())
}

/// `Ok` when this process may run on every one of `cores` (or none is named); else the
/// first it may not, as `core {c}, which this process may not run on (allowed: [...])`.
pub fn check_allowed(cores: &[usize]) -> Result<(), String> {
    if cores.is_empty() {
        return Ok(());
    }
    let allowed =
        allowed_cores().map_err(|e| format!("cores, but reading the cores this process may run on failed: {e}"))?;
    match cores.iter().find(|c| !allowed.contains(c)) {
        Some(c) => Err(format!(
            "core {c}, which this process may not run on (allowed: {allowed:?})"
        )),
        None => Ok(()),
    }
}

/// The core thread `i` of a set pins itself to: `cores[i % cores.len()]` (the list reused
/// from its start), or `None` when no core is named.
pub fn nth_core(cores: &[usize], i: usize) -> Option<usize> {
    (!cores.is_empty()).then(|| cores[i % cores.len()])
}

/// Pins thread `tid` (0: the calling thread) to `cores`.
pub fn pin(tid: libc::pid_t, cores: &[usize]) -> std::io::Result<()> {
    // SAFETY: a zeroed cpu_set_t is a valid empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cores {
        if c >= libc::CPU_SETSIZE as usize {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("core {c} is out of range"),
            ));
        }
        // SAFETY: `c` is below CPU_SETSIZE, checked above.
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a live cpu_set_t of the size passed; a bad tid is an error return.
    if unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
