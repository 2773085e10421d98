"""TransformersForCausalLM end to end: real engines on tiny checkpoints vs HF ``generate``.

For each architecture: greedy fp32 output equals HF token for token, batched and one
prompt at a time; the engine is served by our class (read from the rank's load report,
not inferred); and where SGLang has a native class, the native engine gives the same tokens.
"""

from __future__ import annotations

import pytest

from sglang_hf_backend.testing.engines import engine_case

OURS = "sglang_hf_backend.models.TransformersForCausalLM"
# architecture -> does SGLang 0.5.23 have a native class for it (on transformers 5.19)?
ARCHITECTURES = {
    "llama": True,
    "llama-tied": True,  # tied input/output embeddings
    "qwen2": True,  # q/k/v biases
    "qwen3": True,  # per-head q/k norms
    "mistral": True,
    "granite": True,  # embedding/residual/attention multipliers, logits scaling
    "gpt_neox": False,  # packed per-head qkv, partial rotary, parallel residual
    "olmo2": True,  # q/k norms over all heads
    "gemma2": True,  # attention and final soft-caps, sliding window on half the layers
    "remote": False,  # trust_remote_code TinyLM, attention through the interface
    "phi3": True,  # packed qkv and gate/up projections
    "gpt2": True,  # Conv1D projections, learned positions, no TP plan
    "llama-mqa": True,  # 4 query heads sharing 1 KV head
    "opt": True,  # its LM head calls self.model.decoder(...)
}
NATIVE = [name for name, native in ARCHITECTURES.items() if native]


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def case(request, checkpoint):
    return engine_case(checkpoint, request.param)


def test_served_by_our_class(case):
    assert [r["model_class"] for r in case.reports] == [OURS]


def test_batched_matches_hf(case):
    assert case.batched == case.reference


def test_one_at_a_time_matches_hf(case):
    assert case.one_at_a_time == case.reference


@pytest.mark.parametrize("case", NATIVE, indirect=True)
def test_matches_native(case, checkpoint):
    native = engine_case(checkpoint, case.name, impl="sglang")
    assert native.reports == []  # SGLang's own class served it, not ours
    assert native.batched == case.batched
    assert native.one_at_a_time == case.one_at_a_time
