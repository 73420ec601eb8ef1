//! Finds, opens and checks plugin libraries, and hands their checked entries to the `Foreign*`
//! types of `kvconnect_api::ffi`, which implement the safe connector traits, so the rest of
//! the host cannot tell a plugin from a built-in connector. The checks, in order, are in
//! ARCHITECTURE.md §3.
//!
//! A library is opened `RTLD_NOW|RTLD_LOCAL` and, once its code has run, never closed: its
//! threads, thread-locals and the log bridge it installed may outlive every object it handed
//! us, and `dlclose` under them would crash the host. Every `Foreign*` object also holds an
//! `Arc` to its library, so the ownership is explicit even though unloading never happens.
//!
//! Every check failure is a [`LoadError`] that prints as one line naming the file, what is
//! wrong and what to do; the caller logs it and goes on with the next plugin.

#![allow(unsafe_code)] // Opens plugin libraries and calls the C ABI they export.

use kvconnect_api::ffi::{
    self as abi, call_status, host_api_for, AbiBytes, FactoryFns, PluginCode, PluginDescriptor,
    PluginEntries, SchedulerFns, WorkerFns,
};
pub use kvconnect_api::ffi::{ForeignFactory, ForeignScheduler, ForeignWorker};
use kvconnect_api::{ConnectorError, ConnectorFactory, KvTransferConfig};
use libloading::os::unix::{Library, RTLD_LOCAL, RTLD_NOW};
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
    #[error(
        "plugin {path}: refused: the file is {who}-writable (mode {mode:04o}), so others could replace \
        the code this host runs — run `chmod go-w {path}`, or pass --allow-insecure-plugins"
    )]
    Insecure {
        /// The file.
        path: String,
        /// `group` or `world`.
        who: &'static str,
        /// Its permission bits.
        mode: u32,
    },
    /// `dlopen` failed.
    #[error(
        "plugin {path}: not a loadable shared library ({reason}) — a plugin is a cdylib built with \
        kvconnect_api::export_connector!"
    )]
    NotALibrary {
        /// The file.
        path: String,
        /// dlopen's message.
        reason: String,
    },
    /// No entry symbol.
    #[error(
        "plugin {path}: has no `{}` symbol, so it is not a kvconnect plugin — export one with \
        kvconnect_api::export_connector!(\"name\", Factory::new())",
        abi::ENTRY_SYMBOL
    )]
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
    #[error(
        "plugin {path}: its descriptor starts with {found:#018x}, not kvconnect's magic {expected:#018x} \
        (\"KVCONNEC\"), so it is not a kvconnect plugin or predates ABI 1 — rebuild it against \
        kvconnect-api {host_sdk}"
    )]
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
    #[error("plugin {path}: built for kvconnect ABI {plugin_major}.x ({}), this host speaks \
        {host_major}.x — {}", built_with(.plugin_sdk), rebuild(.plugin_sdk, .host_sdk))]
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
    #[error("plugin {path}: its {what} is {found} bytes but this host calls entries up to byte {needed} \
        (plugin built for ABI {plugin_major}.{plugin_minor} with {}, this host speaks \
        {host_major}.{host_minor}) — {}", built_with(.plugin_sdk), rebuild(.plugin_sdk, .host_sdk))]
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
    /// A vtable shorter than the minor the plugin declares defines it: built from mismatched
    /// definitions.
    #[error("plugin {path}: declares ABI {plugin_major}.{plugin_minor} but its {what} is {found} bytes, \
        short of the {needed} bytes that {plugin_major}.{plugin_minor} defines, so it was built from \
        mismatched definitions ({}) — {}", built_with(.plugin_sdk), rebuild(.plugin_sdk, .host_sdk))]
    ShortForItsMinor {
        /// The file.
        path: String,
        /// Which struct.
        what: &'static str,
        /// Its declared size.
        found: usize,
        /// What its declared minor defines.
        needed: usize,
        /// The plugin's ABI major.
        plugin_major: u16,
        /// The plugin's ABI minor.
        plugin_minor: u16,
        /// The plugin's SDK version.
        plugin_sdk: String,
        /// The host's kvconnect-api version.
        host_sdk: String,
    },
    /// A layout fingerprint that is not ABI 1's.
    #[error("plugin {path}: ABI layout fingerprint {found:#018x} is not the {expected:#018x} that ABI \
        {host_major}.x has on this host (plugin built for ABI {plugin_major}.{plugin_minor} with {} by \
        {plugin_rustc}): it was built for another target or against a modified kvconnect-api or \
        header — {} for this target", built_with(.plugin_sdk), rebuild(.plugin_sdk, .host_sdk))]
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
    #[error(
        "plugin {path}: its {what} has no `{entry}` entry, which ABI {major}.0 requires — {}",
        rebuild(.plugin_sdk, .host_sdk)
    )]
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
    #[error(
        "plugin {path} ('{name}' {version}): {stage} failed: {error} — this is a bug in the plugin; \
        report it to its author or remove the file"
    )]
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
    #[error(
        "plugin {path} ('{name}' {version}): declares invalid capabilities: {reason} — fix its \
        capabilities(); the host refuses it"
    )]
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
    #[error(
        "plugin {path}: connector name '{name}' is already taken by {other} — remove one of them from \
        the plugin path"
    )]
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

/// The prefix a C plugin's `sdk_version` starts with (`kvconnect.h 1.2`), as kvconnect.h asks.
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
            "rebuild it against {C_HEADER_SDK} {}.{} (connector-api/include/kvconnect.h of kvconnect-api \
                {host_sdk})",
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
            | LoadError::ShortForItsMinor { path, .. }
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
    entries: PluginEntries,
}

impl PluginCode for PluginLibrary {
    fn entries(&self) -> &PluginEntries {
        &self.entries
    }
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

/// Opens and checks one plugin file, initialises it and creates its factory: the permission
/// check and `dlopen` (`open_library`), the entry symbol, the descriptor's fixed header and
/// its major, size and fingerprint (`read_header`, `Header::check`), the vtables and their
/// required entries (`checked_entries`), then `init`, the factory and one capabilities query
/// (`start`). The first failure is the error.
pub fn load_plugin(path: &Path, opts: &LoaderOptions) -> Result<LoadedPlugin, LoadError> {
    let shown = path.display().to_string();
    let lib = open_library(path, &shown, opts)?;
    let desc = descriptor(&lib, &shown)?;
    let header = read_header(desc, &shown)?;
    header.check(&shown)?;
    let (init, entries) = checked_entries(desc, &header, &shown)?;
    let library = Arc::new(PluginLibrary {
        _lib: ManuallyDrop::new(lib),
        path: path.to_path_buf(),
        name: header.name.clone(),
        version: header.version.clone(),
        sdk_version: header.plugin_sdk.clone(),
        rustc_version: header.plugin_rustc.clone(),
        abi_major: header.major,
        abi_minor: header.minor,
        entries,
    });
    start(library, init, &shown)
}

/// Checks the file's permissions and opens it.
fn open_library(path: &Path, shown: &str, opts: &LoaderOptions) -> Result<Library, LoadError> {
    let unreadable =
        |e: std::io::Error| LoadError::Unreadable { path: shown.to_owned(), reason: e.to_string() };
    let meta = std::fs::metadata(path).map_err(unreadable)?;
    check_permissions(shown, &meta, opts)?;
    // An absolute path, so dlopen never searches LD_LIBRARY_PATH for a bare file name.
    let full = std::fs::canonicalize(path).map_err(unreadable)?;
    // SAFETY: opening a library runs its initialisers. That is the point of a plugin: the
    // file passed the permission check, and the user put it on the plugin path.
    unsafe { Library::open(Some(&full), RTLD_NOW | RTLD_LOCAL) }
        .map_err(|e| LoadError::NotALibrary { path: shown.to_owned(), reason: e.to_string() })
}

/// Calls the entry symbol; the descriptor it returns, not null.
fn descriptor(lib: &Library, shown: &str) -> Result<*const PluginDescriptor, LoadError> {
    // SAFETY: `kvconnect_plugin_entry` has this signature in every ABI version (it is the
    // one thing that never changes); we only call it, once.
    let entry =
        unsafe { lib.get::<unsafe extern "C" fn() -> *const PluginDescriptor>(abi::ENTRY_SYMBOL.as_bytes()) }
            .map_err(|_| LoadError::NoEntry { path: shown.to_owned() })?;
    // SAFETY: see above; the function takes no arguments.
    let desc = unsafe { entry() };
    if desc.is_null() {
        return Err(LoadError::NullDescriptor { path: shown.to_owned() });
    }
    Ok(desc)
}

/// The descriptor's fixed header: what any version of the ABI lets a host read.
struct Header {
    major: u16,
    minor: u16,
    struct_size: usize,
    fingerprint: u64,
    name: String,
    version: String,
    plugin_sdk: String,
    plugin_rustc: String,
}

/// Reads the fixed header once the magic says it is a kvconnect descriptor.
fn read_header(desc: *const PluginDescriptor, shown: &str) -> Result<Header, LoadError> {
    // SAFETY: every kvconnect descriptor starts with a u64 magic, and the entry returned a
    // non-null pointer to 'static data; we read nothing else until the magic matches.
    let magic = unsafe { std::ptr::read(desc as *const u64) };
    if magic != abi::ABI_MAGIC {
        return Err(LoadError::BadMagic {
            path: shown.to_owned(),
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
    Ok(Header { major, minor, struct_size, fingerprint, name, version, plugin_sdk, plugin_rustc })
}

impl Header {
    /// The major, the descriptor's size and the layout fingerprint against this host's.
    fn check(&self, shown: &str) -> Result<(), LoadError> {
        if self.major != abi::ABI_MAJOR {
            return Err(LoadError::AbiMajor {
                path: shown.to_owned(),
                plugin_major: self.major,
                plugin_sdk: self.plugin_sdk.clone(),
                host_major: abi::ABI_MAJOR,
                host_sdk: abi::SDK_VERSION.into(),
            });
        }
        if self.struct_size < abi::MIN_DESCRIPTOR_SIZE {
            return Err(self.too_short(
                shown,
                "plugin descriptor",
                self.struct_size,
                abi::MIN_DESCRIPTOR_SIZE,
            ));
        }
        if self.fingerprint != abi::LAYOUT_FINGERPRINT {
            return Err(LoadError::Fingerprint {
                path: shown.to_owned(),
                found: self.fingerprint,
                expected: abi::LAYOUT_FINGERPRINT,
                host_major: abi::ABI_MAJOR,
                plugin_major: self.major,
                plugin_minor: self.minor,
                plugin_sdk: self.plugin_sdk.clone(),
                plugin_rustc: self.plugin_rustc.clone(),
                host_sdk: abi::SDK_VERSION.into(),
            });
        }
        Ok(())
    }

    fn too_short(&self, shown: &str, what: &'static str, found: usize, needed: usize) -> LoadError {
        LoadError::TooShort {
            path: shown.to_owned(),
            what,
            found,
            needed,
            plugin_major: self.major,
            plugin_minor: self.minor,
            plugin_sdk: self.plugin_sdk.clone(),
            host_major: abi::ABI_MAJOR,
            host_minor: abi::ABI_MINOR,
            host_sdk: abi::SDK_VERSION.into(),
        }
    }

    fn missing(&self, shown: &str, what: &'static str, entry: &'static str) -> LoadError {
        LoadError::MissingEntry {
            plugin_sdk: self.plugin_sdk.clone(),
            path: shown.to_owned(),
            what,
            entry,
            major: abi::ABI_MAJOR,
            host_sdk: abi::SDK_VERSION.into(),
        }
    }
}

/// Reads the descriptor and its three vtables as long as the plugin declares them, and checks
/// that every entry this major requires is there; `init` and the entries.
fn checked_entries(
    desc: *const PluginDescriptor,
    header: &Header,
    shown: &str,
) -> Result<(abi::InitFn, PluginEntries), LoadError> {
    let missing = |what, entry| header.missing(shown, what, entry);
    // SAFETY: magic, major and fingerprint match, and the plugin declares `struct_size` bytes
    // (at least the 1.0 descriptor): its layout is this host's for the fields both know.
    let d: PluginDescriptor = unsafe { abi::read_declared(desc, header.struct_size) };
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
    for (what, found, needed) in [
        ("factory vtable", fsize, abi::MIN_FACTORY_VTABLE_SIZE),
        ("scheduler vtable", ssize, abi::MIN_SCHEDULER_VTABLE_SIZE),
        ("worker vtable", wsize, abi::MIN_WORKER_VTABLE_SIZE),
    ] {
        if found < needed {
            return Err(header.too_short(shown, what, found, needed));
        }
    }
    // A plugin exports every entry of the minor it declares (those this host knows).
    for (what, found, needed) in [
        ("factory vtable", fsize, abi::FactoryVTable::min_size_for_minor(header.minor)),
        ("scheduler vtable", ssize, abi::SchedulerVTable::min_size_for_minor(header.minor)),
        ("worker vtable", wsize, abi::WorkerVTable::min_size_for_minor(header.minor)),
    ] {
        if found < needed {
            return Err(LoadError::ShortForItsMinor {
                path: shown.to_owned(),
                what,
                found,
                needed,
                plugin_major: header.major,
                plugin_minor: header.minor,
                plugin_sdk: header.plugin_sdk.clone(),
                host_sdk: abi::SDK_VERSION.into(),
            });
        }
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
    let entries = PluginEntries {
        name: header.name.clone(),
        factory_new,
        factory_vt: FactoryFns::check(&fvt).map_err(|e| missing("factory vtable", e))?,
        scheduler_vt: SchedulerFns::check(&svt).map_err(|e| missing("scheduler vtable", e))?,
        worker_vt: WorkerFns::check(&wvt).map_err(|e| missing("worker vtable", e))?,
    };
    Ok((init, entries))
}

/// Runs the plugin's `init`, makes its factory and checks its capabilities once.
fn start(library: Arc<PluginLibrary>, init: abi::InitFn, shown: &str) -> Result<LoadedPlugin, LoadError> {
    let (name, version) = (library.name.clone(), library.version.clone());
    let host_api = host_api_for(&name);
    let start_failed = |stage: &'static str, e: ConnectorError| LoadError::StartFailed {
        path: shown.to_owned(),
        name: name.clone(),
        version: version.clone(),
        stage,
        error: e.to_string(),
    };
    // SAFETY: `init` comes from a checked descriptor; `host_api` is leaked ('static) as
    // `HostApi` documents; `err` is a valid out-parameter.
    call_status(|| &name, |err| unsafe { init(host_api, err) }).map_err(|e| start_failed("init", e))?;
    // SAFETY: the entries passed every check of `checked_entries`, and `library` keeps the code
    // mapped (it is never closed) for as long as the factory and its instances hold it.
    let factory =
        unsafe { ForeignFactory::create(library.clone()) }.map_err(|e| start_failed("its factory", e))?;

    // Capabilities are checked once here, for the plain config; `inspect` and negotiation
    // check them again for theirs.
    match factory.capabilities(&KvTransferConfig::named(&name), None) {
        Ok(caps) => {
            if let Err(e) = caps.validate() {
                return Err(LoadError::InvalidCapabilities {
                    path: shown.to_owned(),
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
