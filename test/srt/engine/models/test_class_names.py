"""The twelve class names SGLang's transformers backend resolves to, and what happens for each.

SGLang builds ``"Transformers" + ["MultiModal"] + ["MoE"] + (ForCausalLM | EmbeddingModel |
ForSequenceClassification)``. The six text names are served by our classes (SGLang's own
resolution is checked for each checkpoint, then the engine's load report names the class,
and outputs are compared with HF); a vision-language checkpoint resolves to ``TransformersMultiModalForCausalLM``, served
by ours (``test_multimodal.py`` covers it in depth), and with ``is_embedding`` to
``TransformersMultiModal(MoE)EmbeddingModel``, whose image + text embeddings match HF's; the
two multimodal classifier names are refused before anything is built.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import AutoConfig

from sglang_hf_backend import compat, plugin
from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.models import ENTRY_CLASSES
from sglang_hf_backend.testing.engines import (
    PROMPTS,
    encode_case,
    engine_case,
    hf_classifier_logits,
    running_engine,
    sentence_transformers_embeddings,
)
from sglang_hf_backend.testing.vision_language import (
    IMAGE_PROMPTS,
    hf_image_last_token_embeddings,
    vision_case,
)

NAMES = [
    f"Transformers{mm}{moe}{base}"
    for mm, moe, base in itertools.product(
        ("", "MultiModal"), ("", "MoE"), ("ForCausalLM", "EmbeddingModel", "ForSequenceClassification")
    )
]


def hf_last_token_embeddings(path) -> torch.Tensor:
    """A decoder with no sentence-transformers files pools its last token, normalised."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(path)
    with torch.no_grad():
        last = [model(**tokenizer(p, return_tensors="pt")).last_hidden_state[0, -1] for p in PROMPTS]
    return torch.nn.functional.normalize(torch.stack(last), dim=-1)


# text class name -> (checkpoint, engine arguments, reference for Engine.encode; None: generate)
SERVED = {
    "TransformersForCausalLM": ("llama", {}, None),
    "TransformersMoEForCausalLM": ("qwen3_moe", {}, None),
    "TransformersEmbeddingModel": ("bert-embedding", {}, sentence_transformers_embeddings),
    "TransformersMoEEmbeddingModel": ("qwen3_moe", {"is_embedding": True}, hf_last_token_embeddings),
    "TransformersForSequenceClassification": ("qwen3-classifier", {}, hf_classifier_logits),
    "TransformersMoEForSequenceClassification": (
        "qwen3_moe-classifier",
        {"is_embedding": True},
        hf_classifier_logits,
    ),
}


def test_every_name_is_ours_in_sglangs_registry():
    plugin.register()
    from sglang.srt.models.registry import ModelRegistry

    assert sorted(cls.__name__ for cls in ENTRY_CLASSES) == sorted(NAMES)
    for name in NAMES:
        cls, _ = ModelRegistry.resolve_model_cls([name])
        assert cls.__module__ == "sglang_hf_backend.models"


@pytest.mark.parametrize("name", list(SERVED))
def test_text_names_are_served_by_our_class(checkpoint, name):
    model, options, reference = SERVED[name]
    path = checkpoint(model)
    assert compat.sglang_backend_class(str(path), False, None, options.get("is_embedding", False)) == name
    if reference is None:
        case = engine_case(checkpoint, model, **options)
        assert case.batched == case.reference
    else:
        case = encode_case(checkpoint, model, **options)
        assert (case.outputs - reference(path)).abs().max() <= 1e-4
    assert {r["model_class"] for r in case.reports} == {f"sglang_hf_backend.models.{name}"}


def test_vision_language_checkpoint_is_served_by_our_multimodal_class(checkpoint, test_images):
    name = "TransformersMultiModalForCausalLM"
    assert compat.sglang_backend_class(str(checkpoint("llava")), False, None, False) == name
    case = vision_case(checkpoint, test_images, "llava")
    assert {r["model_class"] for r in case.reports} == {f"sglang_hf_backend.models.{name}"}
    assert case.batched == case.reference


@pytest.mark.parametrize(
    "model, name",
    [
        ("llava", "TransformersMultiModalEmbeddingModel"),
        ("llava-mixtral", "TransformersMultiModalMoEEmbeddingModel"),
    ],
)
def test_vision_language_embeddings_are_served_by_our_multimodal_embedding_classes(
    checkpoint, test_images, model, name
):
    path = checkpoint(model)
    assert compat.sglang_backend_class(str(path), False, None, True) == name
    texts = [prompt.render(model) for prompt in IMAGE_PROMPTS]
    pictures = [str(test_images[prompt.image]) if prompt.image else None for prompt in IMAGE_PROMPTS]
    with running_engine(path, impl="transformers", is_embedding=True) as engine:
        encoded = engine.engine.encode(prompt=texts, image_data=pictures)
        reports = engine.load_reports()
    assert {r["model_class"] for r in reports} == {f"sglang_hf_backend.models.{name}"}
    ours = torch.tensor([o["embedding"] for o in encoded])
    assert (ours - hf_image_last_token_embeddings(path, model, test_images)).abs().max() <= 1e-4


@pytest.mark.parametrize("name", [n for n in NAMES if "MultiModal" in n and "Classification" in n])
def test_multimodal_classifiers_are_refused_before_building_anything(checkpoint, name):
    """The resolution the launching process's preflight runs for the class name SGLang picked."""
    config = AutoConfig.from_pretrained(checkpoint("llava"))
    task, multimodal = compat.backend_task(name), compat.is_multimodal_class(name)
    with pytest.raises(IncompatibleModelError, match="classifying images with text is not served yet"):
        compat.resolve_hf_class(config, False, task, multimodal)
