"""``SGLANG_HF_BACKEND_DISABLE_FUSIONS``: each fusion switches off alone, and says so.

The engines in test/srt/engine/surgery/test_fusers.py show the tokens stay HF's with every
fusion on and with all off; each fusion replaces its own modules only, so one switched off
leaves the others' plan as it was, but for fusions that build on it (``Fuser.requires``).
"""

from __future__ import annotations

import pytest

from sglang_hf_backend.surgery.fusers import DISABLE_ENV, all_fusers
from sglang_hf_backend.testing.analysis import analyse_checkpoint

LLAMA_FUSIONS = ["qkv", "mlp", "norm", "residual"]


@pytest.mark.parametrize("fusion", LLAMA_FUSIONS)
def test_each_fusion_switches_off_alone(checkpoint, monkeypatch, fusion):
    monkeypatch.setenv(DISABLE_ENV, fusion)
    plan = analyse_checkpoint(checkpoint("llama")).fusions
    assert f"fusion switched off: {fusion}" in plan.notes
    assert plan.matches_of(fusion) == []
    lost = {fusion} | {fuser.name for fuser in all_fusers() if fusion in fuser.requires}
    for other in set(LLAMA_FUSIONS) - lost:
        assert plan.matches_of(other), f"{other} should still fuse with {fusion} switched off"
