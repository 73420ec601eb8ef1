//! docs/plugins.md's "Write a plugin", followed as a user follows it: the section's `cargo new`, its
//! files pasted into the new crate outside the workspace (the kvconnect-api path pointed at
//! this checkout), an offline build, the section's `kvconnect plugins inspect`, and then the
//! worker half driven through the C ABI, to show its safe KV view at work.

#![allow(unsafe_code)] // Tests vouch for their own KV buffers as regions (KvRegion::new).

use kvconnect_api::{
    AttentionKind, BlockId, ConnectorContext, ConnectorError, ConnectorFactory, Dtype, KvLayout, KvRegion,
    KvRegionSpec, KvRole, KvTransferConfig, LayerId, ModelSpec,
};
use kvconnect_engine::local_effective_layout;
use kvconnect_registry::loader::{load_plugin, LoaderOptions};
use kvconnect_tests::plugin_fixtures::{copy_with_mode, external_plugin};
use kvconnect_tests::{cargo_cmd, kvconnect_bin, readme, workspace_root};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the guide's Cargo.toml says the API is.
const API_PLACEHOLDER: &str = "/path/to/kvconnect/connector-api";
const NUM_BLOCKS: u32 = 4;

fn section() -> String {
    let doc =
        std::fs::read_to_string(workspace_root().join("docs/plugins.md")).expect("read docs/plugins.md");
    readme::section(&doc, "## Write a plugin")
        .expect("docs/plugins.md has a \"## Write a plugin\" section")
        .to_owned()
}

/// Step 1 as written: `cargo new --lib NAME && cd NAME`, run in `dir`; returns the crate.
fn new_crate(section: &str, dir: &Path) -> PathBuf {
    let step = readme::marked_block(section, "plugin-step: new").expect("step 1 is marked");
    let (new, cd) = step.trim().split_once(" && ").expect("step 1 is `cargo new ... && cd ...`");
    let args: Vec<&str> = new.split_whitespace().collect();
    assert_eq!(args.first(), Some(&"cargo"), "step 1 runs cargo: {step}");
    cargo_cmd::run(&args[1..], dir);
    dir.join(cd.trim().strip_prefix("cd ").expect("step 1 ends in `cd NAME`"))
}

/// Steps 2 to 4: every marked file written into the crate.
fn write_files(section: &str, krate: &Path) -> Vec<String> {
    let api = workspace_root().join("connector-api");
    let files = readme::marked_blocks(section, "plugin-file: ");
    for (name, body) in &files {
        let body = if name == "Cargo.toml" {
            assert!(body.contains(API_PLACEHOLDER), "the manifest names {API_PLACEHOLDER}:\n{body}");
            body.replace(API_PLACEHOLDER, &api.to_string_lossy())
        } else {
            body.clone()
        };
        let path = krate.join(name);
        std::fs::create_dir_all(path.parent().expect("a file in the crate")).expect("create a source folder");
        std::fs::write(&path, body).expect("write a guide's file");
    }
    files.into_iter().map(|(name, _)| name).collect()
}

/// Step 5's `kvconnect ...` lines, run in the crate (where step 5 copied the library).
fn run_kvconnect_lines(section: &str, krate: &Path) -> Vec<String> {
    let step = readme::marked_block(section, "plugin-step: inspect").expect("step 5 is marked");
    let lines: Vec<&str> = step.lines().filter(|l| l.starts_with("kvconnect ")).collect();
    assert!(!lines.is_empty(), "step 5 runs kvconnect:\n{step}");
    lines
        .iter()
        .map(|line| {
            let out = Command::new(kvconnect_bin())
                .args(line.split_whitespace().skip(1))
                .current_dir(krate)
                .env_remove("KVCONNECT_PLUGIN_PATH")
                .env("RUST_LOG", "off")
                .output()
                .expect("run kvconnect");
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "`{line}` failed:\n{stderr}");
            String::from_utf8_lossy(&out.stdout).into_owned()
        })
        .collect()
}

fn context() -> ConnectorContext {
    let model = ModelSpec {
        name: "tiny".into(),
        num_layers: 1,
        num_kv_heads: 2,
        head_dim: 4,
        dtype: Some(Dtype::F16),
        layers: vec![AttentionKind::Full],
        state: None,
    };
    ConnectorContext {
        config: KvTransferConfig::named("mine"),
        effective: local_effective_layout(&model, KvLayout::NHD, false, 4, Dtype::F16),
        model,
        role: KvRole::Both,
        engine_id: "readme".into(),
        tp_rank: 0,
        tp_size: 1,
    }
}

#[test]
fn the_guide_plugin_builds_loads_and_bounds_checks_its_kv_memory() {
    let section = section();
    let dir = tempfile::tempdir().expect("a temporary directory");
    let krate = new_crate(&section, dir.path());
    let files = write_files(&section, &krate);
    assert_eq!(files, ["Cargo.toml", "src/lib.rs", "src/worker.rs"]);

    let tmp = Path::new(env!("CARGO_TARGET_TMPDIR"));
    let (lib, stderr) = external_plugin(tmp, &krate, "mine");
    assert!(!stderr.contains("warning"), "the guide's plugin builds without warnings:\n{stderr}");
    copy_with_mode(&lib, &krate, "libmine.so", 0o755);
    let outputs = run_kvconnect_lines(&section, &krate);
    let inspect = &outputs[0];
    let field = |key: &str| {
        inspect
            .lines()
            .find_map(|l| l.trim().strip_prefix(key).filter(|rest| rest.starts_with(' ')).map(str::trim))
            .unwrap_or_else(|| panic!("no `{key}` in:\n{inspect}"))
    };
    assert_eq!(field("name"), "mine");
    assert_eq!(field("version"), "0.1.0");
    assert_eq!(field("origin"), "dynamic");
    assert!(field("abi").starts_with("1.3"), "{inspect}");
    assert_eq!(field("memory_kinds"), "host");
    assert_eq!(field("transfer_mode"), "none");

    // The worker half, through the C ABI. Declared before the workers, so it outlives them.
    let per_layer = NUM_BLOCKS as usize * 2 * 2 * 4 * 4 * 2; // blocks x K/V x heads x tokens x dim x f16
    let mut kv = vec![0u8; per_layer];
    let mut short = vec![0u8; per_layer - 1];
    let plugin = load_plugin(&krate.join("libmine.so"), &LoaderOptions::default()).expect("load libmine.so");
    let mut w = plugin.factory.create_worker(&context()).expect("a worker");
    // SAFETY: `kv` outlives the worker and nothing else touches it meanwhile.
    let region =
        unsafe { KvRegion::new(KvRegionSpec::host("layer.0", &mut kv, vec![LayerId(0)], 0, NUM_BLOCKS)) };
    w.register_kv_caches(&[region]).expect("regions that match the layout are taken");
    let e = w.save_kv_layer(LayerId(0), &[BlockId(NUM_BLOCKS - 1)]).unwrap_err();
    assert!(matches!(e, ConnectorError::NotImplemented { .. }), "a block inside the region: {e}");
    let e = w.save_kv_layer(LayerId(0), &[BlockId(NUM_BLOCKS)]).unwrap_err();
    assert!(matches!(e, ConnectorError::InvalidArgument { .. }), "a block past the region's end: {e}");

    let mut w = plugin.factory.create_worker(&context()).expect("a worker");
    // SAFETY: as above, for `short`; the worker refuses it anyway.
    let region =
        unsafe { KvRegion::new(KvRegionSpec::host("layer.0", &mut short, vec![LayerId(0)], 0, NUM_BLOCKS)) };
    let e = w.register_kv_caches(&[region]).unwrap_err();
    assert!(
        matches!(e, ConnectorError::InvalidArgument { .. }) && e.to_string().contains("region 'layer.0' is"),
        "a region one byte short: {e}"
    );
}
