"""Residual add + norm -> the fused form, which needs the norm fuser's SGLang norms."""

from __future__ import annotations

from sglang_hf_backend.surgery.fusers import DISABLE_ENV, all_fusers
from sglang_hf_backend.testing.analysis import analyse_checkpoint, matches


def test_matches_the_add_then_norm_statements(analysis):
    match = matches(analysis("llama"), "residual")["LlamaDecoderLayer"]
    assert match.norms == ("post_attention_layernorm",)
    assert match.description == "residual add + post_attention_layernorm -> fused add-norm"


def test_runs_after_the_fuser_it_builds_on():
    names = [fuser.name for fuser in all_fusers()]
    assert names.index("norm") < names.index("residual")


def test_skipped_with_a_note_when_its_requirement_is_off(checkpoint, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "norm")
    plan = analyse_checkpoint(checkpoint("llama")).fusions
    assert plan.matches_of("residual") == []
    assert "fusion residual skipped: it builds on norm" in plan.notes
    assert "fusion switched off: norm" in plan.notes
