"""Compiled steps saved on disk: traced once, loaded by the next start, never trusted blindly.

A tiny HF Llama backbone (no engine) goes through ``compilation.first_step`` with an empty
inductor cache: the first call traces one graph and saves it, the second loads it; both give
eager's hidden states for any token count. Inputs the saved guards reject (embeddings instead
of token ids) are traced by a fallback step rather than failing; a backbone whose trace breaks
leaves a note, so the next start does not try again; another backbone gets another file.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import AttentionInterface, LlamaConfig, LlamaModel

from sglang_hf_backend import compilation
from sglang_hf_backend.saved_step import SavedStep


def causal_sdpa(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal attention without HF's SDPA path, whose ``q_length > 1`` branch cannot be
    traced for any token count (served models route attention to RadixAttention instead)."""
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


AttentionInterface.register("test_causal_sdpa", causal_sdpa)


def tiny_llama(layers: int = 2) -> LlamaModel:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="test_causal_sdpa",
    )
    return LlamaModel(config).eval()


def token_inputs(tokens: int) -> dict:
    """As ``CompiledStep`` hands them on (``without_views``)."""
    ids = torch.randint(0, 128, (tokens,), generator=torch.Generator().manual_seed(tokens))
    return compilation.without_views({"input_ids": ids[None], "position_ids": torch.arange(tokens)[None]})


def eager(backbone, **inputs) -> torch.Tensor:
    return backbone(**inputs, use_cache=False).last_hidden_state


class BreakingBackbone(torch.nn.Module):
    """A backbone whose forward dynamo cannot trace as one graph."""

    def __init__(self, inner: LlamaModel):
        super().__init__()
        self.inner = inner

    def forward(self, **inputs):
        torch._dynamo.graph_break()
        return self.inner(**inputs)


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
    first = compilation.first_step(backbone, token_inputs(7))
    assert first.source == "traced"
    assert SavedStep(backbone).path.exists()
    second = compilation.first_step(backbone, token_inputs(7))
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
    backbone = BreakingBackbone(tiny_llama())
    inputs = token_inputs(6)
    first = compilation.first_step(backbone, inputs)
    assert isinstance(first, compilation.RecompilingStep)
    assert "graph_break" in SavedStep(backbone).why_unsaveable()
    torch.testing.assert_close(first(backbone, **inputs), eager(backbone.inner, **inputs))

    def refuse(*args):
        raise AssertionError("traced whole again despite the note")

    monkeypatch.setattr(compilation, "trace_whole", refuse)
    assert isinstance(compilation.first_step(backbone, inputs), compilation.RecompilingStep)
