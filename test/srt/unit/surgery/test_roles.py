"""Roles of linears and experts, read off the dataflow, not off attribute names."""

from __future__ import annotations

from sglang_hf_backend.surgery.roles import (
    AttentionRoles,
    MlpRoles,
    MoERoles,
    attention_roles,
    is_expert_bank,
    mlp_roles,
    moe_roles,
    split_parts,
)
from sglang_hf_backend.testing.analysis import class_named, first_instance


def roles_of(analysis, class_name, finder):
    _, module = first_instance(analysis, class_name)
    return finder(analysis.trace.classes[class_named(analysis, class_name)], module)


def test_attention_projections(analysis):
    assert roles_of(analysis("llama"), "LlamaAttention", attention_roles) == AttentionRoles(
        "q_proj", "k_proj", "v_proj", "o_proj"
    )
    assert roles_of(analysis("remote"), "TinyLMAttention", attention_roles) == AttentionRoles(
        "wq", "wk", "wv", "wo"
    )


def test_one_packed_projection_feeds_query_key_and_value(analysis):
    a = analysis("gpt2")
    roles = roles_of(a, "GPT2Attention", attention_roles)
    assert roles == AttentionRoles("c_attn", "c_attn", "c_attn", "c_proj")
    assert roles.inputs == ("c_attn",)
    assert split_parts(a.trace.classes[class_named(a, "GPT2Attention")], "c_attn") == 3


def test_mlp_projections(analysis):
    assert roles_of(analysis("llama"), "LlamaMLP", mlp_roles) == MlpRoles(
        ("gate_proj", "up_proj"), "down_proj"
    )
    assert roles_of(analysis("gpt2"), "GPT2MLP", mlp_roles) == MlpRoles(("c_fc",), "c_proj")
    assert roles_of(analysis("llama"), "LlamaAttention", mlp_roles) is None  # attention is no MLP


def test_expert_banks(analysis):
    a = analysis("qwen3_moe")
    assert is_expert_bank(first_instance(a, "Qwen3MoeExperts")[1])
    assert not is_expert_bank(first_instance(analysis("llama"), "LlamaMLP")[1])


def test_moe_router_and_bank(analysis):
    roles = roles_of(analysis("qwen3_moe"), "Qwen3MoeSparseMoeBlock", moe_roles)
    assert roles == MoERoles("gate", "experts", ("logits", "weights", "indices"))
    assert roles_of(analysis("llama"), "LlamaMLP", moe_roles) is None
