//! The baseline of `kvconnect bench transfer --backend nixl`: the connector's transfer done
//! with bare `nixl-sys` calls and nothing of kvconnect around them, between two processes,
//! as the connector's is.
//!
//! The source process ([`serve_source`], `kvconnect bench nixl-raw-peer`) registers one
//! buffer of [`Shape::runs`] runs, each followed by a gap (so NIXL cannot merge runs that
//! the connector's regions keep apart), fills it with a pattern and prints its agent's
//! metadata. The reading process ([`RawNixlRead`]) registers a buffer of the same shape,
//! prepares both as lists of [`Shape::unit`]-byte entries once, as the connector does per
//! producer, and each measurement makes, posts and polls one READ of every entry (NIXL
//! merges the entries of a run back into one), polling the way the connector's pull thread
//! does; then it checks every byte.

#![allow(unsafe_code)] // NIXL bindings: raw buffers handed to the NIXL C API.

use kvconnect_dataplane::hex::{from_hex, to_hex};
use kvconnect_nixl::nixl_agent::{status_name, NixlCallError};
use kvconnect_support::host_buffer::HostBuffer;
use nixl_sys::{
    Agent, MemType, MemoryRegion, NixlDescriptor, NixlError, RegistrationHandle, XferDescList,
    XferDlistHandle, XferOp, XferStatus,
};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// What one READ moves: `runs` runs of `run_bytes`, each cut into `unit`-byte entries, one
/// `gap_bytes` gap after each run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shape {
    /// Runs (the connector's coalesced runs: one per KV layer and K/V part).
    pub runs: usize,
    /// Bytes of each run.
    pub run_bytes: usize,
    /// Bytes between runs, never read.
    pub gap_bytes: usize,
    /// Bytes of each prepared entry (the connector's: one layer's K or V of one block);
    /// divides `run_bytes`.
    pub unit: usize,
}

impl Shape {
    /// Bytes of the registered buffer.
    fn buffer_bytes(&self) -> usize {
        self.runs * (self.run_bytes + self.gap_bytes)
    }

    /// Bytes one READ moves.
    pub fn bytes(&self) -> usize {
        self.runs * self.run_bytes
    }

    /// Offset of every entry in the buffer.
    fn entries(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.runs).flat_map(move |r| {
            (0..self.run_bytes / self.unit)
                .map(move |i| r * (self.run_bytes + self.gap_bytes) + i * self.unit)
        })
    }

    fn check(&self) -> Result<(), RawNixlError> {
        if self.runs == 0
            || self.unit == 0
            || self.run_bytes == 0
            || !self.run_bytes.is_multiple_of(self.unit)
        {
            return Err(RawNixlError::Peer(format!(
                "{self:?}: runs, run bytes and a unit that divides them are needed"
            )));
        }
        Ok(())
    }
}

/// The source's byte at `at` of the buffer.
fn pattern(at: usize) -> u8 {
    (at.wrapping_mul(7) % 251) as u8
}

/// What the baseline could not do.
#[derive(Debug, thiserror::Error)]
pub enum RawNixlError {
    /// A NIXL call failed.
    #[error(transparent)]
    Nixl(#[from] NixlCallError),
    /// The source process could not be started or answered wrongly.
    #[error("the raw NIXL source process: {0}")]
    Peer(String),
}

/// A buffer of `len` bytes, allocated as the engine allocates KV regions.
fn buffer(len: usize) -> Result<HostBuffer, RawNixlError> {
    HostBuffer::zeroed(len)
        .map_err(|e| RawNixlError::Peer(format!("cannot allocate the baseline's {len} bytes: {e}")))
}

#[derive(Debug)]
struct Buf {
    p: *const u8,
    n: usize,
}
// SAFETY: only the pointer value crosses threads; the buffer it points into outlives the agent.
unsafe impl Send for Buf {}
// SAFETY: as above; NIXL only reads the pointer and size.
unsafe impl Sync for Buf {}
impl MemoryRegion for Buf {
    unsafe fn as_ptr(&self) -> *const u8 {
        self.p
    }
    fn size(&self) -> usize {
        self.n
    }
}
impl NixlDescriptor for Buf {
    fn mem_type(&self) -> MemType {
        MemType::Dram
    }
    fn device_id(&self) -> u64 {
        0
    }
}

fn err(op: &str) -> impl FnOnce(NixlError) -> NixlCallError + '_ {
    move |e| NixlCallError::Status { op: op.to_owned(), status: status_name(&e), detail: e.to_string() }
}

fn agent(name: &str) -> Result<Agent, NixlCallError> {
    kvconnect_nixl::nixl_lib::load()?;
    let a = Agent::new(name).map_err(err("createAgent"))?;
    let (_m, params) = a.get_plugin_params("UCX").map_err(err("getPluginParams"))?;
    a.create_backend("UCX", &params).map_err(err("createBackend"))?;
    Ok(a)
}

/// What the source prints once it is ready.
#[derive(Debug, Serialize, Deserialize)]
struct Ready {
    agent: String,
    md: String,
    base: usize,
}

/// The source process: reads a [`Shape`] (one JSON line) from `input`, registers a buffer of
/// it filled with the pattern, writes its agent's name, metadata and the buffer's address
/// (one JSON line, or `{"error": ...}`) to `output`, and serves until `input` closes.
pub fn serve_source(input: impl Read, mut output: impl Write) -> std::io::Result<()> {
    let mut input = BufReader::new(input);
    let mut line = String::new();
    input.read_line(&mut line)?;
    // The buffer and registration live until the reader is done (input closed).
    let ready = (|| -> Result<(Ready, Agent, RegistrationHandle, HostBuffer), RawNixlError> {
        let shape: Shape =
            serde_json::from_str(&line).map_err(|e| RawNixlError::Peer(format!("malformed shape: {e}")))?;
        shape.check()?;
        let name = format!("raw-source-{}", std::process::id());
        let a = agent(&name)?;
        // Allocated as the engine allocates KV regions (huge pages where the kernel gives them).
        let mut src = buffer(shape.buffer_bytes())?;
        for (i, b) in src.bytes_mut().iter_mut().enumerate() {
            *b = pattern(i);
        }
        let (p, n) = (src.bytes().as_ptr(), src.bytes().len());
        let reg = a.register_memory(&Buf { p, n }, None).map_err(err("registerMem"))?;
        let md = a.get_local_md().map_err(err("getLocalMD"))?;
        let ready = Ready { agent: name, md: to_hex(&md), base: p as usize };
        Ok((ready, a, reg, src))
    })();
    match ready {
        Ok((ready, _agent, _reg, _src)) => {
            writeln!(output, "{}", serde_json::to_string(&ready).map_err(std::io::Error::other)?)?;
            output.flush()?;
            let mut rest = Vec::new();
            input.read_to_end(&mut rest)?;
            Ok(())
        }
        Err(e) => {
            writeln!(output, "{}", serde_json::json!({ "error": e.to_string() }))?;
            output.flush()
        }
    }
}

/// The reading side, with the source process it started.
pub struct RawNixlRead {
    // Field order is drop order: the prepared lists, the registration, the agent, then the
    // buffer they point at; the source process is stopped last.
    lists: (XferDlistHandle, XferDlistHandle),
    _reg: RegistrationHandle,
    reader: Agent,
    dst: HostBuffer,
    shape: Shape,
    indices: Vec<i32>,
    source: Child,
}

impl std::fmt::Debug for RawNixlRead {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RawNixlRead").field("shape", &self.shape).finish()
    }
}

impl Drop for RawNixlRead {
    fn drop(&mut self) {
        // Closing its stdin ends the source; it is waited for so no process is left behind.
        drop(self.source.stdin.take());
        let t0 = Instant::now();
        while t0.elapsed() < Duration::from_secs(10) {
            if let Ok(Some(_)) = self.source.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.source.kill();
        let _ = self.source.wait();
    }
}

impl RawNixlRead {
    /// Starts the source process with `source` (a command that runs [`serve_source`] on its
    /// stdin and stdout), creates this side's agent, registers a buffer of `shape`, loads the
    /// source's metadata and prepares both lists.
    pub fn spawn(shape: Shape, mut source: Command) -> Result<RawNixlRead, RawNixlError> {
        shape.check()?;
        let mut child = source
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| RawNixlError::Peer(format!("cannot start it: {e}")))?;
        let peer = |m: String| RawNixlError::Peer(m);
        let mut stdin = child.stdin.take().ok_or_else(|| peer("no stdin".into()))?;
        let stdout = child.stdout.take().ok_or_else(|| peer("no stdout".into()))?;
        let spec = serde_json::to_string(&shape).map_err(|e| peer(e.to_string()))?;
        writeln!(stdin, "{spec}").map_err(|e| peer(format!("sending the shape: {e}")))?;
        child.stdin = Some(stdin);
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = tx.send(BufReader::new(stdout).read_line(&mut line).map(|_| line));
        });
        let mut guard = Source(Some(child));
        let line = match rx.recv_timeout(Duration::from_secs(120)) {
            Ok(Ok(line)) => line,
            Ok(Err(e)) => return Err(peer(format!("reading its answer: {e}"))),
            Err(_) => return Err(peer("no answer within 120 s".into())),
        };
        let ready: Ready = match serde_json::from_str::<serde_json::Value>(&line) {
            Ok(v) if v.get("error").is_some() => return Err(peer(v["error"].to_string())),
            Ok(v) => serde_json::from_value(v).map_err(|e| peer(format!("{e}: it said {line:?}")))?,
            Err(e) => return Err(peer(format!("{e}: it said {line:?}"))),
        };
        let reader = agent(&format!("raw-reader-{}", std::process::id()))?;
        let mut dst = buffer(shape.buffer_bytes())?;
        let reg = reader
            .register_memory(&Buf { p: dst.bytes_mut().as_mut_ptr(), n: dst.bytes().len() }, None)
            .map_err(err("registerMem"))?;
        let md = from_hex(&ready.md).ok_or_else(|| peer("its metadata is not hex".into()))?;
        let remote = reader.load_remote_md(&md).map_err(err("loadRemoteMD"))?;
        let list = |base: usize| -> Result<XferDescList<'static>, NixlCallError> {
            let mut l = XferDescList::new(MemType::Dram).map_err(err("descriptor list"))?;
            for at in shape.entries() {
                l.add_desc(base + at, shape.unit, 0);
            }
            Ok(l)
        };
        let local = reader
            .prepare_xfer_dlist("", &list(dst.bytes().as_ptr() as usize)?, None)
            .map_err(err("prepXferDlist"))?;
        let far =
            reader.prepare_xfer_dlist(&remote, &list(ready.base)?, None).map_err(err("prepXferDlist"))?;
        let n = shape.entries().count();
        let indices = (0..n)
            .map(|i| i32::try_from(i).map_err(|_| peer(format!("{n} entries"))))
            .collect::<Result<_, _>>()?;
        let source = guard.0.take().ok_or_else(|| peer("lost".into()))?;
        Ok(RawNixlRead { lists: (local, far), _reg: reg, reader, dst, shape, indices, source })
    }

    /// One READ of every entry: make the request from the prepared lists, post it, poll it
    /// until done.
    pub fn measure(&mut self) -> Result<Duration, RawNixlError> {
        // Cleared first so that `verify` checks this READ, not an earlier one.
        self.dst.bytes_mut().fill(0);
        let b = &self.reader;
        let t = Instant::now();
        let (local, far) = &self.lists;
        let req = b
            .make_xfer_req(XferOp::Read, local, &self.indices, far, &self.indices, None)
            .map_err(err("makeXferReq"))?;
        let mut busy = b.post_xfer_req(&req, None).map_err(err("postXferReq"))?;
        // The connector's pull thread polls the same way (spin, then yield): on a loaded
        // machine a bare spin starves the progress threads and would flatter the connector.
        let mut spins = 0u32;
        while busy {
            busy = matches!(b.get_xfer_status(&req).map_err(err("getXferStatus"))?, XferStatus::InProgress);
            spins += 1;
            if spins > 1000 {
                std::thread::yield_now();
            }
        }
        let d = t.elapsed();
        drop(req);
        Ok(d)
    }

    /// Whether every run holds the source's bytes and every gap none (after a
    /// [`measure`](Self::measure)).
    pub fn verify(&self) -> bool {
        let s = &self.shape;
        (0..s.runs).all(|r| {
            let start = r * (s.run_bytes + s.gap_bytes);
            let run = &self.dst.bytes()[start..start + s.run_bytes];
            let gap = &self.dst.bytes()[start + s.run_bytes..start + s.run_bytes + s.gap_bytes];
            run.iter().enumerate().all(|(i, &b)| b == pattern(start + i)) && gap.iter().all(|&b| b == 0)
        })
    }

    /// The shape it reads.
    pub fn shape(&self) -> Shape {
        self.shape
    }
}

/// A source process not yet handed to a [`RawNixlRead`]: stopped if starting fails.
struct Source(Option<Child>);

impl Drop for Source {
    fn drop(&mut self) {
        if let Some(mut c) = self.0.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_cover_the_runs_and_skip_the_gaps() {
        let s = Shape { runs: 2, run_bytes: 8, gap_bytes: 4, unit: 4 };
        assert_eq!(s.entries().collect::<Vec<_>>(), vec![0, 4, 12, 16]);
        assert_eq!((s.bytes(), s.buffer_bytes()), (16, 24));
        assert!(Shape { unit: 3, ..s }.check().is_err());
        assert!(Shape { runs: 0, ..s }.check().is_err());
    }
}
