//! The transfer engine: a pool of worker threads that runs the copies between the KV cache
//! and the tiers, so neither loads nor saves run on the step loop.
//!
//! Jobs are closures; each reports its own result (the worker half collects them through a
//! channel). `shutdown` (and drop) stops taking jobs, lets queued ones finish and joins the
//! threads, so no job outlives the KV regions it copies from.

use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

type Job = Box<dyn FnOnce() + Send + 'static>;

/// A fixed pool of transfer threads.
pub struct TransferPool {
    tx: Option<Sender<Job>>,
    threads: Vec<JoinHandle<()>>,
}

impl TransferPool {
    /// Starts `n` threads (at least one) named `<name>-<i>`.
    pub fn new(n: usize, name: &str) -> std::io::Result<TransferPool> {
        let (tx, rx) = channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let mut threads = Vec::new();
        for i in 0..n.max(1) {
            let rx: Arc<Mutex<Receiver<Job>>> = rx.clone();
            threads.push(std::thread::Builder::new().name(format!("{name}-{i}")).spawn(move || loop {
                let job = {
                    let guard = rx.lock().unwrap_or_else(|e| e.into_inner());
                    guard.recv()
                };
                match job {
                    // A panicking job must not take the thread (and its queue share) down.
                    Ok(job) => {
                        let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(job));
                    }
                    Err(_) => break,
                }
            })?);
        }
        Ok(TransferPool { tx: Some(tx), threads })
    }

    /// Queues a job. False after shutdown.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) -> bool {
        self.tx.as_ref().is_some_and(|tx| tx.send(Box::new(job)).is_ok())
    }

    /// Finishes queued jobs and joins the threads.
    pub fn shutdown(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for TransferPool {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn runs_every_job_before_shutdown_returns() {
        let mut p = TransferPool::new(3, "t").unwrap();
        let n = Arc::new(AtomicUsize::new(0));
        for i in 0..100 {
            let n = n.clone();
            assert!(p.submit(move || {
                if i == 50 {
                    panic!("a job panics");
                }
                n.fetch_add(1, Ordering::SeqCst);
            }));
        }
        p.shutdown();
        assert_eq!(n.load(Ordering::SeqCst), 99);
        assert!(!p.submit(|| {}));
    }
}
