"""Where a step's time goes: our model's forward split by kind of work, and the time around it.

With ``SGLANG_HF_BACKEND_PROFILE=<dir>`` every scheduler rank times each forward of its model
and profiles every other one with torch's profiler (the unprofiled ones give the true wall
time, the profiled ones the split). Each forward becomes one JSON line in
``<dir>/rank<r>.jsonl``:

- ``gemm_ms``: self time of matmul ops outside attention;
- ``attention_ms``: every op inside the RadixAttention call (KV write, gather, SDPA), or
  inside a compiled step's C++ attention node;
- ``other_ops_ms``: every other op (norms, RoPE, activations, copies, sampling-side logits),
  a compiled step's generated kernels included;
- ``python_ms``: forward wall time (unprofiled) minus all op time: Python and dispatch;
- ``outside_ms``: time from the end of the previous forward to the start of this one
  (scheduler, sampling, detokenizer hand-off), for consecutive steps;
- ``top_ops``: the ops with the most self time and their ms, which says what a part is made of.
``scripts/profile_step.py`` runs the workloads and folds the lines into a table.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

import torch

from sglang_hf_backend.diagnostics import tp_rank

PROFILE_ENV = "SGLANG_HF_BACKEND_PROFILE"
ATTENTION_RANGE = "sglang_hf_backend.attention"
# What attention is made of: the range around a Python attention call, or a compiled step's
# C++ attention node (``csrc/step_attention.cpp``), whose KV write and kernel run inside it.
ATTENTION_SPANS = {ATTENTION_RANGE, "sglang_hf_backend_kernels::attend"}
GEMM_OPS = {
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_weight_int8pack_mm",
    "mkldnn::_linear_pointwise",  # prepacked linears (cpu_linear.py)
    "sglang_hf_backend_kernels::one_token_linear",  # their one-token fp32 product
    "sglang_hf_backend_kernels::packed_linear",  # their product (AMX kernel inline; nested oneDNN/aten ops)
    "sglang_hf_backend_kernels::packed_silu_and_mul",  # a merged gate/up's, SiLU-and-multiply included
}
# With TORCHINDUCTOR_CPP_ENABLE_KERNEL_PROFILE=1 a compiled step's generated kernels are
# recorded under names like ``graph_0_cpp_fused_add_mul_0``, or ``cpp_fused_add_mul_0`` inside
# a layer body compiled once and repeated (invoke_subgraph); they count as other ops.
INDUCTOR_KERNEL_PREFIXES = ("graph_", "cpp_fused_")
# torch's ops, our C++ kernels (cpu_kernels.py) and generated kernels; our Python custom ops
# (``sglang_hf_backend::...``) only wrap these, so their own time is dispatch.
OP_PREFIXES = ("aten::", "sglang_hf_backend_kernels::", *INDUCTOR_KERNEL_PREFIXES)
TOP_OPS = 12  # ops with the most self time, listed per profiled forward


def attention_range():
    """A profiler range around one attention call, only while a step is being profiled."""
    return (
        torch.profiler.record_function(ATTENTION_RANGE) if _PROFILER.profiling else contextlib.nullcontext()
    )


class StepProfiler:
    """Times every forward, profiles every other one, writes one JSON line per forward."""

    def __init__(self) -> None:
        self.directory = os.environ.get(PROFILE_ENV)
        self.profiling = False
        self.count = 0
        self.last_end: float | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.directory)

    @contextlib.contextmanager
    def step(self, forward_batch):
        self.count += 1
        self.profiling = self.count % 2 == 0
        started = time.perf_counter()
        outside = None if self.last_end is None else (started - self.last_end) * 1000
        profile = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
        with profile if self.profiling else contextlib.nullcontext():
            yield
        ended = time.perf_counter()
        line = {
            "step": self.count,
            "mode": forward_batch.forward_mode.name.lower(),
            "batch": int(forward_batch.batch_size),
            "tokens": int(forward_batch.input_ids.numel()),
            "wall_ms": (ended - started) * 1000,
            "outside_ms": outside,
            "profiled": self.profiling,
        }
        if self.profiling:
            line.update(split_ops(profile.events()))
        self.profiling = False
        path = Path(self.directory) / f"rank{tp_rank()}.jsonl"
        with path.open("a") as out:
            out.write(json.dumps(line) + "\n")
        # the next gap starts after this bookkeeping (reading a profile takes a while)
        self.last_end = time.perf_counter()


def split_ops(events) -> dict:
    """Self CPU time of the recorded ops (ms): matmuls, attention, everything else, and the top ops."""
    ranges = [(e.time_range.start, e.time_range.end) for e in events if e.name in ATTENTION_SPANS]
    totals = {"gemm_ms": 0.0, "attention_ms": 0.0, "other_ops_ms": 0.0}
    by_op: dict[str, float] = {}
    for event in events:
        if not (event.name.startswith(OP_PREFIXES) or event.name in GEMM_OPS):
            continue
        start = event.time_range.start
        if any(low <= start < high for low, high in ranges):
            key = "attention_ms"
        elif event.name in GEMM_OPS:
            key = "gemm_ms"
        else:
            key = "other_ops_ms"
        totals[key] += event.self_cpu_time_total / 1000
        by_op[event.name] = by_op.get(event.name, 0.0) + event.self_cpu_time_total / 1000
    totals["top_ops"] = dict(sorted(by_op.items(), key=lambda item: -item[1])[:TOP_OPS])
    return totals


_PROFILER = StepProfiler()


def profiled_step(forward_batch):
    """The forward's context: a profiled or timed step when profiling is on, else nothing
    (a hot path: nothing else is looked up when profiling is off)."""
    return _PROFILER.step(forward_batch) if _PROFILER.enabled else contextlib.nullcontext()
