"""The cpu_sdpa attention backend: same tokens as torch_native and HF, without the request loop.

Covers decode, batched prefill of different lengths, a prefix served from the radix
cache, chunked prefill of a long prompt, mixed prefill/decode batches, sliding windows,
SGLang's native models as well as ours, and a clear error for modes it does not serve.
(Soft-capped attention, e.g. Gemma2, is checked against HF in test_causal: torch_native
does not apply soft-caps, so it is no reference there.)
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_hf_backend.cpu_attention import CpuSdpaAttnBackend
from sglang_hf_backend.testing.engines import (
    NEW_TOKENS,
    PROMPTS,
    engine_case,
    hf_greedy,
    prompt_ids,
    running_engine,
)

# (checkpoint, model_impl)
CASES = [
    ("llama", "transformers"),
    ("llama", "sglang"),
    ("mistral-swa", "transformers"),
    ("gpt_neox", "transformers"),
]


@pytest.mark.parametrize(("name", "impl"), CASES)
def test_same_tokens_as_torch_native_and_hf(checkpoint, name, impl):
    ours = engine_case(checkpoint, name, impl=impl)  # cpu_sdpa is this platform's default
    native_attention = engine_case(checkpoint, name, impl=impl, attention_backend="torch_native")
    assert ours.batched == native_attention.batched == ours.reference
    assert ours.one_at_a_time == native_attention.one_at_a_time == ours.reference


@pytest.fixture(scope="module")
def long_prompts(checkpoint):
    """A 300-token prompt, and two prompts that extend it."""
    path = checkpoint("llama")
    base = (prompt_ids(path)[1] * 40)[:300]
    return path, base, [base + [17, 42, 99], base + [5, 6]]


def test_prefix_from_radix_cache(long_prompts):
    path, base, extended = long_prompts
    with running_engine(path, impl="transformers") as engine:
        engine.engine.generate(input_ids=base, sampling_params={"temperature": 0, "max_new_tokens": 1})
        out = engine.engine.generate(
            input_ids=extended[0], sampling_params={"temperature": 0, "max_new_tokens": NEW_TOKENS}
        )
    assert out["meta_info"]["cached_tokens"] >= 256
    assert out["output_ids"] == hf_greedy(path, [extended[0]])[0]


def test_chunked_prefill_and_mixed_batches(long_prompts):
    path, base, extended = long_prompts
    short = prompt_ids(path)
    prompts = [base, *short, *extended]
    with running_engine(
        path, impl="transformers", chunked_prefill_size=64, enable_mixed_chunk=True, disable_radix_cache=True
    ) as engine:
        outputs = engine.generate_ids(prompts)
    assert outputs == hf_greedy(path, prompts)


def test_non_causal_encoder_matches_torch_native(checkpoint):
    """SGLang's native BERT marks its layers encoder-only: no causal mask."""
    path = checkpoint("bert")
    embeddings = {}
    for backend in ("cpu_sdpa", "torch_native"):
        with running_engine(path, is_embedding=True, attention_backend=backend) as engine:
            embeddings[backend] = torch.tensor(engine.engine.encode(PROMPTS[:2])[0]["embedding"])
    assert torch.allclose(embeddings["cpu_sdpa"], embeddings["torch_native"], atol=1e-5)


def test_unsupported_mode_is_refused_clearly():
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=torch.zeros(1, 8, dtype=torch.int32)),
        token_to_kv_pool=SimpleNamespace(),
        dtype=torch.float32,
    )
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(tp_rank=0):  # the backend logs its choice on rank 0
        backend = CpuSdpaAttnBackend(runner, "cpu_sdpa")

    # speculative decoding cannot run on this machine, so its batch is stood in for
    batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, encoder_lens=None)
    with pytest.raises(ValueError, match="cpu_sdpa cannot run forward mode TARGET_VERIFY.*torch_native"):
        backend.init_forward_metadata(batch)
