"""Tensor-parallel layouts planned on meta tensors: from the model's plan, inferred, or gathered."""

from __future__ import annotations

import pytest

from sglang_hf_backend.surgery.linear import COLUMN, REPLICATE, ROW, Placement
from sglang_hf_backend.surgery.tensor_parallel import TensorParallelError, placement_of_style
from sglang_hf_backend.testing.analysis import analyse_checkpoint

GATHERED = Placement("column", gather_output=True)


def placements(analysis, name, layer="layers.0"):
    layout = analysis(name, tp_size=2).tp_layout
    prefix = f"{layer}."
    return layout, {k[len(prefix) :]: v for k, v in layout.placements.items() if k.startswith(prefix)}


def test_the_models_own_plan(analysis):
    layout, layer = placements(analysis, "llama")
    assert layout.source == "plan"
    assert layer == {
        "self_attn.q_proj": COLUMN,
        "self_attn.k_proj": COLUMN,
        "self_attn.v_proj": COLUMN,
        "self_attn.o_proj": ROW,
        "mlp.gate_proj": COLUMN,
        "mlp.up_proj": COLUMN,
        "mlp.down_proj": ROW,
    }


def test_no_plan_is_inferred_from_dataflow(analysis):
    layout, layer = placements(analysis, "gpt2", layer="h.0")
    assert layout.source == "inferred"
    assert layer["mlp.c_fc"] == COLUMN and layer["mlp.c_proj"] == ROW
    assert layer["attn.c_proj"] == ROW
    # c_attn's output is cut with split(self.split_size): its code needs all heads
    assert layer["attn.c_attn"] == GATHERED
    assert "GPT2Attention: attention inputs gathered" in layout.summary()


def test_remote_code_is_inferred(analysis):
    layout, layer = placements(analysis, "remote", layer="blocks.0")
    assert layout.source == "inferred"
    assert [layer[n] for n in ("attn.wq", "attn.wk", "attn.wv", "attn.wo")] == [COLUMN, COLUMN, COLUMN, ROW]
    assert [layer[n] for n in ("mlp.w1", "mlp.w3", "mlp.w2")] == [COLUMN, COLUMN, ROW]


def test_norms_over_all_heads_keep_query_key_value_gathered(analysis):
    _, layer = placements(analysis, "olmo2")
    assert layer["self_attn.q_proj"] == GATHERED
    assert layer["self_attn.o_proj"] == ROW  # attention itself still runs on this rank's heads


def test_fewer_kv_heads_than_ranks_replicate_key_and_value(analysis):
    _, layer = placements(analysis, "llama-mqa")
    assert (layer["self_attn.k_proj"], layer["self_attn.v_proj"]) == (REPLICATE, REPLICATE)
    assert layer["self_attn.q_proj"] == COLUMN


def test_a_plan_that_leaves_an_mlp_out_is_completed_by_inference(analysis):
    layout, layer = placements(analysis, "qwen2_moe")
    assert layer["mlp.shared_expert.gate_proj"] == COLUMN
    assert layer["mlp.shared_expert.down_proj"] == ROW
    assert layer["mlp.shared_expert_gate"] == REPLICATE  # hidden -> 1: nothing to split
    assert "Qwen2MoeMLP: not in the model's tp_plan, inferred" in layout.summary()


def test_tp1_replicates_everything(analysis):
    assert set(analysis("llama").tp_layout.placements.values()) == {REPLICATE}


def test_indivisible_heads_are_refused(checkpoint):
    with pytest.raises(
        TensorParallelError, match="4 attention heads, which cannot be split across tp_size=3"
    ):
        analyse_checkpoint(checkpoint("llama"), tp_size=3)


def test_unknown_plan_styles_are_refused():
    with pytest.raises(TensorParallelError, match="Unknown tensor-parallel style 'diagonal'"):
        placement_of_style("diagonal", "layers.0.mlp.up_proj")
