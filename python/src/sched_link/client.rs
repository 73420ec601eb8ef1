//! The scheduler process's side: a [`SchedulerConnector`] whose every call runs in the worker
//! process ([`super::server`]). It connects on first use; a broken connection is dropped and
//! the call fails with an I/O error naming the socket (the worker process is gone or stuck).
//!
//! `update_state_after_alloc` answers nothing but success or an error, and vLLM's scheduler
//! always makes another call after it in the same pass (`build_connector_meta` at the latest).
//! So it is sent without waiting: its answer is read with the next call's, which the worker
//! process answers after it (one connection, served in order). One wait between the
//! processes fewer per request; an error it answers fails that next call instead, with the
//! connector's message, as it would have failed the pass before.

use super::{read_frame, write_frame, Call, Reply};
use kvconnect_api::{
    BlocksPerGroup, ConnectorError, ConnectorResult, KvEvent, MatchResult, Request, RequestFinished,
    SchedulerConnector, StepInfo,
};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

/// How long one call may take in the worker process. Generous: a loaded machine, a lookup
/// in a remote tier.
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// Answers to `update_state_after_alloc` left unread at most: past this many, the next one
/// waits for them all, so that the worker process never blocks writing answers that nobody
/// reads while this side blocks writing calls. A Unix socket charges each write to the
/// writer's buffer at a kilobyte or more, however small (about 200 KiB by default): 256
/// unread answers filled it in a test, 16 stay well below.
const MAX_UNANSWERED: usize = 16;

/// The scheduler half, reached in the worker process.
pub struct RemoteScheduler {
    name: String,
    path: PathBuf,
    stream: Option<UnixStream>,
    /// `update_state_after_alloc` calls sent whose answers are still unread.
    unanswered: usize,
}

impl RemoteScheduler {
    /// Calls the half served at `path` (connector `name`, for messages).
    pub fn new(name: &str, path: PathBuf) -> RemoteScheduler {
        RemoteScheduler { name: name.to_owned(), path, stream: None, unanswered: 0 }
    }

    fn io(&self, what: impl std::fmt::Display) -> ConnectorError {
        ConnectorError::Io {
            connector: self.name.clone(),
            message: format!(
                "the scheduler half in vLLM's worker process ({}): {what}; the worker process has stopped or \
                    is stuck, see its log",
                self.path.display()
            ),
        }
    }

    /// One call and its answer, after the answers still owed to calls sent without waiting:
    /// an error among those is this call's result.
    fn call(&mut self, call: &Call) -> ConnectorResult<(Reply, Option<Vec<u8>>)> {
        let r = self.send(call).and_then(|()| {
            let owed = self.read_unanswered()?;
            let answer = self.answer()?;
            Ok((owed, answer))
        });
        let (owed, (reply, extra)) = match r {
            Ok(r) => r,
            Err(e) => {
                self.drop_connection();
                return Err(e);
            }
        };
        match (owed, reply) {
            (Some(e), _) | (None, Reply::Error(e)) => Err(e),
            (None, reply) => Ok((reply, extra)),
        }
    }

    /// Sends a call whose answer is read with the next call's ([`call`](Self::call)).
    fn call_unanswered(&mut self, call: &Call) -> ConnectorResult<()> {
        let r = if self.unanswered >= MAX_UNANSWERED { self.read_unanswered() } else { Ok(None) };
        let r = r.and_then(|owed| self.send(call).map(|()| owed));
        match r {
            Ok(owed) => {
                self.unanswered += 1;
                owed.map_or(Ok(()), Err)
            }
            Err(e) => {
                self.drop_connection();
                Err(e)
            }
        }
    }

    fn drop_connection(&mut self) {
        self.stream = None;
        self.unanswered = 0;
    }

    fn send(&mut self, call: &Call) -> ConnectorResult<()> {
        if self.stream.is_none() {
            let s = UnixStream::connect(&self.path).map_err(|e| self.io(format!("cannot connect: {e}")))?;
            s.set_read_timeout(Some(CALL_TIMEOUT)).map_err(|e| self.io(e))?;
            s.set_write_timeout(Some(CALL_TIMEOUT)).map_err(|e| self.io(e))?;
            self.stream = Some(s);
        }
        let body = serde_json::to_vec(call).map_err(|e| self.io(format!("cannot encode the call: {e}")))?;
        let Some(stream) = self.stream.as_mut() else { return Err(self.io("not connected")) };
        write_frame(stream, &body).map_err(|e| self.io(e))
    }

    /// Reads the answers owed to calls sent without waiting: the first error the connector
    /// answered among them (`Ok(Some)`, the connection still in step), or why the exchange
    /// itself broke (`Err`).
    fn read_unanswered(&mut self) -> ConnectorResult<Option<ConnectorError>> {
        let mut first = None;
        while self.unanswered > 0 {
            let (reply, _) = self.answer()?;
            self.unanswered -= 1;
            match reply {
                Reply::Done => {}
                Reply::Error(e) => first = first.or(Some(e)),
                r => return Err(self.unexpected("update_state_after_alloc", r)),
            }
        }
        Ok(first)
    }

    /// Reads one answer (with the metadata's bytes after a `Meta` answer).
    fn answer(&mut self) -> ConnectorResult<(Reply, Option<Vec<u8>>)> {
        let Some(stream) = self.stream.as_mut() else { return Err(self.io("not connected")) };
        let frame = match read_frame(stream) {
            Ok(Some(f)) => f,
            Ok(None) => return Err(self.io("the connection closed")),
            Err(e) => return Err(self.io(e)),
        };
        let reply: Reply = serde_json::from_slice(&frame)
            .map_err(|e| self.io(format!("an answer that cannot be read: {e}")))?;
        if !matches!(reply, Reply::Meta) {
            return Ok((reply, None));
        }
        let Some(stream) = self.stream.as_mut() else { return Err(self.io("not connected")) };
        match read_frame(stream) {
            Ok(Some(bytes)) => Ok((reply, Some(bytes))),
            Ok(None) => Err(self.io("the connection closed inside an answer")),
            Err(e) => Err(self.io(e)),
        }
    }

    fn unexpected(&self, call: &str, reply: Reply) -> ConnectorError {
        self.io(format!("answered {call} with {reply:?}"))
    }
}

impl SchedulerConnector for RemoteScheduler {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult> {
        match self.call(&Call::Match { request: req.clone(), num_computed })? {
            (Reply::Matched(m), _) => Ok(m),
            (r, _) => Err(self.unexpected("get_num_new_matched_tokens", r)),
        }
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        num_external_tokens: usize,
    ) -> ConnectorResult<()> {
        let call =
            Call::Alloc { request: req.clone(), blocks: blocks.clone(), num_external: num_external_tokens };
        self.call_unanswered(&call)
    }

    fn build_connector_meta(&mut self, step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        match self.call(&Call::Meta { step: step.clone() })? {
            (Reply::Meta, Some(bytes)) => Ok(bytes),
            (r, _) => Err(self.unexpected("build_connector_meta", r)),
        }
    }

    fn request_finished(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        match self.call(&Call::Finished { request: req.clone(), blocks: blocks.clone() })? {
            (Reply::Finished(f), _) => Ok(f),
            (r, _) => Err(self.unexpected("request_finished", r)),
        }
    }

    fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
        match self.call(&Call::Events)? {
            (Reply::Events(e), _) => Ok(e),
            (r, _) => Err(self.unexpected("take_events", r)),
        }
    }

    fn reset_cache(&mut self) -> ConnectorResult<bool> {
        match self.call(&Call::Reset)? {
            (Reply::Reset(ok), _) => Ok(ok),
            (r, _) => Err(self.unexpected("reset_cache", r)),
        }
    }
}
