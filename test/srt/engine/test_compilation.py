"""``--enable-torch-compile`` on CPU: the backbone's forward as one graph, attention inside it.

A compiled engine must give HF's greedy tokens (fp32) batched and one prompt at a time
(one graph serves both: batch-1 decode's single token and batches), and the load report
must say the step was compiled: on one rank into one graph without breaks (with TP the
graph breaks at SGLang's CPU all-reduce, which dynamo cannot trace). SGLang's CPU graph
runner, which ``cpu_sdpa`` cannot serve, is kept out of our engines and refused up front
for native ones.
"""

from __future__ import annotations

import pytest
import sglang as sgl

from sglang_hf_backend.testing.engines import engine_case


@pytest.mark.parametrize("name, tp_size", [("llama", 1), ("gemma2", 1), ("gpt2", 1), ("llama", 2)])
def test_compiled_step_matches_hf(checkpoint, name, tp_size):
    case = engine_case(checkpoint, name, enable_torch_compile=True, tp_size=tp_size)
    assert all(report["compiled_step"] for report in case.reports) and len(case.reports) == tp_size
    if tp_size == 1:
        assert (case.reports[0]["compiled_graphs"], case.reports[0]["graph_breaks"]) == (1, 0)
    assert case.batched == case.reference
    assert case.one_at_a_time == case.reference


def test_native_model_with_cpu_graph_capture_is_refused(checkpoint):
    with pytest.raises(ValueError, match="cpu_sdpa does not support SGLang's CPU graph capture"):
        sgl.Engine(model_path=str(checkpoint("llama")), model_impl="sglang", enable_torch_compile=True)
