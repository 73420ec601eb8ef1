//! Adaptations the nixl transport cannot combine are refused before launch, never at load:
//! state layers at `tp_size` > 1 (no `state_with_tp`), another block size across
//! tensor-parallel ranks (no `adapts_with_tp`), another block size beside per-request state
//! (no `adapts_with_state`), and state layers with KV in device memory (the backends that
//! carry state copy host memory only). `kvconnect plan` refuses each deployment in
//! examples/deployments/ with a conflict naming the child and the remedy; workers started
//! from them anyway are refused at start (negotiation) or at decode's handshake with
//! prefill, which loads nothing and says why (ARCHITECTURE.md §5).

use kvconnect_api::KvLayout;
use kvconnect_engine::ReferenceConfig;
use kvconnect_tests::{
    assert_refused_at_the_handshake, disaggregated, monolithic, monolithic_of, run_kvconnect, text,
    varied_prompts, workspace_root, Worker,
};
use std::path::PathBuf;

fn deployment(file: &str) -> PathBuf {
    workspace_root().join("examples/deployments").join(file)
}

/// `kvconnect plan [--joint] FILE`: exit code and stdout.
fn plan(file: &str, joint: bool) -> (i32, String) {
    let path = deployment(file);
    let mut args = vec!["plan"];
    if joint {
        args.push("--joint");
    }
    let path = path.to_str().unwrap().to_owned();
    args.push(&path);
    let out = run_kvconnect(&args);
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("panicked"), "{file}: {stderr}");
    (out.status.code().unwrap_or(-1), text(&out.stdout))
}

/// The one line of a plan that says why it is not compatible (the conflict, or the diff).
fn refusal(stdout: &str) -> String {
    let mut lines = stdout.lines().skip_while(|l| !l.starts_with("NOT COMPATIBLE"));
    let head = lines.next().unwrap_or_default().to_owned();
    match lines.next() {
        Some(diff) if head.ends_with("refused before any KV moves:") => diff.trim().to_owned(),
        _ => head,
    }
}

#[test]
fn plan_refuses_each_combination_before_launch_naming_the_child_and_the_remedy() {
    for (file, joint, wants) in [
        (
            "hybrid-tp.toml",
            false,
            &[
                "NOT COMPATIBLE: prefill: model 'kvconnect-reference (KvconnectReferenceForCausalLM)' keeps per-request state in 2 state-space/linear-attention layer(s), and tp_size=2 splits its KV heads over 2 tensor-parallel ranks",
                "but child 'nixl' carries that state only at tp_size 1 (no state_with_tp)",
                "Remedy: run this model with tp_size=1 on prefill and decode",
            ][..],
        ),
        ("hybrid-tp.toml", true, &["child 'nixl' (prefill and decode) carries that state only at tp_size 1"][..]),
        (
            "tp-block-size.toml",
            false,
            &[
                "block_size: prefill=16 (user set block_size=16;",
                "decode=32 (user set block_size=32;",
                "blocks would be split or merged in a 1:2 ratio with tp_size 2 on prefill and 1 on decode, which is not supported by child 'nixl' (prefill and decode) (no adapts_with_tp",
                "set block_size to the same value on prefill and decode",
            ][..],
        ),
        (
            "hybrid-block-size.toml",
            false,
            &[
                "blocks would be split or merged in a 1:2 ratio beside the per-request state of the model's state layers, which is not supported by child 'nixl' (prefill and decode) (no adapts_with_state)",
                "set block_size to the same value on prefill and decode",
            ][..],
        ),
        (
            "hybrid-device.toml",
            false,
            &[
                "NOT COMPATIBLE: prefill: KV memory device (set by user) is not usable by child 'nixl'",
                "child 'nixl' uses host",
                "Remedy: set kv_buffer_device to host memory",
            ][..],
        ),
        ("hybrid-device.toml", true, &["not usable by child 'nixl' (prefill and decode)"][..]),
        (
            "tp-one-worker.toml",
            false,
            &[
                "NOT COMPATIBLE: prefill: this engine serves its 2 tensor-parallel ranks through one connector",
                "but child 'nixl' serves one rank's KV regions per worker (no ranks_in_one_worker)",
                "Remedy: run tp_size=1, or use connectors that declare ranks_in_one_worker (the nixl connector does with backend shm or tcp)",
            ][..],
        ),
        ("tp-one-worker.toml", true, &["serves one rank's KV regions per worker (no ranks_in_one_worker)"][..]),
    ] {
        let (code, stdout) = plan(file, joint);
        assert_eq!(code, 1, "{file} joint={joint}:\n{stdout}");
        let line = refusal(&stdout);
        for w in wants {
            assert!(line.contains(w), "{file} joint={joint}: want {w:?} in the refusal line:\n{line}\n{stdout}");
        }
    }
    // Joint negotiation gives both roles one block size, so the block-size stories are
    // refused there as two options that must agree.
    for file in ["tp-block-size.toml", "hybrid-block-size.toml"] {
        let (code, stdout) = plan(file, true);
        assert_eq!(code, 1, "{file}:\n{stdout}");
        assert!(
            stdout.contains("option block_size differs between the roles: prefill=16, decode=32"),
            "{stdout}"
        );
    }
}

#[test]
fn each_difference_alone_stays_adaptable() {
    // The refusals above are of combinations only: the same pairs with one difference each
    // are compatible with adaptation.
    let dir = tempfile::tempdir().unwrap();
    let fixtures = workspace_root().join("fixtures");
    for (file, from, to, want) in [
        ("tp-block-size.toml", "block_size = 32", "block_size = 16", "TP: decode TP 1 : prefill TP 2"),
        (
            "tp-block-size.toml",
            "tp_size = 2",
            "tp_size = 1",
            "block sizes: 1 decode block(s) per 2 prefill block(s)",
        ),
        (
            "hybrid-block-size.toml",
            "../../fixtures/models/kvconnect--reference-hybrid",
            "../../fixtures/models/kvconnect--reference",
            "block sizes: 1 decode block(s) per 2 prefill block(s)",
        ),
    ] {
        let src = std::fs::read_to_string(deployment(file))
            .unwrap()
            .replacen(from, to, 1)
            .replace("hybrid_kv_cache_manager = \"on\"\n", "")
            .replace("../../fixtures", fixtures.to_str().unwrap());
        let path = dir.path().join(file);
        std::fs::write(&path, src).unwrap();
        let out = run_kvconnect(&["plan", path.to_str().unwrap()]);
        let stdout = text(&out.stdout);
        assert_eq!(out.status.code(), Some(0), "{file} with {to}:\n{stdout}{}", text(&out.stderr));
        assert!(
            stdout.contains("COMPATIBLE with adaptation") && stdout.contains(want),
            "{file} with {to}:\n{stdout}"
        );
    }
}

/// Prefill and decode started from `file`, each negotiated alone: decode's handshake with
/// prefill is refused with `reason`, nothing is loaded, and the output (decode computed the
/// prompt itself) equals `mono`.
fn refused_at_the_handshake(file: &str, prompt: &[u32], mono: &[u32], reason: &[&str]) {
    let path = deployment(file);
    let start = |role| Worker::start(&["--deployment", path.to_str().unwrap(), "--role", role]);
    let (p, d) = (start("prefill"), start("decode"));
    let (st, r) = disaggregated(&p, &d, prompt, mono.len());
    assert_refused_at_the_handshake(&p, &d, (st, &r), mono, reason);
}

#[test]
fn another_block_size_across_tp_ranks_is_refused_at_the_handshake_not_at_load() {
    let prompts = varied_prompts(22);
    let prompt = &prompts[21];
    let mono = monolithic(std::slice::from_ref(prompt), 4, KvLayout::HND).remove(0);
    refused_at_the_handshake(
        "tp-block-size.toml",
        prompt,
        &mono,
        &["block_size: prefill=16", "decode=32", "no adapts_with_tp", "set block_size to the same value"],
    );
}

#[test]
fn another_block_size_beside_state_is_refused_at_the_handshake_not_at_load() {
    let prompts = varied_prompts(22);
    let prompt = &prompts[21];
    let hybrid = ReferenceConfig::builtin_hybrid().unwrap();
    let mono = monolithic_of(hybrid, std::slice::from_ref(prompt), 4, KvLayout::HND).remove(0);
    refused_at_the_handshake(
        "hybrid-block-size.toml",
        prompt,
        &mono,
        &["block_size: prefill=16", "decode=32", "no adapts_with_state", "set block_size to the same value"],
    );
}

/// A kvconnect worker started from `file` as `role`: its exit code and stderr, or a panic
/// when it is still running after 60 s (it should refuse before it serves).
fn refused_at_start(file: &str, role: &str) -> (i32, String) {
    let path = deployment(file);
    let mut child = std::process::Command::new(kvconnect_tests::kvconnect_bin())
        .args(["worker", "--deployment", path.to_str().unwrap(), "--role", role])
        .env_remove("KVCONNECT_PLUGIN_PATH")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("a worker from {file} as {role} still runs after 60 s instead of refusing to start");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let out = child.wait_with_output().unwrap();
    (out.status.code().unwrap_or(-1), text(&out.stderr))
}

#[test]
fn an_engine_whose_ranks_share_one_connector_is_refused_before_launch_on_a_one_rank_backend() {
    // kvconnect's engine at tp_size 2 over backend nixl: refused at start, never at
    // register_kv_caches, with the conflict plan shows.
    for role in ["prefill", "decode"] {
        let (code, stderr) = refused_at_start("tp-one-worker.toml", role);
        assert_ne!(code, 0, "{role}: {stderr}");
        assert!(
            stderr.contains("serves its 2 tensor-parallel ranks through one connector")
                && stderr.contains("child 'nixl' serves one rank's KV regions per worker"),
            "{role}: {stderr}"
        );
        assert!(!stderr.contains("register_kv_caches") && !stderr.contains("panicked"), "{role}: {stderr}");
    }
    // The same file for vLLM servers (one connector per rank) is compatible, and kvconnect's
    // own servers refuse to run it, saying whose servers it describes.
    let dir = tempfile::tempdir().unwrap();
    let src = std::fs::read_to_string(deployment("tp-one-worker.toml"))
        .unwrap()
        .replace("model = ", "engine = \"vllm\"\nmodel = ")
        .replace("../../fixtures", workspace_root().join("fixtures").to_str().unwrap());
    let vllm = dir.path().join("tp-one-worker-vllm.toml");
    std::fs::write(&vllm, src).unwrap();
    let out = run_kvconnect(&["plan", vllm.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(0), "{}{}", text(&out.stdout), text(&out.stderr));
    let out = run_kvconnect(&["worker", "--deployment", vllm.to_str().unwrap(), "--role", "prefill"]);
    assert_ne!(out.status.code(), Some(0));
    assert!(
        text(&out.stderr).contains("this deployment describes vllm servers (engine = \"vllm\"): start each with vLLM and KvconnectConnector"),
        "{}",
        text(&out.stderr)
    );
}
