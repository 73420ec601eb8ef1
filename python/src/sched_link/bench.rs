//! What calling every tensor-parallel rank's half at once ([`client::call_each`]) saves
//! against calling them one after another, as the scheduler did before: a request's calls on
//! its path to the first token (match with a 410-token prompt, the allocation sent without
//! waiting, the step's metadata, finished), to 2 and 4 halves served on sockets in this
//! process, one thread each, with a connector that does nothing. Interleaved pairs of 200
//! requests each; the ratio is one-after-another's time over at-once's.
//!
//! A benchmark, not a test (the crate is a Python extension module: no `cargo bench` target):
//!
//!     cargo test --release -p kvconnect-python --lib sched_link::bench -- --ignored --nocapture
//!
//! `SCHED_LINK_BENCH_PAIRS` sets the pairs (21).

use super::client::{self, RemoteScheduler};
use super::server::SchedulerServer;
use super::Call;
use kvconnect_api::{
    BlocksPerGroup, ConnectorResult, MatchResult, Request, RequestFinished, RequestId, SchedulerConnector,
    StepInfo,
};
use kvconnect_support::stats::{interleaved_timed, Machine};

/// A scheduler half that answers at once.
struct Idle;

impl SchedulerConnector for Idle {
    fn get_num_new_matched_tokens(&mut self, _: &Request, _: usize) -> ConnectorResult<MatchResult> {
        Ok(MatchResult::Matched { tokens: 0, async_load: false })
    }

    fn update_state_after_alloc(&mut self, _: &Request, _: &BlocksPerGroup, _: usize) -> ConnectorResult<()> {
        Ok(())
    }

    fn build_connector_meta(&mut self, _: &StepInfo) -> ConnectorResult<Vec<u8>> {
        Ok(vec![0; 64])
    }

    fn request_finished(&mut self, _: &Request, _: &BlocksPerGroup) -> ConnectorResult<RequestFinished> {
        Ok(RequestFinished { delay_free: false, transfer_params: None })
    }
}

const REQUESTS: usize = 200;

fn request(i: usize) -> Request {
    Request {
        id: RequestId(format!("r{i}")),
        prompt_tokens: (0..410).collect(),
        kv_transfer_params: Default::default(),
    }
}

/// One request's calls to each half, one half after another.
fn one_after_another(halves: &mut [RemoteScheduler], i: usize) {
    let (r, b, step) =
        (request(i), BlocksPerGroup::default(), StepInfo { step: i as u64, ..Default::default() });
    for h in halves.iter_mut() {
        h.get_num_new_matched_tokens(&r, 0).unwrap();
    }
    for h in halves.iter_mut() {
        h.update_state_after_alloc(&r, &b, 0).unwrap();
    }
    for h in halves.iter_mut() {
        h.build_connector_meta(&step).unwrap();
    }
    for h in halves.iter_mut() {
        h.request_finished(&r, &b).unwrap();
    }
}

/// Every call answered.
fn ok<T>(answers: Vec<ConnectorResult<T>>) {
    for a in answers {
        a.unwrap();
    }
}

/// The same calls, each to every half at once.
fn at_once(halves: &mut [RemoteScheduler], i: usize) {
    let (r, b, step) =
        (request(i), BlocksPerGroup::default(), StepInfo { step: i as u64, ..Default::default() });
    ok(client::call_each(
        &mut *halves,
        |_| Call::Match { request: r.clone(), num_computed: 0 },
        RemoteScheduler::read_match,
    ));
    for h in halves.iter_mut() {
        h.update_state_after_alloc(&r, &b, 0).unwrap();
    }
    ok(client::call_each(&mut *halves, |_| Call::Meta { step: step.clone() }, RemoteScheduler::read_meta));
    ok(client::call_each(
        &mut *halves,
        |_| Call::Finished { request: r.clone(), blocks: b.clone() },
        RemoteScheduler::read_finished,
    ));
}

#[test]
#[ignore = "a benchmark: run with --release -- --ignored --nocapture"]
fn bench() {
    let pairs = std::env::var("SCHED_LINK_BENCH_PAIRS").ok().and_then(|p| p.parse().ok()).unwrap_or(21);
    for ranks in [2, 4] {
        let machine = Machine::start();
        let servers: Vec<SchedulerServer> =
            (0..ranks).map(|_| SchedulerServer::start("idle", Box::new(Idle)).unwrap()).collect();
        let mut seq: Vec<RemoteScheduler> =
            servers.iter().map(|s| RemoteScheduler::new("idle", s.path().to_owned())).collect();
        let mut par: Vec<RemoteScheduler> =
            servers.iter().map(|s| RemoteScheduler::new("idle", s.path().to_owned())).collect();
        let p = interleaved_timed(
            pairs,
            2,
            || (0..REQUESTS).for_each(|i| one_after_another(&mut seq, i)),
            || (0..REQUESTS).for_each(|i| at_once(&mut par, i)),
        );
        println!(
            "{ranks} ranks, a request's scheduler calls, one rank after another / all ranks at once: {:.3} \
             ({:.3}-{:.3}), {pairs} pairs of {REQUESTS} requests; per request {:.1} us against {:.1} us; {}",
            p.ratio.median,
            p.ratio.q1,
            p.ratio.q3,
            p.baseline_s.median / REQUESTS as f64 * 1e6,
            p.subject_s.median / REQUESTS as f64 * 1e6,
            machine.finish()
        );
    }
}
