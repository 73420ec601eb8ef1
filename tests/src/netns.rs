//! Network namespaces standing in for separate hosts: each [`Netns`] is one "host" with its own
//! interfaces, joined to others by veth pairs ([`link`]), its processes started with
//! `ip netns exec` ([`Netns::command`]) and reached from a test thread that joins it
//! ([`Netns::run`]). Namespaces are deleted on drop (on a panic too), and ones left by a test
//! process that was killed are swept when the next one starts.

use std::path::Path;
use std::process::Command;

/// The prefix of every namespace these tests create: `kvct-<pid>-<tag>`.
const PREFIX: &str = "kvct-";

/// Why namespaces cannot be made here (not root, no `ip` or `tc`), or `None` when they can.
pub fn unavailable() -> Option<String> {
    // SAFETY: geteuid(2) reads the process's effective uid; it has no arguments and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Some("network namespaces need root (ip netns add); run the tests as root".into());
    }
    for tool in ["ip", "tc"] {
        if !Command::new(tool).arg("-V").output().is_ok_and(|o| o.status.success()) {
            return Some(format!("the `{tool}` command is missing; install iproute2"));
        }
    }
    None
}

/// Runs `ip ARGS`; panics, as a test fixture, with what it printed when it fails.
pub fn ip(args: &[&str]) {
    let o = Command::new("ip").args(args).output().expect("run ip");
    assert!(o.status.success(), "ip {}: {}", args.join(" "), String::from_utf8_lossy(&o.stderr));
}

/// One network namespace, deleted on drop.
#[derive(Debug)]
pub struct Netns {
    /// Its name (`ip netns list`).
    pub name: String,
}

impl Netns {
    /// Creates `kvct-<pid>-<tag>` with its loopback up.
    pub fn new(tag: &str) -> Netns {
        sweep_dead();
        let name = format!("{PREFIX}{}-{tag}", std::process::id());
        // A namespace of this name can only be left by this process (an earlier test in it
        // that failed before its drop ran): start clean.
        let _ = Command::new("ip").args(["netns", "del", &name]).output();
        ip(&["netns", "add", &name]);
        let ns = Netns { name };
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// Whether interface `dev` here has carrier (`state UP`).
    pub fn link_up(&self, dev: &str) -> bool {
        Command::new("ip")
            .args(["-n", &self.name, "-o", "link", "show", dev])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("state UP"))
    }

    /// Runs `ip -n NAME ARGS`; panics with what it printed when it fails.
    pub fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", self.name.as_str()];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// `ip netns exec NAME PROGRAM`: a command that runs `program` inside this namespace
    /// (`ip` execs it, so the child's pid is the program's).
    pub fn command(&self, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.name]).arg(program);
        c
    }

    /// Reads `/sys/class/net/IFACE/statistics/STAT` as seen inside the namespace.
    pub fn stat(&self, iface: &str, stat: &str) -> u64 {
        let path = format!("/sys/class/net/{iface}/statistics/{stat}");
        let o = self.command(Path::new("cat")).arg(&path).output().expect("run ip netns exec cat");
        String::from_utf8_lossy(&o.stdout).trim().parse().unwrap_or(0)
    }

    /// Runs `f` on a thread that has joined this namespace, so the sockets it opens are this
    /// namespace's (only that thread moves: setns(2) with CLONE_NEWNET is per thread).
    pub fn run<T: Send>(&self, f: impl FnOnce() -> T + Send) -> T {
        let path = format!("/var/run/netns/{}", self.name);
        std::thread::scope(|s| {
            s.spawn(|| {
                let fd = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
                use std::os::fd::AsRawFd;
                // SAFETY: setns(2) with a descriptor this thread owns for the whole call; it
                // changes only the calling thread's network namespace, no memory is touched.
                let rc = unsafe { libc::setns(fd.as_raw_fd(), libc::CLONE_NEWNET) };
                assert_eq!(rc, 0, "setns into {path}: {}", std::io::Error::last_os_error());
                f()
            })
            .join()
            .unwrap_or_else(|p| std::panic::resume_unwind(p))
        })
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// Joins `a` and `b` with a veth pair: `a_if` with `a_addr` (CIDR) in `a`, `b_if` with
/// `b_addr` in `b`, both up. Deleting either namespace removes the pair. Returns once both
/// ends report carrier (`state UP`): a process started before that sees no such device (UCX
/// then refuses the interface, or offers the peer an address it cannot reach).
pub fn link(a: &Netns, a_if: &str, a_addr: &str, b: &Netns, b_if: &str, b_addr: &str) {
    a.ip(&["link", "add", a_if, "type", "veth", "peer", "name", b_if, "netns", &b.name]);
    a.ip(&["addr", "add", a_addr, "dev", a_if]);
    b.ip(&["addr", "add", b_addr, "dev", b_if]);
    a.ip(&["link", "set", a_if, "up"]);
    b.ip(&["link", "set", b_if, "up"]);
    for (ns, dev) in [(a, a_if), (b, b_if)] {
        let up = crate::wait_until(std::time::Duration::from_secs(10), || ns.link_up(dev));
        assert!(up, "link {dev} in {} did not come up within 10 s", ns.name);
    }
}

/// Deletes namespaces left by test processes that no longer run (killed before their drops).
fn sweep_dead() {
    let Ok(o) = Command::new("ip").args(["netns", "list"]).output() else { return };
    for line in String::from_utf8_lossy(&o.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or_default();
        let Some(pid) = name.strip_prefix(PREFIX).and_then(|r| r.split('-').next()) else { continue };
        if pid.parse::<u32>().is_ok() && !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = Command::new("ip").args(["netns", "del", name]).output();
        }
    }
}
