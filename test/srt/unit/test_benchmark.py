"""Benchmark plumbing: implementation specs, ratios to native and to HF's faster dtype, and the
kernel scripts' interleaved timing."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_hf_backend.benchmark import report
from sglang_hf_backend.benchmark.interleaved import median_seconds
from sglang_hf_backend.benchmark.presets import PRESETS, split_impl
from sglang_hf_backend.benchmark.workers import impl_env


def test_impl_specs():
    spec = split_impl("ours+compile+cold+fp32")
    assert (spec.name, spec.engine_args, spec.dtype, spec.cold_cache) == (
        "ours",
        {"enable_torch_compile": True},
        "float32",
        True,
    )
    assert split_impl("native+torch_native").engine_args == {"attention_backend": "torch_native"}
    case = PRESETS["cpu"][0]
    assert split_impl("hf+fp32").dtype_for(case) == "float32"
    assert split_impl("hf").dtype_for(case) == case.dtype == "auto"  # what dtype="auto" serves on this CPU
    with pytest.raises(SystemExit, match="plain HF takes only a dtype"):
        split_impl("hf+compile")
    with pytest.raises(SystemExit, match="unknown implementation"):
        split_impl("vllm")


def test_cold_runs_get_empty_caches_and_builtin_loses_our_plugin(tmp_path: Path):
    cold = impl_env("ours+compile+cold", tmp_path)
    assert cold["TORCHINDUCTOR_CACHE_DIR"].startswith(str(tmp_path))
    assert cold["TORCH_EXTENSIONS_DIR"].startswith(str(tmp_path))
    assert impl_env("builtin", tmp_path)["SGLANG_PLUGINS"] == "sglang_hf_backend_cpu"
    assert impl_env("ours", tmp_path).get("SGLANG_PLUGINS") != "sglang_hf_backend_cpu"


def test_report_names_dtypes_and_gives_ratios_to_native_and_the_faster_hf():
    def stat(value):
        return {"median": value, "min": value, "max": value, "n": 1}

    summary = {
        "m": {
            "native": {"decode_step_ms": stat(100.0), "offline_output_tok_s": stat(200.0)},
            "ours": {"decode_step_ms": stat(50.0), "offline_output_tok_s": stat(400.0)},
            "hf": {"decode_step_ms": stat(80.0), "offline_output_tok_s": stat(300.0)},
            "hf+fp32": {"decode_step_ms": stat(125.0), "offline_output_tok_s": stat(160.0)},
        }
    }
    results = [
        {"model": "m", "impl": impl, "round": 0, "metrics": {"dtype": dtype}}
        for impl, dtype in [
            ("native", "float32"),
            ("ours", "float32"),
            ("hf", "bfloat16"),
            ("hf+fp32", "float32"),
        ]
    ]
    dtypes = report.served_dtypes(results)
    table = report.markdown(summary, ["native", "ours", "hf", "hf+fp32"], report.machine(), dtypes)
    assert "| dtype | float32 | float32 | bfloat16 | float32 |" in table.splitlines()
    step = next(line for line in table.splitlines() if line.startswith("| full-batch decode step"))
    throughput = next(line for line in table.splitlines() if line.startswith("| offline output"))
    assert "50.0 [50.0-50.0] (0.50x, 0.62x hf)" in step  # the faster HF step is 80 ms
    assert "400.0 [400.0-400.0] (2.00x, 1.33x hf)" in throughput  # the faster HF makes 300 tok/s
    assert "(1.25x)" in step  # HF columns get no ratio to HF


def test_interleaved_timing_warms_up_alternates_and_takes_medians():
    calls = []
    medians = median_seconds(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")},
        rounds=3,
        before_each=lambda round_: calls.append(round_),
    )
    assert calls == [0, "a", 0, "b", 1, "a", 1, "b", 2, "a", 2, "b", 3, "a", 3, "b"]
    assert set(medians) == {"a", "b"} and all(0 <= seconds < 0.1 for seconds in medians.values())
