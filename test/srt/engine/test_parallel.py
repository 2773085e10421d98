"""Beyond one TP group: pipeline stages, data-parallel replicas and two nodes on loopback.

Every setting must give HF's greedy tokens (fp32), batched and one at a time; pipeline
stages must each hold about half the weights; a model whose layers reach across the
stack is refused before anything starts.
"""

from __future__ import annotations

import pytest
import requests
import sglang as sgl

from sglang_hf_backend.compat import IncompatibleModelError
from sglang_hf_backend.testing.engines import (
    GREEDY,
    cpu_bind_env,
    engine_case,
    hf_greedy,
    ours_server,
    prompt_ids,
)

# llama: a pp plan; gemma2: per-layer settings (sliding windows) must follow each layer to its
# stage; GPT-2 and remote code: no pp plan, the stages are inferred
PP_MODELS = ["llama", "gpt2", "gemma2", "remote"]


@pytest.mark.parametrize("name", PP_MODELS)
def test_two_pipeline_stages_match_hf(checkpoint, name):
    case = engine_case(checkpoint, name, pp_size=2)
    assert case.batched == case.reference
    assert case.one_at_a_time == case.reference
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in case.reports) == [(0, 0), (1, 0)]


def test_each_stage_holds_about_half_the_weights(checkpoint):
    whole = engine_case(checkpoint, "llama")
    staged = engine_case(checkpoint, "llama", pp_size=2)
    assert staged.batched == whole.batched
    (one_stage,) = [r["weight_bytes"] for r in whole.reports]
    assert all(r["weight_bytes"] <= 0.55 * one_stage for r in staged.reports), staged.reports


def test_tensor_parallel_inside_pipeline_stages(checkpoint):
    case = engine_case(checkpoint, "llama", tp_size=2, pp_size=2)
    assert case.batched == case.reference
    assert case.one_at_a_time == case.reference
    assert sorted((r["pp_rank"], r["tp_rank"]) for r in case.reports) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_two_data_parallel_replicas_match_hf(checkpoint):
    case = engine_case(checkpoint, "llama", dp_size=2)
    assert case.batched == case.reference
    assert case.one_at_a_time == case.reference
    assert len(case.reports) == 2  # one model per replica


@pytest.mark.parametrize(
    "name, options, reason",
    [
        ("remote-mixed", {}, "cannot be split into pipeline stages exactly: layer 0's output is also read"),
        ("llama", {"is_embedding": True}, "pipeline parallelism serves text causal LMs"),
    ],
)
def test_what_cannot_be_cut_is_refused_before_start(checkpoint, name, options, reason):
    with pytest.raises(IncompatibleModelError, match=reason):
        sgl.Engine(
            model_path=str(checkpoint(name)),
            impl="transformers",
            trust_remote_code=name.startswith("remote"),
            pp_size=2,
            **options,
        )


def test_two_nodes_on_loopback_serve_through_the_head(checkpoint, tmp_path):
    """Tensor parallel across the nodes, one rank on each: the node wiring is SGLang's and the
    same for pipeline stages, which are cut (on one node) above."""
    from sglang.srt.utils.network import get_free_port_below_ephemeral

    base = checkpoint("llama")
    ids = prompt_ids(base)
    head_address = f"127.0.0.1:{get_free_port_below_ephemeral()}"
    nodes = ["--nnodes", "2", "--dist-init-addr", head_address, "--tp-size", "2"]
    second = ours_server(
        base, tmp_path / "node1.log", *nodes, "--node-rank", "1", env=cpu_bind_env(1), wait=False
    )
    try:
        head = ours_server(base, tmp_path / "node0.log", *nodes, "--node-rank", "0", env=cpu_bind_env(1))
        try:
            body = {"input_ids": ids, "sampling_params": GREEDY}
            outs = requests.post(f"{head.url}/generate", json=body, timeout=300).json()
            assert [o["output_ids"] for o in outs] == hf_greedy(base, ids)
        finally:
            assert head.stop() == 0
    finally:
        second.stop()
