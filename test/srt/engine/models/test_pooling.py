"""Embedding, classification and reward models through our classes, vs the references users use.

Embeddings are compared with sentence-transformers on the same checkpoint (its
modules.json says how to pool and whether to normalise): a decoder embedder in the
Qwen3-Embedding layout (last token, Matryoshka dimensions) and a BERT encoder (mean
pooling, bidirectional attention on RadixAttention). Classifier logits are compared with
HF ``AutoModelForSequenceClassification``: a decoder classifier with labels, a RoBERTa
classifier (positions from padding_idx + 1, a head on the first token) and a Llama reward
model (one score). Every model at TP=1, prompts of different lengths batched; at TP=2 one
model per kind of backbone and head (a decoder embedder, a decoder classifier, an encoder
classifier): pooling and heads run on the gathered hidden states, so the other two repeat
what these show.
"""

from __future__ import annotations

import pytest
import torch

from sglang_hf_backend.testing.engines import (
    PROMPTS,
    SHORT_DIMENSIONS,
    encode_case,
    hf_classifier_logits,
    running_engine,
    sentence_transformers_embeddings,
)

# name -> (our class, engine arguments besides tp_size)
MODELS = {
    "qwen3-embedding": ("TransformersEmbeddingModel", {"matryoshka": True}),  # Qwen3Model: pooled by default
    "bert-embedding": ("TransformersEmbeddingModel", {}),
    "qwen3-classifier": ("TransformersForSequenceClassification", {}),
    "roberta-classifier": ("TransformersForSequenceClassification", {"is_embedding": True}),
    "llama-reward": ("TransformersForSequenceClassification", {}),
}
EMBEDDERS = {"qwen3-embedding", "bert-embedding"}
SHARDED = ["qwen3-embedding", "qwen3-classifier", "roberta-classifier"]  # also served at TP=2


@pytest.fixture(
    scope="module", params=[(name, 1) for name in MODELS] + [(name, 2) for name in SHARDED], ids=str
)
def case(request, checkpoint):
    name, tp_size = request.param
    return encode_case(checkpoint, name, tp_size=tp_size, **MODELS[name][1])


def test_served_by_our_class(case):
    expected = f"sglang_hf_backend.models.{MODELS[case.name][0]}"
    assert {r["model_class"] for r in case.reports} == {expected}


def test_outputs_match_the_reference(case):
    if case.name in EMBEDDERS:
        reference = sentence_transformers_embeddings(case.path)
        cosine = torch.nn.functional.cosine_similarity(case.outputs, reference)
        assert cosine.min() >= 0.99999, cosine
    else:
        reference = hf_classifier_logits(case.path)
    difference = (case.outputs - reference).abs().max().item()
    print(f"{case.name} on {len(case.reports)} rank(s): max abs diff {difference:.2e}")
    assert case.outputs.shape == reference.shape
    assert difference <= 1e-4


@pytest.mark.parametrize("tp_size", [1, 2])
def test_matryoshka_dimensions_truncate_then_normalise(checkpoint, tp_size):
    case = encode_case(checkpoint, "qwen3-embedding", tp_size=tp_size, **MODELS["qwen3-embedding"][1])
    full = sentence_transformers_embeddings(case.path)
    expected = torch.nn.functional.normalize(full[:, :SHORT_DIMENSIONS], dim=-1)
    assert case.shortened.shape == (len(PROMPTS), SHORT_DIMENSIONS)
    assert (case.shortened - expected).abs().max() <= 1e-4


@pytest.mark.parametrize("name", ["bert-embedding", "roberta-classifier"])
def test_a_cached_prefix_never_changes_the_output(checkpoint, name):
    """Bidirectional attention and mean pooling need every prompt token: no radix-cache reuse."""
    options = MODELS[name][1]
    expected = encode_case(checkpoint, name, **options).outputs
    with running_engine(checkpoint(name), impl="transformers", is_embedding=True) as engine:
        engine.engine.encode([PROMPTS[3][:20]])  # shares a prefix with the last prompt
        again = torch.tensor([o["embedding"] for o in engine.engine.encode(PROMPTS)])
    assert (again - expected).abs().max() <= 1e-6


def test_torchao_quantizes_an_embedder(checkpoint):
    """int8 weight-only on every linear of each rank; the vectors stay close to the fp32 reference."""
    case = encode_case(checkpoint, "qwen3-embedding", torchao_config="int8wo")
    (report,) = case.reports
    assert report["quantized_weight_types"] == ["Int8Tensor"]
    assert report["quantized_linears"] == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    reference = sentence_transformers_embeddings(case.path)
    cosine = torch.nn.functional.cosine_similarity(case.outputs, reference)
    print(f"int8wo embeddings vs fp32 sentence-transformers: min cosine {cosine.min():.5f}")
    assert cosine.min() >= 0.99
