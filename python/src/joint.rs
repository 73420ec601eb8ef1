//! Joint negotiation inside vLLM: both servers of a P/D pair name the same kvconnect
//! deployment file (the one `kvconnect plan --joint` and `kvconnect up` read) and each
//! negotiates both roles together, as workers started from that file do, so prefill and
//! decode reach the same effective layout and compat hash by construction, or refuse to
//! start naming the field.
//!
//! This server's role runs what vLLM actually runs (its block size, cache dtype, hybrid KV
//! cache manager, layout, KV device, opaque blocks); a setting the file also gives for this
//! role must agree with it. The peer's role runs the file's settings, and what the file leaves
//! unset there is taken to be this server's (the same vLLM build and flags on both sides);
//! the handshake still compares the real descriptors.

use crate::error::AdapterError;
use kvconnect_api::compat::CompatDescriptor;
use kvconnect_api::negotiate::{Conflict, EngineOptions, HmaOption, Negotiated};
use kvconnect_api::Role;
use kvconnect_api::{KvRole, KvTransferConfig, ModelSpec};
use kvconnect_deployment::{negotiate_role, Deployment, DeploymentError};
use kvconnect_registry::Registry;
use std::path::Path;

/// A deployment file and the role this server plays in it.
pub struct Joint {
    /// The file, read.
    pub deployment: Deployment,
    /// This server's role.
    pub role: Role,
}

/// What joint negotiation gives this server.
pub struct JointOutcome {
    /// This role's result.
    pub negotiated: Negotiated,
    /// Its descriptor.
    pub compat: CompatDescriptor,
    /// One line for the log: the file, the role and the peer's expected compat hash.
    pub note: String,
}

fn other(role: Role) -> Role {
    match role {
        Role::Prefill => Role::Decode,
        Role::Decode => Role::Prefill,
    }
}

impl Joint {
    /// Reads `path`; the role is `deployment_role` when given, else vLLM's kv_role
    /// (kv_producer: prefill, kv_consumer: decode).
    pub fn load(
        path: &Path,
        deployment_role: Option<&str>,
        kv_role: Option<KvRole>,
    ) -> Result<Joint, AdapterError> {
        let deployment =
            Deployment::load(path).map_err(|e| AdapterError::ExtraConfig(format!("deployment: {e}")))?;
        let from_kv_role = match kv_role {
            Some(KvRole::Producer) => Some(Role::Prefill),
            Some(KvRole::Consumer) => Some(Role::Decode),
            _ => None,
        };
        let role =
            match (deployment_role, from_kv_role) {
                (Some(r), k) => {
                    let r: Role = r.parse().map_err(|e: kvconnect_api::UnknownRole| {
                        AdapterError::ExtraConfig(format!(
                            "deployment_role: \
                    {e}"
                        ))
                    })?;
                    if k.is_some_and(|k| k != r) {
                        return Err(AdapterError::ExtraConfig(format!(
                        "deployment_role is {r} but vLLM's kv_role makes this server the {}; make them agree",
                        k.map_or("", Role::name)
                    )));
                    }
                    r
                }
                (None, Some(k)) => k,
                (None, None) => return Err(AdapterError::ExtraConfig(
                    "with 'deployment' and kv_role kv_both, say which of the file's roles this server is: \
                        deployment_role = \"prefill\" or \"decode\""
                        .into(),
                )),
            };
        Ok(Joint { deployment, role })
    }

    /// This role's kvconnect kv-transfer-config, as the file gives it.
    pub fn config(&self) -> KvTransferConfig {
        self.deployment.role(self.role).kv_transfer_config.clone()
    }

    /// Negotiates both roles together: this one as vLLM runs it (`own`, with `config`, the
    /// file's config with the side channel filled in), the peer as the file says.
    pub fn negotiate(
        &self,
        registry: &Registry,
        config: &KvTransferConfig,
        model: &ModelSpec,
        own: &EngineOptions,
    ) -> Result<JointOutcome, AdapterError> {
        let path = self.deployment.path.display().to_string();
        let file_model = &self.deployment.model;
        fn geometry(
            m: &ModelSpec,
        ) -> (u32, u32, u32, &[kvconnect_api::AttentionKind], Option<&kvconnect_api::LayerState>) {
            (m.num_layers, m.num_kv_heads, m.head_dim, &m.layers, m.state.as_ref())
        }
        if geometry(file_model) != geometry(model) {
            return Err(AdapterError::ExtraConfig(format!(
                "deployment {path}: its model ({}, {} layers, {} KV heads of head dim {}) is not the model \
                    vLLM serves ({}, {} layers, {} KV heads of head dim {}); point the file's model at the \
                    served model's config.json",
                file_model.name,
                file_model.num_layers,
                file_model.num_kv_heads,
                file_model.head_dim,
                model.name,
                model.num_layers,
                model.num_kv_heads,
                model.head_dim
            )));
        }
        let file_own = &self.deployment.role(self.role).options;
        agrees(&path, self.role, file_own, own)?;
        let mut d = self.deployment.clone();
        let peer_role = other(self.role);
        let (mine, peer) = match self.role {
            Role::Prefill => (&mut d.prefill, &mut d.decode),
            Role::Decode => (&mut d.decode, &mut d.prefill),
        };
        mine.options = EngineOptions { allow_adapters: file_own.allow_adapters, ..own.clone() };
        mine.kv_transfer_config = config.clone();
        let p = &mut peer.options;
        p.block_size = p.block_size.or(own.block_size);
        p.cache_dtype = p.cache_dtype.or(own.cache_dtype);
        p.kv_cache_layout = p.kv_cache_layout.or(own.kv_cache_layout);
        p.memory = p.memory.or(own.memory);
        p.opaque_blocks = p.opaque_blocks.clone().or(own.opaque_blocks.clone());
        p.tp_rank = 0;
        // The peer is a vLLM server too: one connector per rank, whatever the file's engine.
        p.ranks_per_worker = 1;
        let conflict = |e: DeploymentError| match &e {
            DeploymentError::Conflict { conflict, .. }
                if matches!(**conflict, Conflict::HmaUnsupported { .. }) =>
            {
                AdapterError::Negotiation(format!(
                    "negotiated jointly from {path}: {e}; inside vLLM: the hybrid KV cache manager is on \
                        here because the connector class is KvconnectHmaConnector: name KvconnectConnector \
                        (or pass --disable-hybrid-kv-cache-manager) and vLLM turns it off"
                ))
            }
            _ => AdapterError::Negotiation(format!("negotiated jointly from {path}: {e}")),
        };
        let (negotiated, compat) = negotiate_role(&d, self.role, true, registry).map_err(conflict)?;
        let (_, peer_compat) = negotiate_role(&d, peer_role, true, registry).map_err(conflict)?;
        let note = format!(
            "negotiated jointly from deployment {path} as its {}; the {peer_role} negotiates compat hash {}",
            self.role,
            peer_compat.compat_hash()
        );
        Ok(JointOutcome { negotiated, compat, note })
    }
}

/// Every option the file sets for this role must be what vLLM runs.
fn agrees(path: &str, role: Role, file: &EngineOptions, vllm: &EngineOptions) -> Result<(), AdapterError> {
    let mut differ: Vec<String> = Vec::new();
    let mut check = |name: &str, f: Option<String>, v: Option<String>| {
        if let (Some(f), Some(v)) = (f, v) {
            if f != v {
                differ.push(format!("{name} = {f} in the file, {v} in this vLLM server"));
            }
        }
    };
    check("block_size", file.block_size.map(|b| b.to_string()), vllm.block_size.map(|b| b.to_string()));
    check("cache_dtype", file.cache_dtype.map(|d| d.to_string()), vllm.cache_dtype.map(|d| d.to_string()));
    check(
        "kv_cache_layout",
        file.kv_cache_layout.map(|l| l.display_name()),
        vllm.kv_cache_layout.map(|l| l.display_name()),
    );
    let hma = |h: HmaOption| (h != HmaOption::Auto).then(|| h.to_string());
    check("hybrid_kv_cache_manager", hma(file.hybrid_kv_cache_manager), hma(vllm.hybrid_kv_cache_manager));
    check("kv_buffer_device", file.memory.map(|m| m.to_string()), vllm.memory.map(|m| m.to_string()));
    if file.tp_size != 1 {
        check("tp_size", Some(file.tp_size.to_string()), Some(vllm.tp_size.to_string()));
    }
    if differ.is_empty() {
        return Ok(());
    }
    Err(AdapterError::ExtraConfig(format!(
        "deployment {path}: its [{role}] section does not describe this vLLM server: {}; change the file or \
            vLLM's flags so they agree",
        differ.join("; ")
    )))
}
