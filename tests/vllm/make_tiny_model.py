"""Builds a tiny Llama (or, with `sliding`, a Gemma-3-like model whose first layer attends
through a sliding window; with `mla`, a DeepSeek-V2-like model with multi-head latent attention) with a fixed seed and a local byte-level BPE tokenizer (with a chat
template) into a directory, so vLLM can serve it without any download.

    python make_tiny_model.py DIR [llama|sliding|mla]

Random weights from a fixed seed are deterministic: greedy outputs of two runs compare exactly.
"""

import sys

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

VOCAB = 1024
SEED = 1234

SENTENCES = [
    "The prefill engine computes the prompt and keeps its KV cache for the decode engine.",
    "A decode engine loads the KV blocks and generates the rest of the answer, token by token.",
    "Blocks move whole between engines over shared memory or over a TCP connection.",
    "Negotiation settles the layout, the block size and the cache dtype before anything moves.",
    "Hello world! How are you today? I am fine, thank you very much for asking.",
    "0123456789 abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_=+*/\\",
]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


# What both kinds share: the size of every layer and the special tokens.
GEOMETRY = dict(
    vocab_size=VOCAB,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=3,
    torch_dtype="bfloat16",
)


def _sliding() -> "torch.nn.Module":
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    cfg = Gemma3TextConfig(
        query_pre_attn_scalar=64,
        sliding_window=64,
        layer_types=["sliding_attention", "full_attention"],
        **GEOMETRY,
    )
    return Gemma3ForCausalLM(cfg)


def _mla() -> "torch.nn.Module":
    """DeepSeek-V2-like attention (one latent per token; every layer dense, so the experts configured are never built). vLLM's
    CPU MLA kernel takes only DeepSeek's latent, kv_lora_rank 512 + rope 64 = 576 wide."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    geometry = dict(GEOMETRY, num_key_value_heads=GEOMETRY["num_attention_heads"])
    cfg = DeepseekV2Config(
        kv_lora_rank=512,
        q_lora_rank=None,
        qk_rope_head_dim=64,
        qk_nope_head_dim=32,
        v_head_dim=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=64,
        first_k_dense_replace=GEOMETRY["num_hidden_layers"],
        tie_word_embeddings=False,
        **geometry,
    )
    return DeepseekV2ForCausalLM(cfg)


def build(out: str, kind: str = "llama") -> None:
    torch.manual_seed(SEED)
    if kind == "sliding":
        model = _sliding()
    elif kind == "mla":
        model = _mla()
    else:
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=False, **GEOMETRY))
    model.to(torch.bfloat16).save_pretrained(out)
    _tokenizer(out)


def _tokenizer(out: str) -> None:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(SENTENCES * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: make_tiny_model.py DIR [llama|sliding|mla]")
    build(*sys.argv[1:])
