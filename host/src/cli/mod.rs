//! The `kvconnect` command: argument parsing and dispatch to one module per subcommand.
//! Subcommands return `anyhow::Result`; `main` prints the error chain as one message.

pub mod bench;
mod bench_cuda;
mod bench_handshake;
mod bench_lmcache_device;
mod bench_nixl_vram;
mod bench_tp;
pub mod config_arg;
pub mod engine_args;
pub mod negotiate;
pub mod plan;
pub mod plugin_query;
pub mod plugins;
pub mod proxy;
pub mod server;
pub mod up;

use clap::{Args, Parser, Subcommand};
use kvconnect_deployment::exit::Exit;
use kvconnect_registry::{Registry, RegistryConfig};
use std::path::PathBuf;
use std::process::ExitCode;

/// kvconnect: KV-cache connectors for disaggregated LLM serving.
#[derive(Debug, Parser)]
#[command(name = "kvconnect", version, about, propagate_version = true)]
pub struct Cli {
    /// Options every subcommand takes.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Options every subcommand takes.
#[derive(Debug, Clone, Default, Args)]
pub struct GlobalArgs {
    /// Also load plugins from DIR (a directory of *.so files, or one file); repeatable.
    /// KVCONNECT_PLUGIN_PATH (colon-separated) is always read too.
    #[arg(long = "plugin-dir", value_name = "DIR", global = true)]
    pub plugin_dirs: Vec<PathBuf>,
    /// Load plugin files that group or others can write (refused by default).
    #[arg(long, global = true)]
    pub allow_insecure_plugins: bool,
}

impl GlobalArgs {
    /// The registry these options describe. Refused plugins are logged as warnings, one
    /// line each; the host goes on without them.
    pub fn registry(&self) -> Registry {
        let r = Registry::load(&self.registry_config());
        r.warn_load_errors();
        r
    }

    /// Where these options say to look for plugins.
    pub fn registry_config(&self) -> RegistryConfig {
        RegistryConfig::with_env(self.plugin_dirs.clone(), self.allow_insecure_plugins)
    }
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Capability queries: list the connectors this host can see, inspect one.
    #[command(subcommand)]
    Plugins(plugins::PluginsCommand),
    /// One worker's effective KV layout and compat hash; --explain says who decided each field.
    Negotiate(negotiate::NegotiateArgs),
    /// Checks a deployment's prefill and decode workers against each other before launch.
    Plan(plan::PlanArgs),
    /// Runs a prefill or decode worker: engine, connector, side channel and HTTP API.
    // One server; the subcommand keeps the name users know it by (ARCHITECTURE.md §2).
    #[command(name = "worker")]
    Server(Box<server::ServerArgs>),
    /// The whole P/D deployment in one command: prefill and decode workers plus the proxy.
    Up(up::UpArgs),
    /// The P/D proxy alone, in front of prefill and decode servers started elsewhere (vLLM
    /// servers with KvconnectConnector).
    Proxy(proxy::ProxyArgs),
    /// End-to-end benchmarks against baselines measured in the same run.
    #[command(subcommand)]
    Bench(bench::BenchCommand),
}

/// Runs a parsed command line.
pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Plugins(c) => plugins::run(&cli.global, c),
        Command::Negotiate(a) => {
            Exit::from_result(negotiate::run(&a, &cli.global.registry(), &mut std::io::stdout().lock()))
        }
        Command::Plan(a) => {
            Exit::from_result(plan::run(&a, &cli.global.registry(), &mut std::io::stdout().lock()))
        }
        Command::Server(a) => server::run(&a, cli.global.registry()),
        Command::Up(a) => up::run(&a),
        Command::Proxy(a) => proxy::run(&a),
        Command::Bench(c) => bench::run(&c),
    }
}

/// The binary's entry point: parses the arguments, installs the log subscriber (stderr,
/// `RUST_LOG`, default `warn`), runs, and prints any error as `error: ...`.
pub fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        // The reader went away (`kvconnect plugins inspect nixl | head`): stop quietly, with
        // the status a process killed by SIGPIPE has.
        Err(e) if broken_pipe(&e) => ExitCode::from(141),
        Err(e) => match e.downcast_ref::<Exit>() {
            Some(x) => {
                if let Some(inner) = &x.error {
                    eprintln!("error: {inner:#}");
                }
                ExitCode::from(x.code)
            }
            None => {
                eprintln!("error: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

/// Whether `e` is, or wraps, a write to a closed pipe.
fn broken_pipe(e: &anyhow::Error) -> bool {
    let is = |c: &(dyn std::error::Error + 'static)| {
        c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    };
    e.chain().any(is)
        || e.downcast_ref::<Exit>().and_then(|x| x.error.as_ref()).is_some_and(|inner| inner.chain().any(is))
}

fn init_tracing() {
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    // Colours only on a terminal: logs written to a file or a pipe stay plain text.
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(ansi)
        .try_init();
}
