"""TransformersMultiModalForCausalLM: images through the HF vision tower, text through our wrapper.

Three transformers 5.19 families at fp32, token for token with HF ``generate`` on the same
images and prompts, batched (two different images and a text-only prompt) and one at a time:
LLaVA (1-D positions), Qwen2-VL (M-RoPE) and Gemma3 (an image's tokens attend to each other
both ways; its tiny checkpoint answers differently when they do not). Qwen2-VL runs at TP=2
as well: the tower is replicated on every rank and the language model is sharded as any
causal LM is (``test_tensor_parallel``), which is the same for the three families. The radix
cache stays on: the same image again reuses the cached prompt, a different image shares
only the text before it (and gets its own answer).
"""

from __future__ import annotations

import pytest

from sglang_hf_backend.testing.vision_language import VISION_LANGUAGE_MODELS, vision_case

OURS = "sglang_hf_backend.models.TransformersMultiModalForCausalLM"
OURS_MOE = "sglang_hf_backend.models.TransformersMultiModalMoEForCausalLM"
MOE = "llava-mixtral"
CASES = [(name, 1) for name in VISION_LANGUAGE_MODELS] + [("qwen2_vl", 2)]


@pytest.fixture(scope="module", params=CASES, ids=str)
def case(request, checkpoint, test_images):
    name, tp_size = request.param
    return vision_case(checkpoint, test_images, name, tp_size=tp_size)


def test_served_by_our_multimodal_class_with_a_fused_language_model(case):
    assert {r["model_class"] for r in case.reports} == {OURS_MOE if case.name == MOE else OURS}
    assert any("qkv_proj" in line for line in case.reports[0]["fusions"]), case.reports[0]["fusions"]
    assert all(r["tower_weight_bytes"] > 0 for r in case.reports)  # replicated on every rank


def test_batched_matches_hf(case):
    assert case.batched == case.reference


def test_one_at_a_time_matches_hf(case):
    assert case.one_at_a_time == case.reference


def test_same_image_again_reuses_the_cached_prompt(case):
    assert case.repeated["output_ids"] == case.reference[0]
    assert case.repeated["cached_tokens"] > case.tokens_before_image + 1


def test_different_image_shares_only_the_text_before_it(case):
    assert case.other_image["cached_tokens"] <= case.tokens_before_image
    assert case.other_image["output_ids"] == case.other_image_reference


def test_torchao_quantizes_the_language_model_and_keeps_the_tower(checkpoint, test_images):
    plain = vision_case(checkpoint, test_images, "llava")
    quantized = vision_case(checkpoint, test_images, "llava", torchao_config="int8wo")
    (report,) = quantized.reports
    assert report["quantized_linears"] == 2 * 4  # qkv, o, gate_up, down in each of 2 layers
    assert report["quantized_weight_types"] == ["Int8Tensor"]
    assert report["tower_weight_bytes"] == plain.reports[0]["tower_weight_bytes"]  # full precision
    assert quantized.batched == quantized.one_at_a_time
