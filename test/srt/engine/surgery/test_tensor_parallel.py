"""Tensor parallelism over SGLang's TP group (gloo on CPU), plan or no plan.

At tp_size=2, greedy fp32 output equals HF ``generate`` token for token (test_causal
shows TP=1 equals HF for the same checkpoints, so TP=2 equals TP=1 too). Each rank
holds only its shard: parameter bytes per rank at TP=2 are at most 0.6x of TP=1.
"""

from __future__ import annotations

import pytest

from sglang_hf_backend.surgery.tensor_parallel import TensorParallelError
from sglang_hf_backend.testing.engines import engine_case, running_engine

# architecture -> where its layout comes from
ARCHITECTURES = {
    "llama": "plan",
    "qwen3": "plan",
    "phi3": "plan",  # packed qkv / gate_up with colwise_gather_output styles
    "olmo2": "plan",  # q/k norms over all heads: q/k/v gathered, attention still sharded
    "llama-mqa": "plan",  # 1 KV head for 2 ranks: key/value replicated
    "gpt2": "inferred",  # no plan, Conv1D projections
    "llama-tied": "plan",
    "remote": "inferred",  # remote code has no plan
}


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def case(request, checkpoint):
    return engine_case(checkpoint, request.param, tp_size=2)


def test_tp2_batched_matches_hf(case):
    assert case.batched == case.reference


def test_tp2_one_at_a_time_matches_hf(case):
    assert case.one_at_a_time == case.reference


def test_layout_source(case):
    assert [r["tp_rank"] for r in case.reports] == [0, 1]
    assert {r["tp_source"] for r in case.reports} == {ARCHITECTURES[case.name]}


def test_layout_shards_attention_and_mlp(case):
    layers = case.reports[0]["layers"].values()
    assert any(
        kind.startswith(("ColumnParallelLinear", "QKVParallelLinear", "MergedColumn")) for kind in layers
    )
    assert any(kind.startswith("RowParallelLinear") for kind in layers)


@pytest.mark.parametrize("case", ["llama-mqa"], indirect=True)
def test_single_kv_head_is_replicated_by_the_fused_qkv(case):
    layers = case.reports[0]["layers"]
    # QKVParallelLinear gives each rank its 2 query heads and a copy of the one KV head
    assert layers["layers.0.self_attn.qkv_proj"] == "QKVParallelLinear"
    assert layers["layers.0.self_attn.o_proj"] == "RowParallelLinear"


@pytest.mark.parametrize("case", ["olmo2"], indirect=True)
def test_norms_over_all_heads_keep_qkv_gathered(case):
    layers = case.reports[0]["layers"]
    assert layers["layers.0.self_attn.q_proj"] == "ColumnParallelLinear (gather output)"
    assert layers["layers.0.self_attn.o_proj"] == "RowParallelLinear"  # attention output is per rank


@pytest.mark.parametrize("case", ["gpt2"], indirect=True)
def test_gpt2_conv1d_layout_is_inferred(case):
    layers = case.reports[0]["layers"]
    assert layers["h.0.mlp.c_fc"] == "ColumnParallelLinear"
    assert layers["h.0.mlp.c_proj"] == "RowParallelLinear"
    assert layers["h.0.attn.c_proj"] == "RowParallelLinear"
    # c_attn's output is cut with split(self.split_size): it runs gathered, attention sharded
    assert layers["h.0.attn.c_attn"] == "ColumnParallelLinear (gather output)"


def test_indivisible_heads_fail_before_start(checkpoint):
    import sglang as sgl

    with pytest.raises(
        TensorParallelError, match="4 attention heads, which cannot be split across tp_size=3"
    ):
        sgl.Engine(model_path=str(checkpoint("llama")), impl="transformers", tp_size=3)


def test_weights_per_rank_shrink(checkpoint):
    path = checkpoint("llama-wide")
    with running_engine(path, impl="transformers") as engine:
        (tp1,) = engine.load_reports()
    with running_engine(path, impl="transformers", tp_size=2) as engine:
        tp2 = engine.load_reports()
    ratios = [r["weight_bytes"] / tp1["weight_bytes"] for r in tp2]
    print(
        f"weight bytes per rank: tp1={tp1['weight_bytes']}, tp2={[r['weight_bytes'] for r in tp2]}, "
        f"ratio={ratios}; RSS peak growth while loading: tp1={tp1['peak_rss_growth_bytes']}, "
        f"tp2={[r['peak_rss_growth_bytes'] for r in tp2]}"
    )
    assert all(ratio <= 0.6 for ratio in ratios)
