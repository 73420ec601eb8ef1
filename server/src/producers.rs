//! Which producers a decode server may load KV from (`--kv-producers`, or `kv_producers` in a
//! deployment file's `[decode]` section): a request whose `kv_transfer_params` name any other
//! is refused before anything is contacted, so a client cannot point decode at an arbitrary
//! host and port.
//!
//! An entry is `[ENGINE@]IP[:PORT]`: the side-channel address prefill puts into the params
//! (`remote_host`, `remote_port`), optionally with the engine id it must carry. Without any
//! entry only producers on this host (loopback) are allowed.

use std::net::{IpAddr, SocketAddr};

/// One allowed producer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Producer {
    /// The engine id it must carry, if named.
    pub engine: Option<String>,
    /// Its side channel's IP.
    pub ip: IpAddr,
    /// Its side channel's port, if named (else any).
    pub port: Option<u16>,
}

impl std::str::FromStr for Producer {
    type Err = String;

    fn from_str(s: &str) -> Result<Producer, String> {
        let t = s.trim();
        let (engine, addr) = match t.rsplit_once('@') {
            Some((e, a)) if !e.is_empty() => (Some(e.to_owned()), a),
            Some(_) => return Err(format!("producer '{t}': the engine id before '@' is empty")),
            None => (None, t),
        };
        let bad = || {
            format!(
                "producer '{t}': expected [ENGINE@]IP[:PORT] with an IP literal (e.g. \
                prefill-0@10.0.0.5:5600, 10.0.0.5 or [fd00::5]:5600); host names are not resolved"
            )
        };
        if let Ok(sa) = addr.parse::<SocketAddr>() {
            return Ok(Producer { engine, ip: sa.ip(), port: Some(sa.port()) });
        }
        let ip = addr.trim_start_matches('[').trim_end_matches(']').parse::<IpAddr>().map_err(|_| bad())?;
        Ok(Producer { engine, ip, port: None })
    }
}

/// The allow-list.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Producers(pub Vec<Producer>);

impl Producers {
    /// Parses a comma-separated list (the flag's value).
    pub fn parse_list(s: &str) -> Result<Producers, String> {
        s.split(',').filter(|e| !e.trim().is_empty()).map(str::parse).collect::<Result<_, _>>().map(Producers)
    }

    /// `Ok` when KV may be loaded from `engine` whose side channel is at `addr` (`ip:port`,
    /// as the params give it); else why not.
    pub fn check(&self, engine: &str, addr: &str) -> Result<(), String> {
        let sa: SocketAddr = addr.parse().map_err(|_| {
            format!(
                "kv_transfer_params name producer '{engine}' at {addr}, which is not an IP literal and \
                port; host names are not resolved and nothing was contacted"
            )
        })?;
        if self.0.is_empty() {
            if sa.ip().is_loopback() {
                return Ok(());
            }
            return Err(format!(
                "kv_transfer_params name producer '{engine}' at {addr}, beyond this host, and \
                this worker has no allow-list of producers; nothing was contacted. List the prefill workers \
                with --kv-producers ENGINE@IP:PORT (or kv_producers in the deployment file's [decode] \
                section)"
            ));
        }
        let ok = self.0.iter().any(|p| {
            p.ip == sa.ip()
                && p.port.is_none_or(|port| port == sa.port())
                && p.engine.as_deref().is_none_or(|e| e == engine)
        });
        if ok {
            Ok(())
        } else {
            Err(format!(
                "kv_transfer_params name producer '{engine}' at {addr}, which --kv-producers does \
                not list; nothing was contacted. Forward the params the deployment's prefill returned, or \
                add that producer to the list"
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_name_an_ip_and_optionally_a_port_and_an_engine() {
        let l = Producers::parse_list("prefill-0@10.0.0.5:5600, 10.0.0.6,[fd00::7]:9").unwrap();
        assert!(l.check("prefill-0", "10.0.0.5:5600").is_ok());
        assert!(l.check("prefill-1", "10.0.0.5:5600").unwrap_err().contains("does not list"));
        assert!(l.check("prefill-0", "10.0.0.5:5601").is_err());
        assert!(l.check("anyone", "10.0.0.6:1234").is_ok());
        assert!(l.check("x", "[fd00::7]:9").is_ok());
        assert!(l.check("x", "169.254.169.254:80").is_err(), "no SSRF to another address");
        assert!(l.check("x", "127.0.0.1:80").is_err(), "a list replaces the loopback default");
        let e = l.check("x", "metadata.internal:80").unwrap_err();
        assert!(e.contains("not an IP literal"), "{e}");
        for bad in ["prefill-0@host.example:1", "@10.0.0.1", "10.0.0.1:99999"] {
            let e = Producers::parse_list(bad).unwrap_err();
            assert!(e.contains("IP literal") || e.contains("empty"), "{bad}: {e}");
        }
    }

    #[test]
    fn without_a_list_only_this_host_is_allowed() {
        let l = Producers::default();
        assert!(l.check("p", "127.0.0.1:5600").is_ok());
        assert!(l.check("p", "[::1]:5600").is_ok());
        let e = l.check("p", "10.1.2.3:5600").unwrap_err();
        assert!(e.contains("--kv-producers") && e.contains("nothing was contacted"), "{e}");
    }
}
