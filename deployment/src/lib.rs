//! Deployment files: one model and the prefill and decode servers' kv-transfer-configs and
//! engine options, in TOML, and their negotiation per role.
//!
//! ```toml
//! model = "../../fixtures/models/openai--gpt-oss-20b/config.json"   # relative to this file
//!
//! [prefill]
//! kv_transfer_config = '{"kv_connector":"PdConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"LMCacheConnectorV1"},{"kv_connector":"NixlConnector"}]}}'
//! hybrid_kv_cache_manager = "auto"     # auto | on | off
//!
//! [decode]
//! kv_transfer_config = '{"kv_connector":"NixlConnector"}'
//!
//! [connectors]                          # optional named configs, usable as kv_connector
//! cache = '{"kv_connector":"LMCacheConnectorV1","kv_connector_extra_config":{"chunk_size":128}}'
//! ```
//!
//! A server started from a deployment calls [`negotiate_role`], so both roles reach the same
//! descriptor and hash by construction when negotiated jointly.
//!
//! Beside the deployment files, what the worker server, `kvconnect up` and the `kvconnect`
//! command share: the deployment's data-plane secret ([`secret`]), the shutdown signal of
//! every long-running command ([`shutdown`]) and the commands' exit statuses ([`exit`]).

pub mod exit;
pub mod secret;
pub mod shutdown;

use kvconnect_api::compat::{
    check_roles, diff_roles, AdaptationPlan, CompatDescriptor, FieldDiff, Incompatible,
};
use kvconnect_api::negotiate::{ChildCaps, Conflict, EngineOptions, HmaOption, Negotiated};
use kvconnect_api::{negotiate, negotiate_deployment};
use kvconnect_api::{ConnectorResolver, Dtype, KvLayout, KvTransferConfig, ModelSpec, Role};
use serde::Deserialize;
use std::fmt;
use std::path::{Path, PathBuf};
use toml::Spanned;

/// Whose negotiation an error is about; the error's message starts with its name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Negotiating {
    /// One role of a deployment (`prefill`, `decode`).
    Role(Role),
    /// Both roles of a deployment, together (`deployment`).
    Deployment,
    /// One engine outside any deployment, by the name its caller gives it in messages
    /// (`kvconnect negotiate`: `worker`; the vLLM adapter: vLLM's `kv_role`).
    Engine(&'static str),
}

impl fmt::Display for Negotiating {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Negotiating::Role(r) => r.fmt(f),
            Negotiating::Deployment => f.write_str("deployment"),
            Negotiating::Engine(name) => f.write_str(name),
        }
    }
}

/// One role's server config.
#[derive(Debug, Clone, PartialEq)]
pub struct RoleConfig {
    /// Its kv-transfer-config, named connector configs expanded.
    pub kv_transfer_config: KvTransferConfig,
    /// Its engine options.
    pub options: EngineOptions,
    /// The engine's own prefix cache (vLLM's `--enable-prefix-caching`; off by default).
    pub enable_prefix_caching: bool,
    /// Decode: the producers KV may be loaded from (`[ENGINE@]IP[:PORT]`, as
    /// `--kv-producers`); empty: only producers on this host.
    pub kv_producers: Vec<String>,
    /// What kvconnect made of the config (LMCache P/D settings turned into the nixl
    /// connector beside lmcache), for the server's log and `kvconnect plan`.
    pub notes: Vec<String>,
}

/// A deployment file, read and checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Deployment {
    /// The file it was read from.
    pub path: PathBuf,
    /// The model config path, resolved against the file's directory.
    pub model_path: PathBuf,
    /// The model.
    pub model: ModelSpec,
    /// The name the servers serve the model under (`served_model_name`, as vLLM's flag).
    pub served_model_name: Option<String>,
    /// The prefill server.
    pub prefill: RoleConfig,
    /// The decode server.
    pub decode: RoleConfig,
    /// The engine the servers run (`engine`): kvconnect's reference engine, or vLLM.
    pub engine: EngineKind,
}

/// The engine a deployment's servers run (`engine = "kvconnect" | "vllm"`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum EngineKind {
    /// kvconnect's reference engine (`kvconnect up`, `kvconnect worker`): its tensor-parallel
    /// ranks are threads of one process behind one connector. The default.
    #[default]
    Kvconnect,
    /// vLLM servers with `KvconnectConnector`: every rank has its own connector.
    Vllm,
}

impl EngineKind {
    /// How many tensor-parallel ranks one connector serves at `tp_size`.
    pub fn ranks_per_worker(self, tp_size: u32) -> u32 {
        match self {
            EngineKind::Kvconnect => tp_size,
            EngineKind::Vllm => 1,
        }
    }
}

impl std::fmt::Display for EngineKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            EngineKind::Kvconnect => "kvconnect",
            EngineKind::Vllm => "vllm",
        })
    }
}

impl Deployment {
    /// Refuses a deployment of another engine's servers (`engine = "vllm"`) where kvconnect's
    /// own servers are to run it (`kvconnect up`, `kvconnect worker --deployment`).
    pub fn for_kvconnect_servers(&self) -> Result<(), DeploymentError> {
        match self.engine {
            EngineKind::Kvconnect => Ok(()),
            engine => Err(DeploymentError::OtherEngine { path: self.path.clone(), engine }),
        }
    }

    /// One role's config.
    pub fn role(&self, role: Role) -> &RoleConfig {
        match role {
            Role::Prefill => &self.prefill,
            Role::Decode => &self.decode,
        }
    }
}

/// Everything that can be wrong with a deployment or its negotiation. The variants up to
/// `Connector` are bad input; `Conflict` and `Incompatible` are deployments that cannot work.
#[derive(Debug, thiserror::Error)]
pub enum DeploymentError {
    /// A deployment of another engine's servers, where kvconnect's servers are to run it.
    #[error("{}: this deployment describes {engine} servers (engine = \"{engine}\"): start each with vLLM \
        and KvconnectConnector, naming this file in kv_connector_extra_config.deployment; kvconnect up and \
        kvconnect worker run kvconnect's own engine (engine = \"kvconnect\", the default)", path.display())]
    OtherEngine {
        /// The file.
        path: PathBuf,
        /// The engine it names.
        engine: EngineKind,
    },
    /// The file cannot be read.
    #[error("{}: cannot read the deployment file: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Not valid TOML, or a value of the wrong type.
    #[error("{}:{line}:{column}: {message}", path.display())]
    Toml {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What is wrong.
        message: String,
    },
    /// Keys the deployment format does not have.
    #[error(
        "{}: unknown key{} {}; valid keys are: model, engine, served_model_name, [connectors], and \
         in [prefill]/[decode]: {}",
        path.display(),
        if keys.len() == 1 { "" } else { "s" },
        keys.join(", "),
        ROLE_KEYS.join(", ")
    )]
    UnknownKeys {
        /// The file.
        path: PathBuf,
        /// The keys, dotted (`prefill.kv_cache_layot`).
        keys: Vec<String>,
    },
    /// A required key is missing.
    #[error("{}: missing {key}: {hint}", path.display())]
    Missing {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What to write.
        hint: String,
    },
    /// An embedded kv-transfer-config is not valid JSON or not a kv-transfer-config.
    #[error("{}:{line}:{column}: {what} is not a valid kv-transfer-config: {message}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// Which config (`[prefill] kv_transfer_config`, `[connectors] cache`).
        what: String,
        /// 1-based line in the file.
        line: usize,
        /// 1-based column in the file.
        column: usize,
        /// serde's message.
        message: String,
    },
    /// An engine option with a value that names nothing.
    #[error("{}:{line}:{column}: [{role}] {message}", path.display())]
    BadOption {
        /// The file.
        path: PathBuf,
        /// The role whose table holds it.
        role: Role,
        /// 1-based line.
        line: usize,
        /// 1-based column.
        column: usize,
        /// What is wrong and the valid values.
        message: String,
    },
    /// A named connector config that refers back to itself.
    #[error("{}: named connector '{name}' contains itself ({chain}); a composite's children must not refer \
        back to it", path.display())]
    PresetLoop {
        /// The file.
        path: PathBuf,
        /// The name that recurs.
        name: String,
        /// The chain of names.
        chain: String,
    },
    /// The model config cannot be read.
    #[error("{}: model {}: {message}", path.display(), model.display())]
    Model {
        /// The deployment file.
        path: PathBuf,
        /// The model path as resolved.
        model: PathBuf,
        /// Why.
        message: String,
    },
    /// A connector cannot be resolved, or its capabilities cannot be read.
    #[error("{who}: {message}")]
    Connector {
        /// Whose connector.
        who: Negotiating,
        /// The connector's or composite's message.
        message: String,
    },
    /// The role's children admit no effective layout.
    #[error("{who}: {conflict}")]
    Conflict {
        /// Whose children.
        who: Negotiating,
        /// The conflict (boxed: it is large and errors travel by value).
        conflict: Box<Conflict>,
    },
}

impl DeploymentError {
    /// True for a deployment that is well formed but cannot work (a negotiation conflict),
    /// false for bad input.
    pub fn is_conflict(&self) -> bool {
        matches!(self, DeploymentError::Conflict { .. })
    }
}

/// The keys of a `[prefill]` / `[decode]` table.
pub const ROLE_KEYS: [&str; 10] = [
    "kv_transfer_config",
    "hybrid_kv_cache_manager",
    "kv_cache_layout",
    "block_size",
    "tp_size",
    "cache_dtype",
    "kv_buffer_device",
    "allow_adapters",
    "enable_prefix_caching",
    "kv_producers",
];

#[derive(Deserialize)]
#[serde(untagged)]
enum StrOrBool {
    Str(String),
    Bool(bool),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDeployment {
    model: Option<Spanned<String>>,
    engine: Option<Spanned<String>>,
    served_model_name: Option<String>,
    prefill: Option<RawRole>,
    decode: Option<RawRole>,
    #[serde(default)]
    connectors: std::collections::BTreeMap<String, Spanned<String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRole {
    kv_transfer_config: Option<Spanned<String>>,
    hybrid_kv_cache_manager: Option<Spanned<StrOrBool>>,
    kv_cache_layout: Option<Spanned<String>>,
    block_size: Option<Spanned<i64>>,
    tp_size: Option<Spanned<i64>>,
    cache_dtype: Option<Spanned<String>>,
    kv_buffer_device: Option<Spanned<String>>,
    allow_adapters: Option<bool>,
    enable_prefix_caching: Option<bool>,
    kv_producers: Option<Vec<String>>,
}

/// 1-based (line, column) of a byte offset.
fn line_col(src: &str, offset: usize) -> (usize, usize) {
    let mut i = offset.min(src.len());
    while i > 0 && !src.is_char_boundary(i) {
        i -= 1;
    }
    let before = &src[..i];
    let line = before.matches('\n').count() + 1;
    let col = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, col)
}

/// Byte offset in the file where a string value's content starts (past the quotes, and
/// past the newline TOML drops right after an opening `'''` or `"""`).
fn content_start(src: &str, span_start: usize) -> usize {
    let rest = src.get(span_start..).unwrap_or("");
    let mut off = span_start;
    if rest.starts_with("'''") || rest.starts_with("\"\"\"") {
        off += 3;
        let after = src.get(off..).unwrap_or("");
        if after.starts_with("\r\n") {
            off += 2;
        } else if after.starts_with('\n') {
            off += 1;
        }
    } else if rest.starts_with('\'') || rest.starts_with('"') {
        off += 1;
    }
    off
}

/// Parses an embedded kv-transfer-config, placing JSON errors at their line and column in
/// the file. Exact for literal strings ('...' and '''...'''), which need no escapes and are
/// what the examples use.
fn parse_embedded(
    path: &Path,
    src: &str,
    what: &str,
    value: &Spanned<String>,
) -> Result<serde_json::Value, DeploymentError> {
    serde_json::from_str::<serde_json::Value>(value.get_ref()).map_err(|e| {
        let start = content_start(src, value.span().start);
        let (l0, c0) = line_col(src, start);
        let (line, column) = if e.line() <= 1 {
            (l0, c0 + e.column().saturating_sub(1))
        } else {
            (l0 + e.line() - 1, e.column())
        };
        DeploymentError::Json {
            path: path.to_owned(),
            what: what.to_owned(),
            line,
            column,
            message: strip_pos(&e.to_string()),
        }
    })
}

/// serde_json's message without its own " at line L column C" (relative to the string, so
/// misleading next to the file position).
fn strip_pos(msg: &str) -> String {
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_owned(),
        None => msg.to_owned(),
    }
}

/// Replaces every object whose `kv_connector` names a `[connectors]` entry by that entry
/// (the referring object's other keys override the entry's), recursively through
/// composites' `connectors` lists.
fn expand_presets(
    path: &Path,
    v: serde_json::Value,
    presets: &std::collections::BTreeMap<String, serde_json::Value>,
    stack: &mut Vec<String>,
) -> Result<serde_json::Value, DeploymentError> {
    let serde_json::Value::Object(mut obj) = v else { return Ok(v) };
    let name = obj.get("kv_connector").and_then(|n| n.as_str()).map(str::to_owned);
    if let Some(name) = name.filter(|n| presets.contains_key(n)) {
        if stack.contains(&name) {
            let mut chain = stack.clone();
            chain.push(name.clone());
            return Err(DeploymentError::PresetLoop {
                path: path.to_owned(),
                name,
                chain: chain.join(" -> "),
            });
        }
        let Some(serde_json::Value::Object(base)) = presets.get(&name).cloned() else {
            return Err(DeploymentError::Missing {
                path: path.to_owned(),
                key: format!("connectors.{name}"),
                hint: "a named connector config must be a JSON object".to_owned(),
            });
        };
        obj.remove("kv_connector");
        let mut merged = base;
        for (k, val) in obj {
            merged.insert(k, val);
        }
        stack.push(name);
        let out = expand_presets(path, serde_json::Value::Object(merged), presets, stack);
        stack.pop();
        return out;
    }
    if let Some(serde_json::Value::Object(extra)) = obj.get_mut("kv_connector_extra_config") {
        if let Some(serde_json::Value::Array(list)) = extra.get_mut("connectors") {
            let items = std::mem::take(list);
            for item in items {
                list.push(expand_presets(path, item, presets, stack)?);
            }
        }
    }
    Ok(serde_json::Value::Object(obj))
}

/// Every key the format does not have, dotted.
fn unknown_keys(table: &toml::Table) -> Vec<String> {
    let mut out = Vec::new();
    for (k, v) in table {
        match k.as_str() {
            "model" | "engine" | "served_model_name" | "connectors" => {}
            "prefill" | "decode" => {
                if let Some(t) = v.as_table() {
                    out.extend(
                        t.keys().filter(|rk| !ROLE_KEYS.contains(&rk.as_str())).map(|rk| format!("{k}.{rk}")),
                    );
                }
            }
            _ => out.push(k.clone()),
        }
    }
    out
}

impl Deployment {
    /// Reads and checks a deployment file.
    pub fn load(path: &Path) -> Result<Deployment, DeploymentError> {
        let src = kvconnect_config_file::read_text(path)
            .map_err(|source| DeploymentError::Read { path: path.to_owned(), source })?;
        Deployment::parse(path, &src)
    }

    /// Parses a deployment; `path` places relative model paths and names the file in errors.
    pub fn parse(path: &Path, src: &str) -> Result<Deployment, DeploymentError> {
        let file = Source { path, src };
        let table: toml::Table = src.parse().map_err(|e| file.toml_error(e))?;
        let unknown = unknown_keys(&table);
        if !unknown.is_empty() {
            return Err(DeploymentError::UnknownKeys { path: path.to_owned(), keys: unknown });
        }
        let raw: RawDeployment = toml::from_str(src).map_err(|e| file.toml_error(e))?;
        let (model_path, model) = file.model(raw.model)?;
        let mut presets = std::collections::BTreeMap::new();
        for (name, v) in &raw.connectors {
            presets.insert(name.clone(), parse_embedded(path, src, &format!("[connectors] {name}"), v)?);
        }
        let engine = file.engine(raw.engine)?;
        let mut prefill = file.role(Role::Prefill, raw.prefill, &presets)?;
        let mut decode = file.role(Role::Decode, raw.decode, &presets)?;
        for rc in [&mut prefill, &mut decode] {
            rc.options.ranks_per_worker = engine.ranks_per_worker(rc.options.tp_size);
        }
        Ok(Deployment {
            path: path.to_owned(),
            model_path,
            model,
            served_model_name: raw.served_model_name,
            prefill,
            decode,
            engine,
        })
    }
}

/// Applies [`kvconnect_lmcache::pd::rewrite`] with this process's `LMCACHE_*` variables:
/// a config whose lmcache asks for P/D (LMCache's `enable_pd`) becomes the nixl connector
/// beside lmcache, with a note saying so. Servers and `kvconnect plan` call it on every config
/// they are given.
pub fn lmcache_pd(cfg: KvTransferConfig) -> Result<(KvTransferConfig, Vec<String>), String> {
    match kvconnect_lmcache::pd::rewrite(&cfg, &kvconnect_lmcache::config::lmcache_env()) {
        Ok(Some(rw)) => Ok((rw.config, vec![rw.announcement])),
        Ok(None) => Ok((cfg, Vec::new())),
        Err(e) => Err(e.to_string()),
    }
}

/// `a/b/../c` -> `a/c`, lexically (the model path is shown to users; symlinks are not
/// resolved, as the file is opened through the joined path anyway).
fn normalize(p: &Path) -> PathBuf {
    use std::path::Component;
    let mut out: Vec<Component> = Vec::new();
    for c in p.components() {
        match c {
            Component::CurDir => {}
            Component::ParentDir if matches!(out.last(), Some(Component::Normal(_))) => {
                out.pop();
            }
            other => out.push(other),
        }
    }
    if out.is_empty() {
        PathBuf::from(".")
    } else {
        out.iter().collect()
    }
}

/// A deployment file being parsed: its path and text, for errors that name both.
struct Source<'a> {
    path: &'a Path,
    src: &'a str,
}

impl Source<'_> {
    /// A TOML error at its line and column.
    fn toml_error(&self, e: toml::de::Error) -> DeploymentError {
        let (line, column) = e.span().map_or((1, 1), |s| line_col(self.src, s.start));
        let message = e.message().trim().lines().map(str::trim).collect::<Vec<_>>().join("; ");
        DeploymentError::Toml { path: self.path.to_owned(), line, column, message }
    }

    fn missing(&self, key: &str, hint: &str) -> DeploymentError {
        DeploymentError::Missing { path: self.path.to_owned(), key: key.to_owned(), hint: hint.to_owned() }
    }

    /// A bad value of role `role`'s table, at byte offset `at`.
    fn bad_option(&self, role: Role, at: usize, message: String) -> DeploymentError {
        let (line, column) = line_col(self.src, at);
        DeploymentError::BadOption { path: self.path.to_owned(), role, line, column, message }
    }

    /// `model = "..."`, relative to the file: its normalized path and its spec.
    fn model(&self, model: Option<Spanned<String>>) -> Result<(PathBuf, ModelSpec), DeploymentError> {
        let rel = model.ok_or_else(|| {
            self.missing("model", "add model = \"<path to the model's config.json>\" (relative to this file)")
        })?;
        let base = self.path.parent().unwrap_or(Path::new("."));
        let model_path = normalize(&base.join(rel.get_ref()));
        let model_error = |message: String| DeploymentError::Model {
            path: self.path.to_owned(),
            model: model_path.clone(),
            message,
        };
        let json = kvconnect_config_file::read_text(&model_path)
            .map_err(|e| model_error(format!("cannot read it: {e}")))?;
        let model = ModelSpec::from_hf_config_json(&json).map_err(|e| model_error(e.to_string()))?;
        Ok((model_path, model))
    }

    /// `engine = "kvconnect" | "vllm"`.
    fn engine(&self, engine: Option<Spanned<String>>) -> Result<EngineKind, DeploymentError> {
        let Some(e) = engine else { return Ok(EngineKind::default()) };
        match e.get_ref().as_str() {
            "kvconnect" => Ok(EngineKind::Kvconnect),
            "vllm" => Ok(EngineKind::Vllm),
            other => {
                let (line, column) = line_col(self.src, e.span().start);
                Err(DeploymentError::Toml {
                    path: self.path.to_owned(),
                    line,
                    column,
                    message: format!(
                        "engine = {other:?}: expected \"kvconnect\" (kvconnect's reference engine, the \
                            default) or \"vllm\" (vLLM servers with KvconnectConnector)"
                    ),
                })
            }
        }
    }

    /// One role's table: its kv-transfer-config and its engine options.
    fn role(
        &self,
        r: Role,
        raw: Option<RawRole>,
        presets: &std::collections::BTreeMap<String, serde_json::Value>,
    ) -> Result<RoleConfig, DeploymentError> {
        let raw = raw.ok_or_else(|| {
            self.missing(
                &format!("[{r}]"),
                "add a table with at least kv_transfer_config = '<vLLM kv-transfer-config JSON>'",
            )
        })?;
        let ktc = raw.kv_transfer_config.clone().ok_or_else(|| {
            self.missing(
                &format!("{r}.kv_transfer_config"),
                "set it to the worker's vLLM --kv-transfer-config JSON",
            )
        })?;
        let (kv_transfer_config, notes) = self.kv_transfer_config(r, &ktc, presets)?;
        let config_at = content_start(self.src, ktc.span().start);
        let options = self.options(r, &raw, &kv_transfer_config, config_at)?;
        Ok(RoleConfig {
            kv_transfer_config,
            options,
            enable_prefix_caching: raw.enable_prefix_caching.unwrap_or(false),
            kv_producers: raw.kv_producers.unwrap_or_default(),
            notes,
        })
    }

    /// A role's `kv_transfer_config`: the JSON with presets expanded, LMCache's P/D settings
    /// turned into the nixl connector beside lmcache, and a `kv_role` of the other side
    /// refused (a copy-paste slip that would start a server on the wrong side).
    fn kv_transfer_config(
        &self,
        r: Role,
        ktc: &Spanned<String>,
        presets: &std::collections::BTreeMap<String, serde_json::Value>,
    ) -> Result<(KvTransferConfig, Vec<String>), DeploymentError> {
        let what = format!("[{r}] kv_transfer_config");
        let json = parse_embedded(self.path, self.src, &what, ktc)?;
        let json = expand_presets(self.path, json, presets, &mut Vec::new())?;
        let at = content_start(self.src, ktc.span().start);
        let (line, column) = line_col(self.src, at);
        let config: KvTransferConfig = serde_json::from_value(json).map_err(|e| DeploymentError::Json {
            path: self.path.to_owned(),
            what: what.clone(),
            line,
            column,
            message: e.to_string(),
        })?;
        let (config, notes) = lmcache_pd(config).map_err(|message| self.bad_option(r, at, message))?;
        if let Some(w) = config.kv_role.filter(|k| Role::from_kv_role(*k).is_some_and(|says| says != r)) {
            let want = format!("{} or {}", r.kv_role(), kvconnect_api::KvRole::Both);
            let from = if notes.is_empty() { "" } else { " (from LMCache's pd_role)" };
            let message = format!(
                "kv_transfer_config has kv_role {w}{from}; a {r} worker needs {want} (or no kv_role)"
            );
            return Err(self.bad_option(r, at, message));
        }
        Ok((config, notes))
    }

    /// A role's engine options; `config_at` is where its kv_transfer_config starts (a bad
    /// `kv_buffer_device` inside it is reported there).
    fn options(
        &self,
        r: Role,
        raw: &RawRole,
        config: &KvTransferConfig,
        config_at: usize,
    ) -> Result<EngineOptions, DeploymentError> {
        let bad = |span: std::ops::Range<usize>, message: String| self.bad_option(r, span.start, message);
        let mut o = EngineOptions::default();
        if let Some(h) = &raw.hybrid_kv_cache_manager {
            o.hybrid_kv_cache_manager = match h.get_ref() {
                StrOrBool::Bool(true) => HmaOption::On,
                StrOrBool::Bool(false) => HmaOption::Off,
                StrOrBool::Str(s) => s
                    .parse()
                    .map_err(|e: kvconnect_api::negotiate::OptionParseError| bad(h.span(), e.to_string()))?,
            };
        }
        if let Some(l) = &raw.kv_cache_layout {
            let layout = l
                .get_ref()
                .parse::<KvLayout>()
                .map_err(|e| bad(l.span(), format!("kv_cache_layout: {e}")))?;
            o.kv_cache_layout = Some(layout);
        }
        let positive = |v: &Spanned<i64>, key: &str| -> Result<u32, DeploymentError> {
            u32::try_from(*v.get_ref()).ok().filter(|n| *n > 0).ok_or_else(|| {
                bad(v.span(), format!("{key} must be a positive integer, got {}", v.get_ref()))
            })
        };
        if let Some(b) = &raw.block_size {
            o.block_size = Some(positive(b, "block_size")?);
        }
        if let Some(t) = &raw.tp_size {
            o.tp_size = positive(t, "tp_size")?;
        }
        if let Some(d) = &raw.cache_dtype {
            o.cache_dtype = parse_cache_dtype(d.get_ref()).map_err(|m| bad(d.span(), m))?;
        }
        if let Some(m) = &raw.kv_buffer_device {
            let memory = EngineOptions::memory_from_kv_buffer_device(m.get_ref())
                .map_err(|e| bad(m.span(), e.to_string()))?;
            o.memory = Some(memory);
        } else if let Some(dev) = &config.kv_buffer_device {
            let memory = EngineOptions::memory_from_kv_buffer_device(dev)
                .map_err(|e| self.bad_option(r, config_at, e.to_string()))?;
            o.memory = Some(memory);
        }
        if let Some(a) = raw.allow_adapters {
            o.allow_adapters = a;
        }
        Ok(o)
    }
}

/// `cache_dtype`: `auto` (the model's dtype) or a dtype name.
pub fn parse_cache_dtype(s: &str) -> Result<Option<Dtype>, String> {
    if s.trim().eq_ignore_ascii_case("auto") {
        return Ok(None);
    }
    Dtype::from_hf_name(s).map(Some).ok_or_else(|| {
        format!(
            "cache_dtype: '{s}' is not a valid value; expected auto, bf16, fp16, fp32, fp8 (= fp8_e4m3) \
            or fp8_e5m2"
        )
    })
}

/// The children negotiation sees for one engine's config: a composite's leaf children, or
/// the connector itself.
pub fn collect_children(
    resolver: &dyn ConnectorResolver,
    config: &KvTransferConfig,
    model: &ModelSpec,
    who: &Negotiating,
) -> Result<Vec<ChildCaps>, DeploymentError> {
    let cerr = |message: String| DeploymentError::Connector { who: who.clone(), message };
    // A config error already names what is wrong; the connector's name is said once, as the
    // user wrote it.
    let said = |e: kvconnect_api::ConnectorError| match e {
        kvconnect_api::ConnectorError::InvalidConfig { message, .. } => {
            format!("{}: {message}", config.kv_connector)
        }
        other => format!("{}: {other}", config.kv_connector),
    };
    let factory = resolver.resolve(config).map_err(|e| {
        let message = match &e {
            kvconnect_api::ConnectorError::InvalidConfig { message, .. } => message.clone(),
            other => other.to_string(),
        };
        cerr(format!(
            "cannot resolve connector '{}': {}",
            config.kv_connector,
            kvconnect_pd::error::with_known(&message, &resolver.known_names())
        ))
    })?;
    if let Some(children) = factory.child_capabilities(config, Some(model)).map_err(|e| cerr(said(e)))? {
        return Ok(children);
    }
    let info = factory.info();
    let caps = factory.capabilities(config, Some(model)).map_err(|e| cerr(said(e)))?;
    caps.validate()
        .map_err(|e| cerr(format!("connector '{}' declares contradictory capabilities: {e}", info.name)))?;
    Ok(vec![ChildCaps { name: info.name, version: info.version, caps }])
}

/// Negotiates one engine alone, as an independently launched engine does.
pub fn negotiate_alone(
    resolver: &dyn ConnectorResolver,
    config: &KvTransferConfig,
    model: &ModelSpec,
    opts: &EngineOptions,
    who: Negotiating,
) -> Result<(Negotiated, CompatDescriptor), DeploymentError> {
    let children = collect_children(resolver, config, model, &who)?;
    let n = negotiate(model, opts, &children)
        .map_err(|conflict| DeploymentError::Conflict { who, conflict: Box::new(conflict) })?;
    let d = CompatDescriptor::new(model, &n, opts);
    Ok((n, d))
}

/// [`negotiate_alone`] for an engine that errors name `name` (the vLLM adapter's entry: it
/// names the engine by its `kv_role`).
pub fn negotiate_worker(
    resolver: &dyn ConnectorResolver,
    config: &KvTransferConfig,
    model: &ModelSpec,
    opts: &EngineOptions,
    name: &'static str,
) -> Result<(Negotiated, CompatDescriptor), DeploymentError> {
    negotiate_alone(resolver, config, model, opts, Negotiating::Engine(name))
}

/// What a server of `role` started from `deployment` negotiates: alone (`joint = false`, as
/// independently launched servers do) or jointly with its peer (`joint = true`), in which
/// case both roles reach the same strict fields and hash by construction.
pub fn negotiate_role(
    deployment: &Deployment,
    role: Role,
    joint: bool,
    resolver: &dyn ConnectorResolver,
) -> Result<(Negotiated, CompatDescriptor), DeploymentError> {
    let model = &deployment.model;
    if !joint {
        let rc = deployment.role(role);
        return negotiate_alone(
            resolver,
            &rc.kv_transfer_config,
            model,
            &rc.options,
            Negotiating::Role(role),
        );
    }
    let (p, d) = negotiate_both(deployment, resolver)?;
    Ok(match role {
        Role::Prefill => p,
        Role::Decode => d,
    })
}

type RoleResult = (Negotiated, CompatDescriptor);

fn negotiate_both(
    deployment: &Deployment,
    resolver: &dyn ConnectorResolver,
) -> Result<(RoleResult, RoleResult), DeploymentError> {
    let model = &deployment.model;
    let (p, d) = (&deployment.prefill, &deployment.decode);
    let pc = collect_children(resolver, &p.kv_transfer_config, model, &Negotiating::Role(Role::Prefill))?;
    let dc = collect_children(resolver, &d.kv_transfer_config, model, &Negotiating::Role(Role::Decode))?;
    let (pn, dn) = negotiate_deployment(model, (&p.options, &pc), (&d.options, &dc)).map_err(|conflict| {
        DeploymentError::Conflict { who: Negotiating::Deployment, conflict: Box::new(conflict) }
    })?;
    let pd = CompatDescriptor::new(model, &pn, &p.options);
    let dd = CompatDescriptor::new(model, &dn, &d.options);
    Ok(((pn, pd), (dn, dd)))
}

/// Both roles negotiated and compared.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Jointly negotiated.
    pub joint: bool,
    /// Prefill's result.
    pub prefill: (Negotiated, CompatDescriptor),
    /// Decode's result.
    pub decode: (Negotiated, CompatDescriptor),
    /// Every field that differs, strict first, worded `prefill=..., decode=...`.
    pub diffs: Vec<FieldDiff>,
    /// What decode applies to what it reads from prefill, or why it cannot.
    pub outcome: Result<AdaptationPlan, Incompatible>,
}

/// Negotiates both roles (alone or jointly) and checks that they can exchange KV.
pub fn plan(
    deployment: &Deployment,
    joint: bool,
    resolver: &dyn ConnectorResolver,
) -> Result<Plan, DeploymentError> {
    let (prefill, decode) = if joint {
        negotiate_both(deployment, resolver)?
    } else {
        (
            negotiate_role(deployment, Role::Prefill, false, resolver)?,
            negotiate_role(deployment, Role::Decode, false, resolver)?,
        )
    };
    let diffs = diff_roles(&prefill.1, &decode.1, Role::Prefill.name(), Role::Decode.name());
    let outcome = check_roles(&prefill.1, &decode.1);
    Ok(Plan { joint, prefill, decode, diffs, outcome })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvconnect_registry::Registry;

    /// A path in examples/deployments/, so `../../fixtures/...` finds the model configs.
    fn here() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../examples/deployments/test.toml")
    }

    const QWEN: &str = "model = \"../../fixtures/models/Qwen--Qwen3-0.6B/config.json\"\n";
    const GPT_OSS: &str = "model = \"../../fixtures/models/openai--gpt-oss-20b/config.json\"\n";
    const DYN3545: &str = r#"
[prefill]
kv_transfer_config = '{"kv_connector":"PdConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"LMCacheConnectorV1"},{"kv_connector":"NixlConnector"}]}}'
[decode]
kv_transfer_config = '{"kv_connector":"NixlConnector"}'
"#;

    fn parse(src: &str) -> Result<Deployment, DeploymentError> {
        Deployment::parse(&here(), src)
    }

    #[test]
    fn the_engine_decides_how_many_ranks_one_connector_serves() {
        let tp2 = "[prefill]\nkv_transfer_config = '{\"kv_connector\":\"NixlConnector\"}'\ntp_size = 2\n\
                   [decode]\nkv_transfer_config = '{\"kv_connector\":\"NixlConnector\"}'\n";
        // kvconnect's engine (the default): its ranks share one connector.
        let d = parse(&format!("{QWEN}served_model_name = \"qwen\"\n{tp2}")).unwrap();
        assert_eq!(
            (d.engine, d.prefill.options.ranks_per_worker, d.decode.options.ranks_per_worker),
            (EngineKind::Kvconnect, 2, 1)
        );
        assert_eq!(d.served_model_name.as_deref(), Some("qwen"));
        assert!(d.for_kvconnect_servers().is_ok());
        // vLLM: one connector per rank; kvconnect's servers refuse to run the file.
        let d = parse(&format!("{QWEN}engine = \"vllm\"\n{tp2}")).unwrap();
        assert_eq!((d.engine, d.prefill.options.ranks_per_worker), (EngineKind::Vllm, 1));
        let e = d.for_kvconnect_servers().unwrap_err().to_string();
        assert!(e.contains("describes vllm servers (engine = \"vllm\")"), "{e}");
        let e = parse(&format!("{QWEN}engine = \"sglang\"\n{tp2}")).unwrap_err().to_string();
        assert!(e.contains("engine = \"sglang\": expected \"kvconnect\"") && e.contains(":2:"), "{e}");
    }

    #[test]
    fn reads_roles_options_and_the_model_relative_to_the_file() {
        let d = parse(&format!(
            "{QWEN}[prefill]\n\
             kv_transfer_config = '{{\"kv_connector\":\"NixlConnector\",\"kv_buffer_device\":\"cuda\"}}'\n\
             hybrid_kv_cache_manager = \"off\"\nkv_cache_layout = \"HND\"\nblock_size = 32\ntp_size = 2\n\
             cache_dtype = \"fp8\"\nallow_adapters = false\n\
             [decode]\nkv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n\
             hybrid_kv_cache_manager = true\n"
        ))
        .unwrap();
        assert_eq!(d.model.num_layers, 28);
        assert!(d.model_path.ends_with("fixtures/models/Qwen--Qwen3-0.6B/config.json"));
        assert!(!d.model_path.to_string_lossy().contains(".."), "{}", d.model_path.display());
        let p = &d.prefill.options;
        assert_eq!(p.hybrid_kv_cache_manager, HmaOption::Off);
        assert_eq!(p.kv_cache_layout, Some(KvLayout::LBHNC));
        assert_eq!((p.block_size, p.tp_size, p.allow_adapters), (Some(32), 2, false));
        assert_eq!(p.cache_dtype, Some(Dtype::Fp8E4m3));
        assert_eq!(p.memory, Some(kvconnect_api::MemoryKind::Device), "from the config's kv_buffer_device");
        assert_eq!(d.decode.options.hybrid_kv_cache_manager, HmaOption::On);
        assert_eq!(
            d.decode.options,
            EngineOptions { hybrid_kv_cache_manager: HmaOption::On, ..Default::default() }
        );
    }

    #[test]
    fn malformed_toml_and_json_are_placed_in_the_file() {
        let e = parse(&format!("{QWEN}\n[prefill\nkv_transfer_config = '{{}}'\n")).unwrap_err();
        assert!(matches!(e, DeploymentError::Toml { line: 3, .. }), "{e}");
        assert!(!e.to_string().contains('\n'), "one line: {e}");
        let e = parse(&format!(
            "{QWEN}[prefill]\nkv_transfer_config = '''\n\
             {{\n  \"kv_connector\": \"NixlConnector\",\n  \"kv_role\": ,\n}}\n'''\n[decode]\n\
             kv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n"
        ))
        .unwrap_err();
        // Line 6 of the file is `  "kv_role": ,`; the comma is column 14.
        assert!(matches!(e, DeploymentError::Json { line: 6, column: 14, .. }), "{e}");
        assert!(e.to_string().contains("test.toml:6:14: [prefill] kv_transfer_config"), "{e}");
        let e = parse(&format!(
            "{QWEN}[prefill]\nkv_transfer_config = '{{\"kv_connector\": 7}}'\n[decode]\n\
             kv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("invalid type: integer `7`"), "{e}");
    }

    #[test]
    fn unknown_keys_and_bad_values_are_named() {
        let e =
            parse(&format!("{QWEN}colour = 1\n[prefill]\nkv_cache_layot = \"HND\"\n[decode]\n")).unwrap_err();
        let s = e.to_string();
        assert!(
            s.contains("colour") && s.contains("prefill.kv_cache_layot") && s.contains("kv_cache_layout"),
            "{s}"
        );
        for (line, want) in [
            ("kv_cache_layout = \"HDN\"", "unknown KV layout 'HDN'"),
            ("hybrid_kv_cache_manager = \"maybe\"", "auto, on or off"),
            ("block_size = 0", "block_size must be a positive integer, got 0"),
            ("cache_dtype = \"int4\"", "expected auto, bf16"),
            ("kv_buffer_device = \"tpu\"", "cpu or cuda"),
        ] {
            let e = parse(&format!(
                "{QWEN}[prefill]\nkv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n{line}\n\
                 [decode]\nkv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n"
            ))
            .unwrap_err();
            assert!(matches!(e, DeploymentError::BadOption { line: 4, .. }), "{e}");
            assert!(e.to_string().contains(want), "{e}");
        }
        let e = parse(&format!(
            "{QWEN}[prefill]\nkv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("missing [decode]"), "{e}");
        let e = parse(&format!(
            "{QWEN}[prefill]\n\
             kv_transfer_config = '{{\"kv_connector\":\"NixlConnector\",\"kv_role\":\"kv_consumer\"}}'\n\
             [decode]\nkv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n"
        ))
        .unwrap_err();
        assert!(
            e.to_string().contains("test.toml:3:23: [prefill] kv_transfer_config has kv_role kv_consumer"),
            "{e}"
        );
        let e = parse("[prefill]\n").unwrap_err();
        assert!(e.to_string().contains("missing model"), "{e}");
        let e = parse(&format!("model = \"nowhere.json\"\n{DYN3545}")).unwrap_err();
        assert!(e.to_string().contains("nowhere.json") && e.to_string().contains("cannot read it"), "{e}");
    }

    #[test]
    fn named_connectors_expand_and_loops_are_refused() {
        let d = parse(&format!(
            "{QWEN}[connectors]\ncache = '{{\"kv_connector\":\"LMCacheConnectorV1\",\"kv_connector_extra_config\":{{\"chunk_size\":128}}}}'\n\
             [prefill]\nkv_transfer_config = '{{\"kv_connector\":\"PdConnector\",\"kv_connector_extra_config\":{{\"connectors\":[{{\"kv_connector\":\"cache\"}},{{\"kv_connector\":\"NixlConnector\"}}]}}}}'\n\
             [decode]\nkv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n"
        ))
        .unwrap();
        let child = &d.prefill.kv_transfer_config.kv_connector_extra_config["connectors"][0];
        assert_eq!(child["kv_connector"], "LMCacheConnectorV1");
        assert_eq!(child["kv_connector_extra_config"]["chunk_size"], 128);
        let e = parse(&format!(
            "{QWEN}[connectors]\na = '{{\"kv_connector\":\"PdConnector\",\"kv_connector_extra_config\":{{\"connectors\":[{{\"kv_connector\":\"b\"}}]}}}}'\n\
             b = '{{\"kv_connector\":\"PdConnector\",\"kv_connector_extra_config\":{{\"connectors\":[{{\"kv_connector\":\"a\"}}]}}}}'\n\
             [prefill]\nkv_transfer_config = '{{\"kv_connector\":\"a\"}}'\n[decode]\n\
             kv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n"
        ))
        .unwrap_err();
        assert!(e.to_string().contains("'a' contains itself (a -> b -> a)"), "{e}");
    }

    #[test]
    fn dyn3545_alone_differs_jointly_agrees() {
        let r = Registry::builtins_only();
        let d = parse(&format!("{GPT_OSS}{DYN3545}")).unwrap();
        let (pn, pd) = negotiate_role(&d, Role::Prefill, false, &r).unwrap();
        let (dn, dd) = negotiate_role(&d, Role::Decode, false, &r).unwrap();
        assert!(!pn.effective.hma && dn.effective.hma);
        assert_ne!(pd.compat_hash(), dd.compat_hash());
        let p = plan(&d, false, &r).unwrap();
        let inc = p.outcome.unwrap_err();
        assert!(inc.diff_of("hma").is_some(), "{inc}");

        let (_, pj) = negotiate_role(&d, Role::Prefill, true, &r).unwrap();
        let (_, dj) = negotiate_role(&d, Role::Decode, true, &r).unwrap();
        assert_eq!(pj.compat_hash(), dj.compat_hash());
        assert!(!pj.effective.hma && !dj.effective.hma);
        assert!(plan(&d, true, &r).unwrap().outcome.unwrap().is_identity());

        // With one attention kind HMA changes nothing: compatible even alone.
        let q = parse(&format!("{QWEN}{DYN3545}")).unwrap();
        assert!(plan(&q, false, &r).unwrap().outcome.is_ok());
    }

    #[test]
    fn resolution_errors_are_bad_input_conflicts_are_not() {
        let r = Registry::builtins_only();
        let bad = parse(&format!(
            "{QWEN}[prefill]\nkv_transfer_config = '{{\"kv_connector\":\"NoSuchConnector\"}}'\n[decode]\n\
             kv_transfer_config = '{{\"kv_connector\":\"NixlConnector\"}}'\n"
        ))
        .unwrap();
        let e = plan(&bad, false, &r).unwrap_err();
        assert!(!e.is_conflict());
        assert!(e.to_string().contains("NoSuchConnector") && e.to_string().contains("NixlConnector"), "{e}");
        let on = parse(
            &format!("{GPT_OSS}{DYN3545}").replace("[decode]", "hybrid_kv_cache_manager = \"on\"\n[decode]"),
        )
        .unwrap();
        let e = plan(&on, false, &r).unwrap_err();
        assert!(e.is_conflict());
        assert!(e.to_string().contains("'lmcache'"), "{e}");
    }
}
