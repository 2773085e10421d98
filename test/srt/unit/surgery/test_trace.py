"""One meta forward records each module class's dataflow and every attention call."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.models.analysis import trace_backbone
from sglang_hf_backend.testing.analysis import class_named


def test_every_attention_call_is_recorded_with_its_shapes(analysis):
    trace = analysis("llama").trace
    calls = trace.attention_calls
    assert [c.order for c in calls] == [0, 1]  # two decoder layers
    assert {(c.num_heads, c.num_kv_heads, c.head_dim, c.v_head_dim) for c in calls} == {(4, 2, 16, 16)}
    assert calls[0].kwargs["scaling"] == pytest.approx(16**-0.5)


def test_each_class_is_traced_once_with_children_opaque(analysis):
    a = analysis("llama")
    attention = a.trace.classes[class_named(a, "LlamaAttention")]
    assert attention.instance == "layers.0.self_attn"  # the first instance
    calls = [n.target for n in attention.nodes if n.kind == "module"]
    assert calls == ["q_proj", "k_proj", "v_proj", "o_proj"]  # children appear as one call each
    assert len(attention.attention_calls()) == 1
    instances = [name for name, _ in a.trace.class_instances[class_named(a, "LlamaAttention")]]
    assert instances == ["layers.0.self_attn", "layers.1.self_attn"]


def test_per_layer_settings_reach_the_trace(analysis):
    calls = analysis("gemma2").trace.attention_calls
    assert {c.kwargs["softcap"] for c in calls} == {2.0}
    assert [c.kwargs.get("sliding_window") for c in calls] == [8, None, 8, None]


def test_value_dependent_python_takes_the_plain_branch(analysis):
    # GPT-2 checks for pad tokens in input_ids: on meta tensors such reads answer "no"
    assert len(analysis("gpt2").trace.attention_calls) == 2


def test_expert_banks_are_opaque(analysis):
    a = analysis("qwen3_moe")
    block = a.trace.classes[class_named(a, "Qwen3MoeSparseMoeBlock")]
    (bank_call,) = block.module_calls("experts")
    assert len(bank_call.inputs) == 3  # hidden states, expert indices, routing weights
    bank = a.trace.classes[class_named(a, "Qwen3MoeExperts")]
    assert [n.target for n in bank.nodes] == ["empty_like"]  # its stand-in, not its code


class _NeedsRealValues(nn.Module):
    def forward(self, input_ids=None, **kwargs):
        return torch.nonzero(input_ids)  # no meta kernel


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.base_model = _NeedsRealValues()


def test_a_model_that_cannot_run_on_meta_is_refused_with_the_reason():
    with pytest.raises(IncompatibleModelError, match="could not be run on meta tensors .*nonzero"):
        model = _Model()
        trace_backbone(model, model.base_model)
