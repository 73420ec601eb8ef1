//! Backend `tcp`: any two hosts. The blocks travel over the producer's listener: a direct
//! plan is cut into one share per stream (several for a large pull), each a `read` on its own
//! authenticated connection, received straight into its destination blocks on a thread of its
//! own; the producer answers each with `writev` straight out of its regions
//! ([`crate::tcp_data`]). An adapting plan is read on the control connection and scattered.
//! The connections are the puller's, lent to the copy as [`Streams`]; the puller sends no
//! message before it (the producer checks each read itself) and `done` after it.

use super::{host_memory, planned, BackendInfo, Confirm, Pin, PullSteps, Setup, Started, Streams, Transport};
use crate::copy_plan::{CopyPlan, LocalRegions};
use crate::error::TransferError;
use crate::metadata::{LoadSpec, PeerInfo};
use crate::puller::PullStats;
use crate::tcp_data::ShareError;
use crate::wire::{ClientMsg, ServerMsg};
use kvconnect_api::kv_memory::KvMemory;
use kvconnect_api::{ConnectorResult, LayerId, MemoryKind};
use std::io::Read;
use std::sync::Arc;

/// Its entry in [`super::BACKENDS`].
pub static BACKEND: BackendInfo = BackendInfo {
    name: "tcp",
    aliases: &[],
    offer: "\"tcp\" (any hosts)",
    across_tp: true,
    carries_state: true,
    // Its copies read and write host memory only.
    memory_kinds: &[MemoryKind::Host],
    serves_reads: true,
    shm_regions: false,
    available: || Ok(()),
    start,
};

fn start(s: &Setup<'_>) -> ConnectorResult<Started> {
    let tcp = Tcp::new(s.cfg.tcp_streams, s.cfg.tcp_stream_min_bytes);
    Ok(Started { mem: host_memory(s)?, transport: Arc::new(tcp) })
}

/// The started backend.
#[derive(Debug)]
pub struct Tcp {
    streams: usize,
    stream_min_bytes: u64,
}

impl Tcp {
    /// Receives a large pull on up to `streams` connections, each carrying at least
    /// `stream_min_bytes` ([`crate::tcp_data::streams_for`]).
    pub fn new(streams: usize, stream_min_bytes: u64) -> Tcp {
        Tcp { streams, stream_min_bytes }
    }

    fn read_msg(load: &LoadSpec, runs: Vec<(u32, u64, u64)>) -> ClientMsg {
        ClientMsg::Read {
            request: load.producer_request().to_owned(),
            capability: load.remote_capability.clone(),
            runs,
        }
    }

    /// A direct plan: its runs cut into one share per stream, each asked for on its own
    /// connection and received into place, the streams on threads of their own. When a kept
    /// connection turns out closed by the producer before it answered (closed as idle just as
    /// the read went out), every share is asked for once more on new connections: a share
    /// received again lands the same bytes in the same place ([`crate::idle_link`]).
    fn receive(
        &self,
        conns: &mut Streams<'_>,
        dst: &mut LocalRegions,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<(), TransferError> {
        let (kept, mut failed) = self.receive_shares(conns, dst, load, plan)?;
        if kept && matches!(failed, Some(ShareError::Closed(_))) {
            tracing::debug!(request = %load.request, "nixl: a kept connection was closed by the producer \
                before it answered a read; reading again on new connections");
            conns.close();
            failed = self.receive_shares(conns, dst, load, plan)?.1;
        }
        if let Some(e) = failed {
            let e = share_err(conns, e);
            // Another stream may have stopped mid-answer: reuse none of them.
            conns.close();
            return Err(e);
        }
        Ok(())
    }

    /// One round of [`Tcp::receive`]: whether any connection was kept from before, and the
    /// first share's failure.
    fn receive_shares(
        &self,
        conns: &mut Streams<'_>,
        dst: &mut LocalRegions,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<(bool, Option<ShareError>), TransferError> {
        let CopyPlan::Direct(runs) = plan else {
            return Err(TransferError::Plan("an adapting plan is received on one stream".into()));
        };
        let n = crate::tcp_data::streams_for(plan.total_bytes(), self.streams, self.stream_min_bytes);
        let shares = crate::copy_plan::split_runs(runs, n);
        let views = dst.views(&shares)?;
        let reads: Vec<ClientMsg> = shares
            .iter()
            .map(|share| {
                Tcp::read_msg(load, share.iter().map(|r| (r.src_region, r.src_off, r.len)).collect())
            })
            .collect();
        let cap = conns.config().max_frame;
        let (kept, streams) = conns.streams(shares.len())?;
        let mut jobs = streams.iter_mut().zip(reads.iter()).zip(views);
        let results: Vec<Result<(), ShareError>> =
            match jobs.next() {
                None => Vec::new(),
                Some(((s, read), v)) => std::thread::scope(|scope| {
                    let rest: Vec<_> = jobs
                        .map(|((s, read), v)| {
                            scope.spawn(move || crate::tcp_data::receive_share(s, read, v, cap))
                        })
                        .collect();
                    let mut out = vec![crate::tcp_data::receive_share(s, read, v, cap)];
                    for h in rest {
                        out.push(h.join().unwrap_or_else(|_| {
                            Err(ShareError::Protocol("a receiving thread panicked".into()))
                        }));
                    }
                    out
                }),
            };
        Ok((kept > 0, results.into_iter().find_map(Result::err)))
    }

    /// An adapting plan: one `read` of its source blocks on the control connection, each
    /// scattered into this engine's layout as it arrives.
    fn receive_adapting(
        conns: &mut Streams<'_>,
        dst: &mut LocalRegions,
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: &CopyPlan,
    ) -> Result<(), TransferError> {
        let total = plan.total_bytes();
        let engine = || peer.meta.engine_id.clone();
        match conns.call(&Tcp::read_msg(load, plan.src_runs()))? {
            ServerMsg::Data { bytes } if bytes == total => {}
            ServerMsg::Error { reason } => return Err(TransferError::Refused { engine: engine(), reason }),
            other => {
                return Err(TransferError::Protocol {
                    engine: engine(),
                    message: format!("answered {other:?} to a read of {total} bytes"),
                })
            }
        }
        if let CopyPlan::Adapt(bs) = plan {
            let mut scratch = Vec::new();
            for b in bs {
                scratch.resize(b.len as usize, 0);
                let read = conns.control()?.read_exact(&mut scratch);
                read.map_err(|e| conns.io("reading block data", e))?;
                dst.scatter(&peer.geometry, load, b, &scratch)?;
            }
        }
        Ok(())
    }
}

fn share_err(conns: &Streams<'_>, e: ShareError) -> TransferError {
    match e {
        ShareError::Frame(f) => conns.frame_err("asking", f),
        ShareError::Io(e) => conns.io("reading block data", e),
        ShareError::Closed(e) => conns.io("asking", e),
        ShareError::Refused(reason) => conns.refused(reason),
        ShareError::Protocol(message) => conns.protocol(message),
    }
}

impl Transport for Tcp {
    fn backend(&self) -> super::Backend {
        super::Backend::of(&BACKEND)
    }

    fn steps(&self) -> PullSteps {
        PullSteps { plan: true, before: Pin::Nothing, after: Confirm::Done }
    }

    fn copy(
        &self,
        conns: Option<&mut Streams<'_>>,
        local: &KvMemory,
        _: &[Vec<LayerId>],
        peer: &PeerInfo,
        load: &LoadSpec,
        plan: Option<&CopyPlan>,
    ) -> Result<PullStats, TransferError> {
        let plan = planned(plan)?;
        let conns = conns.ok_or_else(|| {
            TransferError::Plan(
                "backend tcp receives over the producer's connections, and was lent none".into(),
            )
        })?;
        let mut dst = LocalRegions::new(local);
        match plan {
            CopyPlan::Direct(_) => self.receive(conns, &mut dst, load, plan)?,
            CopyPlan::Adapt(_) => Tcp::receive_adapting(conns, &mut dst, peer, load, plan)?,
        }
        Ok(PullStats::of(plan))
    }
}
