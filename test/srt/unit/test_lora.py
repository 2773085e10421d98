"""LoRA adapters: what reaches our layers, what is refused and why, before any engine starts."""

from __future__ import annotations

import json

import pytest
import sglang as sgl
import torch
from sglang.srt.lora.lora_registry import LoRARef
from torch import nn

from sglang_hf_backend import lora
from sglang_hf_backend.lora import LoRAAdapterRefused
from sglang_hf_backend.testing.lora import build_adapter

# path -> TP kind at TP=2, as the layout places Llama's linears
LLAMA_LINEARS = {
    f"model.layers.{i}.{name}": kind
    for i in range(2)
    for name, kind in (
        ("self_attn.q_proj", "column"),
        ("self_attn.k_proj", "column"),
        ("self_attn.v_proj", "column"),
        ("self_attn.o_proj", "row"),
        ("mlp.down_proj", "row"),
    )
}
QKV = {"qkv_proj": ["q_proj", "k_proj", "v_proj"]}


def test_fused_parts_are_served_under_the_fused_name():
    served = lora.served_after_fusion(LLAMA_LINEARS, QKV)
    assert list(served)[:3] == [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.down_proj",
    ]
    assert served["model.layers.1.self_attn.qkv_proj"] == "column" and len(served) == 6


def test_adapter_reaching_fused_layers_passes():
    served = lora.served_after_fusion(LLAMA_LINEARS, QKV)
    config = {"r": 8, "target_modules": ["q_proj", "k_proj", "o_proj", "down_proj"]}
    lora.check_adapter("a", config, served, "LlamaForCausalLM", max_rank=8, tp_size=2)
    lora.check_adapter("all", {"r": 8, "target_modules": "all-linear"}, served, "LlamaForCausalLM")


@pytest.mark.parametrize(
    "config, packed, linears, reason",
    [
        (
            {"r": 16, "target_modules": ["o_proj"]},
            QKV,
            LLAMA_LINEARS,
            "rank 16, above --max-lora-rank 8; raise it",
        ),
        (
            {"target_modules": ["q_proj"]},
            {},
            LLAMA_LINEARS,
            "fused qkv_proj, and this model serves q_proj unfused",
        ),
        ({"target_modules": ["embed_tokens", "q_proj"]}, QKV, LLAMA_LINEARS, r"trains \['embed_tokens'\]"),
        (
            {"target_modules": ["q_proj"], "modules_to_save": ["lm_head"]},
            QKV,
            LLAMA_LINEARS,
            r"trains \['lm_head'\]",
        ),
        (
            {"target_modules": ["w_in"]},
            QKV,
            LLAMA_LINEARS,
            r"no linear of that name \(LoRA-capable layers: \['down_proj'",
        ),
        (
            {"target_modules": ["c_attn"]},
            {},
            {"transformer.h.0.attn.c_attn": "column"},
            "decoder layers are at transformer.h",
        ),
        (
            {"target_modules": ["o_proj"]},
            QKV,
            {**LLAMA_LINEARS, "model.layers.1.self_attn.o_proj": "replicate"},
            "at TP=2 SGLang shards LoRA weights of o_proj row-parallel, and SomeForCausalLM keeps it replicate/row",
        ),
    ],
)
def test_unreachable_adapter_is_refused_with_the_reason(config, packed, linears, reason):
    served = lora.served_after_fusion(linears, packed)
    with pytest.raises(LoRAAdapterRefused, match=reason):
        lora.check_adapter("bad", config, served, "SomeForCausalLM", max_rank=8, tp_size=2)


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


def test_native_stacked_parameter_table_gives_the_packing():
    model = nn.Module()
    model.bitsandbytes_stacked_params_mapping = {
        ".k_proj": (".qkv_proj", 1),
        ".q_proj": (".qkv_proj", 0),
        ".v_proj": (".qkv_proj", 2),
    }
    assert lora.packed_parts(model) == QKV


def test_unfused_projections_refused_before_start(checkpoint, adapters, monkeypatch):
    monkeypatch.setenv("SGLANG_HF_BACKEND_DISABLE_FUSIONS", "qkv")
    with pytest.raises(LoRAAdapterRefused, match="'(q|v)_proj'.*fused qkv_proj.*serves (q|v)_proj unfused"):
        start(checkpoint("llama"), {"attention": adapters("llama")["attention"]})


def test_rank_above_the_limit_refused_before_start(checkpoint, adapters):
    with pytest.raises(LoRAAdapterRefused, match="rank 8, above --max-lora-rank 4"):
        start(checkpoint("llama"), {"mlp": adapters("llama")["mlp"]}, max_lora_rank=4)


def test_gpt2_layers_refused_before_start(checkpoint, tmp_path):
    adapter = build_adapter(checkpoint("gpt2"), tmp_path / "gpt2", ["c_attn"])
    assert json.loads((adapter / "adapter_config.json").read_text())["target_modules"] == ["c_attn"]
    with pytest.raises(LoRAAdapterRefused, match="targets 'c_attn'.*decoder layers are at transformer.h"):
        start(checkpoint("gpt2"), {"a": adapter})


def start(path, adapters: dict, **options):
    paths = {name: str(adapter) for name, adapter in adapters.items()}
    sgl.Engine(model_path=str(path), impl="transformers", enable_lora=True, lora_paths=paths, **options)
