//! The servers behind the proxy: each one's role, address and whether it is up. Under
//! `kvconnect up` the supervisor marks servers down when they exit or turn unhealthy and up
//! again once a restarted process announced its new address; `kvconnect proxy` marks them by
//! their `/health` (`health`). The proxy picks round-robin among the servers of a role that
//! are up.

use kvconnect_api::Role;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::RwLock;

/// One server as the proxy sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Backend {
    /// Prefill or decode.
    pub role: Role,
    /// Its engine id (stable across restarts).
    pub name: String,
    /// `host:port` of its HTTP API (the last one it announced).
    pub http: String,
    /// Why it is down; `None` while it is up.
    pub down: Option<String>,
    /// Bumped each time it is marked down or up (a change: it restarted since).
    pub generation: u64,
}

/// No server of a role is up.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("no {role} worker is up ({why}); retry shortly: kvconnect up restarts workers that exit, and kvconnect proxy routes to a server again once its /health answers")]
pub struct NoBackend {
    /// The role.
    pub role: Role,
    /// What the servers of that role are doing.
    pub why: String,
}

/// The proxy's servers.
#[derive(Debug, Default)]
pub struct Backends {
    list: RwLock<Vec<Backend>>,
    next: [AtomicUsize; 2],
}

fn slot(role: Role) -> usize {
    match role {
        Role::Prefill => 0,
        Role::Decode => 1,
    }
}

impl Backends {
    /// Servers that are all up.
    pub fn new(servers: impl IntoIterator<Item = (Role, String, String)>) -> Backends {
        let b = Backends::default();
        b.extend(servers);
        b
    }

    /// Adds servers that are up.
    pub fn extend(&self, servers: impl IntoIterator<Item = (Role, String, String)>) {
        let mut l = self.list.write().unwrap_or_else(|p| p.into_inner());
        l.extend(servers.into_iter().map(|(role, name, http)| Backend {
            role,
            name,
            http,
            down: None,
            generation: 0,
        }));
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, Vec<Backend>> {
        self.list.read().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, name: &str, f: impl FnOnce(&mut Backend)) {
        let mut l = self.list.write().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = l.iter_mut().find(|b| b.name == name) {
            f(b);
        }
    }

    /// Marks `name` down, with the reason the proxy reports while no other server can serve.
    pub fn set_down(&self, name: &str, why: &str) {
        self.update(name, |b| {
            b.down = Some(why.to_owned());
            b.generation += 1;
        });
    }

    /// Marks `name` up at `http`.
    pub fn set_up(&self, name: &str, http: &str) {
        self.update(name, |b| {
            b.http = http.to_owned();
            b.down = None;
            b.generation += 1;
        });
    }

    /// Every server, in start order.
    pub fn all(&self) -> Vec<Backend> {
        self.read().clone()
    }

    /// Every server of `role`, in start order, up or not.
    pub fn of_role(&self, role: Role) -> Vec<Backend> {
        self.read().iter().filter(|b| b.role == role).cloned().collect()
    }

    /// The next server of `role` that is up, round-robin, other than those in `avoid`.
    pub fn pick(&self, role: Role, avoid: &[String]) -> Result<String, NoBackend> {
        let l = self.read();
        let of_role: Vec<&Backend> = l.iter().filter(|b| b.role == role).collect();
        let up: Vec<&&Backend> =
            of_role.iter().filter(|b| b.down.is_none() && !avoid.contains(&b.http)).collect();
        if up.is_empty() {
            let why = if of_role.is_empty() {
                "none configured".to_owned()
            } else {
                of_role
                    .iter()
                    .map(|b| format!("{}: {}", b.name, b.down.as_deref().unwrap_or("did not answer")))
                    .collect::<Vec<_>>()
                    .join("; ")
            };
            return Err(NoBackend { role, why });
        }
        let i = self.next[slot(role)].fetch_add(1, Ordering::Relaxed) % up.len();
        Ok(up[i].http.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn two_decoders() -> Backends {
        Backends::new([
            (Role::Prefill, "p0".into(), "127.0.0.1:1".into()),
            (Role::Decode, "d0".into(), "127.0.0.1:2".into()),
            (Role::Decode, "d1".into(), "127.0.0.1:3".into()),
        ])
    }

    #[test]
    fn picks_round_robin_and_skips_servers_that_are_down() {
        let b = two_decoders();
        let picks: Vec<String> = (0..4).map(|_| b.pick(Role::Decode, &[]).unwrap()).collect();
        assert_eq!(picks, ["127.0.0.1:2", "127.0.0.1:3", "127.0.0.1:2", "127.0.0.1:3"]);
        b.set_down("d0", "exited: killed by signal 9 (SIGKILL); restarting");
        for _ in 0..3 {
            assert_eq!(b.pick(Role::Decode, &[]).unwrap(), "127.0.0.1:3");
        }
        assert_eq!(b.pick(Role::Prefill, &[]).unwrap(), "127.0.0.1:1");
        b.set_up("d0", "127.0.0.1:9");
        let picks: Vec<String> = (0..2).map(|_| b.pick(Role::Decode, &[]).unwrap()).collect();
        assert!(picks.contains(&"127.0.0.1:9".to_owned()), "{picks:?}");
    }

    #[test]
    fn no_server_up_names_the_role_and_why() {
        let b = two_decoders();
        b.set_down("d0", "exited: killed by signal 9 (SIGKILL); restarting");
        let e = b.pick(Role::Decode, &["127.0.0.1:3".to_owned()]).unwrap_err().to_string();
        assert!(e.starts_with("no decode worker is up"), "{e}");
        assert!(e.contains("d0: exited: killed by signal 9") && e.contains("d1: did not answer"), "{e}");
        let e = Backends::new([]).pick(Role::Prefill, &[]).unwrap_err().to_string();
        assert!(e.contains("no prefill worker is up (none configured)"), "{e}");
    }
}
