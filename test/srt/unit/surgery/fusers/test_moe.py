"""Sparse-MoE blocks -> SGLang TopK + FusedMoE: routing and experts identified by running them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.surgery.fusers.moe import (
    ExpertLayout,
    ExpertRoute,
    Routing,
    identify_experts,
    identify_routing,
)
from sglang_hf_backend.testing.analysis import analyse_checkpoint, matches
from sglang_hf_backend.weights import Piece

OUTPUTS = ("logits", "weights", "indices")


@pytest.mark.parametrize(
    ("name", "block", "renormalised"),
    [
        ("qwen3_moe", "Qwen3MoeSparseMoeBlock", True),
        ("mixtral", "MixtralSparseMoeBlock", True),
        ("qwen2_moe", "Qwen2MoeSparseMoeBlock", False),
        ("olmoe", "OlmoeSparseMoeBlock", False),
    ],
)
def test_transformers_moe_families(analysis, name, block, renormalised):
    match = matches(analysis(name), "moe")[block]
    assert match.routing == Routing(2, "softmax", renormalised, 1.0, "weight", None, OUTPUTS)
    assert (match.layout.gate_up, match.layout.down, match.layout.transposed) == (
        "gate_up_proj",
        "down_proj",
        False,
    )
    assert match.layout.activation == "silu"
    assert match.description.startswith(
        f"router (gate) + {match.layout.num_experts} experts -> FusedMoE (top-2"
    )


def test_a_router_sglang_cannot_reproduce_is_refused_naming_the_module(checkpoint):
    with pytest.raises(IncompatibleModelError) as error:
        analyse_checkpoint(checkpoint("remote-moe"), trust_remote_code=True)
    message = str(error.value)
    assert "TinyLMSparseBlock is a mixture-of-experts block" in message
    assert "its router (TinyLMSquaredRouter) chooses experts or weights differently" in message
    assert "SGLANG_HF_BACKEND_DISABLE_FUSIONS=moe" in message  # what still serves it, unfused


class SigmoidRouter(nn.Module):
    """DeepSeek-V3-like routing: sigmoid scores, a selection-only bias, renormalised, scaled."""

    def __init__(self, experts=8, hidden=16, top_k=3, scale=2.5):
        super().__init__()
        self.top_k, self.scale = top_k, scale
        self.weight = nn.Parameter(torch.zeros(experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(experts))

    def forward(self, x):
        logits = F.linear(x, self.weight)
        scores = logits.sigmoid()
        ids = torch.topk(scores + self.e_score_correction_bias, self.top_k).indices
        weights = scores.gather(1, ids)
        return logits, weights / weights.sum(-1, keepdim=True) * self.scale, ids


def test_sigmoid_routing_with_correction_bias_and_scale():
    layout = ExpertLayout("gate_up_proj", "down_proj", False, "silu", 8, 16, 4)
    routing = identify_routing(SigmoidRouter(), layout, OUTPUTS)
    assert routing == Routing(
        3, "sigmoid", True, pytest.approx(2.5), "weight", "e_score_correction_bias", OUTPUTS
    )
    assert routing.describe() == "top-3, sigmoid, correction bias, renormalised, scaled x2.5"


class TransposedBank(nn.Module):
    """Experts stored [experts, in, out], computed token by token."""

    def __init__(self, experts=4, hidden=16, inter=8):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(experts, hidden, 2 * inter))
        self.down_proj = nn.Parameter(torch.zeros(experts, inter, hidden))

    def forward(self, x, indices, weights):
        out = torch.zeros_like(x)
        for t in range(x.shape[0]):
            for k in range(indices.shape[1]):
                gate, up = (x[t] @ self.gate_up_proj[indices[t, k]]).chunk(2)
                out[t] += weights[t, k] * ((F.silu(gate) * up) @ self.down_proj[indices[t, k]])
        return out


def test_transposed_experts():
    layout = identify_experts(TransposedBank())
    assert layout == ExpertLayout("gate_up_proj", "down_proj", True, "silu", 4, 16, 8)


def test_relu_experts_are_refused():
    class ReluBank(TransposedBank):
        def forward(self, x, indices, weights):
            return torch.relu(super().forward(x, indices, weights))

    with pytest.raises(Exception, match="do not compute act\\(gate\\) \\* up -> down"):
        identify_experts(ReluBank())


def test_stacked_expert_tensor_loads_expert_by_expert_and_shard_by_shard():
    stacked = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)  # [experts, 2 * inter, hidden]
    route = ExpertRoute("mlp.experts.w13_weight", ("w1", "w3"), transposed=False, num_experts=2)
    loads = {(load.expert_id, load.shard_id): load.tensor for load in route.loads(stacked, None)}
    assert set(loads) == {(0, "w1"), (0, "w3"), (1, "w1"), (1, "w3")}
    assert torch.equal(loads[1, "w3"], stacked[1, 3:])
    transposed = ExpertRoute("mlp.experts.w13_weight", ("w1", "w3"), transposed=True, num_experts=2)
    loads = {(ld.expert_id, ld.shard_id): ld.tensor for ld in transposed.loads(stacked.transpose(1, 2), None)}
    assert torch.equal(loads[1, "w3"], stacked[1, 3:])
    assert sorted(route.keys()) == [
        "mlp.experts.w13_weight:w1:0",
        "mlp.experts.w13_weight:w1:1",
        "mlp.experts.w13_weight:w3:0",
        "mlp.experts.w13_weight:w3:1",
    ]


def test_one_experts_tensor_from_a_per_expert_checkpoint():
    route = ExpertRoute("mlp.experts.w13_weight", ("w1", "w3"), transposed=False, num_experts=8)
    (load,) = route.loads(torch.ones(3, 4), Piece(index=5, part=1, parts=2))
    assert (load.param, load.shard_id, load.expert_id) == ("mlp.experts.w13_weight", "w3", 5)


def test_identified_whatever_the_serving_dtype(checkpoint):
    # schedulers build the model under the serving dtype as torch's default
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        plan = analyse_checkpoint(checkpoint("qwen3_moe")).fusions
    finally:
        torch.set_default_dtype(previous)
    assert [m.module_class.__name__ for m in plan.matches_of("moe")] == ["Qwen3MoeSparseMoeBlock"]
