//! The scheduler link end to end: a half served on a socket, called through
//! [`client::RemoteScheduler`] as vLLM's scheduler process calls it.

use super::client::RemoteScheduler;
use super::server::SchedulerServer;
use kvconnect_api::{
    BlockId, BlocksPerGroup, ConnectorError, ConnectorResult, MatchResult, Request, RequestFinished,
    RequestId, SchedulerConnector, StepInfo,
};
use std::sync::{Arc, Mutex};

/// Records every call it serves, in order; refuses the allocation of request "bad".
struct Recorder(Arc<Mutex<Vec<String>>>);

impl Recorder {
    fn log(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }
}

impl SchedulerConnector for Recorder {
    fn get_num_new_matched_tokens(&mut self, req: &Request, _: usize) -> ConnectorResult<MatchResult> {
        self.log(format!("match {}", req.id.0));
        Ok(MatchResult::Matched { tokens: req.prompt_tokens.len() - 1, async_load: false })
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        b: &BlocksPerGroup,
        _: usize,
    ) -> ConnectorResult<()> {
        let ids: Vec<u32> = b.0.iter().flatten().map(|b| b.0).collect();
        self.log(format!("alloc {} {ids:?}", req.id.0));
        if req.id.0 == "bad" {
            return Err(ConnectorError::invalid("recorder", "request bad: its params name no producer"));
        }
        Ok(())
    }

    fn build_connector_meta(&mut self, step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        self.log(format!("meta {}", step.step));
        Ok(step.step.to_be_bytes().to_vec())
    }

    fn request_finished(&mut self, req: &Request, _: &BlocksPerGroup) -> ConnectorResult<RequestFinished> {
        self.log(format!("finished {}", req.id.0));
        Ok(RequestFinished { delay_free: true, transfer_params: None })
    }
}

fn req(id: &str, tokens: usize) -> Request {
    Request {
        id: RequestId(id.into()),
        prompt_tokens: (0..tokens as u32).collect(),
        kv_transfer_params: Default::default(),
    }
}

fn blocks(ids: &[u32]) -> BlocksPerGroup {
    BlocksPerGroup(vec![ids.iter().map(|&b| BlockId(b)).collect()])
}

fn step(n: u64) -> StepInfo {
    StepInfo { step: n, ..Default::default() }
}

fn served() -> (SchedulerServer, RemoteScheduler, Arc<Mutex<Vec<String>>>) {
    let calls = Arc::new(Mutex::new(Vec::new()));
    let server = SchedulerServer::start("recorder", Box::new(Recorder(calls.clone()))).unwrap();
    let client = RemoteScheduler::new("recorder", server.path().to_owned());
    (server, client, calls)
}

#[test]
fn an_allocation_is_served_in_order_before_the_next_call_answers() {
    let (_server, mut c, calls) = served();
    let r = req("a", 410);
    assert_eq!(
        c.get_num_new_matched_tokens(&r, 0).unwrap(),
        MatchResult::Matched { tokens: 409, async_load: false }
    );
    c.update_state_after_alloc(&r, &blocks(&[1, 2, 3, 4]), 409).unwrap();
    c.update_state_after_alloc(&req("b", 8), &blocks(&[5]), 0).unwrap();
    assert_eq!(c.build_connector_meta(&step(7)).unwrap(), 7u64.to_be_bytes());
    assert!(c.request_finished(&r, &BlocksPerGroup::default()).unwrap().delay_free);
    assert_eq!(
        *calls.lock().unwrap(),
        ["match a", "alloc a [1, 2, 3, 4]", "alloc b [5]", "meta 7", "finished a"]
    );
}

#[test]
fn a_refused_allocation_fails_the_next_call_with_the_connectors_message_and_the_link_goes_on() {
    let (_server, mut c, calls) = served();
    c.update_state_after_alloc(&req("bad", 8), &blocks(&[1]), 0).unwrap();
    c.update_state_after_alloc(&req("ok", 8), &blocks(&[2]), 0).unwrap();
    let e = c.build_connector_meta(&step(1)).unwrap_err();
    assert!(e.to_string().contains("request bad: its params name no producer"), "{e}");
    // The call itself was served, after the allocations, and the link is in step.
    assert_eq!(c.build_connector_meta(&step(2)).unwrap(), 2u64.to_be_bytes());
    assert_eq!(*calls.lock().unwrap(), ["alloc bad [1]", "alloc ok [2]", "meta 1", "meta 2"]);
}

#[test]
fn many_allocations_without_another_call_never_block_either_side() {
    let (_server, mut c, calls) = served();
    // Past the cap of unread answers, each with a long prompt: the client waits for the
    // answers in turn instead of filling both sockets' buffers.
    let n = 2_000;
    for i in 0..n {
        c.update_state_after_alloc(&req(&format!("r{i}"), 4_096), &blocks(&[i]), 0).unwrap();
    }
    assert_eq!(c.build_connector_meta(&step(9)).unwrap(), 9u64.to_be_bytes());
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), n as usize + 1);
    assert_eq!(calls.last().unwrap(), "meta 9");
}

#[test]
fn a_worker_process_that_is_gone_fails_the_call_with_an_io_error_naming_the_socket() {
    let (server, mut c, _) = served();
    c.update_state_after_alloc(&req("a", 8), &blocks(&[1]), 0).unwrap();
    let path = server.path().to_owned();
    drop(server);
    let mut gone = RemoteScheduler::new("recorder", path.clone());
    let e = gone.build_connector_meta(&step(1)).unwrap_err();
    assert!(matches!(e, ConnectorError::Io { .. }), "{e:?}");
    assert!(e.to_string().contains(&path.display().to_string()), "{e}");
}

/// Panics in `build_connector_meta` at step 3.
struct PanicsAtStep3;

impl SchedulerConnector for PanicsAtStep3 {
    fn get_num_new_matched_tokens(&mut self, _: &Request, _: usize) -> ConnectorResult<MatchResult> {
        Ok(MatchResult::Matched { tokens: 0, async_load: false })
    }

    fn update_state_after_alloc(&mut self, _: &Request, _: &BlocksPerGroup, _: usize) -> ConnectorResult<()> {
        Ok(())
    }

    fn build_connector_meta(&mut self, step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        assert_ne!(step.step, 3, "the test's panic in step three");
        Ok(Vec::new())
    }

    fn request_finished(&mut self, _: &Request, _: &BlocksPerGroup) -> ConnectorResult<RequestFinished> {
        Ok(RequestFinished { delay_free: false, transfer_params: None })
    }
}

#[test]
fn a_connector_that_panics_answers_the_panic_then_refuses_every_call_as_poisoned() {
    let server = SchedulerServer::start("panicky", Box::new(PanicsAtStep3)).unwrap();
    let mut c = RemoteScheduler::new("panicky", server.path().to_owned());
    assert!(c.build_connector_meta(&step(2)).is_ok());
    let e = c.build_connector_meta(&step(3)).unwrap_err();
    assert!(
        matches!(&e, ConnectorError::Panicked { method, message, .. }
            if method == "build_connector_meta" && message.contains("the test's panic in step three")),
        "{e:?}"
    );
    // The same connection answers on, and so does a new one: every call refused with the panic.
    for e in [c.get_num_new_matched_tokens(&req("a", 8), 0).unwrap_err(), {
        let mut again = RemoteScheduler::new("panicky", server.path().to_owned());
        again.build_connector_meta(&step(4)).unwrap_err()
    }] {
        assert!(
            matches!(&e, ConnectorError::Poisoned { message, .. }
                if message.contains("in build_connector_meta") && message.contains("step three")),
            "{e:?}"
        );
        assert!(e.poisons_instance());
    }
}

/// A socket in a fresh directory for a scripted worker process to serve by hand.
fn worker_socket() -> (kvconnect_cache_dir::CacheDir, std::path::PathBuf, std::os::unix::net::UnixListener) {
    let dir =
        kvconnect_cache_dir::CacheDir::create_unique(&std::env::temp_dir(), "kvconnect-link-test", "TMPDIR")
            .unwrap();
    let path = dir.path().join("scheduler.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    (dir, path, listener)
}

/// Reads one call on `s` and answers it as a `build_connector_meta` with `bytes`.
fn answer_meta(s: &mut std::os::unix::net::UnixStream, bytes: &[u8]) {
    let _ = super::read_frame(s).unwrap().unwrap();
    super::write_frame(s, &serde_json::to_vec(&super::Reply::Meta).unwrap()).unwrap();
    super::write_frame(s, bytes).unwrap();
}

#[test]
fn a_worker_process_that_dies_inside_a_call_fails_it_with_an_io_error_and_the_next_call_reconnects() {
    let (dir, path, listener) = worker_socket();
    // A worker that reads the call and is gone before it answers; then, on the next
    // connection, one that serves.
    let dying = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let call = super::read_frame(&mut s).unwrap().unwrap();
        drop(s);
        (listener, call)
    });
    let mut c = RemoteScheduler::new("recorder", path.clone());
    let started = std::time::Instant::now();
    let e = c.build_connector_meta(&step(1)).unwrap_err();
    assert!(started.elapsed() < std::time::Duration::from_secs(10), "no wait for the call's time limit");
    assert!(matches!(e, ConnectorError::Io { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains(&path.display().to_string()) && text.contains("closed"), "{text}");
    let (listener, call) = dying.join().unwrap();
    assert!(String::from_utf8_lossy(&call).contains("\"meta\""));
    let serving = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        answer_meta(&mut s, b"m2");
    });
    assert_eq!(c.build_connector_meta(&step(2)).unwrap(), b"m2");
    serving.join().unwrap();
    std::fs::remove_dir_all(dir.path()).unwrap();
}

/// Answers `get_num_new_matched_tokens` only once every one of `n` halves sharing `met` is
/// inside the same call: served one after another, the first would wait alone.
struct Rendezvous {
    met: Arc<(Mutex<usize>, std::sync::Condvar)>,
    n: usize,
}

impl SchedulerConnector for Rendezvous {
    fn get_num_new_matched_tokens(&mut self, _: &Request, _: usize) -> ConnectorResult<MatchResult> {
        let (count, cv) = &*self.met;
        let mut c = count.lock().unwrap();
        *c += 1;
        cv.notify_all();
        let (c, waited) =
            cv.wait_timeout_while(c, std::time::Duration::from_secs(5), |c| *c < self.n).unwrap();
        if waited.timed_out() {
            return Err(ConnectorError::invalid(
                "rendezvous",
                format!("{} of {} halves were called at once", *c, self.n),
            ));
        }
        Ok(MatchResult::Matched { tokens: 1, async_load: false })
    }

    fn update_state_after_alloc(&mut self, _: &Request, _: &BlocksPerGroup, _: usize) -> ConnectorResult<()> {
        Ok(())
    }

    fn build_connector_meta(&mut self, _: &StepInfo) -> ConnectorResult<Vec<u8>> {
        Ok(Vec::new())
    }

    fn request_finished(&mut self, _: &Request, _: &BlocksPerGroup) -> ConnectorResult<RequestFinished> {
        Ok(RequestFinished { delay_free: false, transfer_params: None })
    }
}

#[test]
fn every_rank_is_called_before_any_answer_is_read() {
    let met = Arc::new((Mutex::new(0), std::sync::Condvar::new()));
    let servers: Vec<SchedulerServer> = (0..4)
        .map(|_| {
            SchedulerServer::start("rendezvous", Box::new(Rendezvous { met: met.clone(), n: 4 })).unwrap()
        })
        .collect();
    let mut halves: Vec<RemoteScheduler> =
        servers.iter().map(|s| RemoteScheduler::new("rendezvous", s.path().to_owned())).collect();
    let r = req("a", 410);
    let each = super::client::call_each(
        &mut halves,
        |_| super::Call::Match { request: r.clone(), num_computed: 0 },
        RemoteScheduler::read_match,
    );
    for m in each {
        assert_eq!(m.unwrap(), MatchResult::Matched { tokens: 1, async_load: false });
    }
}

#[test]
fn a_rank_that_is_gone_fails_its_call_and_the_other_ranks_stay_in_step() {
    let (live, live_client, calls) = served();
    let (gone, gone_client, _) = served();
    let gone_path = gone.path().to_owned();
    drop(gone);
    let mut halves = [live_client, gone_client];
    // An allocation owed on the live rank is read with the calls' answers.
    halves[0].update_state_after_alloc(&req("a", 8), &blocks(&[1]), 0).unwrap();
    let meta = |h: &mut [RemoteScheduler; 2], n: u64| {
        super::client::call_each(h, |_| super::Call::Meta { step: step(n) }, RemoteScheduler::read_meta)
    };
    let each = meta(&mut halves, 1);
    assert_eq!(each[0].as_ref().unwrap(), &1u64.to_be_bytes());
    let e = each[1].as_ref().unwrap_err();
    assert!(
        matches!(e, ConnectorError::Io { .. }) && e.to_string().contains(&gone_path.display().to_string()),
        "{e}"
    );
    let each = meta(&mut halves, 2);
    assert_eq!(each[0].as_ref().unwrap(), &2u64.to_be_bytes());
    assert!(each[1].is_err());
    assert_eq!(*calls.lock().unwrap(), ["alloc a [1]", "meta 1", "meta 2"]);
    drop(live);
}

#[test]
fn a_worker_process_stuck_inside_a_call_fails_it_after_the_time_limit_and_the_next_call_reconnects() {
    let (dir, path, listener) = worker_socket();
    // A worker that reads the call and never answers (its connection stays open until the
    // test ends); then, on the next connection, one that serves.
    let (stuck_tx, stuck_rx) = std::sync::mpsc::channel::<()>();
    let worker = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let _ = super::read_frame(&mut s).unwrap().unwrap();
        let (mut s2, _) = listener.accept().unwrap();
        answer_meta(&mut s2, b"m2");
        let _ = stuck_rx.recv();
        drop(s);
    });
    let mut c =
        RemoteScheduler::new("recorder", path.clone()).with_timeout(std::time::Duration::from_millis(300));
    let e = c.build_connector_meta(&step(1)).unwrap_err();
    assert!(matches!(e, ConnectorError::Io { .. }), "{e:?}");
    let text = e.to_string();
    assert!(text.contains("no answer within 0.3 s") && text.contains(&path.display().to_string()), "{text}");
    assert_eq!(c.build_connector_meta(&step(2)).unwrap(), b"m2", "a new connection, answered");
    stuck_tx.send(()).unwrap();
    worker.join().unwrap();
    std::fs::remove_dir_all(dir.path()).unwrap();
}
