//! The `kvconnect` command, built inside the tests crate so its integration tests always find
//! a fresh binary next to them (see `kvconnect_tests::kvconnect_bin`).

fn main() -> std::process::ExitCode {
    kvconnect_host::cli::main()
}
