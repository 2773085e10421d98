"""A tiny model analysed on meta tensors, as each scheduler would, for engine-free tests."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoConfig

from sglang_hf_backend.attention import register_attention_function
from sglang_hf_backend.models.analysis import Analysis, analyse


def analyse_checkpoint(
    path: Path,
    trust_remote_code: bool = False,
    tp_size: int = 1,
    task: str = "causal",
    multimodal: bool = False,
) -> Analysis:
    register_attention_function()
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    return analyse(config, trust_remote_code, tp_size, task, multimodal)


def class_named(analysis: Analysis, name: str) -> type:
    return next(cls for cls in analysis.trace.classes if cls.__name__ == name)


def first_instance(analysis: Analysis, class_name: str):
    """(qualified name, module) of the first instance of a traced class."""
    return analysis.trace.class_instances[class_named(analysis, class_name)][0]


def matches(analysis: Analysis, fuser: str) -> dict:
    """{module class name: match} of one fuser."""
    return {m.module_class.__name__: m for m in analysis.fusions.matches_of(fuser)}
