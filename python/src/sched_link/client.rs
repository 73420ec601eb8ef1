//! The scheduler process's side: a [`SchedulerConnector`] whose every call runs in the worker
//! process ([`super::server`]). It connects on first use; a broken connection is dropped and
//! the call fails with an I/O error naming the socket (the worker process is gone or stuck).

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

/// The scheduler half, reached in the worker process.
pub struct RemoteScheduler {
    name: String,
    path: PathBuf,
    stream: Option<UnixStream>,
}

impl RemoteScheduler {
    /// Calls the half served at `path` (connector `name`, for messages).
    pub fn new(name: &str, path: PathBuf) -> RemoteScheduler {
        RemoteScheduler { name: name.to_owned(), path, stream: None }
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

    fn call(&mut self, call: &Call) -> ConnectorResult<(Reply, Option<Vec<u8>>)> {
        let r = self.exchange(call);
        if r.is_err() {
            self.stream = None;
        }
        let (reply, extra) = r?;
        match reply {
            Reply::Error(e) => Err(e),
            reply => Ok((reply, extra)),
        }
    }

    fn exchange(&mut self, call: &Call) -> ConnectorResult<(Reply, Option<Vec<u8>>)> {
        if self.stream.is_none() {
            let s = UnixStream::connect(&self.path).map_err(|e| self.io(format!("cannot connect: {e}")))?;
            s.set_read_timeout(Some(CALL_TIMEOUT)).map_err(|e| self.io(e))?;
            s.set_write_timeout(Some(CALL_TIMEOUT)).map_err(|e| self.io(e))?;
            self.stream = Some(s);
        }
        let body = serde_json::to_vec(call).map_err(|e| self.io(format!("cannot encode the call: {e}")))?;
        let Some(stream) = self.stream.as_mut() else { return Err(self.io("not connected")) };
        let res = write_frame(stream, &body).and_then(|()| read_frame(stream));
        let frame = match res {
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
        match self.call(&call)? {
            (Reply::Done, _) => Ok(()),
            (r, _) => Err(self.unexpected("update_state_after_alloc", r)),
        }
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
