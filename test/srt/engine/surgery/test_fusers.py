"""Automatic fusion: fused, unfused and HF agree; fused layers run one GEMM where HF ran several.

Fused (the default) vs HF is covered by test_causal (TP=1) and test_tensor_parallel
(TP=2); here every architecture with a fusion pattern also runs with all fusions
switched off and must give the same tokens, and the profiler counts the matrix
multiplies of a forward pass. (Each fusion switching off alone is planned on meta
tensors: test/srt/unit/surgery/fusers/test_switches.py.)
"""

from __future__ import annotations

import collections
import gzip
import json

import pytest

from sglang_hf_backend.surgery.fusers import DISABLE_ENV, all_fusers
from sglang_hf_backend.testing.engines import engine_case, hf_greedy, prompt_ids, running_engine

ALL_OFF = {DISABLE_ENV: ",".join(fuser.name for fuser in all_fusers())}
# Architectures with no fusion pattern are served unfused already (test below), so their
# default runs in test_causal / test_tensor_parallel are the unfused ones.
UNFUSABLE = ["gpt_neox", "gpt2"]
# One architecture per way fusion changes the code it runs (which patterns match, which norm
# variant, remote code, packed projections); Llama-like variants fuse exactly as Llama does
# and are matched on meta tensors in test/srt/unit/surgery/fusers.
# (Llama unfused at TP=1 is the profiler test's second engine.) At TP=2 unfused projections
# take other parallel linears than fused ones: one KV head replicated by plain column shards,
# and a layout inferred for remote code.
TP1 = ["qwen3", "granite", "olmo2", "gemma2", "remote", "phi3"]
TP2 = ["llama-mqa", "remote"]


def _outputs(path, trust, extra_env, **options):
    ids = prompt_ids(path, trust)
    with running_engine(path, extra_env, impl="transformers", trust_remote_code=trust, **options) as engine:
        return ids, engine.generate_ids(ids), engine.load_reports()


@pytest.mark.parametrize("name", TP1)
def test_unfused_matches_hf(checkpoint, name):
    trust = name.startswith("remote")
    path = checkpoint(name)
    ids, unfused, reports = _outputs(path, trust, ALL_OFF)
    assert unfused == hf_greedy(path, ids, trust)
    assert not any(line.startswith("Fused") for line in reports[0]["fusions"])


@pytest.mark.parametrize("name", TP2)
def test_unfused_tp2_matches_hf(checkpoint, name):
    trust = name.startswith("remote")
    path = checkpoint(name)
    ids, unfused, _ = _outputs(path, trust, ALL_OFF, tp_size=2)
    assert unfused == hf_greedy(path, ids, trust)


def test_llama_layer_runs_four_projections(checkpoint):
    layers = engine_case(checkpoint, "llama").reports[0]["layers"]
    layer0 = sorted(name.rsplit(".", 1)[-1] for name in layers if name.startswith("layers.0."))
    assert layer0 == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]


@pytest.mark.parametrize("name", UNFUSABLE)
def test_unrecognised_patterns_are_served_unfused_and_said_so(checkpoint, name):
    case = engine_case(checkpoint, name)
    (hf_class,) = {r["hf_class"] for r in case.reports}
    assert case.reports[0]["fusions"] == [f"no fusion pattern recognised in {hf_class}; serving it unfused"]


@pytest.mark.parametrize(("extra_env", "per_layer"), [({}, 4), (ALL_OFF, 7)], ids=["fused", "unfused"])
def test_profiler_counts_gemms_per_forward(checkpoint, tmp_path, extra_env, per_layer):
    """aten::mm/addmm per forward step = per_layer x 2 layers + 1 LM head, from SGLang's profiler;
    the same engine's tokens equal HF's."""
    path = checkpoint("llama")
    ids = prompt_ids(path)
    with running_engine(path, extra_env, impl="transformers") as engine:
        assert engine.generate_ids(ids) == hf_greedy(path, ids)
        engine.engine.start_profile(output_dir=str(tmp_path), activities=["CPU"], num_steps=3)
        engine.engine.generate(
            input_ids=[[5, 6, 7, 8, 9]], sampling_params={"temperature": 0, "max_new_tokens": 8}
        )
    (trace_file,) = tmp_path.glob("*.trace.json.gz")
    events = json.load(gzip.open(trace_file))["traceEvents"]
    counts = collections.Counter(e["name"] for e in events if e.get("ph") == "X")
    forwards = sum(n for name, n in counts.items() if name.startswith("step["))  # SGLang's step spans
    gemms = counts["aten::mm"] + counts["aten::addmm"]
    assert forwards == 3
    assert gemms / forwards == per_layer * 2 + 1
