"""torchao quantization per TP shard: real SmolLM2-135M-Instruct on CPU, and TP=2 on a tiny Llama.

Each config's linears (fused QKV/gate-up included) hold torchao tensors on every rank,
their weight bytes shrink, and the model stays close to the unquantized one (teacher-forced
top-1 agreement over a fixed prompt set). Bad settings fail in the caller's process.
"""

from __future__ import annotations

import dataclasses

import pytest
import sglang as sgl

from sglang_hf_backend.assets import smollm2_checkpoint
from sglang_hf_backend.quantization import TorchaoConfigError
from sglang_hf_backend.testing.engines import running_engine

TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower and the Louvre museum.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)",
    "Water boils at 100 degrees Celsius at sea level, and freezes at 0 degrees.",
    "Once upon a time, a small robot lived in a quiet village by the sea.",
]
# config -> (SGLang weight type, bytes ratio bound vs bf16, top-1 agreement floor)
CONFIGS = {
    "int8wo": ("Int8Tensor", 0.55, 0.90),
    "int8dq": ("Int8Tensor", 0.55, 0.85),
    # int4 values stored unpacked in int8 on CPU: torchao 0.18 packs int4 only with GPU kernels
    "int4wo-64": ("IntxUnpackedToInt8Tensor", 0.55, 0.60),
    "fp8wo": ("Float8Tensor", 0.55, 0.85),
}


@dataclasses.dataclass
class Run:
    top1: list[int]
    greedy: list[list[int]]
    reports: list[dict]


def teacher_forced_run(engine) -> Run:
    """Top-1 prediction at every prompt position, plus a greedy continuation of each prompt."""
    outs = engine.engine.generate(
        TEXTS,
        {"temperature": 0.0, "max_new_tokens": 16},
        return_logprob=True,
        logprob_start_len=0,
        top_logprobs_num=1,
    )
    top1 = [step[0][1] for out in outs for step in out["meta_info"]["input_top_logprobs"] if step]
    return Run(top1, [o["output_ids"] for o in outs], engine.load_reports())


def agreement(a: list[int], b: list[int]) -> float:
    return sum(x == y for x, y in zip(a, b)) / len(a)


@pytest.fixture(scope="module")
def smollm2():
    return smollm2_checkpoint()


@pytest.fixture(scope="module")
def baseline(smollm2):
    with running_engine(smollm2, impl="transformers", dtype="bfloat16") as engine:
        return teacher_forced_run(engine)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_quantized_shards_stay_close(smollm2, baseline, config):
    weight_type, max_ratio, min_agreement = CONFIGS[config]
    with running_engine(smollm2, impl="transformers", dtype="bfloat16", torchao_config=config) as engine:
        run = teacher_forced_run(engine)
    (report,) = run.reports
    assert report["quantized_weight_types"] == [weight_type]
    assert report["quantized_linears"] == 30 * 4  # qkv, o, gate_up, down per layer
    ratio = report["quantized_bytes_after"] / report["quantized_bytes_before"]
    score = agreement(run.top1, baseline.top1)
    print(
        f"{config}: linear weight bytes x{ratio:.3f} of bf16, top-1 agreement {score:.3f} "
        f"over {len(baseline.top1)} positions"
    )
    assert ratio <= max_ratio
    assert score >= min_agreement


def test_tp2_quantizes_each_shard(checkpoint):
    """Each rank quantizes its own half. Column shards get the same per-row scales as TP=1;
    row-parallel shards see half of each row, so their scales (and last bits) differ."""
    path = checkpoint("llama-wide")
    texts = [{"input_ids": [(7 * i + 3 * j) % 1000 + 3 for j in range(48)]} for i in range(4)]
    runs = {}
    for tp in (1, 2):
        with running_engine(path, impl="transformers", torchao_config="int8wo", tp_size=tp) as engine:
            outs = engine.engine.generate(
                input_ids=[t["input_ids"] for t in texts],
                sampling_params={"temperature": 0.0, "max_new_tokens": 8},
                return_logprob=True,
                logprob_start_len=0,
                top_logprobs_num=1,
            )
            top1 = [step[0][1] for o in outs for step in o["meta_info"]["input_top_logprobs"] if step]
            runs[tp] = (top1, engine.load_reports())
    reports = runs[2][1]
    assert [r["tp_rank"] for r in reports] == [0, 1]
    assert all(r["quantized_weight_types"] == ["Int8Tensor"] for r in reports)
    whole = runs[1][1][0]["quantized_bytes_after"]
    assert all(abs(r["quantized_bytes_after"] / whole - 0.5) < 0.02 for r in reports)
    score = agreement(runs[2][0], runs[1][0])
    print(f"TP=2 vs TP=1 int8wo: teacher-forced top-1 agreement {score:.3f} over {len(runs[1][0])} positions")
    assert score >= 0.95


REFUSALS = {
    "unknown name lists the valid ones": (
        "transformers",
        "int3wo",
        "Unknown torchao config 'int3wo'; valid names: int8wo, int8dq",
    ),
    "config the device cannot run": (
        "transformers",
        "fp8dq-per_row",
        "'fp8dq-per_row' cannot run on this device \\(cpu",
    ),
    "group size must divide each shard": (
        "transformers",
        "int4wo-128",
        "group size 128 does not divide the 64 input features of layers.0",
    ),
    "needs the transformers implementation": ("sglang", "int8wo", "pass impl='transformers'"),
}


@pytest.mark.parametrize("model_impl, config, message", REFUSALS.values(), ids=list(REFUSALS))
def test_refused_before_start(checkpoint, model_impl, config, message):
    with pytest.raises(TorchaoConfigError, match=message):
        sgl.Engine(model_path=str(checkpoint("llama")), model_impl=model_impl, torchao_config=config)
