//! Roles. [`Role`] is the side an engine takes in a disaggregated (P/D) deployment:
//! prefill or decode; deployments, negotiation of a deployment, the proxy and the servers
//! speak of it. [`KvRole`] is vLLM's `kv_role` setting (`kv_producer`, `kv_consumer`,
//! `kv_both`), the same sides in vLLM's words plus `kv_both` (a cache, or symmetric P/D): a
//! connector is told its `KvRole` and declares which ones it can play. The two meet only in
//! [`Role::kv_role`] and [`Role::from_kv_role`].

use serde::{Deserialize, Serialize};
use std::fmt;

/// An engine's side in a P/D deployment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    /// Computes the prompt's KV and serves it.
    Prefill,
    /// Pulls the KV and generates.
    Decode,
}

impl Role {
    /// Both roles, prefill first.
    pub const BOTH: [Role; 2] = [Role::Prefill, Role::Decode];

    /// `prefill` or `decode`: the deployment file's table, `--role`'s value, the name in
    /// messages and metric labels.
    pub fn name(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }

    /// The `kv_role` a connector of this role is given: prefill produces KV, decode
    /// consumes it.
    pub fn kv_role(self) -> KvRole {
        match self {
            Role::Prefill => KvRole::Producer,
            Role::Decode => KvRole::Consumer,
        }
    }

    /// The role a `kv_role` says, if it says one (`kv_both` does not).
    pub fn from_kv_role(kv_role: KvRole) -> Option<Role> {
        match kv_role {
            KvRole::Producer => Some(Role::Prefill),
            KvRole::Consumer => Some(Role::Decode),
            KvRole::Both => None,
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A role name that is neither prefill nor decode.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown role '{given}'; valid roles are prefill and decode")]
pub struct UnknownRole {
    /// What was given.
    pub given: String,
}

impl std::str::FromStr for Role {
    type Err = UnknownRole;
    /// `prefill` or `p`, `decode` or `d`, in any case, around white space.
    fn from_str(s: &str) -> Result<Role, UnknownRole> {
        match s.trim().to_ascii_lowercase().as_str() {
            "prefill" | "p" => Ok(Role::Prefill),
            "decode" | "d" => Ok(Role::Decode),
            _ => Err(UnknownRole { given: s.to_owned() }),
        }
    }
}

/// vLLM's `kv_role`: what a connector instance does with KV (the kv-transfer-config's
/// `kv_role`, the context's `role`), and which of them a connector can do (its
/// capabilities' `roles`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "schema", derive(schemars::JsonSchema))]
pub enum KvRole {
    /// Produces KV (prefill side).
    #[serde(rename = "kv_producer")]
    Producer,
    /// Consumes KV (decode side).
    #[serde(rename = "kv_consumer")]
    Consumer,
    /// Both (monolithic with a cache, or symmetric P/D).
    #[serde(rename = "kv_both")]
    Both,
}

impl KvRole {
    /// vLLM's spelling: `kv_producer`, `kv_consumer` or `kv_both`.
    pub fn name(self) -> &'static str {
        match self {
            KvRole::Producer => "kv_producer",
            KvRole::Consumer => "kv_consumer",
            KvRole::Both => "kv_both",
        }
    }
}

impl fmt::Display for KvRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_the_wire_spellings() {
        for r in [KvRole::Producer, KvRole::Consumer, KvRole::Both] {
            assert_eq!(serde_json::to_value(r).unwrap(), serde_json::Value::from(r.to_string()));
        }
        assert_eq!(Role::BOTH.map(|r| r.to_string()), ["prefill", "decode"]);
    }

    #[test]
    fn roles_parse_and_map_to_kv_roles() {
        assert_eq!(" P ".parse::<Role>(), Ok(Role::Prefill));
        assert_eq!("Decode".parse::<Role>(), Ok(Role::Decode));
        let e = "both".parse::<Role>().unwrap_err();
        assert_eq!(e.to_string(), "unknown role 'both'; valid roles are prefill and decode");
        for r in Role::BOTH {
            assert_eq!(Role::from_kv_role(r.kv_role()), Some(r));
        }
        assert_eq!(Role::from_kv_role(KvRole::Both), None);
    }
}
