"""``--enable-torch-compile`` on CPU: the backbone's forward as one graph, attention inside it.

A compiled engine must give HF's greedy tokens (fp32) batched and one prompt at a time
(one graph serves both: batch-1 decode's single token and batches), and the load report
must say the step was compiled: on one rank into one graph without breaks, traced and saved
on a first start (an empty inductor cache) and loaded, without tracing, by the next start;
with TP the graph breaks at SGLang's CPU all-reduce, which dynamo cannot trace, so the step
takes torch.compile's ordinary path and is not saved. SGLang's CPU graph runner, which
``cpu_sdpa`` cannot serve, is kept out of our engines and refused up front for native ones.
"""

from __future__ import annotations

import pytest
import sglang as sgl

from sglang_hf_backend.testing.engines import engine_case, running_engine


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory) -> dict:
    """An inductor cache (and saved steps) of this module's own, empty when it starts."""
    return {"TORCHINDUCTOR_CACHE_DIR": str(tmp_path_factory.mktemp("inductor"))}


@pytest.mark.parametrize("name, tp_size", [("llama", 1), ("gemma2", 1), ("gpt2", 1), ("llama", 2)])
def test_compiled_step_matches_hf(checkpoint, compile_cache, name, tp_size):
    case = engine_case(checkpoint, name, extra_env=compile_cache, enable_torch_compile=True, tp_size=tp_size)
    assert all(report["compiled_step"] for report in case.reports) and len(case.reports) == tp_size
    if tp_size == 1:
        (report,) = case.reports
        assert (report["compiled_graphs"], report["graph_breaks"], report["compiled_step_source"]) == (
            1,
            0,
            "traced",
        )
    else:
        assert {report["compiled_step_source"] for report in case.reports} == {"traced (recompiling)"}
    assert case.batched == case.reference
    assert case.one_at_a_time == case.reference


def test_second_start_loads_the_saved_step(checkpoint, compile_cache):
    first = engine_case(checkpoint, "llama", extra_env=compile_cache, enable_torch_compile=True)
    options = dict(model_impl="transformers", enable_torch_compile=True)
    with running_engine(first.path, compile_cache, **options) as engine:
        batched, single = engine.generate_ids(first.ids), engine.generate_each(first.ids)
        (report,) = engine.load_reports()
    assert (report["compiled_graphs"], report["graph_breaks"], report["compiled_step_source"]) == (
        1,
        0,
        "loaded",
    )
    assert batched == single == first.reference


def test_native_model_with_cpu_graph_capture_is_refused(checkpoint):
    with pytest.raises(ValueError, match="cpu_sdpa does not support SGLang's CPU graph capture"):
        sgl.Engine(model_path=str(checkpoint("llama")), model_impl="sglang", enable_torch_compile=True)
