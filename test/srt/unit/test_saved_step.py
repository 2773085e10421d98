"""Compiled steps saved on disk: traced once, loaded by the next start, never trusted blindly.

A tiny HF Llama backbone (no engine) goes through ``compilation.first_step`` with an empty
inductor cache: the first call traces one graph and saves it, the second loads it; both give
eager's hidden states for any token count, with the decoder layers compiled once as a shared
region. Inputs the saved guards reject (embeddings instead of token ids) are traced by a
fallback step rather than failing; a backbone whose trace breaks (inside its layers) leaves a
note, so the next start does not try again, and is traced layer by layer; another backbone
gets another file.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaModel

from sglang_hf_backend import compilation
from sglang_hf_backend.saved_step import SavedStep
from sglang_hf_backend.testing.tiny_backbones import eager, tiny_llama, token_inputs


class BreakingMLP(torch.nn.Module):
    """An MLP whose forward dynamo cannot trace as one graph (as SGLang's all-reduce at TP > 1)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        torch._dynamo.graph_break()
        return self.inner(x)


def breaking_llama() -> LlamaModel:
    backbone = tiny_llama()
    for layer in backbone.layers:
        layer.mlp = BreakingMLP(layer.mlp)
    return backbone


def layer_regions(backbone: LlamaModel) -> compilation.LayerRegions:
    return compilation.LayerRegions(backbone, [layer.self_attn for layer in backbone.layers])


@pytest.fixture
def empty_inductor_cache(tmp_path, monkeypatch):
    """An empty cache and fresh dynamo state, in a process placed as rank 0 (no engine here)."""
    from sglang.srt.runtime_context import get_parallel

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    with get_parallel().override(tp_rank=0, pp_rank=0, dp_rank=0):
        yield tmp_path
    torch._dynamo.reset()


@torch.no_grad()
def test_step_is_traced_saved_loaded_and_refits_other_inputs(empty_inductor_cache):
    backbone = tiny_llama()
    regions = layer_regions(backbone)
    first = compilation.first_step(backbone, token_inputs(7), regions)
    assert first.source == "traced"
    assert SavedStep(backbone).path.exists()
    second = compilation.first_step(backbone, token_inputs(7), regions)
    assert second.source == "loaded"
    for tokens in (7, 1, 12):
        inputs = token_inputs(tokens)
        expected = eager(backbone, **inputs)
        torch.testing.assert_close(first(backbone, **inputs), expected)
        torch.testing.assert_close(second(backbone, **inputs), expected)
    assert second.others is None
    inputs = token_inputs(5)
    embedded = {
        "inputs_embeds": backbone.embed_tokens(inputs["input_ids"]),
        "position_ids": inputs["position_ids"],
    }
    torch.testing.assert_close(second(backbone, **embedded), eager(backbone, **embedded))
    assert second.others is not None


def test_another_backbone_gets_another_file(empty_inductor_cache):
    assert SavedStep(tiny_llama(layers=2)).path != SavedStep(tiny_llama(layers=3)).path
    assert SavedStep(tiny_llama()).path == SavedStep(tiny_llama()).path


@torch.no_grad()
def test_a_breaking_trace_is_noted_and_not_retried(empty_inductor_cache, monkeypatch):
    """The break is inside the layers, which the recompiling path must trace one by one."""
    backbone = breaking_llama()
    layer_class = type(backbone.layers[0])
    inputs = token_inputs(6)
    first = compilation.first_step(backbone, inputs, layer_regions(backbone))
    assert isinstance(first, compilation.RecompilingStep)
    assert type(backbone.layers[0]) is layer_class
    assert "graph_break" in SavedStep(backbone).why_unsaveable()
    torch.testing.assert_close(first(backbone, **inputs), eager(backbone, **inputs))

    def refuse(*args):
        raise AssertionError("traced whole again despite the note")

    monkeypatch.setattr(compilation, "trace_whole", refuse)
    assert isinstance(compilation.first_step(backbone, inputs), compilation.RecompilingStep)
