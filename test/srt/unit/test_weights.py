"""Checkpoint names into parameters: transformers' conversion mapping, pieces, strict coverage."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from sglang_hf_backend.weights import (
    CheckpointMismatchError,
    CheckpointNames,
    Piece,
    WeightLoader,
    check_all_loaded,
)


def test_per_expert_tensors_are_pieces_of_the_stacked_parameter(analysis):
    names = CheckpointNames.of(analysis("mixtral").hf_model)
    assert names.resolve("model.layers.1.block_sparse_moe.experts.2.w3.weight") == (
        "model.layers.1.mlp.experts.gate_up_proj",
        Piece(index=2, part=1, parts=2, part_dim=0),
    )
    assert names.resolve("model.layers.1.block_sparse_moe.experts.3.w2.weight") == (
        "model.layers.1.mlp.experts.down_proj",
        Piece(index=3, part=0, parts=1, part_dim=0),
    )
    assert names.resolve("model.layers.1.mlp.gate.weight") == ("model.layers.1.mlp.gate.weight", None)


def test_a_piece_is_a_slice():
    stacked = torch.arange(2 * 6 * 2).reshape(2, 6, 2)
    assert torch.equal(Piece(index=1, part=1, parts=2).of(stacked), stacked[1, 3:])


class _Bank(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.zeros(2, 6, 4), requires_grad=False)
        self.down = nn.Linear(4, 4)


def _loader(model: nn.Module) -> WeightLoader:
    return WeightLoader(model, CheckpointNames([], [], [], "model"), routes={}, tied=set())


def test_pieces_load_into_plain_parameters_slice_by_slice():
    # an expert bank left to HF code (moe fusion off) still loads a per-expert checkpoint
    bank = _Bank()
    loader = _loader(bank)
    up = torch.full((3, 4), 7.0)
    loader._load_one(next(iter(loader.route("gate_up_proj").loads(up, Piece(index=1, part=1, parts=2)))))
    assert torch.equal(bank.gate_up_proj[1, 3:], up)
    assert bank.gate_up_proj[0].abs().sum() == 0 and bank.gate_up_proj[1, :3].abs().sum() == 0


def test_unexpected_and_missing_tensors_are_named():
    loader = _loader(_Bank())
    with pytest.raises(
        CheckpointMismatchError, match=r"match no parameter of the model: \['lm_head.weight'\]"
    ):
        loader.load([("lm_head.weight", torch.zeros(4, 4))])
    loaded = _loader(_Bank()).load([("down.weight", torch.zeros(4, 4))])
    with pytest.raises(CheckpointMismatchError, match=r"missing from the checkpoint: \['down.bias'\]"):
        check_all_loaded(loaded, {"down.weight", "down.bias"}, tied=set())


def test_shape_mismatch_is_an_error():
    with pytest.raises(
        CheckpointMismatchError, match=r"shape \(5, 4\) does not fit a parameter of shape \(4, 4\)"
    ):
        _loader(_Bank()).load([("down.weight", torch.zeros(5, 4))])
