"""Model shapes beyond the plain Llama inside a real vLLM (CPU): the tiny Llama with an fp8 KV
cache (`--kv-cache-dtype fp8` and `fp8_e5m2`), and a DeepSeek-V2-like model with multi-head
latent attention (MLA: one 576-wide latent per token and layer, block size 16, float32).

    VENV/bin/python tests/vllm/test_shapes.py [--shapes fp8,fp8_e5m2,mla] [--keep]

For each shape: prefill and decode through KvconnectConnector over nixl tcp with the shape's
flags. Each prompt's reference output is the prefill server's own, computed whole before any
P/D (as a monolithic server with the same flags would; tests/vllm/test_pd.py compares with a
separate monolithic server). P/D outputs equal them token for token, decode loads every prompt
token but the last, and both sides negotiated the block size and cache dtype the flags give.
The sliding-window shape is tests/vllm/test_hma.py's.
"""

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from harness import (  # noqa: E402
    Failed, Server, complete, external_tokens, free_port, kv_config, loadable, make_tiny_model, serving, tokens_of,
)
from test_pd import nixl, pd_complete  # noqa: E402

PROMPT_LENS = [5, 20, 33, 64, 100, 200]

# name: (model kind, vLLM flags, block size, the cache dtype the adapter negotiates)
SHAPES = {
    "fp8": ("llama", ["--kv-cache-dtype", "fp8"], 32, "cache_dtype Fp8E4m3"),
    "fp8_e5m2": ("llama", ["--kv-cache-dtype", "fp8_e5m2"], 32, "cache_dtype Fp8E5m2"),
    # vLLM's CPU MLA kernel runs block size 16 only. In float32: decode continues a prompt
    # from loaded KV through MLA's absorbed (latent) formulation, a monolithic server computes
    # the whole prompt through the expanded one; in bfloat16 their rounding differs enough to
    # flip a greedy token of the random model. On a CPU with AMX tiles vLLM would pick its AMX
    # MLA backend, which takes no float32 weights (`expect weight to be bfloat16, ...` at
    # startup): the reference CPU_MLA backend is named, so every machine runs the same one.
    "mla": ("mla", ["--block-size", "16", "--dtype", "float32", "--attention-backend", "CPU_MLA"], 16,
            "cache_dtype F32"),
}


def prompts(lens=PROMPT_LENS) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(4, make_tiny_model.VOCAB) for _ in range(n)] for n in lens]


def check_shape(name: str, model: str, logdir: Path, ps) -> None:
    _, args, block, dtype = SHAPES[name]
    port = free_port()
    pre = Server(f"prefill-{name}", model, logdir, core=0, args=args,
                 kv_config=kv_config("kv_producer", nixl("tcp"), port=port))
    dec = Server(f"decode-{name}", model, logdir, core=1, args=args,
                 kv_config=kv_config("kv_consumer", nixl("tcp")))
    with serving(pre, dec):
        pre.wait_healthy()
        dec.wait_healthy()
        # The reference: each whole request on the prefill server alone, before any P/D, so
        # it computes every prompt token itself as a monolithic server with these flags
        # would. P/D's prefill then finds those blocks in its prefix cache and sends them; a
        # connector that wrote into them would show as a differing output on decode.
        expected = [tokens_of(complete(pre.url, p, f"mono-{name}-{i}")) for i, p in enumerate(ps)]
        layouts = []
        for s in (pre, dec):
            line = next((l for l in s.text().splitlines() if "kvconnect worker: connector" in l and "compat hash" in l), "")
            if f"block_size {block}," not in line or f"{dtype}," not in line:
                raise Failed(f"{name}: {s.name} negotiated {line.strip()!r}; expected block_size {block} and {dtype}")
            layouts.append(line.split("layout ", 1)[1].strip())
        got = [tokens_of(pd_complete(pre.url, dec.url, p, f"shapes-{name}-{i}")) for i, p in enumerate(ps)]
        for i, (g, e) in enumerate(zip(got, expected)):
            if g != e:
                raise Failed(f"{name}: prompt {i} ({len(ps[i])} tokens): P/D gave {g}, the prefill server alone {e}")
        # Decode loads every prompt token but the last, also where that ends inside a block.
        want = [loadable(p) for p in ps if loadable(p)]
        ext = external_tokens(dec.text())
        if sorted(ext) != sorted(want):
            raise Failed(f"{name}: decode loaded external tokens {ext}, expected {want}\n{dec.tail()}")
        loaded = dec.text().count("loaded its external KV")
        if loaded != len(want) or "failed to load its external KV" in dec.text():
            raise Failed(f"{name}: decode finished {loaded} loads for {len(want)} requests, or a load failed\n{dec.tail()}")
    print(f"ok: {name}: P/D over nixl tcp equals the prefill server alone for {len(ps)} prompts; decode loaded {sum(ext)} "
          f"prompt tokens; prefill negotiated {layouts[0][:200]}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--keep", action="store_true", help="keep the models and logs")
    a = ap.parse_args()
    names = a.shapes.split(",")
    if set(names) - set(SHAPES):
        ap.error(f"--shapes {a.shapes!r}: give some of {', '.join(SHAPES)}, comma-separated")

    # vLLM's CPU attention keeps an fp8 cache only with AVX-512 or AMX ("FP8 KV cache on CPU
    # requires x86 with AVX-512 or AMX."); on another CPU those shapes cannot run at all.
    import torch
    if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
        fp8 = [n for n in names if n.startswith("fp8")]
        if fp8:
            print(f"skipped: {', '.join(fp8)}: vLLM's CPU attention keeps an fp8 KV cache only on x86 with "
                  "AVX-512 or AMX, and this CPU has neither")
        names = [n for n in names if not n.startswith("fp8")]
    tmp = Path(tempfile.mkdtemp(prefix="kvconnect-vllm-shapes-"))
    ps = prompts()
    try:
        for name in names:
            kind = SHAPES[name][0]
            model = tmp / kind
            if not model.exists():
                make_tiny_model.build(str(model), kind)
            check_shape(name, str(model), tmp, ps)
    except Failed as e:
        print(f"FAILED: {e}", file=sys.stderr)
        print(f"logs in {tmp}", file=sys.stderr)
        sys.exit(1)
    if not a.keep:
        shutil.rmtree(tmp, ignore_errors=True)
    print("all vLLM shapes checks passed")


if __name__ == "__main__":
    main()
