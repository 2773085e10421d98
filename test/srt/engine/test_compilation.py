"""``--enable-torch-compile`` on CPU: our decoder layers compiled, attention opaque.

A compiled engine must give HF's greedy tokens (fp32) batched and one prompt at a time
(batch-1 decode runs the tokens == 1 graph, batches the dynamic one), and the load
report must say the layers were compiled. SGLang's CPU graph runner, which ``cpu_sdpa``
cannot serve, is kept out of our engines and refused up front for native ones.
"""

from __future__ import annotations

import pytest
import sglang as sgl
from transformers import AutoConfig

from sglang_hf_backend.testing.engines import engine_case


def test_compiled_layers_match_hf(checkpoint):
    case = engine_case(checkpoint, "llama", enable_torch_compile=True)
    (report,) = case.reports
    assert report["compiled_layers"] == AutoConfig.from_pretrained(case.path).num_hidden_layers
    assert case.batched == case.reference
    assert case.one_at_a_time == case.reference


def test_native_model_with_cpu_graph_capture_is_refused(checkpoint):
    with pytest.raises(ValueError, match="cpu_sdpa does not support SGLang's CPU graph capture"):
        sgl.Engine(model_path=str(checkpoint("llama")), model_impl="sglang", enable_torch_compile=True)
