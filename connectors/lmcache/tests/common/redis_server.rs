//! A throwaway redis-server for tests and benchmarks: its own port on 127.0.0.1, no
//! persistence (`--save '' --appendonly no`), killed when dropped. Absent binary: `None`, and
//! the caller skips with a message saying how to install it.

#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct RedisServer {
    pub port: u16,
    child: Option<Child>,
    dir: tempfile::TempDir,
    /// Further redis-server arguments, kept for a restart.
    args: Vec<String>,
}

fn binary() -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join("redis-server")).find(|p| p.is_file())
}

/// Says why a Redis test did not run.
pub fn skip(test: &str) {
    eprintln!("SKIPPED {test}: redis-server is not installed (apt-get install -y redis-server; .ci/run installs it)");
}

impl RedisServer {
    /// A server on a free port, or `None` without the binary.
    pub fn start() -> Option<RedisServer> {
        RedisServer::start_with(&[])
    }

    /// A server started with further redis-server arguments (`--maxmemory`, ...).
    pub fn start_with(args: &[&str]) -> Option<RedisServer> {
        binary()?;
        let port = TcpListener::bind("127.0.0.1:0").ok()?.local_addr().ok()?.port();
        let args = args.iter().map(|a| a.to_string()).collect();
        let mut s = RedisServer { port, child: None, dir: tempfile::tempdir().ok()?, args };
        s.spawn();
        Some(s)
    }

    fn spawn(&mut self) {
        let child = Command::new(binary().expect("redis-server vanished"))
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .args(["--dir", &self.dir.path().display().to_string()])
            .args(&self.args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start redis-server");
        self.child = Some(child);
        let t0 = Instant::now();
        while TcpStream::connect(("127.0.0.1", self.port)).is_err() {
            assert!(t0.elapsed() < Duration::from_secs(10), "redis-server did not listen on {}", self.port);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Kills the server (SIGKILL) and waits for it: the port refuses connections after this.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    pub fn client(&self) -> redis::Connection {
        redis::Client::open(self.url()).unwrap().get_connection().unwrap()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
