"""Decisions the wrapper takes from the HF model: where positions start."""

from __future__ import annotations

from sglang_hf_backend.models.base import position_offset


def test_roberta_positions_start_after_the_padding_index(analysis):
    assert position_offset(analysis("roberta-classifier", task="classification").backbone) == 1


def test_other_models_count_from_zero(analysis):
    assert position_offset(analysis("llama").backbone) == 0
    assert position_offset(analysis("bert-embedding", task="embedding").backbone) == 0
