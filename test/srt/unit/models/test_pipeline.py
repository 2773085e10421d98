"""Pipeline stages on meta models: where the stack is, why a model cannot be cut, what a stage holds."""

from __future__ import annotations

import pytest
import torch

from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.models.pipeline import SkippedLayer, ZeroEmbedding, decoder_stack, split_backbone
from sglang_hf_backend.testing.analysis import analyse_checkpoint


@pytest.mark.parametrize(
    "model, path, source, after",
    [
        ("llama", "layers", "the model's pp plan", ("norm",)),
        ("gpt2", "h", "inferred from the trace", ("ln_f",)),
        ("remote", "blocks", "inferred from the trace", ("norm",)),
    ],
)
def test_decoder_stack_from_the_plan_or_the_trace(analysis, model, path, source, after):
    found = analysis(model)
    stack = decoder_stack(found.backbone, found.trace)
    assert (stack.path, stack.num_layers, stack.source, stack.returns_tensor) == (path, 2, source, True)
    assert stack.after == after


def test_layers_read_across_the_stack_are_refused(analysis):
    found = analysis("remote-mixed")
    with pytest.raises(IncompatibleModelError, match="cannot be split.*layer 0's output is also read by"):
        decoder_stack(found.backbone, found.trace)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_stage_holds_its_layers_and_its_end_of_the_model(checkpoint, rank):
    found = analyse_checkpoint(checkpoint("gpt2"))  # its own copy: the split rewrites the model
    backbone = found.backbone
    stage = split_backbone(backbone, "transformer", decoder_stack(backbone, found.trace), rank, 2)
    assert (stage.start, stage.end, stage.is_first, stage.is_last) == (rank, rank + 1, rank == 0, rank == 1)
    other = 1 - rank
    assert isinstance(backbone.h[other], SkippedLayer) and not isinstance(backbone.h[rank], SkippedLayer)
    assert stage.holds_elsewhere(f"transformer.h.{other}.attn.c_attn.weight")
    assert not stage.holds_elsewhere(f"transformer.h.{rank}.attn.c_attn.weight")
    embeddings_elsewhere = {"transformer.wte", "transformer.wpe"} <= set(stage.held_elsewhere)
    assert embeddings_elsewhere == (rank == 1) and isinstance(backbone.wpe, ZeroEmbedding) == (rank == 1)
    assert stage.holds_elsewhere("transformer.ln_f.weight") == (rank == 0)
    assert (stage.entry is backbone.h[0]) == (rank == 1) and (stage.exit is backbone.h[1]) == (rank == 0)


def test_skipped_layers_hand_in_and_keep_hidden_states():
    entry, exit_, passing = SkippedLayer(0, True), SkippedLayer(2, False), SkippedLayer(3, True)
    exit_.keeps = True
    received, computed = torch.ones(1, 3, 4), torch.zeros(1, 3, 4)
    entry.received = received
    assert entry(computed, None, position_ids=torch.arange(3)) is received
    assert entry(computed) is computed  # the received tensor is used once
    assert exit_(hidden_states=computed) == (computed,) and exit_.kept is computed
    assert passing(computed) is computed and passing.kept is None
    assert ZeroEmbedding(4)(torch.zeros(2, 3, dtype=torch.long)).shape == (2, 3, 4)
