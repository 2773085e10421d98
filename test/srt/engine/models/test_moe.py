"""TransformersMoEForCausalLM: sparse-MoE blocks on SGLang's TopK + FusedMoE, vs HF ``generate``.

Four transformers 5.19 families at fp32, token for token with HF ``generate``, batched and
one prompt at a time: Qwen3-MoE (renormalised top-k), Mixtral (saved one tensor per expert as
``block_sparse_moe.experts.N.w1/w2/w3``), Qwen2-MoE (a shared expert behind a sigmoid gate)
and OLMoE (saved with transformers 5's stacked ``[experts, ...]`` tensors). At TP=2 the three
that load their experts differently (one tensor per expert, a shared expert, stacked
tensors); Qwen3-MoE loads as Mixtral does, under other names.
Expert parallelism splits the experts over ranks; the ranks' expert bytes show it.
"""

from __future__ import annotations

import pytest

from sglang_hf_backend.surgery.fusers import DISABLE_ENV
from sglang_hf_backend.testing.engines import engine_case

OURS = "sglang_hf_backend.models.TransformersMoEForCausalLM"
FAMILIES = ["qwen3_moe", "mixtral", "qwen2_moe", "olmoe"]
# SGLang 0.5.23's native OlmoeForCausalLM cannot load a transformers 5.19 OLMoE checkpoint
# (its q/k norms expect the full hidden size: "Attempted to load weight (torch.Size([32])) into
# parameter (torch.Size([64]))"), so OLMoE is compared with HF only.
NATIVE = ["qwen3_moe", "mixtral", "qwen2_moe"]
SHARDED = ["mixtral", "qwen2_moe", "olmoe"]  # also served at TP=2


@pytest.fixture(
    scope="module", params=[(name, 1) for name in FAMILIES] + [(name, 2) for name in SHARDED], ids=str
)
def case(request, checkpoint):
    name, tp_size = request.param
    return engine_case(checkpoint, name, tp_size=tp_size)


def test_served_by_our_moe_class_with_fused_experts(case):
    assert {r["model_class"] for r in case.reports} == {OURS}
    fused = [line for line in case.reports[0]["fusions"] if "experts -> FusedMoE" in line]
    assert len(fused) == 1, case.reports[0]["fusions"]
    assert all(r["moe_layers"] == 2 for r in case.reports)


def test_batched_matches_hf(case):
    assert case.batched == case.reference


def test_one_at_a_time_matches_hf(case):
    assert case.one_at_a_time == case.reference


@pytest.mark.parametrize("name", NATIVE)
def test_matches_native(checkpoint, name):
    ours, native = engine_case(checkpoint, name), engine_case(checkpoint, name, impl="sglang")
    assert native.reports == []  # SGLang's own class served it
    assert native.batched == ours.batched
    assert native.one_at_a_time == ours.one_at_a_time


@pytest.mark.parametrize("split", [{"tp_size": 2}, {"tp_size": 2, "ep_size": 2}], ids=["tp2", "ep2"])
def test_each_rank_holds_a_share_of_the_experts(checkpoint, split):
    whole = engine_case(checkpoint, "mixtral").reports[0]["expert_weight_bytes"]
    case = engine_case(checkpoint, "mixtral", **split)
    per_rank = [r["expert_weight_bytes"] for r in case.reports]
    print(f"expert bytes per rank with {split}: {per_rank} (TP=1: {whole})")
    assert len(per_rank) == 2 and all(b <= 0.55 * whole for b in per_rank)
    assert case.batched == case.reference  # EP: every token still meets all its experts


def test_moe_fusion_switched_off_runs_hf_experts(checkpoint):
    case = engine_case(checkpoint, "qwen3_moe", extra_env={DISABLE_ENV: "moe"})
    assert "fusion switched off: moe" in case.reports[0]["fusions"]
    assert case.reports[0]["moe_layers"] == 0
    assert case.batched == case.reference


def test_torchao_quantizes_dense_linears_and_keeps_experts(checkpoint):
    plain = engine_case(checkpoint, "qwen3_moe").reports[0]
    (report,) = engine_case(checkpoint, "qwen3_moe", torchao_config="int8wo").reports
    assert report["quantized_linears"] == 2 * 2  # qkv_proj and o_proj in each of 2 layers
    assert report["quantized_weight_types"] == ["Int8Tensor"]
    assert report["expert_weight_bytes"] == plain["expert_weight_bytes"]  # full precision
