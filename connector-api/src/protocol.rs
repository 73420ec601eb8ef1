//! Versions of the protocols two kvconnect processes speak to each other: the side-channel
//! handshake (host), the NIXL connector's producer wire, and the P/D composite's metadata
//! envelope. Each carries its version; when the two sides differ, the refusal is one line
//! saying which version each side speaks, worded by [`VersionMismatch`].

/// Two sides of one protocol speak different versions.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{protocol} version mismatch: this {local_role} speaks version {local}, the {peer_role} speaks \
    {} — run the same kvconnect release on both", peer_version(.peer))]
pub struct VersionMismatch {
    /// The protocol (`side-channel handshake`, `nixl wire`, `pd metadata envelope`).
    pub protocol: &'static str,
    /// This side (`prefill worker`, `producer`, `worker`).
    pub local_role: &'static str,
    /// The version this side speaks.
    pub local: u32,
    /// The other side.
    pub peer_role: &'static str,
    /// The version the other side speaks; `None` when it sent none (a release from before the
    /// protocol carried versions).
    pub peer: Option<u32>,
}

fn peer_version(peer: &Option<u32>) -> String {
    match peer {
        Some(v) => format!("version {v}"),
        None => "no version (a release from before versions were sent)".to_owned(),
    }
}

impl VersionMismatch {
    /// `Ok` when `peer` is `local`, else the mismatch.
    pub fn check(
        protocol: &'static str,
        local_role: &'static str,
        local: u32,
        peer_role: &'static str,
        peer: Option<u32>,
    ) -> Result<(), VersionMismatch> {
        if peer == Some(local) {
            Ok(())
        } else {
            Err(VersionMismatch { protocol, local_role, local, peer_role, peer })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mismatch_names_both_versions_in_one_line() {
        assert!(VersionMismatch::check("nixl wire", "producer", 1, "consumer", Some(1)).is_ok());
        let e =
            VersionMismatch::check("nixl wire", "producer", 1, "consumer", Some(2)).unwrap_err().to_string();
        assert_eq!(
            e,
            "nixl wire version mismatch: this producer speaks version 1, the consumer speaks \
             version 2 — run the same kvconnect release on both"
        );
        let old =
            VersionMismatch::check("nixl wire", "producer", 1, "consumer", None).unwrap_err().to_string();
        assert!(
            old.contains("the consumer speaks no version (a release from before versions were sent)"),
            "{old}"
        );
        assert!(!e.contains('\n') && !old.contains('\n'));
    }
}
