//! CPU priority of the threads that move bytes and do pool I/O, below the control
//! plane's, so that on a busy core a lookup's wake-up is not queued behind a copy.
//!
//! Linux keeps a nice value per thread (`setpriority(PRIO_PROCESS, tid, …)` names one
//! thread), and a new thread starts with its creator's. A worker lowers its own priority
//! when it starts; threads it starts later (a Mooncake call's thread, the Mooncake helper
//! process) inherit the lowered value.
//!
//! Only ever lowered, never raised: raising a nice value needs `CAP_SYS_NICE` or an
//! `RLIMIT_NICE`, which a daemon must not count on, so a thread lowered here stays
//! lowered for its life.

/// The largest (lowest-priority) nice value.
pub const MAX_NICE: i32 = 19;

/// The calling thread's kernel id.
fn this_thread() -> libc::id_t {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::syscall(libc::SYS_gettid) as libc::id_t }
}

/// The calling thread's nice value.
pub fn current() -> std::io::Result<i32> {
    // getpriority may return -1 as a value: only errno tells an error apart.
    // SAFETY: errno is the calling thread's own; getpriority reads the calling thread's
    // scheduling value.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, this_thread())
    };
    if nice == -1 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(0) {
            return Err(e);
        }
    }
    Ok(nice)
}

/// Lowers the calling thread's priority by `by` nice steps (the result capped at
/// [`MAX_NICE`]) and returns its nice value afterwards. `by = 0` changes nothing.
pub fn lower_this_thread(by: u8) -> std::io::Result<i32> {
    let now = current()?;
    let target = (now + i32::from(by)).min(MAX_NICE);
    if target <= now {
        return Ok(now);
    }
    // SAFETY: setpriority on the calling thread's own id; a larger nice value needs no
    // privilege.
    if unsafe { libc::setpriority(libc::PRIO_PROCESS, this_thread(), target) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(target)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lowers_only_the_calling_thread_and_never_raises() {
        let mine = current().unwrap();
        let (lowered, again, zero) = std::thread::spawn(move || {
            let lowered = lower_this_thread(3).unwrap();
            // A second call lowers from where the first left it, capped at 19.
            let again = lower_this_thread(30).unwrap();
            let zero = lower_this_thread(0).unwrap();
            (lowered, again, zero)
        })
        .join()
        .unwrap();
        assert_eq!(lowered, (mine + 3).min(MAX_NICE));
        assert_eq!(again, MAX_NICE);
        assert_eq!(zero, MAX_NICE, "by 0 leaves the value as it is");
        // The spawning thread kept its own value.
        assert_eq!(current().unwrap(), mine);
    }

    #[test]
    fn a_thread_started_by_a_lowered_thread_inherits_its_value() {
        let mine = current().unwrap();
        let (parent, child) = std::thread::spawn(|| {
            let parent = lower_this_thread(2).unwrap();
            let child = std::thread::spawn(|| current().unwrap()).join().unwrap();
            (parent, child)
        })
        .join()
        .unwrap();
        assert_eq!(parent, (mine + 2).min(MAX_NICE));
        assert_eq!(child, parent);
    }
}
