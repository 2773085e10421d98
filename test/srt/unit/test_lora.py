"""LoRA adapters: what reaches our layers, what is refused and why, before any engine starts."""

from __future__ import annotations

import pytest
import sglang as sgl
import torch
from sglang.srt.lora.lora_registry import LoRARef
from torch import nn

from sglang_hf_backend import lora
from sglang_hf_backend.lora import LoRAAdapterRefused

LLAMA_LINEARS = [
    f"model.layers.{i}.{name}"
    for i in range(2)
    for name in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.down_proj",
    )
]
GPT2_LINEARS = [
    f"transformer.h.{i}.{name}"
    for i in range(2)
    for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
]
QKV = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def names_of(linears: list[str], packed: dict) -> lora.LoRANames:
    return lora.LoRANames.of(lora.served_after_fusion(linears, packed), packed)


def test_fused_parts_are_served_under_the_fused_name():
    served = lora.served_after_fusion(LLAMA_LINEARS, QKV)
    assert served[:3] == [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert len(served) == 6


def test_peft_targets_name_the_fused_layer_or_the_unfused_part():
    fused, unfused = names_of(LLAMA_LINEARS, QKV), names_of(LLAMA_LINEARS, {})
    assert fused.target_names(["q_proj", "k_proj", "o_proj"], sglang_names=None) == {"qkv_proj", "o_proj"}
    assert unfused.target_names(["q_proj", "k_proj", "o_proj"], sglang_names=None) == {
        "q_proj",
        "k_proj",
        "o_proj",
    }
    assert fused.layer_id("base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight") == 1


def test_gpt2_names_tell_attention_and_mlp_projections_apart():
    names = names_of(GPT2_LINEARS, {})
    assert names.layer_list == "transformer.h"
    assert sorted(set(names.names.values())) == ["attn.c_proj", "c_attn", "c_fc", "mlp.c_proj"]
    assert names.target_names(["c_proj"], sglang_names=None) == {"attn.c_proj", "mlp.c_proj"}
    assert names.target_names(["mlp.c_proj", "c_attn"], sglang_names=None) == {"mlp.c_proj", "c_attn"}
    assert names.layer_id("base_model.model.transformer.h.1.mlp.c_fc.lora_B.weight") == 1
    assert names.layer_id("model.layers.1.mlp.c_fc") is None


def test_adapter_reaching_fused_layers_passes():
    config = {"r": 8, "target_modules": ["q_proj", "k_proj", "o_proj", "down_proj"]}
    lora.check_adapter("a", config, names_of(LLAMA_LINEARS, QKV), "LlamaForCausalLM", max_rank=8)
    lora.check_adapter("all", {"r": 8, "target_modules": "all-linear"}, names_of(LLAMA_LINEARS, QKV), "Llama")


@pytest.mark.parametrize(
    "config, linears, reason",
    [
        (
            {"r": 16, "target_modules": ["o_proj"]},
            LLAMA_LINEARS,
            "rank 16, above --max-lora-rank 8; raise it",
        ),
        ({"target_modules": ["embed_tokens", "q_proj"]}, LLAMA_LINEARS, r"trains \['embed_tokens'\]"),
        (
            {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
            LLAMA_LINEARS,
            r"trains \['lm_head'\]",
        ),
        (
            {"target_modules": ["w_in"]},
            LLAMA_LINEARS,
            r"no linear of that name \(LoRA-capable: \['down_proj'",
        ),
        (
            {"target_modules": ["projector"]},
            [*LLAMA_LINEARS, "model.projector"],
            r"outside the decoder layers \(model.layers.N\)",
        ),
        (
            {"target_modules": ["proj"]},
            ["model.layers.0.a.x.proj", "model.layers.0.b.x.proj"],
            r"same name \(model.layers.0.a.x.proj\)",
        ),
    ],
)
def test_unreachable_adapter_is_refused_with_the_reason(config, linears, reason):
    with pytest.raises(LoRAAdapterRefused, match=reason):
        lora.check_adapter("bad", config, names_of(linears, QKV), "SomeForCausalLM", max_rank=8)


def test_adapter_paths_from_every_form_sglang_takes():
    as_json = {"lora_name": "c", "lora_path": "/c"}
    forms = ["a=/a", "/b", as_json, LoRARef(lora_name="d", lora_path="/d")]
    assert lora.adapter_paths(forms) == {"a": "/a", "/b": "/b", "c": "/c", "d": "/d"}
    assert lora.adapter_paths({"e": "/e"}) == {"e": "/e"}


class _Packed(nn.Module):
    """A fused gate/up layer as far as adapter completion reads it: its full output widths."""

    output_sizes = [12, 12]


def test_parts_an_adapter_leaves_out_get_zeros():
    model = nn.Module()
    model.mlp = nn.Module()
    model.mlp.gate_up_proj = _Packed()
    model.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    weights = {
        "base_model.model.mlp.up_proj.lora_A.weight": torch.ones(4, 8),
        "base_model.model.mlp.up_proj.lora_B.weight": torch.ones(12, 4),
    }
    lora.complete_packed_parts(model, weights)
    assert torch.equal(weights["base_model.model.mlp.gate_proj.lora_A.weight"], torch.zeros(4, 8))
    assert torch.equal(weights["base_model.model.mlp.gate_proj.lora_B.weight"], torch.zeros(12, 4))


def test_adapter_weights_are_stacked_for_the_served_layers():
    names = names_of(["h.0.qkv_proj", "h.0.c_attn", "h.0.o_proj"], QKV)
    prefix = "base_model.model.h.0"
    weights = {
        f"{prefix}.{part}.lora_{kind}.weight": torch.full((4, 8), float(i))
        for i, part in enumerate(["q_proj", "k_proj", "v_proj", "c_attn", "o_proj"])
        for kind in "AB"
    }
    lora.stack_for_served_layers(names, {"h.0.qkv_proj": 3, "h.0.c_attn": 3, "h.0.o_proj": 1}, weights)
    assert sorted(weights) == sorted(
        f"{prefix}.{m}.lora_{k}.weight" for m in ("qkv_proj", "c_attn", "o_proj") for k in "AB"
    )
    assert weights[f"{prefix}.qkv_proj.lora_A.weight"][:, 0].tolist() == [0] * 4 + [1] * 4 + [2] * 4
    assert weights[f"{prefix}.c_attn.lora_A.weight"].shape == (12, 8)  # one A per q/k/v shard
    assert weights[f"{prefix}.c_attn.lora_B.weight"].shape == (4, 8)
    assert weights[f"{prefix}.o_proj.lora_A.weight"].shape == (4, 8)


def test_native_stacked_parameter_table_gives_the_packing():
    model = nn.Module()
    model.bitsandbytes_stacked_params_mapping = {
        ".k_proj": (".qkv_proj", 1),
        ".q_proj": (".qkv_proj", 0),
        ".v_proj": (".qkv_proj", 2),
    }
    assert lora.packed_parts(model) == QKV


def test_rank_above_the_limit_refused_before_start(checkpoint, adapters):
    with pytest.raises(LoRAAdapterRefused, match="rank 8, above --max-lora-rank 4"):
        start(checkpoint("llama"), {"mlp": adapters("llama")["mlp"]}, max_lora_rank=4)


def start(path, adapters: dict, **options):
    paths = {name: str(adapter) for name, adapter in adapters.items()}
    sgl.Engine(model_path=str(path), impl="transformers", enable_lora=True, lora_paths=paths, **options)
