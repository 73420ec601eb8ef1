//! A subcommand's exit status other than success, carried as an error so `main` returns it:
//! 1 for "ran fine, the answer is no" (a conflict, an incompatible deployment), 2 for bad
//! input (with the message `main` prints).

use std::fmt;

/// Exit with `code`; print `error: <message>` first when there is one.
#[derive(Debug)]
pub struct Exit {
    /// The process exit code.
    pub code: u8,
    /// What to print on stderr, if anything.
    pub error: Option<anyhow::Error>,
}

impl Exit {
    /// Exit code 1: the command printed its answer (a conflict, a diff) already.
    pub fn negative() -> anyhow::Error {
        anyhow::Error::new(Exit { code: 1, error: None })
    }

    /// Exit code 2: bad input.
    pub fn bad_input(e: anyhow::Error) -> anyhow::Error {
        anyhow::Error::new(Exit { code: 2, error: Some(e) })
    }

    /// Maps a subcommand's (exit code | bad input) to `run`'s result.
    pub fn from_result(r: anyhow::Result<u8>) -> anyhow::Result<()> {
        match r {
            Ok(0) => Ok(()),
            Ok(_) => Err(Exit::negative()),
            Err(e) => Err(Exit::bad_input(e)),
        }
    }
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.error {
            Some(e) => write!(f, "{e:#}"),
            None => write!(f, "exit status {}", self.code),
        }
    }
}

impl std::error::Error for Exit {}
