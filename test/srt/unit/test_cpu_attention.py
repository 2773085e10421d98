"""The CPU backend's masks: causal, sliding, image spans that attend both ways, and where SDPA's own
causal mask stands in for them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang_hf_backend.cpu_attention import BatchLayout, grouped_attention, matmul_decode_pays


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
        prefix_free=True,
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


def test_fresh_prefills_use_sdpas_own_causal_mask_where_it_says_the_same():
    layout = prefill_layout([7, 3, 5])
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(3, 6, 7, 16, generator=generator)
    keys, values = torch.randn(2, 3, 2, 7, 16, generator=generator)
    assert layout.plain_causal(causal=True, window=-1)
    masked = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=layout.mask(True, -1), scale=0.25, enable_gqa=True
    )
    plain = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=0.25, enable_gqa=True)
    valid = layout.q_valid
    torch.testing.assert_close(plain.transpose(1, 2)[valid], masked.transpose(1, 2)[valid])
    assert not layout.plain_causal(causal=True, window=2)
    assert not layout.plain_causal(causal=False, window=-1)
    layout.within_spans([[(1, 3)], [], []])
    assert not layout.plain_causal(causal=True, window=-1)
    cached_prefix = prefill_layout([4])
    cached_prefix.prefix_free = False
    assert not cached_prefix.plain_causal(causal=True, window=-1)


def decode_inputs(dtype: torch.dtype, lengths: list[int], heads: int = 6, kv_heads: int = 2, dim: int = 16):
    """One decode step's query, cached K/V ([B, kv_heads, L, dim]) and padding mask."""
    generator = torch.Generator().manual_seed(0)
    batch, width = len(lengths), max(lengths)
    query = torch.randn(batch, heads, 1, dim, generator=generator).to(dtype)
    keys = torch.randn(batch, kv_heads, width, dim, generator=generator).to(dtype)
    values = torch.randn(batch, kv_heads, width, dim, generator=generator).to(dtype)
    mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    return query, keys, values, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_matmul_decode_matches_sdpa(dtype):
    query, keys, values, mask = decode_inputs(dtype, [5, 9, 1])
    expected = F.scaled_dot_product_attention(
        query.float(), keys.float(), values.float(), attn_mask=mask, scale=0.25, enable_gqa=True
    )
    out = grouped_attention(query, keys, values, mask, 0.25, None)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    ("dtype", "amx", "expected"),
    [
        (torch.bfloat16, False, True),
        (torch.float16, False, True),
        (torch.bfloat16, True, False),
        (torch.float32, False, False),
    ],
)
def test_matmul_decode_only_for_half_precision_without_amx(monkeypatch, dtype, amx, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert matmul_decode_pays(dtype) is expected


def prefill_backend(lengths: list[int], dtype: torch.dtype = torch.float32):
    """The backend over a real one-layer KV pool, laid out for a prefill of ``lengths`` (no
    cached prefixes), and a layer of 4 query heads over 2 KV heads of 8."""
    from types import SimpleNamespace

    from sglang.srt.layers.radix_attention import AttentionType
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel

    from sglang_hf_backend.cpu_attention import CpuSdpaAttnBackend

    pool = MHATokenToKVPool(
        64, 1, dtype, head_num=2, head_dim=8, layer_num=1, device="cpu", enable_memory_saver=False
    )
    req_to_token = torch.zeros(len(lengths), 32, dtype=torch.int32)
    slots = iter(range(1, 64))
    for row, length in enumerate(lengths):
        req_to_token[row, :length] = torch.tensor([next(slots) for _ in range(length)])
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token), token_to_kv_pool=pool, dtype=dtype
    )
    with get_parallel().override(tp_rank=0):
        backend = CpuSdpaAttnBackend(runner, "cpu_sdpa")
    lens = torch.tensor(lengths)
    backend.init_forward_metadata(
        SimpleNamespace(
            forward_mode=ForwardMode.EXTEND,
            encoder_lens=None,
            seq_lens=lens,
            req_pool_indices=torch.arange(len(lengths)),
            extend_seq_lens=lens,
            extend_prefix_lens=torch.zeros_like(lens),
            out_cache_loc=torch.cat([req_to_token[row, :n] for row, n in enumerate(lengths)]).long(),
        )
    )
    layer = SimpleNamespace(
        layer_id=0,
        tp_q_head_num=4,
        tp_k_head_num=2,
        tp_v_head_num=2,
        qk_head_dim=8,
        v_head_dim=8,
        scaling=0.3,
        logit_cap=0.0,
        sliding_window_size=-1,
        attn_type=AttentionType.DECODER,
        is_cross_attention=False,
    )
    return backend, layer


@pytest.mark.parametrize("lengths", [[5, 5, 5], [5, 3, 4]])
def test_fresh_prefill_attends_to_its_own_kv_as_the_pool_holds_it(lengths):
    """Equal-length prefills without cached prefixes take this forward's K/V as they are (no
    padding, no gather from the pool); either way each request's output is causal attention
    over its own tokens."""
    backend, layer = prefill_backend(lengths)
    generator = torch.Generator().manual_seed(0)
    tokens = sum(lengths)
    q = torch.randn(tokens, 4, 8, generator=generator)
    k, v = torch.randn(2, tokens, 2, 8, generator=generator)
    out = backend.attend_layer(q, k, v, layer)
    gathered = backend._attend_cached(q, layer)  # the same from the pool's copies
    equal = len(set(lengths)) == 1
    assert (backend.forward_metadata.q_rows is None) == equal
    assert backend._new_are_all(backend.forward_metadata, (k, v)) == equal
    torch.testing.assert_close(out, gathered, rtol=1e-6, atol=1e-6)
    first = 0
    for length in lengths:
        rows = slice(first, first + length)
        expected = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1),
            k[rows].transpose(0, 1),
            v[rows].transpose(0, 1),
            is_causal=True,
            scale=0.3,
            enable_gqa=True,
        )
        torch.testing.assert_close(
            out[rows], expected.transpose(0, 1).reshape(length, 32), rtol=1e-5, atol=1e-5
        )
        first += length
