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
//!
//! At several tensor-parallel ranks the scheduler calls every rank's half; [`call_each`] sends
//! each rank its call before it reads any answer, so that the ranks' worker processes serve
//! them together.

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

/// A call's answer: the reply, and the metadata's bytes after a `Meta` reply.
pub type Answer = (Reply, Option<Vec<u8>>);

/// The scheduler half, reached in the worker process.
pub struct RemoteScheduler {
    name: String,
    path: PathBuf,
    stream: Option<UnixStream>,
    /// `update_state_after_alloc` calls sent whose answers are still unread.
    unanswered: usize,
    /// How long one call may take ([`CALL_TIMEOUT`]).
    timeout: Duration,
}

impl RemoteScheduler {
    /// Calls the half served at `path` (connector `name`, for messages).
    pub fn new(name: &str, path: PathBuf) -> RemoteScheduler {
        RemoteScheduler { name: name.to_owned(), path, stream: None, unanswered: 0, timeout: CALL_TIMEOUT }
    }

    /// The same, with calls that may take `timeout` (tests).
    #[cfg(test)]
    pub fn with_timeout(mut self, timeout: Duration) -> RemoteScheduler {
        self.timeout = timeout;
        self
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

    /// Sends `call`; [`finish`](Self::finish) reads its answer. A call that cannot be sent
    /// drops the connection.
    fn start(&mut self, call: &Call) -> ConnectorResult<()> {
        let r = self.send(call);
        if r.is_err() {
            self.drop_connection();
        }
        r
    }

    /// The answer to the call [`start`](Self::start) sent, after the answers still owed to
    /// calls sent without waiting: an error among those is this call's result.
    fn finish(&mut self) -> ConnectorResult<Answer> {
        let r = self.read_unanswered().and_then(|owed| Ok((owed, self.answer()?)));
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

    /// One call and its answer.
    fn call(&mut self, call: &Call) -> ConnectorResult<Answer> {
        self.start(call)?;
        self.finish()
    }

    /// The answer to a `Match`.
    pub fn read_match(&self, a: Answer) -> ConnectorResult<MatchResult> {
        match a {
            (Reply::Matched(m), _) => Ok(m),
            (r, _) => Err(self.unexpected("get_num_new_matched_tokens", r)),
        }
    }

    /// The answer to a `Meta`: the metadata's bytes.
    pub fn read_meta(&self, a: Answer) -> ConnectorResult<Vec<u8>> {
        match a {
            (Reply::Meta, Some(bytes)) => Ok(bytes),
            (r, _) => Err(self.unexpected("build_connector_meta", r)),
        }
    }

    /// The answer to a `Finished`.
    pub fn read_finished(&self, a: Answer) -> ConnectorResult<RequestFinished> {
        match a {
            (Reply::Finished(f), _) => Ok(f),
            (r, _) => Err(self.unexpected("request_finished", r)),
        }
    }

    /// The answer to a `Reset`.
    pub fn read_reset(&self, a: Answer) -> ConnectorResult<bool> {
        match a {
            (Reply::Reset(ok), _) => Ok(ok),
            (r, _) => Err(self.unexpected("reset_cache", r)),
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
            s.set_read_timeout(Some(self.timeout)).map_err(|e| self.io(e))?;
            s.set_write_timeout(Some(self.timeout)).map_err(|e| self.io(e))?;
            self.stream = Some(s);
        }
        let body = serde_json::to_vec(call).map_err(|e| self.io(format!("cannot encode the call: {e}")))?;
        let Some(stream) = self.stream.as_mut() else { return Err(self.io("not connected")) };
        write_frame(stream, &body).map_err(|e| self.io_failed(e, "the call not taken"))
    }

    /// An I/O error of the link; a timeout says what did not come in time (`late`: "no
    /// answer", "the call not taken").
    fn io_failed(&self, e: std::io::Error, late: &str) -> ConnectorError {
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                self.io(format!("{late} within {} s", self.timeout.as_secs_f64()))
            }
            _ => self.io(e),
        }
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
    fn answer(&mut self) -> ConnectorResult<Answer> {
        let Some(stream) = self.stream.as_mut() else { return Err(self.io("not connected")) };
        let frame = match read_frame(stream) {
            Ok(Some(f)) => f,
            Ok(None) => return Err(self.io("the connection closed")),
            Err(e) => return Err(self.io_failed(e, "no answer")),
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
            Err(e) => Err(self.io_failed(e, "no answer")),
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
        let a = self.call(&Call::Match { request: req.clone(), num_computed })?;
        self.read_match(a)
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
        let a = self.call(&Call::Meta { step: step.clone() })?;
        self.read_meta(a)
    }

    fn request_finished(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        let a = self.call(&Call::Finished { request: req.clone(), blocks: blocks.clone() })?;
        self.read_finished(a)
    }

    fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
        match self.call(&Call::Events)? {
            (Reply::Events(e), _) => Ok(e),
            (r, _) => Err(self.unexpected("take_events", r)),
        }
    }

    fn reset_cache(&mut self) -> ConnectorResult<bool> {
        let a = self.call(&Call::Reset)?;
        self.read_reset(a)
    }
}

/// One call to each of several halves at once (vLLM's tensor-parallel ranks, each served in
/// its own worker process): every call is sent before any answer is read, so the worker
/// processes serve them together and the wait is about the slowest one's, not their sum.
/// Every half a call went out to has its answer read, also after another's error, so that
/// each connection stays in step. `call(i)` is the call of the `i`th half; `read` turns each
/// answer into its result; the results are in the halves' order.
pub fn call_each<'a, T>(
    halves: impl IntoIterator<Item = &'a mut RemoteScheduler>,
    call: impl Fn(usize) -> Call,
    read: impl Fn(&RemoteScheduler, Answer) -> ConnectorResult<T>,
) -> Vec<ConnectorResult<T>> {
    let mut halves: Vec<&mut RemoteScheduler> = halves.into_iter().collect();
    let sent: Vec<ConnectorResult<()>> =
        halves.iter_mut().enumerate().map(|(i, h)| h.start(&call(i))).collect();
    halves
        .into_iter()
        .zip(sent)
        .map(|(h, sent)| sent.and_then(|()| h.finish()).and_then(|a| read(h, a)))
        .collect()
}
