//! The `kvconnect` command.

fn main() -> std::process::ExitCode {
    kvconnect_host::cli::main()
}
