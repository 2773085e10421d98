"""The CPU backend's masks: causal, sliding, and image spans that attend both ways."""

from __future__ import annotations

import torch

from sglang_hf_backend.cpu_attention import BatchLayout


def prefill_layout(lengths: list[int]) -> BatchLayout:
    """Two fresh prefills (no cached prefix), padded to the longest."""
    width = max(lengths)
    q_pos = torch.arange(width).repeat(len(lengths), 1)
    q_valid = q_pos < torch.tensor(lengths)[:, None]
    return BatchLayout(
        kv_index=torch.zeros(len(lengths), width, dtype=torch.long),
        kv_pos=torch.arange(width),
        kv_len=torch.tensor(lengths),
        q_pos=q_pos,
        q_valid=q_valid,
        q_rows=None,
    )


def test_a_span_attends_to_itself_both_ways_and_the_rest_stays_causal():
    layout = prefill_layout([6, 4])
    layout.within_spans([[(1, 3)], []])
    allowed = layout.mask(causal=True, window=-1)[:, 0]
    expected = torch.tril(torch.ones(6, 6, dtype=torch.bool))
    expected[1:4, 1:4] = True
    assert torch.equal(allowed[0], expected)
    assert torch.equal(allowed[1, :4, :4], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_a_sliding_window_still_bounds_how_far_back_a_span_token_sees():
    layout = prefill_layout([6])
    layout.within_spans([[(2, 5)]])
    allowed = layout.mask(causal=True, window=1)[0, 0]
    assert allowed[2].tolist() == [False, True, True, True, True, True]  # back 1, forward to the span's end
    assert allowed[5].tolist() == [False, False, False, False, True, True]
