"""Engine-free fixtures: tiny models analysed on meta tensors."""

from __future__ import annotations

import pytest

from sglang_hf_backend.models.analysis import Analysis
from sglang_hf_backend.testing.analysis import analyse_checkpoint
from sglang_hf_backend.testing.vision_language import VISION_LANGUAGE_MODELS


@pytest.fixture(scope="session")
def analysis(checkpoint):
    """``analysis(name, tp_size=1, task="causal")`` -> that tiny checkpoint's Analysis (cached)."""
    cache: dict[tuple[str, int, str], Analysis] = {}

    def get(name: str, tp_size: int = 1, task: str = "causal") -> Analysis:
        if (name, tp_size, task) not in cache:
            path = checkpoint(name)
            multimodal = name in VISION_LANGUAGE_MODELS
            cache[name, tp_size, task] = analyse_checkpoint(
                path, name.startswith("remote"), tp_size, task, multimodal
            )
        return cache[name, tp_size, task]

    return get


@pytest.fixture(scope="session")
def narrower_capability() -> str:
    """The next narrower CPU capability torch can dispatch to here (``ATEN_CPU_CAPABILITY``):
    AVX2, the AVX2-only EPYC's, where this CPU has AVX512; else ATen's generic vectors."""
    import torch

    return "AVX2" if torch.backends.cpu.get_cpu_capability() == "AVX512" else "DEFAULT"
