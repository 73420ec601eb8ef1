//! The one line `kvconnect plugins` prints for a plugin whose query process gave no answer:
//! the file, what happened to the process, and what to do.

use super::time_limit::{shown, QUERY_TIMEOUT_ENV};
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

/// Why a query process gave no answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NoAnswer {
    /// A signal killed it: the plugin crashed it (SIGABRT, SIGSEGV, ...).
    Signal(i32),
    /// It exited with this status before answering: the plugin ended it.
    Exited(i32),
    /// It was still running at the time limit, and was killed with SIGKILL.
    TimedOut(Duration),
    /// It could not be started or waited for (the OS error).
    CannotRun(String),
}

impl NoAnswer {
    /// How a process that ended without an answer ended.
    pub fn from_status(status: ExitStatus) -> NoAnswer {
        match status.signal() {
            Some(sig) => NoAnswer::Signal(sig),
            None => NoAnswer::Exited(status.code().unwrap_or(-1)),
        }
    }

    /// The line naming the plugin file `path`.
    pub fn line(&self, path: &str) -> String {
        const DOING: &str = "while loading and querying it";
        const FIX: &str = "fix it or remove it from the plugin path";
        match self {
            NoAnswer::Signal(sig) => format!(
                "plugin {path}: the query process was killed by signal {sig} ({}) {DOING}, so the plugin \
                    crashed — {FIX}",
                signal_name(*sig)
            ),
            NoAnswer::Exited(code) => format!(
                "plugin {path}: the query process exited with status {code} before answering, {DOING} — a \
                    plugin must not end the process: {FIX}"
            ),
            NoAnswer::TimedOut(limit) => format!(
                "plugin {path}: no answer within {} {DOING}, so the query process was killed (SIGKILL) and \
                    the plugin hangs — {FIX}, or allow more time with --query-timeout SECS or \
                    {QUERY_TIMEOUT_ENV}",
                shown(*limit)
            ),
            NoAnswer::CannotRun(reason) => format!(
                "plugin {path}: cannot run a query process to load it ({reason}) — check that this kvconnect \
                    binary can still be run, and that the machine has processes and memory to spare"
            ),
        }
    }
}

/// A signal's name (`SIGABRT`), or `an unknown signal`.
pub fn signal_name(sig: i32) -> &'static str {
    const NAMES: &[(i32, &str)] = &[
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGINT, "SIGINT"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGILL, "SIGILL"),
        (libc::SIGTRAP, "SIGTRAP"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGBUS, "SIGBUS"),
        (libc::SIGFPE, "SIGFPE"),
        (libc::SIGKILL, "SIGKILL"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGALRM, "SIGALRM"),
        (libc::SIGTERM, "SIGTERM"),
        (libc::SIGXCPU, "SIGXCPU"),
        (libc::SIGXFSZ, "SIGXFSZ"),
        (libc::SIGSYS, "SIGSYS"),
    ];
    NAMES.iter().find(|(n, _)| *n == sig).map(|(_, name)| *name).unwrap_or("an unknown signal")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signal_is_a_crash_named_by_number_and_name() {
        // Raw wait statuses: a signal in the low bits, an exit code in the second byte.
        let end = NoAnswer::from_status(ExitStatus::from_raw(libc::SIGABRT));
        assert_eq!(end, NoAnswer::Signal(6));
        assert_eq!(
            end.line("./x/libbroken.so"),
            "plugin ./x/libbroken.so: the query process was killed by signal 6 (SIGABRT) while loading \
             and querying it, so the plugin crashed — fix it or remove it from the plugin path"
        );
        let segv = NoAnswer::from_status(ExitStatus::from_raw(libc::SIGSEGV)).line("p.so");
        assert!(segv.contains("signal 11 (SIGSEGV)"), "{segv}");
        assert!(NoAnswer::Signal(77).line("p.so").contains("signal 77 (an unknown signal)"));
    }

    #[test]
    fn an_exit_without_an_answer_names_its_status() {
        let end = NoAnswer::from_status(ExitStatus::from_raw(3 << 8));
        assert_eq!(end, NoAnswer::Exited(3));
        let line = end.line("p.so");
        assert!(line.starts_with("plugin p.so: the query process exited with status 3"), "{line}");
        assert!(line.contains("a plugin must not end the process"), "{line}");
    }

    #[test]
    fn a_timeout_names_the_limit_and_how_to_raise_it() {
        let line = NoAnswer::TimedOut(Duration::from_secs(3)).line("./x/libhang.so");
        assert!(line.starts_with("plugin ./x/libhang.so: no answer within 3 s"), "{line}");
        assert!(line.contains("killed (SIGKILL)") && line.contains("the plugin hangs"), "{line}");
        assert!(line.contains("--query-timeout") && line.contains(QUERY_TIMEOUT_ENV), "{line}");
    }

    #[test]
    fn every_line_is_one_line() {
        for end in [
            NoAnswer::Signal(libc::SIGSEGV),
            NoAnswer::Exited(1),
            NoAnswer::TimedOut(Duration::from_millis(1500)),
            NoAnswer::CannotRun("Resource temporarily unavailable (os error 11)".into()),
        ] {
            assert!(!end.line("p.so").contains('\n'), "{end:?}");
        }
    }
}
