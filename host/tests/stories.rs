//! The negotiation stories of ARCHITECTURE.md §5, each run through the real `kvconnect` binary on
//! the deployments in examples/deployments/: the exit code and what the user reads.

use std::path::PathBuf;
use std::process::Command;

struct Out {
    code: i32,
    stdout: String,
    stderr: String,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn kvconnect(args: &[&str]) -> Out {
    let o = Command::new(env!("CARGO_BIN_EXE_kvconnect"))
        .args(args)
        .current_dir(root())
        .env_remove("KVCONNECT_PLUGIN_PATH")
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let out = Out {
        code: o.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&o.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&o.stderr).into_owned(),
    };
    assert!(!out.stderr.contains("panicked"), "kvconnect {args:?} panicked:\n{}", out.stderr);
    out
}

fn plan(file: &str, extra: &[&str]) -> Out {
    let path = format!("examples/deployments/{file}");
    let mut args = vec!["plan"];
    args.extend_from_slice(extra);
    args.push(&path);
    kvconnect(&args)
}

/// The two `compat hash` lines of a plan, prefill first.
fn hashes(stdout: &str) -> Vec<String> {
    stdout.lines().filter_map(|l| l.trim().strip_prefix("compat hash")).map(|h| h.trim().to_owned()).collect()
}

const PD_LMCACHE_NIXL: &str = r#"{"kv_connector":"PdConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"LMCacheConnectorV1"},{"kv_connector":"NixlConnector"}]}}"#;
const PD_FLEXKV_NIXL: &str = r#"{"kv_connector":"PdConnector","kv_connector_extra_config":{"connectors":[{"kv_connector":"FlexKVConnectorV1"},{"kv_connector":"NixlConnector"}]}}"#;
const LLAMA: &str = "fixtures/models/meta-llama--Llama-3.1-8B-Instruct/config.json";
const GEMMA: &str = "fixtures/models/google--gemma-3-1b-it/config.json";

#[test]
fn dyn3545_plan_catches_the_hma_mismatch_on_hybrid_models() {
    for file in ["dyn3545-gpt-oss-20b.toml", "dyn3545-gemma-3-1b.toml"] {
        let o = plan(file, &[]);
        assert_eq!(o.code, 1, "{file}:\n{}{}", o.stdout, o.stderr);
        assert!(o.stdout.contains("prefill: PdConnector[lmcache, nixl]"), "{}", o.stdout);
        assert!(o.stdout.contains("NOT COMPATIBLE"), "{}", o.stdout);
        // Which field, each side's value and why, and the remedy.
        assert!(
            o.stdout.contains("hma: prefill=off (child 'lmcache' does not support HMA), decode=on (default:"),
            "{}",
            o.stdout
        );
        assert!(o.stdout.contains("hybrid_kv_cache_manager=off on decode"), "{}", o.stdout);
        let h = hashes(&o.stdout);
        assert_eq!(h.len(), 2);
        assert_ne!(h[0], h[1]);
    }
}

#[test]
fn dyn3545_joint_negotiation_agrees_by_construction() {
    for file in ["dyn3545-gpt-oss-20b.toml", "dyn3545-gemma-3-1b.toml"] {
        let o = plan(file, &["--joint"]);
        assert_eq!(o.code, 0, "{file}:\n{}{}", o.stdout, o.stderr);
        let h = hashes(&o.stdout);
        assert_eq!(h.len(), 2);
        assert_eq!(h[0], h[1], "{}", o.stdout);
        assert!(o.stdout.contains("COMPATIBLE: identical"), "{}", o.stdout);
    }
}

#[test]
fn dyn3545_pair_on_a_single_attention_kind_model_passes_alone() {
    let o = plan("dyn3545-qwen3-0.6b.toml", &[]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    let h = hashes(&o.stdout);
    assert_eq!(h[0], h[1]);
}

#[test]
fn flexkv_nixl_picks_hnd_with_a_transpose_on_flexkv() {
    let o = plan("flexkv-nixl.toml", &[]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("adapter: child 'flexkv' works in NHD (LBNHC) natively"), "{}", o.stdout);

    let o = kvconnect(&["negotiate", "--kv-transfer-config", PD_FLEXKV_NIXL, "--model", LLAMA, "--explain"]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    let layout = o.stdout.lines().find(|l| l.trim_start().starts_with("layout")).unwrap_or_default();
    assert!(layout.contains("= HND (LBHNC)") && layout.contains("[child nixl]"), "{layout}");
    assert!(layout.contains("'flexkv'") && layout.contains("transpose"), "{layout}");
    assert!(o.stdout.contains("compat hash: "), "{}", o.stdout);

    let o = plan("flexkv-nixl-no-adapters.toml", &[]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains("child 'flexkv' rejects HND") && o.stdout.contains("child 'nixl' requires HND"),
        "{}",
        o.stdout
    );
    let o =
        kvconnect(&["negotiate", "--kv-transfer-config", PD_FLEXKV_NIXL, "--model", LLAMA, "--no-adapters"]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("'flexkv'") && o.stdout.contains("'nixl'"), "{}", o.stdout);
}

#[test]
fn hnd_and_lbhnc_are_the_same_layout() {
    let o = plan("hnd-vs-lbhnc.toml", &[]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("COMPATIBLE: identical"), "{}", o.stdout);
    assert!(!o.stdout.contains("layout: prefill="), "no layout diff: {}", o.stdout);
}

#[test]
fn cross_layer_on_one_side_is_adaptable_with_a_permutation() {
    let o = plan("cross-layer-one-side.toml", &[]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("COMPATIBLE with adaptation"), "{}", o.stdout);
    assert!(o.stdout.contains("layout: prefill=BLHNC (user set kv_cache_layout=BLHNC"), "{}", o.stdout);
    assert!(
        o.stdout.contains(
            "decode permutes every block it reads from prefill: BLHNC -> LBHNC, axes [1, 0, 2, 3, 4]"
        ),
        "{}",
        o.stdout
    );
    let h = hashes(&o.stdout);
    assert_eq!(h[0], h[1], "the layout is not a strict field");
}

#[test]
fn different_tp_sizes_are_refused_naming_both_sizes() {
    let o = plan("tp-mismatch.toml", &[]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    let tp: Vec<&str> = o.stdout.lines().filter(|l| l.trim_start().starts_with("tp_size ")).collect();
    assert_eq!(tp.len(), 2, "each role shows its TP size: {}", o.stdout);
    assert!(tp[0].ends_with(" 2") && tp[1].ends_with(" 4"), "{tp:?}");
    assert!(o.stdout.contains("NOT COMPATIBLE"), "{}", o.stdout);
    assert!(
        o.stdout.contains(
            "tp_size: prefill=2 (user set tp_size=2; child 'nixl' moves KV only between equal TP sizes"
        ),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("decode=4 (user set tp_size=4;"), "{}", o.stdout);
    assert!(
        o.stdout.contains("run decode with tp_size=2 like prefill, or prefill with tp_size=4"),
        "{}",
        o.stdout
    );
    assert!(!o.stdout.contains("hint: "), "negotiating jointly does not change the TP sizes: {}", o.stdout);
    let h = hashes(&o.stdout);
    assert_eq!(h[0], h[1], "the TP size is not hashed: only the transport's support decides");

    let o = plan("tp-mismatch.toml", &["--joint"]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains("NOT COMPATIBLE: deployment: prefill has tp_size=2 and decode tp_size=4, but child 'nixl' (prefill and decode) does not load KV across different TP sizes"),
        "{}",
        o.stdout
    );
    assert!(o.stdout.contains("Remedy: ") && o.stdout.contains("run decode with tp_size=2"), "{}", o.stdout);
}

#[test]
fn nixl_over_shm_loads_across_tp_sizes_that_divide_one_another() {
    let o = plan("tp-heterogeneous.toml", &[]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("COMPATIBLE with adaptation"), "{}", o.stdout);
    assert!(o.stdout.contains("child 'nixl' loads KV across different TP sizes"), "{}", o.stdout);
    assert!(o.stdout.contains("heads are regrouped across ranks in a 1:2 ratio on receive"), "{}", o.stdout);
    // 2 and 3 do not divide one another: refused naming both sizes.
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(root().join("examples/deployments/tp-heterogeneous.toml"))
        .unwrap()
        .replace("tp_size = 4", "tp_size = 3")
        .replace("../../fixtures", &root().join("fixtures").display().to_string());
    let file = dir.path().join("tp3.toml");
    std::fs::write(&file, src).unwrap();
    let o = kvconnect(&["plan", file.to_str().unwrap()]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("tp_size: prefill=2") && o.stdout.contains("decode=3"), "{}", o.stdout);
    assert!(o.stdout.contains("TP sizes 2 and 3 do not divide each other"), "{}", o.stdout);
}

#[test]
fn one_kv_head_makes_nhd_and_hnd_the_same_bytes() {
    for extra in [&[][..], &["--joint"][..]] {
        let o = plan("mla-nhd-hnd.toml", extra);
        assert_eq!(o.code, 0, "{extra:?}:\n{}{}", o.stdout, o.stderr);
        let layouts: Vec<&str> = o.stdout.lines().filter(|l| l.trim_start().starts_with("layout ")).collect();
        assert!(layouts[0].ends_with("NHD (LBNHC)") && layouts[1].ends_with("HND (LBHNC)"), "{layouts:?}");
        assert!(o.stdout.contains("COMPATIBLE: identical compat hashes;"), "{}", o.stdout);
        assert!(
            o.stdout.contains("no adapter: one KV head, so LBNHC and LBHNC are the same bytes"),
            "{}",
            o.stdout
        );
        assert!(!o.stdout.contains("permutes"), "{}", o.stdout);
        assert!(!o.stdout.contains("layout: prefill="), "no layout diff: {}", o.stdout);
        let h = hashes(&o.stdout);
        assert_eq!(h[0], h[1]);
    }
    // Llama has eight KV heads: there NHD is another layout, which nixl does not take.
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(root().join("examples/deployments/mla-nhd-hnd.toml"))
        .unwrap()
        .replace("deepseek-ai--DeepSeek-V2-Lite", "meta-llama--Llama-3.1-8B-Instruct")
        .replace("../../fixtures", root().join("fixtures").to_str().unwrap());
    let file = dir.path().join("llama.toml");
    std::fs::write(&file, src).unwrap();
    let o = kvconnect(&["plan", file.to_str().unwrap()]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains("kv_cache_layout=NHD (LBNHC) was set, but child 'nixl' does not accept it"),
        "{}",
        o.stdout
    );
    assert!(!o.stdout.contains("one KV head"), "{}", o.stdout);
}

#[test]
fn hybrid_models_list_their_state_groups_and_are_refused_without_a_state_carrier() {
    for (file, groups) in [
        ("nemotron-h-state.toml", "23 state-space/linear-attention layer(s) (1 group: mamba2 x23 (conv 3x6144 bf16, ssm 64x64x128 f32))"),
        (
            "qwen3-next-state.toml",
            "36 state-space/linear-attention layer(s) (1 group: gated_delta_net x36 (conv 3x8192 bf16, ssm 32x128x128 bf16))",
        ),
    ] {
        for extra in [&[][..], &["--joint"][..]] {
            let o = plan(file, extra);
            assert_eq!(o.code, 1, "{file} {extra:?}:\n{}{}", o.stdout, o.stderr);
            assert!(o.stdout.contains("NOT COMPATIBLE"), "{}", o.stdout);
            assert!(o.stdout.contains(groups), "{file}: {}", o.stdout);
            assert!(o.stdout.contains("does not carry per-request state (carries_state)"), "{}", o.stdout);
            assert!(o.stdout.contains("Remedy: use connectors that declare carries_state"), "{}", o.stdout);
        }
        let o = plan(file, &[]);
        assert!(o.stdout.contains("but child 'nixl' does not carry"), "{}", o.stdout);
        let o = plan(file, &["--joint"]);
        assert!(o.stdout.contains("but child 'nixl' (prefill and decode) does not carry"), "{}", o.stdout);
    }
    // The nixl connector carries state over shm (its default backend) and tcp: the same
    // models with those backends are compatible, and the plan lists their state groups.
    let o = kvconnect(&["plugins", "inspect", "nixl"]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    let row = o.stdout.lines().find(|l| l.trim_start().starts_with("carries_state")).unwrap_or_default();
    assert!(row.ends_with("yes"), "{}", o.stdout);
    for (file, groups) in [
        ("nemotron-h-state.toml", "1 group: mamba2 x23 (conv 3x6144 bf16, ssm 64x64x128 f32)"),
        ("qwen3-next-state.toml", "1 group: gated_delta_net x36 (conv 3x8192 bf16, ssm 32x128x128 bf16)"),
    ] {
        for backend in ["shm", "tcp"] {
            let dir = tempfile::tempdir().unwrap();
            let src = std::fs::read_to_string(root().join("examples/deployments").join(file))
                .unwrap()
                .replace(r#""backends":["UCX"]"#, &format!(r#""backend":"{backend}""#))
                .replace("../../fixtures", root().join("fixtures").to_str().unwrap());
            let path = dir.path().join(file);
            std::fs::write(&path, src).unwrap();
            let o = kvconnect(&["plan", path.to_str().unwrap()]);
            assert_eq!(o.code, 0, "{file} over {backend}:\n{}{}", o.stdout, o.stderr);
            assert!(o.stdout.contains(groups), "{file} over {backend}: {}", o.stdout);
        }
    }
}

#[test]
fn forcing_hma_on_with_a_child_that_lacks_it_names_the_child() {
    let o = plan("hma-forced-on.toml", &[]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(
        o.stdout.contains("child 'lmcache' does not support the hybrid KV cache manager"),
        "{}",
        o.stdout
    );
    let o = kvconnect(&[
        "negotiate",
        "--kv-transfer-config",
        PD_LMCACHE_NIXL,
        "--model",
        GEMMA,
        "--hybrid-kv-cache-manager",
        "on",
    ]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("child 'lmcache'"), "{}", o.stdout);
}

#[test]
fn bad_deployments_exit_2_with_a_clear_message() {
    for (file, wants) in [
        ("bad/malformed-toml.toml", &["malformed-toml.toml:4:9:", "invalid table header"][..]),
        (
            "bad/malformed-json.toml",
            &["malformed-json.toml:8:14: [prefill] kv_transfer_config", "expected value"][..],
        ),
        (
            "bad/unknown-connector.toml",
            &[
                "'MooncakeStoreConnector'",
                "NixlConnector",
                "LMCacheConnectorV1",
                "FlexKVConnectorV1",
                "PdConnector",
            ][..],
        ),
        (
            "bad/unknown-layout.toml",
            &["unknown-layout.toml:6:19:", "unknown KV layout 'HDN'", "valid layouts are NHD"][..],
        ),
        ("bad/empty-children.toml", &["no children", "kv_connector_extra_config.connectors"][..]),
        ("bad/looping-composite.toml", &["'tiered' contains itself (tiered -> tiered)"][..]),
        ("bad/unknown-keys.toml", &["prefill.kv_cache_layot", "decode.hybrid_kv_cache_manger"][..]),
        ("bad/model-is-a-device.toml", &["/dev/zero", "not a regular file"][..]),
    ] {
        let o = plan(file, &[]);
        assert_eq!(o.code, 2, "{file}:\n{}{}", o.stdout, o.stderr);
        assert!(o.stderr.starts_with("error: "), "{file}: {}", o.stderr);
        assert_eq!(o.stderr.trim_end().lines().count(), 1, "{file}: one line: {}", o.stderr);
        for w in wants {
            assert!(o.stderr.contains(w), "{file}: want {w:?} in {}", o.stderr);
        }
    }
    let o = plan("does-not-exist.toml", &[]);
    assert_eq!(o.code, 2);
    assert!(o.stderr.contains("cannot read the deployment file"), "{}", o.stderr);
}

#[test]
fn a_reader_that_goes_away_ends_the_command_quietly() {
    use std::process::Stdio;
    for args in [&["plugins", "inspect", "nixl"][..], &["plugins", "list", "--json"][..]] {
        // The reader's end is closed before the command starts, as `| head -0` leaves it.
        let (reader, writer) = std::io::pipe().unwrap();
        drop(reader);
        let o = Command::new(env!("CARGO_BIN_EXE_kvconnect"))
            .args(args)
            .current_dir(root())
            .env_remove("KVCONNECT_PLUGIN_PATH")
            .stdout(writer)
            .stderr(Stdio::piped())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&o.stderr);
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
        assert_eq!(o.status.code(), Some(141), "{args:?}: {stderr}");
        assert!(stderr.is_empty(), "{args:?}: nothing on stderr: {stderr}");
    }
}

#[test]
fn bad_negotiate_arguments_exit_2_with_a_clear_message() {
    for (args, wants) in [
        (
            vec!["--kv-transfer-config", "{\"kv_connector\": }", "--model", LLAMA],
            &["line 1, column 18", "expected value"][..],
        ),
        (
            vec![
                "--kv-transfer-config",
                "{\"kv_connector\":\"NixlConnector\"}",
                "--model",
                LLAMA,
                "--kv-cache-layout",
                "HDN",
            ],
            &["--kv-cache-layout", "unknown KV layout 'HDN'"][..],
        ),
        (
            vec!["--kv-transfer-config", "{\"kv_connector\":\"Mooncake\"}", "--model", LLAMA],
            &["'Mooncake'", "NixlConnector"][..],
        ),
        (
            vec![
                "--kv-transfer-config",
                "{\"kv_connector\":\"PdConnector\",\"kv_connector_extra_config\":{\"connectors\":[]}}",
                "--model",
                LLAMA,
            ],
            &["no children"][..],
        ),
        (
            vec!["--kv-transfer-config", "{\"kv_connector\":\"NixlConnector\"}", "--model", "nowhere.json"],
            &["nowhere.json"][..],
        ),
    ] {
        let mut a = vec!["negotiate"];
        a.extend(args.iter().copied());
        let o = kvconnect(&a);
        assert_eq!(o.code, 2, "{a:?}:\n{}{}", o.stdout, o.stderr);
        for w in wants {
            assert!(o.stderr.contains(w), "{a:?}: want {w:?} in {}", o.stderr);
        }
    }
}

#[test]
fn plan_explain_says_why_each_side_chose_its_hma() {
    let o = plan("dyn3545-gemma-3-1b.toml", &["--explain"]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    let hma: Vec<&str> = o.stdout.lines().filter(|l| l.trim_start().starts_with("hma ")).collect();
    assert_eq!(hma.len(), 2, "{}", o.stdout);
    assert!(hma[0].contains("= off") && hma[0].contains("[child lmcache]"), "{}", hma[0]);
    assert!(hma[1].contains("= on") && hma[1].contains("[default]"), "{}", hma[1]);
}

#[test]
fn negotiate_reads_the_config_from_a_file_too() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("pd.json");
    std::fs::write(&path, PD_FLEXKV_NIXL).unwrap();
    let o = kvconnect(&["negotiate", "--kv-transfer-config", path.to_str().unwrap(), "--model", LLAMA]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    assert!(o.stdout.contains("adapter: child 'flexkv'"), "{}", o.stdout);
}

#[test]
fn plan_and_negotiate_speak_json_for_scripts() {
    let o = plan("dyn3545-gpt-oss-20b.toml", &["--json"]);
    assert_eq!(o.code, 1, "{}{}", o.stdout, o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["compatible"], false);
    assert_eq!(v["joint"], false);
    assert!(v["diffs"].as_array().unwrap().iter().any(|d| d["field"] == "hma"), "{v}");
    assert_ne!(v["prefill"]["compat_hash"], v["decode"]["compat_hash"]);

    let o = plan("dyn3545-gpt-oss-20b.toml", &["--joint", "--json"]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["compatible"], true);
    assert_eq!(v["prefill"]["compat_hash"], v["decode"]["compat_hash"]);

    let o = kvconnect(&["negotiate", "--kv-transfer-config", PD_FLEXKV_NIXL, "--model", LLAMA, "--json"]);
    assert_eq!(o.code, 0, "{}{}", o.stdout, o.stderr);
    let v: serde_json::Value = serde_json::from_str(&o.stdout).unwrap();
    assert_eq!(v["effective"]["layout"], "LBHNC");
    assert_eq!(v["adapters"][0]["child"], "flexkv");
    assert_eq!(v["compat_hash"].as_str().unwrap().len(), 64);
}
