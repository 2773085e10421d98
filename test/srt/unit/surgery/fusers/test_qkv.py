"""q/k/v -> one QKVParallelLinear: matched per attention class, refused where heads must gather."""

from __future__ import annotations

from torch import nn

from sglang_hf_backend.surgery.fusers.base import Packing
from sglang_hf_backend.surgery.fusers.qkv import QKVFuser
from sglang_hf_backend.testing.analysis import matches
from sglang_hf_backend.weights import Route


def test_matches_attention_with_three_projections(analysis):
    match = matches(analysis("llama"), "qkv")["LlamaAttention"]
    assert (match.q, match.k, match.v) == ("q_proj", "k_proj", "v_proj")
    assert (match.num_heads, match.num_kv_heads, match.head_dim) == (4, 2, 16)
    assert match.description == "q_proj + k_proj + v_proj -> qkv_proj (QKVParallelLinear)"
    names = match.forward.__code__.co_names
    assert "qkv_proj" in names and "q_proj" not in names  # the class's forward, rewritten


def test_one_packing_gives_routes_and_packed_names(analysis):
    match = matches(analysis("remote"), "qkv")["TinyLMAttention"]
    (packing,) = QKVFuser().packings(match)
    assert packing == Packing("qkv_proj", (("wq", "q"), ("wk", "k"), ("wv", "v")))
    assert packing.packed_modules() == {"qkv_proj": ["wq", "wk", "wv"]}  # the model's own names
    owner = nn.Module()
    owner.qkv_proj = nn.Linear(4, 12, bias=True)
    routes = packing.routes("blocks.0.attn", owner)
    assert routes["blocks.0.attn.wk.weight"] == Route("blocks.0.attn.qkv_proj.weight", "k")
    assert routes["blocks.0.attn.wv.bias"] == Route("blocks.0.attn.qkv_proj.bias", "v")
    assert len(routes) == 6


def test_attention_needing_all_heads_stays_unfused_with_a_note(analysis):
    plan = analysis("olmo2", tp_size=2).fusions
    assert "Olmo2Attention" not in matches(analysis("olmo2", tp_size=2), "qkv")
    assert any("not fused in Olmo2Attention (qkv): its code needs all heads" in n for n in plan.notes)


def test_a_packed_projection_is_left_alone(analysis):
    assert matches(analysis("gpt_neox"), "qkv") == {}
    assert matches(analysis("gpt2"), "qkv") == {}
