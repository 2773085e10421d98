"""Our C++ kernels against torch: paged decode attention on scattered pool slots, writes into
the pool, a compiled step's attention node, the one-token fp32 linear, and the AMX bf16 linear
on oneDNN's packed weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang_hf_backend import cpu_kernels


@pytest.fixture(scope="module")
def kernels():
    assert cpu_kernels.load() is None, "the C++ kernels must build on the project's machines"
    return torch.ops.sglang_hf_backend_kernels


@pytest.fixture(scope="module")
def paged_decode(kernels):
    return kernels.paged_decode_attention


def reference(query, k_buffer, v_buffer, kv_index, kv_len, scale, softcap, window):
    """Softmax attention over each request's first kv_len slots, in fp32, GQA by repetition."""
    group = query.shape[1] // k_buffer.shape[1]
    keys = k_buffer[kv_index].transpose(1, 2).float().repeat_interleave(group, 1)
    values = v_buffer[kv_index].transpose(1, 2).float().repeat_interleave(group, 1)
    scores = torch.einsum("bhd,bhld->bhl", query.float(), keys) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    position = torch.arange(kv_index.shape[1])[None]
    allowed = position < kv_len[:, None]
    if window >= 0:
        allowed &= position >= kv_len[:, None] - 1 - window
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("bhl,bhld->bhd", torch.softmax(scores, -1), values)


CASES = {
    # batch, heads, kv heads, head_dim, longest, soft-cap, window (SGLang's: keys back from the query)
    "gqa": (6, 9, 3, 64, 150, 0.0, -1),
    "mqa-softcap-window": (3, 4, 1, 32, 37, 50.0, 5),
    "mha-wide-window": (2, 8, 8, 128, 70, 0.0, 10),
    "one-request": (1, 6, 2, 48, 200, 0.0, -1),
    "head-dim-off-vector": (3, 4, 2, 40, 45, 0.0, -1),  # scores reduced one by one, scalar tails
    "wide-head": (2, 4, 2, 256, 33, 0.0, -1),  # bf16 pairs: eight registers a row, an odd last pair
    # bf16 pairs: a KV head's seven query heads take their values three, three and one at a time
    "seven-heads-a-kv-head": (5, 14, 2, 64, 131, 0.0, -1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(CASES))
def test_matches_attention_written_out(paged_decode, case, dtype):
    batch, heads, kv_heads, dim, longest, softcap, window = CASES[case]
    generator = torch.Generator().manual_seed(0)
    slots = 4096
    k_buffer = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    v_buffer = torch.randn(slots, kv_heads, dim, generator=generator).to(dtype)
    kv_len = torch.randint(1, longest + 1, (batch,), generator=generator)
    kv_len[0] = longest
    kv_index = torch.randperm(slots - 1, generator=generator)[: batch * longest].view(batch, longest) + 1
    # [tokens, heads, dim] as a view of [1, heads, tokens, dim], the way HF modules hand it over
    query = torch.randn(1, heads, batch, dim, generator=generator).to(dtype)[0].transpose(0, 1)
    scale = dim**-0.5
    out = paged_decode(query, k_buffer, v_buffer, kv_index, kv_len, scale, softcap, window)
    expected = reference(query, k_buffer, v_buffer, kv_index, kv_len, scale, softcap, window)
    tolerance = 2e-6 if dtype == torch.float32 else 8e-3
    assert out.dtype == dtype and out.shape == (batch, heads, dim)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_bad_inputs_are_refused(paged_decode):
    query = torch.randn(2, 4, 8)
    buffer = torch.randn(16, 3, 8)
    index, lens = torch.zeros(2, 4, dtype=torch.long), torch.ones(2, dtype=torch.long)
    with pytest.raises(RuntimeError, match="multiple of KV heads"):
        paged_decode(query, buffer, buffer, index, lens, 1.0, 0.0, -1)
    with pytest.raises(RuntimeError, match="share a dtype"):
        paged_decode(query, buffer.bfloat16(), buffer.bfloat16(), index, lens, 1.0, 0.0, -1)


@pytest.mark.parametrize("tokens", [3, 700])  # 700: split over threads
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kv_writes_rows_where_index_copy_would(kernels, tokens, dtype):
    generator = torch.Generator().manual_seed(0)
    k_buffer, v_buffer = torch.randn(2, 1024, 2, 8, generator=generator).to(dtype)
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    loc = torch.randperm(1024, generator=generator)[:tokens]
    # k with a token's heads flattened, as linears give them
    k = torch.randn(tokens, 16, generator=generator).to(dtype)
    # v a token-strided slice, as a fused QKV projection's output gives it
    v = torch.randn(tokens, 40, generator=generator).to(dtype)[:, 24:].view(tokens, 2, 8)
    kernels.store_kv(k_buffer, v_buffer, loc, k, v)
    expected_k.index_copy_(0, loc, k.view(tokens, 2, 8))
    expected_v.index_copy_(0, loc, v)
    assert torch.equal(k_buffer, expected_k) and torch.equal(v_buffer, expected_v)


def test_store_kv_refuses_slots_outside_the_pool_and_other_dtypes(kernels):
    k_buffer, v_buffer = torch.zeros(2, 8, 2, 4)
    k, v = torch.ones(2, 2, 8)
    with pytest.raises(RuntimeError, match="slot 8 is outside the pool"):
        kernels.store_kv(k_buffer, v_buffer, torch.tensor([1, 8]), k, v)
    assert not k_buffer.any()  # checked before anything is written
    with pytest.raises(RuntimeError, match="must have their buffers' dtypes"):
        kernels.store_kv(k_buffer, v_buffer, torch.tensor([1, 2]), k.bfloat16(), v)


@pytest.mark.parametrize(
    "shape, out_features, bias",
    [((1, 576), 960, True), ((1, 1, 1536), 576, False), ((37,), 7, True), ((1, 64), 4098, False)],
    ids=["qkv-bias", "3d-down", "short-rows", "odd-rows"],
)
def test_one_token_linear_matches_fp64_product(kernels, shape, out_features, bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator)
    weight = torch.randn(out_features, shape[-1], generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    out = kernels.one_token_linear(x, weight, b)
    expected = torch.nn.functional.linear(x.double(), weight.double(), None if b is None else b.double())
    assert out.dtype == torch.float32 and out.shape == (*shape[:-1], out_features)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-4)


def test_one_token_linear_refuses_more_tokens(kernels):
    with pytest.raises(RuntimeError, match="one token"):
        kernels.one_token_linear(torch.randn(2, 8), torch.randn(4, 8), None)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.one_token_linear(torch.randn(1, 8).bfloat16(), torch.randn(4, 8).bfloat16(), None)


# The AMX kernel builds where the CPU has AMX tiles with bf16 (-march=native); elsewhere it refuses,
# and on AVX2-only CPUs oneDNN cannot pack bf16 at all, so an fp32 mkldnn tensor stands in there.
HAS_AMX = torch.cpu._is_amx_tile_supported() and torch.cpu._is_avx512_bf16_supported()
NO_AMX = "without AMX-BF16"


def packed(weight):
    return torch.ops.mkldnn._reorder_linear_weight(weight, 32) if HAS_AMX else weight.float().to_mkldnn()


@pytest.mark.parametrize(
    "shape, out_features, bias",
    [
        ((1, 576), 960, True),
        ((17, 1536), 576, False),
        ((32, 896), 4864, True),
        ((2, 3, 64), 96, False),
        ((0, 64), 32, True),
    ],
    ids=["one-token-bias", "17-tokens", "32-tokens-wide", "3d", "no-tokens"],
)
def test_amx_linear_equals_torch_matmul_bit_for_bit(kernels, shape, out_features, bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=generator).to(torch.bfloat16)
    weight = torch.randn(out_features, shape[-1], generator=generator).to(torch.bfloat16)
    b = torch.randn(out_features, generator=generator).to(torch.bfloat16) if bias else None
    if not HAS_AMX:
        with pytest.raises(RuntimeError, match=NO_AMX):
            kernels.amx_packed_linear(x, weight, packed(weight), b)
        return
    out = kernels.amx_packed_linear(x, weight, packed(weight), b)
    assert out.shape == (*shape[:-1], out_features)
    assert torch.equal(out, torch.nn.functional.linear(x, weight, b))


def test_amx_layout_check_tells_the_blocked_layout_from_others(kernels):
    weight = torch.randn(96, 64).to(torch.bfloat16)
    odd = torch.randn(100, 64).to(torch.bfloat16)
    assert kernels.amx_layout_matches(weight, packed(weight)) == HAS_AMX
    assert not kernels.amx_layout_matches(weight, packed(torch.randn(96, 64).to(torch.bfloat16)))
    assert not kernels.amx_layout_matches(odd, packed(odd))
    assert not kernels.amx_layout_matches(weight, weight)


def test_amx_linear_refuses_what_it_does_not_multiply(kernels):
    weight = torch.randn(64, 64).to(torch.bfloat16)
    x = torch.randn(2, 64).to(torch.bfloat16)
    calls = {
        "up to 32 tokens, got 33": lambda: kernels.amx_packed_linear(
            torch.randn(33, 64).to(torch.bfloat16), weight, packed(weight), None
        ),
        "multiples of 32": lambda: kernels.amx_packed_linear(x, weight[:48], packed(weight[:48]), None),
        "packed weight": lambda: kernels.amx_packed_linear(x, weight, weight, None),
    }
    for message, call in calls.items():
        with pytest.raises(RuntimeError, match=message if HAS_AMX else NO_AMX):
            call()


def test_switch_is_checked(monkeypatch):
    monkeypatch.setenv(cpu_kernels.DECODE_KERNEL_ENV, "0")
    assert not cpu_kernels.decode_kernel_wanted()
    monkeypatch.setenv(cpu_kernels.DECODE_KERNEL_ENV, "on")
    with pytest.raises(ValueError, match="SGLANG_HF_BACKEND_DECODE_KERNEL='on'"):
        cpu_kernels.decode_kernel_wanted()


def test_packed_linear_refuses_a_handle_no_weight_was_registered_under(kernels):
    weight = torch.randn(64, 64)
    for handle, message in (
        (torch.tensor(10**6), "no weight was registered under handle 1000000"),
        (torch.tensor(1.0), "handle must be one int64"),
    ):
        with pytest.raises(RuntimeError, match=message):
            kernels.packed_linear(torch.randn(1, 64), weight, handle, None)
    with pytest.raises(RuntimeError, match="oneDNN's packed weight"):
        kernels.register_packed(0, weight, False, 256)


def step_attention_case(dtype=torch.float32):
    """Two requests decoding one token each (3 and 5 cached tokens with it) in layer 7's pool;
    the step's K/V come as views of [1, heads, tokens, dim], V a slice of a fused projection."""
    generator = torch.Generator().manual_seed(0)
    k_buffer, v_buffer = torch.randn(2, 12, 2, 16, generator=generator).to(dtype)
    kv_index = torch.tensor([[0, 1, 2, 0, 0], [3, 4, 5, 6, 7]])
    kv_len, loc = torch.tensor([3, 5]), torch.tensor([2, 7])
    query = torch.randn(2, 4, 16, generator=generator).to(dtype).transpose(0, 1)[None]
    key = torch.randn(2, 2, 16, generator=generator).to(dtype).transpose(0, 1)[None]
    value = torch.randn(2, 96, generator=generator).to(dtype)[:, 64:].view(2, 2, 16).transpose(0, 1)[None]
    return k_buffer, v_buffer, kv_index, kv_len, loc, query, key, value


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_step_attention_node_in_a_published_decode_step_is_the_two_kernels(kernels, dtype):
    k_buffer, v_buffer, kv_index, kv_len, loc, query, key, value = step_attention_case(dtype)
    expected_k, expected_v = k_buffer.clone(), v_buffer.clone()
    kernels.store_kv(expected_k, expected_v, loc, key[0].transpose(0, 1), value[0].transpose(0, 1))
    expected = kernels.paged_decode_attention(
        query[0].transpose(0, 1), expected_k, expected_v, kv_index, kv_len, 0.25, 0.0, -1
    ).view(1, 2, 4, 16)
    kernels.begin_decode_step(loc, kv_index, kv_len, [7], [k_buffer], [v_buffer], [0.25], [0.0], [-1])
    try:
        out = kernels.attend(query, key, value, torch.tensor(7), 4, 16)
    finally:
        kernels.end_decode_step()
    assert torch.equal(out, expected)
    assert torch.equal(k_buffer, expected_k) and torch.equal(v_buffer, expected_v)


def test_step_attention_node_hands_everything_else_to_the_python_op(kernels, monkeypatch):
    """Outside a published decode step, for a layer not published or a K/V dtype the pool does
    not hold, the node calls ``sglang_hf_backend::attend`` (which needs a running engine step:
    its lookup is replaced here by a recorder)."""
    from sglang_hf_backend import attention

    k_buffer, v_buffer, kv_index, kv_len, loc, query, key, value = step_attention_case()
    calls = []

    def recorded(module, q, k, v, forward_batch):
        calls.append((module, forward_batch))
        return q.new_zeros(1, q.shape[2], 4, 16)

    monkeypatch.setattr(attention, "attend", recorded)
    monkeypatch.setattr(attention, "_RUNNING", [attention._Step({7: "layer 7", 8: "layer 8"}, "batch")])
    kernels.attend(query, key, value, torch.tensor(7), 4, 16)  # nothing published
    kernels.begin_decode_step(loc, kv_index, kv_len, [7], [k_buffer], [v_buffer], [0.25], [0.0], [-1])
    try:
        kernels.attend(query, key, value, torch.tensor(8), 4, 16)  # another layer
        kernels.attend(query.double(), key.double(), value.double(), torch.tensor(7), 4, 16)
    finally:
        kernels.end_decode_step()
    assert calls == [("layer 7", "batch"), ("layer 8", "batch"), ("layer 7", "batch")]
    assert not k_buffer[torch.tensor([2, 7])].equal(key[0].transpose(0, 1))  # nothing written by the node


# The kernel and linear tests that run again in `test_kernels_built_for_a_narrower_vector_unit`.
KERNEL_TESTS = ["test_cpu_kernels.py", "test_cpu_linear.py", "test_cpu_attention.py"]


def test_kernels_built_for_a_narrower_vector_unit(tmp_path, narrower_capability):
    """The kernels' other code paths: built and tested again for the next narrower unit torch
    dispatches to, so a change tested on one kind of machine is checked for the other."""
    here = Path(__file__).parent
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-k", "not narrower_vector_unit"]
        + [str(here / name) for name in KERNEL_TESTS],
        # A cache of its own: the linear tests' compiles do not pass our inductor options.
        env={
            **os.environ,
            "ATEN_CPU_CAPABILITY": narrower_capability.lower(),
            "TORCHINDUCTOR_CACHE_DIR": str(tmp_path),
        },
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"capability {narrower_capability}" in run.stdout
