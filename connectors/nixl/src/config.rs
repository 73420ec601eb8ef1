//! The nixl connector's settings, read from `kv_connector_extra_config`.
//!
//! Keys: `backend` (`shm` | `tcp` | `nixl`, default `shm`; vLLM's `backends: ["UCX"]` selects
//! `nixl`), `kv_lease_duration` (seconds, default 30), `host` / `port` (the producer's
//! control/data listener, default `127.0.0.1:0`), `io_timeout` and `connect_timeout`
//! (seconds, defaults 10 and 5), `max_frame_bytes` (control frame cap, default 16 MiB), and
//! `side_channel_host` / `side_channel_port`, which the *host* sets to its own side-channel
//! address so that `request_finished` can put it into the transfer params. Backend
//! `cuda_ipc` also reads `cuda_ipc_path` (`auto` | `peer` | `staged`, default `auto`): how
//! decode reaches a producer's GPU (see [`CudaIpcPath`]). Backend `shm` reads `copy_threads`
//! (default: the cores this process may use, at most 8): how many threads copy one large pull.
//! Backend `tcp` reads `tcp_streams` (default one per two cores, 1 to 4): how many parallel
//! connections receive one large pull, each carrying at least `tcp_stream_min_bytes`
//! (default 64 MiB), and `tcp_socket_buffer` (bytes, default 4 MiB, 0 for the kernel's
//! autotuning): each data socket's send and receive buffer.
//! `load` (`auto` | `async` | `sync`, default `auto`): whether decode's engine steps on while
//! a request's KV arrives, or the load finishes inside the step that computes the prompt's
//! last token; `auto` loads synchronously over backend `shm` when a request's load is at most
//! `sync_max_bytes` (default 64 MiB) and asynchronously otherwise (see [`LoadMode`]).
//! `kv_lease_max` (seconds, default four leases) caps how long renewals may keep a request's
//! blocks; `max_connections` (default 64) caps the listener's connections; `idle_timeout`
//! (seconds, default 300 or two leases, whichever is longer) is how long the listener keeps a
//! connection that carries no request (consumers open a new one when it is gone).
//!
//! The listener's bound address is what the handshake metadata publishes, so for tcp between
//! hosts set `host` to an address the decode host can reach (not `0.0.0.0`). Every connection
//! to it proves the deployment's secret (`data_plane_secret`, which the host sets, else
//! `KVCONNECT_SIDE_CHANNEL_TOKEN`); without one it binds loopback only.

use kvconnect_api::{ConnectorError, KvTransferConfig};
use kvconnect_dataplane::auth::{Secret, SECRET_CONFIG_KEY, SECRET_ENV};
use serde_json::{Map, Value};
use std::time::Duration;

/// The connector's name in messages.
pub const NAME: &str = "nixl";

pub use crate::transport::Backend;

/// How backend `cuda_ipc` reaches the producer's GPU memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaIpcPath {
    /// The gather kernel reads the producer's memory directly when the two GPUs are the same
    /// or have peer access (NVLink, PCIe P2P); otherwise the copy goes through pinned host
    /// memory. Chosen per producer, and logged.
    Auto,
    /// Direct only: a producer on a GPU without peer access is a failed load (the error says
    /// so), never a silent slow path.
    Peer,
    /// Always through pinned host memory (for GPUs whose peer path is broken or slow).
    Staged,
}

impl CudaIpcPath {
    /// The name users write.
    pub fn name(self) -> &'static str {
        match self {
            CudaIpcPath::Auto => "auto",
            CudaIpcPath::Peer => "peer",
            CudaIpcPath::Staged => "staged",
        }
    }

    fn parse(s: &str) -> Result<CudaIpcPath, ConnectorError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(CudaIpcPath::Auto),
            "peer" => Ok(CudaIpcPath::Peer),
            "staged" | "host" => Ok(CudaIpcPath::Staged),
            other => Err(ConnectorError::config(
                NAME,
                format!(
                    "unknown cuda_ipc_path '{other}' in kv_connector_extra_config; use \"auto\" (direct \
                    when the GPUs have peer access, else through pinned host memory), \"peer\" or \"staged\""
                ),
            )),
        }
    }
}

/// How decode's loads are scheduled (`load`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoadMode {
    /// Synchronous over backend `shm` for a load of at most `sync_max_bytes`, asynchronous
    /// otherwise: a same-host pull runs at memory speed, shorter than the two engine steps an
    /// asynchronous load costs, while a large pull or one over a link would hold up every
    /// request in the step.
    Auto,
    /// Always asynchronous (vLLM's NixlConnector's way).
    Async,
    /// Always synchronous.
    Sync,
}

impl LoadMode {
    fn parse(s: &str) -> Result<LoadMode, ConnectorError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(LoadMode::Auto),
            "async" => Ok(LoadMode::Async),
            "sync" => Ok(LoadMode::Sync),
            _ => Err(ConnectorError::config(
                NAME,
                format!(
                    "kv_connector_extra_config.load = \"{}\": expected \"auto\" (the default: synchronous \
                    over shm up to sync_max_bytes, else asynchronous), \"async\" (decode steps on while the \
                    KV arrives) or \"sync\" (the load finishes inside the step that computes the prompt's \
                    last token)",
                    s.trim()
                ),
            )),
        }
    }
}

/// Default of `sync_max_bytes`: a pull of this size over shared memory takes a few
/// milliseconds, about one engine step of a small model.
pub const DEFAULT_SYNC_MAX_BYTES: u64 = 64 << 20;

/// Parsed settings.
#[derive(Debug, Clone, PartialEq)]
pub struct NixlConfig {
    /// Data path.
    pub backend: Backend,
    /// How long a producer keeps a finished request's blocks for a consumer that has not
    /// come (renewed by every heartbeat or read).
    pub lease: Duration,
    /// Listener bind address (producer).
    pub host: String,
    /// Listener port (0 = any).
    pub port: u16,
    /// Timeout of every socket read and write once a transfer started.
    pub io_timeout: Duration,
    /// Timeout of connecting to a producer.
    pub connect_timeout: Duration,
    /// Largest control frame accepted.
    pub max_frame_bytes: usize,
    /// The host's side-channel address, put into transfer params.
    pub side_channel: Option<(String, u16)>,
    /// Backend cuda_ipc: direct peer reads, host staging, or chosen per producer.
    pub cuda_ipc_path: CudaIpcPath,
    /// Backend shm: threads that copy one large pull.
    pub copy_threads: usize,
    /// Backend tcp: parallel streams of one large pull.
    pub tcp_streams: usize,
    /// Backend tcp: each data socket's send and receive buffer, bytes (0: the kernel's).
    pub tcp_socket_buffer: usize,
    /// Backend tcp: the least one parallel stream carries, bytes.
    pub tcp_stream_min_bytes: u64,
    /// The deployment's data-plane secret (ARCHITECTURE.md §10): from `data_plane_secret`,
    /// which the host sets, else `KVCONNECT_SIDE_CHANNEL_TOKEN`; `None` runs unauthenticated,
    /// which a producer allows on loopback only.
    pub secret: Option<Secret>,
    /// The longest a producer keeps a request's blocks from when it first held them, however
    /// often a consumer renews the lease (`kv_lease_max`, default four leases).
    pub lease_max: Duration,
    /// Connections the producer listener serves at once (`max_connections`); more are refused.
    pub max_connections: usize,
    /// How long the producer listener keeps a connection that carries no request
    /// (`idle_timeout`; default [`default_idle_timeout`] of the lease).
    pub idle_timeout: Duration,
    /// The engine's opaque blocks hold their KV heads one after another
    /// (`opaque_heads_outer`, which the host sets from the engine's tensors: vLLM's CPU
    /// backend's `[B, H, N, 2C]`), so a slice of heads can move between TP sizes.
    pub opaque_heads_outer: bool,
    /// `load`: whether a request's load is scheduled as a synchronous one (vLLM's
    /// `load_kv_async = False`). The engine then computes the prompt's last token in the very
    /// step the load runs in, and `wait_for_layer_load` holds that step until the KV is in,
    /// instead of two more engine steps (one to start the load, one to see it finished) before
    /// the request runs. Best where the pull is short next to a step (a same-host producer);
    /// the step waits for the pull, so a slow link stalls every request in it. With the hybrid
    /// KV cache manager on, or more than one KV cache group, loads stay asynchronous.
    pub load: LoadMode,
    /// `sync_max_bytes`: under `load: "auto"`, the largest load (this rank's bytes) that is
    /// synchronous.
    pub sync_max_bytes: u64,
}

impl Default for NixlConfig {
    fn default() -> Self {
        NixlConfig {
            backend: Backend::default(),
            lease: Duration::from_secs(30),
            host: "127.0.0.1".to_owned(),
            port: 0,
            io_timeout: Duration::from_secs(10),
            connect_timeout: Duration::from_secs(5),
            max_frame_bytes: crate::wire::DEFAULT_MAX_FRAME,
            side_channel: None,
            cuda_ipc_path: CudaIpcPath::Auto,
            copy_threads: crate::copy_plan::default_copy_threads(),
            tcp_streams: crate::tcp_data::default_tcp_streams(),
            tcp_socket_buffer: crate::tcp_data::DEFAULT_SOCKET_BUFFER,
            tcp_stream_min_bytes: crate::tcp_data::STREAM_MIN_BYTES,
            secret: None,
            lease_max: Duration::from_secs(120),
            max_connections: DEFAULT_MAX_CONNECTIONS,
            idle_timeout: default_idle_timeout(Duration::from_secs(30)),
            opaque_heads_outer: false,
            load: LoadMode::Auto,
            sync_max_bytes: DEFAULT_SYNC_MAX_BYTES,
        }
    }
}

/// Default of `idle_timeout` under a lease of `lease`: five minutes, or two leases when that
/// is longer.
pub fn default_idle_timeout(lease: Duration) -> Duration {
    Duration::from_secs(300).max(lease * 2)
}

/// The range `idle_timeout` is accepted in, seconds: shorter closes connections between the
/// messages of one transfer; longer keeps a serving thread per forgotten connection for days.
pub const IDLE_TIMEOUT_RANGE: std::ops::RangeInclusive<f64> = 0.1..=86400.0;

/// Default of `max_connections`: far above the decode workers a producer serves (one
/// connection each), far below what would exhaust its threads.
pub const DEFAULT_MAX_CONNECTIONS: usize = 64;

/// The secret from the config the host wrote, else from the environment.
fn secret(extra: &Map<String, Value>) -> Result<Option<Secret>, ConnectorError> {
    let bad = |e: kvconnect_dataplane::auth::AuthError| ConnectorError::config(NAME, e.to_string());
    if let Some(s) = string(extra, SECRET_CONFIG_KEY)? {
        return Secret::from_text(&s, "the host").map(Some).map_err(bad);
    }
    match std::env::var(SECRET_ENV) {
        Ok(s) if !s.trim().is_empty() => Secret::from_text(&s, SECRET_ENV).map(Some).map_err(bad),
        _ => Ok(None),
    }
}

fn seconds(extra: &Map<String, Value>, key: &str, default: Duration) -> Result<Duration, ConnectorError> {
    match extra.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => match v.as_f64() {
            Some(s) if s.is_finite() && s > 0.0 && s < 1e9 => Ok(Duration::from_secs_f64(s)),
            _ => Err(ConnectorError::config(
                NAME,
                format!("kv_connector_extra_config.{key} = {v}: expected a positive number of seconds"),
            )),
        },
    }
}

fn port(extra: &Map<String, Value>, key: &str) -> Result<Option<u16>, ConnectorError> {
    match extra.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => {
            let n = v.as_u64().or_else(|| v.as_str().and_then(|s| s.trim().parse().ok()));
            match n.and_then(|n| u16::try_from(n).ok()) {
                Some(p) => Ok(Some(p)),
                None => Err(ConnectorError::config(
                    NAME,
                    format!("kv_connector_extra_config.{key} = {v}: expected a TCP port (0..=65535)"),
                )),
            }
        }
    }
}

/// A whole number in `range` under `key`, else `default`; `expected` says what to write.
fn count(
    extra: &Map<String, Value>,
    key: &str,
    default: usize,
    range: std::ops::RangeInclusive<u64>,
    expected: &str,
) -> Result<usize, ConnectorError> {
    match extra.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => match v.as_u64().filter(|n| range.contains(n)).and_then(|n| usize::try_from(n).ok()) {
            Some(n) => Ok(n),
            None => Err(ConnectorError::config(
                NAME,
                format!("kv_connector_extra_config.{key} = {v}: expected {expected}"),
            )),
        },
    }
}

fn string(extra: &Map<String, Value>, key: &str) -> Result<Option<String>, ConnectorError> {
    match extra.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(v) => Err(ConnectorError::config(
            NAME,
            format!("kv_connector_extra_config.{key} = {v}: expected a string"),
        )),
    }
}

impl NixlConfig {
    /// Reads the settings from a kv-transfer-config.
    pub fn from_config(config: &KvTransferConfig) -> Result<NixlConfig, ConnectorError> {
        let extra = &config.kv_connector_extra_config;
        let d = NixlConfig::default();
        let backend = match (string(extra, "backend")?, extra.get("backends")) {
            (Some(b), _) => Backend::parse(&b)?,
            // vLLM's NixlConnector lists NIXL backends (`["UCX"]`): that is the real library.
            (None, Some(Value::Array(list))) if !list.is_empty() => {
                Backend::of(&crate::transport::nixl::BACKEND)
            }
            (None, Some(Value::Array(_))) | (None, None) | (None, Some(Value::Null)) => d.backend,
            (None, Some(v)) => {
                return Err(ConnectorError::config(
                    NAME,
                    format!("kv_connector_extra_config.backends = {v}: expected a list such as [\"UCX\"]"),
                ))
            }
        };
        let max_frame_bytes = match extra.get("max_frame_bytes") {
            None | Some(Value::Null) => d.max_frame_bytes,
            Some(v) => match v.as_u64() {
                Some(n) if (1024..=(1 << 30)).contains(&n) => n as usize,
                _ => {
                    return Err(ConnectorError::config(
                        NAME,
                        format!(
                            "kv_connector_extra_config.max_frame_bytes = {v}: expected bytes between \
                            1024 and 1 GiB"
                        ),
                    ))
                }
            },
        };
        let side_channel = match (string(extra, "side_channel_host")?, port(extra, "side_channel_port")?) {
            (Some(h), Some(p)) => Some((h, p)),
            (None, None) => None,
            _ => return Err(ConnectorError::config(
                NAME,
                "side_channel_host and side_channel_port must be set together (the host sets both to its \
                        side-channel address)",
            )),
        };
        let copy_threads = count(
            extra,
            "copy_threads",
            d.copy_threads,
            1..=64,
            "a thread count from 1 to 64 (leave it out for one per core, at most 8)",
        )?;
        let tcp_streams = count(
            extra,
            "tcp_streams",
            d.tcp_streams,
            1..=16,
            "a stream count from 1 to 16 (leave it out for one per two cores, at most 4)",
        )?;
        let tcp_socket_buffer = count(
            extra,
            "tcp_socket_buffer",
            d.tcp_socket_buffer,
            0..=(256 << 20),
            "bytes from 0 (the kernel's autotuning) to 256 MiB",
        )?;
        let tcp_stream_min_bytes = count(
            extra,
            "tcp_stream_min_bytes",
            d.tcp_stream_min_bytes as usize,
            1..=(1 << 40),
            "bytes from 1 to 1 TiB",
        )? as u64;
        let lease = seconds(extra, "kv_lease_duration", d.lease)?;
        let lease_max = seconds(extra, "kv_lease_max", lease * 4)?;
        if lease_max < lease {
            return Err(ConnectorError::config(
                NAME,
                format!(
                    "kv_connector_extra_config.kv_lease_max = {}s is shorter than kv_lease_duration = {}s; \
                        make it at least as long",
                    lease_max.as_secs_f64(),
                    lease.as_secs_f64()
                ),
            ));
        }
        let max_connections =
            count(extra, "max_connections", d.max_connections, 1..=65536, "a count between 1 and 65536")?;
        let idle_timeout = seconds(extra, "idle_timeout", default_idle_timeout(lease))?;
        if !IDLE_TIMEOUT_RANGE.contains(&idle_timeout.as_secs_f64()) {
            return Err(ConnectorError::config(
                NAME,
                format!(
                    "kv_connector_extra_config.idle_timeout = {}s: expected seconds from {} to {} (one day); \
                        leave it out for {}s",
                    idle_timeout.as_secs_f64(),
                    IDLE_TIMEOUT_RANGE.start(),
                    IDLE_TIMEOUT_RANGE.end(),
                    default_idle_timeout(lease).as_secs_f64()
                ),
            ));
        }
        let opaque_heads_outer = match extra.get("opaque_heads_outer") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                return Err(ConnectorError::config(
                    NAME,
                    format!(
                        "kv_connector_extra_config.opaque_heads_outer = {v}: expected true or false (the \
                        host sets it)"
                    ),
                ))
            }
        };
        let load = match string(extra, "load")? {
            Some(m) => LoadMode::parse(&m)?,
            None => d.load,
        };
        let sync_max_bytes = count(
            extra,
            "sync_max_bytes",
            d.sync_max_bytes as usize,
            0..=(1 << 40),
            "bytes from 0 (never synchronous under load \"auto\") to 1 TiB",
        )? as u64;
        Ok(NixlConfig {
            load,
            sync_max_bytes,
            opaque_heads_outer,
            copy_threads,
            tcp_streams,
            tcp_socket_buffer,
            tcp_stream_min_bytes,
            backend,
            lease,
            lease_max,
            max_connections,
            idle_timeout,
            secret: secret(extra)?,
            host: string(extra, "host")?.unwrap_or(d.host),
            port: port(extra, "port")?.unwrap_or(0),
            io_timeout: seconds(extra, "io_timeout", d.io_timeout)?,
            connect_timeout: seconds(extra, "connect_timeout", d.connect_timeout)?,
            max_frame_bytes,
            side_channel,
            cuda_ipc_path: match string(extra, "cuda_ipc_path")? {
                Some(p) => CudaIpcPath::parse(&p)?,
                None => d.cuda_ipc_path,
            },
        })
    }

    /// Whether a load of `bytes` (this rank's share) is synchronous under `load`, where the
    /// engine allows a synchronous load at all.
    pub fn sync_for(&self, bytes: u64) -> bool {
        match self.load {
            LoadMode::Sync => true,
            LoadMode::Async => false,
            LoadMode::Auto => {
                self.backend == Backend::of(&crate::transport::shm::BACKEND) && bytes <= self.sync_max_bytes
            }
        }
    }

    /// Refuses a backend this build or machine cannot run (`nixl` needs the NIXL library,
    /// [`crate::nixl_lib`], which is found and loaded here, never aborting; `cuda_ipc` the
    /// `cuda` feature), saying what to do.
    pub fn require_available(&self) -> Result<(), ConnectorError> {
        (self.backend.available)()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn cfg(extra: Value) -> KvTransferConfig {
        let mut c = KvTransferConfig::named("NixlConnector");
        c.kv_connector_extra_config = extra.as_object().cloned().unwrap_or_default();
        c
    }

    #[test]
    fn defaults_and_keys() {
        let c = NixlConfig::from_config(&cfg(json!({}))).unwrap();
        assert_eq!(c.backend.name(), "shm");
        assert_eq!(c.lease, Duration::from_secs(30));
        let c = NixlConfig::from_config(&cfg(json!({"backend": "tcp", "kv_lease_duration": 2.5,
            "side_channel_host": "10.0.0.1", "side_channel_port": 5600})))
        .unwrap();
        assert_eq!(c.backend.name(), "tcp");
        assert_eq!(c.lease, Duration::from_millis(2500));
        assert_eq!(c.side_channel, Some(("10.0.0.1".to_owned(), 5600)));
    }

    #[test]
    fn vllm_backends_select_nixl() {
        let c = NixlConfig::from_config(&cfg(json!({"backends": ["UCX"]}))).unwrap();
        assert_eq!(c.backend.name(), "nixl");
        // Available or not depends on the build and the machine; when not, the error says
        // how to get it, and offers the other backends once.
        match c.require_available() {
            Err(e) if !cfg!(feature = "nixl") => {
                let e = e.to_string();
                assert!(e.contains("built without NIXL support") && e.contains("--features nixl"), "{e}");
                assert_eq!(e.matches("backend \"shm\"").count(), 1, "{e}");
            }
            Err(e) => {
                let e = e.to_string();
                assert!(e.contains("scripts/fetch-nixl.sh") || e.contains("NIXL_LIB_DIR"), "{e}");
            }
            Ok(()) => {
                if !cfg!(feature = "nixl") {
                    panic!("backend nixl cannot be available without the feature")
                }
            }
        }
    }

    #[test]
    fn cuda_ipc_path_defaults_to_auto_and_names_its_choices() {
        let c = NixlConfig::from_config(&cfg(json!({"backend": "cuda_ipc"}))).unwrap();
        assert_eq!(c.cuda_ipc_path, CudaIpcPath::Auto);
        let c = NixlConfig::from_config(&cfg(json!({"cuda_ipc_path": "Staged"}))).unwrap();
        assert_eq!(c.cuda_ipc_path, CudaIpcPath::Staged);
        let e = NixlConfig::from_config(&cfg(json!({"cuda_ipc_path": "nvlink"}))).unwrap_err().to_string();
        assert!(e.contains("'nvlink'") && e.contains("\"auto\"") && e.contains("\"staged\""), "{e}");
        let e = NixlConfig::from_config(&cfg(json!({"cuda_ipc_path": 1}))).unwrap_err().to_string();
        assert!(e.contains("cuda_ipc_path") && e.contains("expected a string"), "{e}");
    }

    #[test]
    fn load_mode_is_auto_unless_asked() {
        let d = NixlConfig::from_config(&cfg(json!({}))).unwrap();
        assert_eq!((d.load, d.sync_max_bytes), (LoadMode::Auto, DEFAULT_SYNC_MAX_BYTES));
        assert_eq!(NixlConfig::from_config(&cfg(json!({"load": "async"}))).unwrap().load, LoadMode::Async);
        assert_eq!(NixlConfig::from_config(&cfg(json!({"load": " SYNC "}))).unwrap().load, LoadMode::Sync);
        let c = NixlConfig::from_config(&cfg(json!({"load": "auto", "sync_max_bytes": 0}))).unwrap();
        assert_eq!((c.load, c.sync_max_bytes), (LoadMode::Auto, 0));
    }

    #[test]
    fn auto_loads_synchronously_over_shm_up_to_the_limit_only() {
        let shm = NixlConfig::from_config(&cfg(json!({"sync_max_bytes": 1000}))).unwrap();
        assert!(shm.sync_for(0) && shm.sync_for(1000) && !shm.sync_for(1001));
        let tcp = NixlConfig::from_config(&cfg(json!({"backend": "tcp"}))).unwrap();
        assert!(!tcp.sync_for(1));
        let sync = NixlConfig::from_config(&cfg(json!({"backend": "tcp", "load": "sync"}))).unwrap();
        assert!(sync.sync_for(u64::MAX));
        let not = NixlConfig::from_config(&cfg(json!({"load": "async"}))).unwrap();
        assert!(!not.sync_for(0));
    }

    #[test]
    fn cuda_ipc_needs_the_cuda_feature() {
        let c = NixlConfig::from_config(&cfg(json!({"backend": "cuda_ipc"}))).unwrap();
        assert_eq!(c.backend.name(), "cuda_ipc");
        let r = c.require_available();
        if cfg!(feature = "cuda") {
            assert!(r.is_ok(), "{r:?}");
        } else {
            let e = r.unwrap_err().to_string();
            assert!(e.contains("--features cuda") && e.contains("cuda_ipc"), "{e}");
        }
    }

    #[test]
    fn bad_values_are_named() {
        for (extra, key) in [
            (json!({"backend": "rdma"}), "rdma"),
            (json!({"kv_lease_duration": -1}), "kv_lease_duration"),
            (json!({"side_channel_port": 70000, "side_channel_host": "h"}), "side_channel_port"),
            (json!({"side_channel_host": "h"}), "side_channel_port"),
            (json!({"copy_threads": 0}), "copy_threads = 0: expected a thread count from 1 to 64"),
            (json!({"copy_threads": "many"}), "copy_threads"),
            (json!({"tcp_streams": 0}), "tcp_streams = 0: expected a stream count from 1 to 16"),
            (json!({"tcp_streams": 17}), "tcp_streams = 17"),
            (json!({"tcp_socket_buffer": -1}), "tcp_socket_buffer = -1: expected bytes from 0"),
            (json!({"tcp_socket_buffer": 1e12}), "tcp_socket_buffer"),
            (json!({"idle_timeout": 0}), "idle_timeout = 0: expected a positive number of seconds"),
            (json!({"idle_timeout": 0.01}), "idle_timeout = 0.01s: expected seconds from 0.1 to 86400"),
            (json!({"idle_timeout": 1e7}), "idle_timeout = 10000000s: expected seconds from 0.1"),
            (json!({"idle_timeout": "soon"}), "idle_timeout = \"soon\": expected a positive number"),
            (json!({"load": "eager"}), "load = \"eager\": expected \"auto\""),
            (json!({"sync_max_bytes": -5}), "sync_max_bytes = -5: expected bytes from 0"),
            (json!({"load": true}), "load = true: expected a string"),
        ] {
            let e = NixlConfig::from_config(&cfg(extra)).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn copy_threads_defaults_to_the_cores_and_can_be_set() {
        let d = NixlConfig::from_config(&cfg(json!({}))).unwrap();
        assert_eq!(d.copy_threads, crate::copy_plan::default_copy_threads());
        assert!((1..=8).contains(&d.copy_threads));
        assert_eq!(NixlConfig::from_config(&cfg(json!({"copy_threads": 3}))).unwrap().copy_threads, 3);
    }

    #[test]
    fn tcp_streams_and_socket_buffer_default_and_can_be_set() {
        let d = NixlConfig::from_config(&cfg(json!({}))).unwrap();
        assert_eq!(d.tcp_streams, crate::tcp_data::default_tcp_streams());
        assert_eq!(d.tcp_socket_buffer, crate::tcp_data::DEFAULT_SOCKET_BUFFER);
        let c = NixlConfig::from_config(&cfg(json!({"tcp_streams": 3, "tcp_socket_buffer": 0}))).unwrap();
        assert_eq!((c.tcp_streams, c.tcp_socket_buffer), (3, 0));
    }

    #[test]
    fn idle_timeout_defaults_to_five_minutes_or_two_leases_and_can_be_set() {
        let d = NixlConfig::from_config(&cfg(json!({}))).unwrap();
        assert_eq!(d.idle_timeout, Duration::from_secs(300));
        let long = NixlConfig::from_config(&cfg(json!({"kv_lease_duration": 200}))).unwrap();
        assert_eq!(long.idle_timeout, Duration::from_secs(400));
        let c = NixlConfig::from_config(&cfg(json!({"idle_timeout": 1.5}))).unwrap();
        assert_eq!(c.idle_timeout, Duration::from_millis(1500));
    }
}
