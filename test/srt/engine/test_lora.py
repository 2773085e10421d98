"""LoRA adapters through SGLang's multi-adapter serving, on our layers (fused q/k/v and gate/up).

Each engine serves two PEFT adapters (one on attention, one on the MLP); a batch mixes
both and a request without an adapter, and every request must give the tokens HF + PEFT
give for its own adapter: fused and unfused q/k/v and gate/up, GPT-2's own names (its
``transformer.h`` layers, ``c_proj`` in attention and MLP, the whole-layer ``c_attn``), TP=2.
Native SGLang runs the same case on the CPU platform's LoRA path.
"""

from __future__ import annotations

import re

import pytest

from sglang_hf_backend import assets
from sglang_hf_backend.testing.lora import build_adapter, lora_case

PER_PROMPT = ["attention", "mlp", None, "attention"]
UNFUSED = {"SGLANG_HF_BACKEND_DISABLE_FUSIONS": "qkv,mlp"}
# case -> (model, engine options); GPT-2 at TP=1 lets "--lora-target-modules all" find its linears
CASES = {
    "llama-tp1": ("llama", {}),
    "qwen3-tp1": ("qwen3", {}),
    "llama-tp2": ("llama", {"tp_size": 2}),
    "llama-unfused-tp1": ("llama", {"extra_env": UNFUSED}),
    "gpt2-tp1-all-targets": ("gpt2", {"lora_target_modules": ["all"]}),
    "gpt2-tp2": ("gpt2", {"tp_size": 2}),
    "llama-native": ("llama", {"model_impl": "sglang"}),
}
_RESULTS: dict = {}


def served(case: str, checkpoint, adapters):
    if case not in _RESULTS:
        name, options = CASES[case]
        options = {"model_impl": "transformers", "max_lora_rank": 8, **options}
        _RESULTS[case] = lora_case(checkpoint(name), adapters(name), PER_PROMPT, **options)
    return _RESULTS[case]


@pytest.mark.parametrize("case", list(CASES))
def test_mixed_adapter_batch_matches_hf_peft(case, checkpoint, adapters):
    result = served(case, checkpoint, adapters)
    assert result.batched == result.reference
    assert result.one_at_a_time == result.reference


def test_adapters_change_the_output(checkpoint, adapters):
    result = served("llama-tp1", checkpoint, adapters)
    with_adapter = [i for i, adapter in enumerate(PER_PROMPT) if adapter]
    assert all(result.reference[i] != result.base_reference[i] for i in with_adapter)
    assert result.reference[PER_PROMPT.index(None)] == result.base_reference[PER_PROMPT.index(None)]


def test_real_smollm2_adapter_matches_hf_peft(tmp_path):
    base = assets.smollm2_checkpoint()
    adapter = build_adapter(base, tmp_path / "smollm2-qv", ["q_proj", "v_proj"], seed=3)
    result = lora_case(base, {"qv": adapter}, ["qv", None], model_impl="transformers", max_lora_rank=8)
    assert result.batched == result.reference
    assert result.reference[0] != result.base_reference[0]


def test_server_loads_uses_unloads_and_refuses_adapters(checkpoint, adapters, tmp_path):
    import requests

    from sglang_hf_backend.testing.engines import GREEDY, ours_server, prompt_ids
    from sglang_hf_backend.testing.lora import hf_lora_greedy

    base = checkpoint("llama")
    attention = adapters("llama")["attention"]
    ids = prompt_ids(base)[0]
    wide = build_adapter(base, tmp_path / "rank16", ["q_proj", "v_proj"], rank=16)
    embedding = build_adapter(base, tmp_path / "embedding", ["embed_tokens", "q_proj"])
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    server = ours_server(
        base,
        tmp_path / "server.log",
        "--enable-lora",
        "--max-lora-rank",
        "8",
        "--lora-target-modules",
        *targets,
    )
    try:

        def post(path: str, body: dict) -> requests.Response:
            return requests.post(f"{server.url}{path}", json=body, timeout=120)

        def generate(adapter: str | None) -> requests.Response:
            return post("/generate", {"input_ids": ids, "sampling_params": GREEDY, "lora_path": adapter})

        assert post("/load_lora_adapter", {"lora_name": "attention", "lora_path": str(attention)}).ok
        with_adapter = hf_lora_greedy(base, attention, ids)
        assert generate("attention").json()["output_ids"] == with_adapter

        refusals = {
            "rank 16.*--max-lora-rank": {"lora_name": "wide", "lora_path": str(wide)},
            "trains \\['embed_tokens'\\]": {"lora_name": "embedding", "lora_path": str(embedding)},
            "already loaded": {"lora_name": "attention", "lora_path": str(attention)},
            "": {"lora_name": "missing", "lora_path": str(tmp_path / "no-such-adapter")},
        }
        for message, body in refusals.items():
            response = post("/load_lora_adapter", body)
            assert response.status_code == 400, response.text
            assert re.search(message, response.json()["error_message"]), response.text

        unloaded = post("/unload_lora_adapter", {"lora_name": "attention"})
        assert unloaded.ok and "attention" not in unloaded.json()["loaded_adapters"]
        never_loaded = generate("wide")
        assert never_loaded.status_code == 400 and "never been loaded" in never_loaded.text
        assert generate(None).json()["output_ids"] == hf_lora_greedy(base, None, ids)
        assert post("/load_lora_adapter", {"lora_name": "attention", "lora_path": str(attention)}).ok
        assert generate("attention").json()["output_ids"] == with_adapter
    finally:
        assert server.stop() == 0
