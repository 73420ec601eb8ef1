"""Writes fixtures/vllm_batch.msgpack with vLLM's own classes and encoder.

    /work/main/.venv-vllm/bin/python events/tests/vllm_golden.py events/tests/fixtures/vllm_batch.msgpack

tests/codec.rs holds the same batch in kvconnect's types and checks that kvconnect writes
these bytes exactly and reads them back.
"""

import sys

import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

batch = KVEventBatch(
    ts=1767225600.25,
    events=[
        BlockStored(
            block_hashes=[1, 2**64 - 1],
            parent_block_hash=None,
            token_ids=[1, 2, 3, 4, 70000, 6, 7, 8],
            block_size=4,
            lora_id=None,
            medium="GPU",
            lora_name=None,
        ),
        BlockStored(
            block_hashes=[300],
            parent_block_hash=2**64 - 1,
            token_ids=[9, 10, 11, 12],
            block_size=4,
            lora_id=None,
            medium="cpu_tier",
            lora_name=None,
        ),
        BlockRemoved(block_hashes=[300], medium="cpu_tier"),
        BlockStored(
            block_hashes=[300],
            parent_block_hash=2**64 - 1,
            token_ids=[9, 10, 11, 12],
            block_size=4,
            lora_id=None,
            medium="disk",
            lora_name=None,
        ),
        BlockRemoved(block_hashes=[1, 2**64 - 1], medium="remote"),
        AllBlocksCleared(),
    ],
    data_parallel_rank=3,
)
with open(sys.argv[1], "wb") as f:
    f.write(msgspec.msgpack.Encoder().encode(batch))
