"""On PYTHONPATH of a vLLM server that runs without kvconnect (tests/vllm/bench_ttft.py's
`nixlconnector` peer): every process asks Linux for AMX tile permission as it starts, as
kvconnect's adapter does in its worker (`_allow_amx` in python/kvconnect/vllm.py). Without it,
on a CPU with AMX, vLLM's CPU attention dies of an illegal instruction in the first forward
pass that continues from loaded KV (`cpu_attention_with_kv_cache`), so the baseline could not
run at all."""

try:
    import torch

    if torch.cpu._is_amx_tile_supported():
        torch._C._cpu._init_amx()
except Exception:  # a torch without these calls, or no torch: nothing to ask for
    pass
