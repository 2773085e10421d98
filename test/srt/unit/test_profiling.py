"""The step profile: ops sorted into matmuls, attention and the rest; rows folded per step class."""

from __future__ import annotations

import pytest
import torch

from sglang_hf_backend import profiling
from sglang_hf_backend.benchmark import step_profile


def test_ops_are_split_into_gemm_attention_and_other():
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        a @ b
        with torch.profiler.record_function(profiling.ATTENTION_RANGE):
            torch.softmax(a @ b, dim=-1)  # a matmul inside attention counts as attention
        a + b
    split = profiling.split_ops(profile.events())
    assert split["gemm_ms"] > 0 and split["attention_ms"] > 0 and split["other_ops_ms"] > 0
    names = {e.name for e in profile.events()}
    assert "aten::mm" in names and "aten::_softmax" in names
    top = split["top_ops"]  # the ops with the most self time, most first
    assert "aten::mm" in top and list(top.values()) == sorted(top.values(), reverse=True)
    assert sum(top.values()) <= split["gemm_ms"] + split["attention_ms"] + split["other_ops_ms"] + 1e-9


def test_packed_linears_are_gemms_and_generated_kernels_other_ops():
    from torch._inductor import config as inductor_config

    weight, x = torch.randn(64, 64), torch.randn(4, 64)  # fp32: oneDNN packs it on every x86 CPU
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
    with inductor_config.patch({"cpp.enable_kernel_profile": True}):
        elementwise = torch.compile(lambda t: t * 2 + 1)
        elementwise(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            elementwise(x)
    names = {e.name for e in profile.events()}
    assert "mkldnn::_linear_pointwise" in names
    assert any(name.startswith(profiling.INDUCTOR_KERNEL_PREFIXES) for name in names)
    split = profiling.split_ops(profile.events())
    assert split["gemm_ms"] > 0 and split["other_ops_ms"] > 0 and split["attention_ms"] == 0


def test_kernels_of_a_repeated_layer_body_are_other_ops():
    """A layer body compiled once (invoke_subgraph) names its kernels without the graph prefix."""
    import time

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with torch.profiler.record_function("cpp_fused_mul_silu_slice_4"):
            time.sleep(0.002)
    assert profiling.split_ops(profile.events())["other_ops_ms"] >= 1.5


def test_our_decode_kernel_counts_as_attention():
    from sglang_hf_backend import cpu_kernels

    assert cpu_kernels.load() is None
    query, buffer = torch.randn(2, 4, 16), torch.randn(8, 2, 16)
    index, lens = torch.arange(8).view(2, 4), torch.tensor([4, 3])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        with torch.profiler.record_function(profiling.ATTENTION_RANGE):
            torch.ops.sglang_hf_backend_kernels.paged_decode_attention(
                query, buffer, buffer, index, lens, 0.25, 0.0, -1
            )
    assert "sglang_hf_backend_kernels::paged_decode_attention" in {e.name for e in profile.events()}
    assert profiling.split_ops(profile.events())["attention_ms"] > 0


def test_a_compiled_steps_attention_node_counts_as_attention():
    """The C++ node runs its KV write and kernel inside itself, outside any Python range."""
    from sglang_hf_backend import cpu_kernels

    assert cpu_kernels.load() is None
    kernels = torch.ops.sglang_hf_backend_kernels
    buffer = torch.randn(8, 2, 16)
    kernels.begin_decode_step(
        torch.tensor([3, 7]),
        torch.arange(8).view(2, 4),
        torch.tensor([4, 4]),
        [0],
        [buffer],
        [buffer.clone()],
        [0.25],
        [0.0],
        [-1],
    )
    inputs = (torch.randn(1, 4, 2, 16), torch.randn(1, 2, 2, 16), torch.randn(1, 2, 2, 16), torch.tensor(0))
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            kernels.attend(*inputs, 4, 16)
    finally:
        kernels.end_decode_step()
    split = profiling.split_ops(profile.events())
    assert split["attention_ms"] > 0 and split["other_ops_ms"] == 0


def test_attention_range_only_while_profiling():
    assert not profiling._PROFILER.profiling
    assert not isinstance(profiling.attention_range(), torch.profiler.record_function)


def _line(step, mode, batch, profiled, wall, outside=1.0):
    line = {"step": step, "mode": mode, "batch": batch, "tokens": batch, "wall_ms": wall}
    line.update(outside_ms=outside, profiled=profiled)
    if profiled:
        line.update(gemm_ms=4.0, attention_ms=2.0, other_ops_ms=1.0)
    return line


def test_rows_take_wall_time_from_timed_steps_and_the_split_from_profiled_ones():
    lines = [_line(i, "decode", 4, i % 2 == 0, wall=10.0 + i) for i in range(1, 6)] + [
        _line(6, "extend", 4, False, wall=50.0)
    ]
    row = step_profile.fold(lines, "decode", 4)
    assert row["wall_ms"] == 13.0  # median of 11, 13, 15
    assert row["python_ms"] == 13.0 - 7.0 and row["outside_ms"] == 1.0
    with pytest.raises(RuntimeError, match="no extend steps at batch 4"):
        step_profile.fold(lines, "extend", 4)  # one step cannot be both timed and profiled


def test_bound_is_the_longer_of_weight_reads_and_flops():
    machine = step_profile.Machine(bandwidth_gb_s=10.0, gemm_gflop_s=100.0)
    size = step_profile.ModelSize(weight_bytes=10**9, body_parameters=5 * 10**8, head_parameters=0)
    assert step_profile.bound_ms(size, tokens=1, requests=1, machine=machine) == pytest.approx(100.0)
    assert step_profile.bound_ms(size, tokens=100, requests=1, machine=machine) == pytest.approx(1000.0)
