"""Prepacked linears in a model served with dtype auto: in bf16 not one number changes against
torch's matmul; in fp32 (auto's choice on CPUs without native bf16) oneDNN rounds differently,
so the tokens must agree and the logprobs stay within a bound."""

from __future__ import annotations

import torch

from sglang_hf_backend.assets import smollm2_checkpoint
from sglang_hf_backend.benchmark.workers import prompt_ids
from sglang_hf_backend.cpu_linear import PACKED_WEIGHTS_ENV
from sglang_hf_backend.platform import served_dtype
from sglang_hf_backend.testing.engines import running_engine


def scored_run(extra_env: dict | None = None) -> tuple[list, list, dict]:
    """Greedy continuations, the logprob of every prompt and output token, and the load report."""
    with running_engine(
        smollm2_checkpoint(), extra_env=extra_env, impl="transformers", dtype="auto"
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
    dtype = served_dtype("auto", str(smollm2_checkpoint()))
    print(f"packed weights on this CPU ({dtype}): {packed_report['packed_weights']}")
    assert plain_report["packed_weights"] is False
    assert packed_tokens == plain_tokens
    if dtype == "float32":
        assert packed_report["packed_weights"] is True
        gap = (torch.tensor(sum(packed_scores, [])) - torch.tensor(sum(plain_scores, []))).abs().max().item()
        print(f"fp32 packed vs plain: largest logprob difference {gap:.2e}")
        assert gap < 1e-3
    else:
        assert packed_scores == plain_scores
