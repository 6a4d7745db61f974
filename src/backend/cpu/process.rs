//! The process itself: running a function when it exits (for `NDSCOPE_RECORD`).

/// Runs `f` when the process exits normally (returning from `main` or `std::process::exit`),
/// through the C library's `atexit`. Returns `false` where that is not available.
pub(crate) fn at_exit(f: extern "C" fn()) -> bool {
    #[cfg(any(unix, windows))]
    {
        // SAFETY: `atexit` only stores the pointer of a plain `extern "C"` function with no
        // arguments, which lives as long as the program; it is called once, at exit.
        unsafe { libc::atexit(f) == 0 }
    }
    #[cfg(not(any(unix, windows)))]
    {
        let _ = f;
        false
    }
}
