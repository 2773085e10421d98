"""What the multimodal mixin reads off an HF vision-language class, on meta models."""

from __future__ import annotations

import pytest
import torch

from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.models.analysis import check_pipeline_split, preflight
from sglang_hf_backend.models.multimodal import _mask_kind, feature_rows, image_tokens_attend_both_ways

LANGUAGE_MODELS = {"llava": "LlamaModel", "qwen2_vl": "Qwen2VLTextModel", "gemma3": "Gemma3TextModel"}


@pytest.mark.parametrize("name", list(LANGUAGE_MODELS))
def test_the_backbone_is_the_language_model(analysis, name):
    found = analysis(name)
    assert found.backbone_path == "model.language_model"
    assert type(found.backbone).__name__ == LANGUAGE_MODELS[name]
    assert sum("Attention" in cls.__name__ for cls in found.trace.classes) == 1  # the tower is not traced


@pytest.mark.parametrize("name, both_ways", [("llava", False), ("qwen2_vl", False), ("gemma3", True)])
def test_image_tokens_attend_both_ways_only_where_the_class_masks_say_so(analysis, name, both_ways):
    assert image_tokens_attend_both_ways(analysis(name).hf_model) is both_ways


def test_masks_that_are_neither_causal_nor_image_spans_are_not_recognised():
    types = torch.tensor([0, 1, 1, 0])
    everything = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    causal = torch.tril(everything)
    spans = causal.clone()
    spans[0, 0, 1, 2] = True
    assert _mask_kind("full_attention", causal, types, 4) == "causal"
    assert _mask_kind("full_attention", spans, types, 4) == "spans"
    assert _mask_kind("full_attention", everything, types, 4) is None


def test_image_features_become_one_row_per_image_token():
    per_image = (torch.ones(2, 3, 8), torch.zeros(5, 8))  # one tensor per image, as Qwen2-VL returns
    assert feature_rows(per_image).shape == (11, 8)
    assert feature_rows(torch.ones(2, 4, 8)).shape == (8, 8)


def test_pipeline_stages_are_refused_for_multimodal_models(analysis):
    with pytest.raises(IncompatibleModelError, match="pipeline parallelism serves text causal LMs"):
        check_pipeline_split(analysis("llava"), "TransformersMultiModalForCausalLM", "causal", 2)


def test_image_spans_on_a_backend_that_attends_causally_are_refused_before_start(checkpoint):
    path = str(checkpoint("gemma3"))
    with pytest.raises(IncompatibleModelError, match="attend to each other in both directions.*torch_native"):
        preflight(path, False, attention_backend="torch_native")
    preflight(path, False, attention_backend="cpu_sdpa")
    preflight(str(checkpoint("llava")), False, attention_backend="torch_native")  # causal: any backend
