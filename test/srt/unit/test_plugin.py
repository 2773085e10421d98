"""Plugin wiring: entry point, model classes in SGLang's registry, the attention function."""

from __future__ import annotations

import importlib.metadata

from transformers import AttentionInterface

from sglang_hf_backend import plugin
from sglang_hf_backend.attention import ATTENTION_NAME, hf_attention_forward
from sglang_hf_backend.models import TransformersForCausalLM


def test_registered_as_sglang_general_plugin():
    names = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="sglang.srt.plugins")}
    assert names["sglang_hf_backend"] == "sglang_hf_backend.plugin:register"


def test_our_classes_replace_the_builtin_backend_in_the_registry():
    plugin.register()
    from sglang.srt.models.registry import ModelRegistry

    cls, arch = ModelRegistry.resolve_model_cls(["TransformersForCausalLM"])
    assert cls is TransformersForCausalLM and arch == "TransformersForCausalLM"


def test_attention_function_registered_under_our_name():
    plugin.register()
    assert AttentionInterface()[ATTENTION_NAME] is hf_attention_forward
    assert ATTENTION_NAME != "sglang"  # SGLang's built-in backend keeps its own entry


def test_cpu_attention_backend_is_a_choice():
    plugin.register()
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    assert "cpu_sdpa" in ATTENTION_BACKEND_CHOICES
    assert "cpu_sdpa" in ATTENTION_BACKENDS
