"""Tiny HF backbones for engine-free tests of compiled steps (random weights, no checkpoint).

Served models route attention to RadixAttention; these use ``test_causal_sdpa``, plain causal
SDPA, since HF's own SDPA path branches on the query length and cannot be traced for any
token count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaModel

from sglang_hf_backend import compilation

ATTENTION = "test_causal_sdpa"


def causal_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTENTION, causal_sdpa)


def tiny_llama(layers: int = 2) -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation=ATTENTION,
    )
    return LlamaModel(config).eval()


def token_inputs(tokens: int) -> dict:
    """As ``CompiledStep`` hands them on (``without_views``)."""
    ids = torch.randint(0, 128, (tokens,), generator=torch.Generator().manual_seed(tokens))
    return compilation.without_views({"input_ids": ids[None], "position_ids": torch.arange(tokens)[None]})


def eager(backbone, **inputs) -> torch.Tensor:
    return backbone(**inputs, use_cache=False).last_hidden_state
