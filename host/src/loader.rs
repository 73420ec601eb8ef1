//! Finds, opens and checks plugin libraries, and wraps what they export in `Foreign*` types
//! that implement the safe connector traits, so the rest of the host cannot tell a plugin
//! from a built-in connector. The checks, in order, are in ARCHITECTURE.md §3.
//!
//! A library is opened `RTLD_NOW|RTLD_LOCAL` and, once its code has run, never closed: its
//! threads, thread-locals and the log bridge it installed may outlive every object it handed
//! us, and `dlclose` under them would crash the host. Every `Foreign*` object also holds an
//! `Arc` to its library, so the ownership is explicit even though unloading never happens.
//!
//! Every check failure is a [`LoadError`] that prints as one line naming the file, what is
//! wrong and what to do; the caller logs it and goes on with the next plugin.

#![allow(unsafe_code)] // Opens plugin libraries and calls the C ABI they export.

use kvconnect_api::abi::{
    self, log_level, status, AbiBuffer, AbiBytes, FactoryFns, HostApi, PluginDescriptor, ReceivedBuffer,
    SchedulerFns, Status, WorkerFns,
};
use kvconnect_api::negotiate::ChildCaps;
use kvconnect_api::{
    BlockId, BlocksPerGroup, Capabilities, ConnectorContext, ConnectorError, ConnectorFactory, ConnectorInfo,
    ConnectorResult, FinishedTransfers, KvEvent, KvRegion, KvTransferConfig, LayerId, MatchResult, ModelSpec,
    Request, RequestFinished, RequestId, SchedulerConnector, StepInfo, WorkerConnector,
};
use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
use std::ffi::c_void;
use std::mem::ManuallyDrop;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The environment variable listing plugin directories or files, colon-separated.
pub const PLUGIN_PATH_ENV: &str = "KVCONNECT_PLUGIN_PATH";

/// How to load plugins.
#[derive(Debug, Clone, Default)]
pub struct LoaderOptions {
    /// Load plugin files that group or others may write (`--allow-insecure-plugins`).
    pub allow_insecure: bool,
}

/// Why a plugin was not loaded. Each prints as one line: the file, what is wrong, what to do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LoadError {
    /// The file cannot be read.
    #[error(
        "plugin {path}: cannot read it ({reason}) — check the path in {PLUGIN_PATH_ENV} or --plugin-dir"
    )]
    Unreadable {
        /// The file.
        path: String,
        /// The OS error.
        reason: String,
    },
    /// Group or others may write the file.
    #[error("plugin {path}: refused: the file is {who}-writable (mode {mode:04o}), so others could replace the code this host runs — run `chmod go-w {path}`, or pass --allow-insecure-plugins")]
    Insecure {
        /// The file.
        path: String,
        /// `group` or `world`.
        who: &'static str,
        /// Its permission bits.
        mode: u32,
    },
    /// `dlopen` failed.
    #[error("plugin {path}: not a loadable shared library ({reason}) — a plugin is a cdylib built with kvconnect_api::export_connector!")]
    NotALibrary {
        /// The file.
        path: String,
        /// dlopen's message.
        reason: String,
    },
    /// No entry symbol.
    #[error("plugin {path}: has no `{}` symbol, so it is not a kvconnect plugin — export one with kvconnect_api::export_connector!(\"name\", Factory::new())", abi::ENTRY_SYMBOL)]
    NoEntry {
        /// The file.
        path: String,
    },
    /// The entry returned null.
    #[error(
        "plugin {path}: `{}` returned no descriptor — rebuild it with kvconnect_api::export_connector!",
        abi::ENTRY_SYMBOL
    )]
    NullDescriptor {
        /// The file.
        path: String,
    },
    /// Wrong magic.
    #[error("plugin {path}: its descriptor starts with {found:#018x}, not kvconnect's magic {expected:#018x} (\"KVCONNEC\"), so it is not a kvconnect plugin or predates ABI 1 — rebuild it against kvconnect-api {host_sdk}")]
    BadMagic {
        /// The file.
        path: String,
        /// What it has.
        found: u64,
        /// What it should have.
        expected: u64,
        /// The host's kvconnect-api version.
        host_sdk: String,
    },
    /// Another ABI major.
    #[error("plugin {path}: built for kvconnect ABI {plugin_major}.x ({}), this host speaks {host_major}.x — {}", built_with(.plugin_sdk), rebuild(.plugin_sdk, .host_sdk))]
    AbiMajor {
        /// The file.
        path: String,
        /// The plugin's major.
        plugin_major: u16,
        /// The plugin's SDK version, as far as it can be read.
        plugin_sdk: String,
        /// The host's major.
        host_major: u16,
        /// The host's kvconnect-api version.
        host_sdk: String,
    },
    /// A struct shorter than what the host calls.
    #[error("plugin {path}: its {what} is {found} bytes but this host calls entries up to byte {needed} (plugin built for ABI {plugin_major}.{plugin_minor} with {}, this host speaks {host_major}.{host_minor}) — {}", built_with(.plugin_sdk), rebuild(.plugin_sdk, .host_sdk))]
    TooShort {
        /// The file.
        path: String,
        /// Which struct.
        what: &'static str,
        /// Its declared size.
        found: usize,
        /// The size the host needs.
        needed: usize,
        /// The plugin's ABI major.
        plugin_major: u16,
        /// The plugin's ABI minor.
        plugin_minor: u16,
        /// The plugin's SDK version.
        plugin_sdk: String,
        /// The host's major.
        host_major: u16,
        /// The host's minor.
        host_minor: u16,
        /// The host's kvconnect-api version.
        host_sdk: String,
    },
    /// A layout fingerprint that is not ABI 1's.
    #[error("plugin {path}: ABI layout fingerprint {found:#018x} is not the {expected:#018x} that ABI {host_major}.x has on this host (plugin built for ABI {plugin_major}.{plugin_minor} with {} by {plugin_rustc}): it was built for another target or against a modified kvconnect-api or header — {} for this target", built_with(.plugin_sdk), rebuild(.plugin_sdk, .host_sdk))]
    Fingerprint {
        /// The file.
        path: String,
        /// What it has.
        found: u64,
        /// What this host expects.
        expected: u64,
        /// The host's major.
        host_major: u16,
        /// The plugin's major.
        plugin_major: u16,
        /// The plugin's minor.
        plugin_minor: u16,
        /// The plugin's SDK version.
        plugin_sdk: String,
        /// The plugin's compiler.
        plugin_rustc: String,
        /// The host's kvconnect-api version.
        host_sdk: String,
    },
    /// A required entry point is null.
    #[error("plugin {path}: its {what} has no `{entry}` entry, which ABI {major}.0 requires — {}", rebuild(.plugin_sdk, .host_sdk))]
    MissingEntry {
        /// The plugin's SDK version (`kvconnect.h M.N` for a C plugin).
        plugin_sdk: String,
        /// The file.
        path: String,
        /// Which struct.
        what: &'static str,
        /// Which entry.
        entry: &'static str,
        /// The ABI major.
        major: u16,
        /// The host's kvconnect-api version.
        host_sdk: String,
    },
    /// `init` or the factory constructor failed.
    #[error("plugin {path} ('{name}' {version}): {stage} failed: {error} — this is a bug in the plugin; report it to its author or remove the file")]
    StartFailed {
        /// The file.
        path: String,
        /// The plugin's name.
        name: String,
        /// Its version.
        version: String,
        /// `init` or `its factory`.
        stage: &'static str,
        /// The error.
        error: String,
    },
    /// Capabilities that contradict themselves.
    #[error("plugin {path} ('{name}' {version}): declares invalid capabilities: {reason} — fix its capabilities(); the host refuses it")]
    InvalidCapabilities {
        /// The file.
        path: String,
        /// The plugin's name.
        name: String,
        /// Its version.
        version: String,
        /// What contradicts.
        reason: String,
    },
    /// Two plugins claim one name.
    #[error("plugin {path}: connector name '{name}' is already taken by {other} — remove one of them from the plugin path")]
    DuplicateName {
        /// The file.
        path: String,
        /// The name.
        name: String,
        /// The other plugin's file.
        other: String,
    },
    /// Loading and querying the plugin in a process of its own (`kvconnect plugins`) failed:
    /// that process refused the plugin (its line is relayed as it is), or the plugin crashed
    /// or hung that process.
    #[error("{message}")]
    QueryProcess {
        /// The file.
        path: String,
        /// The whole line: the file, what happened, what to do.
        message: String,
    },
}

/// The prefix a C plugin's `sdk_version` starts with (`kvconnect.h 1.1`), as kvconnect.h asks.
const C_HEADER_SDK: &str = "kvconnect.h";

/// What a plugin was built with, as a message names it.
fn built_with(plugin_sdk: &str) -> String {
    if plugin_sdk.starts_with(C_HEADER_SDK) {
        plugin_sdk.to_owned()
    } else {
        format!("kvconnect-api {plugin_sdk}")
    }
}

/// What to rebuild a plugin against: the C header of this host's ABI for a C plugin, else
/// this host's kvconnect-api.
fn rebuild(plugin_sdk: &str, host_sdk: &str) -> String {
    if plugin_sdk.starts_with(C_HEADER_SDK) {
        format!(
            "rebuild it against {C_HEADER_SDK} {}.{} (connector-api/include/kvconnect.h of kvconnect-api {host_sdk})",
            abi::ABI_MAJOR,
            abi::ABI_MINOR
        )
    } else {
        format!("rebuild it against kvconnect-api {host_sdk}")
    }
}

impl LoadError {
    /// The file the error is about.
    pub fn path(&self) -> &str {
        match self {
            LoadError::Unreadable { path, .. }
            | LoadError::Insecure { path, .. }
            | LoadError::NotALibrary { path, .. }
            | LoadError::NoEntry { path }
            | LoadError::NullDescriptor { path }
            | LoadError::BadMagic { path, .. }
            | LoadError::AbiMajor { path, .. }
            | LoadError::TooShort { path, .. }
            | LoadError::Fingerprint { path, .. }
            | LoadError::MissingEntry { path, .. }
            | LoadError::StartFailed { path, .. }
            | LoadError::InvalidCapabilities { path, .. }
            | LoadError::DuplicateName { path, .. }
            | LoadError::QueryProcess { path, .. } => path,
        }
    }
}

/// A library whose descriptor passed every check.
pub struct PluginLibrary {
    // Never closed: see the module doc.
    _lib: ManuallyDrop<Library>,
    path: PathBuf,
    name: String,
    version: String,
    sdk_version: String,
    rustc_version: String,
    abi_major: u16,
    abi_minor: u16,
    factory_new: abi::FactoryNewFn,
    factory_vt: FactoryFns,
    scheduler_vt: SchedulerFns,
    worker_vt: WorkerFns,
}

impl std::fmt::Debug for PluginLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PluginLibrary").field("path", &self.path).field("name", &self.name).finish()
    }
}

impl PluginLibrary {
    /// The file it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }
    /// The connector name it registers.
    pub fn name(&self) -> &str {
        &self.name
    }
    /// Its version.
    pub fn version(&self) -> &str {
        &self.version
    }
    /// The kvconnect-api version it was built against.
    pub fn sdk_version(&self) -> &str {
        &self.sdk_version
    }
    /// The compiler that built it.
    pub fn rustc_version(&self) -> &str {
        &self.rustc_version
    }
    /// Its ABI version, `major.minor`.
    pub fn abi_version(&self) -> String {
        format!("{}.{}", self.abi_major, self.abi_minor)
    }
}

/// A loaded, checked plugin and its factory.
#[derive(Clone)]
pub struct LoadedPlugin {
    /// The library.
    pub library: Arc<PluginLibrary>,
    /// Its factory.
    pub factory: Arc<ForeignFactory>,
}

/// Lists the plugin files in `dirs_or_files`: a file is taken as given; a directory
/// contributes its `*.so` / `*.dylib` files (sorted, not recursive). Missing entries are
/// reported as errors.
pub fn discover(dirs_or_files: &[PathBuf]) -> (Vec<PathBuf>, Vec<LoadError>) {
    let mut files = Vec::new();
    let mut errors = Vec::new();
    for p in dirs_or_files {
        match std::fs::metadata(p) {
            Ok(m) if m.is_dir() => match std::fs::read_dir(p) {
                Ok(rd) => {
                    let mut found: Vec<PathBuf> = rd
                        .filter_map(|e| e.ok().map(|e| e.path()))
                        .filter(|f| is_library_name(f) && f.is_file())
                        .collect();
                    found.sort();
                    files.extend(found);
                }
                Err(e) => errors
                    .push(LoadError::Unreadable { path: p.display().to_string(), reason: e.to_string() }),
            },
            Ok(_) => files.push(p.clone()),
            Err(e) => {
                errors.push(LoadError::Unreadable { path: p.display().to_string(), reason: e.to_string() })
            }
        }
    }
    (files, errors)
}

fn is_library_name(p: &Path) -> bool {
    let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    name.ends_with(".so") || name.contains(".so.") || name.ends_with(".dylib")
}

/// Splits `KVCONNECT_PLUGIN_PATH`-style text into entries.
pub fn split_plugin_path(s: &str) -> Vec<PathBuf> {
    s.split(':').filter(|p| !p.is_empty()).map(PathBuf::from).collect()
}

/// Opens and checks one plugin file, initialises it and creates its factory.
pub fn load_plugin(path: &Path, opts: &LoaderOptions) -> Result<LoadedPlugin, LoadError> {
    let shown = path.display().to_string();
    let meta = std::fs::metadata(path)
        .map_err(|e| LoadError::Unreadable { path: shown.clone(), reason: e.to_string() })?;
    check_permissions(&shown, &meta, opts)?;
    // An absolute path, so dlopen never searches LD_LIBRARY_PATH for a bare file name.
    let full = std::fs::canonicalize(path)
        .map_err(|e| LoadError::Unreadable { path: shown.clone(), reason: e.to_string() })?;

    // SAFETY: opening a library runs its initialisers. That is the point of a plugin: the
    // file passed the permission check, and the user put it on the plugin path.
    let lib = unsafe { Library::open(Some(&full), RTLD_NOW | RTLD_LOCAL) }
        .map_err(|e| LoadError::NotALibrary { path: shown.clone(), reason: e.to_string() })?;
    let desc = {
        // SAFETY: `kvconnect_plugin_entry` has this signature in every ABI version (it is the
        // one thing that never changes); we only call it, once.
        let entry = unsafe {
            lib.get::<unsafe extern "C" fn() -> *const PluginDescriptor>(abi::ENTRY_SYMBOL.as_bytes())
        }
        .map_err(|_| LoadError::NoEntry { path: shown.clone() })?;
        // SAFETY: see above; the function takes no arguments.
        unsafe { entry() }
    };
    if desc.is_null() {
        return Err(LoadError::NullDescriptor { path: shown });
    }
    // SAFETY: every kvconnect descriptor starts with a u64 magic, and the entry returned a
    // non-null pointer to 'static data; we read nothing else until the magic matches.
    let magic = unsafe { std::ptr::read(desc as *const u64) };
    if magic != abi::ABI_MAGIC {
        return Err(LoadError::BadMagic {
            path: shown,
            found: magic,
            expected: abi::ABI_MAGIC,
            host_sdk: abi::SDK_VERSION.into(),
        });
    }
    // SAFETY: the magic says this is a kvconnect descriptor, whose header (magic, versions,
    // struct_size, fingerprint) has the same layout in every ABI version.
    let (major, minor, struct_size, fingerprint) = unsafe {
        let d = &*desc;
        (d.abi_major, d.abi_minor, d.struct_size, d.layout_fingerprint)
    };
    // The names are part of the fixed header too (every major keeps them at these offsets), so
    // they can name another major's SDK; read them only when the struct is long enough.
    let names_end = std::mem::offset_of!(PluginDescriptor, rustc_version) + std::mem::size_of::<AbiBytes>();
    let (name, version, plugin_sdk, plugin_rustc) = if struct_size >= names_end {
        // SAFETY: the struct is long enough to hold the fixed header, whose name fields point to
        // 'static strings in the plugin in every ABI version.
        unsafe {
            let d = &*desc;
            (
                d.name.to_string_lossy(),
                d.version.to_string_lossy(),
                d.sdk_version.to_string_lossy(),
                d.rustc_version.to_string_lossy(),
            )
        }
    } else {
        ("?".to_owned(), "?".to_owned(), "unknown".to_owned(), "an unknown rustc".to_owned())
    };
    if major != abi::ABI_MAJOR {
        return Err(LoadError::AbiMajor {
            path: shown,
            plugin_major: major,
            plugin_sdk,
            host_major: abi::ABI_MAJOR,
            host_sdk: abi::SDK_VERSION.into(),
        });
    }
    let too_short = |what: &'static str, found: usize, needed: usize| LoadError::TooShort {
        path: shown.clone(),
        what,
        found,
        needed,
        plugin_major: major,
        plugin_minor: minor,
        plugin_sdk: plugin_sdk.clone(),
        host_major: abi::ABI_MAJOR,
        host_minor: abi::ABI_MINOR,
        host_sdk: abi::SDK_VERSION.into(),
    };
    if struct_size < abi::MIN_DESCRIPTOR_SIZE {
        return Err(too_short("plugin descriptor", struct_size, abi::MIN_DESCRIPTOR_SIZE));
    }
    if fingerprint != abi::LAYOUT_FINGERPRINT {
        return Err(LoadError::Fingerprint {
            path: shown,
            found: fingerprint,
            expected: abi::LAYOUT_FINGERPRINT,
            host_major: abi::ABI_MAJOR,
            plugin_major: major,
            plugin_minor: minor,
            plugin_sdk,
            plugin_rustc,
            host_sdk: abi::SDK_VERSION.into(),
        });
    }
    // SAFETY: magic, major and fingerprint match, and the plugin declares `struct_size` bytes
    // (at least the 1.0 descriptor): its layout is this host's for the fields both know.
    let d: PluginDescriptor = unsafe { abi::read_declared(desc, struct_size) };
    let missing = |what: &'static str, entry: &'static str| LoadError::MissingEntry {
        plugin_sdk: plugin_sdk.clone(),
        path: shown.clone(),
        what,
        entry,
        major: abi::ABI_MAJOR,
        host_sdk: abi::SDK_VERSION.into(),
    };
    let init = d.init.ok_or_else(|| missing("plugin descriptor", "init"))?;
    let factory_new = d.factory_new.ok_or_else(|| missing("plugin descriptor", "factory_new"))?;
    if d.factory.is_null() {
        return Err(missing("plugin descriptor", "factory"));
    }
    if d.scheduler.is_null() {
        return Err(missing("plugin descriptor", "scheduler"));
    }
    if d.worker.is_null() {
        return Err(missing("plugin descriptor", "worker"));
    }
    // SAFETY: non-null pointers to the plugin's 'static vtables; their first field is the
    // struct size in every version.
    let (fsize, ssize, wsize) = unsafe {
        (
            std::ptr::read(d.factory as *const usize),
            std::ptr::read(d.scheduler as *const usize),
            std::ptr::read(d.worker as *const usize),
        )
    };
    if fsize < abi::MIN_FACTORY_VTABLE_SIZE {
        return Err(too_short("factory vtable", fsize, abi::MIN_FACTORY_VTABLE_SIZE));
    }
    if ssize < abi::MIN_SCHEDULER_VTABLE_SIZE {
        return Err(too_short("scheduler vtable", ssize, abi::MIN_SCHEDULER_VTABLE_SIZE));
    }
    if wsize < abi::MIN_WORKER_VTABLE_SIZE {
        return Err(too_short("worker vtable", wsize, abi::MIN_WORKER_VTABLE_SIZE));
    }
    // SAFETY: each vtable is 'static data in the plugin, `struct_size` bytes long as it
    // declares (at least the 1.0 size); entries past that are absent, and entries of a newer
    // minor than the host's are not read.
    let (fvt, svt, wvt) = unsafe {
        (
            abi::read_declared(d.factory, fsize),
            abi::read_declared(d.scheduler, ssize),
            abi::read_declared(d.worker, wsize),
        )
    };
    let factory_vt = FactoryFns::check(&fvt).map_err(|e| missing("factory vtable", e))?;
    let scheduler_vt = SchedulerFns::check(&svt).map_err(|e| missing("scheduler vtable", e))?;
    let worker_vt = WorkerFns::check(&wvt).map_err(|e| missing("worker vtable", e))?;

    let library = Arc::new(PluginLibrary {
        _lib: ManuallyDrop::new(lib),
        path: path.to_path_buf(),
        name: name.clone(),
        version: version.clone(),
        sdk_version: plugin_sdk,
        rustc_version: plugin_rustc,
        abi_major: major,
        abi_minor: minor,
        factory_new,
        factory_vt,
        scheduler_vt,
        worker_vt,
    });

    let host_api = host_api_for(&name);
    let start_failed = |stage: &'static str, e: ConnectorError| LoadError::StartFailed {
        path: shown.clone(),
        name: name.clone(),
        version: version.clone(),
        stage,
        error: e.to_string(),
    };
    // SAFETY: `init` comes from a checked descriptor; `host_api` is leaked ('static) as
    // `HostApi` documents; `err` is a valid out-parameter.
    call_status(|| &name, |err| unsafe { init(host_api, err) }).map_err(|e| start_failed("init", e))?;
    let factory = ForeignFactory::create(library.clone()).map_err(|e| start_failed("its factory", e))?;

    // Capabilities are checked once here, for the plain config; `inspect` and negotiation
    // check them again for theirs.
    match factory.capabilities(&KvTransferConfig::named(&name), None) {
        Ok(caps) => {
            if let Err(e) = caps.validate() {
                return Err(LoadError::InvalidCapabilities {
                    path: shown,
                    name,
                    version,
                    reason: e.to_string(),
                });
            }
        }
        Err(e @ (ConnectorError::Panicked { .. } | ConnectorError::Poisoned { .. })) => {
            return Err(start_failed("its capabilities query", e));
        }
        // Some connectors need their config to answer; that is not a reason to refuse them.
        Err(_) => {}
    }
    Ok(LoadedPlugin { library, factory: Arc::new(factory) })
}

fn check_permissions(shown: &str, meta: &std::fs::Metadata, opts: &LoaderOptions) -> Result<(), LoadError> {
    use std::os::unix::fs::PermissionsExt;
    let mode = meta.permissions().mode() & 0o7777;
    if opts.allow_insecure {
        return Ok(());
    }
    let who = if mode & 0o002 != 0 {
        "world"
    } else if mode & 0o020 != 0 {
        "group"
    } else {
        return Ok(());
    };
    Err(LoadError::Insecure { path: shown.to_owned(), who, mode })
}

// ---------------------------------------------------------------------------------------
// Logging from plugins.

fn host_api_for(plugin: &str) -> &'static HostApi {
    use tracing::level_filters::LevelFilter;
    let max = match LevelFilter::current() {
        LevelFilter::OFF => log_level::OFF,
        LevelFilter::ERROR => log_level::ERROR,
        LevelFilter::WARN => log_level::WARN,
        LevelFilter::INFO => log_level::INFO,
        LevelFilter::DEBUG => log_level::DEBUG,
        _ => log_level::TRACE,
    };
    // Leaked on purpose: the plugin keeps the pointer for the life of the process, and
    // plugins are never unloaded (one small allocation per plugin).
    let name: &'static String = Box::leak(Box::new(plugin.to_owned()));
    Box::leak(Box::new(HostApi {
        struct_size: std::mem::size_of::<HostApi>(),
        abi_major: abi::ABI_MAJOR,
        abi_minor: abi::ABI_MINOR,
        max_log_level: max,
        user_data: name as *const String as *const c_void,
        log: Some(host_log),
    }))
}

unsafe extern "C" fn host_log(user_data: *const c_void, level: u32, target: AbiBytes, message: AbiBytes) {
    // A panic must not unwind into the plugin's frames.
    let _ = std::panic::catch_unwind(|| {
        // SAFETY: `user_data` is the leaked name `host_api_for` made; the byte views are
        // valid for this call (the plugin's contract).
        let (plugin, target, message) =
            unsafe { (&*(user_data as *const String), target.to_string_lossy(), message.to_string_lossy()) };
        match level {
            log_level::ERROR => {
                tracing::error!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
            log_level::WARN => {
                tracing::warn!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
            log_level::INFO => {
                tracing::info!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
            log_level::DEBUG => {
                tracing::debug!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
            _ => {
                tracing::trace!(target: "kvconnect::plugin", plugin = %plugin, module = %target, "{message}")
            }
        }
    });
}

// ---------------------------------------------------------------------------------------
// Checked vtables (`abi::{FactoryFns, SchedulerFns, WorkerFns}`): every 1.0 entry present,
// copied out once; a later minor's entries are optional, and each caller applies the fallback
// `abi::vtables` declares for it.

type ErrOut = *mut AbiBuffer;
type Handle = *mut c_void;

// ---------------------------------------------------------------------------------------
// Calling across: status codes, error buffers, JSON results.

/// Runs one call that reports through a status and an error buffer. The connector's name is
/// only looked up on the error path: the success path is the per-step hot path.
#[inline]
fn call_status<'a>(
    connector: impl FnOnce() -> &'a str,
    f: impl FnOnce(ErrOut) -> Status,
) -> ConnectorResult<()> {
    let mut err = AbiBuffer::empty();
    let st = f(&mut err);
    if st == status::OK && err.free.is_none() {
        return Ok(());
    }
    // SAFETY: `err` is empty or was filled by the plugin, which hands ownership to us.
    let err = unsafe { ReceivedBuffer::new(err) };
    if st == status::OK {
        return Ok(());
    }
    Err(decode_error(connector(), st, err.as_bytes()))
}

/// Runs one call that also fills an output buffer.
fn call_out<'a>(
    connector: impl FnOnce() -> &'a str,
    f: impl FnOnce(*mut AbiBuffer, ErrOut) -> Status,
) -> ConnectorResult<ReceivedBuffer> {
    let mut out = AbiBuffer::empty();
    let r = call_status(connector, |err| f(&mut out, err));
    // SAFETY: `out` is empty or was filled by the plugin; either way it is ours to free.
    let out = unsafe { ReceivedBuffer::new(out) };
    r.map(|()| out)
}

fn call_json<'a, T: serde::de::DeserializeOwned>(
    connector: impl Fn() -> &'a str,
    method: &str,
    f: impl FnOnce(*mut AbiBuffer, ErrOut) -> Status,
) -> ConnectorResult<T> {
    let out = call_out(&connector, f)?;
    serde_json::from_slice(out.as_bytes()).map_err(|e| ConnectorError::Other {
        connector: connector().to_owned(),
        message: format!(
            "plugin returned a {method} result the host cannot decode ({e}); is it built against another kvconnect-api?"
        ),
    })
}

fn decode_error(connector: &str, st: Status, bytes: &[u8]) -> ConnectorError {
    if let Ok(e) = serde_json::from_slice::<ConnectorError>(bytes) {
        return e;
    }
    let text = String::from_utf8_lossy(bytes);
    let message =
        if text.is_empty() { format!("failed with status {st} and no message") } else { text.into_owned() };
    match st {
        status::POISONED => ConnectorError::Poisoned { connector: connector.to_owned(), message },
        status::PANICKED => ConnectorError::Panicked {
            connector: connector.to_owned(),
            method: "a plugin call".into(),
            message,
        },
        _ => ConnectorError::Other { connector: connector.to_owned(), message },
    }
}

fn to_json<T: serde::Serialize>(connector: &str, v: &T) -> ConnectorResult<Vec<u8>> {
    serde_json::to_vec(v).map_err(|e| ConnectorError::Other {
        connector: connector.to_owned(),
        message: format!("cannot encode an argument for the plugin: {e}"),
    })
}

fn bytes(b: &[u8]) -> AbiBytes {
    AbiBytes::from_slice(b)
}

// ---------------------------------------------------------------------------------------
// Foreign objects.

struct FactoryHandle {
    lib: Arc<PluginLibrary>,
    handle: Handle,
}

// SAFETY: the handle is an SDK `ExportedFactory` (or a C plugin's equivalent), which the ABI
// requires to be usable from any thread concurrently (`ConnectorFactory: Send + Sync`).
unsafe impl Send for FactoryHandle {}
// SAFETY: as above.
unsafe impl Sync for FactoryHandle {}

impl Drop for FactoryHandle {
    fn drop(&mut self) {
        // SAFETY: the handle came from `factory_new` and is freed once, after every instance
        // (which hold an Arc to this) is gone.
        unsafe { (self.lib.factory_vt.free)(self.handle) };
    }
}

/// A plugin's factory, seen through the safe trait.
pub struct ForeignFactory {
    inner: Arc<FactoryHandle>,
    info: ConnectorInfo,
}

impl ForeignFactory {
    fn create(lib: Arc<PluginLibrary>) -> ConnectorResult<ForeignFactory> {
        let mut handle: Handle = std::ptr::null_mut();
        let factory_new = lib.factory_new;
        // SAFETY: a checked entry; both out-parameters are valid.
        call_status(|| &lib.name, |err| unsafe { factory_new(&mut handle, err) })?;
        if handle.is_null() {
            return Err(ConnectorError::Other {
                connector: lib.name.clone(),
                message: "factory_new returned no factory".into(),
            });
        }
        let inner = Arc::new(FactoryHandle { lib, handle });
        let info_fn = inner.lib.factory_vt.info;
        // SAFETY: a live factory handle; valid out-parameters.
        let info =
            call_json(|| &inner.lib.name, "info", |out, err| unsafe { info_fn(inner.handle, out, err) })?;
        Ok(ForeignFactory { inner, info })
    }

    /// The library it comes from.
    pub fn library(&self) -> &Arc<PluginLibrary> {
        &self.inner.lib
    }

    fn name(&self) -> &str {
        &self.inner.lib.name
    }

    /// Runs a capability-style query: config and model in, JSON out.
    fn query<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        f: abi::FactoryQueryFn,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<T> {
        let c = to_json(self.name(), config)?;
        let m = match model {
            Some(m) => to_json(self.name(), m)?,
            None => Vec::new(),
        };
        // SAFETY: a live factory handle; argument bytes live across the call.
        call_json(
            || self.name(),
            method,
            |out, err| unsafe { f(self.inner.handle, bytes(&c), bytes(&m), out, err) },
        )
    }
}

impl ConnectorFactory for ForeignFactory {
    fn info(&self) -> ConnectorInfo {
        self.info.clone()
    }

    fn capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Capabilities> {
        self.query("capabilities", self.inner.lib.factory_vt.capabilities, config, model)
    }

    fn child_capabilities(
        &self,
        config: &KvTransferConfig,
        model: Option<&ModelSpec>,
    ) -> ConnectorResult<Option<Vec<ChildCaps>>> {
        match self.inner.lib.factory_vt.child_capabilities {
            Some(f) => self.query("child_capabilities", f, config, model),
            // A 1.0 plugin: the entry did not exist, so it is not a composite.
            None => Ok(None),
        }
    }

    fn create_scheduler(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn SchedulerConnector>> {
        let c = to_json(self.name(), ctx)?;
        let f = self.inner.lib.factory_vt.create_scheduler;
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: a live factory handle; valid out-parameters; bytes live across the call.
        call_status(|| self.name(), |err| unsafe { f(self.inner.handle, bytes(&c), &mut h, err) })?;
        if h.is_null() {
            return Err(ConnectorError::Other {
                connector: self.name().into(),
                message: "create_scheduler returned no instance".into(),
            });
        }
        Ok(Box::new(ForeignScheduler {
            factory: self.inner.clone(),
            vt: self.inner.lib.scheduler_vt,
            handle: h,
        }))
    }

    fn create_worker(&self, ctx: &ConnectorContext) -> ConnectorResult<Box<dyn WorkerConnector>> {
        let c = to_json(self.name(), ctx)?;
        let f = self.inner.lib.factory_vt.create_worker;
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: a live factory handle; valid out-parameters; bytes live across the call.
        call_status(|| self.name(), |err| unsafe { f(self.inner.handle, bytes(&c), &mut h, err) })?;
        if h.is_null() {
            return Err(ConnectorError::Other {
                connector: self.name().into(),
                message: "create_worker returned no instance".into(),
            });
        }
        Ok(Box::new(ForeignWorker { factory: self.inner.clone(), vt: self.inner.lib.worker_vt, handle: h }))
    }
}

/// A plugin's scheduler half.
pub struct ForeignScheduler {
    factory: Arc<FactoryHandle>,
    vt: SchedulerFns,
    handle: Handle,
}

// SAFETY: the instance is an SDK `ExportedScheduler` around a `Box<dyn SchedulerConnector>`
// (`Send`); we call it from one thread at a time (`&mut self`).
unsafe impl Send for ForeignScheduler {}

impl Drop for ForeignScheduler {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create_scheduler` and is freed once.
        unsafe { (self.vt.free)(self.handle) };
    }
}

impl ForeignScheduler {
    fn name(&self) -> &str {
        &self.factory.lib.name
    }
}

impl SchedulerConnector for ForeignScheduler {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &Request,
        num_computed: usize,
    ) -> ConnectorResult<MatchResult> {
        let r = to_json(self.name(), req)?;
        let (f, h) = (self.vt.get_num_new_matched_tokens, self.handle);
        // SAFETY: a live instance used from this thread only; bytes live across the call.
        call_json(
            || self.name(),
            "get_num_new_matched_tokens",
            |out, err| unsafe { f(h, bytes(&r), num_computed as u64, out, err) },
        )
    }

    fn update_state_after_alloc(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
        num_external_tokens: usize,
    ) -> ConnectorResult<()> {
        let r = to_json(self.name(), req)?;
        let b = to_json(self.name(), blocks)?;
        let (f, h) = (self.vt.update_state_after_alloc, self.handle);
        // SAFETY: as above.
        call_status(
            || self.name(),
            |err| unsafe { f(h, bytes(&r), bytes(&b), num_external_tokens as u64, err) },
        )
    }

    fn build_connector_meta(&mut self, step: &StepInfo) -> ConnectorResult<Vec<u8>> {
        let s = to_json(self.name(), step)?;
        let (f, h) = (self.vt.build_connector_meta, self.handle);
        // SAFETY: as above.
        let out = call_out(|| self.name(), |out, err| unsafe { f(h, bytes(&s), out, err) })?;
        Ok(out.as_bytes().to_vec())
    }

    fn request_finished(
        &mut self,
        req: &Request,
        blocks: &BlocksPerGroup,
    ) -> ConnectorResult<RequestFinished> {
        let r = to_json(self.name(), req)?;
        let b = to_json(self.name(), blocks)?;
        let (f, h) = (self.vt.request_finished, self.handle);
        // SAFETY: as above.
        call_json(
            || self.name(),
            "request_finished",
            |out, err| unsafe { f(h, bytes(&r), bytes(&b), out, err) },
        )
    }

    fn take_events(&mut self) -> ConnectorResult<Vec<KvEvent>> {
        let (f, h) = (self.vt.take_events, self.handle);
        // SAFETY: as above.
        call_json(|| self.name(), "take_events", |out, err| unsafe { f(h, out, err) })
    }
}

/// A plugin's worker half.
pub struct ForeignWorker {
    factory: Arc<FactoryHandle>,
    vt: WorkerFns,
    handle: Handle,
}

// SAFETY: the instance is an SDK `ExportedWorker` around a `Box<dyn WorkerConnector>`
// (`Send`); we call it from one thread at a time (`&mut self`).
unsafe impl Send for ForeignWorker {}

impl Drop for ForeignWorker {
    fn drop(&mut self) {
        // SAFETY: the handle came from `create_worker` and is freed once.
        unsafe { (self.vt.free)(self.handle) };
    }
}

impl ForeignWorker {
    fn name(&self) -> &str {
        &self.factory.lib.name
    }
}

impl WorkerConnector for ForeignWorker {
    fn register_kv_caches(&mut self, regions: &[KvRegion]) -> ConnectorResult<()> {
        // The regions' memory outlives this instance (`KvRegion::new`'s contract): the promise
        // the plugin side's SDK relies on when it turns these specs back into regions.
        let r = to_json(self.name(), &regions)?;
        let (f, h) = (self.vt.register_kv_caches, self.handle);
        // SAFETY: a live instance used from this thread only; bytes live across the call.
        call_status(|| self.name(), |err| unsafe { f(h, bytes(&r), err) })
    }

    fn bind_connector_meta(&mut self, meta: &[u8]) -> ConnectorResult<()> {
        let (f, h) = (self.vt.bind_connector_meta, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, bytes(meta), err) })
    }

    fn start_load_kv(&mut self) -> ConnectorResult<()> {
        let (f, h) = (self.vt.start_load_kv, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, err) })
    }

    fn wait_for_layer_load(&mut self, layer: LayerId) -> ConnectorResult<()> {
        let (f, h) = (self.vt.wait_for_layer_load, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, layer.0, err) })
    }

    fn save_kv_layer(&mut self, layer: LayerId, block_ids: &[BlockId]) -> ConnectorResult<()> {
        let (f, h) = (self.vt.save_kv_layer, self.handle);
        // SAFETY: as above; `BlockId` is `repr(transparent)` over u32, so the slice is a valid
        // array of `len` u32 for the call.
        call_status(
            || self.name(),
            |err| unsafe { f(h, layer.0, block_ids.as_ptr() as *const u32, block_ids.len(), err) },
        )
    }

    fn wait_for_save(&mut self) -> ConnectorResult<()> {
        let (f, h) = (self.vt.wait_for_save, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, err) })
    }

    fn get_finished(&mut self, finished_reqs: &[RequestId]) -> ConnectorResult<FinishedTransfers> {
        let ids: Vec<AbiBytes> = finished_reqs.iter().map(|r| bytes(r.0.as_bytes())).collect();
        let (f, h) = (self.vt.get_finished, self.handle);
        // SAFETY: as above; `ids` and the strings it borrows live across the call.
        call_json(
            || self.name(),
            "get_finished",
            |out, err| unsafe { f(h, ids.as_ptr(), ids.len(), out, err) },
        )
    }

    fn block_ids_with_load_errors(&mut self) -> ConnectorResult<Vec<BlockId>> {
        let (f, h) = (self.vt.block_ids_with_load_errors, self.handle);
        // SAFETY: as above.
        call_json(|| self.name(), "block_ids_with_load_errors", |out, err| unsafe { f(h, out, err) })
    }

    fn handshake_metadata(&mut self) -> ConnectorResult<Option<serde_json::Value>> {
        let (f, h) = (self.vt.handshake_metadata, self.handle);
        // SAFETY: as above.
        call_json(|| self.name(), "handshake_metadata", |out, err| unsafe { f(h, out, err) })
    }

    fn set_peer_handshake_metadata(&mut self, peer: &serde_json::Value) -> ConnectorResult<()> {
        let p = to_json(self.name(), peer)?;
        let (f, h) = (self.vt.set_peer_handshake_metadata, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, bytes(&p), err) })
    }

    fn shutdown(&mut self) -> ConnectorResult<()> {
        let (f, h) = (self.vt.shutdown, self.handle);
        // SAFETY: as above.
        call_status(|| self.name(), |err| unsafe { f(h, err) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn world_and_group_writable_files_are_refused_unless_allowed() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("libx.so");
        std::fs::write(&p, b"x").unwrap();
        for (mode, who) in [(0o666, "world"), (0o664, "group")] {
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
            let e = load_plugin(&p, &LoaderOptions::default()).err().unwrap();
            assert!(matches!(e, LoadError::Insecure { who: w, .. } if w == who), "{e}");
            // Allowed: it gets past the permission check and fails as what it is.
            let e = load_plugin(&p, &LoaderOptions { allow_insecure: true }).err().unwrap();
            assert!(matches!(e, LoadError::NotALibrary { .. }), "{e}");
        }
    }

    #[test]
    fn discover_takes_libraries_from_directories_and_files_as_given() {
        let dir = tempfile::tempdir().unwrap();
        for f in ["liba.so", "libb.so.1", "notes.txt", "libc.dylib"] {
            std::fs::write(dir.path().join(f), b"").unwrap();
        }
        let extra = dir.path().join("notes.txt");
        let missing = dir.path().join("nope");
        let (files, errors) = discover(&[dir.path().to_path_buf(), extra.clone(), missing]);
        let names: Vec<_> =
            files.iter().map(|f| f.file_name().unwrap().to_string_lossy().into_owned()).collect();
        assert_eq!(names, ["liba.so", "libb.so.1", "libc.dylib", "notes.txt"]);
        assert_eq!(errors.len(), 1);
        assert!(errors[0].to_string().contains("cannot read it"), "{}", errors[0]);
    }

    #[test]
    fn refusals_of_a_c_plugin_name_the_header_version() {
        let e = |plugin_sdk: &str| LoadError::AbiMajor {
            path: "libc.so".into(),
            plugin_major: 2,
            plugin_sdk: plugin_sdk.into(),
            host_major: 1,
            host_sdk: "0.1.0".into(),
        };
        let c = e("kvconnect.h 2.0").to_string();
        assert!(c.contains("ABI 2.x (kvconnect.h 2.0)"), "{c}");
        assert!(
            c.contains(&format!("rebuild it against kvconnect.h {}.{}", abi::ABI_MAJOR, abi::ABI_MINOR)),
            "{c}"
        );
        let rust = e("0.2.0").to_string();
        assert!(
            rust.contains("(kvconnect-api 0.2.0)") && rust.contains("rebuild it against kvconnect-api 0.1.0")
        );
    }

    #[test]
    fn plugin_path_splits_on_colons() {
        assert_eq!(split_plugin_path("/a::/b/c.so:"), vec![PathBuf::from("/a"), PathBuf::from("/b/c.so")]);
    }
}
