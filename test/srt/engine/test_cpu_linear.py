"""Prepacked linears in a served bf16 model: not one number changes against torch's matmul."""

from __future__ import annotations

from sglang_hf_backend.assets import smollm2_checkpoint
from sglang_hf_backend.benchmark.workers import prompt_ids
from sglang_hf_backend.cpu_linear import PACKED_WEIGHTS_ENV
from sglang_hf_backend.testing.engines import running_engine


def scored_run(extra_env: dict | None = None) -> tuple[list, list, dict]:
    """Greedy continuations, the logprob of every prompt and output token, and the load report."""
    with running_engine(
        smollm2_checkpoint(), extra_env=extra_env, impl="transformers", dtype="bfloat16"
    ) as engine:
        outs = engine.engine.generate(
            input_ids=prompt_ids(4, 40, 49000, seed=3),
            sampling_params={"temperature": 0.0, "max_new_tokens": 12},
            return_logprob=True,
            logprob_start_len=0,
        )
        (report,) = engine.load_reports()
    tokens = [o["output_ids"] for o in outs]
    scores = [
        [
            entry[0]
            for entry in o["meta_info"]["input_token_logprobs"][1:] + o["meta_info"]["output_token_logprobs"]
        ]
        for o in outs
    ]
    return tokens, scores, report


def test_packed_weights_give_the_plain_matmuls_numbers():
    packed_tokens, packed_scores, packed_report = scored_run()
    plain_tokens, plain_scores, plain_report = scored_run({PACKED_WEIGHTS_ENV: "0"})
    print(f"packed weights on this CPU: {packed_report['packed_weights']}")
    assert plain_report["packed_weights"] is False
    assert packed_tokens == plain_tokens
    assert packed_scores == plain_scores
