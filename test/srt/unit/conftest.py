"""Engine-free fixtures: tiny models analysed on meta tensors."""

from __future__ import annotations

import pytest

from sglang_hf_backend.models.analysis import Analysis
from sglang_hf_backend.testing.analysis import analyse_checkpoint


@pytest.fixture(scope="session")
def analysis(checkpoint):
    """``analysis(name, tp_size=1)`` -> the Analysis of that tiny checkpoint (cached per session)."""
    cache: dict[tuple[str, int], Analysis] = {}

    def get(name: str, tp_size: int = 1) -> Analysis:
        if (name, tp_size) not in cache:
            cache[name, tp_size] = analyse_checkpoint(checkpoint(name), name.startswith("remote"), tp_size)
        return cache[name, tp_size]

    return get
